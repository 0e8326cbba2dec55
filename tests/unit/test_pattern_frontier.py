"""benchmarks/pattern_quality.py --frontier: where a perplexity curve crosses its limit, the targets it
reports, and the settings it refuses (the measurement itself runs on the real model, in the benchmark)."""

from __future__ import annotations

import pytest

from benchmark_loader import load_benchmark


@pytest.fixture(scope="module")
def pq():
    with load_benchmark("pattern_quality") as module:
        yield module


def test_crossing_interpolates_between_the_last_point_above_and_the_first_within(pq):
    curve = [{"kept_fraction": 0.3, "perplexity_change": 0.009}, {"kept_fraction": 0.2, "perplexity_change": 0.033},
             {"kept_fraction": 0.25, "perplexity_change": 0.019}, {"kept_fraction": 0.1, "perplexity_change": None}]
    assert pq.crossing(curve, 0.02) == pytest.approx(0.2 + 0.05 * (0.033 - 0.02) / (0.033 - 0.019))
    assert pq.crossing(curve, 0.05) == 0.2  # the sparsest measured point is already within
    assert pq.crossing(curve, 0.001) is None


def _point(kind, kept, recall, worst, change=None, **extra):
    return {"kind": kind, "kept_fraction": kept, "recall_mean": recall, "recall_worst_layer": worst,
            "perplexity_change": change, **extra}


def test_frontier_targets_read_the_report(pq):
    limit = {"family": "block", "allocation": "allocated"}
    report = {"frontier": {
        "4096": {"points": {"b20": _point("limit", 0.2, 0.9, 0.8, 0.033, **limit),
                            "b30": _point("limit", 0.3, 0.96, 0.9, 0.009, **limit),
                            "est": _point("estimator", 0.31, 0.95, 0.9, 0.015),
                            "est2": _point("estimator", 0.5, 0.99, 0.9, 0.001)}},
        "8192": {"points": {"a": _point("estimator", 0.2, 0.95, 0.9, 0.004), "b": _point("estimator", 0.24, 0.97, 0.8),
                            "c": _point("estimator", 0.4, 0.99, 0.95, 0.001)}}},
        "estimation_cost": {"seq_len": 8192, "settings": {"defaults": {"ratio_to_defaults_before": 1.2}}}}
    rows = pq.frontier_targets(report)

    def row(text):
        (found,) = [r for r in rows if text in r["target"]]
        return found

    recall = row("mean mass recall")
    assert "S=8192, a " in recall["target"] and recall["pass"]  # b has more recall but a layer below 0.85
    assert row("within 0.5%")["measured"] == 0.2 and "(a)" in row("within 0.5%")["target"]
    block = 0.2 + 0.1 * (0.033 - 0.02) / (0.033 - 0.009)  # interpolated; the estimator's fewest measured within
    assert row("best block pattern")["measured"] == pytest.approx(0.31 / block)
    assert row("best block pattern")["pass"] == (0.31 / block <= 1.3) and row("estimation time")["pass"]


def test_unknown_settings_and_lengths_are_refused(pq):
    with pytest.raises(ValueError, match="unknown frontier settings"):
        pq.PatternQualityArguments(frontier_settings=["topk-1-2"])
    with pytest.raises(ValueError, match="multiples of 512"):
        pq.PatternQualityArguments(frontier_lengths=[1000])
