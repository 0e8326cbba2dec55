"""`hf-sparse-cp simulate` and benchmarks/simulate_cluster.py end to end (tiny sizes): the report, its
sources and the plot."""

import pytest

from hf_sparse_cp.simulator.simulate import CONFIGURATIONS


def test_simulate_command(tmp_path, monkeypatch):
    """`hf-sparse-cp simulate` writes its rows, their sources and a plot into the current directory (tiny sizes)."""
    import json

    from hf_sparse_cp.cli import main

    pytest.importorskip("matplotlib")
    monkeypatch.chdir(tmp_path)
    assert main(["simulate", "--seq", "32768", "--cp", "8", "16", "--no-mtraining", "--layout-heads", "1"]) == 0
    out = tmp_path / "simulate-cluster_qwen2.5-3b_8xH100-IB400.json"
    assert out.with_suffix(".png").stat().st_size > 0
    report = json.loads(out.read_text())
    rows = report["rows"]
    assert {r["config"] for r in rows} == set(CONFIGURATIONS)
    assert all(r["speedup_vs_dense_ring"] == 1.0 for r in rows if r["config"] == "dense ring")
    assert all(r["step_s"] > 0 and 0.0 <= r["comm_share"] < 1.0 for r in rows)
    assert "anchors.md" in report["calibration"]["sources"]["sparse attention"]
    assert report["cluster"]["inter"]["source"]


def test_simulate_cluster_script_on_a_packed_mix(tmp_path, monkeypatch):
    """benchmarks/simulate_cluster.py (the same code) on a row packing the long-tail mix: every
    configuration runs on the same documents, the planner on its ragged split."""
    import importlib.util
    import sys
    from pathlib import Path

    from hf_sparse_cp.simulator.workloads import mix_lengths

    pytest.importorskip("matplotlib")
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "simulate_cluster.py"
    spec = importlib.util.spec_from_file_location("simulate_cluster", script)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    report = module.main(["--seq", "65536", "--cp", "8", "--mix", "long-tail", "--no-mtraining", "--configs",
                          "dense ring", "striped sparse", "planner sparse", "--json", str(tmp_path / "mix.json")])
    rows = {(r["config"], r["kernel"]): r for r in report["rows"]}
    assert set(rows) == {("dense ring", "cudnn"), ("striped sparse", "flex"), ("striped sparse", "block-only"),
                         ("planner sparse", "flex"), ("planner sparse", "block-only")}
    documents = len(mix_lengths("long-tail", 65536, 0))
    assert documents > 1 and all(r["documents"] == documents for r in rows.values())
    planner, striped = rows[("planner sparse", "flex")], rows[("striped sparse", "flex")]
    assert len(set(planner["local_blocks"])) > 1 and len(set(striped["local_blocks"])) == 1  # ragged vs even
    assert all(r["step_s"] > 0 and 0.0 <= r["comm_share"] < 1.0 for r in rows.values())
