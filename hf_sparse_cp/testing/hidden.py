"""Installed packages hidden from imports, as on a machine without them: `HF_SPARSE_CP_TEST_HIDE=triton` runs the
tests (or a command) as on macOS, Windows or a CPU-only install, where Triton is not installed."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable

HIDE_ENV = "HF_SPARSE_CP_TEST_HIDE"


def hide(names: Iterable[str]) -> None:
    """Make `names` unimportable in this process from now on, as when they are not installed: `import name` raises
    ModuleNotFoundError and `importlib.util.find_spec(name)` returns None (a `None` entry in `sys.modules`, Python's
    own way to halt an import). None of them may be imported yet."""
    names = [name for name in names if name]
    loaded = sorted(m for m in sys.modules if any(m == n or m.startswith(n + ".") for n in names))
    if loaded:
        raise RuntimeError(f"${HIDE_ENV}: {', '.join(loaded)} already imported; hide packages before importing them.")
    for name in names:
        sys.modules[name] = None


def hide_from_environment() -> list[str]:
    """Hide the comma-separated packages `$HF_SPARSE_CP_TEST_HIDE` names (none when unset); returns them."""
    names = [name.strip() for name in os.environ.get(HIDE_ENV, "").split(",") if name.strip()]
    if names:
        hide(names)
    return names
