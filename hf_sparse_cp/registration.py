"""`patch()` / `unpatch()`: register the `sparse_cp` backend with transformers, reversibly.

Registration goes through the public `AttentionInterface.register` and
`AttentionMaskInterface.register`. The mask function is transformers' own flash-style one: it
hands the backend the 2D padding mask (or None) instead of a [S, S] mask, and the backend applies
causality and document boundaries itself.
"""

from __future__ import annotations

from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

from .attention import sparse_cp_attention_forward
from .patching import PatchSet

BACKEND_NAME = "sparse_cp"

_active: PatchSet | None = None


def _register(patches: PatchSet, interface: type, fn) -> None:
    registry = interface()
    previous = registry[BACKEND_NAME] if BACKEND_NAME in registry else None

    def restore() -> None:
        if previous is not None:
            interface.register(BACKEND_NAME, previous)
        else:
            # transformers has no public unregister; removing our own key is the only way back.
            interface._global_mapping.pop(BACKEND_NAME, None)

    interface.register(BACKEND_NAME, fn)
    patches.on_undo(restore)


def patch(fused_loss: bool = True) -> None:
    """Register `attn_implementation="sparse_cp"` (and, by default, the memory-lean causal-LM loss).

    Idempotent: a second call does nothing. `unpatch()` restores the previous state.
    """
    global _active
    if _active is not None:
        return
    patches = PatchSet()
    try:
        _register(patches, AttentionInterface, sparse_cp_attention_forward)
        _register(patches, AttentionMaskInterface, flash_attention_mask)
        if fused_loss:
            from .loss import patch_causal_lm_loss

            patch_causal_lm_loss(patches)
    except BaseException:
        patches.undo()  # leave transformers as it was
        raise
    _active = patches


def unpatch() -> None:
    """Undo everything `patch()` did; a no-op when not patched."""
    global _active
    if _active is None:
        return
    _active.undo()
    _active = None


def is_patched() -> bool:
    return _active is not None
