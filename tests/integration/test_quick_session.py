"""benchmarks/gpu_session.sh quick: its --dry-run end to end on the CPU (the same stages and JSON as the
GPU run, at tiny sizes, our kernels in Triton's interpreter), so the script cannot rot between GPU
runs; and the orchestration's parts: the caps, the deadline, pytest's outcomes from a cut-off log."""

import json
import os
import subprocess
import sys
import time

import pytest

from benchmark_loader import BENCHMARKS, load_benchmark


@pytest.fixture(scope="module")
def quick():
    with load_benchmark("quick_session") as module:
        yield module


def test_dry_run_runs_every_stage_and_writes_the_gpu_schema(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    env.pop("QUICK_START", None)
    start = time.monotonic()
    proc = subprocess.run(["bash", str(BENCHMARKS / "gpu_session.sh"), "quick", "--dry-run"], capture_output=True,
                          text=True, timeout=900, env=env, check=False)
    wall = time.monotonic() - start
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert {p.name for p in tmp_path.iterdir()} == {"quick-session.json", "quick.log", "attention.json",
                                                     "engine_table.json", "e2e.json"}
    session = json.loads((tmp_path / "quick-session.json").read_text())
    assert session["complete"] and session["settings"]["dry_run"] and session["device_type"] == "cpu"
    assert [(s["name"], s["status"]) for s in session["stages"]] == [("tests", "ok"), ("attention", "ok"),
                                                                     ("e2e", "ok")]
    assert session["wall_s"] <= session["settings"]["budget_s"] and wall < 900
    tests = session["tests"]  # the gpu-marked tests of both engines, collected and skipped on the CPU
    assert tests["finished"] and tests["skipped"] == tests["selected"] >= 20
    assert tests["passed"] == tests["failed"] == tests["error"] == 0

    attention = json.loads((tmp_path / "attention.json").read_text())
    assert attention["complete"] and attention["command"] and attention["settings"]["dry_run"]
    rows = {(r["seq_len"], r["layout"], r["variant"]): r for r in attention["results"]}
    for s in (64, 128):
        for layout in ("vs@5%", "vs@20%", "dense"):
            assert rows[(s, layout, "ours")]["status"] == "ok"  # our kernels, interpreted
            assert rows[(s, layout, "auto")]["auto_engine"] == "reference"  # auto off CUDA
            assert "CUDA" in rows[(s, layout, "flex_engine")]["reason"]  # no Flex backward on CPU
        assert rows[(s, "dense", "sdpa_flash")]["status"] == "ok"
    assert [c["status"] for c in attention["checks"]] == ["pass"] * 2  # ours == the flex engine (forward), first S
    assert len(attention["engine_targets"]) == 3
    table = json.loads((tmp_path / "engine_table.json").read_text())
    assert table["kind"] == "hf_sparse_cp engine table" and table["rows"] == []  # no flex fwd+bwd on CPU

    e2e = json.loads((tmp_path / "e2e.json").read_text())
    assert e2e["complete"] and {(r["variant"], r["seq_len"], r["status"]) for r in e2e["results"]} == {
        ("sparse_cp", 256, "ok"), ("sparse_cp+liger", 256, "skipped"), ("sdpa+liger", 256, "skipped"),
        ("sdpa", 256, "ok"), ("sparse_cp", 512, "ok"), ("sdpa", 512, "ok")}
    fits = {f["variant"]: (f["seq_len"], f["ended_by"]) for f in e2e["longest_fit"]}
    assert fits == {"sparse_cp": (512, "cap"), "sparse_cp+liger": (None, "skipped"),
                    "sdpa+liger": (None, "skipped"), "sdpa": (512, "cap")}
    headline = session["headline"]
    assert len(headline["attention_fwd_bwd_ms"]) == len(attention["results"]) and headline["longest_fit"] == \
        e2e["longest_fit"]
    assert "stage attention ok" in " ".join(proc.stdout.split())
    print(f"quick --dry-run: {wall:.0f} s wall")


def test_a_stage_past_its_cap_is_killed_with_its_children(quick, tmp_path):
    """SIGTERM to the stage's whole process group at the cap (a child it started dies too)."""
    marker = tmp_path / "child-alive"
    child = f"import time, pathlib; time.sleep(3); pathlib.Path({str(marker)!r}).write_text('x')"
    parent = f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {child!r}]); time.sleep(60)"
    stage = quick.Stage("slow", 60.0, [sys.executable, "-c", parent], [])
    result = quick.run_stage(stage, 1.0, tmp_path / "log")
    assert result["status"] == "timeout" and result["wall_s"] < 30  # killed at its 1 s cap: far below its 60 s
    time.sleep(4)
    assert not marker.exists()
    assert "==== stage slow: timeout" in (tmp_path / "log").read_text()


def test_stages_past_the_deadline_are_skipped_and_reported(quick, tmp_path, monkeypatch):
    monkeypatch.setenv("QUICK_START", str(time.time() - 1000))  # the budget is spent before the first stage
    report = quick.main(["--dry-run", "--out", str(tmp_path)])
    assert report["complete"] and [s["status"] for s in report["stages"]] == ["skipped"] * 3
    assert json.loads((tmp_path / "quick-session.json").read_text())["stages"][0]["reason"].endswith("deadline")


def test_pytest_outcomes_from_a_cut_off_log(quick):
    log = "\n".join([
        "collecting ... collected 12 items / 2 deselected / 10 selected",
        "tests/kernels/test_flex_gpu.py::test_a[x] PASSED                 [ 10%]",
        "tests/kernels/test_flex_gpu.py::test_b FAILED                    [ 20%]",
        "tests/kernels/test_kernels_gpu.py::test_c[y-z] SKIPPED (needs a CUDA GPU) [ 30%]",
        "tests/kernels/test_kernels_gpu.py::test_d ERROR                  [ 40%]",
    ])
    got = quick.pytest_outcomes(log)
    assert (got["selected"], got["passed"], got["failed"], got["skipped"], got["error"]) == (10, 1, 1, 1, 1)
    assert got["not_passed"] == ["tests/kernels/test_flex_gpu.py::test_b", "tests/kernels/test_kernels_gpu.py::test_d"]
    assert not got["finished"]
    assert quick.pytest_outcomes(log + "\n======= 1 failed, 1 passed, 1 skipped, 1 error in 3.2s =======")["finished"]
