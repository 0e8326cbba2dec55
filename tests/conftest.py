"""Tiers of the suite, one folder each (`make test-fast` runs the first):

* `unit/`: one process, no spawned process, no Triton interpreter, no pretrained weights (seconds each);
* `kernels/`: the Triton kernels under the interpreter, their sm_90 builds, and GPU-marked runs;
* `distributed/`: torch.distributed on gloo, 2 to 4 processes, against one process;
* `integration/`: the Trainer end to end, the command line, recipes, benchmarks' smoke runs, real weights.

Each test carries its folder's marker (`-m unit`, ...); `gpu` tests are skipped without a CUDA GPU.
`HF_SPARSE_CP_TEST_HIDE=triton` runs them as on a machine without Triton (macOS, Windows, CPU-only installs;
`make test-no-triton` runs the unit tier so).
"""

import os
from pathlib import Path

from hf_sparse_cp.testing.hidden import hide_from_environment

hide_from_environment()  # (before torch, which looks for Triton)

import pytest  # noqa: E402
import torch  # noqa: E402

TIERS = ("unit", "kernels", "distributed", "integration")
HERE = Path(__file__).resolve().parent

# Under pytest-xdist (`make test` runs a worker per core) the workers share the cores: one intra-op thread per
# core each, where torch's default (every core each) oversubscribes them.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))


def pytest_collection_modifyitems(config, items):
    skip_gpu = None if torch.cuda.is_available() else pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        tier = Path(item.fspath).resolve().relative_to(HERE).parts[0]
        if tier in TIERS:
            item.add_marker(tier)
        if skip_gpu is not None and "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def _restoring_backend_registration():
    """Leave transformers as it was found: the backend and the lean loss, which a SparseTrainer turns on
    and leaves on."""
    import hf_sparse_cp
    from hf_sparse_cp.integration.lean_loss import disable_lean_loss, is_lean_loss_enabled

    was_patched, had_lean_loss = hf_sparse_cp.is_patched(), is_lean_loss_enabled()
    yield
    if is_lean_loss_enabled() and not had_lean_loss:
        disable_lean_loss()
    if hf_sparse_cp.is_patched() and not was_patched:
        hf_sparse_cp.unpatch()


# Per test, and per module for the module-scoped fixtures that train (set up before any test's own
# restore starts, so only the module's teardown sees what they turned on).
_restore_backend_registration = pytest.fixture(autouse=True)(_restoring_backend_registration)
_restore_backend_registration_per_module = pytest.fixture(autouse=True, scope="module")(
    _restoring_backend_registration)


@pytest.fixture
def single_thread():
    """Tiny models run faster on one intra-op thread, and far faster when the cores are shared."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
