"""Dense calls on a library kernel: flash-attn's varlen kernel, or SDPA (cuDNN) for plain causal rows.

A call runs dense when its layer has `pattern="dense"` or a sliding window, or when no document of
the batch is long enough for a sparse pattern (`min_seq_len`). Such a call attends every visible
pair, which a library kernel computes faster than our block-sparse kernels on a dense layout:

* flash-attn (`hf-sparse-cp[flash]`, optional), where installed: its varlen kernel over the batch's
  documents, padding and sliding windows included;
* otherwise SDPA, where every row is one document with no padding and no sliding window (so causal
  attention over the row is the exact function): cuDNN first, K/V expanded to the query heads
  (measured on an H100, 128K tokens, GQA 16/2, head_dim 128, forward + backward: cuDNN 465 ms, our
  kernels 684 ms, FlexAttention 664 ms; benchmarks/results/attention_nvidia-h100-*.json);
* otherwise our kernels on the dense layout.

Only on CUDA for fp16/bf16 inputs, and SDPA only outside deterministic mode (its cuDNN and flash
backwards are not deterministic; our kernels have a deterministic mode). Calls under the sparse ring
always run the ring; under head parallelism each rank's call over the whole sequence of its heads
(`attention.sequence`) chooses as one process does. `HF_SPARSE_CP_DENSE_BACKEND` (`auto`, `kernels`,
`flash_attn`, `sdpa`) overrides the choice; a forced backend that cannot compute the call exactly is an error.

Documents are the contiguous runs of one segment id in a row, padding left out (the convention of
`hf_sparse_cp.attention.tokens.document_starts`); flash-attn sees them as its variable-length sequences.
"""

from __future__ import annotations

import itertools

import numpy
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..backends import choose_backend, is_available
from .tokens import TokenMeta

DENSE_BACKEND_ENV = "HF_SPARSE_CP_DENSE_BACKEND"
DENSE_BACKENDS = ("auto", "kernels", "flash_attn", "sdpa")
LIBRARY_DTYPES = (torch.float16, torch.bfloat16)
FLASH_MAX_HEAD_DIM = 256
# SDPA's backends on CUDA in the order tried; the math backend (materialized scores) is left out.
SDPA_CUDA_ORDER = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]


def is_flash_attn_available() -> bool:
    """True when flash-attn's varlen function can be imported (checked once)."""
    return is_available("flash_attn", "flash_attn_varlen_func")


def library_takes(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether flash-attn, and SDPA's flash backend (the same limits), take these tensors: CUDA, fp16/bf16,
    head_dim a multiple of 8 up to 256."""
    d = q.shape[-1]
    return q.is_cuda and q.dtype in LIBRARY_DTYPES and k.dtype == q.dtype and d <= FLASH_MAX_HEAD_DIM and d % 8 == 0


def plain_causal_rows(meta: TokenMeta, sliding_window: int | None) -> bool:
    """Whether attention over these tokens is plain causal attention per row: one document per row, no
    padding, no sliding window shorter than the row. From the batch's documents (`TokenMeta.documents`, read back
    once per batch, not once per layer)."""
    s = meta.segment.shape[-1]
    whole_row = [(0, s)] if s else []
    return (sliding_window is None or sliding_window >= s) and all(row == whole_row for row in meta.documents)


def dense_backend(q: torch.Tensor, k: torch.Tensor, meta: TokenMeta, sliding_window: int | None = None,
                  backend: str | None = None) -> str:
    """What computes a dense call on q, k over `meta`'s tokens: 'flash_attn', 'sdpa' or 'kernels' (see the
    module docstring).

    `backend` (default: $HF_SPARSE_CP_DENSE_BACKEND or 'auto'): 'auto' takes flash-attn where installed and
    able, else SDPA for plain causal rows on CUDA fp16/bf16 outside deterministic mode, else the kernels;
    'kernels' never a library; 'flash_attn' and 'sdpa' always (an error where they cannot).
    """
    backend = choose_backend("Dense attention", DENSE_BACKEND_ENV, DENSE_BACKENDS, backend)
    if backend == "auto":
        if not library_takes(q, k):
            return "kernels"
        if is_flash_attn_available():
            return "flash_attn"
        sdpa_able = not torch.are_deterministic_algorithms_enabled() and plain_causal_rows(meta, sliding_window)
        return "sdpa" if sdpa_able else "kernels"
    if backend == "flash_attn":
        if not is_flash_attn_available():
            raise ValueError(f"${DENSE_BACKEND_ENV}=flash_attn needs flash-attn: pip install 'hf-sparse-cp[flash]', "
                             "or set it to 'auto'.")
        if not library_takes(q, k):
            raise ValueError(
                f"flash-attn takes CUDA fp16/bf16 tensors with head_dim a multiple of 8 up to {FLASH_MAX_HEAD_DIM}; "
                f"got {q.device.type} {q.dtype} head_dim {q.shape[-1]}. Set ${DENSE_BACKEND_ENV}=auto to use the "
                "kernels here."
            )
    if backend == "sdpa" and not plain_causal_rows(meta, sliding_window):
        raise ValueError(
            f"${DENSE_BACKEND_ENV}=sdpa computes plain causal attention only, and this batch has packed documents, "
            f"padding or a sliding window ({sliding_window}); set ${DENSE_BACKEND_ENV}=auto to use the kernels here."
        )
    return backend


def sdpa_dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float) -> torch.Tensor:
    """Causal attention per row with SDPA (cuDNN first on CUDA), for rows `plain_causal_rows` accepts.

    q: [B, Hq, S, D], k, v: [B, Hkv, S, D]; K/V are expanded to the query heads (the layout SDPA's
    cuDNN backend takes; it costs 2 x S x (Hq - Hkv) x D elements). Returns [B, S, Hq, D]. Differentiable.
    """
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    backends = SDPA_CUDA_ORDER if q.is_cuda else [SDPBackend.MATH]
    with sdpa_kernel(backends, set_priority=True):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    return out.transpose(1, 2)


def varlen_documents(meta: TokenMeta) -> tuple[torch.Tensor | None, torch.Tensor, int]:
    """The batch's documents as flash-attn's variable-length sequences.

    Returns (keep, cu_seqlens, longest): keep, int64 indices of the non-padding tokens in the
    flattened [B * S] batch (None when there is no padding); cu_seqlens, int32 [N + 1] document
    boundaries among the kept tokens; longest, the longest document. Built on the host from the batch's documents
    (`TokenMeta.documents`, read back once per batch) and copied to the device: no read per layer.
    """
    b, s = meta.segment.shape
    docs = [(row * s + start, row * s + end) for row, row_docs in enumerate(meta.documents) for start, end in row_docs]
    lengths = [end - start for start, end in docs]
    bounds = list(itertools.accumulate(lengths, initial=0))
    cu_seqlens = torch.tensor(bounds, dtype=torch.int32, device=meta.segment.device)
    if bounds[-1] == b * s:
        return None, cu_seqlens, max(lengths, default=0)
    keep = numpy.concatenate([numpy.arange(start, end) for start, end in docs] or [numpy.zeros(0, numpy.int64)])
    return torch.from_numpy(keep).to(meta.segment.device), cu_seqlens, max(lengths, default=0)


def flash_dense_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: TokenMeta,
    *,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Attention over every visible pair with flash-attn's varlen kernel.

    q: [B, Hq, S, D], k, v: [B, Hkv, S, D] (GQA native); meta: the tokens' documents and padding;
    sliding_window: keys `sliding_window` or more tokens before the query are invisible.
    Returns [B, S, Hq, D] (transformers' layout), zeros for padding queries. Differentiable; the
    backward is deterministic when `torch.are_deterministic_algorithms_enabled()`.
    """
    from flash_attn import flash_attn_varlen_func

    b, hq, s, d = q.shape
    keep, cu_seqlens, longest = varlen_documents(meta)
    if longest == 0:  # padding only: no query sees anything
        return q.new_zeros(b, s, hq, d)

    def tokens(x: torch.Tensor) -> torch.Tensor:  # [B, H, S, D] -> [N, H, D], padding left out
        x = x.transpose(1, 2).reshape(b * s, x.shape[1], d)
        return x if keep is None else x.index_select(0, keep)

    out = flash_attn_varlen_func(
        tokens(q), tokens(k), tokens(v), cu_seqlens, cu_seqlens, longest, longest,
        softmax_scale=scale, causal=True,
        window_size=(-1, -1) if sliding_window is None else (sliding_window - 1, 0),
        deterministic=torch.are_deterministic_algorithms_enabled(),
    )
    if keep is not None:
        out = out.new_zeros(b * s, hq, d).index_copy(0, keep, out)
    return out.view(b, s, hq, d)
