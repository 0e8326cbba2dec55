"""Smoke test of benchmarks/bench_switch.py: the tiny model on 4 gloo processes writes a complete report
whose switch keeps within the memory bound (issue #17's benchmark)."""

import json
import os
import subprocess
import sys

import pytest

from benchmark_loader import BENCHMARKS

SCRIPT = BENCHMARKS / "bench_switch.py"


def _run(*flags: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, str(SCRIPT), *flags], capture_output=True, text=True, timeout=600, env=env,
                          check=False)


@pytest.mark.slow
def test_tiny_switch_report_is_complete_and_within_the_memory_bound(tmp_path):
    out = tmp_path / "switch.json"
    proc = _run("--models", "tiny", "--repeats", "1", "--output", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ckpt/link" in proc.stdout and "peak extra memory" in proc.stdout
    report = json.loads(out.read_text())
    assert report["world"] == 4 and report["device_type"] == "cpu"
    assert [r["target"] for r in report["rows"]] == ["dp x cp nested", "dp x cp transposed"]
    for row in report["rows"]:
        for key in ("switch_s", "link_s", "save_s", "load_s", "restart_s"):
            assert row[key] > 0, key
        assert len(row["switch_runs_s"]) == 1 and row["link_speedup"] > 0
        assert row["switch_peak_extra_bytes"] <= row["shard_bytes"]
    nested, transposed = report["rows"]
    assert nested["switch_peak_extra_bytes"] == 0 < transposed["switch_peak_extra_bytes"]  # only a swap allocates
    memory = report["targets"][-1]
    assert memory["required"] == "<= 1" and memory["pass"] is True


def test_bad_arguments_are_refused_naming_the_fix():
    proc = _run("--models", "huge", "--repeats", "0")
    assert proc.returncode != 0 and "--repeats >= 1" in proc.stderr and "tiny" in proc.stderr
