"""Public names of a package that are imported on first access (PEP 562), so importing the package
does not import transformers' Trainer stack until a Trainer-facing name is used."""

from __future__ import annotations

import importlib
from collections.abc import Callable


def lazy_attributes(package: str, where: dict[str, str]) -> Callable[[str], object]:
    """A module `__getattr__` for `package` that loads each name of `where` (name -> submodule,
    relative to `package`) on first access."""

    def __getattr__(name: str) -> object:
        if name in where:
            return getattr(importlib.import_module(f"{package}.{where[name]}"), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
