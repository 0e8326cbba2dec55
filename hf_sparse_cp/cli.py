"""`hf-sparse-cp` command line: `launch` runs a stock Trainer or TRL script, unchanged, with the plugin
(`hf_sparse_cp.run` under torchrun or accelerate launch), `train` runs the long-context example (`--recipe NAME`
runs a shipped recipe), `recipes` lists the shipped recipes, `plot` draws a run's sparsity, `simulate` predicts CP
step time on a GPU cluster, `memory` how long a sequence fits on a GPU, `env` reports the setup."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys

EXAMPLE_MODULE = "hf_sparse_cp.examples.train_long_context"
RUN_MODULE = "hf_sparse_cp.run"
TORCHRUN = (sys.executable, "-m", "torch.distributed.run", "--standalone")
# What torchrun itself stops its workers on (its TORCHELASTIC_SIGNALS_TO_HANDLE default).
FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)


def _env() -> int:
    from hf_sparse_cp.env import PACKAGES, environment

    rows = {name: ("not installed" if name in PACKAGES else "-") if value is None else value
            for name, value in environment().items()}
    width = max(map(len, rows))
    for key, value in rows.items():
        print(f"{key:<{width}}  {value}")
    return 0


def _int_list(text: str) -> list[int]:
    """'0,3,5' -> [0, 3, 5] (an argparse type)."""
    try:
        return [int(item) for item in text.split(",") if item.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers, e.g. 0,3") from None


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


def _plot(args, parser: argparse.ArgumentParser) -> int:
    from hf_sparse_cp.reporting.plots import plot_run

    if args.max_length is not None and args.max_length < 2:
        parser.error(f"--max_length {args.max_length}: give at least 2 tokens.")
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
                                 "\"$(hf-sparse-cp recipes --path NAME)\"")):
        names = recipe_names(kind)
        print(f"{kind} ({how}):")
        width = max(map(len, names))
        for name in names:
            print(f"  {name:<{width}}  {recipe_summary(recipe_path(name))}")
    return 0


def run_forwarding_signals(command: list[str]) -> int:
    """Run `command` (torchrun) as a child and end with it: SIGINT, SIGTERM, SIGHUP or SIGQUIT sent to this
    process (Ctrl-C, `kill`, a scheduler) is passed on to the child's process group, and this returns
    only once the child is gone, with 128 + the signal number; otherwise with the child's exit status.

    torchrun, on the first such signal, passes it to its workers and waits for them (SIGKILL after 30 s).
    It runs in its own session so that a terminal's Ctrl-C reaches it once, through us: a second signal
    would interrupt its shutdown and orphan the workers, so only the first one is passed on.
    """
    received: list[int] = []
    child: subprocess.Popen | None = None
    forwarded = False

    def forward_first() -> None:
        nonlocal forwarded
        if child is not None and received and not forwarded:
            forwarded = True
            try:
                os.killpg(child.pid, received[0])
            except ProcessLookupError:  # already gone
                pass

    def on_signal(signum: int, _frame) -> None:
        received.append(signum)
        if len(received) == 1:
            os.write(2, f"hf-sparse-cp: got {signal.Signals(signum).name}, stopping the run...\n".encode())
        forward_first()

    previous = {sig: signal.signal(sig, on_signal) for sig in FORWARDED_SIGNALS}
    try:
        child = subprocess.Popen(command, start_new_session=True)
        forward_first()  # a signal that came while the child was starting
        returncode = child.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if received:
        return 128 + received[0]
    return 128 - returncode if returncode < 0 else returncode  # (killed by a signal: the shell's convention)


LAUNCH_OPTIONS = ("--nproc", "--config_file")  # `launch`'s own options, before the plugin's flags and the script
LAUNCH_USAGE = ("hf-sparse-cp launch [--nproc N | --config_file ACCELERATE_CONFIG] [PLUGIN FLAGS] (script.py | -m "
                "module) [SCRIPT ARGS]")


def _launch(argv: list[str]) -> int:
    """`hf-sparse-cp launch`: `hf_sparse_cp.run` in this process, under torchrun (`--nproc N`) or under accelerate
    launch (`--config_file`, a file or a shipped accelerate recipe's name). Its own options come before the
    script path, so that a script's own `--config_file` stays the script's."""
    from hf_sparse_cp.recipes import recipe_path
    from hf_sparse_cp.run import check_command, split_command
    from hf_sparse_cp.run import main as run

    flags, target, is_module, args = split_command(argv, LAUNCH_OPTIONS)
    check_command(flags, target, is_module, LAUNCH_OPTIONS, LAUNCH_USAGE, "hf-sparse-cp launch")
    launcher = argparse.ArgumentParser(prog="hf-sparse-cp launch", usage=LAUNCH_USAGE, add_help=False,
                                       allow_abbrev=False)
    launcher.add_argument(LAUNCH_OPTIONS[0], type=int, default=1)
    launcher.add_argument(LAUNCH_OPTIONS[1])
    options, plugin_flags = launcher.parse_known_args(flags)
    if {"-h", "--help"} & set(plugin_flags):
        print(f"usage: {LAUNCH_USAGE}\n\n--nproc N: N local processes (torchrun); --config_file: an accelerate "
              "config (a file, or a shipped recipe's name: `hf-sparse-cp recipes`) for accelerate launch. The "
              "plugin's flags:\n")
    if options.nproc < 1 or (options.nproc > 1 and options.config_file):
        launcher.error(f"--nproc {options.nproc}: give at least 1 process, and with --config_file none (the "
                       "accelerate config sets the processes).")
    run_args = [*plugin_flags, *(["-m"] if is_module else []), *([target] if target else []), *args]
    if options.config_file:
        try:
            config = str(recipe_path(options.config_file))
        except FileNotFoundError as e:
            launcher.error(str(e))
        command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", config, "-m", RUN_MODULE]
    elif options.nproc > 1 and "WORLD_SIZE" not in os.environ:
        command = [*TORCHRUN, f"--nproc_per_node={options.nproc}", "-m", RUN_MODULE]
    else:
        run(run_args)
        return 0
    return run_forwarding_signals([*command, *run_args])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["launch"]:  # (everything after the command is the launcher's and the script's, in order)
        return _launch(argv[1:])
    parser = argparse.ArgumentParser(prog="hf-sparse-cp", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser(
        "launch", add_help=False,
        help="Run a stock Trainer or TRL script, unchanged, with the plugin: `hf-sparse-cp launch --nproc 2 train.py "
        "ARGS --cp_size 2` (torchrun), `--config_file RECIPE` (accelerate launch); the plugin's flags parse beside the "
        "script's own (`hf-sparse-cp launch --help` lists them).")
    train = sub.add_parser(
        "train",
        help="Run the long-context Trainer example (tiny model, passkey data); extra flags go to the script "
        "(`--recipe NAME_OR_PATH` first reads a recipe's flags).",
        add_help=False,
    )
    train.add_argument("--nproc", type=int, default=1,
                       help="Local processes to launch (torchrun; gloo on CPU), e.g. --nproc 2 --cp_size 2. Ctrl-C "
                       "or `kill` of this command stops torchrun and its workers too.")
    plot = _add_plot_parser(sub)
    sub.add_parser("simulate", add_help=False,
                   help="Predict training-step time, tokens/s and speedup of context parallelism on a GPU cluster from "
                   "the ring's own plans (`hf-sparse-cp simulate --help` lists its flags; writes JSON and a plot).")
    sub.add_parser("memory", add_help=False,
                   help="Predict how long a sequence fits on a GPU for a model (with CP, FSDP, token tiles, offload) "
                   "and which terms its memory holds (`hf-sparse-cp memory --help` lists its flags).")
    recipes = sub.add_parser("recipes", help="List the shipped recipes (training flags and accelerate configs).")
    recipes.add_argument("--path", metavar="NAME", help="Print the file of this recipe (e.g. for accelerate launch "
                         "--config_file) instead of the list.")
    sub.add_parser("env", help="Print the versions and devices the plugin sees.")
    args, rest = parser.parse_known_args(argv)
    if args.command == "env":
        return _env()
    if args.command == "recipes":
        return _recipes(args, recipes)
    if args.command == "simulate":
        from hf_sparse_cp.simulator.simulate_cli import main as simulate

        try:
            simulate(rest, prog="hf-sparse-cp simulate")
        except ImportError as e:  # names the extra to install
            parser.error(str(e))
        return 0
    if args.command == "memory":
        from hf_sparse_cp.simulator.memory_cli import main as memory

        memory(rest, prog="hf-sparse-cp memory")
        return 0
    if args.command == "plot":
        if rest:
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        return _plot(args, plot)
    if args.nproc < 1:
        parser.error(f"--nproc {args.nproc}: give at least 1 process.")
    from hf_sparse_cp.backends import is_available

    if not is_available("datasets"):
        parser.error("`hf-sparse-cp train` makes its demo data with `datasets`: pip install 'hf-sparse-cp[demo]'.")
    if args.nproc > 1 and "WORLD_SIZE" not in os.environ:
        return run_forwarding_signals([*TORCHRUN, f"--nproc_per_node={args.nproc}", "-m", EXAMPLE_MODULE, *rest])
    from hf_sparse_cp.examples.train_long_context import main as train_main

    train_main(rest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
