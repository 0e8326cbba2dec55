"""hf-sparse-cp: dynamic sparse attention and sparse context parallelism for the Hugging Face Trainer.

Importing the package changes nothing; `hf_sparse_cp.patch()` registers the `sparse_cp` attention
backend (select it with `attn_implementation="sparse_cp"`) and `hf_sparse_cp.unpatch()` undoes it.

The package is laid out by idea, with one import direction:
`integration -> distributed -> attention -> config` (`kernels` a leaf, `loss` and `smet` beside
them, `testing` and `examples` on top). The names below are its public API; the Trainer-facing ones
are imported on first use, so `import hf_sparse_cp` stays light.
"""

__version__ = "0.1.0"

from .attention import SparseLayout, TokenMeta, block_sparse_attention, estimate_layout
from .config import BACKEND_NAME, SparseAttentionConfig
from .distributed import ContextParallelConfig
from .integration.registration import configure, is_patched, patch, unpatch
from .lazy import lazy_attributes

# Public names defined in modules that import transformers' Trainer stack, loaded on first access.
_LAZY = {
    "SMETArguments": "integration.arguments",
    "SparseCPArguments": "integration.arguments",
    "SparseTrainer": "integration.sparse_trainer",
    "SparseTrainingArguments": "integration.sparse_trainer",
    "attach_to_trainer": "integration.trainer",
    "detach_from_trainer": "integration.trainer",
    "disable_lean_loss": "integration.lean_loss",
    "disable_sparse_attention": "integration.trainer",
    "enable_lean_loss": "integration.lean_loss",
    "enable_sparse_attention": "integration.trainer",
    "install_smet": "integration.smet",
    "is_lean_loss_enabled": "integration.lean_loss",
    "uninstall_smet": "integration.smet",
}
__getattr__ = lazy_attributes(__name__, _LAZY)


__all__ = [
    "BACKEND_NAME",
    "ContextParallelConfig",
    "SparseAttentionConfig",
    "SparseLayout",
    "TokenMeta",
    "block_sparse_attention",
    "configure",
    "estimate_layout",
    "is_patched",
    "patch",
    "unpatch",
    *sorted(_LAZY),
]
