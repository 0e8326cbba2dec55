"""`patch()` / `unpatch()`: register the `sparse_cp` backend with transformers, reversibly.

Registration goes through the public `AttentionInterface.register` and
`AttentionMaskInterface.register`. The mask function is transformers' flash-style one
(`call_tokens.sparse_cp_mask`, which adds a mask of ones where a StaticCache holds fewer tokens than key
slots): it hands the backend the 2D padding mask (or None) instead of a [S, S] mask, and the backend
applies causality and document boundaries itself. `patch()` registers the backend and nothing else; the
memory-lean causal-LM loss is its own opt-in (`hf_sparse_cp.enable_lean_loss()`). Apart from
`registration.py` (`configure`), so that the model checks (`models.py`) can register it for a probe.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from ..config import BACKEND_NAME
from . import upstream
from .backend import is_registered, sparse_cp_attention_forward
from .call_tokens import sparse_cp_mask
from .patching import PatchSet

_active: PatchSet | None = None


def _register(patches: PatchSet, interface: type, fn) -> None:
    registry = interface()
    previous = registry[BACKEND_NAME] if BACKEND_NAME in registry else None

    def restore() -> None:
        if BACKEND_NAME not in interface() or interface()[BACKEND_NAME] is not fn:
            return  # registered anew after us: leave it
        if previous is not None:
            interface.register(BACKEND_NAME, previous)
        else:
            upstream.unregister(interface, BACKEND_NAME)

    interface.register(BACKEND_NAME, fn)
    patches.on_undo(restore)


def patch() -> None:
    """Register `attn_implementation="sparse_cp"` with transformers (attention and mask functions).

    Idempotent: a second call does nothing. `unpatch()` restores the previous registrations.
    """
    global _active
    if _active is not None:
        return
    patches = PatchSet()
    try:
        _register(patches, AttentionInterface, sparse_cp_attention_forward)
        _register(patches, AttentionMaskInterface, sparse_cp_mask)
    except BaseException:
        patches.undo()  # leave transformers as it was
        raise
    _active = patches


def unpatch() -> None:
    """Undo what `patch()` did (a registration made by someone else after it stays); a no-op when
    not patched."""
    global _active
    if _active is None:
        return
    _active.undo()
    _active = None


def is_patched() -> bool:
    """Whether `patch()` registered the backend and `unpatch()` has not undone it since."""
    return _active is not None


@contextlib.contextmanager
def registered_for_a_check() -> Iterator[None]:
    """The backend registered with transformers inside the block (`patch()`) where it is not, and unregistered after
    (a model check's probe, before the user has called `patch()`)."""
    registered = is_registered()
    if not registered:
        patch()
    try:
        yield
    finally:
        if not registered:
            unpatch()
