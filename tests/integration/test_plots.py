"""`hf-sparse-cp plot` (issue #15): the kept fraction per layer from a run's logs and the block layouts of
one forward, checked through the matplotlib figures, not only the files."""

import json
import shutil
import sys

import huggingface_hub.constants
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments, default_data_collator

import hf_sparse_cp
from hf_sparse_cp import (
    SparseAttentionConfig,
    attach_to_trainer,
    disable_sparse_attention,
    enable_sparse_attention,
    patch,
)
from hf_sparse_cp.cli import main
from hf_sparse_cp.examples.passkey import passkey_dataset
from hf_sparse_cp.examples.tokenizer import byte_tokenizer
from hf_sparse_cp.reporting.card_quick_start import TOKENIZER_FILES
from hf_sparse_cp.reporting.kept_fraction_figure import kept_fraction_series, mean_kept_fraction_per_layer
from hf_sparse_cp.reporting.model_card import KEPT_FRACTION_PLOT
from hf_sparse_cp.reporting.plots import (
    LAYOUTS_PLOT,
    block_coverage,
    capture_layouts,
    load_sparse_model,
    plot_run,
    sample_ids,
)
from hf_sparse_cp.testing.layouts import random_layout
from hf_sparse_cp.testing.tiny_models import tiny_config
from hf_sparse_cp.trainer.arguments import SparseCPArguments

SEQ_LEN = 512
PATTERN = SparseAttentionConfig(block_size=32, min_seq_len=256, vertical_topk=8, slash_topk=16, local_window=32,
                                sink_tokens=4, last_q=32, dense_first_layers=0)  # both layers sparse
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """The output directory of a 3-step sparse run: no files of its own, one checkpoint (model, tokenizer,
    trainer_state.json)."""
    out = tmp_path_factory.mktemp("run")
    tok = byte_tokenizer()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("qwen2", vocab_size=len(tok)))
    training = TrainingArguments(output_dir=str(out), max_steps=3, per_device_train_batch_size=1, logging_steps=1,
                                 report_to="none", save_strategy="steps", save_steps=3, use_cpu=True)
    sparse = SparseCPArguments(sparse_attention=True, sparse_fused_loss=False)
    enable_sparse_attention(model, sparse, PATTERN, training, max_length=SEQ_LEN)
    trainer = Trainer(model=model, args=training, train_dataset=passkey_dataset(tok, 3, SEQ_LEN),
                      data_collator=default_data_collator, processing_class=tok)
    attach_to_trainer(trainer, sparse)
    trainer.train()
    disable_sparse_attention(model)
    assert [p.name for p in out.iterdir()] == ["checkpoint-3"]
    return out


def _log_history(run_dir) -> list[dict]:
    return json.loads((run_dir / "checkpoint-3" / "trainer_state.json").read_text())["log_history"]


def test_cli_plot_writes_both_pictures(run_dir, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from matplotlib.image import imread

    assert main(["plot", str(run_dir), "--out_dir", str(tmp_path), "--max_length", str(SEQ_LEN)]) == 0
    written = sorted(p.name for p in tmp_path.iterdir())
    assert written == sorted([KEPT_FRACTION_PLOT, LAYOUTS_PLOT])
    out = capsys.readouterr().out
    for name in written:
        assert (tmp_path / name).read_bytes()[:8] == PNG and f"wrote {tmp_path / name}" in out
        image = imread(tmp_path / name)
        assert image.shape[0] > 300 and image.shape[1] > 500 and image.std() > 0.05  # a drawing, not a blank
    assert not (run_dir / KEPT_FRACTION_PLOT).exists()  # --out_dir, not the run directory


def test_the_kept_fraction_figure_shows_every_layer_over_steps_and_its_mean(run_dir, tmp_path):
    pytest.importorskip("matplotlib")
    (figure,) = plot_run(run_dir, tmp_path, only="kept_fraction").values()
    over_steps, per_layer = figure.axes
    assert over_steps.get_title() == "Kept fraction of attention blocks per layer"
    assert per_layer.get_title() == "Mean kept fraction per layer"
    assert (over_steps.get_xlabel(), per_layer.get_xlabel()) == ("optimizer step", "layer")
    history = _log_history(run_dir)
    lines = {line.get_label(): line for line in over_steps.get_lines()}
    assert set(lines) == {"layer 0", "layer 1", "mean over layers"}
    for layer, (steps, values) in kept_fraction_series(history).items():
        assert list(lines[f"layer {layer}"].get_xdata()) == steps == [1, 2, 3]
        assert list(lines[f"layer {layer}"].get_ydata()) == values
    means = mean_kept_fraction_per_layer(history)
    heights = [bar.get_height() for bar in per_layer.patches]
    assert heights == pytest.approx(list(means.values())) and all(0 < h < 1 for h in heights)
    assert [t.get_text() for t in over_steps.get_legend().get_texts()] == ["layer 0", "layer 1", "mean over layers"]


def test_the_layout_figure_draws_the_captured_layouts_per_layer_and_head(run_dir, tmp_path):
    pytest.importorskip("matplotlib")
    (figure,) = plot_run(run_dir, tmp_path, only="layouts", seq_len=SEQ_LEN, layers=[0, 1], heads=[1, 3]).values()
    panels = [ax for ax in figure.axes if ax.images]
    assert len(figure.axes) == len(panels) + 1  # four panels and the colorbar
    assert [ax.get_title().split(":")[0] for ax in panels] == [
        "layer 0, head 1", "layer 0, head 3", "layer 1, head 1", "layer 1, head 3"]
    assert all((ax.get_xlabel(), ax.get_ylabel()) == ("key block", "query block") for ax in panels)
    assert "512 tokens (passkey sample), blocks of 32" in figure.get_suptitle()
    # the same forward, captured here: each panel is its layer's layout for that head
    model_dir = run_dir / "checkpoint-3"
    patch()
    ids = sample_ids(AutoTokenizer.from_pretrained(model_dir), seq_len=SEQ_LEN)
    layouts = capture_layouts(load_sparse_model(model_dir), ids)
    assert sorted(layouts) == [0, 1]
    nqb = SEQ_LEN // 32
    causal = torch.ones(nqb, nqb, dtype=torch.bool).tril()
    for ax, (layer, head) in zip(panels, [(0, 1), (0, 3), (1, 1), (1, 3)]):
        coverage = block_coverage(layouts[layer], SEQ_LEN, head)
        drawn = torch.from_numpy(ax.images[0].get_array().filled(-1.0))
        assert torch.equal(drawn[causal], coverage[causal]) and bool((drawn[~causal] == -1).all())
        kept = layouts[layer].num_computed_blocks()[0, head].item() / causal.sum().item()
        assert ax.get_title().endswith(f"{kept:.0%} kept") and kept < 0.95  # sparse: blocks were skipped


def test_a_dense_layer_is_drawn_as_its_dense_layout(run_dir, tmp_path, capsys):
    """A layer that runs dense (the default `dense_first_layers: 1`, a document below `min_seq_len`) builds the dense
    layout, which the figure drew from no layer: `--layers 0` under such a pattern was refused as "layers [0] do
    not exist: the model has layers 1 to 1", and the default panels left layer 0 out."""
    pytest.importorskip("matplotlib")
    pattern = tmp_path / "pattern.yaml"  # PATTERN with layer 0 dense
    pattern.write_text(json.dumps({**PATTERN.to_dict(), "dense_first_layers": 1}))
    assert main(["plot", str(run_dir), "--only", "layouts", "--max_length", str(SEQ_LEN), "--layers", "0,1", "--heads",
                 "0", "--sparse_config", str(pattern), "--out_dir", str(tmp_path)]) == 0, capsys.readouterr().err
    (figure,) = plot_run(run_dir, tmp_path, only="layouts", seq_len=SEQ_LEN, heads=[0],
                         sparse_config=pattern).values()
    titles = [ax.get_title() for ax in figure.axes if ax.images]
    assert titles[0] == "layer 0, head 0: 100% kept" and titles[1].startswith("layer 1, head 0: "), titles
    assert titles[1] != "layer 1, head 0: 100% kept"


def test_the_layout_panels_tick_whole_blocks():
    """A layout of a few blocks (256 tokens in blocks of 64) was drawn with query-block ticks at -0.5, 0.0, 0.5, ...:
    both axes of every panel tick whole block indices."""
    pytest.importorskip("matplotlib")
    from hf_sparse_cp.reporting.plots import layout_figure

    layout = random_layout(1, 2, 256, 256, 64, 0.5, 0.1, generator=torch.Generator().manual_seed(0))
    figure = layout_figure({0: layout}, 256, 2)
    for ax in (ax for ax in figure.axes if ax.images):
        for ticks in (ax.get_xticks(), ax.get_yticks()):
            assert all(float(t).is_integer() for t in ticks), ticks


def test_block_coverage_is_the_mask_averaged_over_key_blocks():
    layout = random_layout(1, 3, 200, 200, 16, 0.3, 0.05, generator=torch.Generator().manual_seed(0))
    assert layout.col_cnt.sum() > 0
    mask = layout.to_mask(3, 200, 200)[0].double()  # [H, q, k]; k = 200 leaves a last key block of 8 tokens
    for head in range(3):
        rows = mask[head, ::16]  # the rows of a query block share their keys
        pooled = torch.stack([rows[:, k:k + 16].mean(-1) for k in range(0, 200, 16)], dim=-1)
        coverage = block_coverage(layout, 200, head)
        torch.testing.assert_close(coverage, pooled)
        assert ((coverage > 0) & (coverage < 1)).any()  # columns show as parts of a block


def test_plot_without_matplotlib_names_the_extra(run_dir, monkeypatch, capsys):
    for name in ("matplotlib", "matplotlib.figure"):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(SystemExit) as exit_:
        main(["plot", str(run_dir)])
    assert exit_.value.code == 2
    assert "pip install 'hf-sparse-cp[plot]'" in capsys.readouterr().err


@pytest.mark.parametrize("args, fix", [
    (["--only", "kept_fraction"], "trainer.save_state()"),  # an empty directory: no trainer_state.json
    (["--only", "layouts"], "--model PATH_OR_HUB_ID"),  # ... and no model
])
def test_plot_names_the_fix_for_a_directory_without_logs_or_model(tmp_path, capsys, args, fix):
    pytest.importorskip("matplotlib")
    with pytest.raises(SystemExit):
        main(["plot", str(tmp_path), *args])
    assert fix in capsys.readouterr().err


@pytest.mark.parametrize("args, refused", [
    # each was ignored without a word: --only kept_fraction draws no layouts, and '' read as no value
    (["--only", "kept_fraction", "--layers", "0"], "--layers chooses what the block layouts draw, and --only "
     "kept_fraction draws none: drop it, or drop --only."),
    (["--only", "kept_fraction", "--max_length", "256", "--sparse_config", "trial"], "--max_length, --sparse_config "
     "choose what the block layouts draw, and --only kept_fraction draws none: drop them, or drop --only."),
    (["--model", ""], "--model '' is empty (an unset shell variable?): give its value, or drop the flag."),
    # (#50: failed after the logs' plot with huggingface_hub's rule for repo ids, naming neither the flag nor the fix)
    (["--model", "/no/such/model"], "--model /no/such/model: no such folder here, nor a Hub id (owner/name); give "
     "the folder of a saved model (config.json), or its Hub id."),
    (["--model", __file__], f"--model {__file__}: a file here, not a folder, nor a Hub id"),
    # each failed only after the model's forward, naming no flag: a FileNotFoundError, an IsADirectoryError, a
    # FileExistsError, and a MemoryError traceback building the passkey sample
    (["--text_file", "missing.txt"], "--text_file missing.txt: no such file; give the file of a text."),
    (["--text_file", "."], "--text_file .: a folder, not a text file; give the file of a text."),
    (["--out_dir", f"{__file__}/plots"], f"--out_dir {__file__}/plots: {__file__} is a file, not a folder; give a "
     "folder (created when missing)."),
    (["--max_length", "99999999999"], "--max_length 99999999999: a passkey sequence of 99999999999 tokens takes at "
     "least 18626 GiB of memory to build"),
])
def test_plot_refuses_flags_it_would_ignore_or_fail_on_after_drawing(tmp_path, capsys, args, refused):
    with pytest.raises(SystemExit) as stopped:
        main(["plot", str(tmp_path), *args])
    assert stopped.value.code == 2
    assert f"hf-sparse-cp plot: error: {refused}" in capsys.readouterr().err


def test_plot_names_both_causes_for_a_missing_folder_of_a_hub_ids_shape(tmp_path, capsys, monkeypatch):
    """`--model out/run1` with no such folder passed the Hub id check and failed in transformers' loading, offline
    with "We couldn't connect to 'https://huggingface.co'", naming neither the flag nor the folder."""
    pytest.importorskip("matplotlib")
    # (the Hub cannot provide it, whether or not this machine is online). huggingface_hub reads the variable once,
    # at its import: setting it alone left the lookup online, where a machine without a network waited 46 s for
    # its retries of each file.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as stopped:
        main(["plot", str(tmp_path), "--only", "layouts", "--model", "out/run1"])
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert ("hf-sparse-cp plot: error: --model out/run1: no such folder here, and the Hub could not provide it "
            "either (") in err, err
    assert "give the folder of a saved model (config.json), or its Hub id." in err


def test_plot_names_a_text_file_that_is_not_utf8_text_before_loading(tmp_path, capsys):
    """`--text_file model.safetensors` failed after loading the model with "'utf-8' codec can't decode bytes in
    position ...", naming neither the flag nor the file."""
    binary = tmp_path / "model.safetensors"
    binary.write_bytes(b"\x88\x0b\x00\x00{\"__metadata__\": \xff\xfe}")
    with pytest.raises(SystemExit) as stopped:
        main(["plot", str(tmp_path), "--text_file", str(binary)])
    assert stopped.value.code == 2
    assert (f"hf-sparse-cp plot: error: --text_file {binary}: not UTF-8 text (a binary file?); give the file of a "
            "text.") in capsys.readouterr().err


@pytest.mark.parametrize("command, flag, close", [("plot", "--sparse_max_length", "--max_length"),
                                                   ("recipes", "--paht", "--path")])
def test_a_mistyped_flag_of_plot_or_recipes_is_named_with_the_close_one_by_that_command(tmp_path, capsys, command,
                                                                                        flag, close):
    """`hf-sparse-cp plot RUN --sparse_max_length 1024` (training's name of plot's --max_length) ended in
    'hf-sparse-cp: error: unrecognized arguments', the top command's usage, with no hint."""
    with pytest.raises(SystemExit) as refused:
        main([command, *([str(tmp_path)] if command == "plot" else []), flag, "1024"])
    err = capsys.readouterr().err
    assert refused.value.code == 2 and f"usage: hf-sparse-cp {command} " in err
    assert f"{command}: error: unrecognized arguments: {flag} 1024; did you mean {close} for {flag}?" in err


def test_plots_positional_run_dir_given_as_a_flag_is_named_positional(tmp_path, capsys):
    """`hf-sparse-cp plot --run_dir RUN` was answered 'did you mean --out_dir for --run_dir?', the output folder's
    flag for the run's own folder, which plot takes without a flag."""
    with pytest.raises(SystemExit) as refused:
        main(["plot", "--run_dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert refused.value.code == 2 and "--out_dir" not in err.splitlines()[-1], err
    assert ("plot: error: unrecognized arguments: --run_dir; did you mean the value alone for --run_dir (run_dir is "
            "positional)?") in err, err


@pytest.mark.parametrize("layers", ["0,,3", "0,", ""])
def test_plot_refuses_an_empty_item_of_its_lists(tmp_path, capsys, layers):
    """An empty item of --layers or --heads was dropped ('0,,3' drew layers 0 and 3), and an empty list drew the
    default layers."""
    for flag in ("--layers", "--heads"):
        with pytest.raises(SystemExit) as refused:
            main(["plot", str(tmp_path), flag, layers])
        assert refused.value.code == 2
        assert (f"error: argument {flag}: {layers!r} is not a comma-separated list of integers, e.g. 0,3 (no empty "
                "item)") in capsys.readouterr().err


def test_plot_refuses_layers_the_model_does_not_have(run_dir, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    with pytest.raises(SystemExit):
        main(["plot", str(run_dir), "--only", "layouts", "--max_length", "256", "--layers", "0,5", "--out_dir",
              str(tmp_path)])
    assert "layers [5] do not exist: the model has layers 0 to 1; choose them with --layers" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_plot_draws_a_learned_position_models_layouts_within_its_positions(run_dir, tmp_path, capsys):
    """#50: the layouts of a GPT-2 run (learned positions) were drawn for the default 4,096-token sample, past its
    table, and `plot` ended in the forward's 'IndexError: index out of range in self': the default sample is cut to
    the model's positions, and a --max_length past them is refused naming the most it takes."""
    pytest.importorskip("matplotlib")
    run = tmp_path / "run"
    checkpoint = run / "checkpoint-3"
    shutil.copytree(run_dir / "checkpoint-3", checkpoint)
    for weights in checkpoint.glob("model*.safetensors"):
        weights.unlink()
    AutoModelForCausalLM.from_config(tiny_config("gpt2", vocab_size=len(byte_tokenizer()), n_positions=64)
                                     ).save_pretrained(checkpoint)
    with pytest.raises(SystemExit):
        main(["plot", str(run), "--only", "layouts", "--max_length", "128", "--out_dir", str(tmp_path / "out")])
    assert ("128 tokens to draw, and the model learns 64 positions (its position embeddings): a longer input fails "
            "in its forward. Give --max_length 64 or less.") in capsys.readouterr().err
    main(["plot", str(run), "--only", "layouts", "--out_dir", str(tmp_path / "out")])
    assert (tmp_path / "out" / LAYOUTS_PLOT).read_bytes().startswith(PNG)


def test_plot_of_a_model_saved_without_its_tokenizer_names_both_ways_out(run_dir, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    copy = tmp_path / "run" / "checkpoint-3"
    shutil.copytree(run_dir / "checkpoint-3", copy)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (copy / name).unlink(missing_ok=True)
    with pytest.raises(SystemExit):
        main(["plot", str(copy.parent), "--only", "layouts", "--max_length", "256", "--out_dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert "No tokenizer with the model" in err and "--only kept_fraction" in err, err


def test_the_kept_fraction_of_training_leaves_the_evaluations_out():
    """An evaluation's log carries the kept fraction of its forwards (evaluation rows, the first process's alone): the
    card's per-layer means and the figure "during training" counted it as a training step (layer 1: (0.4 + 0.9) / 2
    where training kept 0.4)."""
    history = [{"loss": 2.0, "step": 1, "sparse/kept_fraction/layer_01": 0.4},
               {"eval_loss": 2.1, "step": 1, "sparse/kept_fraction/layer_01": 0.9},
               {"loss": 1.9, "step": 2, "sparse/kept_fraction/layer_01": 0.2},
               {"train_loss": 1.95, "step": 2, "sparse/kept_fraction/layer_01": 0.3}]  # (steps after the last log)
    assert kept_fraction_series(history) == {1: ([1, 2, 2], [0.4, 0.2, 0.3])}
    assert mean_kept_fraction_per_layer(history) == {1: pytest.approx(0.3)}


def test_plot_of_a_saved_lora_adapter_draws_the_base_with_the_adapter_and_the_pattern_given(run_dir, tmp_path, capsys):
    """A LoRA run saves an adapter (adapter_config.json, no config.json), which saves no pattern: its layouts load
    the base model with the adapter under the pattern given with --sparse_config, and are refused without one,
    naming the flag and the card that holds the pattern (they were refused as no saved model at all). An adapter
    saved without its tokenizer (peft's `save_pretrained`) takes its base model's: it was refused, "No tokenizer with
    the model"."""
    pytest.importorskip("matplotlib")
    from peft import LoraConfig, get_peft_model

    base = run_dir / "checkpoint-3"
    adapter = tmp_path / "run"
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(str(base)),
                           LoraConfig(r=2, target_modules=["q_proj"], init_lora_weights=False))
    model.save_pretrained(str(adapter))
    AutoTokenizer.from_pretrained(str(base)).save_pretrained(str(adapter))
    assert not (adapter / "config.json").exists()
    args = ["plot", str(adapter), "--only", "layouts", "--max_length", "256", "--out_dir", str(tmp_path / "png")]
    with pytest.raises(SystemExit):
        main(args)
    err = capsys.readouterr().err
    assert "holds a PEFT adapter" in err and "--sparse_config FILE" in err and "README.md" in err, err
    pattern = tmp_path / "pattern.yaml"
    pattern.write_text("block_size: 32\nmin_seq_len: 128\nlocal_window: 32\nsink_tokens: 4\ndense_first_layers: 0\n")
    assert main([*args, "--sparse_config", str(pattern)]) == 0
    assert (tmp_path / "png" / LAYOUTS_PLOT).read_bytes()[:8] == PNG
    for name in TOKENIZER_FILES:  # saved as peft saves it, without the tokenizer: the base model's serves
        (adapter / name).unlink(missing_ok=True)
    (tmp_path / "png" / LAYOUTS_PLOT).unlink()
    assert main([*args, "--sparse_config", str(pattern)]) == 0, capsys.readouterr().err
    assert (tmp_path / "png" / LAYOUTS_PLOT).read_bytes()[:8] == PNG
    hf_sparse_cp.patch()  # (the suite's fixture unregisters it)
    loaded = load_sparse_model(adapter, pattern)
    try:
        assert any("lora_A" in name for name, _ in loaded.named_parameters())
        assert SparseAttentionConfig.stored_on(loaded.config).min_seq_len == 128
    finally:
        disable_sparse_attention(loaded)


def test_plot_of_an_adapter_naming_no_base_model_names_the_fix(tmp_path, capsys):
    """#50: a LoRA adapter of a model built from a config (adapter_config.json's base_model_name_or_path: null) was
    answered "We couldn't connect to 'https://huggingface.co'"; it is refused naming the field and the ways out."""
    pytest.importorskip("matplotlib")
    from peft import LoraConfig, get_peft_model

    from hf_sparse_cp.testing.tiny_models import tiny_config

    adapter = tmp_path / "run"
    get_peft_model(AutoModelForCausalLM.from_config(tiny_config("llama")),
                   LoraConfig(r=2, target_modules=["q_proj"])).save_pretrained(str(adapter))
    pattern = tmp_path / "pattern.yaml"
    pattern.write_text("block_size: 32\nmin_seq_len: 128\n")
    with pytest.raises(SystemExit):
        main(["plot", str(adapter), "--only", "layouts", "--sparse_config", str(pattern)])
    err = capsys.readouterr().err
    assert "names no base model (base_model_name_or_path" in err and "--model" in err, err
    assert "huggingface.co" not in err, err
