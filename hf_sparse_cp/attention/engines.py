"""Which engine computes a block-sparse attention call: the Triton kernels, FlexAttention or the reference.

The setting (`SparseAttentionConfig.attention_engine`, or the `implementation` argument of the
attention functions) names one, or 'auto'; `$HF_SPARSE_CP_ATTENTION_ENGINE` replaces 'auto' (the
project's one override mechanism, `hf_sparse_cp.backends.choose_backend`). 'auto' decides per call:

* tensors off CUDA, and CUDA inputs the kernels cannot take (fp64, head_dim above 128), run the
  PyTorch reference (the latter with a warning);
* on CUDA it picks the faster of the kernels and Flex for the call's shape from a measured timing
  table (`$HF_SPARSE_CP_ENGINE_TABLE`, the JSON `benchmarks/bench_attention.py` writes, e.g. through
  `benchmarks/gpu_session.sh quick`): among the table's rows for this GPU whose layouts list key
  columns exactly when this call's does, the nearest sequence length, then the nearest kept fraction
  (rows of the call's head_dim first). Without a table for this GPU, or without such a row, the
  default is the Triton kernels: the engine the earlier releases ran, and the one that gathers single
  key columns (Flex computes a column as part of a 128-key tile of a gathered buffer);
* without FlexAttention in this torch, always the kernels.
"""

from __future__ import annotations

import functools
import json
import math
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from ..backends import choose_backend
from .flex import is_flex_available
from .layout import SparseLayout

ENGINE_ENV = "HF_SPARSE_CP_ATTENTION_ENGINE"
TABLE_ENV = "HF_SPARSE_CP_ENGINE_TABLE"
ENGINES = ("auto", "triton", "flex", "reference")
# What the engine table's file says it is (`benchmarks/bench_attention.py` writes it).
TABLE_KIND = "hf_sparse_cp engine table"
DEFAULT_ENGINE = "triton"


@dataclass(frozen=True)
class CallShape:
    """What 'auto' compares with the table: query length, kept fraction of the causal blocks, whether
    the layout lists key columns, head_dim."""

    seq_len: int
    kept_fraction: float
    has_columns: bool
    head_dim: int

    @classmethod
    def of(cls, q: torch.Tensor, layout: SparseLayout) -> CallShape:
        """The shape of attention of q over `layout` (one host synchronization)."""
        kept, columns = torch.stack([layout.kept_fraction(), layout.col_cnt.sum().double()]).tolist()
        return cls(q.shape[2], kept, columns > 0, q.shape[-1])


@functools.cache
def _read_table(path: str, version: tuple[int, int]) -> dict:
    del version  # (modification time, size): part of the cache key only, so that a rewritten file is read again
    try:
        table = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"${TABLE_ENV}={path!r} is not a readable engine table ({e}); point it at the engine "
                         "table JSON that benchmarks/bench_attention.py writes, or unset it.") from None
    if not isinstance(table, dict) or table.get("kind") != TABLE_KIND or not isinstance(table.get("rows"), list):
        raise ValueError(f"${TABLE_ENV}={path!r} is not an engine table (its 'kind' must be {TABLE_KIND!r}); point "
                         "it at the file benchmarks/bench_attention.py writes, or unset it.")
    return table


def engine_table() -> dict | None:
    """The timing table `$HF_SPARSE_CP_ENGINE_TABLE` names (read again when the file changes), or None."""
    path = os.environ.get(TABLE_ENV)
    if not path:
        return None
    if not Path(path).is_file():
        raise ValueError(f"${TABLE_ENV}={path!r} does not exist; point it at the engine table that "
                         "benchmarks/bench_attention.py writes, or unset it.")
    stat = Path(path).stat()
    return _read_table(path, (stat.st_mtime_ns, stat.st_size))


def pick_from_table(table: dict | None, device: str, shape: CallShape) -> str:
    """'triton' or 'flex' for a call of `shape` on `device` (a GPU's name), from `table`'s rows
    ({device, seq_len, kept_fraction, has_columns, head_dim, triton_ms, flex_ms}) as the module
    docstring says; DEFAULT_ENGINE without a matching row."""
    rows = [r for r in (table or {}).get("rows", ())
            if table.get("device") == device and bool(r["has_columns"]) == shape.has_columns]
    if not rows:
        return DEFAULT_ENGINE
    same_dim = [r for r in rows if r["head_dim"] == shape.head_dim]
    rows = same_dim or rows
    nearest = min(abs(math.log2(r["seq_len"] / shape.seq_len)) for r in rows)
    rows = [r for r in rows if abs(math.log2(r["seq_len"] / shape.seq_len)) == nearest]
    row = min(rows, key=lambda r: abs(r["kept_fraction"] - shape.kept_fraction))
    return "flex" if row["flex_ms"] < row["triton_ms"] else "triton"


def resolve_engine(q: torch.Tensor, layout: SparseLayout, implementation: str = "auto") -> str:
    """The engine of one call: 'triton', 'flex' or 'reference'.

    Args:
        q: the queries [B, Hq, Sq, D] (device, dtype and head_dim decide what can run them).
        layout: the call's layout (its kept fraction and columns, for 'auto' on CUDA).
        implementation: 'auto', 'triton', 'flex' or 'reference'; 'auto' gives way to
            `$HF_SPARSE_CP_ATTENTION_ENGINE` when that is set.

    Returns:
        The engine name. 'triton' means the kernels whatever the device (on CPU inside Triton's
        interpreter); 'flex' needs a torch with FlexAttention.
    """
    if implementation not in ENGINES:
        raise ValueError(f"implementation={implementation!r} is unknown; use one of {ENGINES}.")
    given = None if implementation == "auto" else implementation
    engine = choose_backend("Attention engine", ENGINE_ENV, ENGINES, given)
    if engine == "flex" and not is_flex_available():
        raise ValueError(f"the flex engine needs torch.nn.attention.flex_attention (torch >= 2.6; this is torch "
                         f"{torch.__version__}); use 'auto' or 'triton'.")
    if engine != "auto":
        return engine
    if not q.is_cuda:
        return "reference"
    from ..kernels.ops import unsupported

    reason = unsupported(q)
    if reason is not None:
        warnings.warn(f"block-sparse attention on CUDA uses the PyTorch reference (slow) for {reason}.", stacklevel=3)
        return "reference"
    if not is_flex_available():
        return "triton"
    table = engine_table()
    if table is None:
        return DEFAULT_ENGINE
    return pick_from_table(table, torch.cuda.get_device_name(q.device), CallShape.of(q, layout))
