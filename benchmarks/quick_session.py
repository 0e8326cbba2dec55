"""Every headline figure in one short GPU call (`bash benchmarks/gpu_session.sh quick`, issue #32).

GPU calls here are rare and short (about 10 minutes of machine time, the start included), so one call
must bring back everything that matters. This script runs three stages in order of value, each a
subprocess with its own cap, under one global deadline (`--budget_s`, 480 s by default, counted from
`$QUICK_START` when the shell wrapper set it, i.e. before its installs), and writes its JSON after
every stage; the stages' own scripts write theirs as soon as they have a number:

(a) tests: the gpu-marked correctness tests of both engines at small sizes (tests/kernels/test_flex_gpu.py,
    then tests/kernels/test_kernels_gpu.py, without the 32K and fp16 cases: every new shape or dtype costs
    a compilation), outcomes parsed from pytest's log; what the cap cuts off is reported as not run;
(b) attention: `bench_attention.py` at 32K and 128K, head_dim 128, GQA 16/2, vertical-slash layouts at
    ~5% and ~20% kept and the dense causal layout: our kernels, the flex engine and auto on each,
    cuDNN and flash SDPA on the dense one; forward + backward only; it also writes the engine table;
(c) e2e: `bench_e2e.py`, a Qwen2.5-0.5B-shaped training step (random init, bf16, the lean loss,
    gradient checkpointing) at 64K and 128K for sparse_cp, then sparse_cp and sdpa with liger-kernel's
    kernels (when its wheel is in .whl/: carry it, the loss and both liger rows depend on it), and sdpa;
    then each variant that ran at 128K doubles on to 1M: the longest length it fits.
    sparse_cp's 'auto' engine reads the table stage (b) wrote.

A stage that fails or is cut off by its cap does not stop the next; what it wrote stays. Files (at
most 8 come back from a GPU call): quick-session.json (device, versions, the command, settings, each
stage's status, cap, time and outputs, the tests' outcomes, the headline figures), quick.log (every
stage's output), attention.json, engine_table.json, e2e.json, in `$OUT` or `--out`, else
benchmarks/results/. `benchmarks/results/README.md` says how to read them.

`--dry-run` runs the same stages with the same JSON on the CPU at tiny sizes (our kernels in Triton's
interpreter; the gpu-marked tests are collected and skipped), so the script cannot rot between GPU
runs: tests/integration/test_quick_session.py runs it.

    bash benchmarks/gpu_session.sh quick               # on the lent GPU machine
    python benchmarks/quick_session.py --dry-run --out /tmp/quick
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = ROOT / "benchmarks" / "results"
SESSION_JSON, LOG = "quick-session.json", "quick.log"
# Seconds kept after the last stage for the summary, and the least a stage is started with.
RESERVE_S, MIN_STAGE_S = 10.0, 20.0
# A stage whose cap is reached gets SIGTERM, then SIGKILL after this many seconds.
KILL_GRACE_S = 10.0
PYTEST_OUTCOME = re.compile(r"^(\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")
PYTEST_COLLECTED = re.compile(r"\bcollected (\d+) items?(?: / (\d+) deselected)?")
PYTEST_SUMMARY = re.compile(r"^=+ .*\b(passed|failed|skipped|error|errors|deselected|no tests ran)\b.* =+$")


@dataclass
class QuickArguments:
    dry_run: bool = field(
        default=False,
        metadata={"help": "The same stages and JSON on the CPU at tiny sizes (Triton's interpreter): checks the "
                  "script, measures nothing of a GPU."},
    )
    budget_s: float = field(default=480.0, metadata={"help": "Global deadline in seconds, from $QUICK_START if set."})
    out: str | None = field(default=None, metadata={"help": "Output folder; default $OUT, else benchmarks/results/."})
    tests_cap_s: float = field(default=120.0, metadata={"help": "Cap of stage (a), the gpu-marked tests."})
    attention_cap_s: float = field(default=200.0, metadata={"help": "Cap of stage (b), the attention benchmark."})
    e2e_cap_s: float = field(default=300.0, metadata={"help": "Cap of stage (c), the training steps."})


@dataclass(frozen=True)
class Stage:
    name: str
    cap_s: float
    command: list[str]
    outputs: list[str]  # the JSON files it writes, in the output folder
    env: dict[str, str] = field(default_factory=dict)
    # variables naming a file, set only when the file exists as the stage starts (an earlier stage wrote it)
    env_files: dict[str, str] = field(default_factory=dict)


def stages(args: QuickArguments, out: Path) -> list[Stage]:
    """The three stages, their commands at full (GPU) or tiny (--dry-run) sizes."""
    py = sys.executable
    tests = [py, "-m", "pytest", "-v", "-m", "gpu", "-p", "no:cacheprovider", "tests/kernels/test_flex_gpu.py",
             "tests/kernels/test_kernels_gpu.py", "-k", "not 32K and not fp16"]
    attention = [py, "benchmarks/bench_attention.py", "--densities", "0.05", "0.2", "--estimated_budgets", "",
                 "--variants", "ours", "flex_engine", "auto", "sdpa_cudnn", "sdpa_flash", "--time_forward", "false",
                 "--profile_seq_lens", "0", "--output", str(out / "attention.json"),
                 "--engine_table", str(out / "engine_table.json")]
    e2e = [py, "benchmarks/bench_e2e.py", "--variants", "sparse_cp", "sparse_cp+liger", "sdpa+liger", "sdpa",
           "--profile_seq_lens", "0",
           "--output", str(out / "e2e.json")]
    if args.dry_run:
        attention += ["--dry_run", "--seq_lens", "64", "128", "--block_size", "32", "--num_q_heads", "2",
                      "--num_kv_heads", "1", "--head_dim", "16", "--num_verticals", "4", "--dtype", "float16",
                      "--warmup", "0", "--repeats", "1"]
        e2e += ["--tiny", "--device", "cpu", "--min_seq", "256", "--max_seq", "256", "--fit_max_seq", "512",
                "--warmup_steps", "0", "--timed_steps", "1", "--timeout_s", "120"]
        attention_env = {"TRITON_INTERPRET": "1"}
    else:
        attention += ["--seq_lens", "32768", "131072", "--warmup", "1", "--repeats", "5"]
        e2e += ["--models", "0.5b", "--min_seq", "65536", "--max_seq", "131072", "--fit_max_seq", "1048576",
                "--warmup_steps", "1", "--timed_steps", "2", "--timeout_s", "150"]
        attention_env = {}
    from hf_sparse_cp.attention.engines import TABLE_ENV

    return [
        Stage("tests", args.tests_cap_s, tests, []),
        Stage("attention", args.attention_cap_s, attention, ["attention.json", "engine_table.json"], attention_env),
        Stage("e2e", args.e2e_cap_s, e2e, ["e2e.json"], env_files={TABLE_ENV: str(out / "engine_table.json")}),
    ]


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


def pytest_outcomes(log_text: str) -> dict:
    """The tests' outcomes from a `pytest -v` log (complete or cut off): how many were selected, counts per
    outcome, the tests that failed or errored, and whether pytest reached its summary line (those
    selected and not counted did not run)."""
    outcomes, selected = {}, None
    for line in log_text.splitlines():
        m = PYTEST_OUTCOME.match(line)
        if m:
            outcomes[m.group(1)] = m.group(2).lower()
        m = PYTEST_COLLECTED.search(line)
        if m:
            selected = int(m.group(1)) - int(m.group(2) or 0)
    counts = {k: sum(1 for v in outcomes.values() if v == k) for k in ("passed", "failed", "error", "skipped")}
    return {"selected": selected, **counts,
            "not_passed": sorted(t for t, v in outcomes.items() if v in ("failed", "error")),
            "finished": any(PYTEST_SUMMARY.match(line) for line in log_text.splitlines())}


def _read(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def headline(out: Path) -> dict:
    """The figures the README's tables take, from the stages' JSON: attention fwd+bwd ms per (S, layout,
    variant), the engine targets, e2e tokens/s and peak memory per (variant, S), the longest fits."""
    attention, e2e = _read(out / "attention.json") or {}, _read(out / "e2e.json") or {}
    return {
        "attention_fwd_bwd_ms": [{k: r.get(k) for k in ("seq_len", "layout", "variant", "density", "status",
                                                        "fwd_bwd_ms", "auto_engine")}
                                 for r in attention.get("results", [])],
        "engine_targets": attention.get("engine_targets", []),
        "e2e": [{k: r.get(k) for k in ("model", "variant", "seq_len", "status", "tokens_per_s", "peak_gib",
                                       "kept_fraction")} for r in e2e.get("results", [])],
        "longest_fit": e2e.get("longest_fit", []),
        "e2e_targets": e2e.get("targets", []),
    }


def format_summary(report: dict) -> str:
    lines = [f"quick session on {report['device']} (torch {report['torch']}, triton {report['triton']}, "
             f"transformers {report['transformers']}){' DRY RUN (CPU)' if report['settings']['dry_run'] else ''}"]
    for s in report["stages"]:
        wall = f"{s['wall_s']:.0f} s" if s.get("wall_s") is not None else "-"
        lines.append(f"  stage {s['name']:<9} {s['status']:<8} {wall:>6} of cap {s['cap_s']:.0f} s")
    t = report.get("tests")
    if t:
        lines.append(f"  tests: {t['selected']} selected: {t['passed']} passed, {t['failed']} failed, {t['error']} "
                     f"errors, {t['skipped']} skipped{'' if t['finished'] else ' (cut off)'}"
                     + "".join(f"\n    {n}" for n in t["not_passed"]))
    h = report["headline"]
    for r in h["attention_fwd_bwd_ms"]:
        shown = f"{r['fwd_bwd_ms']:.2f} ms" if r["status"] == "ok" else r["status"]
        pick = f" (picked {r['auto_engine']})" if r.get("auto_engine") else ""
        lines.append(f"  attention {r['seq_len'] // 1024}K {r['layout']:<8} {r['variant']:<12} fwd+bwd {shown}{pick}")
    for r in h["e2e"]:
        shown = (f"{r['tokens_per_s']:.0f} tokens/s, {r['peak_gib']:.1f} GiB" if r["status"] == "ok" else r["status"])
        lines.append(f"  e2e {r['model']} {r['variant']:<11} {r['seq_len'] // 1024}K: {shown}")
    for f in h["longest_fit"]:
        longest = f"{f['seq_len'] // 1024}K" if f["seq_len"] else "nothing"
        lines.append(f"  longest fit {f['model']} {f['variant']}: {longest} (then {f['ended_by']})")
    for t in h["engine_targets"] + h["e2e_targets"]:
        verdict = "not measured" if t["pass"] is None else ("PASS" if t["pass"] else "MISS")
        value = "" if t["measured"] is None else f"{t['measured']:.3f} " if isinstance(t["measured"], float) else \
            f"{t['measured']} "
        lines.append(f"  target {t['target']}: {value}(required {t['required']}) {verdict}")
    return "\n".join(lines)


def main(argv: list[str]) -> dict:
    from transformers import HfArgumentParser

    (args,) = HfArgumentParser(QuickArguments).parse_args_into_dataclasses(argv)
    start = float(os.environ.get("QUICK_START") or time.time())
    deadline = start + args.budget_s
    out = Path(args.out or os.environ.get("OUT") or RESULTS_DIR)
    out.mkdir(parents=True, exist_ok=True)
    log_path = out / LOG
    log_path.write_text("")
    import torch

    from hf_sparse_cp.env import environment

    env = environment(torch.device("cpu" if args.dry_run or not torch.cuda.is_available() else "cuda"))
    report = {"benchmark": "quick_session", "date": datetime.now(UTC).isoformat(timespec="seconds"), "complete": False,
              **env, "command": [sys.executable, *sys.argv] if argv == sys.argv[1:] else ["quick_session.py", *argv],
              "settings": {**dataclasses.asdict(args), "out": str(out), "reserve_s": RESERVE_S},
              "stages": [], "tests": None, "headline": headline(out)}

    def write() -> None:
        report["headline"] = headline(out)
        (out / SESSION_JSON).write_text(json.dumps(report, indent=2) + "\n")

    for stage in stages(args, out):
        cap = min(stage.cap_s, deadline - time.time() - RESERVE_S)
        entry = {"name": stage.name, "cap_s": cap, "command": stage.command, "outputs": stage.outputs}
        if cap < MIN_STAGE_S:
            entry.update(status="skipped", reason=f"{cap:.0f} s left before the deadline")
        else:
            print(f"[quick] stage {stage.name} (cap {cap:.0f} s)", flush=True)
            log_start = log_path.stat().st_size
            entry.update(run_stage(stage, cap, log_path))
            if stage.name == "tests":
                report["tests"] = pytest_outcomes(log_path.read_text()[log_start:])
        report["stages"].append(entry)
        write()
    report["complete"] = True
    report["wall_s"] = time.time() - start
    write()
    print(format_summary(report))
    print(f"wrote {out / SESSION_JSON} ({report['wall_s']:.0f} s of the {args.budget_s:.0f} s budget)")
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
