"""Which transformers models sparse context parallelism can shard, checked before training starts."""

from __future__ import annotations

import torch

from ..config import BACKEND_NAME
from . import compat


def check_model_supports_context_parallel(model: torch.nn.Module, backend: str = BACKEND_NAME) -> None:
    """Raise ValueError when sparse context parallelism cannot shard `model`'s attention."""
    config = getattr(model, "config", None)
    name = type(model).__name__
    if config is None:
        raise ValueError(f"{name} has no transformers config; context parallelism needs a transformers model.")
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(f"{name} is an encoder-decoder model; sparse context parallelism shards causal decoders only.")
    sub = [k for k in ("vision_config", "audio_config", "encoder_config") if getattr(config, k, None) is not None]
    if sub:
        raise ValueError(
            f"{name} has non-text towers ({', '.join(sub)}) whose attention is not sharded; sparse context "
            "parallelism supports text-only causal language models."
        )
    impl = compat.attn_implementation(config)
    if impl != backend:
        raise ValueError(
            f"{name} uses attn_implementation={impl!r}; under context parallelism every attention layer must go "
            f"through '{backend}', which runs the ring (call hf_sparse_cp.patch() and hf_sparse_cp.configure(model))."
        )
    if getattr(config, "attn_logit_softcapping", None) is not None:
        raise ValueError(f"{name} soft-caps attention logits, which the sparse kernels do not implement.")
    bidirectional = [n for n, m in model.named_modules() if getattr(m, "is_causal", True) is False]
    if bidirectional:
        raise ValueError(
            f"{name} has bidirectional attention layers ({bidirectional[0]}, ...); the ring computes causal "
            "self-attention only."
        )
