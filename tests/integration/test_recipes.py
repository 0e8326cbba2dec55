"""The shipped recipes load, describe consistent runs and run as shipped (accelerate YAMLs and training
recipes: one schema, `SparseTrainingArguments`, read by any Trainer script and by the example); the example's
defaults: the demo's only for the demo, `--help` shows what a command uses, and flags given beat config files."""

import dataclasses
import json
import re
import warnings
from itertools import pairwise
from pathlib import Path

import pytest
import torch
from accelerate.commands.config.config_args import load_config_from_file
from transformers import HfArgumentParser

from hf_sparse_cp import SparseAttentionConfig, SparseTrainer, SparseTrainingArguments, checkpointing_enabled
from hf_sparse_cp.attention.budgets import TopK
from hf_sparse_cp.config.files import read_mapping
from hf_sparse_cp.examples import train_long_context as example
from hf_sparse_cp.examples.train_long_context import (
    DEMO_BUDGET,
    DEMO_DEFAULTS,
    DEMO_PATTERN,
    ScriptArguments,
    parse_args,
    recipe_flags,
)
from hf_sparse_cp.integration.upstream import attn_implementation
from hf_sparse_cp.recipes import recipe_names, recipe_path
from hf_sparse_cp.smet import SMETConfig
from hf_sparse_cp.testing.spawn import run_cli
from hf_sparse_cp.trainer.arguments import PATTERN_PREFIX, unprefixed

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
ACCELERATE = sorted((RECIPES / "accelerate").glob("*.yaml"))
TRAINING = sorted((RECIPES / "train").glob("*.yaml"))
CURRICULUM = sorted((RECIPES / "train").glob("qwen2.5-3b_*.yaml"))
STAGE1 = RECIPES / "train" / "qwen2.5-3b_32k.yaml"  # vertical_topk 1024


def test_the_recipes_are_there_and_the_package_names_them():
    assert {p.name for p in ACCELERATE} >= {"cpu_2proc_cp2.yaml", "fsdp2_cp8_1node.yaml",
                                            "fsdp2_cp32_4nodes_hierarchical.yaml"}
    assert len(CURRICULUM) == 3 and {p.stem for p in TRAINING} >= {"smet_pretrain", "smet_finetune"}
    assert recipe_names("train") == [p.stem for p in TRAINING]
    assert recipe_names("accelerate") == [p.stem for p in ACCELERATE]
    assert all(recipe_path(p.stem).read_bytes() == p.read_bytes() for p in TRAINING + ACCELERATE)
    assert recipe_path(str(STAGE1)) == STAGE1  # a path is taken as it is
    with pytest.raises(FileNotFoundError, match="neither a file nor a shipped recipe .*qwen2.5-3b_32k"):
        recipe_path("qwen-3b")


def test_the_listing_describes_each_recipe_in_a_whole_sentence(capsys):
    """`hf-sparse-cp recipes` printed each recipe's first comment line, which broke off mid-sentence for most
    ("... hybrid context parallelism: the 16 heads split over the 8", "... (16K tokens per GPU),"): each summary is
    now the comment's first sentence, wrapped beside its name."""
    from hf_sparse_cp.cli import main
    from hf_sparse_cp.recipes import recipe_summary

    for path in sorted(RECIPES.glob("*/*.yaml")):
        summary = recipe_summary(path)
        comment = " ".join(line.lstrip("# ").strip() for line in path.read_text().splitlines()
                           if line.startswith("#"))
        assert summary.endswith(".") and comment.startswith(summary.rstrip(".")), (path.name, summary)
    assert main(["recipes"]) == 0
    listing = capsys.readouterr().out
    assert max(map(len, listing.splitlines())) <= 120
    assert "hierarchical ring." in " ".join(listing.split())


@pytest.mark.parametrize("path", TRAINING, ids=lambda p: p.stem)
def test_every_training_recipe_is_one_schema_any_trainer_script_reads(path):
    """A recipe is `SparseTrainingArguments` flags: a stock HfArgumentParser reads it with no key left over
    (parse_yaml_file refuses unknown keys), and the example's command line reads it to the same arguments."""
    (training,) = HfArgumentParser(SparseTrainingArguments).parse_yaml_file(str(path))
    parsed = parse_args(["--recipe", path.stem])
    for name in read_mapping(path):
        assert getattr(parsed.training, name) == getattr(training, name), name
    assert parsed.explicit == set(read_mapping(path))


@pytest.mark.parametrize("path", ACCELERATE, ids=lambda p: p.stem)
def test_accelerate_configs_load_and_divide_the_world(path):
    config = load_config_from_file(str(path))
    cp = int(config.parallelism_config.get("parallelism_config_cp_size", 1)) if config.parallelism_config else 1
    assert config.num_processes % cp == 0
    if cp > 1:  # accelerate's CP needs FSDP2
        assert config.distributed_type == "FSDP" and config.fsdp_config["fsdp_version"] == 2
        assert config.num_processes % config.num_machines == 0


@pytest.mark.parametrize("path", CURRICULUM, ids=lambda p: p.stem)
def test_training_recipes_parse_into_a_sparse_cp_run(path):
    script, training, sparse, pattern, cp, smet, _ = parse_args([str(path)])
    assert sparse.sparse_attention and not smet.smet
    assert training.sparse_max_length % (cp.cp_size * pattern.sparse_block_size) == 0  # whole blocks on every rank
    assert training.bf16 and not checkpointing_enabled(training)  # (the recipe's length turns it on: see below)
    assert training.sparse_max_length >= training.sparse_gradient_checkpointing_min_length
    assert training.save_strategy == "steps" and training.save_steps < training.max_steps  # the recipe's saving
    assert load_config_from_file(str(RECIPES / "accelerate" / "fsdp2_cp8_1node.yaml")).num_processes % cp.cp_size == 0


@pytest.mark.parametrize("path", sorted((RECIPES / "train").glob("*.yaml")), ids=lambda p: p.stem)
def test_recipes_use_no_form_transformers_deprecates(path):
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        warnings.simplefilter("error", DeprecationWarning)
        parse_args([str(path)])


def test_a_recipe_for_more_processes_says_so_before_building_its_data(monkeypatch, capsys):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(example, "passkey_train_data", lambda *a, **k: pytest.fail("built the data first"))
    with pytest.raises(SystemExit) as ended:  # (as a bad flag ends: status 2)
        example.main(["--recipe", "qwen2.5-3b_32k", "--max_steps", "1"])
    assert ended.value.code == 2
    assert "cp_size=8 splits each sequence over 8 processes, and this one runs alone" in capsys.readouterr().err


def test_a_gpu_accelerate_config_on_a_machine_without_gpus_names_the_cpu_one_before_building_its_data(monkeypatch,
                                                                                                      capsys):
    """`accelerate launch --config_file "$(hf-sparse-cp recipes --path fsdp2_cp8_1node)" -m ...train_long_context
    --recipe qwen2.5-3b_128k` (the README's GPU line) on a CPU machine built 131K-token data on all 8 processes,
    then each printed accelerate's `ParallelismConfig is only compatible ... but got DistributedType.MULTI_CPU`."""
    from hf_sparse_cp.trainer import sparse_trainer

    monkeypatch.setattr(sparse_trainer, "_has_accelerator", lambda: False)
    monkeypatch.setenv("ACCELERATE_USE_PARALLELISM_CONFIG", "true")  # what accelerate launch sets from that file
    monkeypatch.setenv("PARALLELISM_CONFIG_CP_SIZE", "8")
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(example, "passkey_train_data", lambda *a, **k: pytest.fail("built the data first"))
    with pytest.raises(SystemExit):
        example.main(["--recipe", "qwen2.5-3b_128k", "--max_steps", "1"])
    err = capsys.readouterr().err
    assert re.search(r"cp_size 8\).*no GPU.*recipes --path cpu_2proc_cp2", err)
    # (the fault is the accelerate config's, not the recipe's `cp_size: 8`, which the message's fix `--cp_size N`
    # named)
    assert "from the recipe" not in err, err


def test_recipes_and_command_lines_of_earlier_releases_still_run(tmp_path):
    """`max_length` (the sequence length before every plugin flag was prefixed) in a recipe or on the command
    line is read as --sparse_max_length, with a warning that names the new name."""
    recipe = tmp_path / "old.yaml"
    recipe.write_text("max_length: 512\nsparse_block_size: 64\n")
    with pytest.warns(FutureWarning, match="--max_length is deprecated: it is now --sparse_max_length"):
        training = parse_args([str(recipe)]).training
    assert training.sparse_max_length == 512
    with pytest.warns(FutureWarning, match="--max_length is deprecated"):
        assert parse_args(["--max_length=1024"]).training.sparse_max_length == 1024


def test_curriculum_stages_chain_and_grow():
    stages = sorted((parse_args(["--recipe", p.stem]) for p in CURRICULUM), key=lambda a: a.training.sparse_max_length)
    assert [s.training.sparse_max_length for s in stages] == [32768, 131072, 524288]
    for prev, nxt in pairwise(stages):  # each stage's launch line starts from the last one's output
        launch = recipe_path(Path(nxt.training.output_dir).name).read_text()
        assert f"--model_name_or_path {prev.training.output_dir} " in launch


def test_a_mapping_in_a_recipe_becomes_the_json_its_flag_takes(tmp_path):
    recipe = tmp_path / "overrides.yaml"
    recipe.write_text('sparse_max_length: 512\nsparse_layer_overrides:\n  "0-1": {pattern: dense}\n')
    pattern = parse_args([str(recipe)])[3].to_config()
    assert pattern.layer_overrides == {"0-1": {"pattern": "dense"}} and pattern.for_layer(1).pattern == "dense"


def test_flags_after_the_recipe_win_and_bad_recipes_are_refused(tmp_path):
    flags = ["--sparse_max_length", "65536", "--ddp_find_unused_parameters", "true"]
    script, training, *_ = parse_args([str(CURRICULUM[0]), *flags])
    assert training.sparse_max_length == 65536 and training.ddp_find_unused_parameters is True
    assert parse_args([*flags, "--recipe", CURRICULUM[0].stem]).training.sparse_max_length == 65536
    bad = tmp_path / "bad.yaml"
    bad.write_text("- max_length\n")
    with pytest.raises(ValueError, match="mapping of flag names"):
        recipe_flags(str(bad))


def _plain_parse(argv: list[str]) -> tuple:
    """`argv` parsed by a stock HfArgumentParser over the example's dataclasses: the library defaults."""
    script, training = HfArgumentParser((ScriptArguments, SparseTrainingArguments)).parse_args_into_dataclasses(
        args=argv)
    return (script, training, training.plugin_arguments(), training.pattern_flags(), training.context_parallel_config(),
            training.smet_arguments())


@pytest.mark.parametrize("path", CURRICULUM, ids=lambda p: p.stem)
def test_a_recipe_gets_the_library_defaults_for_what_it_does_not_set(path):
    parsed = parse_args([str(path)])
    # the recipe's flags over the library defaults, and nothing else (the example adds DDP without the unused-parameter
    # search, and --use_cpu without CUDA)
    added = ["--ddp_find_unused_parameters", "false"]
    plain = _plain_parse(recipe_flags(str(path)) + added)
    for got, want in zip(parsed[:6], plain):
        assert got == want, type(got).__name__
    # which pattern the run ends up with: the recipe's fields, the library's for the rest (not the demo's
    # sink_tokens 16 / local_window 64, nor its vertical_topk 64 / slash_topk 128 under the 512K top-p recipe)
    recipe = read_mapping(path)
    pattern = {name: recipe[PATTERN_PREFIX + name] for name in unprefixed(recipe, PATTERN_PREFIX)
               if name in SparseAttentionConfig.keys()}
    assert parsed.pattern.to_config() == SparseAttentionConfig(**pattern)
    assert (parsed.pattern.sparse_sink_tokens, parsed.pattern.sparse_local_window) == (64, 128)
    assert parsed.explicit == set(recipe)


def test_the_demo_defaults_apply_only_to_the_demo():
    demo = parse_args([])
    assert demo.pattern.to_config().budget == TopK(64, 128) and demo.training.max_steps == 6
    assert demo.training.save_strategy == "no"
    assert demo.sparse.sparse_attention and demo.explicit == set()
    pretrained = parse_args(["--model_name_or_path", "some/model"])
    assert pretrained.pattern.to_config() == SparseAttentionConfig()  # a pretrained model: the library's pattern
    assert pretrained.training.max_steps == -1 and pretrained.training.save_strategy == "steps"
    assert pretrained.sparse.sparse_attention  # the example's backend, in every run (--sparse_attention false: off)
    assert not parse_args(["--model_name_or_path", "m", "--sparse_attention", "false"]).sparse.sparse_attention
    # the demo's pattern where a layer reads it: its budget not on a dense pattern, none of it without the backend
    dense = parse_args(["--sparse_pattern", "dense"])
    assert dense.pattern.sparse_budget_mode is None and dense.pattern.sparse_block_size == 64
    assert parse_args(["--sparse_attention", "false"]).pattern == parse_args(["--model_name_or_path", "m"]).pattern


@pytest.mark.parametrize("flags, why", [
    # (every pattern flag the recipe types, those at their default value too: --sparse_block_size 128)
    (["--sparse_attention", "false", "--cp_size", "1"], "--sparse_vertical_topk, --sparse_slash_topk, "
     "--sparse_block_size, --sparse_min_seq_len, --sparse_dense_first_layers have no effect: --sparse_attention false "
     "turns the sparse_cp backend off"),
    (["--sparse_pattern", "dense"], "--sparse_vertical_topk, --sparse_slash_topk have no effect: only a vertical_slash "
     "pattern reads them, and every layer of this run is dense"),  # (under the recipe's CP: exact causal attention)
], ids=["no backend", "dense pattern"])
def test_a_recipes_dense_baseline_keeps_its_pattern_flags_and_says_once_they_have_no_effect(monkeypatch, caplog,
                                                                                          flags, why):
    """`--recipe NAME --sparse_attention false` or `--sparse_pattern dense` (the recipe's dense baseline) keeps the
    recipe's budget flags, which then do nothing: accepted, with one line naming them (a refusal would break every
    recipe's baseline)."""
    from hf_sparse_cp.trainer import plugin_arguments

    monkeypatch.setattr(plugin_arguments, "_WARNED", set())
    for _ in range(2):
        parsed = parse_args(["--recipe", STAGE1.stem, *flags])
    assert parsed.pattern.sparse_vertical_topk == 1024
    lines = [r.getMessage() for r in caplog.records if "no effect" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith(why), lines


def test_the_final_line_says_whose_choice_no_checkpoints_was():
    """The run's last line said "no checkpoints (the demo's default; ...)" after a recipe run given
    `--save_strategy no`: the demo's default is named only where it applied."""
    from hf_sparse_cp.examples.train_long_context import checkpoints_note

    assert "the demo's default" in checkpoints_note(parse_args([]).training)
    for argv in (["--save_strategy", "no"], [str(STAGE1), "--save_strategy", "no"]):
        assert checkpoints_note(parse_args(argv).training) == "no checkpoints (--save_strategy no)"
    assert checkpoints_note(parse_args(["--save_steps", "2"]).training).startswith("checkpoints in ")


def _help_defaults(capsys, monkeypatch, argv: list[str]) -> dict[str, str]:
    """flag name -> the default `--help` prints for it."""
    monkeypatch.setenv("COLUMNS", "400")  # one line per help text
    with pytest.raises(SystemExit):
        parse_args([*argv, "--help"])
    out = re.sub(r"\n\n[^\n]+:\n", "\n", capsys.readouterr().out)  # (the argument groups' titles)
    blocks = re.split(r"\n  (?=--)", out)
    return {m[1]: m[2] for block in blocks if (m := re.match(r"--(\w+).*\(default: (.*)\)\s*$", block, re.S))}


@pytest.mark.parametrize("argv", [[], [str(STAGE1)], ["--model_name_or_path", "some/model"]],
                         ids=["demo", "recipe", "pretrained"])
def test_help_shows_the_defaults_the_command_uses(capsys, monkeypatch, argv):
    shown = _help_defaults(capsys, monkeypatch, argv)
    parsed = parse_args(argv)
    given = parsed.explicit
    # (the pattern's section flags left unset show None: they take the budget mode's values, their help says which)
    for config in (parsed.script, parsed.sparse, parsed.pattern, parsed.cp):
        for f in dataclasses.fields(config):
            if f.name not in given:
                assert shown[f.name] == str(getattr(config, f.name)), f.name
    if not argv:  # the demo's training settings too
        for name, value in {**DEMO_DEFAULTS, **DEMO_PATTERN, **DEMO_BUDGET}.items():
            assert shown[name] == str(value), name
    # without an accelerator the arguments train on CPU processes, whatever the command line says
    assert parsed.training.use_cpu == (not torch.accelerator.is_available())


def test_help_under_a_recipe_shows_the_recipes_values(capsys, monkeypatch):
    """#50: `hf-sparse-cp train --recipe smet_finetune --help` showed `--smet (default: False)` and the library's
    SMET density (0.25) for the flags the recipe sets (True, 0.05); a flag given after it still wins the run."""
    argv = ["--recipe", "smet_finetune", "--smet_density", "0.3"]
    shown = _help_defaults(capsys, monkeypatch, argv)
    assert (shown["smet"], shown["smet_density"], shown["smet_mode"]) == ("True", "0.05", "sparse_update")
    assert shown["learning_rate"] == "5e-05"  # (a flag the recipe leaves: the library's default)
    assert parse_args(argv).smet.to_config(parse_args(argv).explicit).density == 0.3


def test_flags_given_beat_the_config_files_and_the_demo_defaults_do_not(tmp_path):
    cfg = tmp_path / "pattern.yaml"
    SparseAttentionConfig(vertical_topk=256, block_size=64, min_seq_len=1024).save(cfg)
    smet = tmp_path / "smet.yaml"
    SMETConfig(density=0.1, update_interval=50).save(smet)
    for argv, want in ((["--sparse_config", str(cfg), "--sparse_vertical_topk", "512"], 512),  # 512: the default
                       ([str(STAGE1), "--sparse_config", str(cfg)], 1024)):  # the recipe's
        parsed = parse_args(argv)
        assert parsed.sparse.attention_config(parsed.pattern, parsed.explicit).budget.vertical_topk == want
    # the demo's toy values are defaults, not flags: the file's settings stand
    parsed = parse_args(["--sparse_config", str(cfg)])
    assert parsed.sparse.attention_config(parsed.pattern, parsed.explicit) == SparseAttentionConfig.from_file(cfg)
    parsed = parse_args(["--smet", "--smet_config", str(smet), "--smet_update_interval", "100"])
    assert parsed.smet.to_config(parsed.explicit).update_interval == 100  # 100: the default value


# A recipe at tiny size: the tiny model (no --model_name_or_path), short sequences, one step, one process; every
# other setting is the recipe's. min_seq_len is a size too (the recipes' 8192 would keep 1K tokens dense).
TINY = ["--tiny_num_layers", "3", "--sparse_max_length", "1024", "--sparse_min_seq_len", "512", "--num_samples", "2",
        "--max_steps", "1"]


def _recording(monkeypatch) -> dict:
    """Record what the example hands to the plugin: the trainer, the CP config, the SMET config."""
    seen = {}

    class Recorded(SparseTrainer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            seen["trainer"], seen["cp"] = self, self.args.context_parallel_config()
            seen["smet"] = self.args.smet_optimizer_config()

    monkeypatch.setattr(example, "SparseTrainer", Recorded)
    return seen


@pytest.mark.parametrize("path", CURRICULUM, ids=lambda p: p.stem)
def test_each_recipe_runs_one_step_at_tiny_size(tmp_path, monkeypatch, single_thread, path):
    seen = _recording(monkeypatch)
    out = tmp_path / "out"
    summary = example.main(["--recipe", path.stem, *TINY, "--cp_size", "1", "--output_dir", str(out),
                            "--save_final_model"])
    shipped = parse_args([str(path)])
    trainer = seen["trainer"]
    assert trainer.state.global_step == 1 and summary["cp_size"] == 1
    # the recipe's pattern (sizes aside) is the one the model trains with
    pattern = SparseAttentionConfig.from_dict(trainer.model.config.sparse_attention)
    assert pattern == shipped.pattern.to_config().replace(min_seq_len=512)
    assert attn_implementation(trainer.model.config) == "sparse_cp"
    # and its training and CP settings
    for name in ("bf16", "learning_rate", "lr_scheduler_type", "warmup_steps", "logging_steps", "save_strategy",
                 "save_steps", "report_to", "per_device_train_batch_size", "gradient_accumulation_steps"):
        assert getattr(trainer.args, name) == getattr(shipped.training, name), name
    assert seen["cp"].cp_sharding == shipped.cp.cp_sharding
    assert (out / "config.json").is_file()  # --save_final_model: the next stage starts from it


@pytest.mark.parametrize("name", ["smet_pretrain", "smet_finetune"])
def test_each_smet_recipe_trains_one_step(tmp_path, monkeypatch, single_thread, name):
    seen = _recording(monkeypatch)
    example.main(["--recipe", name, "--sparse_max_length", "256", "--num_samples", "1", "--max_steps", "1",
                  "--tiny_num_layers", "1", "--output_dir", str(tmp_path)])
    (args,) = HfArgumentParser(SparseTrainingArguments).parse_yaml_file(str(recipe_path(name)))
    assert seen["smet"] == args.smet_optimizer_config() and seen["trainer"].state.global_step == 1


def test_a_recipe_runs_with_cp2_on_two_processes(tmp_path):
    summary = tmp_path / "summary.json"
    done = run_cli(["train", "--nproc", "2", "--recipe", STAGE1.stem, *TINY, "--cp_size", "2",
                    "--output_dir", str(tmp_path / "out"), "--summary_file", str(summary)], 2)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(summary.read_text())
    assert (result["world_size"], result["cp_size"]) == (2, 2)


def test_the_hybrid_recipe_runs_on_four_processes(tmp_path):
    """The 4 x 8 GPU hybrid recipe as shipped, shrunk to 4 CPU processes: head groups of 2, a ring of 2."""
    shipped = parse_args(["--recipe", "hybrid_qwen2.5-3b_1m"])
    assert (shipped.cp.cp_mode, shipped.cp.cp_size, shipped.cp.cp_ulysses_size) == ("hybrid", 32, 8)
    assert shipped.cp.head_size(shipped.cp.cp_size) == 8 and 16 % 8 == 0  # Qwen2.5-3B's 16 query heads
    summary = tmp_path / "summary.json"
    done = run_cli(["train", "--nproc", "4", "--recipe", "hybrid_qwen2.5-3b_1m", *TINY, "--cp_size", "4",
                    "--cp_ulysses_size", "2", "--output_dir", str(tmp_path / "out"), "--summary_file", str(summary)], 4)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(summary.read_text())
    assert (result["world_size"], result["cp_size"]) == (4, 4)
    assert "hybrid: head-parallel (Ulysses) over 2 ranks" in (tmp_path / "out" / "README.md").read_text()


def test_the_run_trains_with_the_flags_given_over_the_config_files(tmp_path, monkeypatch, single_thread):
    seen = _recording(monkeypatch)
    cfg = tmp_path / "pattern.yaml"
    SparseAttentionConfig(vertical_topk=512, slash_topk=32, block_size=64, min_seq_len=128).save(cfg)
    smet = tmp_path / "smet.yaml"
    SMETConfig(density=0.5, update_interval=50).save(smet)
    example.main(["--sparse_max_length", "256", "--num_samples", "1", "--max_steps", "1", "--tiny_num_layers", "1",
                  "--output_dir", str(tmp_path / "out"), "--sparse_config", str(cfg), "--sparse_vertical_topk", "1024",
                  "--smet", "--smet_config", str(smet), "--smet_update_interval", "100"])
    pattern = SparseAttentionConfig.from_dict(seen["trainer"].model.config.sparse_attention)
    assert pattern == SparseAttentionConfig(vertical_topk=1024, slash_topk=32, block_size=64, min_seq_len=128)
    assert (seen["smet"].density, seen["smet"].update_interval) == (0.5, 100)


def test_help_lists_the_common_flags_first(capsys, monkeypatch):
    """`hf-sparse-cp train --help`: the common flags (each class's COMMON_FLAGS) in their own group, before the
    example's own flags and every other flag."""
    from hf_sparse_cp.trainer.plugin_arguments import COMMON_FLAGS

    monkeypatch.setenv("COLUMNS", "400")
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    out = capsys.readouterr().out
    groups = {title: out.index(f"\n{title}:\n") for title in ("common flags", "the example's flags", "other flags")}
    assert groups["common flags"] < groups["the example's flags"] < groups["other flags"]
    common = out[groups["common flags"]:groups["the example's flags"]]
    assert all(f"--{name} " in common for name in COMMON_FLAGS)
    assert "--sparse_budget_mode" in common and "--sparse_sink_tokens" not in common and "--learning_rate" not in common
