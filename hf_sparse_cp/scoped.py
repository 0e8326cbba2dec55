"""A context variable set for the code a `with` block runs, and as it was after (one thread's or task's setting)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from typing import TypeVar

T = TypeVar("T")


@contextlib.contextmanager
def scoped(var: ContextVar[T], value: T) -> Iterator[None]:
    """Inside the block `var` is `value`; after it, what it was before (also when the block raises)."""
    token = var.set(value)
    try:
        yield
    finally:
        var.reset(token)
