"""Run a stock Trainer or TRL script, unchanged, with the plugin.

    python -m hf_sparse_cp.run [PLUGIN FLAGS] script.py [SCRIPT ARGS]
    python -m hf_sparse_cp.run [PLUGIN FLAGS] -m package.module [SCRIPT ARGS]
    torchrun --nproc_per_node 2 -m hf_sparse_cp.run script.py [SCRIPT ARGS] --cp_size 2
    accelerate launch --config_file RECIPE -m hf_sparse_cp.run script.py [SCRIPT ARGS]

The script runs as `__main__`, as `python script.py` (or `python -m package.module`) would run it: the same
`sys.argv` (its path, then its arguments), `__file__`, `sys.path[0]` (its folder) and working directory. While it
runs, a parser it builds over `TrainingArguments` (or `SFTConfig`, or its own subclass) takes the plugin's flags
beside its own, and a Trainer it builds (`Trainer`, `SFTTrainer`, its own subclass) trains with the plugin
(`hf_sparse_cp.launch.launched`); when it ends, transformers is stock again.

The script is the first argument that is neither a flag nor a flag's value, as python reads its command line
(`--sparse_config pattern.py script.py` runs `script.py`). Plugin flags (`--sparse_*`, `--cp_*`, `--smet*`) go
after the script path for a script that parses its arguments with `HfArgumentParser` (or TRL's `TrlParser`), or
before it: there they are defaults for the script's parser, and the settings of a `TrainingArguments` the script
builds in code. `--help` before the script path lists them, the common ones first.
"""

from __future__ import annotations

import importlib.util
import os
import runpy
import sys
from collections.abc import Sequence

from hf_sparse_cp.launch.command import PROG, check_command, parse_plugin_flags, split_command
from hf_sparse_cp.launch.interrupts import INTERRUPTED, end_interrupted
from hf_sparse_cp.launch.known_scripts import module_found, trl_trainers
from hf_sparse_cp.launch.refusals import command_name, end_refused, exit_refused
from hf_sparse_cp.trainer.arguments import is_flag_error

# The Trainer's modules (`launched`, `sparse_trainer`: transformers' Trainer, seconds of imports) are imported once the
# command is checked and its plugin flags parsed: `--help` and a refused command answer without them.
# (`launch.worker` imports them ahead, where a Ctrl-C during the imports ends the process in silence.)
HEAVY_MODULES = ("hf_sparse_cp.launch.launched", "hf_sparse_cp.trainer.sparse_trainer")

USAGE = f"{PROG} [PLUGIN FLAGS] (script.py | -m module) [SCRIPT ARGS]"


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


def script_name(target: str, is_module: bool) -> str:
    """The name a script's own errors go by (argparse's prog: its file's name, `sft.py` for `-m trl.scripts.sft`)."""
    spec = importlib.util.find_spec(target) if is_module else None
    return os.path.basename(spec.origin if spec is not None and spec.origin else target)


def _with_values(args: Sequence[str], flags: Sequence[str]) -> list[str]:
    """The plugin `flags` among `args` (as written) with the values that follow each, as the command to copy."""
    kept, taking = [], False
    for token in args:
        if token.startswith("--"):
            taking = token.split("=", 1)[0] in flags
        if taking:
            kept.append(token)
    return kept


def _explain_refused_plugin_flags(target: str, run, args: Sequence[str]) -> None:
    """Say why a script that parses its command line without `HfArgumentParser` (argparse of its own, as
    transformers' run_clm_no_trainer.py) exited refusing the plugin's flags after its path: its parser names them
    unrecognized, as if the plugin had no such flags. `run`: the `LaunchedRun`."""
    from hf_sparse_cp.launch.launched import plugin_flags_in

    stray = plugin_flags_in(args)
    if run.trainers_built or run.hf_parsers or not stray or os.environ.get("RANK", "0") != "0":
        return
    sys.stderr.write(
        f"{PROG}: note: {target} parses its command line with a parser of its own, not HfArgumentParser (or TRL's "
        f"TrlParser), so the plugin's flags after its path ({', '.join(stray)}) reached that "
        "parser, which does not know them. A script that builds its TrainingArguments in code and trains with a "
        f"Trainer takes them before its path ({PROG} {' '.join(_with_values(args, stray))} ... {target} ...); a "
        "training loop of its own (transformers' run_clm_no_trainer.py) runs without the plugin: drop them, or train "
        "it through the functional API (hf_sparse_cp.configure, enable_sparse_attention: docs/usage.md).\n")


def main(argv: Sequence[str] | None = None) -> None:
    """`python -m hf_sparse_cp.run`: see the module's doc."""
    flags, target, is_module, args = split_command(sys.argv[1:] if argv is None else argv)
    check_command(flags, target, is_module, usage=USAGE, prog=PROG, args=args)
    plugin = parse_plugin_flags(flags, prog=PROG, usage=USAGE, description=__doc__)  # (--help exits here)
    from hf_sparse_cp.launch.launched import flags_given, launched, no_trainer_warning
    from hf_sparse_cp.trainer.sparse_trainer import note_failing_exit

    with launched(plugin) as run:
        if is_module and not module_found(target):  # (else runpy's ImportError traceback, in every process)
            exit_refused(f"usage: {USAGE}\n{PROG}: error: no module named {target!r} (of -m {target}): check the "
                         "name.\n")
        run.trainers = trl_trainers(target, is_module)
        try:
            run_target(target, is_module, args)
        except SystemExit as e:
            if e.code not in (0, None):
                _explain_refused_plugin_flags(target, run, args)
                note_failing_exit(e.code)
            raise
        except (ValueError, TypeError, OSError) as e:
            if not is_flag_error(e):  # (a bug keeps its traceback)
                raise
            # a setting refused against the script's model, data or Trainer, naming the fix: as a bad flag, once
            end_refused(command_name(script_name(target, is_module)), e)
        except KeyboardInterrupt:  # (Ctrl-C, which reaches every rank: one line says so, not a traceback per rank)
            note_failing_exit(INTERRUPTED)  # (a rank the signal reached alone must not wait at the exit barrier)
            end_interrupted(run.output_dirs)
    if not run.trainers_built and not run.told_no_trainer and os.environ.get("RANK", "0") == "0":
        sys.stderr.write(f"{PROG}: {no_trainer_warning(target, flags_given(plugin, args), ended=True)}\n")

if __name__ == "__main__":
    main()
