"""What the modes with head groups share (`HeadGroupMode`): their checks of the model's heads and their
description."""

from __future__ import annotations

from ...config import language_config
from ..heads.split import HeadSplit
from .base import CPMode, cp_mode_named


class HeadGroupMode(CPMode):
    """A mode whose head groups split the attention heads (`heads/`)."""

    def check_model(self, model_config, head_size: int) -> None:
        model_config = language_config(model_config)  # (a composite model's heads are its language model's)
        heads = model_config.num_attention_heads
        HeadSplit(heads, getattr(model_config, "num_key_value_heads", None) or heads, head_size)

    def runs_as(self, head_size: int, cp_size: int) -> CPMode:
        """Head groups of one rank are the ring's layout, and one head group of the whole CP group is ulysses's."""
        if head_size == 1:
            return cp_mode_named("ring")
        return cp_mode_named("ulysses") if head_size == cp_size else self

    def describe(self, parallel) -> str:
        return (f"head-parallel (Ulysses) over {parallel.head_size} ranks: an all-to-all gives each rank the whole "
                "sequence of its share of the heads")
