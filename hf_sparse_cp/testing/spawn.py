"""Run a function in a few local gloo processes (tests and CPU experiments of the distributed code).

The processes fork from a server that imported torch, transformers and the Trainer once (`preload.py`), where
spawning each one fresh would import them again: seconds a process, most of a small test's time on a CPU.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..distributed.mesh import quiesce_process_groups

# Where the platform has no fork server (Windows), each process starts fresh.
START_METHOD = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
PRELOAD = "hf_sparse_cp.testing.preload"


def _worker(rank: int, fn: Callable, world_size: int, workdir: str, timeout_s: float, args: tuple,
            environ: dict[str, str]) -> None:
    # The fork server's environment is the one of its start: each process gets its caller's of now, as spawned
    # processes would (what the preloaded packages read at their import stays the server's).
    os.environ.clear()
    os.environ.update(environ)
    # A process torchrun starts has the platform's default start method; one the fork server starts is given the
    # server's, under which a DataLoader's workers (dataloader_num_workers) waited for a fork server of the process's
    # own: a fresh interpreter importing torch and the dataset's modules, 7 s of a CPU a loader.
    mp.set_start_method(None, force=True)
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{os.path.join(workdir, 'store')}", rank=rank, world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    try:
        result = fn(rank, world_size, *args)
        with open(os.path.join(workdir, f"result{rank}.pkl"), "wb") as f:
            pickle.dump(result, f)
        quiesce_process_groups()
    finally:
        if dist.is_initialized():  # (a run the plugin refused tore it down itself: `launch.refusals.end_refused`)
            dist.destroy_process_group()


def process_context():
    """The multiprocessing context of `run_gloo`'s processes (its fork server, which preloads the packages), for a
    test that starts processes of its own."""
    if START_METHOD == "forkserver":
        mp.set_forkserver_preload([PRELOAD])  # (read when the server starts: the first call of a process)
    return mp.get_context(START_METHOD)


def run_gloo(fn: Callable, world_size: int, *args, timeout_s: float = 300.0) -> list[Any]:
    """Call `fn(rank, world_size, *args)` in `world_size` new processes joined in a gloo group (rendezvous
    through a temporary file, no port; each with this process's environment of now, as a spawned one would
    have); returns every rank's return value in rank order.

    `fn` must be importable by the children (a module-level function). A rank that raises makes
    this raise; processes still running after `timeout_s` are killed and a TimeoutError raised.
    """
    process_context()
    with tempfile.TemporaryDirectory() as workdir:
        ctx = mp.start_processes(_worker, args=(fn, world_size, workdir, timeout_s, args, dict(os.environ)),
                                 nprocs=world_size, join=False, start_method=START_METHOD)
        deadline = time.monotonic() + timeout_s
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
                raise TimeoutError(f"{getattr(fn, '__name__', fn)} did not finish in {timeout_s:.0f} s on "
                                   f"{world_size} processes.")
        results = []
        for rank in range(world_size):
            with open(os.path.join(workdir, f"result{rank}.pkl"), "rb") as f:
                results.append(pickle.load(f))
        return results


def _each(rank: int, world_size: int, calls: dict[str, tuple[Callable, tuple]]) -> dict[str, Any]:
    return {name: fn(rank, world_size, *args) for name, (fn, args) in calls.items()}


def run_gloo_each(calls: Mapping[str, tuple[Callable, tuple]], world_size: int, *,
                  timeout_s: float = 600.0) -> dict[str, list[Any]]:
    """Call each `fn(rank, world_size, *args)` of `calls` ({name: (fn, args)}), one after the other in order, in the
    same `world_size` spawned processes (`run_gloo`: their start, most of a small test's time, paid once); returns
    {name: every rank's return value in rank order}.

    The calls share the processes: each leaves them as a fresh process would be for the next (what it attached
    detached, what it enabled disabled), or comes last."""
    per_rank = run_gloo(_each, world_size, dict(calls), timeout_s=timeout_s)
    return {name: [results[name] for results in per_rank] for name in calls}


def gloo_runs_by_world(fn: Callable, *, timeout_s: float = 600.0) -> Callable[[int], list[Any]]:
    """A function world size -> `run_gloo(fn, world_size)`, spawning each world size once (a test
    module's fixture: every test of the module reads the same runs)."""
    cache: dict[int, list[Any]] = {}

    def get(world_size: int) -> list[Any]:
        if world_size not in cache:
            cache[world_size] = run_gloo(fn, world_size, timeout_s=timeout_s)
        return cache[world_size]

    return get


def _cli_process(rank: int, world: int, argv: list[str]) -> tuple[int, str]:
    """One of the processes torchrun starts for `hf-sparse-cp ARGV` on WORLD processes: its environment, so the
    command runs here; (exit status, stderr) as python would end it."""
    from ..cli import main

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        try:
            status = main(argv)
        except SystemExit as e:  # (a refused run: `launch.refusals.end_refused`)
            status = e.code
        except Exception:  # (an error the run does not mark as a refusal: its traceback)
            traceback.print_exc()
            status = 1
    return status, stderr.getvalue()


def run_cli(argv: list[str], nproc: int, *, timeout_s: float = 600.0) -> subprocess.CompletedProcess:
    """`hf-sparse-cp ARGV` (e.g. `train --nproc NPROC ...`) as torchrun's NPROC processes would run it, in processes
    forked by `run_gloo` (no interpreter start, no launcher: seconds a process on a CPU): for tests whose subject is
    the run, not the launch. Returns the first nonzero exit status (else 0) and every rank's stderr."""
    ranks = run_gloo(_cli_process, nproc, list(argv), timeout_s=timeout_s)
    status = next((code for code, _ in ranks if code), 0)
    return subprocess.CompletedProcess(list(argv), status, "", "".join(err for _, err in ranks))


# `hf-sparse-cp` as a user starts it (the console script runs this module's `command_line`).
CLI = (sys.executable, "-m", "hf_sparse_cp.cli")


def accelerate_cpu_launch() -> list[str]:
    """`accelerate launch` with the shipped CPU recipe (2 local processes) on a free port: accelerate's default,
    29500, fails where another run (another test's) holds it."""
    from ..recipes import recipe_path

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(recipe_path("cpu_2proc_cp2")),
            "--main_process_port", str(port)]


# What a launcher sets in its processes' environment: none of it where a user types a command.
_LAUNCHED = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def launch_env(**extra: str) -> dict[str, str]:
    """This process's environment as a shell's where a user starts a command: outside any launched group (no
    WORLD_SIZE, RANK, ...), one thread per process (several share the CPU cores), with `extra` on top."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", **extra}
    for name in _LAUNCHED:
        env.pop(name, None)
    return env


def launch_cli(argv: list[str], *, cwd: str | os.PathLike | None = None, env: Mapping[str, str] | None = None,
               timeout_s: float = 600.0) -> subprocess.CompletedProcess:
    """`hf-sparse-cp ARGV` launched for real (a new interpreter, torchrun and its workers for `--nproc N`) in `cwd`
    with `launch_env(**env)`: for tests whose subject is the launch; `run_cli` runs the same command without it.
    Output captured as text."""
    return subprocess.run([*CLI, *argv], cwd=cwd, env=launch_env(**(env or {})), capture_output=True, text=True,
                          timeout=timeout_s, check=False)
