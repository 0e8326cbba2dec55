"""benchmarks/pattern_quality.py --layer0 (#50): one window measured on a tiny random model (the real run reads
SmolLM2-135M), the summary of a setting's two arms over windows, and the flags it refuses."""

from __future__ import annotations

import pytest

from benchmark_loader import load_benchmark


@pytest.fixture(scope="module")
def pq():
    with load_benchmark("pattern_quality") as module:
        yield module


def test_a_window_measures_each_arm_against_dense_on_a_tiny_model(pq):
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    from hf_sparse_cp.testing.pattern_quality import dense_perplexity
    from hf_sparse_cp.testing.tiny_models import tiny_config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama", num_hidden_layers=3), attn_implementation="sdpa")
    model.eval()
    ids = torch.randint(3, 259, (1, 256))
    out, saved = {}, []
    pq.layer0_window(model, ids, ["defaults", "layer0-sparse"], None, out, lambda: saved.append(1))
    assert out["seq_len"] == 256 and len(saved) == 2  # saved after every setting
    assert out["perplexity_dense"] == pytest.approx(dense_perplexity(model, ids), rel=1e-5)
    dense_first, sparse_first = out["settings"]["defaults"], out["settings"]["layer0-sparse"]
    assert [r["sparse"] for r in dense_first["per_layer"]] == [False, True, True]
    assert all(r["sparse"] for r in sparse_first["per_layer"])
    # two blocks of 128: the sink and the local window keep all three causal blocks, so every arm computes dense
    # attention (through sparse_cp's block-sparse path) and must give dense's perplexity
    for p in (dense_first, sparse_first):
        assert p["kept_all_layers"] == 1.0 and p["recall_mean"] == pytest.approx(1.0, abs=1e-6)
        assert p["perplexity"] == pytest.approx(out["perplexity_dense"], rel=1e-5)


def _point(change, ppl, kept, recall):
    """A measured setting: its perplexity and change, and per layer (layer 0 first) kept fraction and recall."""
    rows = [{"layer": i, "sparse": True, "kept_fraction": k, "recall_mean": r}
            for i, (k, r) in enumerate(zip(kept, recall))]
    return {"perplexity_change": change, "perplexity": ppl, "kept_all_layers": sum(kept) / len(kept),
            "per_layer": rows}


def test_the_summary_pairs_each_budget_s_two_arms_over_the_windows(pq):
    windows = {
        "0": {"4096": {"settings": {"defaults": _point(0.01, 10.1, [1.0, 0.4, 0.2], [1.0, 0.99, 0.97]),
                                    "layer0-sparse": _point(0.02, 10.2, [0.8, 0.4, 0.2], [0.98, 0.99, 0.97]),
                                    "tight": _point(0.05, 10.5, [1.0, 0.2, 0.2], [1.0, 0.9, 0.95])}}},
        "9": {"4096": {"settings": {"defaults": _point(0.03, 5.15, [1.0, 0.6, 0.4], [1.0, 0.98, 0.96]),
                                    "layer0-sparse": _point(0.02, 5.1, [0.6, 0.6, 0.4], [0.96, 0.98, 0.96])}}},
    }
    summary = pq.layer0_summary(windows)
    (p,) = summary["4096"].values()  # 'tight' has no layer-0-sparse arm: not summarized
    assert list(summary["4096"]) == ["defaults"]
    assert p["perplexity_gap"] == pytest.approx([10.2 / 10.1 - 1, 5.1 / 5.15 - 1])
    dense_first, sparse_first = p["layer0_dense"], p["layer0_sparse"]
    assert sparse_first["layer0_kept"] == pytest.approx(0.7) and sparse_first["layer0_recall"] == pytest.approx(0.97)
    assert sparse_first["other_layers_kept"] == pytest.approx(0.4) and sparse_first["other_layers_worst_recall"] == 0.96
    assert dense_first["perplexity_change_mean"] == pytest.approx(0.02) and dense_first["perplexity_change_max"] == 0.03
    assert p["work_change"] == pytest.approx((1.4 / 3 + 1.6 / 3) / (1.6 / 3 + 2.0 / 3) - 1)
    (row,) = pq.layer0_targets({"summary": summary})
    assert row["measured"] == pytest.approx(10.2 / 10.1 - 1) and row["pass"] is None
    assert "perplexity +0.990% (worst of 2 windows" in row["target"]
    table = pq.format_layer0({"summary": summary}).splitlines()
    assert len(table) == 3 and table[1].split()[2] == "dense" and "(" not in table[1]
    assert table[2].split()[2] == "sparse" and table[2].endswith("+0.010% (+0.990%)")  # the gap: mean (worst)


def test_layer0_flags_are_checked(pq):
    with pytest.raises(ValueError, match="unknown layer 0 budgets"):
        pq.PatternQualityArguments(layer0_budgets=["loose"])
    with pytest.raises(ValueError, match="at most smollm2-135m's context, 8192"):
        pq.PatternQualityArguments(layer0=True, layer0_lengths=[16384])
    assert pq.PatternQualityArguments(layer0=True, layer0_lengths=[4096, 8192]).layer0_windows[0] == 0
    with pytest.raises(ValueError, match="--curve and --layer0 are separate reports"):
        pq.PatternQualityArguments(layer0=True, curve=True)


def test_combine_merges_the_windows_of_several_runs(pq, tmp_path, monkeypatch):
    """Windows measured in two processes (or a run cut off) make one report; a setting measured twice is refused,
    and the report is complete only when every window holds every setting."""
    import json

    monkeypatch.setattr(pq, "plot_layer0", lambda report, path: None)
    pair = {"defaults": _point(0.01, 10.1, [1.0, 0.4], [1.0, 0.99]),
            "layer0-sparse": _point(0.02, 10.2, [0.8, 0.4], [0.98, 0.99])}
    base = {"device": "CPU test", "model": "m", "settings": {}, "patterns": {"defaults": {}, "layer0-sparse": {}}}
    reports = [{**base, "windows": {"0": {"4096": {"seq_len": 4096, "settings": pair}},
                                    "9": {"4096": {"seq_len": 4096, "settings": {}}}}},  # cut before window 9
               {**base, "windows": {"9": {"4096": {"seq_len": 4096, "settings": {"defaults": pair["defaults"]}}}}},
               {**base, "windows": {"9": {"4096": {"seq_len": 4096,
                                                   "settings": {"layer0-sparse": pair["layer0-sparse"]}}}}}]
    paths = []
    for i, r in enumerate(reports):
        paths.append(tmp_path / f"r{i}.json")
        paths[-1].write_text(json.dumps(r))
    half = pq.combine([str(p) for p in paths[:2]], str(tmp_path / "half.json"))
    assert not half["complete"] and half["summary"]["4096"]["defaults"]["layer0_sparse"]["windows"] == 1
    out = pq.combine([str(p) for p in paths], str(tmp_path / "out.json"))
    assert out["complete"] and list(out["windows"]) == ["0", "9"]
    assert out["summary"]["4096"]["defaults"]["perplexity_gap"] == pytest.approx([10.2 / 10.1 - 1] * 2)
    assert json.loads((tmp_path / "out.json").read_text())["targets"] == out["targets"]
    with pytest.raises(ValueError, match=r"window 0, S=4096: \['defaults', 'layer0-sparse'\] measured in two"):
        pq.combine([str(paths[0]), str(paths[0])], str(tmp_path / "twice.json"))
