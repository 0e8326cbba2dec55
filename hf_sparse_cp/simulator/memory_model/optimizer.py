"""The optimizer's bytes: its state (AdamW's moments, SMET's compact state, LoRA's adapters') and its step's
temporaries."""

from __future__ import annotations

from .architecture import Architecture
from .settings import StepSettings


def optimizer_state_bytes(arch: Architecture, s: StepSettings) -> float:
    w = s.weight_bytes
    if s.optimizer == "none":
        return 0.0
    if s.lora is not None:  # the adapters' fp32 moments (SMET with LoRA is refused)
        return 2 * s.lora.params(arch.shape) * 4 / s.fsdp
    if s.optimizer == "adamw":
        return 2 * arch.params * w / s.fsdp
    # SMET: compact moments of the active blocks of every layer matrix, an index and a step counter per block
    dense = arch.params - arch.shape.layers * arch.shape.layer_params
    sparse = arch.shape.layers * arch.shape.layer_params
    blocks = sparse / s.smet_block_size * s.smet_density
    return (2 * dense * w + 2 * s.smet_density * sparse * w + blocks * (4 + 4)) / s.fsdp


def optimizer_temporary_bytes(arch: Architecture, s: StepSettings) -> float:
    """AdamW's step: foreach keeps a temporary of every parameter (the denominators); the per-tensor step
    two temporaries of the largest parameter (the embedding unless `largest_param`)."""
    w = s.weight_bytes
    if s.optimizer == "none":
        return 0.0
    if s.lora is not None:  # (the adapters': fp32)
        return (s.lora.params(arch.shape) if s.device == "cuda" else 2 * s.lora.largest_param(arch.shape)) * 4 / s.fsdp
    if s.device == "cuda":
        return arch.params * w / s.fsdp
    return 2 * max(arch.embedding_params, arch.largest_param) * w / s.fsdp
