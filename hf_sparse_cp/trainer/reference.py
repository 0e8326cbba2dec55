"""The reference model a TRL Trainer keeps beside the model it trains attends as that model does.

TRL's DPO, KTO, GRPO and RLOO trainers compare the trained model's log-probabilities with those of a frozen
reference (`trainer.ref_model`), the model as it was before training. Without PEFT, TRL loads that reference
again from the model's path, after the Trainer's `__init__` where the plugin switched the trained model to
`sparse_cp`: the reference then attends with the model's stock implementation. The two would differ by the
sparse pattern's approximation before any step (DPO's rewards and loss at step 1 away from 0 and log 2), a
bias in every reward, where TRL's reference under PEFT (the trained model with its adapters disabled) attends
with the pattern. So before the Trainer runs, the reference gets the trained model's pattern.
"""

from __future__ import annotations

import dataclasses
import logging

import torch
from transformers import Trainer

from ..config import BACKEND_NAME, SparseAttentionConfig
from ..integration import upstream
from ..integration.layer_settings import model_config_for
from .arguments import SparseCPArguments
from .attach import enable_sparse_attention
from .whole_rows import REFERENCE_MODEL

logger = logging.getLogger(__name__)


def attend_like_trained_model(trainer: Trainer, sparse_args: SparseCPArguments, max_length: int | None) -> None:
    """Switch `trainer.ref_model` (when it has one) to `sparse_cp` with the pattern of the model it trains, when
    that model runs `sparse_cp` and the reference does not yet run it with that pattern (TRL loads it with the trained
    model's `attn_implementation`, so with `sparse_cp`'s default pattern); `disable_sparse_attention(trainer.ref_model)`
    undoes it. `sparse_args`, `max_length`: the plugin's switches and the sequence length of the trained model (the
    fused ops and token tiles run on the reference alike; its `--sparse_config` is already read into the trained
    model's pattern, and a model that never runs backward offloads nothing for it)."""
    reference = getattr(trainer, REFERENCE_MODEL, None)
    if not isinstance(reference, torch.nn.Module):
        return
    reference, trained = trainer.accelerator.unwrap_model(reference), trainer.accelerator.unwrap_model(trainer.model)
    if upstream.attn_implementation(getattr(trained, "config", None)) != BACKEND_NAME:
        return
    pattern = model_config_for(trained)
    previous = upstream.attn_implementation(reference.config)
    # (TRL loads the reference with the trained model's attn_implementation, so `sparse_cp` without its pattern: the
    # default one, another block size and budget)
    stored = SparseAttentionConfig.stored_on(reference.config) if previous == BACKEND_NAME else None
    if stored is not None and stored.to_dict() == pattern.to_dict():
        return
    switches = dataclasses.replace(sparse_args, sparse_config=None, sparse_offload_layer_inputs=False)
    enable_sparse_attention(reference, switches, pattern, trainer.args, max_length)
    if trainer.is_world_process_zero():
        was = (f"{previous!r}" if previous != BACKEND_NAME else
               "the default pattern it was loaded with" if stored is None else "the pattern it was configured with")
        logger.warning("%s.%s (the frozen reference it compares the trained model with) attends with sparse_cp and "
                       "the trained model's pattern, not %s: the two are one model before the first step.",
                       type(trainer).__name__, REFERENCE_MODEL, was)
