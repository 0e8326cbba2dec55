"""Run a stock Trainer or TRL script, unchanged, with the plugin.

    python -m hf_sparse_cp.run [PLUGIN FLAGS] script.py [SCRIPT ARGS]
    python -m hf_sparse_cp.run [PLUGIN FLAGS] -m package.module [SCRIPT ARGS]
    torchrun --nproc_per_node 2 -m hf_sparse_cp.run script.py [SCRIPT ARGS] --cp_size 2
    accelerate launch --config_file RECIPE -m hf_sparse_cp.run script.py [SCRIPT ARGS]

The script runs as `__main__`, as `python script.py` (or `python -m package.module`) would run it: the same
`sys.argv` (its path, then its arguments), `__file__`, `sys.path[0]` (its folder) and working directory. While it
runs, a parser it builds over `TrainingArguments` (or `SFTConfig`, or its own subclass) takes the plugin's flags
beside its own, and a Trainer it builds (`Trainer`, `SFTTrainer`, its own subclass) trains with the plugin
(`hf_sparse_cp.trainer.launched`); when it ends, transformers is stock again.

The script is the first argument that is neither a flag nor a flag's value, as python reads its command line
(`--sparse_config pattern.py script.py` runs `script.py`). Plugin flags (`--sparse_*`, `--cp_*`, `--smet*`) go
after the script path for a script that parses its arguments with `HfArgumentParser` (or TRL's `TrlParser`), or
before it: there they are defaults for the script's parser, and the settings of a `TrainingArguments` the script
builds in code. `--help` before the script path lists them, the common ones first.
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys
from collections.abc import Sequence

from transformers import HfArgumentParser

from hf_sparse_cp.trainer.arguments import explicit_fields, help_groups
from hf_sparse_cp.trainer.launched import launched
from hf_sparse_cp.trainer.sparse_trainer import COMMON_FLAGS, PluginArguments

PROG = "python -m hf_sparse_cp.run"
USAGE = f"{PROG} [PLUGIN FLAGS] (script.py | -m module) [SCRIPT ARGS]"


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The description as written (its command lines), and every flag's default."""


class _Refused(Exception):
    """What argparse would print and exit with, raised instead (`_SplitParser`)."""


class _SplitParser(HfArgumentParser):
    """The plugin's flags, parsed without printing or exiting: which arguments they take (`split_command`)."""

    def __init__(self, options: Sequence[str] = ()) -> None:
        super().__init__(PluginArguments, add_help=False)
        for option in options:  # (options of one value each, e.g. the launcher's --nproc)
            self.add_argument(option)

    def error(self, message: str):
        raise _Refused(message)

    def takes(self, argv: Sequence[str]) -> bool:
        """Whether `argv` parses as flags of this parser, every argument taken."""
        try:
            return not self.parse_known_args(list(argv))[1]
        except _Refused:
            return False


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


def check_command(flags: Sequence[str], target: str | None, is_module: bool, options: Sequence[str] = (),
                  usage: str = USAGE, prog: str = PROG) -> None:
    """Exit naming what the launcher expected when `split_command` found no script, or the script's path is not a
    file (nothing to check with `--help`, which lists the flags)."""
    if {"-h", "--help"} & set(flags):
        return
    if target is None and is_module:
        why = "-m needs the module to run after it (e.g. -m trl.scripts.sft)"
    elif target is None:
        try:
            extra = _SplitParser(options).parse_known_args(list(flags))[1]
            why = (f"{extra[0]!r} is not a plugin flag (--sparse_*, --cp_*, --smet*), and no script comes before it: "
                   "give the script's path or -m module after the plugin flags, and the script's own flags after "
                   "it") if extra else "name the script to run (a .py file, or -m module)"
        except _Refused as e:
            why = f"{e}"
    elif not is_module and not os.path.isfile(target):
        sys.exit(f"{prog}: can't open file {os.path.abspath(target)!r}: no such file.")
    else:
        return
    sys.exit(f"usage: {usage}\n{prog}: error: {why}.")


def parse_plugin_flags(flags: Sequence[str]) -> PluginArguments:
    """The plugin flags given before the script path (help and errors as argparse's)."""
    parser = HfArgumentParser(help_groups(PluginArguments, COMMON_FLAGS), prog=PROG, usage=USAGE,
                              description=__doc__, formatter_class=_HelpFormatter)  # (--help: the common flags first)
    try:
        common, other = parser.parse_args_into_dataclasses(list(flags))
        plugin = PluginArguments(**vars(common), **vars(other))
    except (OSError, ValueError) as e:  # (a --sparse_config / --smet_config file that is not there names it)
        parser.error(str(e))
    plugin.explicit_flags = explicit_fields(parser, flags)
    return plugin


def run_target(target: str, is_module: bool, args: Sequence[str]) -> None:
    """Run `target` (a script's path, or a module's name) as `__main__` with `args`, as python would run it;
    `sys.argv` and `sys.path[0]` are restored afterwards."""
    saved_argv, saved_path = sys.argv[:], sys.path[0]
    sys.argv[:] = [target, *args]
    try:
        if is_module:
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.path[0] = os.path.dirname(os.path.abspath(target))
            runpy.run_path(os.path.abspath(target), run_name="__main__")  # (`__file__` absolute, as python sets it)
    finally:
        sys.argv[:] = saved_argv
        sys.path[0] = saved_path


def main(argv: Sequence[str] | None = None) -> None:
    """`python -m hf_sparse_cp.run`: see the module's doc."""
    flags, target, is_module, args = split_command(sys.argv[1:] if argv is None else argv)
    check_command(flags, target, is_module)
    plugin = parse_plugin_flags(flags)  # (--help exits here)
    with launched(plugin):
        run_target(target, is_module, args)


if __name__ == "__main__":
    main()
