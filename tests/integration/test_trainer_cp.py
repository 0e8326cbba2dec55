"""Sparse context parallelism through the stock Trainer: the example script under torchrun (gloo).

Runs of `hf-sparse-cp train --nproc N --cp_size C` (one launched as a user launches it, which starts torchrun; the
others in processes forked as torchrun's, `run_cli`) are compared with the single-process run on the same data:
losses per step must agree to fp32 rounding, since the CP layout estimation and the ring are exact.
"""

import json
import os

import pytest
import torch
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

import hf_sparse_cp
from hf_sparse_cp.distributed import ContextParallelConfig
from hf_sparse_cp.testing.accelerate_cp import allow_parallelism_config_on_cpu, give_accelerate_cp
from hf_sparse_cp.testing.spawn import launch_cli, run_cli
from hf_sparse_cp.testing.tiny_models import tiny_config
from hf_sparse_cp.trainer.context_parallel import (
    disable_trainer_context_parallel,
    enable_trainer_context_parallel,
)

from oracle import rel_rms, trained_under

# A short job: 512-token sequences in 64-token blocks, sparse from 256 tokens on.
JOB = ["--sparse_max_length", "512", "--max_steps", "4", "--num_samples", "8", "--sparse_min_seq_len", "256",
       "--sparse_block_size", "64", "--sparse_vertical_topk", "16", "--sparse_slash_topk", "32",
       "--sparse_local_window", "32", "--sparse_sink_tokens", "4", "--sparse_last_q", "32"]


def _train(tmp_path, name: str, nproc: int, *flags: str, launch: bool = False) -> dict:
    """`hf-sparse-cp train --nproc NPROC` with the job and `flags`; its summary. Launched (torchrun) with `launch`,
    else in processes forked as torchrun's would run (`run_cli`: the run is the subject, not the launcher)."""
    summary = tmp_path / f"{name}.json"
    argv = ["train", "--nproc", str(nproc), *JOB, *flags, "--output_dir", str(tmp_path / name),
            "--summary_file", str(summary)]
    done = launch_cli(argv) if launch else run_cli(argv, nproc)
    assert done.returncode == 0, done.stderr[-4000:]
    return {**json.loads(summary.read_text()), "stderr": done.stderr}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The CP=1 run, one process, batch 1 and batch 2."""
    tmp = tmp_path_factory.mktemp("cp1")
    return {bs: _train(tmp, f"bs{bs}", 1, "--per_device_train_batch_size", str(bs)) for bs in (1, 2)}


def _assert_same_losses(run: dict, ref: dict, same_rows: bool = True, sparse_below: float = 0.95) -> None:
    """Loss per step of `run` equal to `ref`'s, and the sparse path taken: a mean kept fraction below
    `sparse_below` of the blocks dense attention computes (packed 256-token documents keep most of theirs)."""
    assert len(run["losses"]) == len(ref["losses"]) == 4
    for got, want in zip(run["losses"], ref["losses"]):
        assert abs(got - want) <= 2e-3 * abs(want), (run["losses"], ref["losses"])
    assert run["losses"][-1] < run["losses"][0]
    if same_rows:  # (with DP, the logged kept fraction is the first DP group's rows only)
        assert abs(run["mean_kept_fraction"] - ref["mean_kept_fraction"]) < 1e-6
    assert run["mean_kept_fraction"] < sparse_below  # the sparse path ran


def test_trainer_with_cp2_matches_cp1(tmp_path, reference):
    run = _train(tmp_path, "cp2", 2, "--cp_size", "2", launch=True)  # as a user launches it
    assert (run["world_size"], run["cp_size"]) == (2, 2)
    _assert_same_losses(run, reference[1])


def test_trainer_with_dp2_x_cp2_matches_one_process_with_batch_2(tmp_path, reference):
    """Four processes: two CP groups of two, each group fed its own sample (DP over groups only)."""
    run = _train(tmp_path, "dp2cp2", 4, "--cp_size", "2", "--cp_sharding", "zigzag")
    assert (run["world_size"], run["cp_size"]) == (4, 2)
    _assert_same_losses(run, reference[2], same_rows=False)


PACKED = ("--pack_documents", "2")


@pytest.fixture(scope="module")
def packed_reference(tmp_path_factory):
    return _train(tmp_path_factory.mktemp("packed"), "packed_cp1", 1, *PACKED)


def test_packed_documents_with_cp2_match_cp1(tmp_path, packed_reference):
    """DataCollatorWithFlattening packs two documents per sequence (cu_seq_lens, restarting
    position_ids); the CP shards carry the document boundaries and no attention crosses them."""
    run = _train(tmp_path, "packed_cp2", 2, "--cp_size", "2", *PACKED)
    _assert_same_losses(run, packed_reference, sparse_below=0.99)
    # the note on the batch size, once (each rank printed it)
    assert run["stderr"].count("--pack_documents 2: each device batch is 2 documents") == 1, run["stderr"][-4000:]


def test_document_sharding_with_packed_documents_cp2_matches_cp1(tmp_path, packed_reference):
    """--cp_sharding document: the planner puts each packed document whole on a rank (their K/V never
    travel); the losses and kept fractions are those of one process."""
    run = _train(tmp_path, "packed_doc_cp2", 2, "--cp_size", "2", "--cp_sharding", "document", *PACKED)
    _assert_same_losses(run, packed_reference, sparse_below=0.99)


def test_trainer_with_head_parallel_cp2_matches_cp1(tmp_path, reference):
    """--cp_mode ulysses: each rank attends the whole sequence for half of the heads."""
    run = _train(tmp_path, "ulysses2", 2, "--cp_size", "2", "--cp_mode", "ulysses")
    assert (run["world_size"], run["cp_size"]) == (2, 2)
    _assert_same_losses(run, reference[1])


def test_packed_documents_with_hybrid_2x2_under_fsdp2_match_cp1(tmp_path, packed_reference):
    """Four processes, --cp_mode hybrid: heads over pairs of ranks, the sparse ring across the pairs, the
    packed documents' boundaries kept, FSDP2 sharding the model over the four ranks."""
    fsdp = ("--fsdp", "--fsdp_config", '{"version": 2, "transformer_layer_cls_to_wrap": ["Qwen2DecoderLayer"]}')
    run = _train(tmp_path, "packed_hybrid", 4, "--cp_size", "4", "--cp_mode", "hybrid", "--cp_ulysses_size", "2",
                 *PACKED, *fsdp)
    assert (run["world_size"], run["cp_size"]) == (4, 4) and run["fsdp2_modules"] >= 3
    _assert_same_losses(run, packed_reference, sparse_below=0.99)


def test_fsdp2_trainer_with_cp2_and_smet_matches_one_process(tmp_path):
    """The Trainer's own FSDP2 (accelerate plugin, fsdp_version 2, sharded over dp_shard x cp = 2
    ranks) with sparse CP 2 and the SMET optimizer on its local shards: the single-process run's
    losses and kept fractions."""
    smet = ("--smet", "--smet_density", "0.5")
    fsdp = ("--fsdp",
            "--fsdp_config", '{"version": 2, "transformer_layer_cls_to_wrap": ["Qwen2DecoderLayer"]}')
    ref = _train(tmp_path, "smet_cp1", 1, *smet)
    run = _train(tmp_path, "smet_fsdp2_cp2", 2, "--cp_size", "2", *smet, *fsdp, "--save_steps", "4")
    _assert_same_losses(run, ref)
    # FSDP2 really sharded the model (accelerate alone would have run DDP on CPU processes): the model
    # and its two decoder layers at least are `fully_shard` modules; the final checkpoint holds the full
    # weights gathered from the shards (model.safetensors) and the training state as the ranks held it
    assert ref["fsdp2_modules"] == 0 and run["fsdp2_modules"] >= 3, run
    saved = tmp_path / "smet_fsdp2_cp2" / "checkpoint-4"
    assert (saved / "model.safetensors").is_file() and (saved / "hf_sparse_cp_sharded_state" / "layout.json").is_file()


def _trainer(tmp_path, attn: str) -> Trainer:
    hf_sparse_cp.patch()
    model = AutoModelForCausalLM.from_config(tiny_config("llama"))
    if attn == "sparse_cp":
        hf_sparse_cp.configure(model)
    args = TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True)
    return Trainer(model=model, args=args)


def test_cp_size_1_patches_nothing(tmp_path):
    trainer = _trainer(tmp_path, "sparse_cp")
    before = trainer._prepare_context_parallel_inputs
    parallel = enable_trainer_context_parallel(trainer, ContextParallelConfig(cp_size=1))
    assert parallel.cp_size == 1 and trainer._prepare_context_parallel_inputs == before


def test_cp_without_a_process_group_says_how_to_launch(tmp_path):
    trainer = _trainer(tmp_path, "sparse_cp")
    with pytest.raises(ValueError, match="runs alone: launch it with `torchrun --nproc_per_node N`"):
        enable_trainer_context_parallel(trainer, ContextParallelConfig(cp_size=2))
    disable_trainer_context_parallel(trainer)  # nothing enabled: a no-op


@pytest.fixture(scope="module")
def spawned():
    """What the Trainer tests below run in gloo processes, one after the other in one spawned process ("one") and one
    spawned pair ("cp2", under CP 2), each Trainer detached after (`run_gloo_each`): {"one" | "cp2": {name: per-rank
    results}}."""
    from hf_sparse_cp.testing.spawn import run_gloo_each

    one = {"losses": (_reported_losses, ()), "neftune": (_neftune_run, (5.0,)), "neftune off": (_neftune_run, (None,)),
           **{f"loss {name}": (_label_smoothed_run, _reference_of(*config))
              for name, config in RUNS.items() if _reference_name(name) == name}}
    cp2 = {"patch": (_patch_round_trip, ()), "losses": (_reported_losses, ()), "neftune": (_neftune_run, (5.0,)),
           **{f"loss {name}": (_label_smoothed_run, config) for name, config in RUNS.items()},
           "no_targets": (_step_without_targets_under_cp2, ()), "fsdp2": (_cpu_fsdp2_round_trip, ()),
           "accelerate_cp": (_patch_under_accelerate_cp, ())}  # (last: it sets accelerate's process-wide state)
    return {"one": run_gloo_each(one, 1, timeout_s=900), "cp2": run_gloo_each(cp2, 2, timeout_s=1200)}


def _patch_round_trip(rank: int, world: int) -> dict:
    """In a 2-process gloo group: what the patch changes on a Trainer, and that disabling restores it."""
    import tempfile

    from hf_sparse_cp.distributed import CPShard

    # what torchrun sets: the Trainer and accelerate then see the 2-process group run_gloo made
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    with tempfile.TemporaryDirectory() as tmp:
        trainer = _trainer(tmp, "sparse_cp")
        assert trainer.accelerator.num_processes == world
        names = ("_prepare_context_parallel_inputs", "get_cp_size", "floating_point_ops", "_track_num_input_tokens")
        before = [getattr(trainer, n) for n in names] + [trainer.accelerator.prepare_data_loader]
        parallel = enable_trainer_context_parallel(trainer, ContextParallelConfig(cp_size=2))
        ids = torch.arange(300).remainder(97).add(3).view(1, 300)
        batch = {"input_ids": ids, "labels": ids.clone()}
        ctx, inputs = trainer._prepare_context_parallel_inputs(trainer.model, dict(batch))
        with ctx():
            pass
        items = trainer._get_num_items_in_batch([batch], torch.device("cpu"))
        trainer.args.include_num_input_tokens_seen = "all"
        trainer._track_num_input_tokens(batch)  # every rank of the CP group holds the same 300 tokens
        counts = {"tokens": trainer.state.num_input_tokens_seen, "flops": trainer.floating_point_ops(batch),
                  "batch": trainer.get_total_train_batch_size(trainer.args)}
        patched = [getattr(trainer, n) for n in names] + [trainer.accelerator.prepare_data_loader]
        with pytest.raises(ValueError, match="already enabled"):
            enable_trainer_context_parallel(trainer, ContextParallelConfig(cp_size=2))
        disable_trainer_context_parallel(trainer)
        after = [getattr(trainer, n) for n in names] + [trainer.accelerator.prepare_data_loader]
        return {
            "cp": (parallel.cp_size, parallel.cp_rank),
            "shard": isinstance(inputs.get("cp_shard"), CPShard),
            "lens": (inputs["input_ids"].shape[1], inputs["cp_shard"].plan.local_len,
                     inputs["cp_shard"].plan.padded_len),
            "items": float(items),
            "counts": counts,
            "stock_flops": Trainer.floating_point_ops(trainer, batch),
            "per_device": trainer.args.per_device_train_batch_size,
            "changed": [a != b for a, b in zip(before, patched)],
            "restored": [a == b for a, b in zip(before, after)],
        }


def _cpu_fsdp2_round_trip(rank: int, world: int) -> dict:
    """In a 2-process gloo group: `--fsdp` with FSDP2 on CPU processes, which accelerate alone runs as DDP;
    `accelerator.prepare` then shards the model with `fully_shard`, and disabling restores DDP. An accelerate config
    of FSDP2 (its launcher's variables, no --fsdp), which ran DDP under `accelerate launch`, shards too."""
    import tempfile

    from accelerate import PartialState
    from accelerate.utils import DistributedType
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    from hf_sparse_cp.trainer.cpu_fsdp import disable_cpu_fsdp2, enable_cpu_fsdp2

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    with tempfile.TemporaryDirectory() as tmp:
        def trainer(version: int | None) -> Trainer:
            fsdp = {} if version is None else {"fsdp": True, "fsdp_config": {"fsdp_version": version}}
            args = TrainingArguments(output_dir=tmp, report_to="none", use_cpu=True, **fsdp)
            return Trainer(model=AutoModelForCausalLM.from_config(tiny_config("llama")), args=args)

        plain = enable_cpu_fsdp2(trainer(None))
        t = trainer(2)
        before = (t.accelerator.distributed_type, PartialState().distributed_type, t.is_fsdp_enabled)
        enabled = enable_cpu_fsdp2(t)
        model, _ = t.accelerator.prepare(t.model, torch.optim.AdamW(t.model.parameters()))
        # (after prepare: its optimizer wrapper builds an AcceleratorState, which copies the process state's type)
        during = (t.accelerator.distributed_type, PartialState().distributed_type, t.is_fsdp_enabled,
                  t.accelerator.is_fsdp2)
        sharded = isinstance(model, FSDPModule) and all(isinstance(p, DTensor) for p in model.parameters())
        disable_cpu_fsdp2(t)
        after = (t.accelerator.distributed_type, PartialState().distributed_type, t.is_fsdp_enabled)
        # t's Accelerator set ACCELERATE_USE_FSDP (alone, without accelerate launch's FSDP_VERSION) in this process: a
        # later Trainer without --fsdp runs DDP, not the FSDP1 of a plugin read from it (which failed on the CPU device)
        later = (os.environ.get("ACCELERATE_USE_FSDP"), enable_cpu_fsdp2(trainer(None)))
        os.environ.update(ACCELERATE_USE_FSDP="true", FSDP_VERSION="2")  # what `accelerate launch` sets
        try:
            t = trainer(None)
            from_config = enable_cpu_fsdp2(t) and t.accelerator.is_fsdp2
            disable_cpu_fsdp2(t)
        finally:
            del os.environ["ACCELERATE_USE_FSDP"], os.environ["FSDP_VERSION"]
    cpu, fsdp = DistributedType.MULTI_CPU, DistributedType.FSDP
    return {"plain": plain, "enabled": enabled, "sharded": sharded, "before": before == (cpu, cpu, False),
            "after": after == before, "during": during == (fsdp, fsdp, True, True), "from_config": from_config,
            "later": later}


def test_fsdp_flag_runs_fsdp2_on_cpu_processes_and_disable_restores_ddp(spawned):
    for r in spawned["cp2"]["fsdp2"]:
        assert r == {"plain": False, "enabled": True, "sharded": True, "before": True, "after": True, "during": True,
                     "from_config": True, "later": ("true", False)}


def _patch_under_accelerate_cp(rank: int, world: int) -> dict:
    """With accelerate owning the CP layout (a ParallelismConfig with cp_size, as on GPUs): the layout comes from
    its device mesh, its SDPA model hooks are bypassed, and its data loaders are the plugin's (sharded over the DP
    ranks, as accelerate's shard a map-style dataset, but never dispatched). Its token count is wrapped: without
    --average_tokens_across_devices it divides the CP group's count by the CP degree, a fraction that TRL's
    loss clamps to 1, and under CP the plugin hands the count in the flag's form instead."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        trainer = _trainer(tmp, "sparse_cp")
        give_accelerate_cp(trainer, cp_size=2)
        acc = trainer.accelerator
        before = (acc._prepare_cp, acc.prepare_data_loader, trainer._get_num_items_in_batch)
        parallel = enable_trainer_context_parallel(trainer, ContextParallelConfig(cp_size=1))
        model = torch.nn.Linear(2, 2)
        bypassed = acc._prepare_cp(model) == (model,) and not any(
            h for h in model._forward_pre_hooks.values())
        during = (acc._prepare_cp, acc.prepare_data_loader, trainer._get_num_items_in_batch)
        disable_trainer_context_parallel(trainer)
        after = (acc._prepare_cp, acc.prepare_data_loader, trainer._get_num_items_in_batch)
        return {"cp": (parallel.cp_size, parallel.cp_rank, parallel.cp_ranks), "bypassed": bypassed,
                "changed": [a != b for a, b in zip(before, during)],
                "restored": [a == b for a, b in zip(before, after)]}


def test_under_accelerate_cp_only_the_input_preparation_and_model_hooks_change(spawned):
    for rank, r in enumerate(spawned["cp2"]["accelerate_cp"]):
        assert r["cp"] == (2, rank, (0, 1)) and r["bypassed"]
        assert all(r["changed"]) and all(r["restored"])


def test_enable_patches_the_trainer_instance_and_disable_restores_it(spawned):
    for rank, r in enumerate(spawned["cp2"]["patch"]):
        assert r["cp"] == (2, rank) and r["shard"]
        local, planned, padded = r["lens"]
        assert local == planned == padded // 2 and padded >= 300 and padded % 128 == 0  # whole blocks, nothing cut
        assert r["items"] == 299  # 299 shifted targets, gathered from both ranks and counted once per CP group
        # the Trainer's accounting counts the group's batch once: tokens, flops, samples per step
        assert r["counts"] == {"tokens": 300, "flops": r["stock_flops"] / 2, "batch": r["per_device"]}  # DP 1
        assert all(r["changed"]) and all(r["restored"])


def _step_without_targets_under_cp2(rank: int, world: int) -> dict:
    """Two Trainer steps under CP 2 with the lean loss, the first batch without any target: the weights
    after it are the initial ones, the second step trains, nothing becomes non-finite."""
    import tempfile

    from transformers import TrainerCallback, default_data_collator

    from hf_sparse_cp import (
        SparseCPArguments,
        attach_to_trainer,
        detach_from_trainer,
        disable_lean_loss,
        enable_lean_loss,
    )

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    enable_lean_loss()
    ids = torch.arange(2 * 300).remainder(97).add(3).view(2, 300)
    rows = [{"input_ids": ids[0], "labels": torch.full((300,), -100)}, {"input_ids": ids[1], "labels": ids[1]}]
    weights = []

    class Snapshot(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):
            weights.append([p.detach().clone() for p in model.parameters()])

    torch.manual_seed(0)  # one initialization on both ranks (DDP would otherwise copy rank 0's into rank 1)
    with tempfile.TemporaryDirectory() as tmp:
        trainer = _trainer(tmp, "sparse_cp")
        trainer.args.max_steps, trainer.args.per_device_train_batch_size, trainer.args.learning_rate = 2, 1, 1e-2
        trainer.args.weight_decay, trainer.args.train_sampling_strategy = 0.0, "sequential"
        trainer.train_dataset, trainer.data_collator = rows, default_data_collator
        trainer._train_batch_size = 1
        initial = [p.detach().clone() for p in trainer.model.parameters()]
        attach_to_trainer(trainer, SparseCPArguments(sparse_attention=True), ContextParallelConfig(cp_size=2))
        trainer.add_callback(Snapshot())
        trainer.train()
        detach_from_trainer(trainer)
    disable_lean_loss()
    finite = all(bool(torch.isfinite(w).all()) for step in weights for w in step)
    unchanged = all(torch.equal(a, b) for a, b in zip(initial, weights[0]))
    trained = any(not torch.equal(a, b) for a, b in zip(weights[0], weights[1]))
    return {"finite": finite, "unchanged": unchanged, "trained": trained}


def test_a_batch_without_targets_leaves_the_weights_unchanged_under_cp2(spawned):
    for r in spawned["cp2"]["no_targets"]:
        assert r == {"finite": True, "unchanged": True, "trained": True}


def _reported_losses(rank: int, world: int) -> dict:
    """Three Trainer steps logged every two (the third is in `train_loss` only), then an evaluation of three rows
    (fewer than a gathered batch): the losses the Trainer reports, in one process or under CP 2."""
    import tempfile

    from transformers import default_data_collator

    from hf_sparse_cp import SparseCPArguments, attach_to_trainer, detach_from_trainer

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    ids = torch.arange(6 * 300).remainder(97).add(3).view(6, 300)
    labels = ids.clone()
    for i in range(6):  # a different number of targets in each half of each row
        labels[i, : 40 * i + 20] = -100
    rows = [{"input_ids": ids[i], "labels": labels[i]} for i in range(6)]
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        trainer = _trainer(tmp, "sparse_cp")
        trainer.args.max_steps, trainer.args.per_device_train_batch_size, trainer.args.learning_rate = 3, 1, 1e-2
        trainer.args.logging_steps, trainer.args.train_sampling_strategy = 2, "sequential"
        trainer.train_dataset, trainer.eval_dataset, trainer.data_collator = rows[:3], rows[3:], default_data_collator
        trainer._train_batch_size = 1
        attach_to_trainer(trainer, SparseCPArguments(sparse_attention=True), ContextParallelConfig(cp_size=world))
        result = trainer.train()
        logged = [log["loss"] for log in trainer.state.log_history if "loss" in log]
        eval_loss = trainer.evaluate()["eval_loss"]
        detach_from_trainer(trainer)
        return {"logged": logged, "train_loss": result.training_loss, "eval_loss": eval_loss}


def test_train_loss_and_eval_loss_under_cp2_are_those_of_one_process(spawned):
    """A CP rank's loss is its shard's share: the unlogged steps' part of `train_loss` and an `eval_loss` that
    `gather_for_metrics` takes from rank 0 alone are the whole batch's, as in one process."""
    (one,) = spawned["one"]["losses"]
    for r in spawned["cp2"]["losses"]:
        assert r["logged"] == pytest.approx(one["logged"], rel=1e-5)
        assert r["train_loss"] == pytest.approx(one["train_loss"], rel=1e-5)
        assert r["eval_loss"] == pytest.approx(one["eval_loss"], rel=1e-5)


def _label_smoothed_run(rank: int, world: int, cp_flags: tuple, steps: dict) -> dict:
    """Label-smoothed training (`--label_smoothing_factor 0.1`, SGD, rows with different numbers of targets in each
    half) and evaluation through the Trainer, in one process or under CP `world` with `cp_flags`: the losses it logs,
    its eval_loss, the weights after training and the layout it trained in."""
    import tempfile

    from transformers import default_data_collator
    from transformers.trainer_pt_utils import LabelSmoother

    from hf_sparse_cp import SparseCPArguments, attach_to_trainer, detach_from_trainer
    from hf_sparse_cp.integration.patching import attached_patches

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    ids = torch.arange(6 * 300).remainder(97).add(3).view(6, 300)
    labels = ids.clone()
    for i in range(6):
        labels[i, : 40 * i + 20] = -100
    rows = [{"input_ids": ids[i], "labels": labels[i]} for i in range(6)]
    torch.manual_seed(0)
    steps = dict(steps)
    unmapped = steps.pop("unmapped_model_class", False)
    with tempfile.TemporaryDirectory() as tmp:
        trainer = _trainer(tmp, "sparse_cp")
        if unmapped:  # (a class outside MODEL_FOR_CAUSAL_LM_MAPPING_NAMES: the Trainer smooths unshifted labels)
            trainer.model.__class__ = type("LlamaSubclass", (type(trainer.model),), {})
        for name, value in {"max_steps": 2, "per_device_train_batch_size": 1, "learning_rate": 0.5, "optim": "sgd",
                            "logging_steps": 1, "train_sampling_strategy": "sequential", "label_smoothing_factor": 0.1,
                            **steps}.items():  # (model_accepts_loss_kwargs: the Trainer's, not an argument)
            setattr(trainer.args if hasattr(trainer.args, name) else trainer, name, value)
        factor = trainer.args.label_smoothing_factor  # (the smoother the Trainer builds from the flag)
        trainer.label_smoother = LabelSmoother(epsilon=factor) if factor else None
        trainer.train_dataset, trainer.eval_dataset, trainer.data_collator = rows[:4], rows[4:], default_data_collator
        trainer._train_batch_size = 1
        initial = torch.cat([p.detach().flatten() for p in trainer.model.parameters()])
        flags = dict(cp_flags)
        schedule = flags.pop("cp_schedule", None)  # (a curriculum's stages: {world} is the run's CP degree)
        parallel = attach_to_trainer(trainer, SparseCPArguments(sparse_attention=True),
                                     ContextParallelConfig(cp_size=1 if schedule else world, **flags),
                                     cp_schedule=schedule and schedule.format(world=world))
        trainer.train()
        result = {"logged": [log["loss"] for log in trainer.state.log_history if "loss" in log],
                  "eval_loss": trainer.evaluate()["eval_loss"],
                  "update": torch.cat([p.detach().flatten() for p in trainer.model.parameters()]) - initial,
                  "layout": parallel.describe() if parallel.cp_size > 1 else "one process",
                  "curriculum": attached_patches(trainer, "curriculum") is not None}
        detach_from_trainer(trainer)  # (the next configuration trains a new Trainer in this process)
        return result


LABEL_SMOOTHING = {
    "striped-ga2": ((), {"gradient_accumulation_steps": 2}),
    "zigzag": ((("cp_sharding", "zigzag"),), {}),
    "ulysses": ((("cp_mode", "ulysses"),), {}),
    "document": ((("cp_sharding", "document"),), {}),
    "ga2-per-device-tokens": ((), {"gradient_accumulation_steps": 2, "average_tokens_across_devices": False}),
    "ga2-no-token-count": ((), {"gradient_accumulation_steps": 2, "model_accepts_loss_kwargs": False}),
    "cp_schedule": ((("cp_schedule", "0:256:{world}"),), {}),
    # a model class outside transformers' causal-LM mapping (a subclass of one): the Trainer smooths unshifted labels
    "unshifted-labels": ((), {"gradient_accumulation_steps": 2, "unmapped_model_class": True}),
    "unshifted-labels-no-token-count": ((), {"gradient_accumulation_steps": 2, "unmapped_model_class": True,
                                             "model_accepts_loss_kwargs": False}),
}
# Without label smoothing: a model whose forward takes no loss keywords (its own loss, a mean over its tokens)
NO_LOSS_KEYWORDS = {
    f"no-loss-keywords {name}": ((), {"gradient_accumulation_steps": 2, "model_accepts_loss_kwargs": False,
                                      "label_smoothing_factor": 0.0, **steps})
    for name, steps in (("causal-lm-class", {}), ("unmapped-class", {"unmapped_model_class": True}))}
RUNS = LABEL_SMOOTHING | NO_LOSS_KEYWORDS


def _reference_of(cp_flags: tuple, steps: dict) -> tuple:
    """The one-process run a configuration compares with: its steps, and a schedule's stages (the rows it crops)."""
    return tuple(flag for flag in cp_flags if flag[0] == "cp_schedule"), steps


def _reference_name(name: str) -> str:
    """The first configuration of RUNS whose one-process reference is `name`'s (the one that runs it)."""
    return next(other for other, config in RUNS.items() if _reference_of(*config) == _reference_of(*RUNS[name]))


@pytest.mark.parametrize("name", LABEL_SMOOTHING)
def test_label_smoothing_under_cp2_equals_one_process(spawned, name):
    """--label_smoothing_factor was refused under CP (the Trainer's smoother shifts the labels it gets, a rank's
    shard, and divides by a rank's count). Now the loss it logs, eval_loss and the weights after SGD steps (the
    gradients) equal one process's under the ring's shardings, ulysses and with gradient accumulation, whether the
    Trainer counts the batch's targets (num_items_in_batch, over all devices or per device) or not (a model whose
    forward takes no loss keywords: each micro-batch's mean), and for a model class outside transformers' causal-LM
    mapping (a subclass of one), whose labels the Trainer smooths unshifted (the loss it logged was 5.5693 under CP,
    smoothed over the shifted targets, against one process's 4.5121)."""
    _assert_cp2_equals_one_process(spawned, name)


def _assert_cp2_equals_one_process(spawned, name: str) -> None:
    (one,) = spawned["one"][f"loss {_reference_name(name)}"]
    per_rank = spawned["cp2"][f"loss {name}"]
    cp_flags = dict(RUNS[name][0])
    assert one["layout"] == "one process"
    for r in per_rank:
        assert r["logged"] == pytest.approx(one["logged"], rel=1e-5)
        assert r["eval_loss"] == pytest.approx(one["eval_loss"], rel=1e-5)
        assert rel_rms(r["update"], one["update"]) < 1e-5
        # (each configuration trained as set: the processes trained the others before it)
        assert r["layout"].startswith("CP 2 x DP 1") and r["curriculum"] == ("cp_schedule" in cp_flags), r["layout"]
        for value in {k: v for k, v in cp_flags.items() if k != "cp_schedule"}.values():
            assert value in r["layout"].lower(), (value, r["layout"])


@pytest.mark.parametrize("name", NO_LOSS_KEYWORDS)
def test_a_model_whose_forward_takes_no_loss_keywords_under_cp2_equals_one_process(spawned, name):
    """A model whose forward takes no loss keywords (`model_accepts_loss_kwargs` False: remote code without
    **kwargs) computes its loss itself, as the mean over the tokens it is given: under CP each rank's shard's, whose
    mean over the CP group is not the batch's (the logged loss 5.569465 against one process's 5.569110, the update
    1.6% off, eval_loss 5.58141 against 5.58190). The loss it logs, eval_loss and the weights after SGD steps with
    gradient accumulation now equal one process's, whatever the model's class name."""
    _assert_cp2_equals_one_process(spawned, name)


def _neftune_run(rank: int, world: int, alpha: float | None) -> dict:
    """Two SGD steps through the Trainer with NEFTune (`--neftune_noise_alpha alpha`; None: off) on rows of 300 tokens,
    in one process or under CP `world`: the losses logged and the update."""
    import tempfile

    from transformers import default_data_collator

    from hf_sparse_cp import SparseCPArguments, attach_to_trainer, detach_from_trainer

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    ids = torch.arange(4 * 300).remainder(97).add(3).view(4, 300)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        trainer = _trainer(tmp, "sparse_cp")
        for name, value in {"max_steps": 2, "per_device_train_batch_size": 2, "learning_rate": 0.5, "optim": "sgd",
                            "logging_steps": 1, "train_sampling_strategy": "sequential"}.items():
            setattr(trainer.args, name, value)
        trainer.args.neftune_noise_alpha = trainer.neftune_noise_alpha = alpha  # (what the Trainer reads from args)
        trainer.train_dataset = [{"input_ids": row, "labels": row} for row in ids]
        trainer.data_collator, trainer._train_batch_size = default_data_collator, 2
        initial = torch.cat([p.detach().flatten() for p in trainer.model.parameters()])
        attach_to_trainer(trainer, SparseCPArguments(sparse_attention=True), ContextParallelConfig(cp_size=world))
        trainer.train()
        result = {"logged": [log["loss"] for log in trainer.state.log_history if "loss" in log],
                  "update": torch.cat([p.detach().flatten() for p in trainer.model.parameters()]) - initial,
                  "alpha": trainer.neftune_noise_alpha}
        detach_from_trainer(trainer)
        result["restored"] = trainer.neftune_noise_alpha == alpha
        return result


def test_neftune_under_cp2_adds_the_noise_of_one_process(spawned):
    """transformers' NEFTune hook draws its noise in the shape of the embedded tensor, under CP a rank's shard: its
    scale was sqrt(CP) times one process's, and once scaled (the previous fix) the draws were still each shard's own,
    so the run equalled one process in distribution only (here the update 36% off after 2 steps, the first loss 5.5794
    against 5.5747). The plugin's hook draws the whole batch's noise, as one process does, and adds each rank's shard
    of it: the losses and the update are one process's, and differ from a run without NEFTune."""
    (one,), (off,) = spawned["one"]["neftune"], spawned["one"]["neftune off"]
    assert one["logged"][1] != pytest.approx(off["logged"][1], rel=1e-4)  # the noise is there
    for r in spawned["cp2"]["neftune"]:
        assert r["logged"] == pytest.approx(one["logged"], rel=1e-5)
        assert rel_rms(r["update"], one["update"]) < 1e-5
        assert r["alpha"] is None and r["restored"]  # (the Trainer's own hook kept off while attached)


class _RandomCrops(torch.utils.data.Dataset):
    """Each item a random 64-token window of one seeded document: a dataset that draws random numbers per item."""

    def __len__(self):
        return 8

    def __getitem__(self, i):
        doc = torch.arange(1024).remainder(251).add(3)
        start = int(torch.randint(0, 1024 - 64, (1,)))
        return {"input_ids": doc[start:start + 64], "labels": doc[start:start + 64]}


def _first_batch_with_a_worker(rank: int, world: int, accelerate_cp: bool) -> list[list[int]]:
    """The first batch of a CP 2 Trainer's loader with one worker: the plugin's CP group, or (`accelerate_cp`)
    accelerate's, as on GPUs."""
    import tempfile

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    hf_sparse_cp.patch()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama"))
    hf_sparse_cp.configure(model)
    with tempfile.TemporaryDirectory() as tmp:
        args = TrainingArguments(output_dir=tmp, report_to="none", use_cpu=True, per_device_train_batch_size=2,
                                 dataloader_num_workers=1, seed=0)
        trainer = Trainer(model=model, args=args, train_dataset=_RandomCrops())
        if accelerate_cp:
            give_accelerate_cp(trainer, cp_size=world)
        enable_trainer_context_parallel(trainer, ContextParallelConfig(cp_size=1 if accelerate_cp else world))
        batch = next(iter(trainer.get_train_dataloader()))
        disable_trainer_context_parallel(trainer)
    return batch["input_ids"][:, 0].tolist()


@pytest.mark.parametrize("accelerate_cp", [False, True], ids=["plugin_cp", "accelerate_cp"])
def test_the_ranks_of_a_cp_group_draw_the_same_random_numbers_in_their_data_workers(accelerate_cp):
    """The Trainer seeds its loader's workers by the process index: with --dataloader_num_workers 1 a dataset that
    crops its items at random handed the two ranks of a CP group different rows, and training stopped at its first
    batch blaming data built differently per process (it trained with the workers off). So did accelerate's own CP
    group (a ParallelismConfig with cp_size, as on GPUs), whose loaders shard over the DP ranks but seed as the
    Trainer does."""
    from hf_sparse_cp.testing.spawn import run_gloo

    first, second = run_gloo(_first_batch_with_a_worker, 2, accelerate_cp, timeout_s=300)
    assert first == second


class _Stream(torch.utils.data.IterableDataset):
    """Rows 0, 1, 2, ... in order: an iterable dataset (a streaming `datasets` one, TRL's packed iterable)."""

    def __iter__(self):
        for i in range(16):
            yield {"input_ids": torch.arange(16) + 100 * i, "labels": torch.arange(16) + 100 * i}


def _first_batch_of_a_stream_under_accelerate_cp(rank: int, world: int) -> list[int]:
    import tempfile

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    hf_sparse_cp.patch()
    model = AutoModelForCausalLM.from_config(tiny_config("llama", vocab_size=1600))  # (every id of the stream)
    hf_sparse_cp.configure(model)
    with tempfile.TemporaryDirectory() as tmp:
        args = TrainingArguments(output_dir=tmp, report_to="none", use_cpu=True, per_device_train_batch_size=2,
                                 max_steps=2)
        trainer = Trainer(model=model, args=args, train_dataset=_Stream())
        give_accelerate_cp(trainer, cp_size=world)
        enable_trainer_context_parallel(trainer, ContextParallelConfig(cp_size=1))
        batch = next(iter(trainer.get_train_dataloader()))
        disable_trainer_context_parallel(trainer)
    return batch["input_ids"][:, 0].tolist()


def test_under_accelerate_cp_the_ranks_of_a_cp_group_read_the_same_rows_of_an_iterable_dataset():
    """accelerate's loader dispatches an iterable dataset: rank 0 reads one batch per process and hands each its
    own, which under its CP group gave the two ranks of a group rows [0, 100] and [200, 300] (its device mesh shards
    only map-style datasets by the DP rank). The plugin's loader reads the stream on every rank, sharded over the DP
    ranks (here one): both ranks hold rows 0 and 1."""
    from hf_sparse_cp.testing.spawn import run_gloo

    assert run_gloo(_first_batch_of_a_stream_under_accelerate_cp, 2, timeout_s=300) == [[0, 100]] * 2


def _under_accelerates_parallelism_config(rank: int, world: int) -> dict:
    """Two SGD steps of the plugin's Trainer on 8 rows of 512 tokens, sparse from 256 on: one process with batch 2, or
    (world 4) accelerate's own layout, ParallelismConfig(dp_shard_size=2, cp_size=2) under FSDP2 with batch 1 a
    process, as `accelerate launch` with a CP recipe runs it on GPUs."""
    import tempfile

    from accelerate.parallelism_config import ParallelismConfig

    from hf_sparse_cp import SparseTrainer, SparseTrainingArguments

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama"))
    rows = torch.randint(3, 90, (8, 512), generator=torch.Generator().manual_seed(1))
    layout = {}
    if world > 1:
        allow_parallelism_config_on_cpu()
        layout = {"parallelism_config": ParallelismConfig(dp_shard_size=2, cp_size=2), "fsdp": "full_shard auto_wrap",
                  "fsdp_config": {"fsdp_version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}}
    with tempfile.TemporaryDirectory() as tmp:
        args = SparseTrainingArguments(
            output_dir=tmp, report_to="none", use_cpu=True, max_steps=2, per_device_train_batch_size=1 + (world == 1),
            logging_steps=1, optim="sgd", learning_rate=0.05, save_strategy="no", train_sampling_strategy="sequential",
            sparse_max_length=512, sparse_min_seq_len=256, sparse_block_size=64, sparse_vertical_topk=4,
            sparse_slash_topk=4, sparse_local_window=64, sparse_sink_tokens=4, sparse_last_q=32, **layout)
        trainer = SparseTrainer(model=model, args=args, train_dataset=[{"input_ids": r, "labels": r} for r in rows])
        trainer.train()
        logs = [log for log in trainer.state.log_history if "loss" in log]
        return {"losses": [log["loss"] for log in logs], "kept": [log["sparse/kept_fraction"] for log in logs],
                "cp": trainer.get_cp_size(), "sharded": trainer.is_fsdp_enabled,
                "weights": torch.cat([(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().flatten()
                                      for p in trainer.model.parameters()])}


def test_under_accelerates_fsdp2_dp2_x_cp2_training_equals_one_process():
    """accelerate's own CP group (its ParallelismConfig, the GPU recipes' path) with FSDP2 over 4 processes, DP 2 x
    CP 2: the sparse ring over its CP groups, the DP groups' halves of each batch, the losses and the weights after two
    steps are one process's on the whole batch."""
    from hf_sparse_cp.testing.spawn import run_gloo

    (one,) = run_gloo(_under_accelerates_parallelism_config, 1, timeout_s=300)
    assert one["losses"][0] != pytest.approx(one["losses"][1]) and all(0 < kept < 1 for kept in one["kept"])
    for rank in run_gloo(_under_accelerates_parallelism_config, 4, timeout_s=600):
        assert (rank["cp"], rank["sharded"]) == (2, True)
        assert rank["losses"] == pytest.approx(one["losses"], rel=1e-5) and rank["kept"] == pytest.approx(one["kept"])
        assert rel_rms(rank["weights"], one["weights"]) < 1e-5


def _dp_cp_step(rank: int, world: int, cp: int, average_tokens: bool, pick: tuple[int, ...]) -> dict:
    """One SGD step (no clipping) of batch 1 per device over `pick`'s rows, which hold different numbers of targets,
    accumulated over 4 // (world // cp) micro-batches, under CP `cp`: the loss logged and the update."""
    import tempfile

    from transformers import default_data_collator

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    ids = torch.arange(8 * 300).remainder(97).add(3).view(8, 300)
    labels = ids.clone()
    for i in range(8):
        labels[i, : 35 * i + 20] = -100
    torch.manual_seed(0)
    hf_sparse_cp.patch()
    model = AutoModelForCausalLM.from_config(tiny_config("llama"))
    hf_sparse_cp.configure(model)
    with tempfile.TemporaryDirectory() as tmp:
        # (the accumulation given to the arguments, not set after: the Trainer's accelerator takes it when built)
        args = TrainingArguments(output_dir=tmp, report_to="none", use_cpu=True, max_steps=1, learning_rate=0.5,
                                 per_device_train_batch_size=1, gradient_accumulation_steps=4 * cp // world,
                                 optim="sgd", max_grad_norm=0.0, logging_steps=1, train_sampling_strategy="sequential",
                                 average_tokens_across_devices=average_tokens)
        trainer = Trainer(model=model, args=args, train_dataset=[{"input_ids": ids[i], "labels": labels[i]}
                                                                 for i in pick], data_collator=default_data_collator)
        return trained_under(trainer, ContextParallelConfig(cp_size=cp))


@pytest.mark.parametrize("average_tokens", [True, False], ids=["tokens-over-devices", "tokens-per-device"])
def test_dp2_x_cp2_with_accumulation_and_uneven_targets_equals_one_process(average_tokens):
    """CP 2 x DP 2 with 2 accumulated micro-batches of rows holding different numbers of targets: the logged loss and
    the update are one process's, accumulating the 4 rows (the token mean over all of them), or with per-device
    counts the mean of the two DP ranks' runs (rows 0, 2 and 1, 3: each its own token mean)."""
    from hf_sparse_cp.testing.spawn import run_gloo

    if average_tokens:
        (want,) = run_gloo(_dp_cp_step, 1, 1, True, (0, 1, 2, 3), timeout_s=300)
    else:
        halves = [run_gloo(_dp_cp_step, 1, 1, False, rows, timeout_s=300)[0] for rows in ((0, 2), (1, 3))]
        want = {"logged": [sum(h["logged"][0] for h in halves) / 2], "update": sum(h["update"] for h in halves) / 2}
    for got in run_gloo(_dp_cp_step, 4, 2, average_tokens, tuple(range(8)), timeout_s=600):
        assert got["logged"] == pytest.approx(want["logged"], rel=1e-5)
        assert rel_rms(got["update"], want["update"]) < 1e-5


def _fsdp2_bf16_run(rank: int, world: int, cp: int, packed: bool) -> dict:
    """Three SGD steps of the plugin's Trainer under FSDP2 with bf16 mixed precision (`--bf16`: accelerate's policy of
    bf16 parameters, which casts each wrapped module's floating inputs) over two processes, on 512-token rows (or
    pairs of 256-token documents flattened into one, their position_ids restarting), sparse from 64 tokens on: under
    CP `cp`, or (cp 1) DP 2 given every device batch twice, so that both runs train the same rows."""
    import tempfile

    from torch.distributed.fsdp import FSDPModule
    from transformers import DataCollatorWithFlattening

    from hf_sparse_cp import SparseTrainer, SparseTrainingArguments

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    batch, length = (2, 256) if packed else (1, 512)
    ids = torch.randint(3, 90, (3 * batch, length), generator=torch.Generator().manual_seed(1))
    rows = [{"input_ids": row, "labels": row} for row in ids]
    if cp == 1:  # (accelerate hands the DP ranks consecutive device batches)
        rows = [row for i in range(0, len(rows), batch) for row in rows[i:i + batch] * 2]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama", vocab_size=97))
    with tempfile.TemporaryDirectory() as tmp:
        args = SparseTrainingArguments(
            output_dir=tmp, report_to="none", use_cpu=True, bf16=True, max_steps=3, per_device_train_batch_size=batch,
            logging_steps=1, optim="sgd", learning_rate=0.5, save_strategy="no", train_sampling_strategy="sequential",
            fsdp="full_shard auto_wrap",
            fsdp_config={"fsdp_version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}, cp_size=cp,
            sparse_max_length=512, sparse_min_seq_len=64, sparse_block_size=32, sparse_vertical_topk=8,
            sparse_slash_topk=8, sparse_local_window=32, sparse_sink_tokens=4, sparse_last_q=16)
        trainer = SparseTrainer(model=model, args=args, train_dataset=rows,
                                data_collator=DataCollatorWithFlattening() if packed else None)
        trainer.train()
        logs = [log for log in trainer.state.log_history if "loss" in log]
        return {"losses": [log["loss"] for log in logs], "grad_norms": [log["grad_norm"] for log in logs],
                "kept": [log["sparse/kept_fraction"] for log in logs], "cp": trainer.get_cp_size(),
                "sharded": isinstance(trainer.model_wrapped, FSDPModule),
                "param_dtype": trainer.accelerator.state.fsdp_plugin.mixed_precision_policy.param_dtype,
                "weights": torch.cat([p.full_tensor().detach().float().flatten() for p in trainer.model.parameters()])}


@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed-documents"])
def test_cp2_under_fsdp2_bf16_mixed_precision_trains_as_dp_does(packed):
    """CP 2 under FSDP2 with bf16 mixed precision (the GPU recipes' configuration, whose input cast copies every
    dataclass and floating tensor among a forward's inputs at each wrapped module): the losses, grad norms and weights
    after three steps are those of DP 2 in the same precision on the same rows, to bf16's rounding of the sharded
    forward (measured: losses within 1e-5, grad norms 3e-4, weights 1e-4 relative; the sparse pattern may keep a
    block more or less, 0.7444 against 0.74196 at one step). One process under bf16 autocast is 2e-3 off in the loss,
    as much with sdpa: FSDP2's bf16 parameters against autocast's fp32 ones, not CP."""
    from hf_sparse_cp.testing.spawn import run_gloo

    want = run_gloo(_fsdp2_bf16_run, 2, 1, packed, timeout_s=300)[0]
    assert want["cp"] == 1 and all(0 < kept < (0.99 if packed else 0.9) for kept in want["kept"][1:]), want["kept"]
    for got in run_gloo(_fsdp2_bf16_run, 2, 2, packed, timeout_s=300):
        assert (got["cp"], got["sharded"], got["param_dtype"]) == (2, True, torch.bfloat16)
        assert got["losses"] == pytest.approx(want["losses"], rel=1e-4)
        assert got["grad_norms"] == pytest.approx(want["grad_norms"], rel=2e-3)
        assert rel_rms(got["weights"], want["weights"]) < 1e-3
