"""What the block-sparse kernels take (dtypes, head_dim), in plain PyTorch: readable without Triton installed,
so that the engine choice can ask before any kernel is imported."""

from __future__ import annotations

import torch

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256
# The widest head of the first tiles in configs; wider ones take their own (configs.WIDE_HEAD_TILES).
NARROW_HEAD_DIM = 128


def outside_limits(q: torch.Tensor) -> str | None:
    """Why the kernels cannot compute these queries (and k, v of the same dtype) on any device, or None."""
    if q.dtype not in SUPPORTED_DTYPES:
        return f"dtype {q.dtype} (the kernels take {', '.join(str(t) for t in SUPPORTED_DTYPES)})"
    if q.shape[-1] > MAX_HEAD_DIM:
        return f"head_dim {q.shape[-1]} (the kernels stop at {MAX_HEAD_DIM})"
    return None


# Shared memory per block the launched tiles take at most (sm_90 builds: dk/dv of 16-bit inputs at head_dim 128, 161 KB;
# tests/kernels/test_kernels_compile.py). An A100 (163 KB) or H100 (227 KB) has it; sm_86/sm_89 GPUs (A10, L4, RTX 30
# and 40: 99 KB) do not, and a launch there fails (Triton's OutOfResources).
MIN_SHARED_BYTES = 161 * 1024
# Heads above 128 lanes (configs.WIDE_HEAD_TILES; 256-lane tiles): the scoring's row statistics of 16-bit inputs take
# 224 KB, dk/dv 200.5 KB (sm_90 builds at head_dim 256): an H100 (227 KB), not an A100 (163 KB).
WIDE_HEAD_SHARED_BYTES = 224 * 1024


def shared_memory_shortfall(device: torch.device, head_dim: int) -> str | None:
    """Why the GPU `device` cannot launch the kernels' tiles for heads of `head_dim` lanes (too little shared memory
    per block), or None (enough, or a torch that does not report it)."""
    props = torch.cuda.get_device_properties(device)
    shared = getattr(props, "shared_memory_per_block_optin", None)
    need, gpus = (WIDE_HEAD_SHARED_BYTES, "an H100 or newer") if head_dim > NARROW_HEAD_DIM else (MIN_SHARED_BYTES,
                                                                                   "an A100, H100 or newer")
    if shared is None or shared >= need:
        return None
    return (f"{props.name} ({shared // 1024} KB of shared memory per block; the kernels' tiles take up to "
            f"{need // 1024} KB at head_dim {head_dim}: {gpus})")


def unsupported(q: torch.Tensor) -> str | None:
    """Why the compiled kernels cannot take these queries (and k, v of the same dtype) on their GPU, or None."""
    if not q.is_cuda:
        return f"{q.device.type} tensors (the kernels are compiled for CUDA)"
    return outside_limits(q) or shared_memory_shortfall(q.device, q.shape[-1])
