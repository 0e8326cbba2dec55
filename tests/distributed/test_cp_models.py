"""Architectures under sparse context parallelism: every entry of the table of tested model types
gives, under CP 2, the logits, loss, gradients and logged kept fraction of one process; architectures it
cannot compute exactly are refused before training, naming the cause (a decoder layer the shard does not
reach, RoPE that depends on the length, token mixing outside attention), and only those."""

import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

import hf_sparse_cp
from hf_sparse_cp import SparseAttentionConfig
from hf_sparse_cp.integration.architectures import cp_tested_model_types
from hf_sparse_cp.integration.models import check_model_supports_context_parallel
from hf_sparse_cp.testing.spawn import run_gloo, run_gloo_each
from hf_sparse_cp.testing.tiny_models import tiny_config

from oracle import rel_rms

BLOCK = 16
SEQ = 135  # 9 blocks of 16, which a CP 2 split pads to 10
PATTERN = SparseAttentionConfig(block_size=BLOCK, min_seq_len=64, vertical_topk=6, slash_topk=6, sink_tokens=2,
                                local_window=8, last_q=16, dense_first_layers=0)  # the sparse path in every layer
# Sliding-window families get a window shorter than the sequence and one layer of each kind; the families with a
# learned table of positions one long enough for the test (the tiny models' 2**20 rows: 1 GiB in float64, twice
# with its gradient, per process).
OVERRIDES = {**{t: {"sliding_window": 24, "layer_types": ["sliding_attention", "full_attention"]}
                for t in ("gemma3_text", "cohere2", "gpt_oss", "granite_swa")},
             # (its sliding layers' window is config.sliding_window, which ModernBERT derives from local_attention)
             "modernbert-decoder": {"max_position_embeddings": 4 * SEQ, "local_attention": 24, "sliding_window": 12,
                                    "layer_types": ["sliding_attention", "full_attention"]},
             **{t: {"max_position_embeddings": 4 * SEQ} for t in (
                 "opt", "gpt2", "gpt_bigcode", "biogpt", "bart", "mbart", "plbart", "blenderbot", "blenderbot-small",
                 "marian", "pegasus")},
             "ctrl": {"max_position_embeddings": 4 * SEQ, "dff": 256},  # (sinusoidal positions; 8192-wide MLP)
             # Cross-layer KV sharing: Gemma 3n's last two layers attend over the keys and values of earlier layers
             # (Gemma 4's too, whose KV-shared layers the backend hands their inputs whole: `integration/kv_sharing.py`)
             **{t: {"sliding_window": 24, "num_hidden_layers": 4, "num_kv_shared_layers": 2,
                    "layer_types": ["sliding_attention", "full_attention"] * 2}
                for t in ("gemma3n_text", "gemma4_text")},
             # A no-RoPE layer and a RoPE one; the no-RoPE layer's temperature tuning scales queries by their positions
             # counted from the tensor's length (a shard's under CP), by more than 1 past floor_scale (8192 by default)
             "llama4_text": {"no_rope_layers": [0, 1], "floor_scale": 16, "attn_scale": 0.5},
             # Multi-head latent attention with values narrower than queries and keys (the engines pad them)
             "deepseek_v3": {"num_key_value_heads": 4, "qk_nope_head_dim": 32, "qk_rope_head_dim": 32, "v_head_dim": 48,
                             "kv_lora_rank": 32, "q_lora_rank": None}}


def _model(model_type: str, **overrides) -> torch.nn.Module:
    torch.manual_seed(0)
    config = tiny_config(model_type, vocab_size=97, **{**OVERRIDES.get(model_type, {}), **overrides})
    # The experts of MoE models loop in eager code: torch's grouped matmul takes no float64.
    model = AutoModelForCausalLM.from_config(config, experts_implementation="eager").double().eval()
    for module in model.modules():  # learned sinks (GPT-OSS; Granite-SWA's scale each output by sigmoid(lse - sink))
        # that change the output visibly (their init is ~0.02)
        if isinstance(getattr(module, "sinks", None), torch.nn.Parameter):
            torch.nn.init.normal_(module.sinks, 0.0, 2.0)
    hf_sparse_cp.configure(model, PATTERN)
    return model


def _registry_under_cp2(rank: int, world: int, model_types: tuple[str, ...], flags: tuple = ()) -> dict:
    """Each model type's errors under CP over the `world` ranks (2 in the table's test) with the
    `ContextParallelConfig` flags (name, value) against one process."""
    from hf_sparse_cp.distributed import ContextParallelConfig, ParallelDims, prepare_context_parallel_inputs
    from hf_sparse_cp.distributed.loss import global_mean_loss, global_num_items, rank_loss
    from hf_sparse_cp.integration.call_context import guard_context_parallel
    from hf_sparse_cp.integration.stats import pop_kept_fractions

    hf_sparse_cp.patch()
    par = ParallelDims.from_config(ContextParallelConfig(cp_size=world, **dict(flags)))
    ids = torch.randint(3, 97, (1, SEQ), generator=torch.Generator().manual_seed(1))
    results = {}
    for model_type in model_types:
        model = _model(model_type)
        check_model_supports_context_parallel(model)
        params = [p for p in model.parameters() if p.requires_grad]
        ref = model(input_ids=ids)  # the loss in float64 (transformers' own upcasts the logits to fp32)
        ref_loss = F.cross_entropy(ref.logits[0, :-1], ids[0, 1:])
        ref_grads = torch.autograd.grad(ref_loss, params, allow_unused=True)
        ref_kept = pop_kept_fractions(model)
        inputs = prepare_context_parallel_inputs({"input_ids": ids, "labels": ids}, par, block_size=BLOCK,
                                                 sparse_config=PATTERN)  # (the document plan follows it)
        targets = inputs.pop("shift_labels")
        del inputs["labels"]
        out = model(**inputs)
        loss_sum = F.cross_entropy(out.logits[0], targets[0], reduction="sum")  # -100: padding, ignored
        num_items = global_num_items(targets)
        grads = torch.autograd.grad(rank_loss(loss_sum, num_items, 1), params, allow_unused=True)
        # Each parameter's error relative to its gradient, or to a millionth of the whole gradient where its own is
        # zero but for rounding (a key projection's bias: softmax does not change when every key moves alike).
        floor = 1e-6 * torch.linalg.vector_norm(torch.stack([g.norm() for g in ref_grads if g is not None]))
        grad_error = 0.0
        for grad, ref_grad in zip(grads, ref_grads):
            if ref_grad is None:  # a parameter the batch does not reach (an expert no token was routed to)
                continue
            grad = torch.zeros_like(ref_grad) if grad is None else grad.clone()
            dist.all_reduce(grad)
            grad_error = max(grad_error, float((grad - ref_grad).norm() / torch.maximum(ref_grad.norm(), floor)))
        plan = inputs["cp_shard"].plan
        lengths = [plan.local_len_of(r) for r in range(world)]  # (unequal under the document sharding)
        local = F.pad(out.logits.detach(), (0, 0, 0, max(lengths) - out.logits.shape[1]))
        shards = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(shards, local.contiguous())
        full = plan.unshard([shard[:, :n] for shard, n in zip(shards, lengths)])[:, :SEQ]
        kept = pop_kept_fractions(model)
        results[model_type] = {
            "logits": rel_rms(full, ref.logits.detach()), "grads": grad_error,
            "loss": abs(float(global_mean_loss(loss_sum.detach(), num_items)) - float(ref_loss)) / float(ref_loss),
            "kept": max(abs(kept[i] - ref_kept[i]) for i in ref_kept), "sparse": min(ref_kept.values()) < 1.0}
    if model_types != GROUPS[0] or flags:
        return results
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


# The table in groups of a few architectures, one spawned pair each: a pair's run stays within its limit on a
# busy machine.
GROUPS = tuple(cp_tested_model_types()[i:i + 6] for i in range(0, len(cp_tested_model_types()), 6))


@functools.cache
def _group_under_cp2(group: int) -> list[dict] | Exception:
    try:
        return run_gloo(_registry_under_cp2, 2, GROUPS[group], timeout_s=1800)
    except Exception as e:  # kept, so that the group's other tests fail at once instead of running it again
        return e


def _under_cp2(model_type: str) -> list[dict]:
    results = _group_under_cp2(next(i for i, group in enumerate(GROUPS) if model_type in group))
    if isinstance(results, Exception):
        raise results
    return results


# Architectures whose own float32 computations round differently with the length of the tensor: Llama 4's router takes
# the sigmoid of its logits in float32, and torch's CPU sigmoid rounds an element of the vectorized body of a tensor
# and of its scalar tail differently (18 of 540 random values differ by one ulp); a shard's length moves elements
# between the two, so a router score can differ from one process's by one float32 ulp (2**-24 relative) while its
# logits are equal to the bit. Measured with two RoPE layers: one score of 540 one ulp apart (9.5e-8), the logits
# 4.3e-9 (rel. RMS) and the loss 2.4e-11 from one process's (with the table's layers: 4e-17). A score weights an
# expert's output, so logits and loss agree to float32's rounding: bounded by its ulp.
FLOAT32_ROUNDED = {"llama4_text": 2.0 ** -23}


@pytest.mark.parametrize("model_type", cp_tested_model_types())
def test_every_registered_architecture_equals_one_process_under_cp2(model_type):
    bound = FLOAT32_ROUNDED.get(model_type, 1e-10)
    for rank in _under_cp2(model_type):
        result = rank[model_type]
        assert result["sparse"]  # the vertical-slash path ran: a layer skipped blocks
        assert result["logits"] < bound and result["loss"] < bound, result
        # Gemma's, Cohere's and Helium's norms compute in fp32 whatever the model's dtype, so their weights' gradients
        # (sums over the tokens, split otherwise under CP) agree to fp32 rounding.
        assert result["grads"] < 1e-6, result
        assert result["kept"] < 1e-12, result  # the kept fraction counts real tokens only: no padding effect


LAYOUTS = {"zigzag": (("cp_sharding", "zigzag"),), "document": (("cp_sharding", "document"),),
           "ulysses": (("cp_mode", "ulysses"),)}
POSITION_DEPENDENT = ("gpt_oss", "llama4_text", "bart", "marian")
HYBRID = (("cp_mode", "hybrid"), ("cp_ulysses_size", 2), ("cp_sharding", "zigzag"))


@pytest.fixture(scope="module")
def position_dependent_runs():
    """{layout: per-rank results} of POSITION_DEPENDENT under every one of LAYOUTS, spawned once."""
    return run_gloo_each({name: (_registry_under_cp2, (POSITION_DEPENDENT, flags)) for name, flags in LAYOUTS.items()},
                         2, timeout_s=900)


@pytest.mark.parametrize("layout", [*LAYOUTS, "hybrid-cp4"])
def test_position_dependent_queries_sinks_and_windows_equal_one_process_under_every_cp_layout(request, layout):
    """GPT-OSS passes learned sinks (`s_aux`), which the ring applies once to each query's merged result and
    ulysses to its share of the heads; Llama 4's no-RoPE layer scales its queries by positions it counts from the
    length of the tensor it gets (a rank's shard), which the backend moves to the tokens' positions in the row
    (without it the hidden states after the first layer were 3.4e-2 from one process's); BART's and Marian's decoders
    count the positions of their learned (offset 2) or sinusoidal table from their input's length, a shard's, which
    a hook moves to the row's positions (without it the logits were 0.74 and 1.03 from one process's, striped). Under
    the shardings and
    modes besides the table's striped ring, the hybrid's heads over 2 ranks x a zigzag ring of 2 among them (with
    Gemma 3's sliding-window and global layers), the logits, loss and gradients (the sinks' among them) equal one
    process's too."""
    if layout == "hybrid-cp4":  # (4 processes: heads over 2 ranks x a zigzag ring of 2)
        model_types = (*POSITION_DEPENDENT, "gemma3_text")
        ranks = run_gloo(_registry_under_cp2, 4, model_types, HYBRID, timeout_s=600)
    else:
        model_types, ranks = POSITION_DEPENDENT, request.getfixturevalue("position_dependent_runs")[layout]
    for rank in ranks:
        for model_type in model_types:
            result, bound = rank[model_type], FLOAT32_ROUNDED.get(model_type, 1e-10)
            assert result["sparse"] and result["logits"] < bound and result["loss"] < bound, result
            assert result["grads"] < 1e-6 and result["kept"] < 1e-12, result


def test_an_attention_call_without_the_shard_during_a_cp_forward_is_an_error():
    for rank in _under_cp2(GROUPS[0][0]):
        assert "StableLmAttention (layer 0) was called without the context-parallel shard" in rank["guard"]


@pytest.mark.parametrize("model_type, overrides, cause", [
    ("stablelm", {}, "the context-parallel shard does not reach StableLmDecoderLayer"),
    ("nemotron", {}, "the context-parallel shard does not reach NemotronDecoderLayer"),
    ("llama", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}},
     "RoPE type 'dynamic'"),
    ("lfm2", {"layer_types": ["conv", "full_attention"]}, "mixes tokens outside attention \\(layer type 'conv'"),
    # (one full-attention layer: a model of linear-attention layers only does not run, in eager either)
    ("qwen3_next", {"layer_types": ["linear_attention", "full_attention"]},
     "mixes tokens outside attention \\(layer type 'linear_attention'"),
], ids=["stablelm", "nemotron", "dynamic-rope", "lfm2-conv", "qwen3next-linear-attention"])
def test_models_cp_cannot_compute_exactly_are_refused_naming_the_cause(model_type, overrides, cause):
    hf_sparse_cp.patch()
    model = _model(model_type, **overrides)
    with pytest.raises(ValueError, match=cause):
        check_model_supports_context_parallel(model)


def test_longrope_is_refused():
    hf_sparse_cp.patch()
    factors = [1.0] * 16  # head_dim 32 / 2
    rope = {"rope_type": "longrope", "short_factor": factors, "long_factor": factors,
            "original_max_position_embeddings": 64, "rope_theta": 10000.0}
    model = _model("phi3", rope_parameters=rope, max_position_embeddings=1024)
    with pytest.raises(ValueError, match="RoPE type 'longrope'"):
        check_model_supports_context_parallel(model)


def test_an_architecture_outside_the_table_that_passes_the_checks_trains_and_the_log_says_so(caplog):
    hf_sparse_cp.patch()
    model = _model("olmo")
    assert "olmo" not in cp_tested_model_types()
    with caplog.at_level("WARNING", logger="hf_sparse_cp.integration.models"):
        check_model_supports_context_parallel(model)
    assert "Model type 'olmo' is outside the architectures tested exact under context parallelism" in caplog.text


def test_the_former_opt_in_flag_is_accepted_and_says_it_does_nothing():
    from hf_sparse_cp.distributed import ContextParallelConfig

    with pytest.warns(FutureWarning, match="--cp_allow_untested_model is no longer needed"):
        ContextParallelConfig(cp_allow_untested_model=True)


def _multimodal_rope_text_models_under_cp2(rank: int, world: int) -> dict:
    """Qwen2-VL's and GLM-4V-MoE's text models under CP 2 against one process (sdpa), with packed position_ids of each
    shape they take: their hidden states' and gradients' errors, or the refusal."""
    from transformers import AutoModel

    from hf_sparse_cp.distributed import ContextParallelConfig, ParallelDims, prepare_context_parallel_inputs
    from hf_sparse_cp.integration.call_context import guard_context_parallel

    hf_sparse_cp.patch()
    par = ParallelDims.from_config(ContextParallelConfig(cp_size=world))
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6], "partial_rotary_factor": 1.0}
    keep_all = PATTERN.replace(min_seq_len=0, vertical_topk=10**4, slash_topk=10**4)  # (sdpa's attention, sparse path)
    ids = torch.randint(3, 97, (1, SEQ), generator=torch.Generator().manual_seed(1))
    text = torch.cat([torch.arange(50), torch.arange(SEQ - 50)])[None]
    shapes = [("2D", text), ("3D", text[None].expand(3, 1, SEQ)), ("4D", torch.cat([text[None], text[None] + 7] * 2))]
    results = {}
    for model_type in ("qwen2_vl_text", "glm4v_moe_text"):
        torch.manual_seed(0)
        config = tiny_config(model_type, vocab_size=97, rope_parameters=rope)
        ref = AutoModel.from_config(config, attn_implementation="sdpa", experts_implementation="eager").double()
        model = AutoModel.from_config(tiny_config(model_type, vocab_size=97, rope_parameters=rope),
                                      experts_implementation="eager").double()
        model.load_state_dict(ref.state_dict())
        hf_sparse_cp.configure(model, keep_all)
        guard_context_parallel(model)
        for name, position_ids in shapes:
            inputs = {"input_ids": ids, "position_ids": position_ids, "use_cache": False}
            hidden = ref(**inputs).last_hidden_state
            weights = torch.randn(hidden.shape, generator=torch.Generator().manual_seed(2), dtype=hidden.dtype)
            ref_grads = torch.autograd.grad((hidden * weights).sum(), list(ref.parameters()), allow_unused=True)
            local = prepare_context_parallel_inputs({"input_ids": ids, "position_ids": position_ids}, par,
                                                    block_size=BLOCK, sparse_config=keep_all)
            shard = local["cp_shard"]
            try:
                out = model(**local, use_cache=False).last_hidden_state
            except ValueError as e:
                results[model_type, name] = str(e)
                continue
            loss = (out * shard.plan.shard(weights, rank, pad_value=0.0)).sum()
            grads = torch.autograd.grad(loss, list(model.parameters()), allow_unused=True)
            errors = []
            for grad, ref_grad in zip(grads, ref_grads):
                if ref_grad is None or float(ref_grad.norm()) < 1e-9:  # (an expert no token reached)
                    continue
                grad = torch.zeros_like(ref_grad) if grad is None else grad.clone()
                dist.all_reduce(grad)
                errors.append(rel_rms(grad, ref_grad))
            results[model_type, name] = {"hidden": rel_rms(shard.whole_sequence(out.detach()), hidden.detach()),
                                         "grads": max(errors)}
    return results


def test_multimodal_rope_position_ids_pack_as_the_model_does_under_cp2():
    """Multimodal RoPE position_ids [3, B, S] and [4, B, S] (Qwen2-VL, GLM-4V) failed in the input preparation (an
    expand to [B, S]); they are sharded by row and pack by the text row of [4, B, S] ones, as transformers does. [B, S]
    restarting ones, which these models expand to their RoPE rows without packing by them while the batch was split
    into their documents, gave hidden states 0.66 (Qwen2-VL) and 0.64 (GLM-4V-MoE) from one process's; refused,
    naming the fix. (float64: GLM-4V-MoE computes some of its own steps in float32.)"""
    ranks = run_gloo(_multimodal_rope_text_models_under_cp2, 2, timeout_s=600)
    for results in ranks:
        for model_type in ("qwen2_vl_text", "glm4v_moe_text"):
            for name in ("3D", "4D"):
                errors = results[model_type, name]
                assert errors["hidden"] <= 1e-6 and errors["grads"] <= 1e-6, (model_type, name, errors)
            refusal = results[model_type, "2D"]
            assert "from its layer: the model expands the batch's restarting [batch, seq] position_ids" in refusal
            assert "position_ids of shape [4, batch, seq] with the text positions first" in refusal
