"""Memory-lean causal-LM loss: cross-entropy straight from hidden states, never the full [N, vocab] logits.

* `chunked_linear_cross_entropy`: the PyTorch implementation (token chunks, exact gradients);
* `linear_cross_entropy`: dispatch to liger-kernel's fused kernel on CUDA when installed, else the above.

The causal-LM `forward` that uses it inside transformers models is
`hf_sparse_cp.integration.lean_loss` (`hf_sparse_cp.enable_lean_loss()`).
"""

from .chunked import chunked_linear_cross_entropy, default_chunk_size
from .dispatch import BACKEND_ENV, is_liger_kernel_available, linear_cross_entropy, resolve_backend

__all__ = [
    "BACKEND_ENV",
    "chunked_linear_cross_entropy",
    "default_chunk_size",
    "is_liger_kernel_available",
    "linear_cross_entropy",
    "resolve_backend",
]
