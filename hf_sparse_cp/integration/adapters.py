"""Whether a model trains a PEFT adapter, however the adapter was added (what the checkpoint checks count as one)."""

from __future__ import annotations

import sys
from typing import Any


def has_adapter(model: Any) -> bool:
    """Whether `model` trains a PEFT adapter: a PEFT model of any kind (`PeftModel`, `PeftMixedModel`, wrapped or not)
    or one with PEFT's tuner layers (an adapter transformers' `add_adapter` or PEFT's `inject_adapter_in_model` put
    in). A model has one only where `peft` was imported."""
    peft = sys.modules.get("peft")
    if peft is None:
        return False
    from peft.tuners.tuners_utils import BaseTunerLayer

    kinds = (peft.PeftModel, peft.PeftMixedModel, BaseTunerLayer)
    return any(isinstance(module, kinds) for module in model.modules())
