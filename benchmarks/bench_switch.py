"""The curriculum's online CP switch against two chained jobs, as users run them (4 gloo processes, FSDP2).

A context-length curriculum (`--cp_schedule "0:L1:1,N:L2:2"`, `hf_sparse_cp/trainer/curriculum.py`)
trains steps 1..N on L1-token samples at CP 1 x DP 4, then L2-token samples at CP 2 x DP 2, in one
Trainer run; at constant world size every FSDP2 shard stays where it is. The alternative a user has
is two jobs: the first trains stage 1 and saves a checkpoint at step N (the plugin's FSDP2 sharded
save, `resharding/resume.py`), then fresh processes resume it into stage 2. Each run is the example's
Trainer (`hf-sparse-cp train`'s `build_trainer`) launched by torchrun as `hf-sparse-cp train --nproc 4`
launches it, with `--fsdp` FSDP2 on CPU and a step clock (a TrainerCallback) in every process:

* `online`: one run of max_steps steps. Its switch costs the boundary interval (from the end of
  step N to the end of step N+1, the first step of stage 2, as the last rank sees them) plus what the
  curriculum builds up front for stage 2 (its CP and DP process groups, `ParallelDims.from_config`,
  timed again in the same processes after training). Against it: the stage-2 steady step (median
  interval of steps N+2..max_steps) and the peak RSS of the boundary interval beyond the largest
  peak of any steady interval of either stage (glibc's default malloc; per-interval peaks through
  /proc/self/clear_refs), against one rank's shard of the training state (weights and AdamW moments).
* `chain`: the same command with `--save_strategy steps --save_steps N`, stopped once the step-N
  checkpoint is saved; when its torchrun returns, the same command with `--resume_from_checkpoint
  .../checkpoint-N` in fresh processes, stopped after step N+1. Timed end to end, from the end of
  step N in the first job to the end of step N+1 in the second: save (and the Trainer's end of
  training), exit (process teardown), restart (torchrun, interpreters, imports), build (arguments,
  process group, data, model, SparseTrainer), prepare + load (FSDP2 wrapping, optimizer, the sharded
  load), first step (the data skip and step N+1). Its step N+1 must reproduce the online run's loss.

Both sides contain one stage-2 step; chain / switch says how many times faster the switch is. Target (issue
#17, restated for what users run): the online switch >= 20x faster than the chained jobs, with peak
extra memory <= one rank's shard.

    python benchmarks/bench_switch.py                           # tiny and small, 3 repeats each
    python benchmarks/bench_switch.py --models tiny --repeats 1
"""

from __future__ import annotations

import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent / "results"
WORKER = "--worker"  # first argument of the script when torchrun starts it as a training process


@dataclass(frozen=True)
class Preset:
    """A model and its two stages: the tiny demo model (no model folder), or a random-init model of
    `config` (`testing.tiny_models.tiny_config` fields), saved as a bf16 model folder with the byte tokenizer
    and trained from it with `--model_name_or_path`, as a pretrained model is."""

    lengths: tuple[int, int]  # tokens per sample in stage 1 (CP 1) and stage 2 (CP 2)
    layer: str  # the decoder layer class FSDP2 wraps
    config: dict | None = None


PRESETS = {
    "tiny": Preset((256, 512), "Qwen2DecoderLayer"),  # the demo's model: 2 layers, hidden 128, byte vocabulary
    "small": Preset((128, 256), "Qwen2DecoderLayer", dict(  # 39M parameters, Qwen2-shaped
        model_type="qwen2", vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
        num_attention_heads=8, num_key_value_heads=2, head_dim=64)),
}
# The pattern of both presets, sized so that their lengths run sparse (the demo's own starts at 1024 tokens).
PATTERN = ("--sparse_block_size", "32", "--sparse_min_seq_len", "128", "--sparse_vertical_topk", "8",
           "--sparse_slash_topk", "8", "--sparse_local_window", "32", "--sparse_sink_tokens", "4",
           "--sparse_last_q", "16", "--sparse_dense_first_layers", "0")


@dataclass
class BenchSwitchArguments:
    models: list[str] = field(default_factory=lambda: list(PRESETS), metadata={"help": f"Of {list(PRESETS)}."})
    world: int = field(default=4, metadata={"help": "Processes (even: stage 2 runs CP 2)."})
    switch_step: int = field(default=3, metadata={
        "help": "N: stage 2 starts after step N (step 1 warms up; steps 2..N are stage 1's steady steps)."})
    max_steps: int = field(default=6, metadata={
        "help": "Steps of the online run: N+1 is the boundary, N+2.. the stage-2 steady steps."})
    repeats: int = field(default=3, metadata={
        "help": "Online runs and chains per model, alternately (medians over them)."})
    output: str | None = field(default=None, metadata={"help": "JSON path (default: benchmarks/results/...)."})


# ---- in each training process ----


def _worker(role: str, stop_at: int, report: str, flags: list[str]) -> None:
    """One training process of `role` (online, save, resume): the example's Trainer with a step clock,
    stopped after step `stop_at` (0: run to max_steps); its times and peaks go to `report`-RANK.json."""
    import dataclasses

    import torch.distributed as dist
    from transformers import TrainerCallback

    from hf_sparse_cp.distributed import CP_SHARD_KWARG, ParallelDims
    from hf_sparse_cp.examples.train_long_context import build_trainer, parse_args
    from hf_sparse_cp.resharding.resume import training_state
    from hf_sparse_cp.testing.benchmarking import peak_rss
    from hf_sparse_cp.trainer.schedule import parse_schedule

    out = {"role": role, "imported": time.time(), "start_peak_rss": peak_rss(), "step_end": {}, "peak_rss": {},
           "loss": {}, "cp_size": {}}

    class StepClock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            out["train_begin"] = time.time()
            out["prepare_peak_rss"] = peak_rss()

        def on_step_end(self, args, state, control, **kwargs):
            out["step_end"][state.global_step] = time.time()
            out["peak_rss"][state.global_step] = peak_rss()  # of the interval since the step before
            if state.global_step == stop_at:
                control.should_training_stop = True

        def on_log(self, args, state, control, logs=None, **kwargs):
            if "loss" in (logs or {}):
                out["loss"][state.global_step] = logs["loss"]

    script, training, *_ = parse_args(flags)
    trainer = build_trainer(script, training, callbacks=[StepClock()])
    out["built"] = time.time()

    def seen(module, args, kwargs):  # the CP degree each training forward runs at, by the step it belongs to
        shard = kwargs.get(CP_SHARD_KWARG)
        out["cp_size"][trainer.state.global_step + 1] = 1 if shard is None else shard.parallel.cp_size

    trainer.model.register_forward_pre_hook(seen, with_kwargs=True)
    trainer.train(resume_from_checkpoint=training.resume_from_checkpoint)
    out["trained"] = time.time()
    out["end_peak_rss"] = peak_rss()  # since the last step: a saving job's save
    state = training_state(trainer.model, trainer.optimizer)
    out["state_bytes"] = sum(t.to_local().nbytes if hasattr(t, "to_local") else t.nbytes for t in state.values())
    out["parameters"] = sum(p.numel() for p in trainer.model.parameters())
    if role == "online":  # what the curriculum built up front for the later stages, built again
        stages = parse_schedule(training.cp_schedule)
        later = sorted({s.cp_size for s in stages} - {stages[0].cp_size})
        dist.barrier()
        start = time.perf_counter()
        for cp in later:
            ParallelDims.from_config(dataclasses.replace(training.context_parallel_config(), cp_size=cp))
        dist.barrier()
        out["stage_groups_s"] = time.perf_counter() - start
    Path(f"{report}-{dist.get_rank()}.json").write_text(json.dumps(out))


# ---- the parent: launches, phases, report ----


def train_flags(name: str, switch_step: int, max_steps: int, output_dir: Path, model_dir: Path | None) -> list[str]:
    """The flags of `hf-sparse-cp train` for preset `name`'s online run (the chain adds its own)."""
    preset = PRESETS[name]
    first, second = preset.lengths
    fsdp_config = json.dumps({"fsdp_version": 2, "transformer_layer_cls_to_wrap": [preset.layer]})
    flags = ["--model_name_or_path", str(model_dir)] if model_dir else []
    return [*flags, "--sparse_max_length", str(second), "--num_samples", "16", "--cp_schedule",
            f"0:{first}:1,{switch_step}:{second}:2", "--max_steps", str(max_steps), "--per_device_train_batch_size",
            "1", "--learning_rate", "2e-3", "--lr_scheduler_type", "constant", "--logging_steps", "1",
            "--report_to", "none", "--save_strategy", "no", *PATTERN, "--fsdp",
            "--fsdp_config", fsdp_config, "--output_dir", str(output_dir)]


def _save_model_folder(name: str, folder: Path) -> Path | None:
    """Preset `name`'s random-init model and the byte tokenizer, saved where `--model_name_or_path` reads
    them (None for the demo's own model)."""
    config = PRESETS[name].config
    if config is None:
        return None
    import torch
    from transformers import AutoModelForCausalLM

    from hf_sparse_cp.examples.tokenizer import byte_tokenizer
    from hf_sparse_cp.testing.tiny_models import tiny_config

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_config(**config)).to(torch.bfloat16).save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    return folder


def _launch(world: int, role: str, stop_at: int, report: Path, flags: list[str]) -> tuple[float, float, list[dict]]:
    """Run `role`'s processes under torchrun; (launched, returned) wall-clock times and each rank's record."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for name in ("WORLD_SIZE", "GLIBC_TUNABLES"):  # (a launch of its own, with glibc's default malloc)
        env.pop(name, None)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
               str(Path(__file__).resolve()), WORKER, role, str(stop_at), str(report), *flags]
    launched = time.time()
    proc = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    returned = time.time()
    if proc.returncode:
        raise RuntimeError(f"the {role} job failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return launched, returned, [json.loads(Path(f"{report}-{r}.json").read_text()) for r in range(world)]


def _last(ranks: list[dict], key: str, step: int | None = None) -> float:
    """When the last rank reached `key` (at `step`)."""
    return max(r[key] if step is None else r[key][str(step)] for r in ranks)


def _steady_peak(ranks: list[dict], steps) -> list[int]:
    return [max(r["peak_rss"][str(s)] for s in steps) for r in ranks]


def measure_once(world: int, switch_step: int, max_steps: int, flags: list[str], workdir: Path) -> dict:
    """One online run and one chain; the phases in seconds and the peaks in bytes (see the docstring)."""
    n = switch_step
    _, _, online = _launch(world, "online", 0, workdir / "online", flags)
    steps = {k: _last(online, "step_end", k) - _last(online, "step_end", k - 1) for k in range(2, max_steps + 1)}
    steady = [k for k in steps if k != n + 1]
    boundary_extra = max(r["peak_rss"][str(n + 1)] - p for r, p in zip(online, _steady_peak(online, steady)))
    chain_dir = workdir / "chain"
    chained = [*flags, "--output_dir", str(chain_dir), "--save_strategy", "steps", "--save_steps", str(n)]
    _, saved_at, first = _launch(world, "save", n, workdir / "save", chained)
    resume = [*chained, "--resume_from_checkpoint", str(chain_dir / f"checkpoint-{n}")]
    launched, _, second = _launch(world, "resume", n + 1, workdir / "resume", resume)
    save_extra = max(r["end_peak_rss"] - p for r, p in zip(first, _steady_peak(first, range(2, n + 1))))
    run = {
        "online": {
            "step_s": steps, "boundary_s": steps[n + 1],
            "stage1_steady_s": statistics.median(steps[k] for k in range(2, n + 1)),
            "stage2_steady_s": statistics.median(steps[k] for k in range(n + 2, max_steps + 1)),
            "stage_groups_s": max(r["stage_groups_s"] for r in online),
            "prepare_s": _last(online, "train_begin") - _last(online, "built"),
            "boundary_peak_extra_bytes": boundary_extra,
            "process_peak_rss_bytes": max(max(r["start_peak_rss"], r["prepare_peak_rss"], *r["peak_rss"].values())
                                          for r in online),
            "cp_size_by_step": online[0]["cp_size"], "loss_by_step": online[0]["loss"],
        },
        "chain": {
            "save_s": _last(first, "trained") - _last(first, "step_end", n),
            "exit_s": saved_at - _last(first, "trained"),
            "relaunch_gap_s": launched - saved_at,
            "restart_s": _last(second, "imported") - launched,
            "build_s": _last(second, "built") - _last(second, "imported"),
            "prepare_load_s": _last(second, "train_begin") - _last(second, "built"),
            "first_step_s": _last(second, "step_end", n + 1) - _last(second, "train_begin"),
            "total_s": _last(second, "step_end", n + 1) - _last(first, "step_end", n),
            "save_peak_extra_bytes": save_extra,
            "resume_process_peak_rss_bytes": max(max(r["start_peak_rss"], r["prepare_peak_rss"],
                                                     *r["peak_rss"].values()) for r in second),
            "resumed_cp_size": second[0]["cp_size"][str(n + 1)],
            "resumed_loss": second[0]["loss"][str(n + 1)],
        },
        "state_bytes": max(r["state_bytes"] for r in online),
        "parameters": online[0]["parameters"],
    }
    online, chain = run["online"], run["chain"]
    online["switch_s"] = online["boundary_s"] + online["stage_groups_s"]
    # beyond what the stage-2 step itself costs (a boundary step may run faster than the median steady one)
    online["switch_overhead_s"] = online["switch_s"] - online["stage2_steady_s"]
    chain["overhead_s"] = chain["total_s"] - online["stage2_steady_s"]
    run["speedup"] = chain["total_s"] / online["switch_s"]
    return run


def summarize(name: str, runs: list[dict], flags: list[str], world: int, switch_step: int) -> dict:
    """Medians over the repeats of preset `name`, and whether the chain reproduced the online step."""
    def median(part: str, key: str) -> float:
        return statistics.median(r[part][key] for r in runs)

    online_keys = ("boundary_s", "stage1_steady_s", "stage2_steady_s", "stage_groups_s", "switch_s",
                   "switch_overhead_s", "prepare_s")
    chain_keys = ("save_s", "exit_s", "relaunch_gap_s", "restart_s", "build_s", "prepare_load_s", "first_step_s",
                  "total_s", "overhead_s")
    n = switch_step
    same = all(abs(r["chain"]["resumed_loss"] - r["online"]["loss_by_step"][str(n + 1)])
               <= 1e-6 * abs(r["online"]["loss_by_step"][str(n + 1)]) for r in runs)
    command = shlex.join(["hf-sparse-cp", "train", "--nproc", str(world), *flags])
    return {
        "model": name, "parameters": runs[0]["parameters"], "state_bytes_per_rank": runs[0]["state_bytes"],
        "stage_lengths": PRESETS[name].lengths,
        "model_config": PRESETS[name].config,  # MODEL_DIR: this config, random init, bf16, with the byte tokenizer
        "command": command,
        "chain_commands": [command + f" --save_strategy steps --save_steps {n}  # stopped after the step-{n} save",
                           command + f" --save_strategy steps --save_steps {n} --resume_from_checkpoint "
                           f"OUTPUT_DIR/checkpoint-{n}  # stopped after step {n + 1}"],
        "online": {k: median("online", k) for k in online_keys},
        "chain": {k: median("chain", k) for k in chain_keys},
        "speedup": statistics.median(r["speedup"] for r in runs),
        "speedup_min": min(r["speedup"] for r in runs),
        "boundary_peak_extra_bytes": max(r["online"]["boundary_peak_extra_bytes"] for r in runs),
        "save_peak_extra_bytes": max(r["chain"]["save_peak_extra_bytes"] for r in runs),
        "resumed_step_reproduces_online": same,
        "runs": runs,
    }


def format_table(rows: list[dict]) -> str:
    head = (f"{'model':>6} {'params':>7} {'state MB':>9} {'steady s':>9} {'boundary s':>11} {'groups s':>9} "
            f"{'switch s':>9} {'-steady s':>10} {'save s':>7} {'exit+restart s':>15} {'build s':>8} "
            f"{'prep+load s':>12} {'1st step s':>11} {'chain s':>8} {'chain/switch':>13} {'peak extra MB':>14}")
    lines = [head]
    for r in rows:
        o, c = r["online"], r["chain"]
        lines.append(
            f"{r['model']:>6} {r['parameters'] / 1e6:>6.1f}M {r['state_bytes_per_rank'] / 2**20:>9.1f} "
            f"{o['stage2_steady_s']:>9.3f} {o['boundary_s']:>11.3f} {o['stage_groups_s']:>9.4f} {o['switch_s']:>9.3f} "
            f"{o['switch_overhead_s']:>10.3f} {c['save_s']:>7.2f} "
            f"{c['exit_s'] + c['relaunch_gap_s'] + c['restart_s']:>15.2f} {c['build_s']:>8.2f} "
            f"{c['prepare_load_s']:>12.2f} {c['first_step_s']:>11.2f} {c['total_s']:>8.2f} {r['speedup']:>12.1f}x "
            f"{r['boundary_peak_extra_bytes'] / 2**20:>14.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    from transformers import HfArgumentParser

    from hf_sparse_cp.env import environment
    from hf_sparse_cp.testing.benchmarking import format_targets, write_report

    (args,) = HfArgumentParser(BenchSwitchArguments).parse_args_into_dataclasses(argv)
    unknown = set(args.models) - set(PRESETS)
    steps_fit = 2 <= args.switch_step <= args.max_steps - 2
    if unknown or args.world < 2 or args.world % 2 or args.repeats < 1 or not steps_fit:
        raise SystemExit(f"--models from {list(PRESETS)}, an even --world >= 2, --repeats >= 1 and 2 <= --switch_step "
                         f"<= --max_steps - 2 (got {args.models}, {args.world}, {args.repeats}, {args.switch_step}, "
                         f"{args.max_steps}).")
    rows, load_before = [], os.getloadavg()  # (the machine's load: the other jobs every phase shares it with)
    for name in args.models:
        with tempfile.TemporaryDirectory() as folder:
            folder = Path(folder)
            model_dir = _save_model_folder(name, folder / "model")
            runs = []
            for i in range(args.repeats):
                workdir = folder / f"run{i}"
                workdir.mkdir()
                flags = train_flags(name, args.switch_step, args.max_steps, workdir / "online", model_dir)
                runs.append(measure_once(args.world, args.switch_step, args.max_steps, flags, workdir))
                print(f"{name} repeat {i + 1}/{args.repeats}: switch {runs[-1]['online']['switch_s']:.3f} s, chain "
                      f"{runs[-1]['chain']['total_s']:.2f} s", flush=True)
        shown = train_flags(name, args.switch_step, args.max_steps, Path("OUTPUT_DIR"),
                            Path("MODEL_DIR") if model_dir else None)
        rows.append(summarize(name, runs, shown, args.world, args.switch_step))
    speedup = min(r["speedup"] for r in rows)
    memory = max(r["boundary_peak_extra_bytes"] / r["state_bytes_per_rank"] for r in rows)
    targets = [
        {"target": "online CP switch (boundary step + stage-2 groups) vs two chained jobs (save, exit, restart, "
                   "build, prepare + load, first stage-2 step) (issue #17; smallest median over models)",
         "required": ">= 20x", "measured": speedup, "pass": speedup >= 20},
        {"target": "peak RSS of the boundary step beyond the steady steps' / one rank's shard of weights + AdamW "
                   "moments (largest over models, ranks and repeats)",
         "required": "<= 1", "measured": memory, "pass": memory <= 1},
        {"target": "the resumed job's step N+1 reproduces the online run's loss (every repeat)", "required": "yes",
         "measured": all(r["resumed_step_reproduces_online"] for r in rows),
         "pass": all(r["resumed_step_reproduces_online"] for r in rows)},
    ]
    env = environment("cpu")
    print(f"CP switch on {args.world} gloo processes ({env['device']}, torch {env['torch']}), FSDP2, cp_schedule "
          f"CP 1 -> CP 2 after step {args.switch_step} of {args.max_steps}; medians of {args.repeats} repeats")
    print(format_table(rows))
    print(format_targets(targets))
    report = {**env, "world": args.world, "switch_step": args.switch_step, "max_steps": args.max_steps,
              "repeats": args.repeats, "omp_num_threads": 1, "load_average_before": load_before,
              "load_average_after": os.getloadavg(), "benchmark_command": shlex.join(
                  ["python", "benchmarks/bench_switch.py", *(sys.argv[1:] if argv is None else argv)]),
              "rows": rows, "targets": targets}
    write_report(report, RESULTS_DIR, "switch", args.output)
    return report


if __name__ == "__main__":
    if sys.argv[1:2] == [WORKER]:
        role, stop_at, report, *flags = sys.argv[2:]
        _worker(role, int(stop_at), report, flags)
    else:
        main()
