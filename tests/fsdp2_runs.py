"""A tiny Llama trained by `SparseTrainer` under FSDP2 (CP 2 and DP 2, two processes) and in one process, for tests
that compare what a Trainer under FSDP2 reports or saves with one process's (FSDP2 renames the model's class, and
the Trainer decides some things by that name)."""

import os
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from padding import pad_collate


def rows() -> list[dict]:
    """Six rows of 96 to 176 tokens, a different number of leading labels masked in each."""
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(6):
        ids = torch.randint(3, 97, (96 + 16 * i,), generator=g)
        labels = ids.clone()
        labels[: 7 * i + 3] = -100
        out.append({"input_ids": ids, "labels": labels})
    return out


@contextmanager
def fsdp2_trainer(rank: int, world: int, cp: int, fsdp_config: dict | None = None, **kwargs) -> Iterator:
    """A `SparseTrainer` of a seeded tiny Llama on `rows()[:4]` (eval: the last two) writing into a temporary
    output_dir: under FSDP2 (`fsdp_config` added to its version) at CP `cp` over `world` processes, or in one
    process; two rows a step in each layout. `kwargs`: more `SparseTrainingArguments`."""
    from transformers import AutoModelForCausalLM

    from hf_sparse_cp import SparseTrainer, SparseTrainingArguments
    from hf_sparse_cp.testing.tiny_models import tiny_config

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama", vocab_size=97))
    fsdp = {"fsdp": "full_shard", "fsdp_config": {"fsdp_version": 2, **(fsdp_config or {})}} if world > 1 else {}
    data = rows()
    with tempfile.TemporaryDirectory() as tmp:
        args = SparseTrainingArguments(
            output_dir=tmp, report_to="none", use_cpu=True, learning_rate=0.1, optim="sgd",
            per_device_train_batch_size=2 * cp // world, per_device_eval_batch_size=2, save_strategy="no",
            cp_size=cp, sparse_block_size=16, sparse_min_seq_len=64, sparse_vertical_topk=2, sparse_slash_topk=2,
            sparse_local_window=16, sparse_sink_tokens=4, **fsdp, **kwargs)
        yield SparseTrainer(model=model, args=args, train_dataset=data[:4], eval_dataset=data[4:],
                            data_collator=pad_collate)


def one_process_and_fsdp2(fn: Callable[[int, int, dict], dict]) -> tuple[dict, list[dict]]:
    """`fn(rank, world, {run name: CP size})` in one process (run "one") and on two (runs "FSDP2 CP 2" and
    "FSDP2 DP 2"): one process's result and every rank's."""
    from hf_sparse_cp.testing.spawn import run_gloo

    return (run_gloo(fn, 1, {"one": 1}, timeout_s=300)[0],
            run_gloo(fn, 2, {"FSDP2 CP 2": 2, "FSDP2 DP 2": 1}, timeout_s=600))
