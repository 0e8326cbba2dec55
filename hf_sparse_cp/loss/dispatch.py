"""Which linear + cross-entropy implementation runs: liger-kernel's fused one on CUDA, else ours.

liger-kernel is an optional extra (`pip install "hf-sparse-cp[liger]"`): its availability is
checked once, on first use, and it is imported only then. The environment variable
`HF_SPARSE_CP_LOSS_BACKEND` (`auto`, `torch`, `liger`) overrides the choice.

In a model compiled whole (a Trainer's --torch_compile), liger-kernel's loss runs outside the graphs, as it runs
eagerly: dynamo does not keep its autograd Function whole but compiles its forward's code frame by frame (breaking at
its host reads), which would hand its Triton kernels' in-place writes into slices of its buffers to inductor. One
graph break at the loss instead; the chunked PyTorch loss, whose chunk loop a trace would unroll (hundreds of chunks
at long context), is no replacement there.
"""

from __future__ import annotations

import torch

from ..backends import choose_backend, is_available
from .chunked import chunked_linear_cross_entropy, compute_dtype, loss_normalizer, normalize

BACKEND_ENV = "HF_SPARSE_CP_LOSS_BACKEND"
BACKENDS = ("auto", "torch", "liger")


def is_liger_kernel_available() -> bool:
    """True when liger-kernel's fused linear cross-entropy can be imported (checked once)."""
    return is_available("liger_kernel.transformers.functional")


def resolve_backend(device: torch.device, backend: str | None = None, dtype: torch.dtype | None = None) -> str:
    """'liger' or 'torch' for tensors of `dtype` on `device`; `backend` (default: $HF_SPARSE_CP_LOSS_BACKEND or
    'auto'). 'auto' keeps fp16 to the chunked loss: liger-kernel sums the weight gradient of the loss sum over every
    token in the weight's dtype, which in fp16 overflows (2000 tokens of one target, hidden states of 50: inf, which
    fp16 training's loss scaler skips the step for, at every step), where the chunked loss holds fp16 gradients scaled
    within range."""
    backend = choose_backend("Loss", BACKEND_ENV, BACKENDS, backend)
    if backend == "auto":
        liger = device.type == "cuda" and dtype != torch.float16 and is_liger_kernel_available()
        return "liger" if liger else "torch"
    if backend == "liger":
        if device.type != "cuda":
            raise ValueError(f"The liger loss backend needs CUDA tensors, got device {device}; use backend 'torch'.")
        if not is_liger_kernel_available():
            raise ValueError(
                "The liger loss backend needs liger-kernel: pip install 'hf-sparse-cp[liger]', or use backend 'torch'."
            )
    return backend


@torch.compiler.disable
def _liger_linear_cross_entropy(hidden, weight, labels, *, bias, num_items_in_batch, ignore_index):
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    labels = labels.to(hidden.device)
    loss_sum = liger_fused_linear_cross_entropy(
        hidden.contiguous(), weight, labels, bias=bias, ignore_index=ignore_index, reduction="sum"
    )
    # liger computes its gradients in forward and multiplies them by the incoming one: dividing by a
    # normalizer of 0 would hand it 1 / 0 and turn its zero gradients into NaN. The chunked loss's
    # divisor handling (mean or num_items_in_batch, zero gradient without targets) applies instead.
    return normalize(loss_sum, loss_normalizer(labels, num_items_in_batch, ignore_index))


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    num_items_in_batch: torch.Tensor | int | None = None,
    ignore_index: int = -100,
    backend: str | None = None,
) -> torch.Tensor:
    """Memory-lean cross-entropy of `hidden @ weight.T + bias` against shifted `labels`.

    Args:
        hidden, weight, labels, bias, num_items_in_batch, ignore_index: as for
            `chunked_linear_cross_entropy` (hidden [N, H], weight [V, H], labels [N]).
        backend: 'auto' (liger-kernel's fused kernel for CUDA tensors when installed, but in fp16, the chunked
            PyTorch implementation otherwise: `resolve_backend`), 'liger' or 'torch'; default
            $HF_SPARSE_CP_LOSS_BACKEND.

    Returns:
        The loss sum over non-ignored tokens divided by `num_items_in_batch`, else their mean. A batch
        without targets gets a zero gradient with every backend.
    """
    if resolve_backend(hidden.device, backend, compute_dtype(hidden, weight)) == "liger":
        return _liger_linear_cross_entropy(
            hidden, weight, labels, bias=bias, num_items_in_batch=num_items_in_batch, ignore_index=ignore_index
        )
    return chunked_linear_cross_entropy(
        hidden, weight, labels, bias=bias, num_items_in_batch=num_items_in_batch, ignore_index=ignore_index
    )
