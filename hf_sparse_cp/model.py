"""Per-model settings: which sparse pattern a model's `sparse_cp` layers use."""

from __future__ import annotations

import torch

from .attention import CONFIG_ATTRIBUTE
from .config import SparseAttentionConfig
from .registration import BACKEND_NAME


def configure(model: torch.nn.Module, config: SparseAttentionConfig | None = None, *, select: bool = True) -> None:
    """Store `config` on the model's config (saved with it) and, if `select`, switch it to `sparse_cp`.

    The backend must be registered first (`hf_sparse_cp.patch()`).
    """
    config = SparseAttentionConfig() if config is None else config
    setattr(model.config, CONFIG_ATTRIBUTE, config.to_dict())
    if select:
        model.set_attn_implementation(BACKEND_NAME)
