"""flash-attn for the layers that run dense, where a user has it installed (`hf-sparse-cp[flash]`).

A call runs dense when its layer has `pattern="dense"` or a sliding window, or when no document of
the batch is long enough for a sparse pattern (`min_seq_len`). Such a call attends every visible
pair; on CUDA, with flash-attn installed, it runs flash-attn's varlen kernel over the batch's
documents instead of our block-sparse kernels on a dense layout. flash-attn is never required:
without it (or on CPU, or for fp32 inputs) the kernels run. Context-parallel calls always run the
ring. `HF_SPARSE_CP_DENSE_BACKEND` (`auto`, `kernels`, `flash_attn`) overrides the choice.

Documents are the contiguous runs of one segment id in a row, padding left out (the convention of
`hf_sparse_cp.attention.tokens.document_starts`); flash-attn sees them as its variable-length sequences.
"""

from __future__ import annotations

import torch

from ..backends import choose_backend, is_available
from .tokens import PAD_SEGMENT, TokenMeta, run_starts

DENSE_BACKEND_ENV = "HF_SPARSE_CP_DENSE_BACKEND"
DENSE_BACKENDS = ("auto", "kernels", "flash_attn")
FLASH_DTYPES = (torch.float16, torch.bfloat16)
FLASH_MAX_HEAD_DIM = 256


def is_flash_attn_available() -> bool:
    """True when flash-attn's varlen function can be imported (checked once)."""
    return is_available("flash_attn", "flash_attn_varlen_func")


def flash_attn_takes(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether flash-attn takes these tensors: CUDA, fp16/bf16, head_dim a multiple of 8 up to 256."""
    d = q.shape[-1]
    return q.is_cuda and q.dtype in FLASH_DTYPES and k.dtype == q.dtype and d <= FLASH_MAX_HEAD_DIM and d % 8 == 0


def use_flash_attn(q: torch.Tensor, k: torch.Tensor, backend: str | None = None) -> bool:
    """Whether a dense call on q, k runs flash-attn; `backend` (default: $HF_SPARSE_CP_DENSE_BACKEND
    or 'auto'): 'auto' uses it where installed and able, 'kernels' never, 'flash_attn' always (an
    error where it cannot)."""
    backend = choose_backend("Dense attention", DENSE_BACKEND_ENV, DENSE_BACKENDS, backend)
    if backend == "kernels":
        return False
    if backend == "auto":
        return flash_attn_takes(q, k) and is_flash_attn_available()
    if not is_flash_attn_available():
        raise ValueError(
            f"${DENSE_BACKEND_ENV}=flash_attn needs flash-attn: pip install 'hf-sparse-cp[flash]', or set it to 'auto'."
        )
    if not flash_attn_takes(q, k):
        raise ValueError(
            f"flash-attn takes CUDA fp16/bf16 tensors with head_dim a multiple of 8 up to {FLASH_MAX_HEAD_DIM}; got "
            f"{q.device.type} {q.dtype} head_dim {q.shape[-1]}. Set ${DENSE_BACKEND_ENV}=auto to use the kernels here."
        )
    return True


def varlen_documents(meta: TokenMeta) -> tuple[torch.Tensor | None, torch.Tensor, int]:
    """The batch's documents as flash-attn's variable-length sequences.

    Returns (keep, cu_seqlens, longest): keep, int64 indices of the non-padding tokens in the
    flattened [B * S] batch (None when there is no padding); cu_seqlens, int32 [N + 1] document
    boundaries among the kept tokens; longest, the longest document. Two host synchronizations.
    """
    seg = meta.segment
    b, s = seg.shape
    valid = (seg != PAD_SEGMENT).flatten()
    keep = valid.nonzero().squeeze(1)
    bounds = [*run_starts(seg).flatten()[keep].nonzero().squeeze(1).tolist(), keep.numel()]
    cu_seqlens = torch.tensor(bounds, dtype=torch.int32, device=seg.device)
    longest = max((hi - lo for lo, hi in zip(bounds, bounds[1:])), default=0)
    return (None if keep.numel() == b * s else keep), cu_seqlens, longest


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
