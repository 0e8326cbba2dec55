"""The single-process attention engine: token metadata, layouts, pattern estimation, exact
block-sparse attention (Triton kernels or FlexAttention on CUDA, a PyTorch reference elsewhere) and
the merge of partial results. Nothing here knows about transformers or process groups.

* `tokens.py`: `TokenMeta` (global order and document of every token) and how it is derived;
* `layout.py`: `SparseLayout`, the contract with the kernels and the ring, and the input checks;
* `build.py`: layout construction (`build_layout`, `dense_layout`);
* `estimate.py`: vertical-slash pattern estimation (`estimate_layout`);
* `ops.py`: `block_sparse_attention` and the per-step primitives;
* `engines.py`: which engine computes a call (the setting, `auto` and its timing table; `register_engine`);
* `flex.py`: the FlexAttention engine;
* `reference.py`, `merge.py`, `dense.py`, `precision.py`.
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
