"""The grammar of a launch command (`python -m hf_sparse_cp.run`, `hf-sparse-cp launch`): the plugin's flags, then
the script (a path, or `-m module`), then the script's own arguments. The script is found as python finds it on
its own command line: the first argument that is neither a flag nor a flag's value, which the plugin's argument
classes decide (so this module imports them, without the Trainer: `trainer.plugin_arguments`; the launcher's light
options are read before, in `processes.py`)."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import shlex
import sys
import zipfile
from collections.abc import Sequence
from typing import Any

import yaml
from transformers import HfArgumentParser

from hf_sparse_cp.config.files import did_you_mean
from hf_sparse_cp.config.registries import UnregisteredVariant, VariantFlag
from hf_sparse_cp.trainer.arguments import explicit_fields, help_groups
from hf_sparse_cp.trainer.plugin_arguments import COMMON_FLAGS, PluginArguments, parsing_for_cpu, parsing_typed_flags

from .known_scripts import source_words, training_flags

PROG = "python -m hf_sparse_cp.run"

# What a variant nobody registered among the flags before the script's path is told (named by a flag, or by a config
# file a flag gives): they parse before the script runs.
BEFORE_THE_SCRIPT = (" (The flags before the script's path are read before the script runs: a flag or a config file "
                     "naming a variant the script registers goes after its path, where the script's parser reads it.)")


class _Refused(Exception):
    """What argparse would print and exit with, raised instead (`_SplitParser`)."""


class _QuietParser(argparse.ArgumentParser):
    """A parser that raises `_Refused` where argparse would print and exit."""

    def error(self, message: str):
        raise _Refused(message)


class _SplitParser(_QuietParser, HfArgumentParser):
    """The plugin's flags, parsed without printing or exiting: which arguments they take (`split_command`). A flag's
    variant of the user's own (`--cp_mode own_ring`) is one argument like any: the script registers it, so its
    parser checks it (`registries.VariantFlag`)."""

    checks_variants = False

    def __init__(self, options: Sequence[str] = (), allow_abbrev: bool = True) -> None:
        super().__init__(PluginArguments, add_help=False, allow_abbrev=allow_abbrev)
        # (a help flag takes no value: the path after it is the script, whose run prints the help)
        self.add_argument("-h", "--help", action="store_true")
        for option in options:  # (options of one value each, e.g. the launcher's --nproc)
            self.add_argument(option)

    def takes(self, argv: Sequence[str]) -> bool:
        """Whether `argv` parses as flags of this parser, every argument taken."""
        try:
            return not self.parse_known_args(list(argv))[1]
        except _Refused:
            return False


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The description as written (its command lines), and every flag's default."""


def parse_plugin_flags(flags: Sequence[str], *, prog: str | None = None, usage: str | None = None,
                       description: str | None = None) -> PluginArguments:
    """The plugin flags given before the script path (help and errors as argparse's, as `prog`; `--help` lists the
    common flags first, after `description`)."""
    parser = HfArgumentParser(help_groups(PluginArguments, COMMON_FLAGS), prog=prog, usage=usage,
                              description=description, formatter_class=_HelpFormatter)
    parser.unregistered_note = BEFORE_THE_SCRIPT  # (a flag naming a variant nobody registered: `VariantFlag`)
    explicit = explicit_fields(parser, flags)
    try:
        common, other = parser.parse_args_into_dataclasses(list(flags))
        with parsing_typed_flags(explicit):
            plugin = PluginArguments(**vars(common), **vars(other))
    except (OSError, ValueError) as e:  # (a --sparse_config / --smet_config file that is not there names it)
        late = BEFORE_THE_SCRIPT if isinstance(e, UnregisteredVariant) else ""
        parser.error(f"{e}{late}{did_you_mean(parser, parser.parse_known_args(list(flags))[1])}")
    return plugin


def split_command(argv: Sequence[str], options: Sequence[str] = ()) -> tuple[list[str], str | None, bool, list[str]]:
    """(plugin flags, the script's path or module name, whether it is a module, the script's arguments).

    As python reads its own command line, the script is the first argument that is neither a flag nor a flag's value:
    `-m` and the module after it, or an argument the flags before it leave over (a path, with or without `.py`), where
    those flags parse on their own (the plugin's, and `options` of one value each: the launcher's). An argument
    that a flag before it takes as a value (`--sparse_config pattern.py`, `--smet true`) is that value; a `.py` path
    that a flag of several values would also take (`--smet_target_modules q k train.py`) is the script. Without
    a script: (every argument, None, whether the last is a bare `-m`, [])."""
    parser = _SplitParser(options)
    for i, arg in enumerate(argv):
        if (arg.startswith("-") and arg != "-m") or not parser.takes(argv[:i]):
            continue
        if arg == "-m":
            return (list(argv[:i]), argv[i + 1], True, list(argv[i + 2:])) if i + 1 < len(argv) else \
                (list(argv[:i]), None, True, [])
        if arg.endswith(".py") or not parser.takes(argv[:i + 1]):
            return list(argv[:i]), arg, False, list(argv[i + 1:])
    return list(argv), None, False, []


def trl_config(args: Sequence[str]) -> dict[str, Any]:
    """The settings of the YAML file that TRL's parser reads from `--config PATH` among `args`
    (`TrlParser.parse_args_and_config`: they become its flags' defaults, which the command line's beat), without its
    `env`; {} without one, or where the file cannot be read (the script's parser says why)."""
    args = list(args)
    at = args.index("--config") + 1 if "--config" in args else len(args)
    if at >= len(args):
        return {}
    try:
        with open(args[at]) as file:
            config = yaml.safe_load(file)
    except (OSError, yaml.YAMLError):
        return {}
    return {key: value for key, value in config.items() if key != "env"} if isinstance(config, dict) else {}


def script_max_steps(args: Sequence[str], reads_config: bool) -> int:
    """The `--max_steps` among a script's arguments `args` as its Trainer's parser reads it (`TrainingArguments`'
    field, spelled whole; the key of TRL's `--config` file where the script reads it, `reads_config`, the command
    line beating it); -1 (not known) without one, or where the parser alone can say (a value it refuses)."""
    parser = _QuietParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--max_steps", type=int, default=(trl_config(args) if reads_config else {}).get("max_steps"))
    try:
        steps = parser.parse_known_args(list(args))[0].max_steps
    except _Refused:
        return -1
    return steps if isinstance(steps, int) and not isinstance(steps, bool) else -1


def launched_flags(plugin: PluginArguments, args: Sequence[str], reads_config: bool) -> PluginArguments | None:
    """`plugin` (the flags before the script path) with the plugin's flags among `args` (the script's arguments,
    which the script's parser takes beside its own, over the keys of TRL's `--config` file, `trl_config`, where the
    script reads it, `reads_config`; the last one given wins), checked as each launched process checks them (on the
    CPU with the script's --use_cpu among `args`): raises their ValueError (or OSError: a --sparse_config file not
    there), naming the fix, before any process starts. Read as written, without the script's parser: only flags
    spelled whole (a prefix of one may be the script's own flag), the script's own arguments left alone; None where
    that parser alone can say (a value it refuses)."""
    read = _read_after_path(plugin, args, reads_config)
    return None if read is None else _applied(plugin, *read)


# The plugin's settings that name a file of settings (whose sections may name a variant: a budget or SMET mode).
SETTINGS_FILES = ("sparse_config", "smet_config")


def launched_cp_degrees(plugin: PluginArguments, args: Sequence[str], reads_config: bool
                        ) -> tuple[PluginArguments, bool] | None:
    """Where `launched_flags` meets a variant nobody registered yet (`UnregisteredVariant`: the script registers it,
    in each process, before its parser reads it): (the arguments as `launched_flags` reads them, less the settings
    given that may name one: a variant's own, `VariantFlag`, and a settings file, `SETTINGS_FILES`; whether
    --cp_mode was among them), from which the CP degrees the launch must run are read all the same (not the ring's
    nodes where --cp_mode names the variant: how many ranks a ring spans is its mode's). None where they cannot be
    read so (a setting left needs one left out: the processes say)."""
    read = _read_after_path(plugin, args, reads_config)
    if read is None:
        return None
    after, values, use_cpu = read
    may_name = {action.dest for action in _SplitParser()._actions if isinstance(action, VariantFlag)}
    left_out = after & (may_name | set(SETTINGS_FILES))
    try:
        return _applied(plugin, after - left_out, values, use_cpu), "cp_mode" in left_out
    except (OSError, ValueError):
        return None


def _read_after_path(plugin: PluginArguments, args: Sequence[str], reads_config: bool
                     ) -> tuple[set[str], dict[str, Any], bool] | None:
    """What `launched_flags` reads among `args`: (the plugin's settings given, by field name, their values, whether
    the script trains on the CPU); None where the script's parser alone can say."""
    parser = _SplitParser(allow_abbrev=False)
    # (--use_cpu read as the script's parser reads it only where given: that parser imports transformers' model code)
    cpu_given = any(arg.split("=")[0] == "--use_cpu" for arg in args)
    script = training_flags(plugin, args) if cpu_given else None
    in_file = {name: value for name, value in (trl_config(args) if reads_config else {}).items()
               if name in vars(parser.parse_args([]))}
    parser.set_defaults(**in_file)  # (as TRL's parser takes them)
    try:
        after = explicit_fields(parser, args) | set(in_file)
        values = vars(parser.parse_known_args(list(args))[0])
    except _Refused:  # (the script's parser refuses it, naming the flag)
        return None
    if cpu_given and script is None:  # (--use_cpu maybe)
        return None
    return after, values, bool(script and script.use_cpu)


def _applied(plugin: PluginArguments, after: set[str], values: dict[str, Any], use_cpu: bool) -> PluginArguments:
    """`plugin` with the settings `after` of `values`, checked as a process checks them (on the CPU with `use_cpu`)."""
    if not after and not use_cpu:
        return plugin
    explicit = set(plugin.explicit_flags or ()) | after
    with parsing_typed_flags(explicit), parsing_for_cpu(use_cpu):
        return dataclasses.replace(plugin, **{name: values[name] for name in after})


def mistyped_flags_refusal(args: Sequence[str], target: str, is_module: bool,
                           where: str = "after the script's path") -> str | None:
    """Why the launcher refuses the flags among `args` (the arguments of the script `target`, a path or with `is_module`
    a module's name; `where` they were given, for the message; a process checks its TRL --config file's keys so) that
    read as mistyped plugin flags: of the plugin's first words (`--sparse_*`, `--cp_*`, `--smet*`; dashes read as
    underscores) and close to one of its flags (`did_you_mean`), yet no flag that the script's parser,
    extended with the plugin's, takes as far as the launcher can know: no plugin flag nor the start of one (argparse's
    abbreviation), nor the start of a word of the script's source or of its folder's other modules (`source_words`: a
    flag of its own, declared there; no field of transformers' `TrainingArguments` or TRL's configs has the plugin's
    first words). None when there is none, or without the script's source: its parser alone knows its flags."""
    parser = _SplitParser()
    known = {option[2:].replace("-", "_") for action in parser._actions for option in action.option_strings}
    first_words = {field.name.partition("_")[0] for field in dataclasses.fields(PluginArguments) if field.init}
    close = []
    for arg in args:
        if arg == "--":  # (what follows is positional to argparse)
            break
        flag = arg.split("=", 1)[0]
        name = flag[2:].replace("-", "_")
        if (flag.startswith("--") and name.partition("_")[0] in first_words
                and not any(option.startswith(name) for option in known) and did_you_mean(parser, [flag])):
            close.append(flag)
    words = source_words(target, is_module) if close else None
    if words is None:
        return None
    mistyped = [flag for flag in close if not any(word.startswith(flag[2:].replace("-", "_")) for word in words)]
    if not mistyped:
        return None
    what = "is not a plugin flag, nor one" if len(mistyped) == 1 else "are not plugin flags, nor ones"
    return (f"{', '.join(mistyped)} {where} {what} that {os.path.basename(target)} declares"
            f"{did_you_mean(parser, mistyped)}{_own_budget_fields(mistyped, words)}")


def _own_budget_fields(flags: Sequence[str], words: set[str]) -> str:
    """What to do instead, where `flags` hold a `--sparse_X` whose X is a word of a script that registers a budget
    mode (`words`: its source's): likely a field of that mode, which is no flag (the pattern flags are the built-in
    modes' fields, built before any script runs), so the closest built-in flag alone would mislead."""
    fields = [flag for flag in flags if (name := flag[2:].replace("-", "_")).startswith("sparse_")
              and name[len("sparse_"):] in words]
    if not fields or "register_budget" not in words:
        return ""
    return (f" Or, if {', '.join(fields)} should set a field of the budget mode that the script registers: a "
            "budget mode of one's own has no flags, its fields go in the file given to --sparse_config (its "
            "'budget' section: the mode and its fields)")


def _trl_command(target: str, is_module: bool) -> bool:
    """Whether `target` is TRL's command line (`trl sft`: the `trl` console script, or `-m trl.cli[.main]`), which
    starts the training script it names in new processes (accelerate launch), where the plugin does not run."""
    if is_module:
        return target == "trl.cli" or target.startswith("trl.cli.")
    return os.path.basename(target) == "trl"


def _trl_script_line(command: str, flags: Sequence[str], args: Sequence[str]) -> str | None:
    """The command line that runs what `trl {command} ARGS` runs, with the plugin, where ARGS hold accelerate's
    options: TRL's command line hands accelerate launch the arguments its script's parser does not take (and its
    `--accelerate_config` as a --config_file), which that script's own parser would refuse (`--num_processes`: "did
    you mean --dataset_num_proc"). `flags` (the plugin's, before the script) and the plugin flags among ARGS stay with
    the script. None where ARGS hold none of accelerate's options, or TRL's split of them fails (the launched script
    then says why)."""
    try:
        from trl.cli.accelerate_config import resolve_accelerate_config_argument

        parser = importlib.import_module(f"trl.scripts.{command}").make_parser(prog=f"trl {command}")
        given, from_file = list(args), []
        if "--config" in given:  # (as TRL's parser reads it, without building its arguments: no checks of them)
            i = given.index("--config")
            with open(given[i + 1]) as file:
                config = yaml.safe_load(file)
            from_file = parser.set_defaults_with_config(**{k: v for k, v in config.items() if k != "env"})
            del given[i:i + 2]
        rest = parser.parse_known_args(given)[1]
        accelerate = _SplitParser(allow_abbrev=False).parse_known_args(rest)[1]  # (the plugin's flags: the script's)
        if not accelerate and not from_file:
            return None
        launch = resolve_accelerate_config_argument(list(from_file) + accelerate)
    except (ImportError, AttributeError, OSError, IndexError, TypeError, ValueError, SystemExit, _Refused):
        return None
    script, left = [], list(accelerate)
    for arg in args:  # (args less accelerate's, in order: TRL's `_subtract_subsequence`)
        if left and arg == left[0]:
            left.pop(0)
        else:
            script.append(arg)
    return shlex.join(["accelerate", "launch", *launch, "-m", "hf_sparse_cp.run", *flags, "-m",
                       f"trl.scripts.{command}", *script])


def _without(flags: Sequence[str], options: Sequence[str]) -> list[str]:
    """`flags` less the launcher's `options` (one value each, `--nproc 2` or `--nproc=2`), as argparse reads them."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    for option in options:
        parser.add_argument(option)
    return parser.parse_known_args(list(flags))[1]


def _not_python(path: str) -> str | None:
    """Why the file at `path` is no Python script that python would run (a shell script, a binary, a syntax error),
    as each launched process would fail on it with a SyntaxError under the launcher's traceback; None when it is one
    (or cannot be read here: python says why)."""
    if path.endswith(".pyc") or zipfile.is_zipfile(path):  # (python runs these too: bytecode, a zip's __main__.py)
        return None
    try:
        with open(path, "rb") as file:
            source = file.read()
        compile(source, path, "exec", dont_inherit=True)
    except OSError:
        return None
    except (SyntaxError, ValueError) as e:  # (ValueError: null bytes, a binary)
        first = source.split(b"\n", 1)[0].decode(errors="replace").strip()
        if first.startswith("#!") and "python" not in first:
            return (f"{path} is a script of {first[2:].strip()}, not Python: the launcher runs a Python script (a "
                    "Trainer or TRL script, or -m module) in each process; give the Python script it starts, with its "
                    "arguments")
        where = f"{e.msg}{f' (line {e.lineno})' if e.lineno else ''}" if isinstance(e, SyntaxError) else str(e)
        return f"python cannot run {path}: {where}; correct it (each launched process would end on it)"
    return None


def check_command(flags: Sequence[str], target: str | None, is_module: bool, options: Sequence[str] = (), *,
                  usage: str, prog: str, args: Sequence[str] = ()) -> None:
    """Exit as argparse ends a bad flag (`usage`, `prog: error: ...`, status 2) naming what the launcher expected
    when `split_command` found no script, the script's path is not a file or not Python (`_not_python`), the module's
    package is not installed, it is TRL's command line, which would train without the plugin, or a flag among its
    arguments `args` is a mistyped plugin flag (`mistyped_flags_refusal`; nothing to check with `--help`, which lists
    the flags)."""
    if {"-h", "--help"} & set(flags):
        return
    if target is not None and _trl_command(target, is_module):
        command = args[0] if args and not args[0].startswith("-") else "sft"
        why = (f"{target} (TRL's command line) starts its training script in new processes through accelerate "
               "launch, which the plugin does not reach: it would train without it. Run the script that "
               f"`trl {command}` starts instead, with the arguments after {command}: -m trl.scripts.{command}")
        if line := _trl_script_line(command, _without(flags, options), args[1:] if args[:1] == [command] else args):
            why += f"; as `trl {command}` would run it: `{line}`"
    elif target is None and is_module:
        why = "-m needs the module to run after it (e.g. -m trl.scripts.sft)"
    elif target is None:
        try:
            parser = _SplitParser(options)
            extra = parser.parse_known_args(list(flags))[1]
            why = (f"{extra[0]!r} is not a plugin flag (--sparse_*, --cp_*, --smet*), and no script comes before it: "
                   "give the script's path or -m module after the plugin flags, and the script's own flags after "
                   f"it{did_you_mean(parser, extra[:1])}" if extra else "name the script to run (a .py file, or -m "
                   "module)")
        except _Refused as e:
            why = f"{e}"
    elif not is_module and not os.path.isfile(target):
        why = f"can't open file {os.path.abspath(target)!r}: no such file"
    elif not is_module and (not_python := _not_python(target)):
        why = not_python
    elif is_module and importlib.util.find_spec(package := target.split(".")[0]) is None:
        # (the top-level package only: finding a submodule imports its parents, before the plugin's changes)
        why = f"no module named {package!r} (of -m {target}): install it, or check the name"
    elif refusal := mistyped_flags_refusal(args, target, is_module):
        # (else each launched process's parser refused it, the script's own argparse without naming the close flag)
        why = refusal
    else:
        return
    # as argparse ends a bad flag: the usage, then `prog: error: ...` on stderr, exit status 2
    sys.stderr.write(f"usage: {usage}\n{prog}: error: {why}{'' if why.endswith('?') else '.'}\n")
    sys.exit(2)
