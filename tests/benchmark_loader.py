"""Benchmarks are scripts, not package modules: tests load them from benchmarks/ by path."""

import contextlib
import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@contextlib.contextmanager
def load_benchmark(name: str) -> Iterator[ModuleType]:
    """The module benchmarks/<name>.py, registered in sys.modules while in use (dataclasses resolve
    their module while the file executes)."""
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)
