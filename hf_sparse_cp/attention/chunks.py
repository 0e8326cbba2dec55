"""Work in pieces whose temporaries stay within an element budget."""

from __future__ import annotations


def head_chunks(heads: int, per_head: int, elements: int) -> list[slice]:
    """Slices of `heads` heads whose [heads, per_head] temporaries hold at most `elements` elements (one head at
    least)."""
    step = max(1, min(heads, elements // max(1, per_head)))
    return [slice(h0, min(heads, h0 + step)) for h0 in range(0, heads, step)]
