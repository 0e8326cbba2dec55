"""Smoke test of benchmarks/bench_cp_modes.py: ring, ulysses and hybrid side by side on 4 gloo processes
write a complete report whose layouts computed the same attention."""

import json
import os
import subprocess
import sys

from benchmark_loader import BENCHMARKS


def test_three_layouts_side_by_side_agree_and_report_time_bytes_and_memory(tmp_path):
    out = tmp_path / "modes.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "bench_cp_modes.py"), "--seq", "1024", "--heads", "4",
                           "2", "--head-dim", "16", "--repeats", "1", "--rounds", "1", "--output", str(out)],
                          capture_output=True, text=True, timeout=900, env=env, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "fwd MiB sent" in proc.stdout
    report = json.loads(out.read_text())
    rows = {row["mode"]: row for row in report["rows"]}
    assert list(rows) == ["ring", "ulysses", "hybrid"] and report["args"]["world"] == 4
    for mode, row in rows.items():
        assert len(row["per_rank"]) == 4 and row["step_s"] > 0 and row["peak_extra_bytes_per_rank"] >= 0
        assert row["forward_bytes_per_rank"] > 0 and row["backward_bytes_per_rank"] > 0, mode
        assert row["out_rel_rms_vs_ring"] < 1e-5, mode  # the same attention whichever way it was split
        assert row["kept_fraction"] == rows["ring"]["kept_fraction"]
