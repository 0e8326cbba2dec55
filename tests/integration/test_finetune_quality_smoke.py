"""Smoke test of benchmarks/finetune_quality.py (#43) at tiny size: every arm trains through SparseTrainer and
is evaluated; two runs with the same seed give the same numbers; the GPU stage's --dry-run runs it end to end."""

import json
import os
import subprocess
import sys

import pytest

from benchmark_loader import BENCHMARKS, load_benchmark

TINY = ["--dry_run", "--steps", "2", "--prompts_per_cell", "1", "--ppl_windows", "1", "--threads", "1"]


@pytest.fixture(scope="module")
def bench():
    with load_benchmark("finetune_quality") as module:
        yield module


def test_two_runs_with_one_seed_measure_the_same(bench, tmp_path):
    argv = TINY + ["--arms", "dense", "aggressive", "smet"]
    first = bench.main(argv + ["--output", str(tmp_path / "a.json")])
    second = bench.main(argv + ["--output", str(tmp_path / "b.json")])
    verdict = bench.main(["--compare", str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--output",
                          str(tmp_path / "same.json")])
    assert verdict["same"] and verdict["differences"] == [] and verdict["values_compared"] > 50
    assert json.loads((tmp_path / "same.json").read_text())["same"]
    # what it compares: every measurement, timings aside; a changed loss or retrieval answer is found
    measured = bench.measurements(first)
    assert measured == bench.measurements(second) and "train_seconds" not in measured["dense"]["training"]
    changed = json.loads((tmp_path / "b.json").read_text())
    changed["arms"]["aggressive"]["training"]["loss"][1] += 1e-6
    changed["arms"]["start"]["retrieval_dense"]["per_cell"]["256@0.2"]["correct"] += 1
    (tmp_path / "c.json").write_text(json.dumps(changed))
    found = bench.main(["--compare", str(tmp_path / "a.json"), str(tmp_path / "c.json")])["differences"]
    assert [d.split(":")[0] for d in found] == ["arms.aggressive.training.loss[1]",
                                                "arms.start.retrieval_dense.per_cell.256@0.2.correct"]
    with pytest.raises(ValueError, match="two reports"):
        bench.main(["--compare", str(tmp_path / "a.json")])
    assert list(first["arms"]) == ["start", "dense", "aggressive", "smet"] and first["complete"]
    dense, aggressive, smet = (first["arms"][n] for n in ("dense", "aggressive", "smet"))
    assert len(dense["training"]["loss"]) == 2 and dense["training"]["config"] is None
    assert dense["training"]["kept_fraction"] == [None, None]  # sdpa: nothing sparse to log
    assert 0.0 < aggressive["training"]["kept_fraction_mean"] < 1.0  # the sparse layer kept a part of its blocks
    assert aggressive["training"]["config"]["budget"]["vertical_topk"] == 32 and smet["training"]["smet"]
    # the start model scored with every trained arm's pattern, each arm with its own
    assert set(first["arms"]["start"]["perplexity_sparse"]) == {"aggressive", "smet"}
    assert set(aggressive["perplexity_sparse"]) == {"aggressive"} and "perplexity_sparse" not in dense
    # the dry run's two eval lengths and depths, one prompt each, and their Wilson intervals
    cells = dense["retrieval_dense"]["per_cell"]
    assert set(cells) == {"256@0.2", "256@0.8", "512@0.2", "512@0.8"}
    assert all(0.0 <= c["wilson95"][0] <= c["wilson95"][1] <= 1.0 and c["prompts"] == 1 for c in cells.values())
    assert [t["pass"] is None for t in first["targets"]] == [True] * 4  # aggressive and SMET gaps: stated
    assert (tmp_path / "a.png").stat().st_size > 0


def test_combine_merges_arms_and_refuses_other_settings(bench, tmp_path):
    a = bench.main(TINY + ["--arms", "dense", "--output", str(tmp_path / "a.json")])
    bench.main(TINY + ["--arms", "default", "--no_start", "--output", str(tmp_path / "b.json")])
    merged = bench.main(["--combine", str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--output",
                         str(tmp_path / "ab.json")])
    assert list(merged["arms"]) == ["start", "dense", "default"]
    assert merged["arms"]["dense"] == a["arms"]["dense"]
    perplexity, needles = merged["targets"]  # the default held to both; 4 prompts cannot tell the needles' change
    assert isinstance(perplexity["pass"], bool) and needles["pass"] is None and needles["verdict"] == "INCONCLUSIVE"
    assert "on the same 4:" in needles["target"] and merged["settings"]["retrieval_margin"] == 0.1
    # every arm's hit of every prompt, in the same order: what the verdict pairs
    assert [len(merged["arms"][n]["retrieval_dense"]["hits"]) for n in merged["arms"]] == [4, 4, 4]
    looser = bench.main(["--combine", str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--retrieval_margin",
                           "0.9", "--output", str(tmp_path / "ab9.json")])  # re-judged from the stored hits
    assert looser["settings"]["retrieval_margin"] == 0.9 and looser["targets"][1]["required"] == \
        "interval above -0.90"
    bench.main(TINY + ["--arms", "default", "--no_start", "--seed", "1", "--output", str(tmp_path / "c.json")])
    with pytest.raises(ValueError, match="other settings"):
        bench.main(["--combine", str(tmp_path / "a.json"), str(tmp_path / "c.json")])


def test_kv_recall_learns_from_its_answers_and_is_scored_dense_and_sparse(bench, tmp_path):
    """#53's skill task at tiny size: the loss on the answers only, the held-out recall of every arm served dense
    and with its own pattern (the start model with each arm's), a probe while training, only the upper layer
    trained, the targets; a rerun with --checkpoint_dir trains nothing and scores the same weights the same."""
    argv = TINY + ["--task", "kv_recall", "--arms", "dense", "aggressive", "--eval_every", "1", "--eval_every_rows",
                   "1", "--train_layers_from", "1", "--checkpoint_dir", str(tmp_path / "trained")]
    first = bench.main(argv + ["--output", str(tmp_path / "a.json")])
    start, dense, aggressive = (first["arms"][n] for n in ("start", "dense", "aggressive"))
    tokenizer, _ = bench.load(bench.FinetuneQualityArguments(dry_run=True))
    args = bench.FinetuneQualityArguments(dry_run=True, task="kv_recall", steps=2)
    rows = bench.training_rows(tokenizer, args)
    assert len(rows) == 2 and all(sum(label != -100 for label in r["labels"]) < 0.1 * len(r["labels"]) for r in rows)
    assert start["recall_dense"]["prompts"] == 2 * 2 and set(start["recall_sparse"]) == {"aggressive"}
    assert set(aggressive["recall_sparse"]) == {"aggressive"} and "recall_sparse" not in dense
    assert [p["step"] for p in dense["training"]["probe"]] == [1, 2]
    assert 0 < dense["training"]["trainable_parameters"] and "decoder layers 1-" in dense["training"]["trainable"]
    assert aggressive["training"]["kept_fraction_mean"] < 1.0
    # served with a pattern, the pattern ran on the held-out rows (they are as long as its min_seq_len)
    assert 0.0 < aggressive["recall_sparse"]["aggressive"]["kept_fraction"] < 1.0
    assert 0.0 < start["recall_sparse"]["aggressive"]["kept_fraction"] < 1.0
    targets = {r["target"].split(":")[0].split(" (")[0]: r for r in first["targets"]}
    assert "aggressive arm" in targets and targets["aggressive arm"]["pass"]  # its pattern was active
    assert any(t.startswith("dense arm learns the task in 2 steps") for t in targets)
    assert (tmp_path / "a.png").stat().st_size > 0
    second = bench.main(argv + ["--output", str(tmp_path / "b.json")])
    for name in ("dense", "aggressive"):
        assert second["arms"][name]["training"] == first["arms"][name]["training"]
        assert second["arms"][name]["recall_dense"] == first["arms"][name]["recall_dense"]
    with pytest.raises(ValueError, match="trained with other settings"):
        bench.main(argv[:-2] + ["--checkpoint_dir", str(tmp_path / "trained"), "--lr", "1e-3", "--output",
                                str(tmp_path / "c.json")])


def test_kv_recall_rerun_scores_only_what_its_report_lacks(bench, tmp_path, monkeypatch):
    """A rerun at the same --output reads the trained weights and the scores measured, and measures what is new:
    here the --serve_variants of the aggressive pattern (for the start model and the aggressive arm)."""
    argv = TINY + ["--task", "kv_recall", "--arms", "dense", "aggressive", "--train_layers_from", "1",
                   "--checkpoint_dir", str(tmp_path / "trained"), "--output", str(tmp_path / "a.json")]
    first = bench.main(argv)
    scored = []
    recall_scores = bench.recall_scores
    monkeypatch.setattr(bench, "recall_scores", lambda model, rows, cfg: scored.append(cfg) or
                        recall_scores(model, rows, cfg))
    again = bench.main(argv + ["--serve_variants", "vertical_topk=64"])
    assert [cfg.budget.vertical_topk for cfg in scored] == [64, 64]
    for name in ("start", "dense", "aggressive"):
        assert again["arms"][name]["recall_dense"] == first["arms"][name]["recall_dense"]
    for name in ("start", "aggressive"):
        served = again["arms"][name]["recall_sparse"]
        assert served["aggressive"] == first["arms"][name]["recall_sparse"]["aggressive"]
        assert 0.0 < served["aggressive vertical_topk=64"]["kept_fraction"] < 1.0
    with pytest.raises(ValueError, match="field=value"):
        bench.main(argv + ["--serve_variants", "vertical_topk"])
    with pytest.raises(ValueError, match="Unknown sparse attention config keys"):
        bench.main(argv + ["--serve_variants", "vertical_top=64"])


def test_an_arm_cut_off_resumes_from_its_last_trainer_checkpoint(bench, tmp_path):
    """With --checkpoint_dir the Trainer saves every --save_every steps; a rerun whose arm has no trained weights
    yet resumes from the last checkpoint with the cut run's record up to it (here the last step: nothing left to
    train, the same losses)."""
    argv = TINY + ["--task", "kv_recall", "--arms", "dense", "--no_start", "--save_every", "1", "--checkpoint_dir",
                   str(tmp_path / "ck"), "--output", str(tmp_path / "a.json")]
    first = bench.main(argv)["arms"]["dense"]["training"]
    assert (tmp_path / "ck" / "dense-trainer" / "checkpoint-2").is_dir()
    (tmp_path / "ck" / "dense.pt").unlink()  # as if cut off after its last checkpoint, before the weights were kept
    again = bench.main(argv)["arms"]["dense"]["training"]
    assert again["resumed_from"] == 2 and again["loss"] == first["loss"]
    with pytest.raises(ValueError, match="other settings"):
        bench.main([a if a != "2" else "3" for a in argv])  # --steps 3 against the report of --steps 2


def test_bad_arguments_are_refused(bench):
    with pytest.raises(ValueError, match="unknown arms"):
        bench.main(TINY + ["--arms", "sparse"])
    with pytest.raises(ValueError, match="evaluates nothing"):
        bench.main(TINY + ["--start_only", "--no_start"])
    row = bench.retrieval.AnswerRow(list(range(100)), [-100] * 100, [(90, 91)], [50])
    with pytest.raises(ValueError, match="min_seq_len=128: it would not run"):  # not scored dense as if sparse
        bench.recall_scores(None, [row], bench.SparseAttentionConfig(min_seq_len=128))


def test_gpu_session_finetune_dry_run(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(["bash", str(BENCHMARKS / "gpu_session.sh"), "finetune", "--dry-run"], capture_output=True,
                          text=True, timeout=900, env=env, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "finetune-quality.json").read_text())
    assert report["complete"] and report["settings"]["dry_run"] and report["device_type"] == "cpu"
    assert list(report["arms"]) == ["start", "dense", "default", "aggressive", "aggressive-4k", "smet"]
    assert report["settings"]["seq_len"] == 512 and report["settings"]["rope_theta"] is None  # the dry run's sizes
    assert (tmp_path / "finetune-quality.png").stat().st_size > 0 and (tmp_path / "finetune.log").stat().st_size > 0
