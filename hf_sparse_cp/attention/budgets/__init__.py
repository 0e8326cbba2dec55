"""Budget modes: how many key columns and diagonals each head keeps. One module per mode behind one
interface (`base.Budget`), registered here by name (`hf_sparse_cp.config.sections.register_budget`; the first
one's fields come first on the flag page), and `naive.py`, a dense fp64 selection per mode that the tests
hold them against."""

from ...config.sections import register_budget
from .base import Budget, Entries, rank_order, top_entries
from .mass import Mass
from .ranked import TopK, TopP

for _budget in (TopK, TopP, Mass):
    register_budget(_budget)

__all__ = ["Budget", "Entries", "Mass", "TopK", "TopP", "rank_order", "top_entries"]
