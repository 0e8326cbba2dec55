"""`python -m hf_sparse_cp.run`, in this process: the script's parser takes the plugin's flags beside its own,
flags before the script path set what a script builds in code, the script runs as `__main__` would, and outside
the run transformers is stock (issue #42)."""

import dataclasses
import json
import os
import re
import sys
import textwrap
from dataclasses import dataclass, field

import pytest
from torch.optim.optimizer import _global_optimizer_pre_hooks
from transformers import HfArgumentParser, Trainer, TrainingArguments

from hf_sparse_cp import SparseTrainingArguments, sparse_arguments_class
from hf_sparse_cp.distributed import check_launched
from hf_sparse_cp.integration.compat_checks import argument_parser_classes
from hf_sparse_cp.launch.command import parse_plugin_flags, split_command
from hf_sparse_cp.launch.launched import attention_asked, attention_replaced, launched, plugin_flags_in
from hf_sparse_cp.launch.processes import RUN_MODULE
from hf_sparse_cp.launch_env import launched_env, launched_world_size
from hf_sparse_cp.recipes import recipe_path
from hf_sparse_cp.run import main as run
from hf_sparse_cp.trainer.plugin_arguments import COMMON_FLAGS, PluginArguments
from hf_sparse_cp.trainer.sparse_trainer import SparseArgumentsMixin


@dataclass
class DataTrainingArguments:  # a run_clm-shaped script's own: its sequence length is `block_size`
    train_file: str | None = field(default=None, metadata={"help": "train file"})
    block_size: int | None = field(default=None, metadata={"help": "tokens per block"})
    max_length: int = field(default=77, metadata={"help": "a field named like the plugin's former length flag"})


def _stock_members() -> dict:
    return {(cls, name): vars(cls)[name] for cls in (*argument_parser_classes(), Trainer)
            for name in ("__init__", "parse_args_into_dataclasses") if name in vars(cls)}


@pytest.fixture
def started(monkeypatch):
    """The commands the launcher starts, recorded instead (`processes.run_forwarding_signals` answers 0)."""
    from hf_sparse_cp.launch import processes

    commands = []
    monkeypatch.setattr(processes, "run_forwarding_signals", lambda command, env=None: commands.append(command) or 0)
    return commands


@pytest.fixture
def cpu_launch_folder(monkeypatch, tmp_path):
    """`tmp_path`, the current directory, holding an empty train.py, on a machine without accelerators, outside any
    launch (no WORLD_SIZE): where the launcher's checks before any process starts run as a user's."""
    from hf_sparse_cp.launch import processes

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(processes, "accelerator_count", lambda: 0)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    (tmp_path / "train.py").write_text("")
    return tmp_path


def test_the_scripts_parser_takes_the_plugins_flags_beside_its_own(tmp_path):
    stock = _stock_members()
    plugin = parse_plugin_flags(["--sparse_block_size", "64", "--cp_sharding", "zigzag"])
    with launched(plugin):
        parser = HfArgumentParser((DataTrainingArguments, TrainingArguments))
        data, training = parser.parse_args_into_dataclasses([
            "--output_dir", str(tmp_path), "--block_size", "512", "--max_length", "9", "--sparse_vertical_topk", "32",
            "--cp_sharding", "contiguous"])
        help_text = parser.format_help()
    assert isinstance(training, TrainingArguments) and isinstance(training, SparseArgumentsMixin)
    assert type(training) is sparse_arguments_class(TrainingArguments)
    assert (data.block_size, data.max_length) == (512, 9)  # the script's own fields stay its own
    config = training.sparse_attention_config()
    assert config.block_size == 64 and config.budget.vertical_topk == 32  # before the script path, and after it
    assert training.context_parallel_config().cp_sharding == "contiguous"  # after the script path wins
    assert {"sparse_vertical_topk", "cp_sharding", "sparse_block_size"} <= set(training.explicit_flags)
    assert "--sparse_vertical_topk" in help_text and "--block_size" in help_text
    assert _stock_members() == stock  # undone
    with pytest.raises(ValueError, match="not used by the HfArgumentParser"):  # stock again
        HfArgumentParser(TrainingArguments).parse_args_into_dataclasses(
            ["--output_dir", str(tmp_path), "--sparse_block_size", "64"])


def test_the_scripts_dataset_name_names_the_cards_dataset_unless_the_flag_does(tmp_path):
    @dataclass
    class ScriptArguments:
        dataset_name: str | None = None

    with launched(PluginArguments()):
        parser = HfArgumentParser((ScriptArguments, TrainingArguments))
        _, training = parser.parse_args_into_dataclasses(["--output_dir", str(tmp_path), "--dataset_name", "wikitext"])
        _, flagged = parser.parse_args_into_dataclasses(["--output_dir", str(tmp_path), "--dataset_name", "wikitext",
                                                         "--sparse_card_datasets", "trl-lib/Capybara"])
    assert training.plugin_arguments().card_metadata() == {"datasets": ["wikitext"]}
    assert flagged.sparse_card_datasets == ["trl-lib/Capybara"]


def test_trls_parser_and_its_config_file_take_the_plugins_flags(tmp_path):
    trl = pytest.importorskip("trl")
    recipe = tmp_path / "sft.yaml"
    recipe.write_text(f"output_dir: {tmp_path}\nsparse_block_size: 32\nmax_length: 512\nbf16: false\n")
    with launched(PluginArguments()):
        parser = trl.TrlParser((trl.ScriptArguments, trl.SFTConfig, trl.ModelConfig))
        script, config, model = parser.parse_args_and_config(["--config", str(recipe), "--cp_sharding", "zigzag"])
    assert isinstance(config, trl.SFTConfig) and isinstance(config, SparseArgumentsMixin)
    assert config.sparse_block_size == 32 and config.sequence_length == 512 and config.cp_sharding == "zigzag"


@pytest.mark.parametrize("script_passes_args", [False, True])
def test_a_plugin_key_of_trls_config_file_counts_as_typed(tmp_path, monkeypatch, capsys, script_passes_args):
    """A key of TRL's --config file at its default value was not counted as typed (TRL makes the file's values its
    flags' defaults): --sparse_estimation_chunk 1024 there trained, ignored, where the same flag was refused. The
    same where the script passes its own list (`parse_args_and_config(args=[...])`): the keys were read from
    sys.argv."""
    trl = pytest.importorskip("trl")
    recipe = tmp_path / "sft.yaml"
    recipe.write_text(f"output_dir: {tmp_path}\nsparse_estimation_chunk: 1024\n")  # (its default)
    args = ["--config", str(recipe)]
    monkeypatch.setattr(sys, "argv", ["sft.py"] + ([] if script_passes_args else args))
    with launched(PluginArguments()), pytest.raises(SystemExit) as refused:
        trl.TrlParser((trl.ScriptArguments, trl.SFTConfig, trl.ModelConfig)).parse_args_and_config(
            args if script_passes_args else None)
    assert refused.value.code == 2 and "--sparse_estimation_chunk 1024 would be ignored" in capsys.readouterr().err


def test_a_mistyped_plugin_key_of_trls_config_file_is_refused_naming_the_close_flag(tmp_path, monkeypatch, capsys):
    """TRL's scripts take the keys of their --config file that no flag takes as remaining strings, and drop them:
    `cp_sizee: 2` there trained 2 processes as DDP replicas (`hf-sparse-cp launch --nproc 2 -m trl.scripts.sft
    --config sft.yaml`), where `--cp_sizee 2` on the command line is refused. Refused as that flag is, naming the close
    one; a key the script's source declares, and one not of the plugin's first words, stay the script's."""
    trl = pytest.importorskip("trl")
    script = tmp_path / "sft.py"
    script.write_text("script_args, config, rest = TrlParser(types).parse_args_and_config(return_remaining_strings=1)")
    monkeypatch.setattr(sys, "argv", [str(script)])
    recipe = tmp_path / "sft.yaml"

    def parse(keys: str):
        recipe.write_text(f"output_dir: {tmp_path}\n{keys}")
        with launched(PluginArguments()):
            return trl.TrlParser((trl.ScriptArguments, trl.SFTConfig)).parse_args_and_config(
                ["--config", str(recipe)], return_remaining_strings=True)

    with pytest.raises(SystemExit) as refused:
        parse("cp_sizee: 2\n")
    err = capsys.readouterr().err
    assert refused.value.code == 2, err
    assert err.endswith("sft.py: error: --cp_sizee in the --config file is not a plugin flag, nor one that sft.py "
                        "declares; did you mean --cp_size for --cp_sizee?\n"), err
    assert parse("max_stepss: 2\ncp_size: 1\n")[-1] == ["--max_stepss", "2"]  # (TRL's to drop, as without the plugin)
    script.write_text(script.read_text() + "\n# cp_sizee: a key of its own")
    assert parse("cp_sizee: 2\n")[-1] == ["--cp_sizee", "2"]


def test_a_key_no_field_takes_in_a_scripts_arguments_file_ends_as_a_mistyped_flag(tmp_path, capsys):
    """run_clm.py's `script.py args.json` (HfArgumentParser.parse_json_file) with `"cp_sizee": 2` ended in
    HfArgumentParser's ValueError, a traceback from every rank under `hf-sparse-cp launch`: it ends as a mistyped
    flag does (exit status 2, the message once), naming the close field; a file the script reads with
    allow_extra_keys keeps them."""
    arguments = tmp_path / "args.json"
    arguments.write_text(json.dumps({"output_dir": str(tmp_path), "cp_sizee": 2, "max_stepss": 3}))
    with launched(PluginArguments()):
        parser = HfArgumentParser(TrainingArguments)
        with pytest.raises(SystemExit) as refused:
            parser.parse_json_file(str(arguments))
        (args,) = parser.parse_json_file(str(arguments), allow_extra_keys=True)
    err = capsys.readouterr().err
    assert refused.value.code == 2 and "Traceback" not in err, err
    assert err.endswith("error: Some keys are not used by the HfArgumentParser: ['cp_sizee', 'max_stepss'] (did you "
                        "mean 'cp_size' for 'cp_sizee', 'max_steps' for 'max_stepss'?)\n"), err
    assert args.output_dir == str(tmp_path)


def test_a_script_field_named_like_a_plugin_flag_is_refused_naming_both(tmp_path):
    @dataclass
    class Clashing:
        cp_size: int = 1

    with launched(PluginArguments()), pytest.raises(ValueError, match="--cp_size.*plugin's flags"):
        HfArgumentParser((Clashing, TrainingArguments))


def test_a_cp_degree_this_launch_cannot_run_is_refused_at_parse_time(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with launched(PluginArguments()), pytest.raises(SystemExit) as refused:  # as argparse refuses a flag's value
        HfArgumentParser(TrainingArguments).parse_args_into_dataclasses(["--output_dir", str(tmp_path), "--cp_size",
                                                                         "2"])
    assert refused.value.code == 2
    assert "error: cp_size=2 splits each sequence over 2 processes, and this one runs alone" in capsys.readouterr().err
    with launched(PluginArguments()), pytest.raises(SystemExit) as refused:
        HfArgumentParser(TrainingArguments).parse_args_into_dataclasses(["--output_dir", str(tmp_path), "--cp_schedule",
                                                                         "0:256:1,2:512:2", "--max_steps", "3"])
    assert refused.value.code == 2
    assert ("error: --cp_schedule stage 1 (2:512:2): cp_size=2 splits each sequence over 2 processes, and this one "
            "runs alone") in capsys.readouterr().err
    with pytest.raises(ValueError, match="cp_size=2 does not divide the world size 3"):  # what the parse checks
        check_launched([1, 2], launched_env(3))
    check_launched([1, 2, 4], launched_env(4))


def test_a_schedule_stage_s_cp_degree_is_refused_before_its_length(tmp_path, monkeypatch):
    """`--cp_schedule 0:256:1,5:256:3` parsed for 2 processes was refused for 256 tokens not splitting into whole
    blocks over 3 CP ranks, naming seq_len=192 or 288, which the processes then refused for the degree."""
    from hf_sparse_cp.trainer.plugin_arguments import parsing_for_launch
    from hf_sparse_cp.trainer.sparse_trainer import SparseTrainingArguments

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with parsing_for_launch(2), pytest.raises(ValueError, match=re.escape(
            "--cp_schedule stage 1 (5:256:3): cp_size=3 does not divide the world size 2")):
        SparseTrainingArguments(output_dir=str(tmp_path), use_cpu=True, max_steps=6, sparse_block_size=32,
                                cp_schedule="0:256:1,5:256:3")
    # where the world size is not known (a process alone), the length, which the flags alone decide
    with pytest.raises(ValueError, match=r"seq_len=256 does not split into whole blocks of 32 tokens over 3 CP ranks"):
        SparseTrainingArguments(output_dir=str(tmp_path), use_cpu=True, max_steps=6, sparse_block_size=32,
                                cp_schedule="0:256:1,5:256:3")


def test_a_schedule_over_a_pattern_file_is_checked_once_the_typed_flags_are_known(tmp_path, monkeypatch):
    """With a --sparse_config file, which of the file and a flag gives a pattern field waits for the flags typed; the
    launcher checked a schedule's lengths against the merged pattern (`PluginArguments.check_schedule`) once they were
    known, and the Trainer's arguments never did, leaving `--sparse_config trial` (64-token blocks) with a 192-token
    stage over 2 CP ranks to every process once it had built its data and model."""
    from hf_sparse_cp.trainer.plugin_arguments import parsing_typed_flags
    from hf_sparse_cp.trainer.sparse_trainer import SparseTrainingArguments

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    flags = dict(output_dir=str(tmp_path), use_cpu=True, max_steps=4, sparse_config="trial",
                 cp_schedule="0:128:1,2:192:2")
    with parsing_typed_flags(flags), pytest.raises(ValueError, match=re.escape(
        "cp_schedule stage 1 (2:192:2): seq_len=192 does not split into whole blocks of 64 tokens over 2 CP ranks")):
        SparseTrainingArguments(**flags)
    with parsing_typed_flags({*flags, "sparse_block_size"}):  # the typed flag beats the file: 3 blocks of 32 a rank
        assert SparseTrainingArguments(**flags, sparse_block_size=32).sparse_attention_config().block_size == 32
    SparseTrainingArguments(**flags)  # (built in code, no flags typed: which value the run takes is not known yet)


def test_the_command_splits_at_the_script_path():
    assert split_command(["--smet", "train.py", "--smet", "x.py"]) == (["--smet"], "train.py", False, ["--smet",
                                                                                                       "x.py"])
    assert split_command(["--cp_size", "2", "-m", "pkg.mod", "--lr", "1"]) == (["--cp_size", "2"], "pkg.mod", True,
                                                                                ["--lr", "1"])
    assert split_command(["--cp_size", "2"]) == (["--cp_size", "2"], None, False, [])
    # a flag's value is that flag's, whatever it ends in; the script is the first argument no flag takes
    assert split_command(["--sparse_config", "pattern.py", "script.py", "--lr", "1"]) == (
        ["--sparse_config", "pattern.py"], "script.py", False, ["--lr", "1"])
    assert split_command(["--smet", "true", "train", "--x"]) == (["--smet", "true"], "train", False, ["--x"])
    assert split_command(["--smet_target_modules", "q", "k", "train.py"]) == (
        ["--smet_target_modules", "q", "k"], "train.py", False, [])
    assert split_command(["--cp_size", "2", "-m"]) == (["--cp_size", "2"], None, True, [])
    assert split_command(["--nproc", "2", "train.py"], ("--nproc",)) == (["--nproc", "2"], "train.py", False, [])
    # a help flag takes no value (the path after it was taken as its value: `hf-sparse-cp train --nproc 2 --help
    # run_clm.py` printed the long-context example's help, not the launcher's)
    for help_flag in ("-h", "--help"):
        assert split_command(["--nproc", "2", help_flag, "run_clm.py", "--x"], ("--nproc",)) == (
            ["--nproc", "2", help_flag], "run_clm.py", False, ["--x"])
    assert plugin_flags_in(["--cp-size=2", "--no_sparse_fused_loss", "--lr", "--cp_sizes", "x"]) == [
        "--cp-size", "--no_sparse_fused_loss"]


def _refused(capsys, argv, main=run) -> str:
    """What `main(argv)` prints on stderr when it refuses `argv` as argparse refuses a flag: exit status 2."""
    with pytest.raises(SystemExit) as refused:
        main(argv)
    assert refused.value.code == 2, refused.value.code
    return capsys.readouterr().err


def test_only_plugin_flags_go_before_the_script_path(capsys):
    """The launcher's grammar refuses as argparse refuses a flag: its usage, `prog: error: message`, exit status 2."""
    usage = "usage: python -m hf_sparse_cp.run [PLUGIN FLAGS] (script.py | -m module) [SCRIPT ARGS]\n"
    error = usage + "python -m hf_sparse_cp.run: error: "
    err = _refused(capsys, ["--learning_rate", "1e-3", "train.py"])
    assert err.startswith(error + "'--learning_rate' is not a plugin flag (--sparse_*, --cp_*, --smet*), and no "
                          "script comes before it: give the script's path or -m module after the plugin flags"), err
    assert _refused(capsys, ["--cp_size", "1", "-m"]) == error + ("-m needs the module to run after it (e.g. -m "
                                                                  "trl.scripts.sft).\n")
    err = _refused(capsys, ["missing_script", "--output_dir", "out"])  # a path without .py is a path
    assert re.fullmatch(re.escape(error) + "can't open file '.*missing_script': no such file.\n", err), err
    with pytest.raises(SystemExit):  # the flag's value, not the script: the file it names is read (and not there)
        run(["--sparse_config", "pattern.py", __file__])
    assert "error: Config file 'pattern.py' does not exist" in capsys.readouterr().err
    assert _refused(capsys, ["--cp_size", "1"]) == error + "name the script to run (a .py file, or -m module).\n"
    err = _refused(capsys, ["missing_script.py"])
    assert re.fullmatch(re.escape(error) + "can't open file '.*missing_script.py': no such file.\n", err), err
    # (#50: a module not installed was a traceback from every launched process)
    err = _refused(capsys, ["--cp_size", "1", "-m", "no_such_package.train", "--output_dir", "out"])
    assert err == error + ("no module named 'no_such_package' (of -m no_such_package.train): install it, or check "
                           "the name.\n")
    # a bad value of a plugin flag before the script path: argparse's message, as the script's parser gives it after
    err = _refused(capsys, ["--sparse_vertical_topk", "abc", __file__])
    assert err == error + "argument --sparse_vertical_topk/--sparse-vertical-topk: invalid int value: 'abc'.\n"
    err = _refused(capsys, ["--smet", "--smet_density", "2", __file__])  # a value SMET refuses: before the script runs
    assert err.startswith(error + "--smet_density=2.0 must be in (0, 1]"), err


def test_trls_command_line_which_would_train_without_the_plugin_is_refused_naming_its_script(capsys):
    """`trl sft` starts trl/scripts/sft.py in new processes (accelerate launch) that the plugin never reaches: run
    under the launcher, it trained stock without a word; refused naming the module to run instead."""
    from hf_sparse_cp import cli as launch_cli

    fix = "Run the script that `trl sft` starts instead, with the arguments after sft: -m trl.scripts.sft.\n"
    for argv in (["-m", "trl.cli.main", "sft", "--max_steps", "1"], ["--sparse_config", "trial", "trl", "sft"]):
        err = _refused(capsys, argv)
        assert "TRL's command line" in err and err.endswith(fix), err
    err = _refused(capsys, ["launch", "--nproc", "2", "-m", "trl.cli", "dpo"], launch_cli.main)
    assert err.endswith("-m trl.scripts.dpo.\n"), err


def test_trls_command_line_with_accelerate_options_is_refused_naming_the_whole_command_that_runs_it(capsys, tmp_path):
    """`trl sft ARGS` hands accelerate launch the arguments its script's parser does not take: with those among
    them, the script's module alone was no fix (its parser refused --num_processes: 'did you mean
    --dataset_num_proc'). The refusal names the accelerate launch line TRL would run, with the plugin, the plugin's
    flags kept with the script, a --config file's keys of accelerate's too (the launcher's own options dropped)."""
    from hf_sparse_cp import cli as launch_cli

    config = tmp_path / "sft.yaml"
    config.write_text("max_steps: 1\nmixed_precision: 'no'\n")
    err = _refused(capsys, ["--cp_size", "2", "trl", "sft", "--output_dir", "o", "--num_processes", "2",
                            "--sparse_config", "trial", "--config", str(config), "--max_length", "64"])
    assert err.endswith(f"as `trl sft` would run it: `accelerate launch --mixed_precision no --num_processes 2 -m "
                        f"hf_sparse_cp.run --cp_size 2 -m trl.scripts.sft --output_dir o --sparse_config trial "
                        f"--config {config} --max_length 64`.\n"), err
    err = _refused(capsys, ["launch", "--nproc", "2", "-m", "trl.cli", "dpo", "--output_dir", "o",
                            "--accelerate_config", "zero2"], launch_cli.main)
    assert re.search(r"`accelerate launch --config_file \S+/zero2\.yaml -m hf_sparse_cp\.run -m trl\.scripts\.dpo "
                     r"--output_dir o`\.\n$", err), err


def test_the_launchers_help_lists_the_common_flags_first(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")
    with pytest.raises(SystemExit):
        run(["--help"])
    out = capsys.readouterr().out
    common, other = out.index("\ncommon flags:\n"), out.index("\nother flags:\n")
    assert common < other
    assert all(f"--{name} " in out[common:other] for name in COMMON_FLAGS)
    assert "--sparse_sink_tokens" in out[other:] and "--sparse_sink_tokens" not in out[common:other]


RECORDER = textwrap.dedent("""
    import json, os, sys
    from transformers import HfArgumentParser, TrainingArguments
    (args,) = HfArgumentParser(TrainingArguments).parse_args_into_dataclasses()
    record = {"name": __name__, "file": __file__, "argv": sys.argv, "path0": sys.path[0], "cwd": os.getcwd(),
              "class": type(args).__name__, "block": args.sparse_block_size}
    with open("record.json", "w") as f:  # (relative to the working directory, as for `python script.py`)
        json.dump(record, f)
""")


def test_a_script_without_py_runs_as_python_would_run_it(tmp_path, monkeypatch):
    (tmp_path / "record_run").write_text(RECORDER)
    monkeypatch.chdir(tmp_path)
    run(["--sparse_block_size", "64", "record_run", "--output_dir", "out"])
    record = json.loads((tmp_path / "record.json").read_text())
    assert record["file"] == str(tmp_path / "record_run") and record["block"] == 64


def test_the_script_runs_as_main_with_its_argv_file_and_folder(tmp_path, monkeypatch):
    folder = tmp_path / "scripts"
    folder.mkdir()
    (folder / "record_run.py").write_text(RECORDER)
    (folder / "helper_module.py").write_text("VALUE = 7\n")
    monkeypatch.chdir(tmp_path)
    argv_before, path_before = sys.argv[:], sys.path[:]
    run(["--sparse_block_size", "64", "scripts/record_run.py", "--output_dir", "out"])
    record = json.loads((tmp_path / "record.json").read_text())
    assert record["name"] == "__main__" and record["file"] == str(folder / "record_run.py")
    assert record["argv"] == [str(folder / "record_run.py"), "--output_dir", "out"]
    assert record["path0"] == str(folder) and record["cwd"] == str(tmp_path)  # its folder first, as python puts it
    assert record["class"] == "SparseTrainingArguments" and record["block"] == 64
    assert sys.argv == argv_before and sys.path == path_before


def test_a_module_runs_as_python_dash_m_would_run_it(tmp_path, monkeypatch):
    package = tmp_path / "stockpkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "train.py").write_text(RECORDER)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    run(["-m", "stockpkg.train", "--output_dir", "out", "--sparse_block_size", "32"])
    record = json.loads((tmp_path / "record.json").read_text())
    assert record["name"] == "__main__" and record["file"] == str(package / "train.py")
    assert record["argv"][1:] == ["--output_dir", "out", "--sparse_block_size", "32"] and record["block"] == 32


def test_reading_a_modules_source_runs_none_of_its_parents(tmp_path, monkeypatch):
    """The launcher reads a `-m` module's source (does it read TRL's --config?) and checks it is there before any
    process starts; finding it imported its parents, running their `__init__` (all of TRL's for trl.scripts.X) in
    the launcher. Found in the parents' search locations now; a package's source is its `__main__`, what -m runs."""
    from hf_sparse_cp.launch.known_scripts import module_found, reads_trl_config

    package = tmp_path / "configpkg"
    (package / "inner").mkdir(parents=True)
    for init in (package / "__init__.py", package / "inner" / "__init__.py"):
        init.write_text(f"open({str(tmp_path / 'ran')!r}, 'a').write({str(init)!r})\n")
    reads = "script, config = TrlParser((A, B)).parse_args_and_config()\n"
    (package / "inner" / "sft.py").write_text(reads)
    (package / "inner" / "__main__.py").write_text(reads)
    (package / "own.py").write_text("TrlParser((A,)).parse_args_and_config(args=['--x'])\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert reads_trl_config("configpkg.inner.sft", True) and reads_trl_config("configpkg.inner", True)
    assert not reads_trl_config("configpkg.own", True) and module_found("configpkg.inner.sft")
    assert not (tmp_path / "ran").exists() and "configpkg" not in sys.modules
    # a module not in its parents' locations is looked for as python does (a parent may build its __path__ at import)
    assert not module_found("configpkg.inner.missing") and not reads_trl_config("configpkg.missing", True)


def test_plugin_flags_that_a_script_building_its_arguments_in_code_never_reads_are_refused(tmp_path, monkeypatch):
    args = TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True)
    for stray, says in ((["--cp_size", "2"], "--cp_size reaches"),  # (one flag: 'reaches', not 'reach')
                        (["--cp_size", "2", "--sparse_config", "trial"], "--cp_size, --sparse_config reach")):
        monkeypatch.setattr(sys, "argv", ["script.py", *stray])
        with launched(PluginArguments()), pytest.raises(ValueError, match=f"{says} the script, which builds its "
                                                                           "TrainingArguments in code"):
            Trainer(model=None, args=args)


def test_arguments_built_in_code_take_the_flags_given_before_the_script_path(tmp_path, monkeypatch):
    import torch
    from transformers import AutoModelForCausalLM

    from hf_sparse_cp.testing.tiny_models import tiny_config

    class OwnTrainer(Trainer):
        def own_method(self) -> str:
            return "own"

    monkeypatch.setattr(sys, "argv", ["script.py"])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama"))
    args = TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True, save_strategy="no")
    plugin = parse_plugin_flags(["--sparse_block_size", "32", "--sparse_min_seq_len", "64"])
    with launched(plugin):
        trainer = OwnTrainer(model=model, args=args)
    assert isinstance(trainer, OwnTrainer) and trainer.own_method() == "own"
    assert trainer.args.sparse_attention and trainer.args.sparse_attention_config().block_size == 32
    assert trainer.args.output_dir == str(tmp_path) and trainer.args.use_cpu  # the script's own settings kept
    assert model.config._attn_implementation == "sparse_cp"
    later = OwnTrainer(model=AutoModelForCausalLM.from_config(tiny_config("llama")), args=args)
    assert type(later) is OwnTrainer  # outside the run: the script's class as written


INTERRUPTED_SCRIPT = """
import sys
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments
from hf_sparse_cp.testing.tiny_models import tiny_config

args = TrainingArguments(output_dir=sys.argv[1], report_to="none", use_cpu=True, save_strategy="no")
Trainer(model=AutoModelForCausalLM.from_config(tiny_config("llama")), args=args)
raise KeyboardInterrupt  # (Ctrl-C, as it lands in every rank mid-training)
"""


@pytest.mark.parametrize("launched_rank", [False, True])
def test_ctrl_c_ends_a_run_with_one_line_naming_the_last_complete_checkpoint(tmp_path, monkeypatch, capsys,
                                                                             launched_rank):
    """Ctrl-C in a run launched on N processes printed Python's KeyboardInterrupt traceback once per rank (and
    torchrun's own). A rank the launcher started ends in silence, status 130, having noted its Trainer's output
    folder for the launcher, which prints the one line (`processes.launch`); a run in this process prints it itself.
    The line names the newest checkpoint there that is complete (not the one being saved when the signal came)."""
    from hf_sparse_cp.launch.interrupts import interrupted_line, recorded_output_dirs
    from hf_sparse_cp.launch.refusals import REPORTS_ENV
    from hf_sparse_cp.trainer.checkpoints import MARKER

    out = tmp_path / "out"
    for step, complete in ((2, True), (4, False), (10, None)):  # (10: no checkpoint-N folder, a file)
        if complete is None:
            out.joinpath(f"checkpoint-{step}").write_text("")
            continue
        out.joinpath(f"checkpoint-{step}").mkdir(parents=True)
        out.joinpath(f"checkpoint-{step}", MARKER).write_text(json.dumps({"complete": complete, "step": step}))
    (tmp_path / "script.py").write_text(INTERRUPTED_SCRIPT)
    reports = tmp_path / "reports"
    reports.mkdir()
    if launched_rank:
        monkeypatch.setenv(REPORTS_ENV, str(reports))
        monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(SystemExit) as ended:
        run([str(tmp_path / "script.py"), str(out)])
    line = (f"hf-sparse-cp: interrupted by the user; 1 rank stopped; the last checkpoint is {out / 'checkpoint-2'} "
            f"(--resume_from_checkpoint {out / 'checkpoint-2'} continues from it).\n")
    err = capsys.readouterr().err
    assert ended.value.code == 130 and "Traceback" not in err and "KeyboardInterrupt" not in err, err
    if launched_rank:
        assert err == "" and recorded_output_dirs(reports) == [str(out)]
        assert interrupted_line(2, recorded_output_dirs(reports)) == line.replace("1 rank", "2 ranks")
    else:
        assert err == line and recorded_output_dirs(reports) == []
    assert interrupted_line(2, [str(tmp_path / "none")]).endswith("; 2 ranks stopped; no checkpoint was saved.\n")


def test_launcher_flags_have_the_defaults_and_help_of_the_switch(tmp_path):
    plugin, switch = PluginArguments(), SparseTrainingArguments(output_dir=str(tmp_path), report_to="none")
    helps = {f.name: f.metadata.get("help") for f in dataclasses.fields(SparseTrainingArguments)}
    names = [f.name for f in dataclasses.fields(PluginArguments) if f.init]
    assert plugin.sparse_attention and len(names) > 50
    for f in dataclasses.fields(PluginArguments):
        if f.init:
            assert getattr(plugin, f.name) == getattr(switch, f.name) and f.metadata["help"] == helps[f.name], f.name


# torchrun and accelerate launch, through the module that ends a refused run quietly (`launch/refusals.py`)
TORCHRUN = [sys.executable, "-m", "hf_sparse_cp.launch.refusals", "torchrun", "--standalone"]
ACCELERATE = [sys.executable, "-m", "hf_sparse_cp.launch.refusals", "accelerate"]


def test_the_launch_shorthand_starts_torchrun_or_accelerate_launch(started, monkeypatch, tmp_path, capsys):
    from hf_sparse_cp import cli
    from hf_sparse_cp.launch import processes
    from hf_sparse_cp.recipes import recipe_path

    monkeypatch.chdir(tmp_path)
    usage = f"usage: {cli.LAUNCH_USAGE}\n"
    err = _refused(capsys, ["launch", "--nproc", "2", "--cp_size", "2", "train.py"], cli.main)  # before N processes
    assert re.fullmatch(re.escape(usage) + "hf-sparse-cp launch: error: can't open file '.*train.py': no such "
                        "file.\n", err), err
    assert _refused(capsys, ["launch", "--nproc", "2", "-m"], cli.main) == usage + (
        "hf-sparse-cp launch: error: -m needs the module to run after it (e.g. -m trl.scripts.sft).\n")
    (tmp_path / "train.py").write_text("")
    monkeypatch.setattr(processes, "accelerator_count", lambda: 0)  # (the CPU recipe's machine)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert cli.main(["launch", "--nproc", "2", "--cp_size", "2", "train.py", "--config_file", "own.json"]) == 0
    assert started[-1] == [*TORCHRUN, "--nproc_per_node=2", "-m", RUN_MODULE, "--cp_size", "2", "train.py",
                           "--config_file", "own.json"]
    assert cli.main(["launch", "--config_file", "cpu_2proc_cp2", "-m", "trl.scripts.sft", "--cp_size", "2"]) == 0
    assert started[-1] == [*ACCELERATE, "--config_file", str(recipe_path("cpu_2proc_cp2")), "-m", RUN_MODULE,
                           "-m", "trl.scripts.sft", "--cp_size", "2"]
    with pytest.raises(SystemExit):
        cli.main(["launch", "--nproc", "2", "--config_file", "cpu_2proc_cp2", "train.py"])
    capsys.readouterr()
    # '' (an unset shell variable) was read as no config: the run launched by torchrun (or here), not accelerate
    assert _refused(capsys, ["launch", "--config_file", "", "train.py"], cli.main) == usage + (
        "hf-sparse-cp launch: error: --config_file '' is empty (an unset shell variable?): give the accelerate config, "
        "or drop the flag.\n")
    # the example, through the same launcher: its module as the script, the launcher's options taken from anywhere
    assert cli.main(["train", "--cp_size", "2", "--nproc", "2", "--max_steps", "1"]) == 0
    assert started[-1] == [*TORCHRUN, "--nproc_per_node=2", "-m", RUN_MODULE, "-m", cli.EXAMPLE_MODULE,
                           "--cp_size", "2", "--max_steps", "1"]
    assert cli.main(["train", "--config_file", "cpu_2proc_cp2", "--cp_size", "2"]) == 0
    assert started[-1][:6] == [*ACCELERATE, "--config_file", str(recipe_path("cpu_2proc_cp2"))]
    assert started[-1][6:] == ["-m", RUN_MODULE, "-m", cli.EXAMPLE_MODULE, "--cp_size", "2"]


def test_main_returns_the_status_of_a_launch_to_a_python_caller_and_the_console_script_ends_with_it(started,
                                                                                                    monkeypatch):
    """`main()` with this process's command line (a Python wrapper setting sys.argv) ended the whole process once a
    launch's run was over (`refusals.end_launcher`, os._exit: the wrapper's code after it never ran); the console
    script's `command_line` still does, with the status (tests/unit/test_setup_cfg.py: the script runs it)."""
    from hf_sparse_cp import cli
    from hf_sparse_cp.launch import refusals

    ended = []

    def end_launcher(status):
        ended.append(status)
        raise SystemExit(status)

    monkeypatch.setattr(refusals, "end_launcher", end_launcher)
    monkeypatch.setattr(sys, "argv", ["hf-sparse-cp", "train", "--cp_size", "2", "--nproc", "2", "--max_steps", "1"])
    assert cli.main() == 0 and not ended
    assert started[-1][-5:] == [cli.EXAMPLE_MODULE, "--cp_size", "2", "--max_steps", "1"]
    with pytest.raises(SystemExit) as done:
        cli.command_line()
    assert done.value.code == 0 and ended == [0]


@pytest.mark.parametrize("accelerators", [0, 2])
def test_a_gpu_config_with_more_processes_per_machine_than_accelerators_is_refused_before_any_starts(
        started, monkeypatch, tmp_path, capsys, accelerators):
    """`hf-sparse-cp train --config_file fsdp2_cp8_1node` on a machine without 8 accelerators started all 8
    processes (30 s here), each then refusing the ParallelismConfig on CPU (with accelerators, the processes past
    the last one have no device): refused once, before any starts, naming the config, the processes per machine,
    the accelerators found and the fix. A config whose processes run on the CPU, or that names no count, still
    launches."""
    import torch

    from hf_sparse_cp import cli

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(torch.accelerator, "device_count", lambda: accelerators)
    (tmp_path / "train.py").write_text("")
    usage = {"launch": f"usage: {cli.LAUNCH_USAGE}\n", "train": f"usage: {cli.TRAIN_USAGE}\n"}
    fix = {0: "its parallelism_config runs only on accelerators. Launch CPU processes instead: `--config_file "
              "cpu_2proc_cp2` (its num_processes set to N) or `--nproc N`, with the CP degree as --cp_size N.",
           2: "launch on machines with 8 accelerators each, or set its num_processes to 2 (and its parallelism sizes "
              "to match)."}[accelerators]
    for command, args in (("launch", ["train.py"]), ("train", ["--max_steps", "1"])):
        err = _refused(capsys, [command, "--config_file", "fsdp2_cp8_1node", *args], cli.main)
        assert err == usage[command] + (
            f"hf-sparse-cp {command}: error: --config_file {recipe_path('fsdp2_cp8_1node')} starts 8 processes "
            f"(FSDP), each on an accelerator of its own, and this machine has {accelerators} "
            f"(torch.accelerator.device_count()): {fix}\n"), err
    assert "32 processes over 4 machines, 8 per machine (FSDP)" in _refused(
        capsys, ["launch", "--config_file", "fsdp2_cp32_4nodes_hierarchical", "train.py"], cli.main)
    assert not started
    # what still launches: the CPU recipe without accelerators (its processes train on the CPU), a use_cpu or
    # MULTI_CPU config, one without num_processes, and a GPU config on a machine with its accelerators
    configs = {"use_cpu": {"distributed_type": "MULTI_GPU", "num_processes": 4, "use_cpu": True},
               "multi_cpu": {"distributed_type": "MULTI_CPU", "num_processes": 4},
               "no_count": {"distributed_type": "FSDP"}}
    for name, config in configs.items():
        (tmp_path / f"{name}.json").write_text(json.dumps({"compute_environment": "LOCAL_MACHINE", **config}))
        assert cli.main(["launch", "--config_file", f"{name}.json", "train.py"]) == 0
    if not accelerators:
        assert cli.main(["launch", "--config_file", "cpu_2proc_cp2", "train.py"]) == 0
    monkeypatch.setattr(torch.accelerator, "device_count", lambda: 8)
    assert cli.main(["launch", "--config_file", "fsdp2_cp8_1node", "train.py"]) == 0
    assert cli.main(["launch", "--config_file", "fsdp2_cp32_4nodes_hierarchical", "train.py"]) == 0
    assert len(started) == len(configs) + (not accelerators) + 2


def test_the_launcher_reads_the_accelerate_config_once(monkeypatch, tmp_path):
    """The launcher read its --config_file for its kind, then for its process count, then for its accelerators (and
    `launch` each time for its leading options too): read once, held on the parsed options."""
    from hf_sparse_cp import cli
    from hf_sparse_cp.config import files
    from hf_sparse_cp.launch import processes

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(processes, "accelerator_count", lambda: 0)
    monkeypatch.setattr(processes, "run_forwarding_signals", lambda command, env=None: 0)
    reads, read = [], files.read_mapping
    monkeypatch.setattr(files, "read_mapping", lambda path, *a, **k: reads.append(str(path)) or read(path, *a, **k))
    (tmp_path / "train.py").write_text("")
    config = str(recipe_path("cpu_2proc_cp2"))
    for argv in (["launch", "--config_file", "cpu_2proc_cp2", "--cp_size", "2", "train.py"],
                 ["train", "--config_file", "cpu_2proc_cp2", "--cp_size", "2", "--max_steps", "1"]):
        reads.clear()
        assert cli.main(argv) == 0
        assert reads.count(config) == 1, (argv, reads)


def test_an_unknown_flag_gets_the_nearest_one_named(tmp_path, capsys):
    err = _refused(capsys, ["--sparse_vertical_top_k", "8", "train.py"])  # before the script path: the grammar
    assert err.startswith("usage: python -m hf_sparse_cp.run ") and err.endswith(
        "; did you mean --sparse_vertical_topk for --sparse_vertical_top_k?\n"), err
    with launched(PluginArguments()), pytest.raises(SystemExit) as ended:  # the script's parser: as a bad flag
        HfArgumentParser(TrainingArguments).parse_args_into_dataclasses(
            ["--output_dir", str(tmp_path), "--sparse_blocksize", "64"])
    err = capsys.readouterr().err
    assert ended.value.code == 2 and ": error: Some specified arguments are not used" in err
    assert err.endswith("did you mean --sparse_block_size for --sparse_blocksize?\n"), err


@pytest.mark.parametrize("flag, named", [
    # all the flags as close as the closest, as the config keys are named (it named --sparse_slash_topp alone: the
    # last of a tie in the alphabet)
    ("--sparse_slash_top", "--sparse_slash_topk or --sparse_slash_topp for --sparse_slash_top"),
    ("--adam_beta", "--adam_beta1 or --adam_beta2 for --adam_beta"),
    # a flag without its first word, as close to two (it named --smet_block_size alone)
    ("--vertical_topk", "--sparse_vertical_topk for --vertical_topk"),
    ("--block_size", "--sparse_block_size or --smet_block_size for --block_size"),
    # a close whole flag beats its --no_ twin, and a short flag still finds its longer one; dashes read as underscores
    ("--skip_memory_metric", "--skip_memory_metrics for --skip_memory_metric"),
    ("--bf", "--bf16 for --bf"),
    ("--sparse-blocksize=64", "--sparse_block_size for --sparse-blocksize"),
])
def test_an_unknown_flag_is_named_with_every_flag_as_close_as_the_config_keys_are(flag, named):
    """The flags and the config keys had two matchers: a flag got one guess, the last of a tie in the alphabet, and
    none for a flag without its first word, which a config key gets (mode for cp_mode). One matcher serves both."""
    from hf_sparse_cp.config.files import did_you_mean

    assert did_you_mean(HfArgumentParser(SparseTrainingArguments), [flag]) == f"; did you mean {named}?"


def test_a_flag_in_the_spelling_a_launcher_option_does_not_take_is_named_with_the_one_it_takes(capsys):
    """`hf-sparse-cp launch --config-file x.yaml train.py` was refused with no hint: the launcher's own options are
    plain argparse, `--config_file` only, and the matcher read the dashed name as known and guessed nothing."""
    from hf_sparse_cp import cli
    from hf_sparse_cp.config.files import did_you_mean
    from hf_sparse_cp.launch.processes import launcher_options

    hint = "did you mean --config_file for --config-file?"
    assert did_you_mean(launcher_options("p", "u"), ["--config-file"]) == f"; {hint}"
    with pytest.raises(SystemExit) as refused:
        cli.main(["launch", "--config-file", "x.yaml", "train.py"])
    assert refused.value.code == 2 and hint in capsys.readouterr().err


@pytest.mark.parametrize("typed, hint", [
    ("--nprocs", "did you mean --nproc for --nprocs?"),
    ("--confg_file", "did you mean --config_file for --confg_file?"),
    # (it named the example's --sparse_config, --smet_config, ... --fsdp_config)
    ("--config-file", "did you mean --config_file for --config-file?"),
])
def test_a_near_miss_of_a_launcher_option_to_train_is_named_with_the_option(monkeypatch, capsys, typed, hint):
    """`hf-sparse-cp train` takes the launcher's options anywhere among the example's flags, so a typo of one is left
    to the example's parser, which does not have them: `--nprocs 2` was refused with no hint."""
    from hf_sparse_cp import cli
    from hf_sparse_cp.launch import processes

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    started = []
    monkeypatch.setattr(processes, "run_forwarding_signals", lambda command, env=None: started.append(command) or 0)
    with pytest.raises(SystemExit) as refused:
        cli.main(["train", "--nproc", "2", typed, "2", "--max_steps", "1"])
    err = capsys.readouterr().err
    assert refused.value.code == 2 and f"unrecognized arguments: {typed} 2; {hint}" in err, err
    assert not started


@pytest.mark.parametrize("trl_parser", [False, True])
def test_an_unknown_flag_with_no_near_one_ends_as_a_bad_flag_too(tmp_path, capsys, trl_parser):
    """`--torch_dtype bfloat16` given to run_clm.py (whose flag is --dtype) or to TRL's sft.py (TRL's own copy of
    HfArgumentParser) under hf-sparse-cp launch raised HfArgumentParser's ValueError with a traceback from every
    rank and exit status 1: only a flag with a near one ended as argparse ends a bad flag, once, exit status 2. A
    ValueError of the script's own (a dataclass's __post_init__) keeps its traceback."""
    parser_class = HfArgumentParser
    if trl_parser:
        parser_class = pytest.importorskip("trl").TrlParser
    with launched(PluginArguments()), pytest.raises(SystemExit) as ended:
        parser_class(TrainingArguments).parse_args_into_dataclasses(
            ["--output_dir", str(tmp_path), "--torch_dtype", "bfloat16"])
    err = capsys.readouterr().err
    assert ended.value.code == 2 and "error: Some specified arguments are not used" in err and "torch_dtype" in err
    assert "did you mean" not in err

    @dataclass
    class Data:
        train_file: str | None = None

        def __post_init__(self):
            if self.train_file is None:
                raise ValueError("Need a training file.")

    with launched(PluginArguments()), pytest.raises(ValueError, match="Need a training file"):
        parser_class((Data, TrainingArguments)).parse_args_into_dataclasses(["--output_dir", str(tmp_path)])


@pytest.mark.parametrize("flags, file, message", [
    (["--sparse_config", "{dir}/typo.yaml"], "vertical_top_k: 8\n",
     "typo.yaml': Unknown sparse attention config keys ['vertical_top_k']"),
    (["--sparse_config", "{dir}/typed.yaml"], "block_size: thirty-two\n", "use a whole number"),
    (["--sparse_config", "{dir}/missing.yaml"], None, "missing.yaml' does not exist"),
    (["--sparse_block_size", "48"], None, "block_size (--sparse_block_size)=48 must be a power of two"),
    (["--sparse_vertical_topk", "8", "--sparse_mass_target", "0.5"], None, "pass --sparse_budget_mode mass"),
    (["--sparse_estimation_chunk", "256"], None, "--sparse_estimation_chunk 256 would be ignored"),
    (["--sparse_estimation_chunk", "1024"], None, "--sparse_estimation_chunk 1024 would be ignored"),  # its default
    (["--cp_planner_comm_per_token", "300"], None, "--cp_planner_comm_per_token 300.0 would be ignored"),
    (["--sparse_attention_engine", "triton", "--use_cpu"], None, "Triton's kernels train on CUDA GPUs"),
    (["--smet", "--smet_density", "2"], None, "--smet_density=2.0 must be in (0, 1]"),
    (["--smet", "--smet_update_interval=-1"], None, "--smet_update_interval=-1 must be >= 2"),
    (["--smet", "--smet_config", "{dir}/smet.yaml"], "smet:\n  density: 0\n",
     "smet.yaml': density=0 must be in (0, 1]"),
    (["--smet", "--smet_config", "{dir}/typo.yaml"], "smet:\n  densty: 0.1\n",
     "typo.yaml': Unknown SMET config keys ['densty']"),
])
def test_a_bad_plugin_flag_of_a_launched_script_is_refused_with_its_message_alone(tmp_path, capsys, flags, file,
                                                                                   message):
    """A refused plugin flag (or the --sparse_config file it names) of a launched script ends it as argparse ends a
    bad flag: the message naming the field and the fix, exit status 2, no traceback through the script."""
    if file is not None:
        (tmp_path / flags[-1].rsplit("/", 1)[-1]).write_text(file)
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        from transformers import HfArgumentParser, TrainingArguments
        HfArgumentParser(TrainingArguments).parse_args_into_dataclasses()
        raise AssertionError("parsed")
    """))
    argv = [str(script), "--output_dir", str(tmp_path / "out"), *(f.format(dir=tmp_path) for f in flags)]
    with pytest.raises(SystemExit) as refused:
        run(argv)
    assert refused.value.code == 2
    err = capsys.readouterr().err
    assert "train.py: error: " in err and message in err and "Traceback" not in err


@pytest.mark.parametrize("argv", [
    ["launch", "--nproc", "2", "--cp_size", "3", "train.py"],  # before the script path
    ["launch", "--nproc", "2", "train.py", "--output_dir", "out", "--cp_size=3"],  # the script's parser takes it
    ["launch", "--nproc", "2", "train.py", "--cp_schedule", "0:64:1,5:128:3"],  # a curriculum stage's degree
    # the degree, not what follows from it: 128 tokens do not split into whole blocks over 3 CP ranks either, and the
    # refusal named other lengths (3:192:3), which the processes then refused for the degree
    ["train", "--nproc", "2", "--cp_schedule", "0:256:1,5:128:3", "--max_steps", "6"],
    ["launch", "--config_file", "cpu_2proc_cp2", "train.py", "--cp_size", "3"],  # the accelerate config's processes
    ["train", "--nproc", "2", "--cp_size", "3", "--max_steps", "1"],
    ["train", "--config_file", "cpu_2proc_cp2", "--cp_size", "3"],
    # --fsdp needs several processes: the check here parses as one of them would, not as a process alone
    ["train", "--nproc", "2", "--cp_size", "3", "--fsdp", "full_shard", "--fsdp_config",
     '{"version": 2, "transformer_layer_cls_to_wrap": ["Qwen2DecoderLayer"]}'],
])
def test_a_cp_degree_the_launched_processes_cannot_run_is_refused_before_they_start(started, monkeypatch,
                                                                                    tmp_path, capsys,
                                                                                       argv):
    """`--nproc 2 --cp_size 3`: every process would refuse it, then torchrun would print its own failure; the
    launcher refuses it first, as argparse refuses a flag (exit 2), and starts nothing."""
    from hf_sparse_cp import cli

    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(SystemExit) as refused:
        cli.main(argv)
    assert refused.value.code == 2 and not started
    err = capsys.readouterr().err
    stage = "--cp_schedule stage 1 (5:128:3): " if "--cp_schedule" in argv else ""  # (the stage refused, named)
    # (the example's schedule is refused by its own parse, as its other stage refusals are, under the command's name)
    prog = f"hf-sparse-cp {argv[0]}"
    assert (f"{prog}: error: {stage}cp_size=3 does not divide the world size 2 (the number of "
            "processes)") in err
    assert "launch a multiple of 3 processes" in err and "Traceback" not in err


@pytest.mark.parametrize("flags, message", [
    # (the plugin's flags before the script path, the script's after it)
    (["--cp_schedule", "0:128:1,2:200:2", "train.py", "--max_steps", "4"],
     "cp_schedule stage 1 (2:200:2): seq_len=200 does not split into whole blocks of 128 tokens over 2 CP ranks"),
    (["train.py", "--cp_schedule", "0:128:1,2:192:2", "--sparse_block_size", "64", "--max_steps", "4"],
     "cp_schedule stage 1 (2:192:2): seq_len=192 does not split into whole blocks of 64 tokens over 2 CP ranks"),
    (["--cp_schedule", "0:128:1,2:256:2:vertical_top=4", "train.py"], "['vertical_top'] are not sparse-pattern fields"),
    (["--cp_schedule", "0:128:1,2:256:2:cp_mode=bogus", "train.py"], "cp_mode=bogus (str) is not valid"),
    (["--cp_schedule", "0:128:1,2:256:2,2:256:1", "train.py", "--max_steps", "6"],
     "starts at step 2, not after stage 1"),
    # the starts against the script's --max_steps (TrainingArguments' flag, as its parser reads it)
    (["--cp_schedule", "0:128:1,4:256:2", "train.py", "--max_steps", "4"],
     "cp_schedule's last stage starts at step 4, at or after --max_steps 4"),
    (["--cp_schedule", "0:128:1,4:256:2", "train.py", "--max_steps=3"], "at or after --max_steps 3"),
])
def test_a_schedule_of_a_launched_script_that_its_flags_refuse_is_refused_before_the_processes_start(
        started, monkeypatch, tmp_path, capsys, flags, message):
    """`hf-sparse-cp launch --nproc 2 --cp_schedule 0:128:1,2:200:2 train.py --max_steps 4` (and a stage's unknown
    field, its start at or after --max_steps, ...) started both processes, each refusing the schedule once it had built
    its data and model (the launcher checked the stages' CP degrees only, where the docs say the flags alone refuse
    it before a launcher starts any process): refused once, naming the fix, nothing started."""
    from hf_sparse_cp import cli

    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(SystemExit) as refused:
        cli.main(["launch", "--nproc", "2", *flags, "--output_dir", "out", "--use_cpu"])
    assert refused.value.code == 2 and not started
    err = capsys.readouterr().err
    assert "hf-sparse-cp launch: error: " in err and message in err and "Traceback" not in err, err


@pytest.mark.parametrize("flags", [
    ["--cp_schedule", "0:128:1,2:192:2", "train.py", "--sparse_block_size", "32", "--max_steps", "4"],  # whole blocks
    ["--cp_schedule", "0:128:1,4:256:2", "train.py"],  # no --max_steps typed: the script may set it in code
    ["--cp_schedule", "0:128:1,4:256:2", "train.py", "--max_steps", "five"],  # the script's parser refuses it
    ["--cp_schedule", "0:128:1,4:256:2", "train.py", "--max_steps_total", "4"],  # a flag of the script's own
])
def test_a_schedule_the_launcher_cannot_refuse_from_the_flags_starts_the_processes(started, monkeypatch, tmp_path,
                                                                                    flags):
    from hf_sparse_cp import cli

    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert cli.main(["launch", "--nproc", "2", *flags, "--output_dir", "out", "--use_cpu"]) == 0
    assert len(started) == 1


def test_the_launcher_reads_a_scripts_use_cpu_for_the_device_its_processes_train_on(started, monkeypatch, tmp_path,
                                                                                      capsys):
    """A GPU-only engine with the script's --use_cpu on a GPU machine: the launcher checked it for the GPU and started
    the processes, each refusing it; it reads --use_cpu (and --use_cpu true/false) after the script path."""
    import torch

    from hf_sparse_cp import cli

    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)  # (a GPU machine)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda: torch.device("cuda"))
    for engine in (["--sparse_attention_engine", "triton"], []):  # (before the script path, or among its arguments)
        for use_cpu in (["--use_cpu"], ["--use_cpu", "true"], ["--use_cpu=True"]):
            after = [] if engine else ["--sparse_attention_engine", "triton"]
            with pytest.raises(SystemExit) as refused:
                cli.main(["launch", "--nproc", "2", *engine, "train.py", "--output_dir", "out", *after, *use_cpu])
            assert refused.value.code == 2 and not started
            assert "Triton's kernels train on CUDA GPUs" in capsys.readouterr().err
    assert cli.main(["launch", "--nproc", "2", "--sparse_attention_engine", "triton", "train.py", "--use_cpu",
                     "false"]) == 0
    assert len(started) == 1


def test_a_schedule_the_flags_refuse_is_refused_before_the_processes_start(started, monkeypatch, capsys):
    """`--cp_schedule 0:256:1,4:512:2 --max_steps 4` started both processes, each refusing it once it had built its
    data and model; the launcher's parse of the example's flags refuses it, once, and starts nothing."""
    from hf_sparse_cp import cli

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(SystemExit) as refused:
        cli.main(["train", "--nproc", "2", "--cp_schedule", "0:256:1,4:512:2", "--max_steps", "4"])
    assert refused.value.code == 2 and not started
    assert ("error: cp_schedule's last stage starts at step 4, at or after --max_steps 4: raise --max_steps above 4 "
            "or start the stage earlier.") in capsys.readouterr().err


def test_the_launcher_refuses_what_every_launched_process_would_before_starting_them(
        started, monkeypatch, tmp_path, capsys):
    from hf_sparse_cp import cli

    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    refusals = {("--sparse_block_size", "48"): "block_size (--sparse_block_size)=48 must be a power of two",
                ("--sparse_estimation_chunk", "256"): "--sparse_estimation_chunk 256 would be ignored",
                ("--sparse_estimation_chunk", "1024"): "--sparse_estimation_chunk 1024 would be ignored",  # (default)
                ("--cp_planner_comm_per_token=300",): "--cp_planner_comm_per_token 300.0 would be ignored"}
    for flags, refusal in refusals.items():
        # a plugin flag before the script path, which each process parses alone, or among the script's arguments,
        # which each process's parser takes: refused once each process had started, before
        for argv in ([*flags, "train.py"], ["train.py", "--output_dir", "out", *flags]):
            with pytest.raises(SystemExit) as refused:
                cli.main(["launch", "--nproc", "2", *argv])
            assert refused.value.code == 2 and not started
            assert f"hf-sparse-cp launch: error: {refusal}" in capsys.readouterr().err
    # the plugin's keys of TRL's --config file (its default value too), which each process's TrlParser reads
    (tmp_path / "trl_train.py").write_text("args = TrlParser(types).parse_args_and_config(fail_with_unknown_args=0)")
    for key, value in {"sparse_estimation_chunk": 1024, "cp_planner_comm_per_token": 300}.items():
        (tmp_path / "recipe.yaml").write_text(f"output_dir: out\n{key}: {value}\n")
        with pytest.raises(SystemExit) as refused:
            cli.main(["launch", "--nproc", "2", "trl_train.py", "--config", "recipe.yaml"])
        assert refused.value.code == 2 and not started
        assert f"error: --{key} {value}" in capsys.readouterr().err
    with pytest.raises(SystemExit) as refused:  # the example's own refusal, once, before the processes
        cli.main(["train", "--nproc", "2", "--recipe", "qwen2.5-3b_32k", "--max_steps", "1"])
    assert refused.value.code == 2 and not started
    assert "cp_size=8 does not divide the world size 2" in capsys.readouterr().err
    # what the processes can run starts them; what the script's own parser would read is left to it
    # (TRL's --config keys only where the script reads them: not a script's own --config YAML, nor where it passes
    # parse_args_and_config a list of its own)
    (tmp_path / "own_list.py").write_text("args = parser.parse_args_and_config(['--config', 'other.yaml'])")
    for script in ("train.py", "own_list.py"):
        assert cli.main(["launch", "--nproc", "2", script, "--config", "recipe.yaml"]) == 0
    assert cli.main(["launch", "--nproc", "2", "train.py", "--cp_size", "2", "--cp_size_of_mine", "3"]) == 0
    assert cli.main(["launch", "--nproc", "2", "train.py", "--cp_size", "abc"]) == 0
    # (a script's own flag that a flag of ours starts with, or that starts one of ours, is the script's: declared in
    # its source, where a flag close to one of ours that it does not declare is refused as mistyped)
    (tmp_path / "own_flags.py").write_text('parser.add_argument("--sparse")\nparser.add_argument("--sparse_estimation_'
                                           'chunks")\n')
    assert cli.main(["launch", "--nproc", "2", "own_flags.py", "--sparse", "256", "--sparse_estimation_chunks",
                     "8"]) == 0
    assert cli.main(["train", "--nproc", "2", "--cp_size", "2", "--max_steps", "1"]) == 0
    assert len(started) == 6



@pytest.mark.parametrize("script", ["stock", "own_parser"])
def test_a_mistyped_plugin_flag_after_the_script_path_is_refused_before_the_processes_start(
        started, monkeypatch, tmp_path, capsys, script):
    """`--cp_sizee 2` after the script's path started every process, whose parser refused it (a script's own argparse
    once per process, without naming --cp_size), then torchrun's SIGTERM line ended the output. A flag of the plugin's
    first words that is close to one of its flags, and that neither the plugin nor the script's source declares, is
    refused once, naming the close flag, before any process starts."""
    from hf_sparse_cp import cli

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    (tmp_path / "train.py").write_text(
        "(args,) = HfArgumentParser(TrainingArguments).parse_args_into_dataclasses()" if script == "stock" else
        'parser = argparse.ArgumentParser()\nparser.add_argument("--cp-sizes")\n'
        'parser.add_argument("--sparse_block_sizes")')
    for flags, named in ((["--cp_sizee", "2"], "--cp_sizee after the script's path is not a plugin flag, nor one that "
                          "train.py declares; did you mean --cp_size for --cp_sizee?"),
                         (["--sparse-max-lenght=300", "--smet_block_sizes", "8"], "--sparse-max-lenght, "
                          "--smet_block_sizes after the script's path are not plugin flags, nor ones that train.py "
                          "declares; did you mean --sparse_max_length for --sparse-max-lenght, --smet_block_size for "
                          "--smet_block_sizes?")):
        with pytest.raises(SystemExit) as refused:
            cli.main(["launch", "--nproc", "2", "train.py", "--output_dir", "out", *flags])
        assert refused.value.code == 2 and not started
        err = capsys.readouterr().err
        assert err.count(named) == 1 and err.endswith(f"hf-sparse-cp launch: error: {named}\n"), err
    with pytest.raises(SystemExit) as refused:  # (run in this process, or by `python -m hf_sparse_cp.run`: the same)
        run(["train.py", "--cp_sizee", "2"])
    assert refused.value.code == 2 and "did you mean --cp_size for --cp_sizee?" in capsys.readouterr().err
    # left to the script's parser: a plugin flag or an abbreviation of one, a flag not close to one, a flag the script
    # declares (`--cp-sizes`), one after `--`
    for flags in (["--cp_size", "2"], ["--cp_siz", "2"], ["--cp_my_own", "1"], ["--sparsity", "1"],
                  ["--", "--cp_sizee"]):
        assert cli.main(["launch", "--nproc", "2", "train.py", *flags]) == 0, flags
    if script == "own_parser":
        assert cli.main(["launch", "--nproc", "2", "train.py", "--cp_sizes", "2", "--sparse_block_sizes", "8"]) == 0
    # a flag declared in a module of the script's folder (its argument classes imported by name), not in the script
    (tmp_path / "my_args.py").write_text("@dataclass\nclass DataArguments:\n    cp_sizee: int = 1\n")
    assert cli.main(["launch", "--nproc", "2", "train.py", "--cp_sizee", "2"]) == 0
    assert len(started) == 6 + (script == "own_parser")


def test_a_flag_for_a_field_of_a_budget_mode_the_script_registers_names_the_config_file(started, monkeypatch, tmp_path,
                                                                                        capsys):
    """`--sparse_share` for the field `share` of a budget mode the script registers was refused naming only the
    closest built-in flag (--sparse_mass_target), though a budget mode of one's own has no flags (the pattern flags
    are built before the script runs): the refusal also names the --sparse_config file's budget section."""
    from hf_sparse_cp import cli

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    own = "@register_budget\n@dataclass\nclass Share(Budget):\n    mode = 'share'\n    share: float = 0.1\n"
    (tmp_path / "train.py").write_text(own)
    with pytest.raises(SystemExit) as refused:
        cli.main(["launch", "--nproc", "2", "train.py", "--sparse_share", "0.2"])
    err = capsys.readouterr().err
    assert refused.value.code == 2 and not started, err
    assert ("did you mean --sparse_mass_target for --sparse_share? Or, if --sparse_share should set a field of the "
            "budget mode that the script registers: a budget mode of one's own has no flags, its fields go in the "
            "file given to --sparse_config (its 'budget' section: the mode and its fields).") in err, err
    (tmp_path / "train.py").write_text(own.replace("register_budget", "dataclass"))  # (registers none: a typo alone)
    with pytest.raises(SystemExit):
        cli.main(["launch", "--nproc", "2", "train.py", "--sparse_share", "0.2"])
    err = capsys.readouterr().err
    assert "did you mean --sparse_mass_target for --sparse_share?" in err and "budget mode" not in err, err


SETUP_SCRIPT = textwrap.dedent("""
    import sys
    import torch
    from transformers import AutoModelForCausalLM, HfArgumentParser, Trainer, TrainingArguments
    from hf_sparse_cp.testing.tiny_models import tiny_config

    (args,) = HfArgumentParser(TrainingArguments).parse_args_into_dataclasses()
    model = AutoModelForCausalLM.from_config(tiny_config("llama", num_hidden_layers=2))
    rows = [] if "{empty}" == "yes" else [{{"input_ids": torch.arange(3, 40), "labels": torch.arange(3, 40)}}]
    Trainer(model=model, args=args, train_dataset=rows)
    raise AssertionError("built")
""")


@pytest.mark.parametrize("flags, empty, message", [
    (["--sparse_layer_overrides", '{"5": {"pattern": "dense"}}'], "no",
     "layer_overrides key '5' reaches past the model's 2 layers: use keys within 0-1."),
    (["--sparse_layer_overrides", '{"1-3": {"pattern": "dense"}}'], "no",
     "layer_overrides key '1-3' reaches past the model's 2 layers: use '1-1'."),
    ([], "yes", "train_dataset is empty (0 samples): there is nothing to train on"),
    (["--smet", "--smet_block_size", "24"], "no", "input columns, not a multiple of block_size=24; pick a block size"),
])
def test_a_setting_the_trainer_refuses_at_set_up_ends_a_launched_script_as_a_bad_flag(tmp_path, capsys, flags, empty,
                                                                                        message):
    """Refusals the plugin can only make once the script's Trainer has its model and data (layer_overrides past the
    model's layers, an empty train_dataset) end a launched script with the message alone, exit status 2, as a bad
    flag does, not in a traceback through the script and the Trainer."""
    script = tmp_path / "train.py"
    script.write_text(SETUP_SCRIPT.format(empty=empty))
    with pytest.raises(SystemExit) as refused:
        run([str(script), "--output_dir", str(tmp_path / "out"), "--report_to", "none", "--use_cpu", *flags])
    assert refused.value.code == 2
    err = capsys.readouterr().err
    assert "train.py: error: " in err and message in err and "Traceback" not in err, err


def test_a_bad_value_for_the_scripts_parser_prints_a_short_usage_not_every_flag(tmp_path, capsys):
    """argparse's own error (`--sparse_vertical_topk abc`) printed the usage of every flag the parser has, the
    plugin's ~60 beside TrainingArguments' (178 lines): the script's parser, extended, prints its prog and a
    pointer to --help instead, then the error, exit status 2; a usage the script wrote is kept."""
    with launched(PluginArguments()), pytest.raises(SystemExit) as refused:
        HfArgumentParser(TrainingArguments, prog="train.py").parse_args_into_dataclasses(
            ["--output_dir", str(tmp_path), "--sparse_vertical_topk", "abc"])
    err = capsys.readouterr().err
    assert refused.value.code == 2
    assert err.splitlines() == ["usage: train.py [FLAGS] (train.py --help lists them)",
                                "train.py: error: argument --sparse_vertical_topk/--sparse-vertical-topk: invalid int "
                                "value: 'abc'"]
    with launched(PluginArguments()), pytest.raises(SystemExit):
        own = HfArgumentParser(TrainingArguments, prog="train.py", usage="train.py --output_dir DIR")
        own.parse_args_into_dataclasses(["--learning_rate", "abc"])
    assert capsys.readouterr().err.splitlines()[0] == "usage: train.py --output_dir DIR"


HELP_SCRIPT = textwrap.dedent("""
    from transformers import HfArgumentParser, TrainingArguments
    HfArgumentParser(TrainingArguments).parse_args_into_dataclasses()
    raise AssertionError("parsed")
""")


@pytest.mark.parametrize("argv, here", [
    (["train", "--nproc", "2", "--help"], ["train", "--help"]),
    (["train", "--config_file", "cpu_2proc_cp2", "-h"], ["train", "-h"]),
    (["launch", "--nproc", "2", "--help"], ["launch", "--help"]),
    (["launch", "--nproc", "2", "train.py", "--help"], ["launch", "train.py", "--help"]),
    (["launch", "--config_file", "cpu_2proc_cp2", "train.py", "--cp_size", "2", "-h"], ["launch", "train.py", "-h"]),
])
def test_help_under_several_processes_prints_once_before_any_starts(started, monkeypatch, tmp_path, capsys, argv, here):
    """`hf-sparse-cp train --nproc 2 --help` printed the example's help once per launched process: it prints it
    once, here, as one process does, and exits 0 without starting them (`launch`: the plugin's flags before a
    script path, or the script's own help, with the plugin's flags, after it)."""
    from hf_sparse_cp import cli

    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text(HELP_SCRIPT)
    monkeypatch.setenv("COLUMNS", "200")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    printed = []
    for command in (here, argv):
        with pytest.raises(SystemExit) as done:
            cli.main(command)
        assert done.value.code in (0, None) and not started
        printed.append(capsys.readouterr())
    (one, _), (out, err) = printed
    assert "--sparse_vertical_topk" in one and err == ""
    assert out == one


def test_a_script_that_reads_no_help_is_not_run_alone_for_it(started, monkeypatch, tmp_path, capsys):
    """The help of a script to launch in several processes comes from its run here, up to its parser: a script that
    builds its Trainer without a parser that reads --help is stopped there, naming why, with nothing launched (it
    would otherwise train here, in one process)."""
    from hf_sparse_cp import cli

    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("from transformers import Trainer\nTrainer(model=None, args=None)\n")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    err = _refused(capsys, ["launch", "--nproc", "2", "train.py", "--help"], cli.main)
    assert not started
    assert err == ("train.py: error: --help: the script built its Trainer without a parser that reads --help, so it "
                   "has none to print; nothing was launched.\n"), err


@pytest.mark.parametrize("nproc", ["1", "2"])
def test_a_bad_flag_of_the_example_prints_a_short_usage_not_every_flag(started, monkeypatch, tmp_path, capsys, nproc):
    """`hf-sparse-cp train --sparse_vertical_topk abc` printed the usage of every flag (~190 lines) before the
    error: the example's parser prints its prog and a pointer to --help, then argparse's error, exit 2 (in this
    process, and before launching several)."""
    from hf_sparse_cp import cli

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    err = _refused(capsys, ["train", "--nproc", nproc, "--sparse_vertical_topk", "abc"], cli.main)
    assert not started
    prog = "hf-sparse-cp train"  # (the command typed, in this process and before launching several)
    assert err.splitlines() == [f"usage: {prog} [FLAGS] ({prog} --help lists them)",
                                f"{prog}: error: argument --sparse_vertical_topk/--sparse-vertical-topk: invalid int "
                                "value: 'abc'"], err


def test_the_example_run_by_hf_sparse_cp_train_goes_by_that_name_in_its_processes(monkeypatch, tmp_path, capsys):
    """`hf-sparse-cp train` runs the example module: its help, usage and refusals said `train_long_context.py`, a
    file its user never typed (and 'train_long_context.py --help lists them', no command). They name the command,
    in the processes it starts (`COMMAND_ENV` as they start) and for a refusal of the model it builds in this
    process; the name is this command's only while it runs."""
    from hf_sparse_cp import cli
    from hf_sparse_cp.launch import processes
    from hf_sparse_cp.launch.refusals import COMMAND_ENV

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv(COMMAND_ENV, raising=False)
    names = []
    monkeypatch.setattr(processes, "run_forwarding_signals",
                        lambda command, env=None: names.append((env or os.environ).get(COMMAND_ENV)) or 0)
    assert cli.main(["train", "--nproc", "2", "--sparse_max_length", "256"]) == 0
    assert names == ["hf-sparse-cp train"] and COMMAND_ENV not in os.environ
    job = ["--sparse_max_length", "256", "--max_steps", "1", "--num_samples", "1", "--tiny_num_layers", "1",
           "--output_dir", str(tmp_path), "--sparse_layer_overrides", '{"5-10": {"pattern": "dense"}}']
    err = _refused(capsys, ["train", *job], cli.main)
    assert re.search(r"(^|\n)hf-sparse-cp train: error: ", err) and "reaches past the model's 1 layers" in err, err
    assert COMMAND_ENV not in os.environ


def test_a_script_loads_its_model_with_attn_implementation_sparse_cp():
    """TRL's scripts load the model before the Trainer, with their --attn_implementation: `sparse_cp` loads under
    hf_sparse_cp.run (transformers refused it as not supported, the backend registered only in the Trainer's
    __init__), and is unregistered again when the script ends."""
    from transformers import AutoModelForCausalLM

    from hf_sparse_cp.integration.interfaces import is_patched, unpatch
    from hf_sparse_cp.testing.tiny_models import tiny_config

    unpatch()
    with launched(PluginArguments()):
        model = AutoModelForCausalLM.from_config(tiny_config("llama"), attn_implementation="sparse_cp")
    assert model.config._attn_implementation == "sparse_cp" and not is_patched()


def test_a_script_that_builds_no_trainer_is_told_the_plugin_never_reached_it(tmp_path, monkeypatch, capsys):
    """A training loop of its own (transformers' run_clm_no_trainer.py) under hf_sparse_cp.run trained with stock
    attention and without CP, silently, whatever plugin flags it was given; it is now told when it ends."""
    (tmp_path / "own_loop.py").write_text("print('trained')\n")
    monkeypatch.chdir(tmp_path)
    run(["--cp_size", "2", "--sparse_block_size", "32", "own_loop.py"])
    err = capsys.readouterr().err
    assert "own_loop.py ended without building a transformers Trainer" in err
    assert "--cp_size, --sparse_block_size" in err and "functional API" in err
    # (a model the script loads with attn_implementation="sparse_cp" attends sparse: the warning said it did not)
    assert "model's own attention" not in err and 'attn_implementation="sparse_cp" attended' in err
    assert "never reached it: it ran as python runs it" in err
    (tmp_path / "record_run.py").write_text(RECORDER)  # a script that parses the flags but trains nothing: told too
    run(["record_run.py", "--output_dir", "out", "--sparse_min_seq_len", "64"])
    err = capsys.readouterr().err
    assert "record_run.py ended without building a transformers Trainer" in err
    assert "flags --sparse_min_seq_len were not used" in err


OWN_LOOP = textwrap.dedent("""
    import torch

    weight = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([weight], lr=0.5)
    for step in range(2):
        weight.sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        print(f"step {step}: {weight.tolist()}")
""")


def test_a_training_loop_of_its_own_is_told_at_its_first_step_and_refused_with_plugin_flags(tmp_path, monkeypatch,
                                                                                           capsys):
    """A script's own training loop (no Trainer) under hf_sparse_cp.run trained its whole run without the plugin and
    heard so at its end; given plugin flags (before its path or among its own), which it would train without, it is
    now refused at its first optimizer step, before a weight changes; without flags it is warned then, once."""
    (tmp_path / "own_loop.py").write_text(OWN_LOOP)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as refused:
        run(["--cp_size", "2", "own_loop.py"])
    captured = capsys.readouterr()
    assert refused.value.code == 2 and "step 0" not in captured.out
    assert "own_loop.py takes an optimizer step without having built a transformers Trainer" in captured.err
    assert "(--cp_size) never reach" in captured.err and "Nothing was trained" in captured.err
    run(["own_loop.py"])
    captured = capsys.readouterr()
    assert "step 1: [0.0, 0.0]" in captured.out  # (it trains as python runs it)
    assert captured.err.count("without building a transformers Trainer") == 1
    assert "own_loop.py takes its first optimizer step without building a transformers Trainer" in captured.err
    # (told before it trains: what it runs, not what it ran, as the end of a run says: #50)
    assert "never reaches it: it runs as python runs it" in captured.err and " ran " not in captured.err
    assert 'attn_implementation="sparse_cp" attends with' in captured.err
    assert not _global_optimizer_pre_hooks  # (the hook is gone with the script)
OWN_PARSER = textwrap.dedent("""
    import argparse
    parser = argparse.ArgumentParser(description="a training loop of its own, as run_clm_no_trainer.py")
    parser.add_argument("--model_name_or_path")
    parser.add_argument("--output_dir")
    print(parser.parse_args())
""")


def test_plugin_flags_refused_by_a_scripts_own_argparse_are_explained(tmp_path, monkeypatch, capsys):
    """transformers' run_clm_no_trainer.py parses its flags with argparse: `hf-sparse-cp launch --nproc 2
    run_clm_no_trainer.py ... --cp_size 2` ended on its 'unrecognized arguments: --cp_size 2' alone, as if the
    plugin had no such flag; a note now says why and what to do. A script whose parser takes the plugin's flags gets
    no note for its own refusals."""
    (tmp_path / "own_parser.py").write_text(OWN_PARSER)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(SystemExit) as exited:
        run(["own_parser.py", "--model_name_or_path", "m", "--cp_size", "2", "--sparse_block_size=32"])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and "unrecognized arguments: --cp_size 2 --sparse_block_size=32" in err
    assert "note: own_parser.py parses its command line with a parser of its own" in err
    assert "(--cp_size, --sparse_block_size)" in err and "before its path" in err and "functional API" in err
    # (the command to copy holds their values: it named the flags alone, `run --cp_size --sparse_block_size ...`)
    assert "(python -m hf_sparse_cp.run --cp_size 2 --sparse_block_size=32 ... own_parser.py ...)" in err
    with pytest.raises(SystemExit):  # its own flag refused, no plugin flag given: argparse's message alone
        run(["own_parser.py", "--bogus", "1"])
    assert "note:" not in capsys.readouterr().err
    (tmp_path / "record_run.py").write_text(RECORDER)  # a parser over TrainingArguments: its refusal says enough
    with pytest.raises(SystemExit):
        run(["record_run.py", "--output_dir", "out", "--cp_size", "0"])
    assert "note:" not in capsys.readouterr().err


ATTENTION_SCRIPT = textwrap.dedent("""
    from dataclasses import dataclass
    import torch
    from transformers import AutoModelForCausalLM, HfArgumentParser, Trainer, TrainingArguments
    from hf_sparse_cp.testing.tiny_models import tiny_config

    @dataclass
    class ModelArguments:  # TRL's ModelConfig's field
        attn_implementation: str | None = None

    model_args, args = HfArgumentParser((ModelArguments, TrainingArguments)).parse_args_into_dataclasses()
    model = AutoModelForCausalLM.from_config(tiny_config("llama"), attn_implementation=model_args.attn_implementation)
    rows = [{"input_ids": torch.arange(3, 40), "labels": torch.arange(3, 40)}]
    trainer = Trainer(model=model, args=args, train_dataset=rows)
    print("attention:", trainer.model.config._attn_implementation)
""")


@pytest.mark.parametrize("flags, runs, says", [
    (["--attn_implementation", "eager"], "sparse_cp", True),
    (["--attn_implementation", "sdpa", "--cp_size", "1"], "sparse_cp", True),
    (["--attn_implementation", "eager", "--sparse_attention", "false"], "eager", False),
    (["--attn_implementation", "eager", "--sparse_attention", "true"], "sparse_cp", False),
    (["--attn_implementation", "sparse_cp"], "sparse_cp", False),
    ([], "sparse_cp", False),
], ids=["eager", "sdpa", "eager-kept", "sparse-asked", "sparse_cp", "default"])
def test_an_attention_implementation_the_script_was_given_says_what_replaced_it_and_how_to_keep_it(
        tmp_path, capsys, caplog, flags, runs, says):
    """A stock script given `--attn_implementation eager` trains, launched, with sparse attention (the launcher's
    default): one line on the main process names the implementation asked for, the one that replaced it and the flag
    that keeps it; `--sparse_attention false` keeps it, and nothing is said where nothing the user chose was
    replaced (no --attn_implementation, sparse_cp itself, or --sparse_attention true given beside it)."""
    script = tmp_path / "train.py"
    script.write_text(ATTENTION_SCRIPT)
    with caplog.at_level("WARNING", logger="hf_sparse_cp"):
        run([str(script), "--output_dir", str(tmp_path / "out"), "--report_to", "none", "--use_cpu", *flags])
    assert f"attention: {runs}" in capsys.readouterr().out
    replaced = [r.getMessage() for r in caplog.records if "--attn_implementation" in r.getMessage()]
    if not says:
        assert replaced == []
        return
    asked = flags[1]
    assert replaced == [f"The script's --attn_implementation asks for attn_implementation {asked}, which sparse_cp "
                        "replaces: hf_sparse_cp.run trains with sparse attention unless told otherwise; pass "
                        f"--sparse_attention false to keep {asked}."]
    args = SparseTrainingArguments(output_dir=str(tmp_path), use_cpu=True, cp_size=2)
    assert attention_replaced("--attn_implementation", asked, args).endswith(
        f"to keep {asked} and drop --cp_size (context parallelism runs only through sparse_cp).")


def test_trls_model_init_kwargs_naming_an_attention_implementation_are_named_as_the_flag_that_asked(tmp_path):
    """TRL's scripts load the model with `--model_init_kwargs` over `--attn_implementation`: an implementation either
    names is the one the replacement line names, with its flag."""
    trl = pytest.importorskip("trl")
    with launched(PluginArguments()):
        parser = trl.TrlParser((trl.SFTConfig, trl.ModelConfig))
        argv = ["--output_dir", str(tmp_path), "--bf16", "false", "--attn_implementation", "sdpa"]
        config, model = parser.parse_args_into_dataclasses(
            [*argv, "--model_init_kwargs", '{"attn_implementation": "eager"}'])
        explicit = set(config.explicit_flags)
        assert attention_asked([config, model], explicit) == ("--model_init_kwargs", "eager")
        config, model = parser.parse_args_into_dataclasses(argv)
        assert attention_asked([config, model], set(config.explicit_flags)) == ("--attn_implementation", "sdpa")
        config, model = parser.parse_args_into_dataclasses(argv[:4])
        assert attention_asked([config, model], set(config.explicit_flags)) is None


def test_sparse_attention_off_with_a_model_loaded_as_sparse_cp_is_refused(tmp_path, capsys):
    """`--attn_implementation sparse_cp --sparse_attention false` (a dense baseline asked for, the script's model loaded
    sparse) trained sparse, with the backend's default pattern: `--sparse_block_size 32` ran as block 128, without a
    word. Refused, naming both ways out; an sdpa model with the switch off trains dense, as before."""
    script = tmp_path / "train.py"
    script.write_text(ATTENTION_SCRIPT)
    common = [str(script), "--output_dir", str(tmp_path / "out"), "--report_to", "none", "--use_cpu",
              "--sparse_attention", "false"]
    with pytest.raises(SystemExit) as refused:
        run([*common, "--attn_implementation", "sparse_cp", "--sparse_block_size", "32"])
    assert refused.value.code == 2
    err = capsys.readouterr().err
    assert ("train.py: error: --sparse_attention false, but LlamaForCausalLM runs attn_implementation='sparse_cp' (it "
            "was loaded or configured with it), so it would train sparse, its pattern not the run's flags: load it "
            "with attn_implementation='sdpa' or 'eager' (the script's --attn_implementation) to train dense, or drop "
            "--sparse_attention false to train sparse.") in err, err
    run([*common, "--attn_implementation", "sdpa"])
    assert "attention: sdpa" in capsys.readouterr().out


def test_train_runs_a_script_at_a_path_without_py_and_names_a_missing_one(started, monkeypatch, tmp_path, capsys):
    """`hf-sparse-cp train path/to/script` (an executable file, no .py) went to the example, which ended in
    'unrecognized arguments: path/to/script': a file is the script, run as `launch` runs it; a path that is no
    file is refused as no such script, before anything starts; a recipe file first stays the example's."""
    from hf_sparse_cp import cli

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "train").write_text("")
    assert cli.main(["train", "--nproc", "2", "--cp_size", "2", "bin/train", "--output_dir", "out"]) == 0
    assert started[-1] == [*TORCHRUN, "--nproc_per_node=2", "-m", RUN_MODULE, "--cp_size", "2", "bin/train",
                           "--output_dir", "out"]
    for missing in (["bin/trian"], ["--nproc", "2", "--sparse_max_length", "512", "trian", "--max_steps", "1"]):
        started.clear()
        assert cli.main(["train", *missing]) == 2 and not started
        err = capsys.readouterr().err
        assert err.startswith(f"usage: {cli.TRAIN_USAGE}\nhf-sparse-cp train: error: no such script: ") and (
            "is not a file" in err and "unrecognized arguments" not in err), err
    assert cli.main(["train", "--nproc", "2", "--sparse_max_length", "512", "--max_steps", "1"]) == 0
    assert started[-1][-6:] == ["-m", cli.EXAMPLE_MODULE, "--sparse_max_length", "512", "--max_steps", "1"]


DATA_SCRIPT = textwrap.dedent("""
    from transformers import HfArgumentParser, TrainingArguments

    (args,) = HfArgumentParser(TrainingArguments).parse_args_into_dataclasses()
    raise AssertionError("the script went on to build its data")
""")


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="liger-kernel runs on CUDA")
def test_use_liger_kernel_on_cpu_is_refused_as_the_scripts_flags_parse(tmp_path, capsys):
    """--use_liger_kernel on CPU was refused only when the Trainer was built, after the script had loaded and
    tokenized its data (minutes on a real dataset): the plugin's arguments refuse it as they parse."""
    script = tmp_path / "train.py"
    script.write_text(DATA_SCRIPT)
    with pytest.raises(SystemExit) as refused:
        run([str(script), "--output_dir", str(tmp_path / "out"), "--report_to", "none", "--use_liger_kernel"])
    assert refused.value.code == 2
    err = capsys.readouterr().err
    assert ("train.py: error: --sparse_fused_ops liger (or --use_liger_kernel): liger-kernel's Triton kernels need a "
            "CUDA GPU") in err and "Traceback" not in err, err
    with pytest.raises(ValueError, match="--use_liger_kernel asks for liger-kernel's kernels and --sparse_fused_ops"):
        SparseTrainingArguments(output_dir=str(tmp_path), use_liger_kernel=True, sparse_fused_ops="compile")
    # without sparse attention the plugin applies nothing (the Trainer's own liger-kernel set-up runs)
    SparseTrainingArguments(output_dir=str(tmp_path), use_liger_kernel=True, sparse_attention=False)


@pytest.mark.parametrize("flags, env, message", [
    (["--fsdp", "full_shard"], {}, "--fsdp shards the model over processes, and this one runs alone"),
    ([], {"ACCELERATE_USE_PARALLELISM_CONFIG": "true", "PARALLELISM_CONFIG_CP_SIZE": "2"},
     "The accelerate config sets a ParallelismConfig (parallelism_config_cp_size 2), which accelerate runs only on "
     "GPUs"),
], ids=["fsdp-alone", "parallelism-config-on-cpu"])
def test_a_launch_the_arguments_refuse_ends_a_launched_script_as_a_bad_flag(tmp_path, capsys, monkeypatch, flags,
                                                                             env, message):
    """`--fsdp` in one process, and an accelerate config's ParallelismConfig on a machine without GPUs (the GPU recipe
    copied to CPU processes), were refused in a traceback through the script from every process: they end as a bad
    flag does, the message alone, exit status 2."""
    from hf_sparse_cp.trainer import sparse_trainer

    monkeypatch.setattr(sparse_trainer, "_has_accelerator", lambda: False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    script = tmp_path / "train.py"
    script.write_text(DATA_SCRIPT)
    with pytest.raises(SystemExit) as refused:
        run([str(script), "--output_dir", str(tmp_path / "out"), "--report_to", "none", *flags])
    assert refused.value.code == 2
    err = capsys.readouterr().err
    assert f"train.py: error: {message}" in err and "Traceback" not in err, err


# (the template's parser reads ORPOConfig: imported beside DistillationTrainer)
_DISTILLATION = "\nfrom trl import DistillationTrainer\nfrom trl.experimental.orpo import ORPOConfig"
TRL_SCRIPT = textwrap.dedent("""
    from trl import ModelConfig, TrlParser{imports}

    if __name__ == "__main__":
        parser = TrlParser((ORPOConfig, ModelConfig))
        args, model_args = parser.parse_args_and_config()
        {body}
""")


@pytest.mark.parametrize("script, refused", [
    (["-m", "trl.scripts.reward"], None),  # (CP pools its head's score over the group's whole rows)
    (["-m", "trl.scripts.grpo"], None),  # (its CP groups share the rows they generate, as DPO's whole rows)
    (["-m", "trl.scripts.rloo"], None),  # (as GRPO's)
    (["-m", "trl.scripts.distillation"], "DistillationTrainer"),
    (["-m", "trl.scripts.dpo"], None),  # (CP gathers its whole rows)
    (["-m", "trl.scripts.sft"], None),
    # TRL's examples/scripts/orpo.py builds TRL's ORPOTrainer by name (CP gathers its whole rows' logits)
    ([("\nfrom trl.experimental.orpo import ORPOConfig, ORPOTrainer", "trainer = ORPOTrainer(model=None, args=args)")],
     None),
    # a script that builds TRL's DistillationTrainer by name
    ([(_DISTILLATION, "trainer = DistillationTrainer(model=None, args=args)")], "DistillationTrainer"),
    # what the source does not say for sure is left to the processes: a trainer of the script's own, one of two
    ([(f"{_DISTILLATION}\nclass Mine(DistillationTrainer): pass", "trainer = Mine(model=None, args=args)")], None),
    ([(f"{_DISTILLATION}\nfrom trl import SFTTrainer",
       "trainer = (DistillationTrainer if args.seed else SFTTrainer)(model=None, args=args)")], None),
    ([(f"{_DISTILLATION}\nfrom trl import SFTTrainer",
       "trainer = DistillationTrainer(model=None, args=args) if args.seed else SFTTrainer(model=None, args=args)")],
     None),
])
def test_a_trl_trainer_cp_does_not_reproduce_is_refused_before_the_processes_start(started, monkeypatch,
                                                                                   tmp_path, capsys,
                                                                                    script, refused):
    """TRL's distillation trainer under CP was refused only once every process had built its Trainer, after loading
    and tokenizing the data: the launcher reads which trainer the script builds from its source (`-m
    trl.scripts.distillation`, a script that builds TRL's DistillationTrainer) and refuses with the same message
    before any process starts; where the source does not say for sure, the processes refuse as before. Each process
    refuses it too as its flags parse (`launched`), for a launch that does not go through `hf-sparse-cp launch`."""
    pytest.importorskip("trl")
    from hf_sparse_cp import cli

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    if isinstance(script[0], tuple):
        (tmp_path / "orpo.py").write_text(TRL_SCRIPT.format(imports=script[0][0], body=script[0][1]))
        script = ["orpo.py"]
    argv = ["launch", "--nproc", "2", *script, "--output_dir", "out", "--cp_size", "2"]
    if refused is None:
        assert cli.main(argv) == 0 and started
        return
    with pytest.raises(SystemExit) as stopped:
        cli.main(argv)
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and not started, err
    assert (f"hf-sparse-cp launch: error: {refused} under context parallelism (CP 2) is not supported: its "
            "compute_loss") in err and "Fix: run without CP (drop --cp_size" in err, err
    assert cli.main(argv[:-2]) == 0 and started  # (without CP it trains)


def test_each_process_refuses_the_trl_trainer_its_script_builds_as_its_flags_parse(monkeypatch, tmp_path, capsys):
    trl = pytest.importorskip("trl")
    from hf_sparse_cp.trainer.plugin_arguments import PluginArgumentsMixin

    monkeypatch.setattr(PluginArgumentsMixin, "check_launch", lambda self, env=None: None)  # (as under 2 processes)
    argv = ["--output_dir", str(tmp_path), "--cp_size", "2", "--report_to", "none"]
    with launched(PluginArguments()) as run:
        run.trainers = [trl.SFTTrainer]
        HfArgumentParser(TrainingArguments).parse_args_into_dataclasses(argv)
    with launched(PluginArguments()) as run, pytest.raises(SystemExit) as refused:
        run.trainers = [trl.DistillationTrainer]
        HfArgumentParser(TrainingArguments).parse_args_into_dataclasses(argv)
    assert refused.value.code == 2
    assert "error: DistillationTrainer under context parallelism (CP 2) is not supported" in capsys.readouterr().err


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="liger-kernel runs on CUDA")
def test_use_liger_kernel_on_cpu_for_a_trl_script_is_refused_before_the_processes_start(started, monkeypatch, tmp_path,
                                                                                        capsys):
    pytest.importorskip("trl")
    from hf_sparse_cp import cli

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(SystemExit) as stopped:
        cli.main(["launch", "--nproc", "2", "-m", "trl.scripts.sft", "--output_dir", "out", "--use_liger_kernel"])
    assert stopped.value.code == 2 and not started
    assert ("hf-sparse-cp launch: error: --sparse_fused_ops liger (or --use_liger_kernel): liger-kernel's Triton "
            "kernels need a CUDA GPU") in capsys.readouterr().err
    for flags in (["--use_liger_kernel", "false"], ["--use_liger_kernel", "--sparse_attention", "false"]):
        assert cli.main(["launch", "--nproc", "2", "-m", "trl.scripts.sft", "--output_dir", "out", *flags]) == 0
    # a script whose trainer the source does not name is left to its processes (they refuse it as they parse)
    (tmp_path / "train.py").write_text(DATA_SCRIPT)
    assert cli.main(["launch", "--nproc", "2", "train.py", "--output_dir", "out", "--use_liger_kernel"]) == 0


def test_a_file_python_cannot_run_is_refused_before_the_processes_start(started, monkeypatch, tmp_path, capsys):
    """A shell script, a binary or a script with a syntax error, given as the script (`hf-sparse-cp train run.sh`
    now runs a file as the script), ended in each launched process in a SyntaxError under runpy's traceback; the
    launcher names it once. What python runs (source, a zip with __main__.py) is left to it."""
    import zipfile

    from hf_sparse_cp import cli

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    (tmp_path / "run.sh").write_text("#!/bin/bash\npython train.py \"$@\"\n")
    (tmp_path / "broken.py").write_text("def main(:\n    pass\n")
    (tmp_path / "binary").write_bytes(b"\x7fELF\x00\x01")
    for command, script, message in (
            ("train", "run.sh", "run.sh is a script of /bin/bash, not Python: the launcher runs a Python script"),
            ("launch", "broken.py", "python cannot run broken.py: invalid syntax (line 1); correct it"),
            ("launch", "binary", "python cannot run binary: source code string cannot contain null bytes")):
        with pytest.raises(SystemExit) as refused:
            cli.main([command, "--nproc", "2", script, "--output_dir", "out"])
        err = capsys.readouterr().err
        assert refused.value.code == 2 and not started and f"hf-sparse-cp {command}: error: {message}" in err, err
    (tmp_path / "train.py").write_text("import sys\n")
    with zipfile.ZipFile(tmp_path / "app.zip", "w") as archive:
        archive.writestr("__main__.py", "import sys\n")
    for script in ("train.py", "app.zip"):
        assert cli.main(["launch", "--nproc", "2", script]) == 0 and started[-1][-1] == script


def test_the_examples_model_folder_not_there_is_refused_before_the_processes_start(
        started, monkeypatch, tmp_path, capsys):
    """`hf-sparse-cp train --nproc 2 --model_name_or_path ./missing` started both processes (20-40 s here), each then
    refusing the folder as it loaded the model; the launcher refuses it once, before any starts."""
    from hf_sparse_cp import cli

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(SystemExit) as refused:
        cli.main(["train", "--nproc", "2", "--model_name_or_path", "./missing", "--max_steps", "1"])
    err = capsys.readouterr().err
    assert refused.value.code == 2 and not started, err
    assert "hf-sparse-cp train: error: --model_name_or_path ./missing: no such folder" in err, err
    # a Hub id is left to the processes (they load it)
    assert cli.main(["train", "--nproc", "2", "--model_name_or_path", "Qwen/Qwen2.5-0.5B", "--max_steps", "1"]) == 0


def test_a_module_that_is_not_there_is_refused_before_the_processes_start(started, monkeypatch, tmp_path, capsys):
    """`-m trl.scripts.stf` (its package installed, the module misspelled) passed the launcher's check of the top-level
    package and ended in each process in runpy's ImportError traceback and torchrun's failure report."""
    from hf_sparse_cp import cli

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(SystemExit) as refused:
        cli.main(["launch", "--nproc", "2", "-m", "hf_sparse_cp.examples.no_such_example", "--output_dir", "out"])
    err = capsys.readouterr().err
    assert refused.value.code == 2 and not started, err
    assert ("hf-sparse-cp launch: error: no module named 'hf_sparse_cp.examples.no_such_example' (of -m "
            "hf_sparse_cp.examples.no_such_example): check the name.") in err, err
    assert cli.main(["launch", "--nproc", "2", "-m", "hf_sparse_cp.examples.train_long_context"]) == 0 and started
    with pytest.raises(SystemExit) as refused:  # (in one process, or under a launcher of the user's)
        run(["-m", "hf_sparse_cp.examples.no_such_example"])
    err = capsys.readouterr().err
    assert refused.value.code == 2 and "python -m hf_sparse_cp.run: error: no module named " in err, err
    assert "Traceback" not in err, err


@pytest.mark.parametrize("rank, launches", [(None, True), ("0", False)])
def test_a_world_size_the_shell_exported_does_not_keep_nproc_from_launching(started, monkeypatch, tmp_path, rank,
                                                                              launches):
    """`hf-sparse-cp launch --nproc 2` from a shell that exported WORLD_SIZE (a cluster job script sets it before its
    torchrun line) ran the script here, alone, as if it were already one of a launched group: accelerate then failed
    on the unset MASTER_ADDR. A launched process has RANK too: there the command still runs in it."""
    from hf_sparse_cp import cli

    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("")
    monkeypatch.setenv("WORLD_SIZE", "2")
    if rank is None:
        monkeypatch.delenv("RANK", raising=False)
    else:
        monkeypatch.setenv("RANK", rank)
    assert cli.main(["launch", "--nproc", "2", "train.py"]) == 0
    assert [command[-3:] for command in started] == ([["-m", RUN_MODULE, "train.py"]] if launches else [])


@pytest.mark.parametrize("exported", ["1", "2"])
def test_a_world_size_the_shell_exported_is_a_process_alone_for_every_check(monkeypatch, tmp_path, exported):
    """The launcher took a WORLD_SIZE without RANK for a shell's (013dd209), where the flags' count of processes, the
    --fsdp check, the Trainer's launch check and the CP degrees' took it for a launched group's: WORLD_SIZE=1
    exported let --fsdp past its refusal (to fail later in transformers), WORLD_SIZE=2 passed --cp_size 2 in a process
    alone and refused a Trainer of one process as launched twice. One rule (`launch_env`) for all: it runs alone."""
    import types

    from hf_sparse_cp import SparseTrainingArguments
    from hf_sparse_cp.launch_env import in_launched_group
    from hf_sparse_cp.trainer.attach import check_launch
    from hf_sparse_cp.trainer.plugin_arguments import launch_world_size

    monkeypatch.setenv("WORLD_SIZE", exported)
    monkeypatch.delenv("RANK", raising=False)
    assert not in_launched_group() and launched_world_size() is None and launch_world_size() is None
    with pytest.raises(ValueError, match="this one runs alone"):
        check_launched([2], {"WORLD_SIZE": exported})
    with pytest.raises(ValueError, match="--fsdp shards the model over processes, and this one runs alone"):
        SparseTrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True, fsdp="full_shard")
    check_launch(types.SimpleNamespace(accelerator=types.SimpleNamespace(num_processes=1),
                                       args=types.SimpleNamespace(use_cpu=True)))  # (one process, as it runs)
    monkeypatch.setenv("RANK", "0")  # a launched group's process: its WORLD_SIZE counts
    assert launched_world_size() == launch_world_size() == int(exported)


@pytest.mark.parametrize("command", ["launch", "train"])
def test_ctrl_c_while_the_launcher_checks_the_run_ends_with_one_line(monkeypatch, capsys, command):
    """Ctrl-C in the seconds the launcher checks the run before it starts any process (its imports of torch and the
    Trainer's flags) ended in Python's KeyboardInterrupt traceback; it ends with one line and status 130, as a run
    interrupted later does."""
    from hf_sparse_cp import cli

    def interrupted(argv):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, f"_{command}", interrupted)
    assert cli.main([command, "--nproc", "2", "train.py"]) == 130
    assert capsys.readouterr().err == "hf-sparse-cp: interrupted by the user before the run started.\n"


def test_a_launched_process_interrupted_during_its_imports_ends_in_silence(monkeypatch, capsys):
    """Ctrl-C in the first seconds of a launched run reached each process inside the run's imports (torch,
    transformers), before `hf_sparse_cp.run` could end it in silence: each printed Python's KeyboardInterrupt
    traceback through them. The launched processes run `launch.worker`, which ends such a process with status 130
    and nothing printed (the launcher prints the one line)."""
    import types

    from hf_sparse_cp.launch import worker

    class Importing(types.ModuleType):
        def __getattr__(self, name):  # (the run's module, still importing when the signal comes)
            raise KeyboardInterrupt

    monkeypatch.setitem(sys.modules, "hf_sparse_cp.run", Importing("hf_sparse_cp.run"))
    with pytest.raises(SystemExit) as ended:
        worker.main()
    assert ended.value.code == 130 and capsys.readouterr() == ("", "")


def test_the_launchers_device_flags_parse_as_the_training_arguments_flags():
    """The launcher reads --use_cpu and --use_liger_kernel from a script's arguments before any process starts,
    without importing `TrainingArguments` (seconds): its own declaration of the two fields makes the same argparse
    options as transformers' (and TRL's config, which declares use_liger_kernel again)."""
    from trl import SFTConfig

    from hf_sparse_cp.launch.known_scripts import DeviceFlags

    def options(cls):
        return {action.dest: (action.option_strings, action.nargs, action.const, action.type, action.default)
                for action in HfArgumentParser(cls)._actions if action.dest in ("use_cpu", "use_liger_kernel")}

    assert options(DeviceFlags) == options(TrainingArguments) == options(SFTConfig)
    assert len(options(DeviceFlags)) == 2


def test_a_config_file_naming_a_variant_the_script_registers_is_read_after_the_script_path(
        started, cpu_launch_folder, capsys):
    """A plug-in's variant (here a SMET mode) is registered by the script, which the launcher does not run: a config
    file naming it among the script's arguments, which each process's parser reads once the script's imports ran,
    was refused by the launcher as a mode nobody registered, so no launch could use it (#50). The launcher leaves
    it to the processes; before the script's path, where every process reads it before the script runs too, it is
    refused naming where it goes."""
    from hf_sparse_cp import cli

    (cpu_launch_folder / "smet.yaml").write_text("mode: own_mode\ndensity: 0.5\n")
    (cpu_launch_folder / "sparse.yaml").write_text("budget_mode: own_budget\n")
    for config in (["--smet", "--smet_config", "smet.yaml"], ["--sparse_config", "sparse.yaml"]):
        assert cli.main(["launch", "--nproc", "2", "train.py", *config, "--use_cpu"]) == 0
        assert started[-1][-len(config) - 2:] == ["train.py", *config, "--use_cpu"]
    err = _refused(capsys, ["launch", "--nproc", "2", "--smet", "--smet_config", "smet.yaml", "train.py"], cli.main)
    assert ("mode='own_mode' (str) is not valid: use one of 'sparse_weights', 'sparse_update' (a mode of your own: "
            "hf_sparse_cp.smet.register_smet_mode(instance) first). (The flags before the script's path are read "
            "before the script runs: a flag or a config file naming a variant the script registers goes after its "
            "path") in err
    # a value of the wrong kind is no variant's name: refused before any process starts, as before
    (cpu_launch_folder / "smet.yaml").write_text("mode: [own_mode]\n")
    err = _refused(capsys, ["launch", "--nproc", "2", "train.py", "--smet", "--smet_config", "smet.yaml"], cli.main)
    assert "mode=['own_mode'] (list) is not valid" in err and "script's path" not in err


def test_a_config_file_giving_the_fields_of_a_budget_mode_the_script_registers_is_read_after_the_script_path(
        started, cpu_launch_folder, capsys):
    """A budget mode of one's own with fields: they go in the --sparse_config file (the mode has no flags), whose
    budget section the launcher read for its keys before its mode, refusing the file ('Unknown budget key
    'share'') among the script's arguments, where the script registers the mode, and naming no mode before its path
    (#50). The section's mode is read first: after the path the file is left to the processes, before it the
    refusal names the mode and where the file goes."""
    from hf_sparse_cp import cli

    (cpu_launch_folder / "sparse.yaml").write_text("budget:\n  mode: own_budget\n  share: 0.25\n")
    assert cli.main(["launch", "--nproc", "2", "train.py", "--sparse_config", "sparse.yaml", "--use_cpu"]) == 0
    assert started[-1][-4:] == ["train.py", "--sparse_config", "sparse.yaml", "--use_cpu"]
    err = _refused(capsys, ["launch", "--nproc", "2", "--sparse_config", "sparse.yaml", "train.py"], cli.main)
    assert "budget_mode='own_budget' (str) is not valid: use one of 'topk', 'topp', 'mass'" in err, err
    assert "goes after its path" in err and "Unknown budget key" not in err, err


OWN_RING_SCRIPT = textwrap.dedent("""
    from transformers import HfArgumentParser, TrainingArguments
    from hf_sparse_cp.distributed import register_cp_mode
    from hf_sparse_cp.distributed.modes.ring import RingMode

    class OwnRing(RingMode):
        name = "own_ring"
        help = "the ring, as a plug-in"

    register_cp_mode(OwnRing())
    (args,) = HfArgumentParser(TrainingArguments).parse_args_into_dataclasses()
    print("selected", args.context_parallel_config().mode.name)
""")


@pytest.mark.parametrize("own", [["--cp_mode", "own_ring"], ["--cp_mode=own_ring"],
                                 ["--sparse_budget_mode", "own_budget"], ["--sparse_attention_engine", "own_engine"],
                                 ["--smet", "--smet_mode", "own_smet"], ["--sparse_config", "sparse.yaml"],
                                 ["--smet", "--smet_config", "smet.yaml"]])
def test_a_variant_the_script_registers_leaves_the_launchers_cp_checks_on(started, cpu_launch_folder, capsys, own):
    """A flag or a settings file after the script's path naming a variant the script registers is left to the
    processes, and so was everything else the launcher checks before any process starts: `--nproc 2 ... --cp_size 3`
    started both processes, each refusing the degree (#50). The CP degrees are read without the settings that name
    variants and refused here; a hierarchical ring's nodes are checked too unless --cp_mode names the variant (how
    many ranks the ring spans is its mode's), and a degree the launch runs still starts it."""
    from hf_sparse_cp import cli

    (cpu_launch_folder / "smet.yaml").write_text("mode: own_smet\ndensity: 0.5\n")
    (cpu_launch_folder / "sparse.yaml").write_text("budget:\n  mode: own_budget\n  share: 0.25\n")
    err = _refused(capsys, ["launch", "--nproc", "2", "train.py", *own, "--cp_size", "3", "--use_cpu"], cli.main)
    assert "error: cp_size=3 does not divide the world size 2 (the number of processes)" in err and not started, err
    ring = ["--cp_size", "2", "--cp_ring", "hierarchical", "--cp_node_size", "3", "--use_cpu"]
    if own[0].startswith("--cp_mode"):
        assert cli.main(["launch", "--nproc", "2", "train.py", *own, *ring]) == 0
    else:
        err = _refused(capsys, ["launch", "--nproc", "2", "train.py", *own, *ring], cli.main)
        assert "--cp_node_size" in err and not started, err
    assert cli.main(["launch", "--nproc", "2", "train.py", *own, "--cp_size", "2", "--use_cpu"]) == 0
    assert started[-1][-len(own) - 3:] == [*own, "--cp_size", "2", "--use_cpu"]


def test_the_settings_files_the_launcher_reads_without_are_every_plugin_flag_of_a_file():
    """`launched_cp_degrees` leaves out the settings files (whose sections may name a variant): every plugin flag
    that takes a YAML/JSON file, so a new one cannot be missed."""
    from hf_sparse_cp.launch.command import SETTINGS_FILES

    files = [field.name for field in dataclasses.fields(PluginArguments)
             if "YAML/JSON file" in field.metadata.get("help", "")]
    assert sorted(files) == sorted(SETTINGS_FILES)


def test_a_flag_naming_a_variant_the_script_registers_is_read_after_the_script_path(
        started, cpu_launch_folder, monkeypatch, capsys):
    """`--cp_mode own_ring` (`--sparse_budget_mode`, `--sparse_attention_engine`, `--smet_mode`), own_ring registered
    by the script on import, was refused by the script's parser (HfArgumentParser's choices: the built-in modes), by
    the launcher before any process started, and before the script's path the launcher found no script at all (#50).
    After the path, the script's parser takes it, and the launcher, which cannot know it, leaves it to the processes
    (as a config file naming it); before the path, which every process reads before the script runs, it is refused
    naming where it goes."""
    from hf_sparse_cp import cli
    from hf_sparse_cp.distributed.modes import base as cp_mode_registry

    monkeypatch.setattr(cp_mode_registry._MODES, "_entries", dict(cp_mode_registry._MODES._entries))
    (cpu_launch_folder / "train.py").write_text(OWN_RING_SCRIPT)
    own = [["--cp_mode", "own_ring"], ["--sparse_budget_mode", "own_budget"],
           ["--sparse_attention_engine", "own_engine"], ["--smet", "--smet_mode", "own_smet"]]
    flags = ["--cp_size", "2", *(arg for given in own for arg in given), "--use_cpu"]
    assert cli.main(["launch", "--nproc", "2", "train.py", *flags]) == 0
    assert started[-1][-len(flags) - 1:] == ["train.py", *flags]
    for given in own:
        err = _refused(capsys, ["launch", "--nproc", "2", *given, "train.py"], cli.main)
        assert f"error: argument {given[-2]}/" in err and "goes after its path" in err, err
    err = _refused(capsys, ["--cp_mode", "own_ring", "train.py"])
    assert ("error: argument --cp_mode/--cp-mode: cp_mode='own_ring' (str) is not valid: use one of 'ring', "
            "'ulysses', 'hybrid' (a mode of your own: hf_sparse_cp.distributed.register_cp_mode(instance) first). "
            "(The flags before the script's path are read before the script runs: a flag or a config file naming a "
            "variant the script registers goes after its path, where the script's parser reads it.)") in err, err
    run(["train.py", "--output_dir", str(cpu_launch_folder / "out"), "--use_cpu", "--report_to", "none",
         "--cp_mode", "own_ring"])
    assert "selected own_ring" in capsys.readouterr().out
