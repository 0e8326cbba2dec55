"""The kept fraction at a length from a measured curve (#43 item 4), and what the simulator and the memory model
take from it: the density of a predicted step's sparse layers, the dense first layers' cost, the layout width."""

import json
import math
import re
from pathlib import Path

import pytest
import torch

from hf_sparse_cp import SparseAttentionConfig
from hf_sparse_cp.attention.build import dense_layout
from hf_sparse_cp.attention.tokens import TokenMeta
from hf_sparse_cp.simulator.kept_curve import DEFAULT_CURVE, KeptCurve, KeptPoint
from hf_sparse_cp.simulator.memory_model.presets import PRESETS
from hf_sparse_cp.simulator.memory_model.settings import StepSettings
from hf_sparse_cp.simulator.memory_model.step import predict_step_memory
from hf_sparse_cp.simulator.shapes import MODELS
from hf_sparse_cp.simulator.simulate import CONFIGURATIONS, Workload
from hf_sparse_cp.simulator.step_model import CLUSTERS, HARDWARE, predict_step, with_causal_layout
from hf_sparse_cp.simulator.workloads import random_vertical_slash_layout

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


def power_curve(a: float, b: float, lengths=(1024, 2048, 4096, 8192), **extra) -> KeptCurve:
    return KeptCurve(tuple(KeptPoint(s, a * s ** b, min(1.0, 2 * a * s ** b)) for s in lengths)
                     + tuple(extra.get("beyond", ())), "test curve")


def test_a_power_law_is_read_back_at_every_length_with_its_basis():
    """Measured at a measured length, interpolated between two (log-log), extrapolated outside them: on points
    of an exact power law every answer lies on it."""
    a, b = 20.0, -0.55
    curve = power_curve(a, b)
    for s, basis in ((4096, "measured"), (3000, "interpolated"), (6000, "interpolated"), (131072, "extrapolated"),
                     (1 << 20, "extrapolated"), (512, "extrapolated")):
        at = curve.at(s)
        assert at.basis == basis and at.seq_len == s
        assert at.kept == pytest.approx(min(1.0, a * s ** b), rel=1e-9)
        assert at.source == "test curve"


def test_lengths_past_the_trained_context_are_never_used():
    """A point flagged beyond the model's context (where its attention spreads) changes no answer."""
    plain = power_curve(20.0, -0.55)
    flagged = power_curve(20.0, -0.55, beyond=(KeptPoint(16384, 0.9, 0.95, beyond_context=True),))
    for s in (6000, 16384, 131072):
        assert flagged.at(s) == plain.at(s)
    assert flagged.at(16384).basis == "extrapolated"


def test_extrapolation_follows_the_longest_two_octaves():
    """Past the longest length the trend of the longest measured lengths (a quarter of it and up) continues, not
    the short lengths' flatter start."""
    curve = KeptCurve((KeptPoint(1024, 0.95, 1.0), KeptPoint(2048, 0.94, 1.0), KeptPoint(4096, 0.8, 0.9),
                       KeptPoint(8192, 0.6, 0.7)), "bent")
    tail = ((2048, 0.94), (4096, 0.8), (8192, 0.6))
    xs, ys = [math.log(s) for s, _ in tail], [math.log(k) for _, k in tail]
    mx, my = sum(xs) / 3, sum(ys) / 3
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    expected = math.exp(my + b * (math.log(65536) - mx))
    assert curve.at(65536).kept == pytest.approx(expected, rel=1e-9)


def test_shares_stay_between_the_diagonal_and_everything():
    """A steep fall stops at what every layout keeps (each query block row's own block); a rise stops at 1."""
    falling = power_curve(1e4, -1.5)
    at = falling.at(1 << 24)
    rows = (1 << 24) // 128
    assert at.kept == pytest.approx(2 / (rows + 1)) and at.width_share == pytest.approx(1 / rows)
    assert power_curve(0.002, 0.6).at(1 << 24).kept == 1.0


def test_a_curve_without_a_usable_point_or_with_shares_outside_0_1_is_refused():
    with pytest.raises(ValueError, match="no measured length inside"):
        KeptCurve((KeptPoint(16384, 0.3, 0.4, beyond_context=True),), "only past the context")
    with pytest.raises(ValueError, match=r"must be in \(0, 1\]"):
        KeptCurve((KeptPoint(1024, 1.2, 1.0),), "bad")


def curve_report(tmp_path, lengths: dict) -> Path:
    report = {"model": "tiny", "settings": {"block_size": 64}, "curve_settings": {"defaults": {}, "other": {
        "block_size": 64}}, "lengths": {str(s): {"seq_len": s, "beyond_context": beyond, "settings": {
            name: {"kept_sparse_layers": kept, "width_share_max": width} for name in ("defaults", "other")}}
        for s, (kept, width, beyond) in lengths.items()}}
    path = tmp_path / "curve.json"
    path.write_text(json.dumps(report))
    return path


def test_a_report_is_read_with_its_settings_block_size_and_wrong_files_are_named(tmp_path):
    path = curve_report(tmp_path, {1024: (0.9, 1.0, False), 2048: (0.7, 0.8, False), 4096: (0.5, 0.6, True)})
    curve = KeptCurve.from_report(path)
    assert curve.block_size == 128  # the defaults' block size, not the report's other modes'
    assert curve.measures(SparseAttentionConfig(min_seq_len=4096, attention_engine="triton"))
    assert not curve.measures(SparseAttentionConfig(mass_target=0.95))
    assert KeptCurve.from_report(path, "other").block_size == 64
    assert [p.seq_len for p in curve.usable] == [1024, 2048] and curve.points[-1].beyond_context
    assert curve.at(2048).kept == 0.7 and "curve.json (defaults, tiny, every layer)" in curve.source
    with pytest.raises(ValueError, match=r"no setting 'nope'; it has \['defaults', 'other'\]"):
        KeptCurve.from_report(path, "nope")
    # a report that spells out each setting's pattern is read by it, not by today's defaults
    report = json.loads(path.read_text())
    report["patterns"] = {"defaults": SparseAttentionConfig(min_seq_len=0, local_window=256).to_dict(),
                          "other": SparseAttentionConfig(min_seq_len=0, block_size=64).to_dict()}
    path.write_text(json.dumps(report))
    assert KeptCurve.from_report(path).measures(SparseAttentionConfig(local_window=256))
    assert not KeptCurve.from_report(path).measures(SparseAttentionConfig())
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"lengths": {}}))
    with pytest.raises(ValueError, match="other.json is not a kept-fraction curve"):
        KeptCurve.from_report(other)
    other.write_text("not json")
    with pytest.raises(ValueError, match="other.json: not JSON; give a report that benchmarks/pattern_quality.py"):
        KeptCurve.from_report(other)
    other.write_bytes(b"\x88\x0b\x00\x00{\"__metadata__\": \xff\xfe}")  # (a binary file: 'utf-8' codec can't...)
    with pytest.raises(ValueError, match="other.json: not JSON; give a report that benchmarks/pattern_quality.py"):
        KeptCurve.from_report(other)
    with pytest.raises(ValueError, match="missing.json: No such file or directory; give a report"):
        KeptCurve.from_report(tmp_path / "missing.json")


def test_the_shipped_curve_is_the_committed_measurement():
    """The package data holds the report its source names (in benchmarks/results), labelled with its model and
    layers, and that report measured today's defaults."""
    report = RESULTS / DEFAULT_CURVE.source.split(" ")[0]
    measured = KeptCurve.from_report(report)
    assert measured == DEFAULT_CURVE
    data = json.loads(report.read_text())
    assert all(p.beyond_context == (p.seq_len > data["trained_context"]) for p in DEFAULT_CURVE.points)
    assert data["model"] in DEFAULT_CURVE.source and "layer" in DEFAULT_CURVE.source
    # it measured today's defaults: a change of the defaults fails here until the curve is measured again
    assert DEFAULT_CURVE.measures(SparseAttentionConfig())
    assert not DEFAULT_CURVE.measures(SparseAttentionConfig(local_window=256))


def test_the_shipped_curve_file_is_written_from_a_report(tmp_path, monkeypatch, capsys):
    """`python -m hf_sparse_cp.simulator.kept_curve REPORT` writes what DEFAULT_CURVE reads back the same."""
    from hf_sparse_cp.simulator import kept_curve

    path = curve_report(tmp_path, {1024: (0.9, 1.0, False), 2048: (0.7, 0.8, False), 4096: (0.5, 0.6, True)})
    monkeypatch.setattr(kept_curve, "DEFAULT_CURVE_FILE", tmp_path / "shipped.json")
    kept_curve.main([str(path), "--setting", "other"])
    written = KeptCurve.from_dict(json.loads((tmp_path / "shipped.json").read_text()))
    assert written == KeptCurve.from_report(path, "other") and written.points[-1].beyond_context
    assert KeptCurve.from_dict(DEFAULT_CURVE.to_dict()) == DEFAULT_CURVE
    # a report not there, or without the setting: a usage error naming it (a traceback), the shipped file untouched
    shipped = (tmp_path / "shipped.json").read_text()
    for argv, said in (([str(tmp_path / "missing.json")], "missing.json: No such file or directory"),
                       ([str(path), "--setting", "nosuch"], "nosuch")):
        with pytest.raises(SystemExit) as ended:
            kept_curve.main(argv)
        assert ended.value.code == 2 and said in capsys.readouterr().err
    assert (tmp_path / "shipped.json").read_text() == shipped


def ring(s: int = 131072, cp: int = 8):
    layouts = {"sparse": random_vertical_slash_layout(1, 2, s, 128, num_diagonals=6, num_verticals=64,
                                                      sink_tokens=32, generator=torch.Generator().manual_seed(0)),
               "dense": dense_layout(TokenMeta.contiguous(1, s), 128)}
    workload = Workload((s,), ("sparse",), lambda kind, plan: layouts[kind])
    setup = CONFIGURATIONS["striped sparse"](workload, cp, 128, 8)
    return setup, with_causal_layout(setup, layouts["dense"])


def test_dense_first_layers_cost_the_causal_ring_each():
    """Each dense layer replaces a sparse one by the same ring over the causal layout without estimation: the
    step grows by the same amount per layer, and the dense layers' share of the attention is theirs."""
    setup, dense = ring()
    model, hw, cluster = MODELS["qwen2.5-3b"], HARDWARE["8xH100-IB400"](), CLUSTERS["8xH100-IB400"]
    steps = [predict_step(setup, model, hw, cluster, dense_layers=n, dense=dense) for n in (0, 1, 2)]
    assert steps[0]["dense_layers"] == 0 and steps[0]["dense_layers_attention_share"] == 0
    one = steps[1]["step_s"] - steps[0]["step_s"]
    assert one > 0 and steps[2]["step_s"] - steps[0]["step_s"] == pytest.approx(2 * one, rel=1e-9)
    share = steps[1]["dense_layers_attention_share"]
    assert 1 / model.layers < share < 1  # one causal layer outweighs one sparse layer of ~1% of the blocks
    assert steps[1]["attention_fwd_s"] == steps[0]["attention_fwd_s"]  # the sparse layers' ring is unchanged
    with pytest.raises(ValueError, match="dense_layers needs `dense`"):
        predict_step(setup, model, hw, cluster, dense_layers=1)
    with pytest.raises(ValueError, match="within the model's 0-36 layers"):
        predict_step(setup, model, hw, cluster, dense_layers=37, dense=dense)


def test_the_memory_model_sizes_mass_layouts_from_the_curve():
    """A budget that bounds no diagonals (the default 'mass'): the layout is as wide as the curve says at the
    length (labelled), not every block of the row; a top-k budget keeps its bound; `kept_curve=None` the bound."""
    arch, s = PRESETS["qwen2.5-3b"], 1 << 20
    curve = predict_step_memory(arch, s, StepSettings(cp=8))
    bound = predict_step_memory(arch, s, StepSettings(cp=8, kept_curve=None))
    rows = s // 128
    width = math.ceil(DEFAULT_CURVE.at(s).width_share * rows)
    assert curve.layout_width.startswith(f"{width} blocks") and "extrapolated" in curve.layout_width
    assert bound.layout_width.startswith(f"{rows} blocks") and width < rows
    assert curve.terms("backward")["attention layouts"] < bound.terms("backward")["attention layouts"]
    assert curve.peak_bytes < bound.peak_bytes
    topk = StepSettings(cp=8, pattern=SparseAttentionConfig(budget_mode="topk"))
    assert "budget's bound" in predict_step_memory(arch, s, topk).layout_width
    # a pattern the curve did not measure (here layer 0 sparse, whose rows run full width) is sized at the bound
    layer0 = predict_step_memory(arch, s, StepSettings(cp=8, pattern=SparseAttentionConfig(dense_first_layers=0)))
    assert layer0.layout_width.startswith(f"{rows} blocks") and "measured another pattern" in layer0.layout_width
    assert curve.to_dict()["layout_width"] == curve.layout_width


def _broken(report: dict, change) -> dict:
    broken = json.loads(json.dumps(report))
    change(broken)
    return broken


@pytest.mark.parametrize("change, named", [
    (lambda r: r.pop("lengths"), r"lengths is missing; it must hold a mapping of each measured length in tokens"),
    (lambda r: r["lengths"]["1024"].pop("settings"), r"lengths\['1024'\]\['settings'\] is missing; it must hold a "
                                                     "mapping of each setting's name"),
    (lambda r: r["lengths"]["1024"]["settings"]["defaults"].update(kept_sparse_layers="0.9"),
     r"lengths\['1024'\]\['settings'\]\['defaults'\]\['kept_sparse_layers'\] is '0.9'; it must hold a number in "
     r"\(0, 1\]"),
    (lambda r: r["lengths"].update(abc=r["lengths"]["1024"]),
     r"lengths\['abc'\]: a key of 'lengths' must be a sequence length in tokens, a whole number such as \"1024\""),
    (lambda r: r["lengths"]["2048"].update(beyond_context="no"), r"lengths\['2048'\]\['beyond_context'\] is 'no'; "
                                                                 "it must hold true or false"),
    (lambda r: r.update(curve_settings=["defaults"]), r"curve_settings is \['defaults'\]; it must hold a mapping"),
    (lambda r: r["curve_settings"].update(defaults={"no_such_field": 1}), r"curve_settings\['defaults'\] is not a "
                                                                          "pattern: .*no_such_field"),
], ids=["no-lengths", "no-settings", "share-as-text", "length-key-abc", "beyond-as-text", "settings-a-list",
        "unknown-field"])
def test_a_curve_shaped_otherwise_names_the_file_the_entry_and_what_it_must_hold(tmp_path, capsys, change, named):
    """Every command that reads a curve (`from_report`, `hf-sparse-cp simulate` and `memory --kept-curve`) refuses
    a report shaped otherwise than pattern_quality.py --curve writes it, naming the file, the entry and what it must
    hold, instead of a bare key, a TypeError or int()'s message."""
    from hf_sparse_cp.simulator import memory_cli, simulate_cli

    good = json.loads(curve_report(tmp_path, {1024: (0.9, 1.0, False), 2048: (0.7, 0.8, False)}).read_text())
    path = tmp_path / "broken.json"
    path.write_text(json.dumps(_broken(good, change)))
    with pytest.raises(ValueError, match=f"kept-fraction curve {path}: {named}"):
        KeptCurve.from_report(path)
    with pytest.raises(SystemExit) as refused:  # as argparse refuses a flag, before anything prints
        simulate_cli.main(["--kept-curve", str(path), "--seq", "131072", "--cp", "8", "--no-mtraining"])
    out, err = capsys.readouterr()
    assert refused.value.code == 2 and out == ""
    assert re.search(f"error: --kept-curve {path}: kept-fraction curve {path}: {named}", err)
    with pytest.raises(SystemExit):
        memory_cli.main(["--model", "qwen2.5-0.5b", "--kept-curve", str(path)])


def test_a_curve_named_beside_a_setting_that_would_not_read_it_is_refused(capsys):
    """`simulate --density` (one share at every length) or `--mix` (per-document patterns), and `memory
    --layout-width bound` (every block), never read the curve the user named: refused, naming both and the fix."""
    from hf_sparse_cp.simulator import memory_cli, simulate_cli

    for argv, other in ((["--density", "0.1"], "--density gives the kept fraction at every length"),
                        (["--mix", "long-tail"], "--mix long-tail packs rows")):
        with pytest.raises(SystemExit):
            simulate_cli.parse_args([*argv, "--kept-curve", "missing.json"])
        err = capsys.readouterr().err
        assert f"--kept-curve missing.json would not be read: {other}" in err and f"drop {argv[0]}" in err
    with pytest.raises(SystemExit):
        memory_cli.main(["--model", "qwen2.5-0.5b", "--layout-width", "bound", "--kept-curve", "missing.json"])
    assert "--kept-curve missing.json would not be read: --layout-width bound" in capsys.readouterr().err
