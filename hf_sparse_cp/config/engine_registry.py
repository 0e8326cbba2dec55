"""The attention engines by name, as `SparseAttentionConfig.attention_engine` names them: the registry that
`hf_sparse_cp.attention.engines` fills (its built-in engines, then any `register_engine` adds), kept here so that a
config checks its value against it without importing the engines, which import the config."""

from __future__ import annotations

import importlib
from typing import Any

# name -> engine (an `hf_sparse_cp.attention.engines.Engine`), in the order 'auto' walks them
ENGINES: dict[str, Any] = {}
BUILTIN_ENGINES = "hf_sparse_cp.attention.engines"  # the module that registers the built-in engines


def engine_settings() -> tuple[str, ...]:
    """The values `attention_engine` takes: 'auto' (chosen per call) and every registered engine's name. The
    built-in engines register when their module is imported, which this makes sure of (as `sections._registered`
    does for the budget modes)."""
    importlib.import_module(BUILTIN_ENGINES)
    return ("auto", *ENGINES)
