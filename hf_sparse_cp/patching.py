"""Reversible patches, recorded in one place so `unpatch()` can undo exactly what `patch()` did."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_MISSING = object()


class PatchSet:
    """A stack of undo actions; `undo()` runs them in reverse order."""

    def __init__(self) -> None:
        self._undo: list[Callable[[], None]] = []

    def set_attr(self, owner: Any, name: str, value: Any) -> None:
        """Set `owner.name = value`, remembering the previous value (or its absence)."""
        previous = owner.__dict__.get(name, _MISSING) if isinstance(owner, type) else getattr(owner, name, _MISSING)

        def restore() -> None:
            if previous is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, previous)

        setattr(owner, name, value)
        self._undo.append(restore)

    def on_undo(self, action: Callable[[], None]) -> None:
        self._undo.append(action)

    def undo(self) -> None:
        while self._undo:
            self._undo.pop()()
