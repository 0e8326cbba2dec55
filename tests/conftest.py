import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _restore_backend_registration():
    """Tests that patch transformers leave it as they found it."""
    import hf_sparse_cp

    was_patched = hf_sparse_cp.is_patched()
    yield
    if hf_sparse_cp.is_patched() and not was_patched:
        hf_sparse_cp.unpatch()


@pytest.fixture
def single_thread():
    """Tiny models run faster on one intra-op thread, and far faster when the cores are shared."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
