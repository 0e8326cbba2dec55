"""The GPU figures still missing in one short call (`bash benchmarks/gpu_session.sh quick`, issues #32, #50), the rest
in a second (`gpu_session.sh quick2`).

GPU calls here are rare and short (one H200 for about 15 minutes of machine time, its start included: one call of
at most 9 minutes per lent session), so one call must bring back what matters most. This script runs the stages of
`--call` in order of value, each a subprocess with its own cap, under one global deadline (`--budget_s`, 540 s by
default, counted from `$QUICK_START` when the shell wrapper set it, i.e. before its installs), and writes its JSON
after every stage; the stages' own scripts write theirs as soon as they have a number. `quick` (the 256K step and
the compiled one first: the H200 call of 2026-12-04 measured the kernels' stages and not these):

- e2e: `bench_e2e.py`, a Qwen2.5-0.5B-shaped training step (random init, bf16, lean loss, gradient
  checkpointing) at 256K: `sparse_cp` as the plugin runs by default (liger-kernel's RoPE, RMSNorm and SwiGLU
  where its wheel was carried in .whl/) against sdpa + liger-kernel (all of liger's kernels), one warm-up and
  one timed step each; sparse_cp's 'auto' engine reads the output folder's engine table where one exists as the
  stage starts (neither call's attention stage runs before it: only an earlier call's in the same folder; its rows of
  head_dim 128 do not decide for the model's head_dim 64);
- compile: the same sparse_cp step with the whole model compiled as a stock script's `--torch_compile` has the
  Trainer do (`bench_e2e.py --torch_compile`), one warm-up (the compilation) and one timed step, against e2e's
  (the work around attention fused by inductor there, as the plugin's 'auto' leaves it in a compiled model);
- tiles: `tune_tiles.py --shortlist --kernels columns dq forward dkdv` at 128K (the attention stage's geometry):
  the whole backward with the columns' dk/dv from the key-major kernel (`kernels/column_bwd.py`) against the dq
  kernel's atomics, then the few candidates of dq, the forward and dk/dv (FlexAttention's grid order, TMA, its row
  addressing: `Tiles.lean_index`), each
  checked against the launched tiles' result and each kernel timed with the earlier ones' chosen tiles. Its
  `chosen` tiles (a candidate at least 2% faster than the launched tiles and computing their result; none
  otherwise) are the tile table the stages after it launch from (`$HF_SPARSE_CP_TILES`, set only when tiles.json
  exists; applied only on this GPU at head_dim 128, layout block 128, bf16: the attention stage, not the 0.5B
  model's head_dim 64 nor the head_dim-256 stages); every JSON records the variable;
- attention: `bench_attention.py` at 128K, head_dim 128, GQA 16/2: a random vertical-slash layout at ~5% kept
  and the dense causal layout: our kernels, auto, the flex engine, compiled Flex on a BlockMask of the same
  blocks (Triton and flash backends), our kernels on those blocks alone (what the columns cost), cuDNN and
  flash SDPA dense, forward + backward, each ratio; an estimated layout (our kernels only) with the pattern
  estimation's time as a share of that attention; the engine table `auto` reads;
- wide_tests: the gpu-marked kernel tests of heads above 128 lanes (160, 256) and of fp32 inputs (their own tiles,
  `configs.WIDE_HEAD_TILES`, `FP32_TILES`, `FP32_WIDE_HEAD_TILES`) against the fp64 reference; pytest's report is
  folded into the session's JSON;
- wide_attention: `bench_attention.py` at head_dim 256 (Gemma's), 32K, GQA 16/2, ~5% kept and dense: ours, ours
  on the blocks alone (`ours_blocks`: what the columns cost there; ours was 0.31x Flex on the same blocks) and auto
  against Flex on the same blocks (and the check that both compute the same), cuDNN and flash SDPA dense.

`quick2`: wide_tiles (the tile short list at head_dim 256, 32K: `configs.WIDE_HEAD_SHORTLIST`), e2e at 128K,
fit (sparse_cp at 512K and 1M, one step each, its peak memory beside the memory model's prediction), layer0
(sparse_cp at 128K with the first layer sparse, `--sparse_dense_first_layers 0`, against e2e's 128K run with it
dense, the default: what the dense first layer costs) and untiled (sparse_cp at 128K without token tiles,
`--token_tiling_min_length 0`, against e2e's run with them, the default from 32K: what their extra MLP forward costs
in time and saves in memory, never measured on a GPU) and estimation (`bench_attention.py` at 256K, 512K and 1M,
head_dim 128, GQA 16/2, our kernels only: the pattern estimation's time by part, scoring and layout build, with
the same budget as the attention stage's estimated layout at 128K: how it grows with the length, which the
cluster simulator charges as a constant; docs/scaling.md).

The caps add up to more than the budget on purpose; benchmarks/results/README.md estimates each stage's time
from the earlier GPU sessions' JSON. A stage the deadline skips is rerun in a call of its own
(`gpu_session.sh tune --shortlist`, `gpu_session.sh e2e ...`).

A stage that fails or is cut off by its cap does not stop the next; what it wrote stays. Files (at most 8 come
back from a GPU call), in `$OUT` or `--out`, else benchmarks/results/: `<call>-session.json` (device, versions,
the command, settings, each stage's status, cap, time and outputs, the headline figures and verdicts),
`<call>.log` (every stage's output), and the stages' JSON: `quick` attention.json, engine_table.json,
attention-d256.json, e2e.json, e2e-compile.json, tiles.json; `quick2` tiles-d256.json, e2e.json, e2e-fit.json,
e2e-layer0.json, e2e-untiled.json, estimation.json. `benchmarks/results/README.md` says how to read them.

`--dry-run` runs the same stages with the same JSON on the CPU at tiny sizes (our kernels in Triton's
interpreter, the gpu-marked tests skipped), so the script cannot rot between GPU runs:
tests/integration/test_quick_session.py runs both calls.

    bash benchmarks/gpu_session.sh quick               # on the lent GPU machine
    python benchmarks/quick_session.py --dry-run --out /tmp/quick
    python benchmarks/quick_session.py --call quick2 --dry-run --out /tmp/quick2
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Literal

ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = ROOT / "benchmarks" / "results"
# Files of the stages that the session's JSON reads besides the e2e ones; the kernel tests' report goes to the scratch
# folder. The tests: the gpu-marked kernel tests of heads above 128 lanes and of fp32 inputs (their own tiles).
WIDE_ATTENTION, WIDE_TESTS_XML, WIDE_TESTS = "attention-d256.json", "wide-tests.xml", "d160 or d256 or fp32"
# Seconds kept after the last stage for the summary, and the least a stage is started with.
RESERVE_S, MIN_STAGE_S = 10.0, 20.0
# A stage whose cap is reached gets SIGTERM, then SIGKILL after this many seconds.
KILL_GRACE_S = 10.0


# The stages of each prepared call, in order of value: `quick` the figures still missing that matter most, `quick2`
# the rest (for a second lent machine).
CALLS = {"quick": ("e2e", "compile", "tiles", "attention", "wide_tests", "wide_attention"),
         "quick2": ("wide_tiles", "e2e", "fit", "layer0", "untiled", "estimation")}
# Sequence length of the e2e stage's runs per call (the compile stage runs at the same length): 256K in `quick` (its
# ratio over sdpa + liger is the missed target), 128K in `quick2` (layer0's comparison).
E2E_SEQ = {"quick": 262144, "quick2": 131072}


@dataclass
class QuickArguments:
    call: Literal["quick", "quick2"] = field(
        default="quick", metadata={"help": f"Which prepared call: its stages, in order ({CALLS})."})
    dry_run: bool = field(
        default=False,
        metadata={"help": "The same stages and JSON on the CPU at tiny sizes (Triton's interpreter): checks the "
                  "script, measures nothing of a GPU."},
    )
    budget_s: float = field(default=540.0, metadata={"help": "Global deadline in seconds, from $QUICK_START if set."})
    out: str | None = field(default=None, metadata={"help": "Output folder; default $OUT, else benchmarks/results/."})
    tiles_cap_s: float = field(default=70.0, metadata={"help": "Cap of the tile short list at 128K."})
    attention_cap_s: float = field(default=110.0, metadata={"help": "Cap of the attention benchmark at 128K."})
    wide_tests_cap_s: float = field(
        default=100.0, metadata={"help": "Cap of the gpu-marked kernel tests at head_dim 160/256 and fp32."})
    wide_attention_cap_s: float = field(default=75.0, metadata={"help": "Cap of the attention benchmark at head_dim "
                                                                "256, 32K."})
    e2e_cap_s: float = field(default=170.0, metadata={"help": "Cap of the training steps against sdpa + liger."})
    compile_cap_s: float = field(default=150.0, metadata={"help": "Cap of the compiled (--torch_compile) step."})
    wide_tiles_cap_s: float = field(default=70.0, metadata={"help": "Cap of the tile short list at head_dim 256."})
    fit_cap_s: float = field(default=210.0, metadata={"help": "Cap of the 512K and 1M steps."})
    layer0_cap_s: float = field(default=40.0, metadata={"help": "Cap of the 128K step with the first layer sparse."})
    untiled_cap_s: float = field(default=40.0, metadata={"help": "Cap of the 128K step without token tiles."})
    estimation_cap_s: float = field(default=90.0, metadata={"help": "Cap of the estimation's timing at 256K-1M."})


@dataclass(frozen=True)
class Stage:
    name: str
    cap_s: float
    command: list[str]
    outputs: list[str]  # the JSON files it writes, in the output folder
    env: dict[str, str] = field(default_factory=dict)
    # variables naming a file, set only when the file exists as the stage starts (an earlier stage, or call, wrote it)
    env_files: dict[str, str] = field(default_factory=dict)


def stages(args: QuickArguments, out: Path, scratch: Path | None = None) -> list[Stage]:
    """The stages of `args.call`, in order, their commands at full (GPU) or tiny (--dry-run) sizes. `scratch`: a folder
    outside `out` for what is folded into the session's JSON instead of coming back as a file of its own (a GPU
    call brings back at most 8): the kernel tests' report, the head_dim-256 engine table."""
    py = sys.executable
    scratch = scratch or Path(tempfile.gettempdir())
    sparse_attention = ["--densities", "0.05", "--time_forward", "false", "--profile_seq_lens", "0"]
    attention = [py, "benchmarks/bench_attention.py", *sparse_attention, "--estimated_variants", "ours",
                 "--variants", "ours", "ours_blocks", "auto", "flex_engine", "flex", "flex_flash",
                 "sdpa_cudnn", "sdpa_flash", "--output", str(out / "attention.json"),
                 "--engine_table", str(out / "engine_table.json")]
    # head_dim 256 (Gemma) on the attention stage's heads: ours against Flex on the same blocks, cuDNN and flash dense
    wide_attention = [py, "benchmarks/bench_attention.py", *sparse_attention, "--head_dim", "256",
                      "--estimated_budgets", "", "--variants", "ours", "ours_blocks", "auto", "flex", "sdpa_cudnn",
                      "sdpa_flash",
                      "--output", str(out / WIDE_ATTENTION), "--engine_table", str(scratch / "engine_table-d256.json")]
    # the pattern estimation at longer lengths, with the attention stage's estimated budget (ours on its layout too)
    estimation = [py, "benchmarks/bench_attention.py", *sparse_attention, "--variants", "ours", "--estimated_variants",
                  "ours", "--dense", "false", "--check", "false", "--output", str(out / "estimation.json"),
                  "--engine_table", str(scratch / "engine_table-estimation.json")]
    # (-v: the log names each outcome as it comes, for a run its cap cuts before pytest writes the report)
    wide_tests = [py, "-m", "pytest", "-v", "-m", "gpu", "-p", "no:cacheprovider", "tests/kernels/test_kernels_gpu.py",
                  "-k", WIDE_TESTS, "--junitxml", str(scratch / WIDE_TESTS_XML)]
    e2e = [py, "benchmarks/bench_e2e.py", "--profile_seq_lens", "0", "--timed_steps", "1"]
    headline = ["--variants", "sparse_cp", "sdpa+liger", "--warmup_steps", "1", "--output", str(out / "e2e.json")]
    compiled = ["--variants", "sparse_cp", "--torch_compile", "true", "--warmup_steps", "1",
                "--output", str(out / "e2e-compile.json")]
    fit = ["--variants", "sparse_cp", "--warmup_steps", "0", "--output", str(out / "e2e-fit.json")]
    layer0 = ["--variants", "sparse_cp", "--sparse_dense_first_layers", "0", "--warmup_steps", "1",
              "--output", str(out / "e2e-layer0.json")]
    untiled = ["--variants", "sparse_cp", "--token_tiling_min_length", "0", "--warmup_steps", "1",
               "--output", str(out / "e2e-untiled.json")]
    tiles = [py, "benchmarks/tune_tiles.py", "--shortlist", "--kernels", "columns", "dq", "forward", "dkdv"]
    e2e_seq = E2E_SEQ[args.call]
    if args.dry_run:
        # (the MLP product timed beside ours at a tiny width: Qwen2.5-3B's 11008 at head_dim 256 cost 2 s of a CPU's
        # float16 products per call)
        tiny_shape = ["--dry_run", "--block_size", "32", "--num_q_heads", "2", "--num_kv_heads", "1", "--num_verticals",
                      "4", "--dtype", "float16", "--warmup", "0", "--repeats", "1", "--linear_intermediate", "256"]
        tiny = [*tiny_shape, "--seq_lens", "128"]
        attention += [*tiny, "--head_dim", "16", "--estimated_budgets", "8:2"]
        estimation += [*tiny_shape, "--seq_lens", "128", "256", "--head_dim", "16", "--estimated_budgets", "8:2"]
        wide_attention += tiny
        e2e += ["--tiny", "--device", "cpu"]
        headline += ["--token_tiling_min_length", "64"]  # (tiled at its tiny length as the GPU's from 32K)
        e2e_seq //= 1024
        # (first length, last length, per-run timeout in seconds) of each e2e stage
        # (short: a bf16 step on a CPU without bf16 products costs about its length; fit still past the headline;
        # the compiled step: about a minute of inductor on 2 cores)
        runs = {"headline": (e2e_seq, e2e_seq, 120), "compile": (e2e_seq, e2e_seq, 240), "fit": (512, 1024, 120),
                "layer0": (128, 128, 120), "untiled": (128, 128, 120)}
        tiles += ["--dry_run", "--seq_len", "96", "--block_size", "16", "--num_q_heads", "2", "--num_kv_heads", "1",
                  "--num_verticals", "4", "--density", "0.3", "--warmup", "0", "--repeats", "1"]
        wide_tiles = [*tiles, "--head_dim", "256"]
        tiles += ["--head_dim", "16"]
        interpreted = {"TRITON_INTERPRET": "1"}
    else:
        attention += ["--seq_lens", "131072", "--warmup", "1", "--repeats", "5", "--estimated_budgets", "1000:256"]
        # (one timed call of each: ours on the estimated layout at 1M takes about 9 s, 64x 128K's)
        estimation += ["--seq_lens", "262144", "524288", "1048576", "--warmup", "1", "--repeats", "1",
                       "--estimated_budgets", "1000:256"]
        wide_attention += ["--seq_lens", "32768", "--warmup", "1", "--repeats", "5"]
        e2e += ["--models", "0.5b"]
        # the H200's 1M step took about 135 s with its start-up (2026-11-29): the fit stage's runs get 190 s; the
        # compiled step's warm-up holds inductor's compilation (never timed on a GPU): the rest of its cap
        runs = {"headline": (e2e_seq, e2e_seq, 150), "compile": (e2e_seq, e2e_seq, int(args.compile_cap_s) - 15),
                "fit": (524288, 1048576, 190), "layer0": (131072, 131072, 150), "untiled": (131072, 131072, 150)}
        wide_tiles = [*tiles, "--seq_len", "32768", "--head_dim", "256", "--warmup", "1", "--repeats", "3"]
        tiles += ["--seq_len", "131072", "--warmup", "1", "--repeats", "3"]
        interpreted = {}
    tiles += ["--output", str(out / "tiles.json")]
    wide_tiles += ["--output", str(out / "tiles-d256.json")]
    run = {name: [*e2e, "--min_seq", str(first), "--max_seq", str(last), "--timeout_s", str(timeout)]
           for name, (first, last, timeout) in runs.items()}
    from hf_sparse_cp.attention.engines import TABLE_ENV
    from hf_sparse_cp.kernels.configs import TILES_ENV

    tile_table = {TILES_ENV: str(out / "tiles.json")}
    table = {TABLE_ENV: str(out / "engine_table.json"), **tile_table}
    every = {
        "tiles": Stage("tiles", args.tiles_cap_s, tiles, ["tiles.json"], interpreted),
        "attention": Stage("attention", args.attention_cap_s, attention, ["attention.json", "engine_table.json"],
                           interpreted, env_files=tile_table),
        "wide_tests": Stage("wide_tests", args.wide_tests_cap_s, wide_tests, []),
        "wide_attention": Stage("wide_attention", args.wide_attention_cap_s, wide_attention, [WIDE_ATTENTION],
                                interpreted),
        "e2e": Stage("e2e", args.e2e_cap_s, run["headline"] + headline, ["e2e.json"], env_files=table),
        "compile": Stage("compile", args.compile_cap_s, run["compile"] + compiled, ["e2e-compile.json"],
                         env_files=table),
        "wide_tiles": Stage("wide_tiles", args.wide_tiles_cap_s, wide_tiles, ["tiles-d256.json"], interpreted),
        "fit": Stage("fit", args.fit_cap_s, run["fit"] + fit, ["e2e-fit.json"], env_files=table),
        "layer0": Stage("layer0", args.layer0_cap_s, run["layer0"] + layer0, ["e2e-layer0.json"], env_files=table),
        "untiled": Stage("untiled", args.untiled_cap_s, run["untiled"] + untiled, ["e2e-untiled.json"],
                         env_files=table),
        "estimation": Stage("estimation", args.estimation_cap_s, estimation, ["estimation.json"], interpreted,
                            env_files=tile_table),
    }
    return [every[name] for name in CALLS[args.call]]


def run_stage(stage: Stage, cap_s: float, log_path: Path) -> dict:
    """Run one stage as its own process group, appending its output to the log; SIGTERM at the cap, then
    SIGKILL. Returns {status, returncode, wall_s}: status 'ok', 'failed' (non-zero exit) or 'timeout'."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **stage.env,
           **{name: path for name, path in stage.env_files.items() if Path(path).is_file()}}
    start = time.monotonic()
    with log_path.open("a") as log:
        log.write(f"\n==== stage {stage.name} (cap {cap_s:.0f} s): {' '.join(stage.command)}\n")
        log.flush()
        proc = subprocess.Popen(stage.command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            returncode = proc.wait(timeout=cap_s)
            status = "ok" if returncode == 0 else "failed"
        except subprocess.TimeoutExpired:
            status = "timeout"
            for sig, wait_s in ((signal.SIGTERM, KILL_GRACE_S), (signal.SIGKILL, None)):
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    proc.wait(timeout=wait_s)
                    break
                except subprocess.TimeoutExpired:
                    continue
            returncode = proc.wait()
        log.write(f"==== stage {stage.name}: {status} (exit {returncode}) after {time.monotonic() - start:.1f} s\n")
    return {"status": status, "returncode": returncode, "wall_s": time.monotonic() - start}


def _read(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def _rows(report: dict, *keys: str) -> list[dict]:
    return [{k: r.get(k) for k in keys} for r in report.get("results", [])]


def _ok_row(report: dict, variant: str, seq_len: int) -> dict:
    """The result of `variant` at `seq_len` when it ran to the end, else {} (its values then read as None)."""
    return next((r for r in report.get("results", [])
                 if r["variant"] == variant and r["seq_len"] == seq_len and r["status"] == "ok"), {})


def setting_cost(e2e: dict, changed: dict, default: str, other: str) -> list[dict]:
    """sparse_cp's step as the plugin runs it by default (e2e.json) against the same step with one setting changed
    (`changed`, a stage's e2e file) at each length both ran: both steps' time and peak (`{default}_step_s`,
    `{other}_peak_gib`, ...) and `{default}_share`, the share of the default step that the setting costs (negative:
    it saves time)."""
    lengths = sorted({r["seq_len"] for r in changed.get("results", []) if r["variant"] == "sparse_cp"})
    out = []
    for seq_len in lengths:
        default_row, other_row = _ok_row(e2e, "sparse_cp", seq_len), _ok_row(changed, "sparse_cp", seq_len)
        mine, theirs = default_row.get("step_s"), other_row.get("step_s")
        out.append({"seq_len": seq_len, f"{default}_step_s": mine, f"{other}_step_s": theirs,
                    f"{default}_peak_gib": default_row.get("peak_gib"), f"{other}_peak_gib": other_row.get("peak_gib"),
                    f"{default}_share": (mine - theirs) / mine if mine and theirs else None})
    return out


def compiled_step(e2e: dict, compiled: dict) -> list[dict]:
    """sparse_cp's step with the whole model compiled (e2e-compile.json, --torch_compile) against the same step
    uncompiled and sdpa + liger (e2e.json) at each length the compiled step ran: the speed-ups, its first step (the
    compilation included), both peaks and what fused the work around attention in each (a compiled model's 'auto':
    inductor; the uncompiled one's: liger-kernel where installed)."""
    out = []
    for r in compiled.get("results", []):
        if r["variant"] != "sparse_cp":
            continue
        seq_len, step = r["seq_len"], _ok_row(compiled, "sparse_cp", r["seq_len"]).get("step_s")
        uncompiled = _ok_row(e2e, "sparse_cp", seq_len)
        eager, liger = uncompiled.get("step_s"), _ok_row(e2e, "sdpa+liger", seq_len).get("step_s")
        # the same steps on the same tokens from the same init: the losses say whether the compiled model computes
        # what the uncompiled one does (to bf16 rounding)
        losses = list(zip(r.get("losses", []), uncompiled.get("losses", [])))
        dynamo = r.get("dynamo") or {}
        out.append({"seq_len": seq_len, "status": r["status"], "compiled_step_s": step, "eager_step_s": eager,
                    "speedup": eager / step if eager and step else None,
                    "compiled_over_liger": liger / step if liger and step else None,
                    "first_step_s": (r.get("warmup_times_s") or [None])[0], "peak_gib": r.get("peak_gib"),
                    "eager_peak_gib": uncompiled.get("peak_gib"),
                    "fused_ops": (r.get("fused_ops") or {}).get("description"),
                    "eager_fused_ops": (uncompiled.get("fused_ops") or {}).get("description"),
                    "loss_rel_diff": max((abs(a - b) / abs(b) for a, b in losses), default=None),
                    "unique_graphs": dynamo.get("stats", {}).get("unique_graphs"),
                    "graph_breaks": sum(dynamo.get("graph_breaks", {}).values()) if dynamo else None,
                    # (at a call run outside the graph: the sparse attention's before its custom ops)
                    "attention_breaks": sum(n for reason, n in dynamo.get("graph_breaks", {}).items()
                                            if "torch.compiler.disable" in reason) if dynamo else None,
                    "reason": r.get("reason")})
    return out


def test_outcomes(path: Path) -> dict | None:
    """The outcomes in a pytest JUnit XML report (None without one: pytest did not finish): counts and per test."""
    import xml.etree.ElementTree as ElementTree

    try:
        root = ElementTree.parse(path).getroot()
    except (OSError, ElementTree.ParseError):
        return None
    tests = []
    for case in root.iter("testcase"):
        outcome, message = "passed", None
        for tag, name in (("failure", "failed"), ("error", "error"), ("skipped", "skipped")):
            if (found := case.find(tag)) is not None:
                outcome, message = name, (found.get("message") or "")[:300]
                break
        tests.append({"test": case.get("name"), "outcome": outcome, "time_s": float(case.get("time") or 0),
                      "message": message})
    return {**{k: sum(t["outcome"] == k for t in tests) for k in ("passed", "failed", "error", "skipped")},
            "tests": tests}


def verdicts(*reports: dict) -> list[dict]:
    """Every target of the stages' JSON once (by its name), the measured entry where several files list it."""
    found: dict[str, dict] = {}
    for report in reports:
        for key in ("targets", "engine_targets"):
            for t in report.get(key, []):
                if t["target"] not in found or found[t["target"]]["measured"] is None:
                    found[t["target"]] = t
    return list(found.values())


def correctness_verdicts(tests: dict | None, wide_attention: dict) -> list[dict]:
    """The GPU's word on the kernels of heads above 128 lanes and of fp32 inputs: the gpu-marked tests against the
    fp64 reference, and at head_dim 256 ours against Flex on the same blocks (bench_attention's checks)."""
    ran = tests and tests["passed"] + tests["failed"] + tests["error"]
    wrong = tests and tests["failed"] + tests["error"]
    checks = [c for c in wide_attention.get("checks", []) if c["against"] == "flex"]
    return [{"target": f"kernels at head_dim 160/256 and fp32 against the fp64 reference (tests -k '{WIDE_TESTS}')",
             "required": "every test passed",
             "measured": f"{tests['passed']} passed, {wrong} failed, {tests['skipped']} skipped" if tests else None,
             "pass": (wrong == 0) if ran else None},
            {"target": "head_dim 256: ours computes Flex's result on the same blocks (rel. RMS within rtol)",
             "required": "pass", "measured": max((c["rel_rms"] for c in checks), default=None),
             "pass": all(c["status"] == "pass" for c in checks) if checks else None}]


ESTIMATION_KEYS = ("seq_len", "layout", "total_ms", "scoring_ms", "layout_ms", "share_of_fwd_bwd", "peak_mib",
                   "layout_mib", "peak_over_layout")


def headline(out: Path, scratch: Path, ran: set[str] | None = None) -> dict:
    """The figures the README's tables take, from the JSON of the stages named in `ran` (this call's, so that no file
    an earlier call left in the folder is read as this one's; default every stage): attention fwd+bwd ms per (S,
    layout, variant) and ours over every baseline, the columns' cost, the estimation's share, the same at head_dim
    256 with the kernel tests' outcomes, e2e tokens/s and peak memory per (variant, S) with the speed-ups, the
    compiled step, the fit runs with their predicted peaks, the dense first layer's and the token tiles' costs, the
    tiles timed best per kernel (head_dim 128 and 256), and every target's verdict."""
    read = lambda stage, name: (_read(out / name) if ran is None or stage in ran else None) or {}
    attention, wide, e2e, compiled, fit, layer0, untiled, tiles, wide_tiles, lengths = (read(*stage) for stage in (
        ("attention", "attention.json"), ("wide_attention", WIDE_ATTENTION), ("e2e", "e2e.json"),
        ("compile", "e2e-compile.json"), ("fit", "e2e-fit.json"), ("layer0", "e2e-layer0.json"),
        ("untiled", "e2e-untiled.json"), ("tiles", "tiles.json"), ("wide_tiles", "tiles-d256.json"),
        ("estimation", "estimation.json")))
    tests = test_outcomes(scratch / WIDE_TESTS_XML) if ran is None or "wide_tests" in ran else None
    attention_rows = ("seq_len", "layout", "variant", "density", "status", "fwd_bwd_ms", "fwd_bwd_tflops",
                      "auto_engine")
    return {
        "attention_fwd_bwd_ms": _rows(attention, *attention_rows),
        "attention_ratios": attention.get("ratios", []),
        "column_costs": attention.get("column_costs", []),
        "rate_shares": attention.get("rate_shares", []),
        "estimation": [{k: e.get(k) for k in ESTIMATION_KEYS} for e in attention.get("estimation", [])],
        "estimation_lengths": [{k: e.get(k) for k in ESTIMATION_KEYS} for e in lengths.get("estimation", [])],
        "wide_tests": tests,
        "wide_attention_fwd_bwd_ms": _rows(wide, *attention_rows),
        "wide_attention_ratios": wide.get("ratios", []),
        "e2e": _rows(e2e, "model", "variant", "seq_len", "status", "tokens_per_s", "peak_gib", "kept_fraction",
                     "fused_ops"),
        "speedups": e2e.get("speedups", []),
        "compiled_step": compiled_step(e2e, compiled),
        "fit": fit.get("memory_predictions", []) + [
            {k: r.get(k) for k in ("model", "variant", "seq_len", "status", "reason")}
            for r in fit.get("results", []) if r["status"] != "ok"],
        "first_layer": setting_cost(e2e, layer0, "dense_first_layer", "sparse_first_layer"),
        "token_tiles": setting_cost(e2e, untiled, "tiled", "untiled"),
        "tiles_best": tiles.get("best", {}),
        "wide_tiles_best": wide_tiles.get("best", {}),
        "verdicts": verdicts(attention, e2e, fit) + (correctness_verdicts(tests, wide) if ran is None or {
            "wide_tests", "wide_attention"} & ran else []),
    }


def format_summary(report: dict) -> str:
    dry = " DRY RUN (CPU)" if report["settings"]["dry_run"] else ""
    lines = [f"{report['settings'].get('call', 'quick')} session on {report['device']} (torch {report['torch']}, "
             f"triton {report['triton']}, transformers {report['transformers']}){dry}"]
    for s in report["stages"]:
        wall = f"{s['wall_s']:.0f} s" if s.get("wall_s") is not None else "-"
        lines.append(f"  stage {s['name']:<14} {s['status']:<8} {wall:>6} of cap {s['cap_s']:.0f} s")
    h = report["headline"]
    # (the head_dim-256 keys are absent from sessions before that stage existed)
    for d, rows, ratios in ((128, h["attention_fwd_bwd_ms"], h["attention_ratios"]),
                            (256, h.get("wide_attention_fwd_bwd_ms", []), h.get("wide_attention_ratios", []))):
        for r in rows:
            shown = f"{r['fwd_bwd_ms']:.2f} ms" if r["status"] == "ok" else r["status"]
            pick = f" (picked {r['auto_engine']})" if r.get("auto_engine") else ""
            lines.append(f"  attention d{d} {r['seq_len'] // 1024}K {r['layout']:<14} {r['variant']:<12} fwd+bwd "
                         f"{shown}{pick}")
        for e in ratios:
            over = ", ".join(f"{b} {x:.2f}x" for b, x in e["over"].items() if x is not None)
            lines.append(f"  d{d} {e['variant']} {e['seq_len'] // 1024}K {e['layout']} over: {over or '-'}")
    if tests := h.get("wide_tests"):
        lines.append(f"  kernel tests (d160/d256/fp32): {tests['passed']} passed, {tests['failed']} failed, "
                     f"{tests['error']} errors, {tests['skipped']} skipped")
        lines += [f"    {t['outcome']} {t['test']}: {t['message']}" for t in tests["tests"]
                  if t["outcome"] in ("failed", "error")]
    for c in h.get("column_costs", []):  # (absent from sessions before it was measured)
        lines.append(f"  columns {c['seq_len'] // 1024}K {c['layout']}: {c['columns_ms']:.2f} of {c['ours_ms']:.2f} ms "
                     f"({100 * c['columns_time_share']:.1f}% of the time for {100 * c['column_share']:.1f}% of the "
                     f"pairs); block pairs {c['blocks_tflops']:.0f} TFLOP/s"
                     + (f" (Flex on them {c['flex_tflops']:.0f})" if c["flex_tflops"] is not None else ""))
    for r in h.get("rate_shares", []):  # (absent from sessions before it was measured)
        lines.append(f"  rate share {r['seq_len'] // 1024}K {r['layout']}: ours {r['ours_tflops']:.0f} TFLOP/s "
                     f"over the MLP product's {r['linear_tflops']:.0f} = {r['measured_share']:.2f} (planner: "
                     f"{r['planner_share']})")
    for e in h["estimation"] + h.get("estimation_lengths", []):  # (the second: absent from sessions before it)
        share = "-" if e["share_of_fwd_bwd"] is None else f"{100 * e['share_of_fwd_bwd']:.1f}% of our fwd+bwd"
        memory = "" if e.get("peak_mib") is None else (f"; peak {e['peak_mib']:.0f} MiB, {e['peak_over_layout']:.2f}x "
                                                        f"the layout's {e['layout_mib']:.0f}")
        parts = "" if e.get("layout_ms") is None else (f" (scoring {e['scoring_ms']:.2f}, layout build "
                                                        f"{e['layout_ms']:.2f})")
        lines.append(f"  estimation {e['seq_len'] // 1024}K {e['layout']}: {e['total_ms']:.2f} ms{parts}, {share}"
                     f"{memory}")
    for r in h["e2e"]:
        shown = (f"{r['tokens_per_s']:.0f} tokens/s, {r['peak_gib']:.1f} GiB" if r["status"] == "ok" else r["status"])
        lines.append(f"  e2e {r['model']} {r['variant']:<11} {r['seq_len'] // 1024}K: {shown}")
    for c in h.get("compiled_step", []):
        if c["compiled_step_s"] is None:
            lines.append(f"  compiled step {c['seq_len'] // 1024}K: {c['status']} {c.get('reason') or ''}"[:140])
            continue
        ratio = lambda x: "-" if x is None else f"{x:.2f}x"
        same = "-" if c["loss_rel_diff"] is None else f"{c['loss_rel_diff']:.1e}"
        lines.append(f"  compiled step {c['seq_len'] // 1024}K: {c['compiled_step_s']:.2f} s (first step "
                     f"{c['first_step_s']:.0f} s), {ratio(c['speedup'])} over uncompiled, "
                     f"{ratio(c['compiled_over_liger'])} over sdpa + liger, {c['peak_gib']:.1f} GiB, losses "
                     f"{same} from uncompiled; {c['unique_graphs']} graphs, {c['graph_breaks']} graph breaks "
                     f"({c['attention_breaks']} at attention); {c['fused_ops']}")
    for f in h["fit"]:
        # A step that did not finish has no time: its memory prediction row (no reason) shows the peak it reached,
        # its result row the reason.
        if f["status"] == "ok":
            shown = f"{f['step_s']:.1f} s, {f['peak_gib']:.1f} GiB (predicted {f['predicted_peak_gib']:.1f})"
        elif f.get("peak_gib") is not None:
            shown = f"{f['status']} at {f['peak_gib']:.1f} GiB (predicted {f['predicted_peak_gib']:.1f})"
        else:
            shown = f"{f['status']}: {f.get('reason') or ''}"[:100]
        lines.append(f"  fit {f['model']} {f['variant']} {f['seq_len'] // 1024}K: {shown}")
    for f in h["first_layer"]:
        share = "-" if f["dense_first_layer_share"] is None else f"{100 * f['dense_first_layer_share']:.1f}%"
        lines.append(f"  dense first layer at {f['seq_len'] // 1024}K: {share} of the step")
    for f in h.get("token_tiles", []):  # (sessions before it: none)
        share = "-" if f["tiled_share"] is None else f"{100 * f['tiled_share']:.1f}%"
        peaks = "-" if None in (f["tiled_peak_gib"], f["untiled_peak_gib"]) else \
            f"{f['tiled_peak_gib']:.1f} GiB against {f['untiled_peak_gib']:.1f} without"
        lines.append(f"  token tiles at {f['seq_len'] // 1024}K: {share} of the step, {peaks}")
    for d, best_tiles in ((128, h["tiles_best"]), (256, h.get("wide_tiles_best", {}))):
        for kernel, best in best_tiles.items():
            lines.append(f"  tiles d{d} {kernel}: best {best['tiles']} {best.get('ms')} ms (launched: "
                         f"{best['current']})")
    from hf_sparse_cp.testing.benchmarking import format_targets

    lines += [f"  target {line}" for line in format_targets(h["verdicts"]).splitlines()]
    return "\n".join(lines)


def main(argv: list[str]) -> dict:
    from transformers import HfArgumentParser

    (args,) = HfArgumentParser(QuickArguments).parse_args_into_dataclasses(argv)
    start = float(os.environ.get("QUICK_START") or time.time())
    deadline = start + args.budget_s
    out = Path(args.out or os.environ.get("OUT") or RESULTS_DIR)
    out.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f"{args.call}-"))
    session_json, log_path = out / f"{args.call}-session.json", out / f"{args.call}.log"
    log_path.write_text("")
    plan = stages(args, out, scratch)
    ran = {stage.name for stage in plan}
    import torch

    from hf_sparse_cp.env import environment

    env = environment(torch.device("cpu" if args.dry_run or not torch.cuda.is_available() else "cuda"))
    report = {"benchmark": "quick_session", "date": datetime.now(UTC).isoformat(timespec="seconds"), "complete": False,
              **env, "command": [sys.executable, *sys.argv] if argv == sys.argv[1:] else ["quick_session.py", *argv],
              "settings": {**dataclasses.asdict(args), "out": str(out), "reserve_s": RESERVE_S},
              "stages": [], "headline": headline(out, scratch, ran)}

    def write() -> None:
        report["headline"] = headline(out, scratch, ran)
        session_json.write_text(json.dumps(report, indent=2) + "\n")

    for stage in plan:
        cap = min(stage.cap_s, deadline - time.time() - RESERVE_S)
        entry = {"name": stage.name, "cap_s": cap, "command": stage.command, "outputs": stage.outputs}
        if cap < MIN_STAGE_S:
            entry.update(status="skipped", reason=f"{cap:.0f} s left before the deadline")
        else:
            print(f"[{args.call}] stage {stage.name} (cap {cap:.0f} s)", flush=True)
            entry.update(run_stage(stage, cap, log_path))
        report["stages"].append(entry)
        write()
    report["complete"] = True
    report["wall_s"] = time.time() - start
    write()
    shutil.rmtree(scratch, ignore_errors=True)
    print(format_summary(report))
    print(f"wrote {session_json} ({report['wall_s']:.0f} s of the {args.budget_s:.0f} s budget)")
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
