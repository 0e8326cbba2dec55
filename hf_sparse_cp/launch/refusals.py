"""How a launched run ends when the plugin refuses a setting it cannot run (an error marked by
`trainer.arguments.flag_errors`, whose message names the fix): the message alone, once, exit status `REFUSED`.

* `end_refused`, in each process (`hf_sparse_cp.run`): prints `prog: error: MESSAGE` as argparse prints a bad flag,
  tears the process group down and exits. Under CP every rank of a group refuses alike, so the first rank to
  refuse with a message prints it and the others stay silent: not rank 0 alone, because the launcher stops the
  other ranks as soon as one exits (rank 0 may never get to print), and because ranks of different data-parallel
  groups can refuse different batches (each different message is printed, once). The ranks count a message in the
  process group's store or, before there is one (a script's flags refused as its parser reads them), in the folder
  `hf-sparse-cp launch` gives its processes (`REPORTS_ENV`): once per machine.
* `python -m hf_sparse_cp.launch.refusals (torchrun | accelerate) ARGS`, the launcher `hf-sparse-cp launch` starts:
  torchrun or accelerate launch as their commands run them, except that a run whose processes ended refused (the
  others stopped by the launcher) ends with `REFUSED` and without their traceback and failure summary, which
  only repeat the message's process's exit status (as torchrun's ChildFailedError, or as the CalledProcessError
  accelerate launch raises for a config of one process). A process that refused marks it in the launcher's folder
  before its teardown (`REFUSED_MARKER`): a run whose processes all ended on signals after that (a rank aborting in
  its process group's teardown, the others stopped by the launcher, as seen under load) ended on the refusal too.
  Any other failure keeps them. A run stopped by a signal
  ends with 128 + its number, without the launcher's traceback (and, on Ctrl-C, without torchrun's line per worker:
  `interrupts.py`). Once its workers are gone it ends without the interpreter's teardown (`end_launcher`).
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import importlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Iterator
from typing import NoReturn

from ..launch_env import launched_world_size

# argparse's status for a bad flag (an uncaught exception ends a process with 1)
REFUSED = 2
LAUNCHERS = {"torchrun": "torch.distributed.run", "accelerate": "accelerate.commands.launch"}
# A folder the launcher's processes share on one machine (made and removed by `hf-sparse-cp launch`), where the
# first to report a message before any process group exists marks it
REPORTS_ENV = "HF_SPARSE_CP_REPORTS"
# The file in that folder that says a process ended refused (written before its teardown)
REFUSED_MARKER = "refused"
# The command a user typed to run a program of ours (`hf-sparse-cp train` runs the example), set by that command for
# the processes it starts: the program's help and refusals name it, not the module's file, which is no command
COMMAND_ENV = "HF_SPARSE_CP_COMMAND"


def command_name(default: str) -> str:
    """The name a program's help and refusals give: the command that ran it (`COMMAND_ENV`), else `default`."""
    return os.environ.get(COMMAND_ENV) or default


@contextlib.contextmanager
def running_as(command: str) -> Iterator[None]:
    """Within it, what runs here or in the processes started here is `command` to its user (`command_name`)."""
    before = os.environ.get(COMMAND_ENV)
    os.environ[COMMAND_ENV] = command
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(COMMAND_ENV, None)
        else:
            os.environ[COMMAND_ENV] = before


def first_to_report(message: str) -> bool:
    """Whether this process is the first of its launched group to report `message`: counted in the default
    process group's store (without waiting on any other rank), else in the launcher's folder (`REPORTS_ENV`);
    True in a process alone, or where neither answers (a message printed twice beats one lost)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        if dist.get_world_size() == 1:
            return True
        from ..integration import upstream

        try:
            return counted_first(upstream.default_store(), message)
        except RuntimeError:  # (the store's host gone: torch raises DistError, a RuntimeError)
            return True
    folder = os.environ.get(REPORTS_ENV)
    if not folder or (launched_world_size() or 1) == 1:
        return True
    try:
        os.close(os.open(os.path.join(folder, _key(message)), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    except OSError:  # (the folder gone)
        return True
    return True


def counted_first(store, message: str) -> bool:
    """Count `message` in `store` (a `torch.distributed.Store`, shared by the ranks); whether it was the first."""
    return store.add(f"hf_sparse_cp/refused/{_key(message)}", 1) == 1


def _key(message: str) -> str:
    return hashlib.sha1(message.encode()).hexdigest()


def exit_refused(text: str) -> NoReturn:
    """Exit with `REFUSED` after writing `text` (argparse's usage and error lines) to stderr if `first_to_report`
    it: what a launched script's parser does with a bad flag, which each process reads alike."""
    if first_to_report(text):
        sys.stderr.write(text)
        sys.stderr.flush()
    sys.exit(REFUSED)


def end_refused(prog: str, error: BaseException) -> NoReturn:
    """Exit with `REFUSED` after printing `prog: error: <error>` (if `first_to_report` it) and destroying the
    default process group, if any."""
    import torch.distributed as dist

    message = str(error)
    if first_to_report(message):
        sys.stderr.write(f"{prog}: error: {message}\n")
        sys.stderr.flush()
    _mark_refused()
    if dist.is_available() and dist.is_initialized():
        from ..distributed.mesh import settle_gloo_workers

        settle_gloo_workers()  # (local: the other ranks may not come here)
        dist.destroy_process_group()
    sys.exit(REFUSED)


def _mark_refused() -> None:
    """Write `REFUSED_MARKER` in the launcher's folder (`REPORTS_ENV`), where a launched process has one."""
    folder = os.environ.get(REPORTS_ENV)
    if folder:
        try:
            open(os.path.join(folder, REFUSED_MARKER), "a").close()
        except OSError:  # (the folder gone: the exit status still says it)
            pass


def refused_run(exit_codes: list[int], marked: bool = False) -> bool:
    """Whether the launched processes that failed with `exit_codes` ended on a refusal: one at least with
    `REFUSED`, the others with it or stopped by a signal (the launcher stops the rest once one exits); or, where a
    process `marked` its refusal before its teardown (`REFUSED_MARKER`), all of them on signals."""
    if not all(code == REFUSED or code < 0 for code in exit_codes):
        return False
    return REFUSED in exit_codes or marked


def drops_refused_failure(record: logging.LogRecord) -> bool:
    """A logging filter: False for torchrun's line on a worker that ended with `REFUSED` (`failed (exitcode: 2) ...`),
    which only repeats the status of the refusal printed above it; its summary of a run that failed otherwise still
    names every failure."""
    return not (str(record.msg).startswith("failed (exitcode") and bool(record.args) and record.args[0] == REFUSED)


def drops_interrupt_shutdown(record: logging.LogRecord) -> bool:
    """A logging filter: False for torchrun's lines on stopping its workers on Ctrl-C (`Received 2 death signal,
    shutting down workers`, then `Sending process N closing signal SIGINT` for each), which the launcher's line on
    the interrupted run says once (`interrupts.interrupted_line`)."""
    text = str(record.msg)
    return not (bool(record.args) and (
        text.startswith("Received %s death signal") and record.args[0] == signal.SIGINT
        or text.startswith("Sending process %s closing signal") and record.args[-1] == signal.SIGINT.name))


def main(argv: list[str]) -> None:
    """Run the launcher `argv[0]` (a key of `LAUNCHERS`) with the arguments `argv[1:]` (see the module's doc)."""
    import subprocess

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(drops_refused_failure)
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(drops_interrupt_shutdown)
    logging.getLogger("torch.distributed.elastic.agent.server.api").addFilter(drops_interrupt_shutdown)
    name, args = argv[0], argv[1:]
    sys.argv[:] = [name, *args]  # (both launchers parse sys.argv)
    try:
        importlib.import_module(LAUNCHERS[name]).main()
    except ChildFailedError as e:
        folder = os.environ.get(REPORTS_ENV)
        marked = bool(folder) and os.path.exists(os.path.join(folder, REFUSED_MARKER))
        if refused_run([failure.exitcode for failure in e.failures.values()], marked):
            sys.exit(REFUSED)
        raise
    except subprocess.CalledProcessError as e:  # accelerate launch's one-process launcher (`simple_launcher`)
        if e.returncode == REFUSED:
            sys.exit(REFUSED)
        raise
    except SignalException as e:  # (torchrun stopped by the signal `hf-sparse-cp` passed on: it says so, once)
        sys.exit(128 + e.sigval)
    except KeyboardInterrupt:  # (accelerate launch's one-process launcher, waiting on its process)
        sys.exit(128 + signal.SIGINT)


def end_launcher(status: int) -> NoReturn:
    """End this process, a launcher whose run is over (the command line's `hf-sparse-cp launch` once its launcher
    child is gone, `processes.launched_a_child`; torchrun or accelerate launch once their workers are), with
    `status`: its exit handlers run and its output is flushed, but not the interpreter's teardown, which here only
    frees what the launcher imported (torch; for the command line's checks transformers and a script's TRL trainer:
    1.2 s of a CPU, 1.8 s of wall on a loaded 2-core machine, after the run had ended)."""
    # (as python's exit, before the exit handlers: the threading module's own exit hooks, which stop the idle workers
    # of a ThreadPoolExecutor never shut down, then waits for the non-daemon threads; joining them alone would wait
    # forever on such workers)
    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # (a closed pipe, a closed stream: nothing left to write to)
            pass
    os._exit(status)


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except SystemExit as e:
        if e.code is not None and not isinstance(e.code, int):  # (a message: python prints it, status 1)
            raise
        end_launcher(e.code or 0)
    end_launcher(0)
