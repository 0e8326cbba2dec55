"""The unit tier stays in one process: a test that starts a process (a subprocess, a gloo group, the
Triton interpreter's worker) or loads the pretrained model fails here, naming the folder it belongs in."""

import multiprocessing.process
import subprocess
import sys

import pytest


def _refuse(what: str):
    def refuse(*args, **kwargs):
        raise AssertionError(f"a unit test {what}: move it to tests/distributed, tests/kernels or tests/integration.")

    return refuse


@pytest.fixture(autouse=True)
def _one_process(monkeypatch):
    monkeypatch.setattr(subprocess.Popen, "__init__", _refuse("starts a subprocess"))
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", _refuse("starts a process"))
    monkeypatch.setattr("hf_sparse_cp.testing.pretrained.model_file", _refuse("loads the pretrained model"))
    yield
    forget_inductor_compiles()


def forget_inductor_compiles() -> None:
    """Drop inductor's in-process compile caches, where inductor is loaded: a C++ build refused here (the compiler is a
    subprocess) is held there as a failed job, which a later test of another tier in this pytest process compiling the
    same kernel would be handed (a CI run's compiled fused-ops tests failed with this tier's refusal)."""
    utils = sys.modules.get("torch._inductor.utils")
    if utils is not None:
        utils.clear_inductor_caches()


@pytest.fixture
def patched():
    """The `sparse_cp` backend registered with transformers for the test, unregistered after it (a module that needs
    it in every test: `pytestmark = pytest.mark.usefixtures("patched")`)."""
    import hf_sparse_cp

    hf_sparse_cp.patch()
    yield
    hf_sparse_cp.unpatch()
