"""Architectures under sparse context parallelism: every entry of the registry of tested model types
gives, under CP 2, the logits and the logged kept fraction of one process; architectures it cannot
compute exactly are refused before training, naming the cause (a decoder layer the shard does not
reach, RoPE that depends on the length, token mixing outside attention)."""

import pytest
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

import hf_sparse_cp
from hf_sparse_cp import SparseAttentionConfig
from hf_sparse_cp.examples.tiny_model import tiny_config
from hf_sparse_cp.integration.architectures import cp_tested_model_types
from hf_sparse_cp.integration.models import check_model_supports_context_parallel
from hf_sparse_cp.testing.spawn import run_gloo

from oracle import rel_rms

BLOCK = 16
SEQ = 135  # 9 blocks of 16, which a CP 2 split pads to 10
PATTERN = SparseAttentionConfig(block_size=BLOCK, min_seq_len=64, vertical_topk=6, slash_topk=6, sink_tokens=2,
                                local_window=8, last_q=16, dense_first_layers=0)  # the sparse path in every layer
# Sliding-window families get a window shorter than the sequence and one layer of each kind.
OVERRIDES = {t: {"sliding_window": 24, "layer_types": ["sliding_attention", "full_attention"]}
             for t in ("gemma3_text", "cohere2")}


def _model(model_type: str, **overrides) -> torch.nn.Module:
    torch.manual_seed(0)
    config = tiny_config(model_type, vocab_size=97, **{**OVERRIDES.get(model_type, {}), **overrides})
    model = AutoModelForCausalLM.from_config(config).double().eval()
    hf_sparse_cp.configure(model, PATTERN)
    return model


def _registry_under_cp2(rank: int, world: int) -> dict:
    from hf_sparse_cp.distributed import ContextParallelConfig, ParallelDims, prepare_context_parallel_inputs
    from hf_sparse_cp.integration.backend import guard_context_parallel
    from hf_sparse_cp.integration.stats import pop_kept_fractions

    hf_sparse_cp.patch()
    par = ParallelDims.from_config(ContextParallelConfig(cp_size=world))
    ids = torch.randint(3, 97, (1, SEQ), generator=torch.Generator().manual_seed(1))
    results = {}
    for model_type in cp_tested_model_types():
        model = _model(model_type)
        check_model_supports_context_parallel(model)
        with torch.no_grad():
            ref = model(input_ids=ids).logits
            ref_kept = pop_kept_fractions(model)
            inputs = prepare_context_parallel_inputs({"input_ids": ids}, par, block_size=BLOCK)
            local = model(**inputs).logits
        shards = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(shards, local.contiguous())
        full = inputs["cp_shard"].plan.unshard(shards)[:, :SEQ]
        kept = pop_kept_fractions(model)
        results[model_type] = {"logits": rel_rms(full, ref), "kept": max(abs(kept[i] - ref_kept[i]) for i in ref_kept),
                               "sparse": min(ref_kept.values()) < 0.9}
    # A decoder layer that drops the shard, forced past the model check: the backend refuses the call.
    model = _model("stablelm")
    guard_context_parallel(model)
    inputs = prepare_context_parallel_inputs({"input_ids": ids}, par, block_size=BLOCK)
    try:
        model(**inputs)
        results["guard"] = "no error"
    except RuntimeError as e:
        results["guard"] = str(e)
    return results


@pytest.fixture(scope="module")
def under_cp2():
    return run_gloo(_registry_under_cp2, 2, timeout_s=600)


@pytest.mark.parametrize("model_type", cp_tested_model_types())
def test_every_registered_architecture_equals_one_process_under_cp2(under_cp2, model_type):
    for rank in under_cp2:
        result = rank[model_type]
        assert result["sparse"]  # the vertical-slash path ran
        assert result["logits"] < 1e-10, result
        assert result["kept"] < 1e-12, result  # the kept fraction counts real tokens only: no padding effect


def test_an_attention_call_without_the_shard_during_a_cp_forward_is_an_error(under_cp2):
    for rank in under_cp2:
        assert "StableLmAttention (layer 0) was called without the context-parallel shard" in rank["guard"]


@pytest.mark.parametrize("model_type, overrides, cause", [
    ("stablelm", {}, "the context-parallel shard does not reach StableLmDecoderLayer"),
    ("nemotron", {}, "the context-parallel shard does not reach NemotronDecoderLayer"),
    ("llama", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}},
     "RoPE type 'dynamic'"),
    ("lfm2", {"layer_types": ["conv", "full_attention"]}, "mixes tokens outside attention \\(layer type 'conv'"),
    ("qwen3_next", {}, "mixes tokens outside attention \\(layer type 'linear_attention'"),
], ids=["stablelm", "nemotron", "dynamic-rope", "lfm2-conv", "qwen3next-linear-attention"])
def test_models_cp_cannot_compute_exactly_are_refused_naming_the_cause(model_type, overrides, cause):
    hf_sparse_cp.patch()
    model = _model(model_type, **overrides)
    with pytest.raises(ValueError, match=cause):
        check_model_supports_context_parallel(model, allow_untested=True)


def test_longrope_is_refused():
    hf_sparse_cp.patch()
    factors = [1.0] * 16  # head_dim 32 / 2
    rope = {"rope_type": "longrope", "short_factor": factors, "long_factor": factors,
            "original_max_position_embeddings": 64, "rope_theta": 10000.0}
    model = _model("phi3", rope_parameters=rope, max_position_embeddings=1024)
    with pytest.raises(ValueError, match="RoPE type 'longrope'"):
        check_model_supports_context_parallel(model)


def test_an_untested_architecture_needs_an_explicit_opt_in():
    hf_sparse_cp.patch()
    model = _model("olmo")
    assert "olmo" not in cp_tested_model_types()
    with pytest.raises(ValueError, match="has not been tested against one process.*allow_untested=True"):
        check_model_supports_context_parallel(model)
    check_model_supports_context_parallel(model, allow_untested=True)
