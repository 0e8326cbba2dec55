"""The teardown of a distributed run's process groups: a gloo worker that frees a finished collective's tensors
takes the GIL, so every path that destroys the groups or ends the interpreter first lets the workers finish (why:
`settle_gloo_workers`). An exit that loses that race aborts rarely ("terminate called without an active
exception", after TRL's sft.py under CP 2 called `trainer.end()`), so no test loops for it: these check that each
path settles before the teardown."""

from __future__ import annotations

import functools
import sys
import time
import types
from pathlib import Path
from unittest import mock

import pytest
import torch.distributed as dist

from hf_sparse_cp.launch import refusals
from hf_sparse_cp.testing.spawn import run_gloo
from hf_sparse_cp.trainer import sparse_trainer
from hf_sparse_cp.trainer.sparse_trainer import SparseTrainer


def _recording(calls: list[str], name: str):
    return lambda *args, **kwargs: calls.append(name)


def test_trainer_end_settles_before_the_group_is_destroyed(monkeypatch):
    """`Trainer.end()` (TRL's scripts call it last) destroys the process group through accelerate: the sparse
    Trainer's quiesces first, as its exit handler does (before: the group went right after the last collective)."""
    calls: list[str] = []
    monkeypatch.setattr(sparse_trainer, "quiesce_process_groups", _recording(calls, "quiesce"))
    trainer = object.__new__(SparseTrainer)  # (only `end` runs: it reads the accelerator alone)
    trainer.accelerator = types.SimpleNamespace(end_training=_recording(calls, "destroy"))
    trainer.end()
    assert calls == ["quiesce", "destroy"]


def test_exit_handler_settles_also_where_the_script_destroyed_the_group(monkeypatch):
    """A script that destroyed the default group itself may hold another (a device mesh's), whose workers outlive
    the destroy: the exit handler settles them before the interpreter finalises."""
    calls: list[str] = []
    handlers = []
    monkeypatch.setattr(sparse_trainer, "settle_gloo_workers", _recording(calls, "settle"))
    monkeypatch.setattr(sparse_trainer.atexit, "register", handlers.append)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    sparse_trainer._tear_down_at_exit.__wrapped__()
    (handler,) = handlers
    handler()
    assert calls == ["settle"]


def test_a_refusal_settles_before_it_destroys_the_group(monkeypatch, tmp_path):
    """A refused rank ends alone (the others may not come): it settles its own workers, then destroys the group."""
    from hf_sparse_cp.distributed import mesh

    calls: list[str] = []
    destroy = dist.destroy_process_group
    monkeypatch.setattr(mesh, "settle_gloo_workers", _recording(calls, "settle"))
    monkeypatch.setattr(dist, "destroy_process_group", lambda: (calls.append("destroy"), destroy()))
    monkeypatch.setenv(refusals.REPORTS_ENV, str(tmp_path))
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        refusals.end_refused("prog", ValueError("refused"))
    except SystemExit as exit_:
        assert exit_.code == refusals.REFUSED
    finally:
        if dist.is_initialized():
            destroy()
    assert calls == ["settle", "destroy"]


def _exit_handler_calls(monkeypatch) -> list[str]:
    """What the exit handler does at exit in a process whose group is up: settle, quiesce (the barrier), destroy."""
    calls: list[str] = []
    handlers = []
    monkeypatch.setattr(sparse_trainer, "settle_gloo_workers", _recording(calls, "settle"))
    monkeypatch.setattr(sparse_trainer, "quiesce_process_groups", _recording(calls, "quiesce"))
    monkeypatch.setattr(sparse_trainer.atexit, "register", handlers.append)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(sparse_trainer.upstream, "default_store", lambda: None)
    monkeypatch.setattr(sparse_trainer, "every_rank_at_exit", lambda store: True)
    monkeypatch.setattr(dist, "destroy_process_group", _recording(calls, "destroy"))
    sparse_trainer._tear_down_at_exit.__wrapped__()
    (handler,) = handlers
    handler()
    return calls


def test_exit_handler_on_an_uncaught_exception_settles_without_the_barrier(monkeypatch):
    """A rank that ends on an uncaught exception after training (run_clm.py's save_model on rank 0 alone, refusing
    the model's config) leaves the others inside another collective (evaluate()'s gather): its exit handler settles
    its workers and neither waits at the exit barrier nor destroys the group, so the launcher ends the job on its
    exit at once (before: the barrier waited on the others until the group's timeout, 30 minutes by default)."""
    monkeypatch.setattr(sys, "last_value", ValueError("the script's error, as python sets it once printed"),
                        raising=False)
    assert _exit_handler_calls(monkeypatch) == ["settle"]


@pytest.mark.parametrize("code, skips_the_barrier", [(3, True), ("a message", True), (0, False), (None, False)])
def test_a_script_leaving_with_a_failing_exit_code_skips_the_exit_barrier(tmp_path, monkeypatch, code,
                                                                          skips_the_barrier):
    """A script that ends with `sys.exit(1)` on one rank after training (its own check of the results failing
    there alone) leaves the others in another collective, as an uncaught exception does, but python records no
    exception for it: the launcher notes the code, so its exit handler neither waits at the barrier (before: until
    the group's timeout) nor destroys the group. A clean `sys.exit(0)` keeps the barrier."""
    left, calls = _launched_script_exit(tmp_path, monkeypatch, f"import sys\nsys.exit({code!r})\n")
    assert left == code
    assert calls == (["settle"] if skips_the_barrier else ["quiesce", "destroy"])


def test_a_rank_interrupted_after_training_skips_the_exit_barrier(tmp_path, monkeypatch):
    """Ctrl-C reaching one rank alone after training (`kill -INT` of its process, or mid-save), its launched script
    ending with INTERRUPTED in silence (`interrupts.end_interrupted`), the other in evaluate()'s gather: its exit
    handler settles without the barrier, as for a failing `sys.exit` (before: it waited there for the other, which
    never came, until the group's timeout)."""
    from hf_sparse_cp.launch.interrupts import INTERRUPTED

    assert _launched_script_exit(tmp_path, monkeypatch, "raise KeyboardInterrupt\n") == (INTERRUPTED, ["settle"])


def _launched_script_exit(tmp_path, monkeypatch, script: str) -> tuple[object, list[str]]:
    """(the exit code, what the exit handler then does: `_exit_handler_calls`) of `script` run by the launcher's
    `hf_sparse_cp.run`, with no exception recorded as python records one it printed."""
    from hf_sparse_cp.run import main as run

    (tmp_path / "script.py").write_text(script)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sparse_trainer, "_failing_exit", [])
    with pytest.raises(SystemExit) as leaving:
        run(["script.py"])
    for name in ("last_exc", "last_value"):
        monkeypatch.delattr(sys, name, raising=False)
    return leaving.value.code, _exit_handler_calls(monkeypatch)


def _exit_handler_of_rank(rank: int, world: int, leaving: int | None, workdir: str) -> list[str]:
    """What this rank's exit handler does (`_exit_handler_calls`, in a real 2-process group whose ranks agree in its
    store; the exit waits 1 s). Where a rank is `leaving` alone (its script's `sys.exit(1)` under torchrun), the
    other is elsewhere (in another collective, as evaluate()'s gather) until it has left; else both exit."""
    calls: list[str] = []
    handlers = []
    if leaving is not None and rank != leaving:
        while not Path(workdir, "left").exists():
            time.sleep(0.05)
    with mock.patch.object(sparse_trainer, "settle_gloo_workers", _recording(calls, "settle")), \
            mock.patch.object(sparse_trainer, "quiesce_process_groups", _recording(calls, "quiesce")), \
            mock.patch.object(sparse_trainer, "every_rank_at_exit",
                              functools.partial(sparse_trainer.every_rank_at_exit, wait_s=1.0)), \
            mock.patch.object(dist, "destroy_process_group", _recording(calls, "destroy")), \
            mock.patch.object(sparse_trainer.atexit, "register", handlers.append):
        sparse_trainer._tear_down_at_exit.__wrapped__()
        (handler,) = handlers
        handler()
    if rank == leaving:
        Path(workdir, "left").touch()
    return calls


@pytest.mark.parametrize("leaving", [None, 0])
def test_a_rank_failing_alone_outside_our_launcher_leaves_without_waiting_at_the_exit_barrier(tmp_path, leaving):
    """A script run by torchrun itself that ends with `sys.exit(1)` on one rank after training (no launcher to note
    the code: python records none) went into the exit barrier while the other rank waited in another collective for
    it, both until the group's timeout (30 minutes by default; a CP 2 run with --ddp_timeout 60 ended after 79 s,
    where it now ends 30 s after the exit). The ranks now agree in the store whether all got to their exit
    within `mesh.EXIT_WAIT_S`: the leaving rank settles without the barrier, and the other, coming later, learns it
    and does too; ranks that all exit still go through the barrier and the teardown."""
    calls = run_gloo(_exit_handler_of_rank, 2, leaving, str(tmp_path), timeout_s=120)
    if leaving is None:
        assert calls == [["quiesce", "destroy"]] * 2
    else:
        assert calls == [["settle"]] * 2


def test_workers_restarted_by_torchrun_agree_on_their_exit_anew(monkeypatch):
    """torchrun's workers restarted after a failure (--max_restarts) share its store with the keys of those that
    ended: a rank of the new group, alone at its exit (the other failing elsewhere), read the old group's agreement
    (all at the exit) and went into the barrier; it now agrees with its own group only (TORCHELASTIC_RESTART_COUNT)."""
    from concurrent.futures import ThreadPoolExecutor

    from hf_sparse_cp.distributed import mesh

    store = dist.HashStore()
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    with ThreadPoolExecutor(2) as ranks:  # the first group: both ranks at their exit
        assert list(ranks.map(lambda _: mesh.every_rank_at_exit(store, wait_s=60.0), range(2))) == [True, True]
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert mesh.every_rank_at_exit(store, wait_s=0.0) is False


def test_ctrl_c_while_a_rank_waits_for_the_others_at_its_exit_ends_the_wait(monkeypatch):
    """Ctrl-C reaching a rank that waits at its exit for the others (rank 0 still saving the final model): the wait
    ends and the rank leaves, where the interrupt escaped the exit handler with a traceback ('Exception ignored in
    atexit callback'), breaking the launcher's one line."""
    from hf_sparse_cp.distributed import mesh

    def interrupted(_seconds):
        raise KeyboardInterrupt

    store = dist.HashStore()
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(mesh.time, "sleep", interrupted)
    assert mesh.every_rank_at_exit(store, wait_s=60.0) is False
    monkeypatch.undo()
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    assert mesh.every_rank_at_exit(store, wait_s=60.0) is False  # (the other, coming later, learns it left)
