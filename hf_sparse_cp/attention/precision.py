"""The arithmetic of the attention engine: fp32 whatever the input dtype, fp64 for fp64 inputs.

Scores, softmax statistics, partial results and gradient accumulators of the reference, the
merge, pattern estimation and the ring all use `compute_dtype`; the kernels compute in fp32.
"""

from __future__ import annotations

import torch


def compute_dtype(*dtypes: torch.dtype) -> torch.dtype:
    """float64 when any of `dtypes` is float64, else float32."""
    return torch.float64 if torch.float64 in dtypes else torch.float32


def autocast_inputs(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The tensors in the autocast dtype when autocast is on for their device (as SDPA gets them:
    under autocast q, k, v may arrive in different dtypes), else unchanged. Callers then compute with
    autocast off, so that fp32 arithmetic stays fp32."""
    device_type = tensors[0].device.type
    if not torch.is_autocast_enabled(device_type):
        return tensors
    dtype = torch.get_autocast_dtype(device_type)
    return tuple(t.to(dtype) for t in tensors)
