"""The "did you mean" rule of every refusal that names a close match (an unknown key, flag, file or recipe name):
a leaf, imported by the config files and the shipped recipes alike, without torch."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def closest_names(key: str, known: Iterable[str], prefix: str = "") -> list[str]:
    """The names among `known` closest to `key`, all those as close as the closest (slash_top: slash_topk and
    slash_topp), [] for none: a typo of the name (verticle_topk, densty) or the name without its first word (mode for
    cp_mode), at least 0.75 alike by difflib's ratio. A name as close whole beats one as close only without its first
    word (--skip_memory_metrics, not also --no_skip_memory_metrics, for --skip_memory_metric). `prefix` goes before
    both (a flag's '--': a short flag is then close to its longer one, --bf to --bf16)."""
    def ratio(name: str) -> tuple[float, bool]:  # (how alike, and whether whole)
        whole = difflib.SequenceMatcher(None, prefix + key, prefix + name).ratio()
        part = difflib.SequenceMatcher(None, prefix + key, prefix + name.partition("_")[2]).ratio()
        return max(whole, part), whole >= part

    ratios = {name: ratio(name) for name in known}
    best = max(ratios.values(), default=(0.0, True))
    return [name for name, alike in ratios.items() if alike == best] if best[0] >= 0.75 else []
