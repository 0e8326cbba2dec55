"""Smoke test of benchmarks/bench_switch.py: the tiny model's online CP switch and its two chained jobs
(2 gloo processes here, to keep the three launches short) write a complete, consistent report."""

import json
import os
import subprocess
import sys

import pytest

from benchmark_loader import BENCHMARKS, load_benchmark

SCRIPT = BENCHMARKS / "bench_switch.py"


def _run(*flags: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, str(SCRIPT), *flags], capture_output=True, text=True, timeout=600, env=env,
                          check=False)


def test_tiny_switch_and_chain_report_is_complete_and_consistent(tmp_path):
    out = tmp_path / "switch.json"
    proc = _run("--models", "tiny", "--repeats", "1", "--world", "2", "--output", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "chain/switch" in proc.stdout and "peak RSS of the boundary step" in proc.stdout
    report = json.loads(out.read_text())
    assert report["world"] == 2 and report["device_type"] == "cpu" and report["repeats"] == 1
    (row,) = report["rows"]
    assert row["model"] == "tiny" and row["command"].startswith("hf-sparse-cp train --nproc 2 ")
    assert "--cp_schedule 0:256:1,3:512:2" in row["command"] and "fsdp_version" in row["command"]
    (run,) = row["runs"]
    online, chain = run["online"], run["chain"]
    # steps 1-3 at CP 1, from step 4 on CP 2; the resumed job's first step is step 4, at CP 2, with the same loss
    assert online["cp_size_by_step"] == {str(s): 1 if s <= 3 else 2 for s in range(1, 7)}
    assert chain["resumed_cp_size"] == 2 and row["resumed_step_reproduces_online"] is True
    assert chain["resumed_loss"] == pytest.approx(online["loss_by_step"]["4"], rel=1e-6)
    for key in ("boundary_s", "stage1_steady_s", "stage2_steady_s", "stage_groups_s", "prepare_s"):
        assert online[key] > 0, key
    for key in ("save_s", "exit_s", "restart_s", "build_s", "prepare_load_s", "first_step_s"):
        assert chain[key] > 0, key
    assert online["boundary_s"] == online["step_s"]["4"]
    assert online["switch_s"] == pytest.approx(online["boundary_s"] + online["stage_groups_s"])
    phases = sum(chain[k] for k in ("save_s", "exit_s", "relaunch_gap_s", "restart_s", "build_s", "prepare_load_s",
                                    "first_step_s"))
    assert chain["total_s"] == pytest.approx(phases, rel=1e-9)
    assert chain["total_s"] > chain["restart_s"]
    assert run["speedup"] == pytest.approx(chain["total_s"] / online["switch_s"])
    assert 0 < row["state_bytes_per_rank"] < online["process_peak_rss_bytes"]
    speed, memory, same = report["targets"]
    assert speed["required"] == ">= 20x" and speed["measured"] == row["speedup"]
    assert speed["pass"] == (row["speedup"] >= 20)
    assert memory["required"] == "<= 1" and memory["measured"] == pytest.approx(
        row["boundary_peak_extra_bytes"] / row["state_bytes_per_rank"])
    assert same["pass"] is True


def test_bad_arguments_are_refused_naming_the_fix():
    """Refused as the arguments are read, before any process starts: checked in this process (a fresh interpreter
    only to read its arguments cost seconds of imports)."""
    with load_benchmark("bench_switch") as bench, pytest.raises(SystemExit) as refused:
        bench.main(["--models", "huge", "--repeats", "0"])
    message = str(refused.value.code)  # (SystemExit with a message: exit status 1, the message on stderr)
    assert "--repeats >= 1" in message and "tiny" in message
