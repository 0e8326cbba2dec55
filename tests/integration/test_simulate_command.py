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


def test_the_simulator_reads_the_density_at_each_length_from_the_curve(tmp_path, monkeypatch):
    """`hf-sparse-cp simulate` draws each length's sparse layout at the curve's kept share, and labels the
    rows with its basis; --density still sets one share; the first layer is dense by default."""
    import json

    from hf_sparse_cp.simulator import simulate_cli
    from hf_sparse_cp.simulator.kept_curve import DEFAULT_CURVE

    pytest.importorskip("matplotlib")
    monkeypatch.chdir(tmp_path)
    base = ["--seq", "32768", "--cp", "8", "--no-mtraining", "--layout-heads", "1", "--configs", "dense ring",
            "striped sparse"]
    report = simulate_cli.main(base)
    sparse = [r for r in report["rows"] if r["config"] == "striped sparse"]
    expected = DEFAULT_CURVE.at(32768)
    assert all(r["kept_target"] == expected.kept and r["kept_basis"] == expected.basis for r in sparse)
    assert all(r["kept_source"] == DEFAULT_CURVE.source for r in sparse)  # the measurement, its model and layers
    # the layout's share: the curve's diagonals and the 1000 verticals' blocks on top
    assert all(expected.kept <= r["kept"] < expected.kept + 0.05 and r["dense_layers"] == 1 for r in sparse)
    given = simulate_cli.main([*base, "--density", "0.05", "--dense-first-layers", "0"])
    sparse_given = [r for r in given["rows"] if r["config"] == "striped sparse"]
    assert all(r["kept_basis"] == "given" and r["dense_layers"] == 0 for r in sparse_given)
    assert all(r["kept_target"] == 0.05 and r["kept"] < min(x["kept"] for x in sparse) for r in sparse_given)
    report_of_a_curve = {"model": "tiny", "settings": {}, "curve_settings": {"defaults": {}}, "lengths": {
        str(s): {"seq_len": s, "beyond_context": False, "settings": {"defaults": {
            "kept_sparse_layers": kept, "width_share_max": kept}}} for s, kept in ((8192, 0.5), (32768, 0.3))}}
    path = tmp_path / "curve.json"
    path.write_text(json.dumps(report_of_a_curve))
    own = simulate_cli.main([*base, "--kept-curve", str(path)])
    assert {r["kept_basis"] for r in own["rows"] if r["config"] == "striped sparse"} == {"measured"}
    with pytest.raises(SystemExit, match="--kept-curve"):
        simulate_cli.main([*base, "--kept-curve", str(tmp_path / "missing.json")])
