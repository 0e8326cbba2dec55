"""Memory-lean causal-LM loss: cross-entropy straight from hidden states, never the full [N, vocab] logits.

* `chunked_linear_cross_entropy`: the PyTorch implementation (token chunks, exact gradients);
* `linear_cross_entropy`: dispatch to liger-kernel's fused kernel on CUDA when installed, else the above;
* `patch_causal_lm_loss`: the reversible `forward` replacement of the supported causal-LM classes that
  `hf_sparse_cp.patch()` applies.
"""

from .causal_lm import SUPPORTED_CAUSAL_LM_CLASSES, lean_causal_lm_forward, patch_causal_lm_loss
from .chunked import chunked_linear_cross_entropy, default_chunk_size
from .dispatch import BACKEND_ENV, is_liger_kernel_available, linear_cross_entropy, resolve_backend

__all__ = [
    "BACKEND_ENV",
    "SUPPORTED_CAUSAL_LM_CLASSES",
    "chunked_linear_cross_entropy",
    "default_chunk_size",
    "is_liger_kernel_available",
    "lean_causal_lm_forward",
    "linear_cross_entropy",
    "patch_causal_lm_loss",
    "resolve_backend",
]
