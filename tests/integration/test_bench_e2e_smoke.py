"""Smoke test of benchmarks/bench_e2e.py: the --tiny preset runs on CPU and writes a complete JSON report."""

import json
import math
import os
import subprocess
import sys

import pytest

from hf_sparse_cp.testing.benchmarking import format_targets

from benchmark_loader import BENCHMARKS, load_benchmark

SCRIPT = BENCHMARKS / "bench_e2e.py"


@pytest.fixture(scope="module")
def bench():
    with load_benchmark("bench_e2e") as module:
        yield module


def test_tiny_run_writes_a_complete_report(tmp_path, bench):
    """Two lengths, 512 and 1,024 tokens (the sweep doubling S, one profiled step at the first), with a smaller
    budget than --tiny's own: the preset's pattern keeps every block at 1K and its sparse steps at 2K (a bf16 step on
    a CPU without bf16 products) took most of this test's 74 s; a given flag overrides the preset's field alone."""
    out = tmp_path / "e2e.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--tiny", "--min_seq", "512", "--max_seq", "1024", "--timed_steps", "1",
         "--device", "cpu", "--profile_seq_lens", "512", "--variants", "sdpa", "sdpa+liger", "sparse_cp",
         "sparse_cp+liger", "--sparse_vertical_topk", "16", "--sparse_slash_topk", "16", "--output", str(out)],
        capture_output=True, text=True, timeout=300, env=env, check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "tokens/s" in proc.stdout  # the table was printed

    report = json.loads(out.read_text())
    assert report["complete"] is True and not any("env" in r for r in report["results"])
    for key in ("device", "torch", "transformers", "triton", "date"):
        assert report[key], key
    assert report["device_type"] == "cpu"
    rows = {(r["variant"], r["seq_len"]): r for r in report["results"]}
    assert set(rows) == {("sdpa", 512), ("sdpa", 1024), ("sdpa+liger", 512), ("sparse_cp", 512), ("sparse_cp", 1024),
                         ("sparse_cp+liger", 512)}
    for variant in ("sdpa+liger", "sparse_cp+liger"):
        assert rows[variant, 512]["status"] == "skipped" and "CUDA" in rows[variant, 512]["reason"]
    # the given budget over --tiny's pattern, its other fields the preset's (TINY_SPARSE)
    pattern = report["sparse_attention"]
    assert pattern["budget"] == {"mode": "topk", "vertical_topk": 16, "slash_topk": 16}
    assert {key: pattern[key] for key in ("block_size", "min_seq_len", "sink_tokens", "local_window")} == {
        key: bench.TINY_SPARSE[key] for key in ("block_size", "min_seq_len", "sink_tokens", "local_window")}
    assert pattern["scoring"]["last_q"] == bench.TINY_SPARSE["last_q"]

    vocab = report["settings"]["model_shapes"]["tiny"]["vocab_size"]
    for (variant, seq_len), r in rows.items():
        if variant.endswith("+liger"):
            continue
        assert r["status"] == "ok", r.get("reason")
        assert r["step_s"] > 0 and r["peak_gib"] > 0
        assert math.isclose(r["tokens_per_s"], seq_len / r["step_s"])
        assert len(r["losses"]) == 2  # one warm-up and one timed step
        assert abs(r["losses"][0] - math.log(vocab)) < 0.5  # a real loss over a random-init model
    for seq_len in (512, 1024):
        sparse = rows["sparse_cp", seq_len]
        assert 0 < sparse["kept_fraction"] <= 1 and sparse["loss_backend"] == "torch"
        # the plugin's default fused ops: liger-kernel on CUDA only; the memory model's peak beside the measured one
        assert sparse["fused_ops"]["setting"] == "auto" and sparse["fused_ops"]["choice"] == "off"
        assert sparse["predicted_peak_gib"] > 0
        # the engine 'auto' gave its attention calls, with why (on a GPU the engine table decides a dense layer's)
        assert set(sparse["attention_engines"]) == {"reference"}
        (why,) = sparse["attention_engines"]["reference"]
        assert why.startswith("auto; triton declined: cpu tensors")
        # Same init and tokens: before any update the two variants see the same model.
        assert abs(sparse["losses"][0] - rows["sdpa", seq_len]["losses"][0]) < 0.05
    assert rows["sparse_cp", 1024]["kept_fraction"] < 1  # the pattern is really sparse
    for (variant, seq_len), r in rows.items():  # one extra step profiled at S=512 only (the shorter: cheaper)
        assert ("kernels" in r) == (seq_len == 512 and r["status"] == "ok"), (variant, seq_len)
    profile = rows["sparse_cp", 512]["kernels"]
    assert len(profile) == 13 and profile[0]["ms"] >= profile[1]["ms"] > 0  # 12 kernels and the rest
    assert "one training step by kernel" in proc.stdout


def test_the_report_is_written_after_every_run(tmp_path, bench, monkeypatch):
    """A sweep cut off after its first run (the device's time limit, say) leaves that run's JSON."""
    out = tmp_path / "e2e.json"
    calls = []

    def run_in_subprocess(spec, timeout_s):
        if calls:
            raise KeyboardInterrupt  # stands in for the sweep being killed
        calls.append(spec)
        return {"model": spec["model"], "variant": spec["variant"], "seq_len": spec["seq_len"], "status": "ok",
                "step_s": 0.5, "tokens_per_s": spec["seq_len"] / 0.5, "peak_gib": 1.0, "kept_fraction": 0.1,
                "env": {"device": "test device", "torch": "x"}}

    monkeypatch.setattr(bench, "run_in_subprocess", run_in_subprocess)
    with pytest.raises(KeyboardInterrupt):
        bench.main(["--tiny", "--variants", "sparse_cp", "--device", "cpu", "--output", str(out)])
    report = json.loads(out.read_text())
    assert report["complete"] is False and report["device"] == "test device"
    assert [(r["variant"], r["seq_len"], r["status"]) for r in report["results"]] == [("sparse_cp", 1024, "ok")]


def test_tiny_preset_and_explicit_flags(bench):
    args, sparse = bench.parse_args(["--tiny"])
    assert args.models == ["tiny"] and args.seq_lens() == [1024, 2048, 4096]
    assert sparse.block_size == bench.TINY_SPARSE["block_size"]
    args, sparse = bench.parse_args(["--tiny", "--sparse_block_size", "32", "--min_seq", "2048"])
    assert sparse.block_size == 32 and args.seq_lens() == [2048, 4096]
    args, _ = bench.parse_args(["--min_seq", "8192", "--max_seq", "65536"])
    assert args.models == ["0.5b", "1.5b"] and args.seq_lens() == [8192, 16384, 32768, 65536]
    with pytest.raises(ValueError, match="Unknown variants"):
        bench.parse_args(["--variants", "flash"])


def test_memory_check_compares_sparse_cp_with_liger(bench):
    def row(variant, seq_len, peak, status="ok"):
        return {"model": "0.5b", "variant": variant, "seq_len": seq_len, "status": status, "peak_gib": peak,
                "memory_metric": "torch.cuda.max_memory_allocated"}

    results = [row("sdpa+liger", 8192, 6.0), row("sparse_cp", 8192, 5.5), row("sdpa+liger", 16384, 8.0),
               row("sparse_cp", 16384, 9.0), row("sparse_cp", 32768, 12.0), row("sdpa+liger", 32768, 1.0, "oom"),
               row("sdpa+liger", 65536, 20.0), row("sparse_cp", 65536, 30.0, "oom")]
    checks = {c["seq_len"]: c["pass"] for c in bench.memory_check(results)}
    assert checks == {8192: True, 16384: False, 65536: False}


def test_kept_fraction_budget_lands_near_its_target(bench):
    """The derived top-k budgets keep about the requested share of causal blocks on random q/k (the picks
    of a random-init model land at random places), and the settings carry them per S."""
    import torch

    from hf_sparse_cp import SparseAttentionConfig
    from hf_sparse_cp.attention.estimate import estimate_layout

    args, sparse = bench.parse_args(["--kept_fraction", "0.1", "--sparse_block_size", "64", "--sparse_min_seq_len",
                                     "1024"])
    assert bench.parse_args([])[0].kept_fraction == 0.05 and bench.parse_args(["--tiny"])[0].kept_fraction == 0
    settings, budget = bench.sparse_settings(sparse, args, 16384)
    given = settings["budget"]
    assert budget["target_kept_fraction"] == 0.1 and given["vertical_topk"] == budget["vertical_topk"] > 0
    assert given["slash_topk"] == budget["slash_topk"] > 0 and given["mode"] == "topk"
    assert bench.sparse_settings(sparse, args, 65536)[1]["vertical_topk"] > budget["vertical_topk"]  # grows with S
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 2, 16384, 32, generator=g), torch.randn(1, 1, 16384, 32, generator=g)
    kept = float(estimate_layout(q, k, SparseAttentionConfig.from_dict(settings)).kept_fraction())
    assert 0.07 <= kept <= 0.13

    args, sparse = bench.parse_args(["--kept_fraction", "0", "--sparse_vertical_topk", "77"])
    settings, budget = bench.sparse_settings(sparse, args, 16384)
    assert budget is None and settings["budget"]["vertical_topk"] == 77


def test_speedups_and_targets_come_from_the_rows(bench):
    def row(variant, seq_len, tokens_per_s, peak, status="ok", kept=None):
        return {"model": "0.5b", "variant": variant, "seq_len": seq_len, "status": status,
                "tokens_per_s": tokens_per_s, "step_s": seq_len / tokens_per_s, "peak_gib": peak,
                "memory_metric": "torch.cuda.max_memory_allocated", "kept_fraction": kept}

    results = [row("sdpa+liger", 131072, 15000.0, 14.5), row("sparse_cp", 131072, 48000.0, 12.0, kept=0.05),
               row("sdpa+liger", 262144, 7600.0, 25.9), row("sparse_cp", 262144, 30000.0, 26.5, kept=0.05),
               row("sparse_cp", 524288, 20000.0, 40.0, kept=0.05)]
    ratios = {e["seq_len"]: e for e in bench.speedups(results)}
    assert ratios[131072]["vs_liger"] == pytest.approx(3.2) and ratios[131072]["vs_sdpa"] is None
    assert ratios[524288]["vs_liger"] is None
    targets = bench.issue_targets(results)
    # trains at 512K, at 1M (not run), 128K speed-up and memory, 256K speed-up and memory
    assert [t["pass"] for t in targets] == [True, None, True, True, False, False]
    assert targets[2]["required"] == ">= 3 (aim 4)"
    assert "3.20" in bench.format_table(results)
    assert format_targets(targets).count("MISS") == 2

    # another sparse variant (compiled instead of liger-kernel's kernels): its own ratios, checks and targets
    results.append(row("sparse_cp+compile", 131072, 46500.0, 14.0, kept=0.05))
    ratios = {(e["variant"], e["seq_len"]): e["vs_liger"] for e in bench.speedups(results)}
    assert ratios["sparse_cp+compile", 131072] == pytest.approx(3.1)
    assert ratios["sparse_cp", 131072] == pytest.approx(3.2)
    targets = {t["target"]: t["pass"] for t in bench.issue_targets(results)}
    assert len(targets) == 12 and targets["0.5b 128K: sparse_cp+compile tokens/s over sdpa + liger"] is True
    assert targets["0.5b 128K: sparse_cp+compile peak memory <= sdpa + liger"] is True
    assert targets["0.5b sparse_cp+compile trains at 512K"] is None
    table = bench.format_table(results)
    assert "3.10" in table and "3.20" in table


def test_memory_predictions_pair_the_measured_gpu_peak_with_the_models():
    with load_benchmark("bench_e2e") as bench:
        settings = bench.step_settings({"block_size": 128}, tiled=True, offload_layer_inputs=False,
                                       loss_backend="liger")
        predicted = bench.predicted_peak_gib("0.5b", 1 << 20, settings)
        rows = [{"model": "0.5b", "variant": "sparse_cp", "seq_len": 1 << 20, "status": "ok", "step_s": 60.0,
                 "peak_gib": 1.1 * predicted, "predicted_peak_gib": predicted,
                 "memory_metric": "torch.cuda.max_memory_allocated"},
                {"model": "0.5b", "variant": "sparse_cp", "seq_len": 1 << 19, "status": "ok", "peak_gib": 9.0,
                 "predicted_peak_gib": 8.0, "memory_metric": "process peak RSS"}]  # a CPU run: not a GPU peak
        (entry,) = bench.memory_predictions(rows)
    assert 10 < predicted < 139 and entry["measured_over_predicted"] == pytest.approx(1.1)


def test_fit_search_follows_every_headline_run_and_reports_the_longest_fit(tmp_path, bench, monkeypatch):
    """--fit_max_seq: first every variant's headline lengths, then each variant that ran at max_seq doubles
    on (one step per run) until a run fails or the cap; longest_fit says how far each got and why it stopped."""
    out = tmp_path / "e2e.json"
    runs = []

    def run_in_subprocess(spec, timeout_s):
        runs.append((spec["variant"], spec["seq_len"], spec["warmup_steps"], spec["timed_steps"]))
        fits = {"sparse_cp": 8192, "sdpa": 2048}[spec["variant"]]
        status = "ok" if spec["seq_len"] <= fits else "oom"
        return {"model": spec["model"], "variant": spec["variant"], "seq_len": spec["seq_len"], "status": status,
                "step_s": 0.5, "tokens_per_s": spec["seq_len"] / 0.5, "peak_gib": 1.0, "kept_fraction": 0.1,
                "reason": "", "env": {"device": "test device"}}

    monkeypatch.setattr(bench, "run_in_subprocess", run_in_subprocess)
    report = bench.main(["--tiny", "--variants", "sparse_cp", "sdpa", "--max_seq", "2048", "--fit_max_seq", "16384",
                         "--device", "cpu", "--output", str(out)])
    # every variant at a length before the next (a cut-off run keeps the comparisons at the shorter ones)
    assert runs == [("sparse_cp", 1024, 1, 3), ("sdpa", 1024, 1, 3), ("sparse_cp", 2048, 1, 3), ("sdpa", 2048, 1, 3),
                    ("sparse_cp", 4096, 0, 1), ("sparse_cp", 8192, 0, 1), ("sparse_cp", 16384, 0, 1),
                    ("sdpa", 4096, 0, 1)]
    fits = {f["variant"]: (f["seq_len"], f["ended_by"]) for f in report["longest_fit"]}
    assert fits == {"sparse_cp": (8192, "oom"), "sdpa": (2048, "oom")}
    assert json.loads(out.read_text())["command"][-1] == str(out)
    with pytest.raises(ValueError, match="fit_max_seq"):
        bench.parse_args(["--tiny", "--max_seq", "4096", "--fit_max_seq", "4096"])


def test_a_runs_attention_engines_keep_every_reason_each_was_chosen_for(bench):
    """An engine chosen for two reasons (the kernels for the vertical-slash layers, and by the engine table or its
    default for the dense first layer) records both: the dense layer's is what the row is read for."""
    from hf_sparse_cp.attention import engines

    level = engines.logger.level
    handler = bench._EngineChoices.attach()
    try:
        for engine, why in (("triton", "auto: columns"), ("triton", "auto: the table"), ("flex", "auto: the table")):
            engines.logger.info("Block-sparse attention engine: %s (%s).", engine, why)
    finally:
        engines.logger.removeHandler(handler)
        engines.logger.setLevel(level)
    assert handler.chosen == {"triton": ["auto: columns", "auto: the table"], "flex": ["auto: the table"]}


@pytest.mark.parametrize("failure", ["raises", "dies"])
def test_a_report_of_failed_runs_still_names_the_device_and_versions(bench, monkeypatch, failure):
    """The 2026-12-04 H200 files of the compiled step (every run failed: an exception, an illegal memory access, a
    timeout) recorded `"device": "cuda"` and no versions: the worker's environment went down with its run. The worker
    now writes it first, and every result of the sweep, failed or not, carries it to the report."""

    def failing_run(spec):
        if failure == "dies":
            os._exit(3)  # as a CUDA fault ends the process, no result file written
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(bench, "run_one", failing_run)  # the CPU worker is forked from this process
    spec = {"model": "tiny", "variant": "sparse_cp", "seq_len": 512, "device": "cpu"}
    result = bench.run_in_subprocess(spec, timeout_s=120)
    assert result["status"] == "error", result
    assert result["env"]["device"].startswith("CPU") and result["env"]["torch"], result
    args, sparse = bench.parse_args(["--tiny", "--device", "cpu"])
    report = bench.build_report(args, sparse, [result], "cpu", complete=True)
    assert report["device"].startswith("CPU") and report["torch"] and report["transformers"]
    assert not any("env" in r for r in report["results"])
