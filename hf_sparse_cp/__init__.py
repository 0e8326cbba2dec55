"""hf-sparse-cp: dynamic sparse attention and sparse context parallelism for the Hugging Face Trainer.

Importing the package changes nothing; `hf_sparse_cp.patch()` registers the `sparse_cp` attention
backend (select it with `attn_implementation="sparse_cp"`) and `hf_sparse_cp.unpatch()` undoes it.
"""

__version__ = "0.1.0"

from .config import SparseAttentionConfig
from .layout import SparseLayout
from .model import configure
from .registration import BACKEND_NAME, is_patched, patch, unpatch
from .tokens import TokenMeta

__all__ = [
    "BACKEND_NAME",
    "SparseAttentionConfig",
    "SparseLayout",
    "TokenMeta",
    "configure",
    "is_patched",
    "patch",
    "unpatch",
]
