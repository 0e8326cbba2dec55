"""The arithmetic of the attention engine: fp32 whatever the input dtype, fp64 for fp64 inputs.

Scores, softmax statistics, partial results and gradient accumulators of the reference, the
merge, pattern estimation and the ring all use `compute_dtype`; the kernels compute in fp32.
"""

from __future__ import annotations

import torch


def compute_dtype(*dtypes: torch.dtype) -> torch.dtype:
    """float64 when any of `dtypes` is float64, else float32."""
    return torch.float64 if torch.float64 in dtypes else torch.float32
