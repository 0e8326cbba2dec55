"""benchmarks/finetune_quality.py's retrieval and recall verdicts on synthetic hits: an arm against the
dense-trained one on the same prompts (`retrieval.paired_verdict`), not its count against dense's Wilson interval;
reports from before the hits were stored decide nothing."""

from __future__ import annotations

import pytest

from hf_sparse_cp.testing import retrieval

from benchmark_loader import load_benchmark


@pytest.fixture(scope="module")
def fq():
    with load_benchmark("finetune_quality") as module:
        yield module


def _paired(both: int, dense_only: int, arm_only: int, neither: int) -> tuple[list[bool], list[bool]]:
    pairs = [(True, True)] * both + [(True, False)] * dense_only + [(False, True)] * arm_only \
        + [(False, False)] * neither
    return [d for d, _ in pairs], [a for _, a in pairs]


def _scores(hits: list, with_hits: bool = True) -> dict:
    flat = [h for row in hits for h in (row if isinstance(row, list) else [row])]
    return {**retrieval.accuracy(flat), **({"hits": hits} if with_hits else {})}


def _needles_report(dense: list[bool], default: list[bool], with_hits: bool = True, **settings) -> dict:
    arm = {"perplexity_dense": 10.0, "training": {"kept_fraction_mean": 0.8}}
    return {"settings": {"task": "needles", **settings},
            "arms": {"dense": {**arm, "retrieval_dense": _scores(dense, with_hits)},
                     "default": {**arm, "retrieval_dense": _scores(default, with_hits)}}}


def _retrieval_target(fq, report: dict) -> dict:
    (row,) = [t for t in fq.targets(report) if "retrieval" in t["target"]]
    return row


@pytest.mark.parametrize("counts,verdict,passed", [
    # loses 4 of dense's 14 of 20: 10/20 lay inside dense's Wilson interval [0.481, 0.855], a 'pass' before
    ((10, 4, 0, 6), "INCONCLUSIVE", None),
    ((14, 14, 0, 12), None, False),  # loses 14 of 40
    ((28, 0, 0, 12), None, True),  # the same answers, 40 prompts
])
def test_the_needles_verdict_pairs_the_arms_prompts(fq, counts, verdict, passed):
    row = _retrieval_target(fq, _needles_report(*_paired(*counts)))
    assert row["pass"] is passed and row.get("verdict") == verdict, row
    assert row["measured"] == pytest.approx((counts[2] - counts[1]) / sum(counts))
    lo, hi = retrieval.paired_difference_interval(*counts)
    assert f"[{lo:+.3f}, {hi:+.3f}]" in row["target"] and row["required"] == "interval above -0.10"


def test_the_margin_is_the_reports_and_refused_outside_0_1(fq):
    hits = _paired(14, 14, 0, 12)  # loses 0.35 of 40: a fail at 0.1, a pass at 0.6
    assert _retrieval_target(fq, _needles_report(*hits, retrieval_margin=0.6))["pass"] is True
    with pytest.raises(ValueError, match="--retrieval_margin 1.0 must lie in"):
        fq.FinetuneQualityArguments(retrieval_margin=1.0)


def test_reports_without_hits_are_not_judged(fq):
    """The counts alone cannot be paired: no verdict is made up for the reports measured before #50."""
    row = _retrieval_target(fq, _needles_report(*_paired(10, 4, 0, 6), with_hits=False))
    assert row["pass"] is None and row["verdict"] == "inconclusive: no per-prompt hits stored"
    assert row["measured"] == pytest.approx(-0.2)


def test_kv_recall_pairs_each_rows_questions(fq):
    """kv_recall's hits are per row of questions; the verdict pairs them question by question, served dense and
    with the arm's own pattern, the default arm held to it and another arm's gap stated."""
    dense, served_dense = _paired(534, 24, 2, 16)  # the shape of finetune-skill_cpu_4k: 536/576 against 558/576
    _, served_own = _paired(438, 120, 2, 16)  # 440/576
    rows = lambda hits: [hits[i:i + 96] for i in range(0, 576, 96)]  # noqa: E731
    arm = {"perplexity_dense": 10.0, "training": {"kept_fraction_mean": 0.8, "kept_fraction": [0.8], "loss": [1.0],
                                                   "train_seconds": 1.0}}
    report = {"settings": {"task": "kv_recall"}, "arms": {
        "dense": {**arm, "recall_dense": _scores(rows(dense))},
        "default": {**arm, "recall_dense": _scores(rows(served_dense)),
                    "recall_sparse": {"default": _scores(rows(served_own))}},
        "aggressive": {**arm, "recall_dense": _scores(rows(served_own)),
                       "recall_sparse": {"aggressive": _scores(rows(served_own))}}}}
    got = {t["target"].split(" accuracy")[0]: t for t in fq.targets(report) if "recall accuracy" in t["target"]}
    assert got["default-trained served dense vs dense-trained: recall"]["pass"] is True  # loses 0.038, within 0.1
    assert got["default-trained served with its own pattern vs dense-trained: recall"]["pass"] is False  # 0.205
    stated = got["aggressive-trained served dense vs dense-trained: recall"]
    assert stated["pass"] is None and stated["required"] == "(stated)" and "verdict" not in stated
    assert "on the same 576: 438 both, 120 dense only, 2 this one only" in stated["target"]
