"""Inputs beside the token ids under CP 2 against one process: multimodal RoPE position_ids ([3, B, S] and [4, B, S]:
one row per rotary axis, the text row first in the 4-row form) in Trainer batches (ring and Ulysses), other per-token
tensors (GPT-2's token_type_ids). Vision-language models: test_cp_vision_language_models.py."""

import copy
import os
import tempfile

import pytest
import torch

from hf_sparse_cp.testing.spawn import run_gloo_each
from hf_sparse_cp.testing.tiny_models import tiny_config

from oracle import rel_rms, trained_under

SEQ, ROWS = 256, 4
MODES = {"one": {}, "ring": {}, "ulysses": {"cp_mode": "ulysses"}}


def _compass():
    """Cohere Compass's text model: a causal LM with multimodal RoPE (sections 4 + 6 + 6 of the 16 frequencies)."""
    from transformers import AutoModelForCausalLM

    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]}
    config = tiny_config("cohere_compass_text", vocab_size=97, rope_parameters={"full_attention": rope},
                         sliding_window=1 << 20, layer_types=["full_attention"] * 2)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).double()


def _rows(rope_rows: int) -> list[dict]:
    """Rows of text whose height and width rows leave the text positions (an image's grid, then text again), with
    the text row first in the 4-row form; labels with a different number of targets per half."""
    g = torch.Generator().manual_seed(3)
    rows = []
    for i in range(ROWS):
        ids = torch.randint(3, 97, (SEQ,), generator=g)
        text = torch.arange(SEQ)
        grid = torch.where((text >= 20) & (text < 84), 20 + (text - 20) // 8 + 3 * i, text)
        position_ids = torch.stack([text, text, grid, grid + (text % 8)])[4 - rope_rows:]
        position_ids = position_ids[0] if rope_rows == 1 else position_ids  # (1: the text positions alone)
        labels = ids.clone()
        labels[: 30 * i + 10] = -100
        rows.append({"input_ids": ids, "labels": labels, "position_ids": position_ids})
    return rows


def _collate(rows: list[dict]) -> dict:
    """The default collation, with the RoPE rows first ([R, B, S], as the models take them)."""
    from transformers import default_data_collator

    batch = default_data_collator(rows)
    if batch["position_ids"].dim() == 3:
        batch["position_ids"] = batch["position_ids"].transpose(0, 1).contiguous()
    return batch


def _train(rank: int, world: int, mode: str, rope_rows: int) -> dict:
    """Two SGD steps of batch 2 through the Trainer with sparse_cp (every block kept), in one process or under CP 2:
    the losses it logs and the update of the weights."""
    from transformers import Trainer, TrainingArguments

    import hf_sparse_cp
    from hf_sparse_cp import SparseAttentionConfig
    from hf_sparse_cp.distributed import ContextParallelConfig

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    hf_sparse_cp.patch()
    model = _compass()
    hf_sparse_cp.configure(model, SparseAttentionConfig(block_size=16, min_seq_len=0, vertical_topk=10**4,
                                                        slash_topk=10**4))  # (sdpa's attention, sparse path)
    with tempfile.TemporaryDirectory() as tmp:
        args = TrainingArguments(output_dir=tmp, report_to="none", use_cpu=True, max_steps=2, learning_rate=0.5,
                                 optim="sgd", per_device_train_batch_size=2, logging_steps=1,
                                 train_sampling_strategy="sequential")
        trainer = Trainer(model=model, args=args, train_dataset=_rows(rope_rows), data_collator=_collate)
        return trained_under(trainer, ContextParallelConfig(cp_size=world, **MODES[mode]))


def _token_types(rank: int, world: int) -> dict:
    """GPT-2's logits with token_type_ids (embedded per token) under CP `world` against one process's (sdpa), for
    sequences whose shards pad (100 tokens) or hold as many positions as the sequence (32 tokens, zigzag: 4 blocks of
    16 for 2 ranks)."""
    from transformers import AutoModelForCausalLM

    import hf_sparse_cp
    from hf_sparse_cp import SparseAttentionConfig
    from hf_sparse_cp.distributed import ContextParallelConfig, ParallelDims, prepare_context_parallel_inputs
    from hf_sparse_cp.integration.call_context import guard_context_parallel

    hf_sparse_cp.patch()
    keep_all = SparseAttentionConfig(block_size=16, min_seq_len=0, vertical_topk=10**4, slash_topk=10**4)
    config = tiny_config("gpt2", vocab_size=97, max_position_embeddings=1024)
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").double().eval()
    model = copy.deepcopy(ref)
    hf_sparse_cp.configure(model, keep_all)
    guard_context_parallel(model)
    errors = {}
    for sharding, seq in (("zigzag", 32), ("striped", 100)):
        parallel = ParallelDims.from_config(ContextParallelConfig(cp_size=world, cp_sharding=sharding))
        ids = torch.randint(3, 97, (2, seq), generator=torch.Generator().manual_seed(1))
        batch = {"input_ids": ids, "token_type_ids": (torch.arange(seq) >= seq // 3).long().expand(2, seq) + 5}
        with torch.no_grad():
            full = ref(**batch).logits
            local = prepare_context_parallel_inputs(batch, parallel, block_size=16, sparse_config=keep_all)
            try:
                out = local["cp_shard"].whole_sequence(model(**local).logits)
            except RuntimeError as e:
                errors[sharding, seq] = str(e)
                continue
        errors[sharding, seq] = rel_rms(out, full)
    return errors


@pytest.fixture(scope="module")
def runs():
    calls = {(mode, rows): (_train, (mode, rows)) for mode in ("ring", "ulysses") for rows in (3, 4)}
    calls["token_types"] = (_token_types, ())
    one = run_gloo_each({**{rows: (_train, ("one", rows)) for rows in (3, 4)}, "text": (_train, ("one", 1))}, 1,
                        timeout_s=900)
    return one, run_gloo_each(calls, 2, timeout_s=1200)


@pytest.mark.parametrize("rope_rows", [3, 4])
@pytest.mark.parametrize("mode", ["ring", "ulysses"])
def test_multimodal_rope_position_ids_in_trainer_batches_under_cp2_equal_one_process(runs, mode, rope_rows):
    one, cp2 = runs
    (ref,) = one[rope_rows]
    for r in cp2[mode, rope_rows]:
        # (float64 weights, float32 losses: transformers' causal-LM loss takes the logits .float())
        assert r["logged"] == pytest.approx(ref["logged"], rel=1e-6)
        assert rel_rms(r["update"], ref["update"]) <= 1e-6, rel_rms(r["update"], ref["update"])
    # (the height and width rows matter: the update of text positions in every row is another)
    assert rel_rms(one["text"][0]["update"], ref["update"]) > 1e-3, rel_rms(one["text"][0]["update"], ref["update"])


def test_per_token_tensors_beside_the_ids_are_sharded_with_them(runs):
    """GPT-2's token_type_ids passed whole to every rank: a shard of as many positions as the sequence (zigzag, 32
    tokens) added the token types of the sequence's first positions to its tokens (logits 0.47 from one process's),
    a padded one failed in GPT-2's forward ("shape '[-1, 64]' is invalid for input of size 200"). They are sharded as
    the ids are now."""
    for errors in runs[1]["token_types"]:
        assert all(isinstance(e, float) and e <= 1e-12 for e in errors.values()), errors
