"""benchmarks/gpu_session.sh quick: its --dry-run end to end on the CPU (the same stages and JSON as the
GPU run, at tiny sizes, our kernels in Triton's interpreter), so the script cannot rot between GPU
runs; and the orchestration's parts: the caps, the deadline, the verdicts gathered from the stages' files."""

import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import pytest

from benchmark_loader import BENCHMARKS, load_benchmark


@pytest.fixture(scope="module")
def quick():
    with load_benchmark("quick_session") as module:
        yield module


def _start_dry_run(call: str, out) -> tuple[subprocess.Popen, Callable[[], tuple[dict, float, str]]]:
    """Start `gpu_session.sh CALL --dry-run` writing to `out`: its process and the call that waits for it and checks
    what every call's session JSON holds, returning (the session JSON, the wall time, its stdout on one line)."""
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    env.pop("QUICK_START", None)
    stdout, stderr = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
    start = time.monotonic()
    proc = subprocess.Popen(["bash", str(BENCHMARKS / "gpu_session.sh"), call, "--dry-run"], stdout=stdout,
                            stderr=stderr, text=True, env=env, start_new_session=True)

    def finish() -> tuple[dict, float, str]:
        try:
            proc.wait(900)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            raise
        wall = time.monotonic() - start
        stdout.seek(0), stderr.seek(0)
        out_text, err_text = stdout.read(), stderr.read()
        assert proc.returncode == 0, out_text[-3000:] + err_text[-3000:]
        session = json.loads((out / f"{call}-session.json").read_text())
        assert session["complete"] and session["settings"]["dry_run"] and session["device_type"] == "cpu"
        assert session["settings"]["call"] == call and session["wall_s"] <= session["settings"]["budget_s"] <= 540
        assert wall < 900 and len(list(out.iterdir())) <= 8  # what a GPU call brings back
        return session, wall, " ".join(out_text.split())

    return proc, finish


@pytest.fixture(scope="module")
def dry_runs(tmp_path_factory):
    """Both calls' dry runs, started together (each runs its stages one after the other on one thread: together
    they take the longer one's time where the machine has two cores); {call: (the call that waits for its run,
    its output folder)}. A run still going at the module's end (its test failed first) is stopped."""
    runs, procs = {}, []
    for call in ("quick", "quick2"):
        out = tmp_path_factory.mktemp(call)
        proc, finish = _start_dry_run(call, out)
        runs[call] = (finish, out)
        procs.append(proc)
    yield runs
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_dry_run_runs_every_stage_and_writes_the_gpu_schema(dry_runs):
    finish, tmp_path = dry_runs["quick"]
    session, wall, stdout = finish()
    files = {p.name for p in tmp_path.iterdir()}
    assert files == {"quick-session.json", "quick.log", "attention.json", "engine_table.json", "attention-d256.json",
                     "e2e.json", "e2e-compile.json", "tiles.json"}
    assert [(s["name"], s["status"]) for s in session["stages"]] == [
        ("e2e", "ok"), ("compile", "ok"), ("tiles", "ok"), ("attention", "ok"), ("wide_tests", "ok"),
        ("wide_attention", "ok")]

    attention = json.loads((tmp_path / "attention.json").read_text())
    assert attention["complete"] and attention["command"] and attention["settings"]["dry_run"]
    rows = {(r["layout"], r["variant"]): r for r in attention["results"]}
    for layout in ("vs@5%", "dense"):
        assert rows[(layout, "ours")]["status"] == "ok"  # our kernels, interpreted
        assert rows[(layout, "auto")]["auto_engine"] == "reference"  # auto off CUDA
        assert "CUDA" in rows[(layout, "flex_engine")]["reason"]  # no Flex backward on CPU
        for flex in ("flex", "flex_flash"):  # compiled Flex on the same blocks, both backends: rows with the reason
            assert "backward on CPU" in rows[(layout, flex)]["reason"]
    assert rows[("dense", "sdpa_flash")]["status"] == "ok"
    assert {v for (layout, v) in rows if layout.startswith("est ")} == {"ours"}  # --estimated_variants
    (estimation,) = attention["estimation"]  # the pattern estimation's share of the attention it serves
    assert estimation["share_of_fwd_bwd"] > 0 and estimation["share_of_fwd"] is None
    assert estimation["peak_mib"] > 0 and estimation["peak_over_layout"] >= 1  # its memory beside the layout
    assert [(c["against"], c["status"]) for c in attention["checks"]] == [("flex_engine", "pass"), ("flex", "pass")]
    assert {"flex", "flex_flash", "sdpa_cudnn"} <= set(attention["ratios"][0]["over"])
    assert len(attention["engine_targets"]) == 3 and len(attention["targets"]) == 7
    (linear,) = attention["linear"]  # the MLP product's rate, and ours over it (the planner's rate share)
    assert linear["status"] == "ok" and {s["layout"] for s in attention["rate_shares"]} >= {"vs@5%", "dense"}
    table = json.loads((tmp_path / "engine_table.json").read_text())
    assert table["kind"] == "hf_sparse_cp engine table" and table["rows"] == []  # no flex fwd+bwd on CPU

    # head_dim 256: our kernels (their wide tiles, interpreted) beside Flex and the dense SDPA backends
    wide = json.loads((tmp_path / "attention-d256.json").read_text())
    assert wide["settings"]["head_dim"] == 256 and wide["estimation"] == []
    rows = {(r["layout"], r["variant"]): r for r in wide["results"]}
    assert rows[("vs@5%", "ours")]["status"] == rows[("dense", "ours")]["status"] == "ok"
    assert {v for _, v in rows} == {"ours", "ours_blocks", "auto", "flex", "sdpa_cudnn", "sdpa_flash"}
    assert [(c["against"], c["status"]) for c in wide["checks"]] == [("flex", "pass")]

    e2e = json.loads((tmp_path / "e2e.json").read_text())
    assert e2e["complete"] and {(r["variant"], r["seq_len"], r["status"]) for r in e2e["results"]} == {
        ("sparse_cp", 256, "ok"), ("sdpa+liger", 256, "skipped")}
    assert {r["fused_ops"]["choice"] for r in e2e["results"] if r["variant"] == "sparse_cp"} == {"off"}  # CPU
    compiled = json.loads((tmp_path / "e2e-compile.json").read_text())
    (step,) = compiled["results"]
    assert step["status"] == "ok" and step["torch_compile"] and compiled["settings"]["torch_compile"]
    assert len(step["warmup_times_s"]) == 1 and not e2e["settings"]["torch_compile"]
    tiles = json.loads((tmp_path / "tiles.json").read_text())
    assert tiles["settings"]["shortlist"] and set(tiles["best"]) == {"columns", "dq", "forward", "dkdv"}
    assert all(r["status"] == "ok" for r in tiles["results"])  # each candidate computes the launched tiles' result
    # the tile table the later stages were given (never applied off CUDA), and each JSON recording it
    assert tiles["chosen"]["applies_to"] == {"device": tiles["device"], "head_dim": 16, "block_size": 16,
                                             "dtype": "float32"}
    assert tiles["HF_SPARSE_CP_TILES"] is None and attention["HF_SPARSE_CP_TILES"] == str(tmp_path / "tiles.json")

    headline = session["headline"]
    assert len(headline["attention_fwd_bwd_ms"]) == len(attention["results"])
    assert len(headline["wide_attention_fwd_bwd_ms"]) == len(wide["results"])
    assert headline["estimation"][0]["peak_mib"] == estimation["peak_mib"]
    assert headline["rate_shares"] == attention["rate_shares"] and "rate share" in stdout
    # the gpu-marked tests at head_dim 160/256 and fp32 ran (skipped without a GPU), their report folded in here
    tests = headline["wide_tests"]
    assert tests["skipped"] == len(tests["tests"]) >= 5 and tests["passed"] == tests["failed"] == 0
    (step,) = headline["compiled_step"]
    assert step["seq_len"] == 256 and step["speedup"] > 0 and step["compiled_over_liger"] is None
    assert step["loss_rel_diff"] < 1e-4  # the compiled model trains as the uncompiled one (same init and tokens)
    assert step["unique_graphs"] >= 1 and step["attention_breaks"] == 0  # (the sparse attention: custom ops)
    assert headline["first_layer"] == headline["token_tiles"] == [] and headline["wide_tiles_best"] == {}  # quick2's
    verdicts = {t["target"]: t for t in headline["verdicts"]}
    assert len(verdicts) == len(headline["verdicts"]) and "0.5b sparse_cp trains at 1024K" in verdicts
    (kernels,) = [t for name, t in verdicts.items() if name.startswith("kernels at head_dim 160/256")]
    assert kernels["pass"] is None and kernels["measured"].startswith("0 passed, 0 failed")
    assert verdicts["head_dim 256: ours computes Flex's result on the same blocks (rel. RMS within rtol)"]["pass"]
    assert "stage wide_attention ok" in stdout and "compiled step 0K" in stdout
    print(f"quick --dry-run: {wall:.0f} s wall")


def test_the_second_call_dry_run_runs_the_rest(dry_runs):
    """`quick2`: the head_dim-256 tile short list, the 128K step against sdpa + liger, the fit runs, layer 0 sparse, the
    step without token tiles, the estimation's time at longer lengths."""
    finish, tmp_path = dry_runs["quick2"]
    session, wall, stdout = finish()
    assert {p.name for p in tmp_path.iterdir()} == {"quick2-session.json", "quick2.log", "tiles-d256.json", "e2e.json",
                                                    "e2e-fit.json", "e2e-layer0.json", "e2e-untiled.json",
                                                    "estimation.json"}
    assert [(s["name"], s["status"]) for s in session["stages"]] == [
        ("wide_tiles", "ok"), ("e2e", "ok"), ("fit", "ok"), ("layer0", "ok"), ("untiled", "ok"), ("estimation", "ok")]
    lengths = session["headline"]["estimation_lengths"]
    assert [e["seq_len"] for e in lengths] == [128, 256] and all(e["layout_ms"] > 0 and e["scoring_ms"] > 0
                                                                 for e in lengths)
    assert "estimation 0K est v8/s2: " in stdout and "layout build" in stdout
    assert session["headline"]["estimation"] == []  # (quick's attention stage)
    tiles = json.loads((tmp_path / "tiles-d256.json").read_text())
    assert tiles["chosen"]["applies_to"]["head_dim"] == 256 and set(tiles["best"]) == {"columns", "dq", "forward",
                                                                                       "dkdv"}
    assert all(r["status"] == "ok" for r in tiles["results"])
    from hf_sparse_cp.kernels import configs

    assert len(tiles["results"]) == sum(len(configs.WIDE_HEAD_SHORTLIST[k]) for k in tiles["best"]) + 1  # + launched
    e2e = json.loads((tmp_path / "e2e.json").read_text())
    assert {(r["variant"], r["seq_len"], r["status"]) for r in e2e["results"]} == {
        ("sparse_cp", 128, "ok"), ("sdpa+liger", 128, "skipped")}
    fit = json.loads((tmp_path / "e2e-fit.json").read_text())
    assert [(r["seq_len"], r["status"]) for r in fit["results"]] == [(512, "ok"), (1024, "ok")]
    assert all(r["predicted_peak_gib"] > 0 for r in fit["results"])  # the memory model's peak beside each run
    layer0 = json.loads((tmp_path / "e2e-layer0.json").read_text())
    assert layer0["sparse_attention"]["dense_first_layers"] == 0 and e2e["sparse_attention"]["dense_first_layers"] == 1
    headline = session["headline"]
    (first_layer,) = headline["first_layer"]
    assert first_layer["seq_len"] == 128 and first_layer["dense_first_layer_share"] is not None
    # token tiles: e2e's step tiled (at its tiny length, as the GPU's from 32K), untiled's not, both peaks beside
    untiled = json.loads((tmp_path / "e2e-untiled.json").read_text())
    tiled_of = lambda report: [r["memory_savers"]["tiled"] for r in report["results"] if r["variant"] == "sparse_cp"]
    assert tiled_of(e2e) == [True] and tiled_of(untiled) == [False]
    (tiles_cost,) = headline["token_tiles"]
    assert tiles_cost["seq_len"] == 128 and tiles_cost["tiled_share"] is not None
    assert tiles_cost["tiled_peak_gib"] > 0 and tiles_cost["untiled_peak_gib"] > 0
    assert "token tiles at 0K: " in stdout
    assert set(headline["wide_tiles_best"]) == set(tiles["best"]) and headline["tiles_best"] == {}
    assert headline["wide_tests"] is None and headline["compiled_step"] == []  # quick's
    assert "stage wide_tiles ok" in stdout
    print(f"quick2 --dry-run: {wall:.0f} s wall")


@pytest.mark.parametrize("dry_run", [False, True], ids=["full-size", "dry-run"])
def test_no_stage_command_repeats_an_option(quick, tmp_path, dry_run):
    """Each option once per command (argparse keeps the last of a repeated one: the fit stage passed e2e's
    --timeout_s 150 and --warmup_steps 1, then its own 190 and 0; the dry run's attention stage two
    --estimated_budgets); each e2e stage sets its runs' timeout and warm-up steps."""
    stages = [stage for call in quick.CALLS
              for stage in quick.stages(quick.QuickArguments(call=call, dry_run=dry_run), tmp_path)]
    for stage in stages:
        options = [a for a in stage.command if a.startswith("--")]
        assert len(options) == len(set(options)), stage.name
    timeouts = {(s.name, s.command[s.command.index("--min_seq") + 1]): s.command[s.command.index("--timeout_s") + 1]
                for s in stages if "--timeout_s" in s.command}
    assert timeouts == ({("e2e", "256"): "120", ("compile", "256"): "240", ("e2e", "128"): "120",
                         ("fit", "512"): "120", ("layer0", "128"): "120", ("untiled", "128"): "120"} if dry_run else
                        {("e2e", "262144"): "150", ("compile", "262144"): "135", ("e2e", "131072"): "150",
                         ("fit", "524288"): "190", ("layer0", "131072"): "150", ("untiled", "131072"): "150"})
    warmups = {s.name: s.command[s.command.index("--warmup_steps") + 1]
               for s in stages if "--warmup_steps" in s.command}
    assert warmups == {"e2e": "1", "compile": "1", "fit": "0", "layer0": "1", "untiled": "1"}


def test_each_call_writes_at_most_eight_files_and_the_caps_fit_its_budget(quick, tmp_path):
    """A GPU call brings back at most 8 files: each call's stages write at most 6 besides its session JSON and log
    (the kernel tests' report and the head_dim-256 engine table go to the scratch folder, folded into the session's
    JSON); each stage's cap fits the 540 s budget, and every stage of both calls has a cap of its own."""
    args = quick.QuickArguments()
    seen = []
    for call, names in quick.CALLS.items():
        stages = quick.stages(quick.QuickArguments(call=call), tmp_path / "out", tmp_path / "scratch")
        outputs = [o for s in stages for o in s.outputs]
        assert len(outputs) == len(set(outputs)) <= 6 and [s.name for s in stages] == list(names)
        assert all(str(tmp_path / "out") not in " ".join(s.command) for s in stages if not s.outputs)
        assert all(s.cap_s == getattr(args, f"{s.name}_cap_s") < args.budget_s for s in stages)
        seen += names
    fields = {f.name.removesuffix("_cap_s") for f in dataclasses.fields(args) if f.name.endswith("_cap_s")}
    assert fields == set(seen)


@pytest.mark.parametrize("dry_run", [False, True], ids=["full-size", "dry-run"])
def test_the_tile_stage_comes_before_the_kernels_stages_and_they_launch_its_choice(quick, tmp_path, dry_run):
    """`quick` runs the 256K step and the compiled one first (the kernels' stages were measured on 2026-12-04, these
    not), then the tile short list at the attention stage's length, whose tiles.json is the tile table
    (`configs.TILES_ENV`) of the 128K attention after it."""
    from hf_sparse_cp.kernels.configs import TILES_ENV

    stages = quick.stages(quick.QuickArguments(dry_run=dry_run), tmp_path)
    assert [s.name for s in stages] == ["e2e", "compile", "tiles", "attention", "wide_tests", "wide_attention"]
    at = [s.name for s in stages].index("tiles")
    assert TILES_ENV not in stages[at].env_files and stages[at].outputs == ["tiles.json"]
    # (the head_dim-256 stages: a table of head_dim 128 would not apply there)
    assert all(s.env_files[TILES_ENV] == str(tmp_path / "tiles.json") for s in stages if s.name != "tiles"
               and "wide" not in s.name)
    tiles, attention = stages[at].command, stages[at + 1].command
    length = lambda cmd, option: cmd[cmd.index(option) + 1]
    assert length(tiles, "--seq_len") == ("96" if dry_run else length(attention, "--seq_lens"))


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
    assert report["complete"] and [s["status"] for s in report["stages"]] == ["skipped"] * len(quick.CALLS["quick"])
    assert json.loads((tmp_path / "quick-session.json").read_text())["stages"][0]["reason"].endswith("deadline")


def test_verdicts_keep_each_target_once_the_measured_entry_first(quick):
    e2e = {"targets": [{"target": "0.5b sparse_cp trains at 1024K", "measured": None, "pass": None, "required": "ok"},
                       {"target": "0.5b 128K: ratio", "measured": 3.2, "pass": True, "required": ">= 3"}]}
    fit = {"targets": [{"target": "0.5b sparse_cp trains at 1024K", "measured": "ok", "pass": True, "required": "ok"},
                       {"target": "0.5b 128K: ratio", "measured": None, "pass": None, "required": ">= 3"}]}
    got = {t["target"]: t["pass"] for t in quick.verdicts(e2e, fit)}
    assert got == {"0.5b sparse_cp trains at 1024K": True, "0.5b 128K: ratio": True}


def test_the_summary_of_a_gpu_session_with_an_out_of_memory_step(quick):
    """The H200 session of 2026-11-29 ended in a TypeError printing its 1M row (a peak, no step time)."""
    path = BENCHMARKS / "results" / "quick-session_nvidia-h200_20261129-221239.json"
    summary = quick.format_summary(json.loads(path.read_text()))
    assert "fit 0.5b sparse_cp 1024K: oom: CUDA out of memory" in summary
    assert "fit 0.5b sparse_cp 1024K: oom at 137.4 GiB (predicted 63.6)" in summary  # not a row with no reason
    assert "1024K: oom: \n" not in summary
    assert "fit 0.5b sparse_cp 512K: 24.0 s, 57.0 GiB (predicted 32.4)" in summary


def test_a_settings_cost_from_the_two_e2e_files(quick):
    run = lambda step, peak: {"results": [{"variant": "sparse_cp", "seq_len": 131072, "status": "ok", "step_s": step,
                                           "peak_gib": peak}]}
    (cost,) = quick.setting_cost(run(4.0, 12.0), run(3.6, 15.5), "tiled", "untiled")
    assert cost["tiled_share"] == pytest.approx(0.1) and (cost["tiled_step_s"], cost["untiled_step_s"]) == (4.0, 3.6)
    assert (cost["tiled_peak_gib"], cost["untiled_peak_gib"]) == (12.0, 15.5)
    (missing,) = quick.setting_cost({"results": []}, run(3.6, 15.5), "dense_first_layer", "sparse_first_layer")
    assert missing["dense_first_layer_share"] is None and missing["dense_first_layer_peak_gib"] is None


def test_the_kernel_tests_report_and_its_verdict(quick, tmp_path):
    """The wide_tests stage's pytest report (JUnit XML, in the scratch folder) folded into the session's JSON: a failed
    test fails the verdict, skipped ones alone (no GPU) leave it unmeasured, no report (pytest cut off) too."""
    report = tmp_path / "report.xml"
    report.write_text('<testsuites><testsuite name="pytest"><testcase name="a[d256]" time="1.5"/>'
                      '<testcase name="b[d160]"><failure message="rel_rms 0.3 &gt; 0.02">trace</failure></testcase>'
                      '<testcase name="c[fp32]"><skipped message="needs a CUDA GPU"/></testcase>'
                      '</testsuite></testsuites>')
    tests = quick.test_outcomes(report)
    assert (tests["passed"], tests["failed"], tests["error"], tests["skipped"]) == (1, 1, 0, 1)
    assert tests["tests"][1] == {"test": "b[d160]", "outcome": "failed", "time_s": 0.0, "message": "rel_rms 0.3 > 0.02"}
    flex = {"checks": [{"against": "flex", "status": "FAIL", "rel_rms": 0.5}]}
    kernels, against_flex = quick.correctness_verdicts(tests, flex)
    assert kernels["pass"] is False and kernels["measured"] == "1 passed, 1 failed, 1 skipped"
    assert against_flex["pass"] is False and against_flex["measured"] == 0.5
    skipped = {**tests, "passed": 0, "failed": 0}
    assert [v["pass"] for v in quick.correctness_verdicts(skipped, {})] == [None, None]
    assert quick.test_outcomes(tmp_path / "absent.xml") is None
    assert quick.correctness_verdicts(None, {})[0]["measured"] is None


def test_the_compiled_step_against_the_uncompiled_one(quick):
    row = lambda variant, step, **kw: {"variant": variant, "seq_len": 262144, "status": "ok", "step_s": step, **kw}
    e2e = {"results": [row("sparse_cp", 7.0, losses=[12.0, 11.0], peak_gib=17.5), row("sdpa+liger", 33.6)]}
    dynamo = {"stats": {"unique_graphs": 3},
              "graph_breaks": {"Skip calling `torch.compiler.disable()`d function": 24, "Tensor.item()": 2}}
    liger = {"choice": "liger", "description": "fused ops: liger-kernel 0.8.5 (...)"}
    inductor = {"choice": "off", "description": "fused ops: by torch.compile's inductor (...)"}
    e2e["results"][0]["fused_ops"] = liger
    compiled = {"results": [row("sparse_cp", 5.6, losses=[12.0, 11.011], peak_gib=18.0, warmup_times_s=[80.0],
                                dynamo=dynamo, fused_ops=inductor)]}
    (step,) = quick.compiled_step(e2e, compiled)
    assert (step["fused_ops"], step["eager_fused_ops"]) == (inductor["description"], liger["description"])
    assert step["speedup"] == pytest.approx(1.25) and step["compiled_over_liger"] == pytest.approx(6.0)
    assert step["first_step_s"] == 80.0 and step["eager_peak_gib"] == 17.5
    assert step["loss_rel_diff"] == pytest.approx(1e-3) and (step["unique_graphs"], step["graph_breaks"]) == (3, 26)
    assert step["attention_breaks"] == 24
    failed = {"results": [{"variant": "sparse_cp", "seq_len": 262144, "status": "timeout", "reason": "exceeded"}]}
    (step,) = quick.compiled_step(e2e, failed)
    assert step["compiled_step_s"] is None and step["speedup"] is None and step["reason"] == "exceeded"
