"""`hf-sparse-cp simulate` and benchmarks/simulate_cluster.py end to end (tiny sizes): the report, its
sources and the plot."""

import json
import re
import subprocess
import sys

import pytest

from hf_sparse_cp.simulator.simulate import CONFIGURATIONS


def test_simulate_command(tmp_path, monkeypatch, capsys):
    """`hf-sparse-cp simulate` writes its rows, their sources and a plot into the current directory (tiny sizes):
    by default the rows of the question (the dense ring and the plugin's default sparse ring, priced with our
    kernels' measured costs), with --all every configuration, also priced with FlexAttention's costs and at its
    block-only bound, labelled as a bound (issues #52, #50)."""
    import json

    from hf_sparse_cp.cli import main

    pytest.importorskip("matplotlib")
    monkeypatch.chdir(tmp_path)
    assert main(["simulate", "--seq", "32768", "--cp", "8", "16", "--layout-heads", "1"]) == 0
    out = tmp_path / "simulate-cluster_qwen2.5-3b_8xH100-IB400.json"
    assert out.with_suffix(".png").stat().st_size > 0
    report = json.loads(out.read_text())
    rows = report["rows"]
    assert [(r["config"], r["kernel"], r["cp"]) for r in rows] == [
        ("dense ring", "cudnn", 8), ("striped sparse", "ours", 8), ("dense ring", "cudnn", 16),
        ("striped sparse", "ours", 16)] and "mtraining" not in report
    assert all(r["speedup_vs_dense_ring"] == 1.0 for r in rows if r["config"] == "dense ring")
    assert all(r["step_s"] > 0 and 0.0 <= r["comm_share"] < 1.0 for r in rows)
    assert "attention_nvidia-h100" in report["calibration"]["sources"]["sparse attention"]
    assert "anchors.md" in report["calibration"]["sources"]["dense attention"]
    assert report["cluster"]["inter"]["source"]
    capsys.readouterr()
    every = main(["simulate", "--seq", "32768", "--cp", "8", "--layout-heads", "1", "--all", "--no-mtraining"])
    printed = capsys.readouterr().out
    rows = json.loads(out.read_text())["rows"]
    assert every == 0 and {r["config"] for r in rows} == set(CONFIGURATIONS)
    assert {r["kernel"] for r in rows if r["config"] != "dense ring"} == {"ours", "flex", "block-only"}
    assert sum(r["config"] == "dense ring" for r in rows) == 1
    bounds = [r for r in rows if r["bound"]]
    assert bounds and all(r["kernel"] == "block-only" for r in bounds)
    assert printed.count("block-only (bound)") == len(bounds) and "an optimistic bound, not a prediction" in printed


def test_simulate_takes_any_config_and_a_custom_cluster(tmp_path, monkeypatch, capsys):
    """`--config` reads any causal LM's config.json (here a Llama-3-8B-shaped one); the cluster flags replace the
    preset's GPU FLOP/s, GPUs per node and links, and the report says so (issue #52)."""
    import json

    from hf_sparse_cp.simulator import simulate_cli

    pytest.importorskip("matplotlib")
    monkeypatch.chdir(tmp_path)
    folder = tmp_path / "llama-8b"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "model_type": "llama", "num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
        "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256}))
    base = ["--seq", "32768", "--cp", "4", "--layout-heads", "1", "--config", str(folder)]
    preset = simulate_cli.main(base)
    custom = simulate_cli.main([*base, "--cluster", "8xA100-IB200", "--gpu-tflops", "624", "--gpus-per-node", "4",
                                "--intra-node-gbps", "115"])
    assert preset["model"]["layers"] == 32 and preset["model"]["intermediate"] == 14336
    assert preset["rows"][0]["model"] == "llama-8b"
    assert custom["cluster"]["gpus_per_node"] == 4 and custom["cluster"]["intra"]["bandwidth"] == 115e9
    assert "A100 costs x 624/312 (--gpu-tflops" in custom["calibration"]["sources"]["scaling"]
    dense = [r["step_s"] for r in (preset["rows"][0], custom["rows"][0])]
    assert dense[0] != dense[1]
    # (issue #50: refused, naming no width; its learned positions reach the length, as GPT-2's 1,024 would not)
    (folder / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_positions": 32768}))
    gpt2 = simulate_cli.main(base)["model"]  # its MLP: n_inner (None: 4 x n_embd), two matrices
    assert (gpt2["hidden"], gpt2["intermediate"], gpt2["gated"]) == (768, 3072, False)
    (folder / "config.json").write_text(json.dumps({  # Gemma 3 270M: 15 of its 18 layers attend within 512 tokens
        "model_type": "gemma3_text", "num_hidden_layers": 18, "hidden_size": 640, "num_attention_heads": 4,
        "num_key_value_heads": 1, "head_dim": 256, "intermediate_size": 2048, "vocab_size": 262144,
        "sliding_window": 512}))
    assert {r["sliding_layers"] for r in simulate_cli.main(base)["rows"]} == {15}
    capsys.readouterr()
    with pytest.raises(SystemExit) as refused:  # as argparse refuses a flag, before anything prints
        (folder / "config.json").write_text(json.dumps({"model_type": "opt"}))  # its width: ffn_dim, not read
        simulate_cli.main(base)
    out, err = capsys.readouterr()
    assert refused.value.code == 2 and out == "" and "no intermediate_size" in err


def test_simulate_writes_into_folders_that_do_not_exist_yet(tmp_path):
    """--json and --png in missing folders: created (they ended with a FileNotFoundError after the simulation)."""
    from hf_sparse_cp.simulator import simulate_cli

    pytest.importorskip("matplotlib")
    json_path, png = tmp_path / "new" / "a.json", tmp_path / "other" / "deeper" / "a.png"
    simulate_cli.main(["--model", "qwen2.5-0.5b", "--seq", "8192", "--cp", "2", "--layout-heads", "1",
                       "--no-mtraining", "--configs", "dense ring", "--json", str(json_path), "--png", str(png)])
    assert json_path.stat().st_size > 0 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("command", ["simulate", "memory"])
def test_every_help_entry_has_text_and_its_default(command, monkeypatch):
    """Every flag has a help text and states its default once (unless None: the help says what stands in)."""
    from hf_sparse_cp.simulator import memory_cli, simulate_cli

    monkeypatch.setenv("COLUMNS", "1000")  # (one line per flag)
    parser = {"simulate": simulate_cli, "memory": memory_cli}[command].build_parser()
    entries = re.split(r"\n(?=  -)", parser.format_help())  # one entry per flag: its line(s) and help
    for action in parser._actions:
        if action.option_strings and action.dest != "help":
            assert action.help, action.option_strings
            entry = next(e for e in entries if e.strip().startswith(action.option_strings[0]))
            # its default said once (`memory --help` said "(default 0.9: 72 GB of 80). (default: 0.9)"), and no
            # "(default: None)" after a help that says what stands in
            said = len(re.findall(r"\(default[ :)]|default:", entry))
            assert said == (action.default is not None) or (action.default is None and said == 1), entry
            assert "(default: None)" not in entry, entry


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
    assert set(rows) == {("dense ring", "cudnn"), *((config, kernel) for config in ("striped sparse", "planner sparse")
                                                    for kernel in ("ours", "flex", "block-only"))}
    documents = len(mix_lengths("long-tail", 65536, 0))
    assert documents > 1 and all(r["documents"] == documents for r in rows.values())
    planner, striped = rows[("planner sparse", "flex")], rows[("striped sparse", "flex")]
    assert len(set(planner["local_blocks"])) > 1 and len(set(striped["local_blocks"])) == 1  # ragged vs even
    assert all(r["step_s"] > 0 and 0.0 <= r["comm_share"] < 1.0 for r in rows.values())


def test_the_simulator_reads_the_density_at_each_length_from_the_curve(tmp_path, monkeypatch, capsys):
    """`hf-sparse-cp simulate` draws each length's sparse layout at the curve's kept fraction, and labels the
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
    capsys.readouterr()
    with pytest.raises(SystemExit) as refused:
        simulate_cli.main([*base, "--kept-curve", str(tmp_path / "missing.json")])
    out, err = capsys.readouterr()
    assert refused.value.code == 2 and out == "" and f"error: --kept-curve {tmp_path / 'missing.json'}" in err


def test_the_header_states_the_target_and_the_realized_kept_fraction(tmp_path, monkeypatch, capsys):
    """The header gave the kept fraction the diagonals are drawn for (--density 0.175) as the layouts' while the
    table's kept, the realized one with the verticals on top, said 0.19: both, labelled, the realized the table's."""
    from hf_sparse_cp.simulator import simulate_cli

    monkeypatch.chdir(tmp_path)
    report = simulate_cli.main(["--seq", "32768", "--cp", "8", "--no-mtraining", "--layout-heads", "1", "--configs",
                                "dense ring", "striped sparse", "--density", "0.175", "--json", "report.json"])
    (realized,) = {r["kept"] for r in report["rows"] if r["config"] == "striped sparse"}
    assert realized > 0.175 + 0.005  # (the verticals' blocks on top of the diagonals', as the header says)
    header = capsys.readouterr().out.split(simulate_cli.HEADER)[0]
    assert "diagonals for the target kept fraction of the causal blocks, 1000 verticals + 32 sink tokens on top " \
           "(the realized fraction, the table's kept)" in header
    assert f"  32768 tokens: kept target 0.175, realized {realized:.3f}; layout width 1.000 of the rows (given; " \
           "--density)" in header


def test_each_lengths_sparse_layout_is_drawn_once_for_the_header_and_the_rows(tmp_path, monkeypatch, capsys):
    """The header's realized kept fraction drew each length's layout once more than the rows did (the same seed: the
    same numbers, twice the drawing): one draw per length now, the header's the rows' (every configuration and CP
    size of a length reads it from the workload's cache); #50: so does a length that each split pads to its own grid
    (20000), every sparse row's kept the row's."""
    from hf_sparse_cp.simulator import simulate_cli

    drawn = []

    def counted(*args, **kwargs):
        drawn.append(args[2])  # (its length)
        return draw(*args, **kwargs)

    draw = simulate_cli.random_vertical_slash_layout
    monkeypatch.setattr(simulate_cli, "random_vertical_slash_layout", counted)
    monkeypatch.chdir(tmp_path)
    report = simulate_cli.main(["--seq", "16384", "20000", "32768", "--cp", "4", "8", "--no-mtraining",
                                "--layout-heads", "1", "--all", "--json", "report.json"])
    assert drawn == [16384, 20000, 32768]
    header = capsys.readouterr().out.split(simulate_cli.HEADER)[0]
    for seq in (16384, 20000, 32768):
        (kept,) = {r["kept"] for r in report["rows"] if r["seq"] == seq and r["config"] != "dense ring"}
        assert f"  {seq} tokens: kept target " in header and f", realized {kept:.3f}; " in header


def test_simulate_answers_for_the_cp_mode_asked(tmp_path, monkeypatch, capsys):
    """`--cp_mode` / `--cp_ulysses_size` as training takes them (#49): the sparse rows are the mode's (resolved per CP
    size by the mode objects: heads over 8 of 8 GPUs is ulysses), priced by the head-parallel step model on the
    mode's split; the dense ring stays the baseline; a sharding the mode refuses is skipped naming why, and flags
    training would refuse are refused before any simulation."""
    import json

    from hf_sparse_cp.cli import main
    from hf_sparse_cp.simulator.head_parallel import head_parallel_setup, predict_head_parallel_step
    from hf_sparse_cp.simulator.shapes import MODELS
    from hf_sparse_cp.simulator.simulate_cli import BLOCK, parse_args, sequence_workload
    from hf_sparse_cp.simulator.step_model import CLUSTERS, HARDWARE

    pytest.importorskip("matplotlib")
    monkeypatch.chdir(tmp_path)
    argv = ["--model", "qwen2.5-0.5b", "--seq", "32768", "--cp", "8", "16", "--layout-heads", "1",
            "--cp_mode", "hybrid", "--cp_ulysses_size", "8", "--configs", "dense ring", "striped sparse",
            "zigzag sparse", "planner sparse", "--dense-first-layers", "0"]
    assert main(["simulate", *argv]) == 0
    printed = capsys.readouterr().out
    assert "CP 8 runs ulysses (heads over 8 GPUs); CP 16 runs hybrid (heads over 8 GPUs, a ring of 2 across them)" \
        in printed
    assert "planner sparse              skipped under --cp_mode hybrid: --cp_sharding document is not available" \
        in printed
    rows = json.loads((tmp_path / "simulate-cluster_qwen2.5-0.5b_8xH100-IB400.json").read_text())["rows"]
    assert [(r["config"], r["cp"], r["mode"], r["head_size"]) for r in rows] == [
        ("dense ring", 8, "ring", 1), ("striped sparse", 8, "ulysses", 8),  # ulysses: no ring, one piece each
        ("dense ring", 16, "ring", 1), ("striped sparse", 16, "hybrid", 8), ("zigzag sparse", 16, "hybrid", 8)]
    args = parse_args(argv)
    setup = head_parallel_setup(sequence_workload(args, 32768), 16, 8, BLOCK, "sparse", "striped")
    want = predict_head_parallel_step(setup, MODELS["qwen2.5-0.5b"], HARDWARE["8xH100-IB400"](dense_kernel="cudnn"),
                                      CLUSTERS["8xH100-IB400"], head_size=8)
    assert rows[3]["step_s"] == pytest.approx(want["step_s"], rel=1e-12)
    with pytest.raises(SystemExit):
        main(["simulate", "--seq", "32768", "--cp", "8", "--cp_mode", "hybrid"])
    assert "--cp_mode hybrid needs --cp_ulysses_size" in capsys.readouterr().err


def test_simulate_without_matplotlib_writes_its_json_and_refuses_only_a_plot_asked_for(tmp_path, monkeypatch, capsys):
    """Issue #50: on the README's install (`.[demo]`, no matplotlib) `hf-sparse-cp simulate` with no flags was
    refused for its default plot, a file nobody asked for: it now writes the JSON and says how to get the plot;
    `--png FILE` is still refused before the simulation, naming the extra."""
    from hf_sparse_cp.simulator import simulate_cli

    for name in ("matplotlib", "matplotlib.figure"):  # (as on a machine without it)
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.chdir(tmp_path)
    args = ["--model", "qwen2.5-0.5b", "--seq", "8192", "--cp", "2", "--layout-heads", "1", "--no-mtraining"]
    report = simulate_cli.main(args)
    out = tmp_path / "simulate-cluster_qwen2.5-0.5b_8xH100-IB400.json"
    assert json.loads(out.read_text())["rows"] == report["rows"] and report["rows"]
    assert not list(tmp_path.glob("*.png"))
    assert f"wrote {out} (no plot: drawing it needs matplotlib, pip install 'hf-sparse-cp[plot]')" in \
        capsys.readouterr().out
    with pytest.raises(SystemExit) as refused:
        simulate_cli.main([*args, "--png", str(tmp_path / "a.png")])
    assert refused.value.code == 2 and "needs matplotlib: pip install 'hf-sparse-cp[plot]'" in capsys.readouterr().err


def test_lengths_below_the_checkpointing_threshold_are_predicted_without_the_recomputed_forward(tmp_path, capsys):
    """Issue #50: training checkpoints from --sparse_gradient_checkpointing_min_length (16K) on; `simulate` charged
    every length a recomputed forward: at 8K on CP 2 the dense ring's step 0.17 s (0.13 s as it trains), the striped
    sparse one's 0.34 s (0.23 s). Each row says whether it checkpoints; training's flag name is taken, 1 checkpointing
    every length."""
    from hf_sparse_cp.cli import main

    def rows(*flags: str) -> dict[int, dict]:
        out = tmp_path / "sim.json"
        main(["simulate", "--seq", "8192", "16384", "--cp", "2", "--configs", "dense ring", "--json", str(out),
                           "--png", str(tmp_path / "sim.png"), *flags])
        return {row["seq"]: row for row in json.loads(out.read_text())["rows"]}

    trained, recomputed = rows(), rows("--sparse_gradient_checkpointing_min_length", "1")
    capsys.readouterr()
    assert [trained[n]["gradient_checkpointing"] for n in (8192, 16384)] == [False, True]
    assert recomputed[8192]["gradient_checkpointing"]
    assert trained[8192]["attention_fwd_s"] == pytest.approx(recomputed[8192]["attention_fwd_s"])
    assert trained[8192]["step_s"] < recomputed[8192]["step_s"] - trained[8192]["attention_fwd_s"] / 2
    assert trained[16384]["step_s"] == pytest.approx(recomputed[16384]["step_s"])


def test_a_config_s_report_names_no_preset(tmp_path, capsys):
    """`simulate --config DIR --json` recorded the preset default (`"model": "qwen2.5-3b"`) among its arguments beside
    the config it simulated (#50): the report's arguments name the config alone."""
    from hf_sparse_cp.cli import main
    from hf_sparse_cp.testing.tiny_models import tiny_config

    tiny_config("qwen2", vocab_size=300).save_pretrained(tmp_path / "tiny")
    main(["simulate", "--config", str(tmp_path / "tiny"), "--seq", "8192", "--cp", "2", "--configs", "dense ring",
          "--json", str(tmp_path / "sim.json"), "--png", str(tmp_path / "sim.png")])
    capsys.readouterr()
    report = json.loads((tmp_path / "sim.json").read_text())
    assert report["args"]["model"] is None and report["args"]["config"] == str(tmp_path / "tiny")


@pytest.mark.parametrize("fields", [dict(output_router_logits=True), dict(router_jitter_noise=0.1)])
def test_simulate_times_a_mixture_of_experts_with_a_router_loss_or_jitter_as_without(fields, tmp_path, capsys):
    """The router's auxiliary loss and its input noise hold tensors the memory predictions do not count (`memory`
    refuses them: test_memory_moe.py), and cost a softmax over [tokens, experts] and an elementwise product a
    layer: `simulate` refused them as `memory` does, for its memory reasons. It times the model as without them."""
    from hf_sparse_cp.cli import main
    from hf_sparse_cp.testing.tiny_models import tiny_config

    pytest.importorskip("matplotlib")
    times = {}
    for name, given in (("plain", {}), ("routed", fields)):
        folder = tmp_path / name
        tiny_config("mixtral", vocab_size=300, **given).save_pretrained(folder)
        out = tmp_path / f"{name}.json"
        main(["simulate", "--config", str(folder), "--seq", "65536", "--cp", "4", "--json", str(out)])
        times[name] = [round(row["step_s"], 12) for row in json.loads(out.read_text())["rows"]]
    capsys.readouterr()
    assert times["plain"] and times["routed"] == times["plain"]


def test_two_runs_of_one_simulate_command_write_the_same_report(tmp_path):
    """Two runs of `hf-sparse-cp simulate` with the same arguments wrote reports differing in the last digits of their
    times (the fits of the measured costs, by LAPACK's least squares, varied from one process to the next): apart
    from when it was made and where it was written, the report is the same bits every run."""
    reports = []
    for run in ("one", "two"):
        out = tmp_path / f"{run}.json"
        subprocess.run([sys.executable, "-m", "hf_sparse_cp.cli", "simulate", "--seq", "65536", "--cp", "4",
                        "--json", str(out), "--png", str(tmp_path / f"{run}.png")], check=True, capture_output=True)
        report = json.loads(out.read_text())
        del report["created"], report["args"]["json"], report["args"]["png"]
        reports.append(report)
    assert reports[0] == reports[1]


def test_simulate_and_memory_give_a_rank_the_same_tokens_and_simulate_pads_as_training_does(tmp_path, monkeypatch):
    """`memory --seq-len 1000 --cp 3` answered where `simulate` refused; under zigzag they split the sequence apart
    (memory 384 tokens a rank, training and simulate 512). One split now (`head_group_plan`): each rank's tokens in
    simulate's rows are memory's and training's split's (`ShardPlan.local_len`), at a length of whole chunks (1536)
    and, #50, at one that each sharding and CP size pads to its own grid (1000 at CP 2, 3 and 4, which simulate
    refused then), under the ring and under head groups."""
    from hf_sparse_cp.distributed.split.blocks import head_group_plan
    from hf_sparse_cp.simulator import memory_cli, simulate_cli

    monkeypatch.chdir(tmp_path)
    for seq, cps, mode in (("1536", ["3"], []), ("1000", ["2", "3"], []),
                           ("1000", ["2", "4"], ["--cp_mode", "hybrid", "--cp_ulysses_size", "2"])):
        report = simulate_cli.main(["--model", "qwen2.5-0.5b", "--seq", seq, "--cp", *cps, "--configs", "dense ring",
                                    "zigzag sparse", "striped sparse", "--no-mtraining", "--layout-heads", "1",
                                    "--json", "simulate.json", *mode])
        for cp in map(int, cps):
            for config, sharding in (("dense ring", "zigzag"), ("zigzag sparse", "zigzag"),
                                     ("striped sparse", "striped")):
                rows = [r for r in report["rows"] if r["config"] == config and r["cp"] == cp]
                if not rows:  # (a sharding the mode does not run: ulysses holds the whole sequence)
                    continue
                (row,) = rows
                head_size = row["head_size"]  # (the dense ring stays the ring, every mode's baseline)
                memory_cli.main(["--model", "qwen2.5-0.5b", "--seq-len", seq, "--cp", str(cp), "--cp_sharding",
                                 sharding, "--quiet", "--json", "memory.json", *(mode if head_size > 1 else [])])
                tokens = json.loads((tmp_path / "memory.json").read_text())["lengths"][seq]["tokens_per_rank"]
                local = head_group_plan(sharding, cp, head_size, simulate_cli.BLOCK, int(seq)).local_len // head_size
                assert [b * simulate_cli.BLOCK // head_size for b in row["local_blocks"]] == \
                    [local] * (cp // head_size) == [tokens] * (cp // head_size), (seq, cp, config)
                assert row["tokens_per_s"] == pytest.approx(int(seq) / row["step_s"])  # (the real tokens)


@pytest.mark.parametrize("mode", [[], ["--cp_mode", "hybrid", "--cp_ulysses_size", "2"]], ids=["ring", "hybrid"])
def test_lengths_on_every_splits_grid_are_predicted_as_before_layouts_were_padded(mode, capsys):
    """#50 gives every split the row's layouts padded to its grid; at lengths that every split holds unpadded the rows
    are those of the layouts drawn for each split's padded length, as `simulate` drew them before."""
    from dataclasses import replace

    import torch

    from hf_sparse_cp.attention.build import dense_layout
    from hf_sparse_cp.attention.tokens import TokenMeta
    from hf_sparse_cp.simulator import simulate_cli
    from hf_sparse_cp.simulator.arguments import cluster_of
    from hf_sparse_cp.simulator.shapes import MODELS

    args = simulate_cli.parse_args(["--model", "qwen2.5-0.5b", "--seq", "8192", "16384", "--cp", "4", "8", "--all",
                                    "--no-mtraining", "--layout-heads", "2", *mode])
    model = MODELS["qwen2.5-0.5b"]

    def drawn_per_split(seq: int):  # (before #50: each split's layouts built over its padded length)
        density = simulate_cli.kept_target(args, seq).kept

        def layout(kind, plan, window=None):
            meta, bs = TokenMeta.contiguous(1, seq).pad_to(plan.padded_len), simulate_cli.BLOCK
            return dense_layout(meta, bs, window) if kind == "dense" else simulate_cli.random_vertical_slash_layout(
                1, args.layout_heads, seq, bs, num_diagonals=round(density * seq // bs), num_verticals=args.verticals,
                sink_tokens=args.sink, diagonal_spread=args.spread, padded_len=plan.padded_len,
                generator=torch.Generator().manual_seed(args.seed))

        return replace(simulate_cli.workload_for(args, seq, model), layout=layout)

    def rows(workload_of):
        cluster, hardware_of = cluster_of(args)
        return simulate_cli.simulate(args, "qwen2.5-0.5b", model, cluster, hardware_of,
                                     [(seq, workload_of(seq)) for seq in args.seq], args.cp, args.configs,
                                     args.dense_kernel, args.sparse_kernels)

    now = rows(lambda seq: simulate_cli.workload_for(args, seq, model))
    assert len(now) > 8 and now == rows(drawn_per_split)
    capsys.readouterr()
