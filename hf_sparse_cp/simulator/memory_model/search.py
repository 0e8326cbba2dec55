"""The longest sequence whose predicted step fits a memory budget (`longest_fitting_length`)."""

from __future__ import annotations

from collections.abc import Callable

from .architecture import Architecture
from .settings import StepSettings
from .step import predict_step_memory

# The longest length `longest_fitting_length` tries (2^40 tokens): far beyond any GPU's, so that an answer at it says
# "at least" (the command line says so) rather than standing for a length that did not fit.
SEARCH_LIMIT = 1 << 40


def longest_fitting_length(arch: Architecture, budget_bytes: float,
                           settings: StepSettings | Callable[[int], StepSettings] | None = None,
                           granularity: int = 1024, limit: int = SEARCH_LIMIT) -> int:
    """The longest sequence, a multiple of `granularity` x CP size and at most `limit`, whose predicted peak stays
    within `budget_bytes` on each rank; 0 when not even the first multiple fits.

    Args:
        arch: the model. budget_bytes: usable bytes of one device.
        settings: the step's settings, or a function of the sequence length giving them (settings
            that change with the length: token tiles from a threshold on, pattern budgets).
        granularity: tokens per rank the answer is a multiple of. limit: longest length tried (an answer
            within one multiple of it may be bounded by it rather than by the memory).

    The peak grows with the length (for settings that change with it, the answer is the longest
    length before the first that does not fit, found by doubling then bisecting)."""
    if callable(settings):
        settings_for = settings
    else:
        fixed = settings or StepSettings()
        settings_for = lambda _: fixed
    cp = settings_for(granularity).cp
    unit = granularity * cp

    def fits(n: int) -> bool:
        return predict_step_memory(arch, n * unit, settings_for(n * unit)).peak_bytes <= budget_bytes

    if not fits(1):
        return 0
    lo, hi = 1, 2
    while hi * unit <= limit and fits(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, limit // unit + 1)  # the doubling may stop at the limit: bisect up to it, not below it
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo * unit
