"""`hf-sparse-cp` command line: `launch` runs a stock Trainer or TRL script, unchanged, with the plugin
(`hf_sparse_cp.run` in this process, under torchrun or accelerate launch), `train` runs the long-context example
through the same launcher (`--recipe NAME` runs a shipped recipe), `recipes` lists the shipped recipes, `plot`
draws a run's sparsity, `simulate` predicts CP step time on a GPU cluster, `memory` how long a sequence fits on a
GPU, `env` reports the setup."""

from __future__ import annotations

import argparse
import os
import sys
import textwrap
from typing import NoReturn

from hf_sparse_cp.version import __version__

# Commands import what they need when they run: `--help`, `--version` and `recipes` import neither torch nor
# transformers (tests/integration/test_cli_imports.py).
EXAMPLE_MODULE = "hf_sparse_cp.examples.train_long_context"


def _env() -> int:
    from hf_sparse_cp.env import PACKAGES, environment

    rows = {name: ("not installed" if name in PACKAGES else "-") if value is None else value
            for name, value in environment().items()}
    width = max(map(len, rows))
    for key, value in rows.items():
        print(f"{key:<{width}}  {value}")
    return 0


def _int_list(text: str) -> list[int]:
    """'0,3,5' -> [0, 3, 5] (an argparse type). An empty item ('0,,3', a trailing comma, '') is refused: it was
    dropped, and an empty list drew the default layers."""
    try:
        return [int(item) for item in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers, e.g. 0,3 (no empty "
                                         "item)") from None


def _add_plot_parser(sub) -> argparse.ArgumentParser:
    plot = sub.add_parser(
        "plot",
        help="Draw a run's sparsity as PNGs: the kept fraction per layer over training (from trainer_state.json) "
        "and the block layouts of chosen layers/heads for one input. Needs pip install 'hf-sparse-cp[plot]'.",
    )
    plot.add_argument("run_dir", help="The run's output or checkpoint directory (its trainer_state.json, or that of "
                      "its last checkpoint).")
    plot.add_argument("--out_dir", help="Where the PNGs go (default: RUN_DIR, beside the model card).")
    plot.add_argument("--only", choices=("kept_fraction", "layouts"), help="Draw one of the two pictures.")
    plot.add_argument("--model", help="Model for the layouts, a directory or hub id (default: the one saved in "
                      "RUN_DIR or its last checkpoint).")
    plot.add_argument("--text_file", help="Draw the layouts for this text (default: a synthetic passkey sample).")
    plot.add_argument("--max_length", type=int, help="Tokens of the input (default: the whole text; for the passkey "
                      "sample 4096, or the pattern's min_seq_len if longer).")
    plot.add_argument("--layers", type=_int_list, help="Layers to draw, e.g. 0,5,11 (default: up to 4, evenly "
                      "spaced).")
    plot.add_argument("--heads", type=_int_list, help="Query heads to draw, e.g. 0,7 (default: up to 4, evenly "
                      "spaced).")
    plot.add_argument("--sparse_config", help="Draw the layouts of this YAML/JSON SparseAttentionConfig instead of "
                      "the model's own.")
    return plot


# The plot flags that choose what the layouts draw (`--only kept_fraction` draws none)
LAYOUT_FLAGS = ("model", "text_file", "max_length", "layers", "heads", "sparse_config")


def _check_plot_flags(args, parser: argparse.ArgumentParser) -> None:
    """Refuse, before anything loads, plot flags that would be ignored or fail only after the model's forward: a
    layout flag with `--only kept_fraction`, an empty path, a text file or an output folder that is not there to
    read or write, a passkey sample longer than this machine builds."""
    from pathlib import Path

    given = [f"--{name}" for name in LAYOUT_FLAGS if getattr(args, name) is not None]
    if args.only == "kept_fraction" and given:
        parser.error(f"{', '.join(given)} {'choose' if len(given) > 1 else 'chooses'} what the block layouts draw, "
                     f"and --only kept_fraction draws none: drop {'them' if len(given) > 1 else 'it'}, or drop --only.")
    for flag in ("--out_dir", "--model", "--text_file", "--sparse_config"):
        value = getattr(args, flag[2:])
        if value is not None and not value.strip():
            parser.error(f"{flag} {value!r} is empty (an unset shell variable?): give its value, or drop the flag.")
    if args.max_length is not None and args.max_length < 2:
        parser.error(f"--max_length {args.max_length}: give at least 2 tokens.")
    if args.model is not None and args.model.strip() and not Path(args.model).is_dir():
        # (#50: a missing folder failed in transformers' loading with huggingface_hub's rule for repo ids, naming
        # neither the flag nor the fix)
        # (a name of a Hub id's shape is refused where the Hub cannot provide it: `load_sparse_model`)
        from huggingface_hub.errors import HFValidationError
        from huggingface_hub.utils import validate_repo_id

        from hf_sparse_cp.reporting.plots import missing_model

        try:
            validate_repo_id(args.model)
        except HFValidationError:
            parser.error(missing_model(args.model, "nor a Hub id (owner/name)"))
    if args.text_file is not None and not Path(args.text_file).is_file():
        parser.error(f"--text_file {args.text_file}: " + ("a folder, not a text file" if Path(args.text_file).is_dir()
                                                           else "no such file") + "; give the file of a text.")
    if args.text_file is not None:
        try:  # (read before the model loads, as the drawing reads it)
            Path(args.text_file).read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            parser.error(f"--text_file {args.text_file}: not UTF-8 text (a binary file?); give the file of a text.")
    if args.text_file is None and args.max_length is not None and args.only != "kept_fraction":
        try:
            from hf_sparse_cp.examples.passkey import check_buildable  # (needs datasets: `plot_run` names the extra)

            check_buildable(args.max_length, "--max_length", "draw the layouts of a text of yours (--text_file)")
        except ImportError:
            pass
        except ValueError as e:
            parser.error(f"--max_length {args.max_length}: {e}")
    if args.out_dir is not None:  # (made after the drawing: a file there ended the command then, naming no flag)
        out = Path(args.out_dir).absolute()
        existing = next(folder for folder in (out, *out.parents) if folder.exists())
        if not existing.is_dir():
            parser.error(f"--out_dir {args.out_dir}: {existing} is a file, not a folder; give a folder (created when "
                         "missing).")


def _plot(args, parser: argparse.ArgumentParser) -> int:
    from hf_sparse_cp.reporting.plots import plot_run

    _check_plot_flags(args, parser)
    try:
        figures = plot_run(args.run_dir, args.out_dir, only=args.only, model=args.model, text_file=args.text_file,
                           seq_len=args.max_length, layers=args.layers, heads=args.heads,
                           sparse_config=args.sparse_config)
    except (ImportError, OSError, ValueError) as e:  # each names its fix
        parser.error(str(e))
    for path in figures:
        print(f"wrote {path}")
    return 0


def _recipes(args, parser: argparse.ArgumentParser) -> int:
    from hf_sparse_cp.recipes import KINDS, recipe_names, recipe_path, recipe_summary

    if args.path is not None:
        try:
            print(recipe_path(args.path))
        except FileNotFoundError as e:
            parser.error(str(e))
        return 0
    for kind, how in zip(KINDS, ("hf-sparse-cp train --recipe NAME", "accelerate launch --config_file "
                                 "\"$(hf-sparse-cp recipes --path NAME)\"", "--sparse_config NAME")):
        names = recipe_names(kind)
        print(f"{kind} ({how}):")
        width = max(map(len, names)) + 4
        for name in names:  # (each summary wrapped beside its name)
            print(textwrap.fill(recipe_summary(recipe_path(name)), 120, initial_indent=f"  {name:<{width - 2}}",
                                subsequent_indent=" " * width, break_on_hyphens=False))
    return 0


LAUNCH_USAGE = ("hf-sparse-cp launch [--nproc N | --config_file ACCELERATE_CONFIG] [PLUGIN FLAGS] (script.py | -m "
                "module) [SCRIPT ARGS]")
TRAIN_USAGE = "hf-sparse-cp train [--nproc N | --config_file ACCELERATE_CONFIG] [--recipe NAME_OR_PATH] [FLAGS]"


def _run_here(run_args: list[str]) -> None:
    """`python -m hf_sparse_cp.run RUN_ARGS` in this process (imported only when it runs here)."""
    from hf_sparse_cp.run import main

    main(run_args)


def _launch(argv: list[str], command: str = "launch") -> int:
    """`hf-sparse-cp launch`: a stock script with the plugin (`hf_sparse_cp.run`). The launcher's options come before
    the script path, so that a script's own `--config_file` stays the script's; the script is checked before any
    process starts. Its refusals name `hf-sparse-cp COMMAND`, the command typed (`train` given a script runs this)."""
    from hf_sparse_cp.launch.processes import (
        LAUNCHER_OPTIONS,
        OPTIONS_HELP,
        launch,
        launched_processes,
        launcher_options,
        leading_options,
        parse_launcher_options,
        refuse_unlaunchable,
        refuse_unrunnable_config,
    )

    prog = f"hf-sparse-cp {command}"
    usage = LAUNCH_USAGE.replace("hf-sparse-cp launch", prog, 1)
    parser = launcher_options(prog, usage)
    leading = leading_options(argv)
    given, _ = parse_launcher_options(parser, leading)  # (a bad process count, named before the slow imports)
    from hf_sparse_cp.launch.command import check_command, launched_flags, split_command

    flags, target, is_module, args = split_command(argv, LAUNCHER_OPTIONS)
    check_command(flags, target, is_module, LAUNCHER_OPTIONS, usage=usage, prog=prog, args=args)
    options, plugin_flags = parse_launcher_options(parser, flags[len(leading):], given)
    run_args = [*plugin_flags, *(["-m"] if is_module else []), *([target] if target else []), *args]
    if {"-h", "--help"} & set(plugin_flags):  # once, here, not once per launched process
        print(f"usage: {usage}\n\n{OPTIONS_HELP} The plugin's flags:\n")
        _run_here(run_args)
        return 0
    processes = launched_processes(options)
    if processes is not None and {"-h", "--help"} & set(args):
        # the script's help, once, here: the script runs up to its parser, which prints it and exits (a Trainer it
        # builds before is refused, not trained in this one process)
        from hf_sparse_cp.trainer.plugin_arguments import parsing_for_launch

        with parsing_for_launch():
            _run_here(run_args)
        return 0
    if processes is not None:
        # what each process would refuse, once, before any starts (else each prints it, then the launcher its failure):
        # the flags before the script path, which each parses alone, those among the script's arguments, which the
        # script's parser takes, a CP degree the processes cannot run
        from hf_sparse_cp.config.registries import UnregisteredVariant
        from hf_sparse_cp.launch.command import launched_cp_degrees, parse_plugin_flags, script_max_steps
        from hf_sparse_cp.launch.known_scripts import module_found, reads_trl_config, script_refusal
        from hf_sparse_cp.trainer.plugin_arguments import parsing_for_launch

        with parsing_for_launch(processes):  # (as one of the processes, which say what the flags do themselves)
            plugin = parse_plugin_flags(plugin_flags, prog=prog, usage=usage)
            reads_config, mode_unknown, complete = reads_trl_config(target, is_module), False, True
            try:
                run_flags = launched_flags(plugin, args, reads_config)
            except UnregisteredVariant:
                complete = False  # (the settings that may name the variant left out: the pattern is not known)
                # a flag or a config file among the script's arguments naming a variant of the user's own, which the
                # script registers in each process before its parser reads them: the processes check it (as they check
                # what only the script's parser can say); the CP degrees are checked here all the same
                run_flags, mode_unknown = launched_cp_degrees(plugin, args, reads_config) or (None, False)
            except (OSError, ValueError) as e:
                parser.error(str(e))
        if run_flags is not None:
            refuse_unlaunchable(parser, run_flags, processes, options.accelerate_config, ring=not mode_unknown)
        if run_flags is not None and complete:
            # a --cp_schedule's stages as the flags alone decide them (their fields, whole blocks per CP rank, the
            # starts against the script's --max_steps), which each process refused only once it had built its data
            # and model (the degrees against the processes first: what follows from a degree is no fix)
            try:
                run_flags.check_schedule(script_max_steps(args, reads_config))
            except ValueError as e:
                parser.error(str(e))
        # and what the script's source says it builds: a TRL trainer CP or this machine cannot run
        if is_module and not module_found(target):  # (`hf_sparse_cp.run` refuses it too, once per launch)
            parser.error(f"no module named {target!r} (of -m {target}): check the name.")
        cp_size = max(cp_size for _, cp_size in run_flags.cp_degrees()) if run_flags is not None else 1
        refusal = script_refusal(target, is_module, cp_size, plugin, args)
        if refusal is not None:
            parser.error(refusal)
    refuse_unrunnable_config(parser, options)
    return launch(options, run_args, _run_here)


def _train(argv: list[str]) -> int:
    """`hf-sparse-cp train`: the long-context example (`hf_sparse_cp.examples.train_long_context`) through the same
    launcher as `launch`; the launcher's options may come anywhere, every other argument is the example's. A
    script's path (a `.py` file, or any file: an executable script) or `-m module` where `launch` takes one runs that
    script instead, as `launch` runs it (the example takes no such argument: it ended in the example's 'unrecognized
    arguments: run_clm.py'); a path that is no file is refused as no such script; a recipe's YAML/JSON file first
    stays the example's."""
    from hf_sparse_cp.launch.command import split_command
    from hf_sparse_cp.launch.processes import LAUNCHER_OPTIONS
    from hf_sparse_cp.recipes import RECIPE_SUFFIXES

    _, target, is_module, _ = split_command(argv, LAUNCHER_OPTIONS)
    if is_module or (target or "").endswith(".py") or (target is not None and os.path.isfile(target)
                                                        and not target.endswith(RECIPE_SUFFIXES)):
        return _launch(argv, "train")
    if target is not None and not target.endswith(RECIPE_SUFFIXES):
        sys.stderr.write(f"usage: {TRAIN_USAGE}\nhf-sparse-cp train: error: no such script: {target!r} "
                         f"({os.path.abspath(target)} is not a file). `hf-sparse-cp train` runs the long-context "
                         "example, which takes flags only, or the script at a file's path (or -m module) with its "
                         "arguments, as `hf-sparse-cp launch` does.\n")
        return 2
    from hf_sparse_cp.backends import is_available
    from hf_sparse_cp.launch.processes import (
        launch,
        launched_processes,
        launcher_options,
        parse_launcher_options,
        refuse_unlaunchable,
        refuse_unrunnable_config,
    )
    from hf_sparse_cp.launch.refusals import running_as

    parser = launcher_options("hf-sparse-cp train", TRAIN_USAGE)
    options, rest = parse_launcher_options(parser, argv)
    if not is_available("datasets"):
        parser.error("`hf-sparse-cp train` makes its demo data with `datasets`: pip install 'hf-sparse-cp[demo]'.")
    processes = launched_processes(options)
    with running_as("hf-sparse-cp train"):  # (the example's help and refusals, here and in each process)
        if processes is not None:
            # the example's flags as each process parses them first (its refusals, and --help, once, before any
            # starts), a CP degree the processes cannot run (a recipe's too) and a model they cannot load
            from hf_sparse_cp.examples import train_long_context as example
            from hf_sparse_cp.trainer.plugin_arguments import parsing_for_launch

            with parsing_for_launch(processes):
                parsed = example.parse_args(rest)
            refuse_unlaunchable(parser, parsed.training, processes, options.accelerate_config)
            if parsed.script.model_name_or_path:  # (each process checks it as it loads the model: a folder not there)
                try:
                    example.check_model_source(parsed.script.model_name_or_path)
                except ValueError as e:
                    parser.error(str(e))
            refuse_unrunnable_config(parser, options)
        return launch(options, ["-m", EXAMPLE_MODULE, *rest], _run_here)


def main(argv: list[str] | None = None) -> int:
    """Run `hf-sparse-cp ARGV` (default: this process's command line, `sys.argv[1:]`) and return its exit status, for
    a Python caller to go on after it (the console script ends with it: `command_line`). Bad arguments, --help and
    --version end as argparse ends them, raising SystemExit (status 2 or 0)."""
    return _command(sys.argv[1:] if argv is None else argv, from_command_line=False)


def command_line() -> NoReturn:
    """The `hf-sparse-cp` console script (setup.cfg) and `python -m hf_sparse_cp.cli`: the command on this process's
    command line, ended with its status. The process is the command's own, so a launcher whose run is over ends without
    the interpreter's teardown (`refusals.end_launcher`), and `simulate` runs again with the allocator's settings."""
    sys.exit(_command(sys.argv[1:], from_command_line=True))


def _command(argv: list[str], from_command_line: bool) -> int:
    # (everything after these commands is the launcher's and the script's, in order)
    if argv[:1] in (["launch"], ["train"]):
        try:
            status = (_launch if argv[0] == "launch" else _train)(argv[1:])
        except KeyboardInterrupt:  # (Ctrl-C while the launcher checks the run: seconds of imports, before it starts)
            from hf_sparse_cp.launch.interrupts import INTERRUPTED

            sys.stderr.write("hf-sparse-cp: interrupted by the user before the run started.\n")
            return INTERRUPTED
        from hf_sparse_cp.launch.processes import launched_a_child
        from hf_sparse_cp.launch.refusals import end_launcher

        if from_command_line and launched_a_child():  # (the run is over: nothing is left in this process to tear down)
            end_launcher(status)
        return status
    parser = argparse.ArgumentParser(prog="hf-sparse-cp", description=__doc__)
    parser.add_argument("--version", action="version", version=f"hf-sparse-cp {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser(
        "launch", add_help=False,
        help="Run a stock Trainer or TRL script, unchanged, with the plugin: `hf-sparse-cp launch --nproc 2 train.py "
        "ARGS --cp_size 2` (torchrun), `--config_file RECIPE` (accelerate launch); the plugin's flags parse beside the "
        "script's own (`hf-sparse-cp launch --help` lists them).")
    sub.add_parser(
        "train", add_help=False,
        help="Run the long-context Trainer example (tiny model, passkey data) through the same launcher: `--nproc N` "
        "(torchrun) or `--config_file RECIPE` (accelerate launch); every other flag is the example's "
        "(`--recipe NAME_OR_PATH` first reads a recipe's flags; `hf-sparse-cp train --help` lists them); given a "
        "script path or -m module, it runs that script as `launch` does.")
    plot = _add_plot_parser(sub)
    sub.add_parser("simulate", add_help=False,
                   help="Predict training-step time, tokens/s and speedup of context parallelism on a GPU cluster from "
                   "the ring's own plans, for a preset or any config.json (`hf-sparse-cp simulate --help` lists its "
                   "flags; writes JSON, and a plot where matplotlib is installed).")
    sub.add_parser("memory", add_help=False,
                   help="Predict how long a sequence fits on a GPU for a preset or any config.json (with CP, FSDP, "
                   "token tiles, offload) and which terms its memory holds (`hf-sparse-cp memory --help` lists its "
                   "flags).")
    recipes = sub.add_parser("recipes", help="List the shipped recipes (training flags and accelerate configs).")
    recipes.add_argument("--path", metavar="NAME", help="Print the file of this recipe (e.g. for accelerate launch "
                         "--config_file) instead of the list.")
    env = sub.add_parser("env", help="Print the versions and devices the plugin sees.")
    args, rest = parser.parse_known_args(argv)
    own_parser = {"env": env, "recipes": recipes, "plot": plot}.get(args.command)
    if own_parser is not None and rest:  # (named by the command's own usage, with the flags close to a mistyped one)
        from hf_sparse_cp.config.files import did_you_mean

        own_parser.error(f"unrecognized arguments: {' '.join(rest)}{did_you_mean(own_parser, rest)}")
    if args.command == "env":
        return _env()
    if args.command == "recipes":
        return _recipes(args, recipes)
    if args.command == "plot":
        return _plot(args, plot)
    if args.command == "simulate":
        if from_command_line and sys.platform == "linux" and "GLIBC_TUNABLES" not in os.environ:
            # (a process reads the allocator's settings at start: run the command again in one that recycles memory)
            from hf_sparse_cp.backends import RECYCLING_MALLOC

            os.execve(sys.executable, [sys.executable, "-m", "hf_sparse_cp.cli", *argv],
                      {**os.environ, "GLIBC_TUNABLES": RECYCLING_MALLOC})
        from hf_sparse_cp.simulator.simulate_cli import main as simulate

        try:
            simulate(rest, prog="hf-sparse-cp simulate")
        except ImportError as e:  # names the extra to install
            parser.error(str(e))
        return 0
    from hf_sparse_cp.simulator.memory_cli import main as memory

    memory(rest, prog="hf-sparse-cp memory")
    return 0


if __name__ == "__main__":
    command_line()
