"""The single-process attention engine: token metadata, layouts, pattern estimation, exact
block-sparse attention (Triton kernels or FlexAttention on CUDA, a PyTorch reference elsewhere) and
the merge of partial results. Nothing here knows about transformers or process groups.

* `tokens.py`: `TokenMeta` (global order and document of every token) and how it is derived;
* `layout.py`: `SparseLayout`, the contract with the kernels and the ring, and the input checks;
* `build.py`: layout construction (`build_layout`, `dense_layout`);
* `estimate.py`: vertical-slash pattern estimation (`estimate_layout`), from the scores of `scoring.py` (exact
  sums: `exact.py`) and the budget modes of `budgets/`;
* `sequence.py`: a whole sequence's attention in one process (the pattern estimated, then exact attention over it);
* `ops.py`: `block_sparse_attention` and the per-step primitives, on one call (`call.py`);
* `engines.py`: which engine computes a call (the setting, `auto` and its timing table; `register_engine`);
* `flex.py`: the FlexAttention engine; `reference.py`: the PyTorch reference; `masked.py`: dense arithmetic with the
  layout as a mask; `opaque.py`: attention over a layout as one custom op, for graphs torch.compile traces;
* `merge.py`, `dense.py`, `precision.py`, `sinks.py` (learned attention sinks), `chunks.py` (work in pieces).
"""

from .build import build_layout, dense_layout
from .call import AttentionCall
from .engines import Engine, register_engine
from .estimate import estimate_layout
from .layout import SparseLayout
from .merge import merge_attention
from .ops import attention_backward, attention_forward, block_sparse_attention
from .reference import reference_backward, reference_forward, reference_vertical_slash
from .tokens import TokenMeta

__all__ = [
    "AttentionCall",
    "Engine",
    "SparseLayout",
    "TokenMeta",
    "attention_backward",
    "attention_forward",
    "block_sparse_attention",
    "build_layout",
    "dense_layout",
    "estimate_layout",
    "merge_attention",
    "reference_backward",
    "reference_forward",
    "reference_vertical_slash",
    "register_engine",
]
