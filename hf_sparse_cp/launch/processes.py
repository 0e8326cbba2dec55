"""The one launch path of the command line: `hf_sparse_cp.run` with a script's arguments, run in this process,
under torchrun (`--nproc N`, local processes) or under accelerate launch (`--config_file`, a file or a shipped
accelerate recipe), and ended with the child when a signal stops this process.

`hf-sparse-cp launch [OPTIONS] script.py ARGS` and `hf-sparse-cp train [OPTIONS] ARGS` (the example module as the
script) both come here; the launcher options are `launcher_options`'s.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence

from ..launch_env import in_launched_group, launched_env
from .interrupts import INTERRUPTED, interrupted_line, recorded_output_dirs
from .refusals import REPORTS_ENV

RUN_MODULE = "hf_sparse_cp.launch.worker"  # (`hf_sparse_cp.run`, quiet on a Ctrl-C during its imports)
# torchrun and accelerate launch, each run as its own command runs it but ending a refused run with the message alone
# (`refusals.py`)
_LAUNCHER = (sys.executable, "-m", "hf_sparse_cp.launch.refusals")
TORCHRUN = (*_LAUNCHER, "torchrun", "--standalone")
ACCELERATE_LAUNCH = (*_LAUNCHER, "accelerate")
# What torchrun itself stops its workers on (its TORCHELASTIC_SIGNALS_TO_HANDLE default).
FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
OPTIONS_HELP = ("--nproc N: N local processes (torchrun; gloo on CPU), default 1; --config_file CONFIG: an accelerate "
                "config (a file, or a shipped recipe's name: `hf-sparse-cp recipes`) for accelerate launch, which "
                "then sets the processes. Ctrl-C or `kill` of this command stops the launcher and its workers too.")


LAUNCHER_OPTIONS = ("--nproc", "--config_file")  # each takes one value
# What a recipe file of each kind (`recipes.KINDS`) is, and where it goes ({}: its name or path), for one given where
# another kind goes
KIND_USES = {"train": ("a training recipe of flags", "`hf-sparse-cp train --recipe {}`"),
             "accelerate": ("a launch config for `accelerate launch --config_file`", "`--config_file {}`"),
             "pattern": ("a sparse pattern (SparseAttentionConfig fields)", "`--sparse_config {}`")}
# The keys accelerate writes in every launch config (`compute_environment`) or requires (`distributed_type`)
ACCELERATE_KEYS = frozenset(("compute_environment", "distributed_type"))


def launcher_options(prog: str, usage: str) -> argparse.ArgumentParser:
    """The parser of the launcher's own options (`LAUNCHER_OPTIONS`); `-h` stays the script's."""
    parser = argparse.ArgumentParser(prog=prog, usage=usage, add_help=False, allow_abbrev=False)
    parser.add_argument(LAUNCHER_OPTIONS[0], type=int, default=1)
    parser.add_argument(LAUNCHER_OPTIONS[1])
    # the --config_file's mapping, read once by `parse_launcher_options`; None without one, or where accelerate
    # launch names what is wrong with the file
    parser.set_defaults(accelerate_config=None)
    return parser


def leading_options(argv: Sequence[str]) -> list[str]:
    """The launcher's options at the start of `argv` (`--nproc 2`, `--config_file=x.yaml`), up to its first other
    argument."""
    taken: list[str] = []
    while argv[len(taken):]:
        arg = argv[len(taken)]
        if arg in LAUNCHER_OPTIONS:
            taken += argv[len(taken):len(taken) + 2]
        elif arg.split("=", 1)[0] in LAUNCHER_OPTIONS and "=" in arg:
            taken.append(arg)
        else:
            break
    return taken


def parse_launcher_options(parser: argparse.ArgumentParser, argv: Sequence[str],
                           given: argparse.Namespace | None = None) -> tuple[argparse.Namespace, list[str]]:
    """(the launcher's options, the other arguments in their order); a process count that cannot run is argparse's
    error, naming the fix. `given`: the options parsed before from the arguments that came before `argv` (`launch`
    parses its leading ones first), kept unless `argv` gives them again. The accelerate config is read here, once,
    and held on the options (`accelerate_config`)."""
    options, rest = parser.parse_known_args(list(argv), argparse.Namespace(**vars(given)) if given else None)
    if options.nproc < 1:
        parser.error(f"--nproc {options.nproc}: give at least 1 process.")
    if options.config_file is not None and not options.config_file.strip():  # (read as none: launched by torchrun)
        parser.error(f"--config_file {options.config_file!r} is empty (an unset shell variable?): give the accelerate "
                     "config, or drop the flag.")
    if options.nproc > 1 and options.config_file:
        parser.error(f"--nproc {options.nproc} with --config_file {options.config_file}: the accelerate config sets "
                     "the processes (its num_processes); drop --nproc, or drop --config_file to launch with torchrun.")
    if options.config_file and options.config_file != getattr(given, "config_file", None):
        from hf_sparse_cp.config.files import read_mapping
        from hf_sparse_cp.recipes import recipe_path

        name = options.config_file
        try:
            options.config_file = str(recipe_path(name))
        except FileNotFoundError:  # (named among the shipped launch configs alone, the kind it takes)
            try:
                recipe_path(name, ("accelerate",))
            except FileNotFoundError as e:
                parser.error(f"--config_file: {e}")
        try:  # (a training recipe or a pattern here ended in accelerate's traceback on its missing distributed_type)
            options.accelerate_config = read_mapping(options.config_file)
        except (OSError, ValueError):  # (accelerate launch names what is wrong with its file)
            options.accelerate_config = None
        mistake = options.accelerate_config and wrong_kind(name, options.config_file, options.accelerate_config,
                                                           "accelerate")
        if mistake:
            parser.error(f"--config_file {name}: {mistake}")
    return options, rest


def recipe_kind(mapping: Mapping) -> str:
    """The kind (of `recipes.KINDS`) of a recipe file's `mapping`: 'accelerate' with accelerate's keys, 'pattern'
    when it holds only the keys of a `SparseAttentionConfig` (flat, in sections, or under its file section), else
    'train'."""
    from hf_sparse_cp.config import SparseAttentionConfig

    if ACCELERATE_KEYS & set(mapping):
        return "accelerate"
    if mapping and set(mapping) <= {*SparseAttentionConfig.keys(), SparseAttentionConfig.FILE_SECTION}:
        return "pattern"
    return "train"


def wrong_kind(given: str, path: str, mapping: Mapping, wanted: str) -> str | None:
    """Where the file `given` (found at `path`, holding `mapping`) goes when it is a recipe of another kind than
    `wanted` (a message naming the flag that takes it); None when it is of that kind."""
    kind = recipe_kind(mapping)
    if kind == wanted:
        return None
    what, use = KIND_USES[kind]
    return f"{path} is {what}, not {KIND_USES[wanted][0]}: give it as {use.format(given)}."


def launched_processes(options: argparse.Namespace) -> int | None:
    """How many processes `launch` starts for `options`: `nproc` under torchrun, the accelerate config's
    `num_processes` (all machines'); None when the run stays in this process (it checks its own flags there, with
    no launcher to report a failure) or the config does not say."""
    if options.config_file:
        from .accelerate_config import positive_count

        return positive_count((options.accelerate_config or {}).get("num_processes", 1))
    return options.nproc if options.nproc > 1 and not in_launched_group() else None


def accelerator_count() -> int:
    """The accelerators this process sees: `torch.accelerator.device_count()` where torch has it, else CUDA's."""
    import torch

    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and hasattr(accelerator, "device_count"):
        return accelerator.device_count()
    return torch.cuda.device_count()


def refuse_unrunnable_config(parser: argparse.ArgumentParser, options: argparse.Namespace) -> None:
    """Exit as argparse ends a bad flag, before any process starts, when the accelerate config of `options` cannot run
    on this machine (`accelerate_config.config_mistake`: more processes per machine than accelerators, gpu_ids that
    leave a process without one, FSDP1 or a parallelism_config without any, DeepSpeed not installed), naming the
    fix."""
    from .accelerate_config import config_mistake

    if options.accelerate_config is None:
        return
    mistake = config_mistake(options.accelerate_config, accelerator_count())
    if mistake:
        parser.error(f"--config_file {options.config_file} {mistake}.")


def refuse_unlaunchable(parser: argparse.ArgumentParser, arguments, processes: int,
                        config: Mapping | None = None, ring: bool = True) -> None:
    """Exit as argparse ends a bad flag (`parser`'s usage and prog) when `processes` launched processes cannot run
    the CP degrees of `arguments` (the plugin's, `PluginArgumentsMixin`), each of which would refuse them
    (`check_launch`, its ring's nodes with `ring`; under the accelerate `config`, `check_training_arguments` too: a
    DeepSpeed config), before any starts."""
    env = launched_env(processes)  # (what the launcher sets in each process)
    try:
        arguments.check_launch(env, ring=ring)
        cp_size = max(cp_size for _, cp_size in arguments.cp_degrees())
        if cp_size > 1 and config and config.get("distributed_type") == "DEEPSPEED":
            # (imports the Trainer, which the launcher's checks otherwise do without)
            from hf_sparse_cp.trainer.cp_checks import check_training_arguments

            check_training_arguments(arguments, cp_size, {**env, "ACCELERATE_USE_DEEPSPEED": "true"})
    except ValueError as e:
        parser.error(str(e))


def launch(options: argparse.Namespace, run_args: Sequence[str], here: Callable[[list[str]], None]) -> int:
    """Run `python -m hf_sparse_cp.run RUN_ARGS` as `options` ask: under accelerate launch (`config_file`), under
    torchrun (`nproc` > 1, unless this process is already one of a launched group: `in_launched_group`), else in
    this process, by `here` (`hf_sparse_cp.run.main`, which the caller imports: the launcher sits below it).
    Returns the exit status."""
    if options.config_file:
        command = [*ACCELERATE_LAUNCH, "--config_file", options.config_file, "-m", RUN_MODULE]
    elif options.nproc > 1 and not in_launched_group():
        command = [*TORCHRUN, f"--nproc_per_node={options.nproc}", "-m", RUN_MODULE]
    else:
        here(list(run_args))
        return 0
    with tempfile.TemporaryDirectory(prefix="hf-sparse-cp-reports-") as reports:  # (`refusals.first_to_report`)
        status = run_forwarding_signals([*command, *run_args], env={**os.environ, REPORTS_ENV: reports})
        if status == INTERRUPTED:  # (the processes exit in silence: `interrupts.end_interrupted`)
            sys.stderr.write(interrupted_line(launched_processes(options) or 1, recorded_output_dirs(reports)))
    global _launched_a_child
    _launched_a_child = True
    return status


_launched_a_child = False  # (set once `launch` has left a run to a launcher child: `launched_a_child`)


def launched_a_child() -> bool:
    """Whether `launch` ran its run under a launcher child (torchrun, accelerate launch) of this process, which then
    only waited for it: nothing of the run is left here (`refusals.end_launcher`)."""
    return _launched_a_child


def run_forwarding_signals(command: list[str], env: Mapping[str, str] | None = None) -> int:
    """Run `command` (torchrun, accelerate launch) as a child (in `env`, default this process's) and end with it:
    SIGINT, SIGTERM, SIGHUP or SIGQUIT sent to this process (Ctrl-C, `kill`, a scheduler) is passed on to the child's
    process group, and this returns only once the child is gone, with 128 + the signal number; otherwise with the
    child's exit status.

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
        child = subprocess.Popen(command, env=env, start_new_session=True)
        forward_first()  # a signal that came while the child was starting
        returncode = child.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if received:
        return 128 + received[0]
    return 128 - returncode if returncode < 0 else returncode  # (killed by a signal: the shell's convention)
