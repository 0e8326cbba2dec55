"""Triton is optional (issue #52): where it is not installed, 'auto' computes CUDA calls with FlexAttention, the
scoring runs in PyTorch, and asking for our kernels explicitly is an error that names the install."""

from types import SimpleNamespace

import pytest
import torch

from hf_sparse_cp import backends
from hf_sparse_cp.attention import engines, scoring
from hf_sparse_cp.attention.build import dense_layout
from hf_sparse_cp.attention.call import AttentionCall
from hf_sparse_cp.attention.tokens import TokenMeta


@pytest.fixture
def no_triton(monkeypatch):
    real = backends.is_available

    def available(module, attribute=None):
        return False if module.split(".")[0] == "triton" else real(module, attribute)

    monkeypatch.setattr(backends, "is_available", available)


class _CudaLike(torch.Tensor):
    """CPU queries that report themselves on CUDA, so that 'auto' takes its CUDA branch."""

    @property
    def is_cuda(self) -> bool:
        return True


def test_auto_runs_cuda_calls_on_flex_without_triton(no_triton, monkeypatch):
    monkeypatch.delenv(engines.ENGINE_ENV, raising=False)
    monkeypatch.setattr(engines, "is_flex_available", lambda: True)
    q = torch.zeros(1, 2, 64, 16).as_subclass(_CudaLike)
    assert engines.resolve_engine(q, dense_layout(TokenMeta.contiguous(1, 64), 32)) == "flex"
    assert scoring._scoring_kernel(q, q) is None  # the PyTorch scoring


def test_the_kernels_asked_for_without_triton_name_the_install(no_triton):
    q = torch.randn(1, 2, 64, 16)
    layout = dense_layout(TokenMeta.contiguous(1, 64), 32)
    call = AttentionCall(q, q, q, layout, 0.25, TokenMeta.contiguous(1, 64), TokenMeta.contiguous(1, 64), None)
    with pytest.raises(ImportError, match=r"engine 'triton'.*needs Triton.*hf-sparse-cp\[cuda\].*auto"):
        engines.ENGINES["triton"].forward(call)


def test_a_triton_older_than_the_kernels_need_counts_as_missing(monkeypatch):
    """torch 2.6 and 2.7 bring Triton 3.2 and 3.3, which have no `triton.tools.tensor_descriptor`: the engine took the
    kernels there and failed importing them (ModuleNotFoundError); 'auto' now leaves such calls to FlexAttention and
    asking for the kernels names the release they need."""
    real = backends.is_available
    monkeypatch.setattr(backends, "is_available", lambda module, attribute=None: module != "triton.tools."
                        "tensor_descriptor" and real(module, attribute))
    assert "too old: pip install 'hf-sparse-cp[cuda]' (Triton >= 3.4" in engines.ENGINES["triton"].missing()
    assert scoring._scoring_kernel(torch.zeros(1, 2, 64, 16).as_subclass(_CudaLike), None) is None


@pytest.mark.parametrize("shared,d,engine", [(101376, 16, "flex"), (166912, 16, "triton"), (166912, 256, "flex"),
                                             (232448, 256, "triton")], ids=["L4", "A100", "A100-d256", "H100-d256"])
def test_auto_leaves_a_gpu_without_the_kernels_shared_memory_to_flex(monkeypatch, shared, d, engine):
    """The kernels' tiles take up to 161 KB of shared memory per block: on a GPU with 99 KB (sm_86/sm_89: A10, L4,
    RTX 30/40) their launch failed with Triton's OutOfResources. 'auto' gives Flex those calls, the kernels named
    explicitly say so and name the fix, the pattern's scoring runs in PyTorch; an A100 runs the kernels. Heads above
    128 lanes (Gemma's 256) take up to 224 KB (`limits.WIDE_HEAD_SHARED_BYTES`): an H100 runs them, an A100 not."""
    monkeypatch.delenv(engines.ENGINE_ENV, raising=False)
    monkeypatch.delenv(engines.TABLE_ENV, raising=False)
    monkeypatch.setattr(engines, "is_flex_available", lambda: True)
    monkeypatch.setattr(engines, "is_triton_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device=None: SimpleNamespace(name="GPU X", shared_memory_per_block_optin=shared))
    q = torch.zeros(1, 2, 64, d, dtype=torch.bfloat16).as_subclass(_CudaLike)
    assert engines.resolve_engine(q, dense_layout(TokenMeta.contiguous(1, 64), 32)) == engine
    if engine == "flex" and backends.is_triton_available():
        from hf_sparse_cp.kernels import ops, vertical_slash

        with pytest.raises(ValueError, match=rf"cannot run on GPU X \({shared // 1024} KB of shared memory.*'flex'"):
            ops._check(q)
        assert not vertical_slash.supports(q, q)
