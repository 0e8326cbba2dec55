"""A stock Trainer given `--fsdp` (FSDP2) on CPU processes and the plugin through `attach_to_trainer` (the functional
API): accelerate alone runs such a Trainer as DDP, training unsharded replicas without a word; `attach_to_trainer`
switches it to FSDP2 as `SparseTrainer` does (`cpu_fsdp.enable_cpu_fsdp2`), and `detach_from_trainer` back."""

import os
import tempfile

import pytest
import torch

from oracle import rel_rms

SEQ = 64


def _rows() -> list[dict]:
    g = torch.Generator().manual_seed(0)
    return [{"input_ids": (ids := torch.randint(3, 97, (SEQ,), generator=g)), "labels": ids} for _ in range(4)]


def _train(rank: int, world: int) -> dict:
    from torch.distributed.fsdp import FSDPModule
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    from hf_sparse_cp import SparseCPArguments, attach_to_trainer, detach_from_trainer
    from hf_sparse_cp.testing.tiny_models import tiny_config

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    results = {}
    for version in (2,) if world > 1 else (None,):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(tiny_config("llama", vocab_size=97))
        fsdp = {} if version is None else {"fsdp": True, "fsdp_config": {"fsdp_version": version}}
        with tempfile.TemporaryDirectory() as tmp:
            args = TrainingArguments(output_dir=tmp, report_to="none", use_cpu=True, max_steps=2, learning_rate=0.1,
                                     optim="sgd", per_device_train_batch_size=2 // world, logging_steps=1,
                                     save_strategy="no", **fsdp)
            trainer = Trainer(model=model, args=args, train_dataset=_rows())
            attach_to_trainer(trainer, SparseCPArguments(sparse_attention=False))
            trainer.train()
            sharded = isinstance(trainer.model_wrapped, FSDPModule)
            weights = torch.cat([getattr(v, "full_tensor", lambda v=v: v)().flatten()
                                 for v in trainer.model.state_dict().values()])
            detach_from_trainer(trainer)
            results[version] = {"sharded": sharded, "fsdp_after_detach": trainer.is_fsdp_enabled,
                                "loss": [log["loss"] for log in trainer.state.log_history if "loss" in log],
                                "weights": weights}
    return results


def test_attach_runs_a_stock_trainers_fsdp2_on_cpu_processes_as_one_process_trains():
    from hf_sparse_cp.testing.spawn import run_gloo

    (one,) = run_gloo(_train, 1, timeout_s=300)
    ranks = run_gloo(_train, 2, timeout_s=600)
    want = one[None]
    for rank in ranks:
        got = rank[2]
        assert got["sharded"] and not got["fsdp_after_detach"]
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
        assert rel_rms(got["weights"], want["weights"]) < 1e-6
