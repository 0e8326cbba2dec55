"""What the block-sparse kernels take (dtypes, head_dim), in plain PyTorch: readable without Triton installed,
so that the engine choice can ask before any kernel is imported."""

from __future__ import annotations

import torch

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 128  # see configs.py


def outside_limits(q: torch.Tensor) -> str | None:
    """Why the kernels cannot compute these queries (and k, v of the same dtype) on any device, or None."""
    if q.dtype not in SUPPORTED_DTYPES:
        return f"dtype {q.dtype} (the kernels take {', '.join(str(t) for t in SUPPORTED_DTYPES)})"
    if q.shape[-1] > MAX_HEAD_DIM:
        return f"head_dim {q.shape[-1]} (the kernels stop at {MAX_HEAD_DIM})"
    return None


def unsupported(q: torch.Tensor) -> str | None:
    """Why the compiled kernels cannot take these queries (and k, v of the same dtype), or None."""
    if not q.is_cuda:
        return f"{q.device.type} tensors (the kernels are compiled for CUDA)"
    return outside_limits(q)
