"""The engines that compute a block-sparse attention call, registered by name (`ENGINES`): the Triton
kernels, FlexAttention, the PyTorch reference and the dense masked form (`masked.py`), each taking the call as
one `AttentionCall` and saying why it cannot run (`Engine.missing`) or why 'auto' should not give it a call
(`Engine.declines`: the masked form is named only); and which one computes a call (`resolve_engine`, the choice
logged once with the reasons of the others).

The setting (`SparseAttentionConfig.attention_engine`, or the `implementation` argument of the
attention functions) names one, or 'auto'; `$HF_SPARSE_CP_ATTENTION_ENGINE` replaces 'auto' (the
project's one override mechanism, `hf_sparse_cp.backends.choose_backend`). 'auto' walks the registry:

* the kernels and Flex decline tensors off CUDA, and CUDA inputs the kernels cannot take (fp64,
  head_dim above 256), which then run the PyTorch reference (on CUDA with a warning); Flex also declines
  when this torch has no FlexAttention, the kernels on a GPU with less shared memory than their tiles take
  (`kernels.limits.shared_memory_shortfall`: A10, L4, RTX 30/40; an A100 above head_dim 128), where Flex takes
  their calls;
* a layout that lists key columns (a vertical-slash layer) runs the Triton kernels: the flex engine
  computes columns as 128-key tiles of a gathered buffer under a per-element mask, which was measured
  slower than the kernels on every such layout and slower than dense Flex on a 5%-kept one
  (benchmarks/results/README.md), so auto leaves that path out;
* for a layout without columns (dense layers, a block pattern) that both may run, it picks the faster of
  the kernels and Flex for the call's shape from a measured timing table (`$HF_SPARSE_CP_ENGINE_TABLE`, the
  JSON `benchmarks/bench_attention.py` writes, e.g. through `benchmarks/gpu_session.sh quick`): among the
  table's rows for this GPU without columns and of the call's head_dim, the nearest sequence length, then the
  nearest kept fraction. Without a table for this GPU, or without such a row, the default is the Triton
  kernels, the engine the earlier releases ran: rows of another head_dim do not decide (the H200's tables of
  head_dim 128, within 1-3% between the engines, picked Flex in one session and the kernels in the next for the
  0.5B model's dense first layer at head_dim 64).
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch

from ..backends import TRITON_INSTALL, choose_backend, is_triton_available, require_triton
from ..config.registries import ENGINES, engine_settings, register_in
from .call import AttentionCall
from .flex import flex_backward, flex_block_sparse_attention, flex_forward, is_flex_available
from .layout import SparseLayout
from .masked import masked_backward, masked_forward
from .merge import merge_attention
from .reference import reference_backward, reference_forward
from .tokens import TokenMeta

logger = logging.getLogger(__name__)

ENGINE_ENV = "HF_SPARSE_CP_ATTENTION_ENGINE"
TABLE_ENV = "HF_SPARSE_CP_ENGINE_TABLE"
# What the engine table's file says it is (`benchmarks/bench_attention.py` writes it).
TABLE_KIND = "hf_sparse_cp engine table"
DEFAULT_ENGINE = "triton"


class Engine:
    """What computes attention over a layout (see `hf_sparse_cp.attention.ops` for the arguments): `forward`
    merges into a running (out, lse) when given; `backward` takes the final out and lse of the queries.
    `differentiable`: the engine differentiates its calls itself (`attention`), not through the plugin's
    autograd Function."""

    name: ClassVar[str]
    differentiable: ClassVar[bool] = False

    def missing(self) -> str | None:
        """Why this engine cannot run in this installation at all (None: it can)."""
        return None

    def declines(self, q: torch.Tensor) -> str | None:
        """Why 'auto' does not give this engine a call with queries `q` (their device, dtype, head_dim; None:
        it may), the installation's reason first."""
        return self.missing()

    def device_refusal(self, device_type: str) -> str | None:
        """Why this engine cannot train on `device_type` devices ('cuda', 'cpu', ...; None: it can)."""
        return None

    def forward(self, call: AttentionCall, out=None, lse=None, out_in_input_dtype: bool = False):
        """(out, lse) of `call` (`part`), merged with a running `out` and `lse` when given (`merge_attention`), its
        out in q's dtype with `out_in_input_dtype`."""
        part = _returned(self, "part", self.part(call), [call.q.shape, call.q.shape[:-1]], "(out, lse)")
        if out is not None:
            return merge_attention(out, lse, *part)
        return (part[0].to(call.q.dtype), part[1]) if out_in_input_dtype else part

    def backward(self, call: AttentionCall, out, lse, dout, dlse=None, deterministic=None,
                 grads_in_input_dtype: bool = False):
        """(dq, dk, dv) of `call` (`part_grads`) from the queries' final `out` and `lse`, in the inputs' dtypes with
        `grads_in_input_dtype`; `deterministic` matters to an engine with a faster nondeterministic backward (the
        kernels): this one ignores it."""
        grads = _returned(self, "part_grads", self.part_grads(call, out, lse, dout, dlse),
                          [x.shape for x in call[:3]], "(dq, dk, dv)")
        return tuple(g.to(x.dtype) for g, x in zip(grads, call[:3])) if grads_in_input_dtype else grads

    def part(self, call: AttentionCall) -> tuple[torch.Tensor, torch.Tensor]:
        """(out, lse) of the call alone, in the compute dtype."""
        raise NotImplementedError

    def part_grads(self, call: AttentionCall, out, lse, dout, dlse) -> tuple[torch.Tensor, ...]:
        """(dq, dk, dv) of the call, in the compute dtype."""
        raise NotImplementedError


def _returned(engine: Engine, method: str, result: Any, shapes: list[torch.Size], what: str) -> Any:
    """`result`, what `engine.method` returned, where it is a tuple of tensors of `shapes` (`what` names them); else
    TypeError naming the engine, the method and what it must return (a plug-in's mistake otherwise ended in the
    merge or the autograd function: 'NoneType' object is not subscriptable)."""
    if (isinstance(result, (tuple, list)) and len(result) == len(shapes)
            and all(isinstance(t, torch.Tensor) and t.shape == shape for t, shape in zip(result, shapes))):
        return result
    got = (", ".join(f"{t.dtype} {list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__ for t in result)
           if isinstance(result, (tuple, list)) else type(result).__name__)
    raise TypeError(f"attention engine {engine.name!r} ({type(engine).__qualname__}.{method}) returned {got}: it must "
                    f"return {what}, tensors of shapes {', '.join(str(list(s)) for s in shapes)}.")


def kernel_split(layout: SparseLayout, q_meta: TokenMeta, k_meta: TokenMeta, window: int | None):
    """The kernels' full/partial split of `layout` for these tokens (`kernels.indexing.split_layout`),
    computed once and kept on the layout (`SparseLayout.derived`): a layer's forward and backward and
    the ring steps that reuse a layout share it."""
    from ..kernels.indexing import split_layout

    tokens = (q_meta.index, q_meta.segment, k_meta.index, k_meta.segment)
    return layout.derived("kernel_split", tokens, window,
                          lambda: split_layout(layout.block_idx, layout.block_cnt, layout.col_idx, layout.col_cnt,
                                               *tokens, layout.block_size, window))


class TritonEngine(Engine):
    """Our Triton kernels (`hf_sparse_cp.kernels.ops`); they merge into (out, lse) in place, in one pass."""

    name = "triton"

    def missing(self):
        return None if is_triton_available() else f"needs Triton, not installed or too old: {TRITON_INSTALL}"

    def declines(self, q):
        if not q.is_cuda:
            return f"{q.device.type} tensors (the kernels train on CUDA; elsewhere they run in Triton's interpreter)"
        return self.missing() or _kernels_unsupported(q)

    def device_refusal(self, device_type):
        if device_type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1":  # (the interpreter: tests, debugging)
            return None
        return "Triton's kernels train on CUDA GPUs (Triton's interpreter, a test tool, runs them elsewhere)"

    def forward(self, call, out=None, lse=None, out_in_input_dtype=False):
        require_triton("The attention engine 'triton' (our kernels)")
        from ..kernels.ops import triton_forward

        call.check()
        return triton_forward(call.q, call.k, call.v, *self._raw(call), scale=call.scale,
                              block_size=call.layout.block_size, window=call.sliding_window, out=out, lse=lse,
                              out_in_input_dtype=out_in_input_dtype, split=self._split(call))

    def backward(self, call, out, lse, dout, dlse=None, deterministic=None, grads_in_input_dtype=False):
        require_triton("The attention engine 'triton' (our kernels)")
        from ..kernels.ops import triton_backward

        call.check()
        return triton_backward(call.q, call.k, call.v, out, lse, dout, *self._raw(call), scale=call.scale,
                               block_size=call.layout.block_size, window=call.sliding_window, dlse=dlse,
                               deterministic=deterministic, grads_in_input_dtype=grads_in_input_dtype,
                               split=self._split(call))

    @staticmethod
    def _raw(call: AttentionCall) -> tuple[tuple, tuple, tuple]:
        layout, tokens = call.layout, call.tokens()
        return (layout.block_idx, layout.block_cnt, layout.col_idx, layout.col_cnt), tokens[:2], tokens[2:]

    @staticmethod
    def _split(call: AttentionCall):
        return kernel_split(call.layout, call.q_meta, call.k_meta, call.sliding_window)


class FlexEngine(Engine):
    """FlexAttention (`flex.py`): a layer's own calls differentiate through Flex's backward (CUDA only)."""

    name = "flex"
    differentiable = True

    def missing(self):
        if not is_flex_available():
            return f"needs torch.nn.attention.flex_attention (torch >= 2.6; this is torch {torch.__version__})"
        return None

    def declines(self, q):
        if not q.is_cuda:
            return f"{q.device.type} tensors (Flex trains on CUDA only: torch has no Flex backward elsewhere)"
        # 'auto' offers Flex the calls the kernels could take (it weighs the two by their measured times; without
        # Triton, or on a GPU without the kernels' shared memory, Flex takes them in the kernels' place)
        return self.missing() or _kernels_unsupported(q, on_this_gpu=False)

    def device_refusal(self, device_type):
        if device_type == "cuda":
            return None
        return "FlexAttention trains on CUDA only (torch has no Flex backward elsewhere)"

    def part(self, call):
        call.check()
        return flex_forward(call)

    def part_grads(self, call, out, lse, dout, dlse):
        call.check()
        return flex_backward(call, out, lse, dout, dlse)

    def attention(self, call: AttentionCall) -> tuple[torch.Tensor, torch.Tensor]:
        call.check()
        return flex_block_sparse_attention(call)


class ReferenceEngine(Engine):
    """The PyTorch reference (`reference.py`), any device and dtype."""

    name = "reference"

    def part(self, call):
        return reference_forward(call)

    def part_grads(self, call, out, lse, dout, dlse):
        return reference_backward(call, out, lse, dout, dlse)


class MaskedEngine(Engine):
    """Dense arithmetic with the layout as a mask (`masked.py`), any device and dtype: no work skipped, faster
    than the reference on a CPU at a few thousand tokens."""

    name = "masked"

    def declines(self, q):
        # its memory per chunk grows with the sequence and it saves no work: only where a user names it
        return "named only (dense arithmetic with the layout as a mask: it saves no work)"

    def part(self, call):
        return masked_forward(call)

    def part_grads(self, call, out, lse, dout, dlse):
        return masked_backward(call, out, lse, dout, dlse)


def register_engine(engine: Engine) -> Engine:
    """Make `engine` (an instance of an `Engine` subclass that computes `part` and `part_grads`, or `forward` and
    `backward` merging as the kernels do, or `attention` where it is `differentiable`) selectable as
    `SparseAttentionConfig(attention_engine=engine.name)`. A registered engine runs where a config names it; 'auto'
    gives it a call only where every engine registered before it declines (the PyTorch reference never does). A name
    registered to an engine of another class is refused (the class redefined, a notebook's cell run again, replaces
    its earlier instance)."""
    fix = ("subclass hf_sparse_cp.attention.engines.Engine, set its `name`, implement part and part_grads (or "
           "attention, with differentiable = True), and register an instance")
    if not isinstance(engine, Engine):
        raise TypeError(f"register_engine takes an instance of an Engine subclass, not {type(engine).__name__} "
                        f"{engine!r}: {fix}.")
    name = getattr(engine, "name", None)
    if not isinstance(name, str) or not name or name == "auto":
        raise ValueError(f"{type(engine).__qualname__} has no `name` (a class attribute other than 'auto', the "
                         f"attention_engine value that selects it): {fix}.")
    own = lambda method: getattr(type(engine), method, None) is not getattr(Engine, method, None)  # noqa: E731
    needs = [("attention",)] if engine.differentiable else [("part", "forward"), ("part_grads", "backward")]
    missing = [" or ".join(either) for either in needs if not any(map(own, either))]
    if missing:
        raise TypeError(f"engine {name!r} ({type(engine).__qualname__}) does not implement {', '.join(missing)}: "
                        f"{fix}.")
    register_in(ENGINES, name, engine, "attention engine")
    return engine


for _engine in (TritonEngine(), FlexEngine(), ReferenceEngine(), MaskedEngine()):  # (the order 'auto' walks)
    register_engine(_engine)


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
    docstring says; DEFAULT_ENGINE for a layout with columns and without a row of its head_dim."""
    if shape.has_columns:  # the flex engine's column path is not a candidate (module docstring)
        return DEFAULT_ENGINE
    rows = [r for r in (table or {}).get("rows", ()) if table.get("device") == device and not r["has_columns"]]
    if not rows:
        return DEFAULT_ENGINE
    rows = [r for r in rows if r["head_dim"] == shape.head_dim]
    if not rows:
        return DEFAULT_ENGINE
    nearest = min(abs(math.log2(r["seq_len"] / shape.seq_len)) for r in rows)
    rows = [r for r in rows if abs(math.log2(r["seq_len"] / shape.seq_len)) == nearest]
    row = min(rows, key=lambda r: abs(r["kept_fraction"] - shape.kept_fraction))
    return "flex" if row["flex_ms"] < row["triton_ms"] else "triton"


def resolve_engine(q: torch.Tensor, layout: SparseLayout, implementation: str = "auto") -> str:
    """The engine of one call: 'triton', 'flex', 'reference' or 'masked' (a key of `ENGINES`), each choice logged
    once with the reasons of the engines it passed over.

    Args:
        q: the queries [B, Hq, Sq, D] (device, dtype and head_dim decide what can run them).
        layout: the call's layout (its kept fraction and columns, for 'auto' on CUDA).
        implementation: 'auto' or an engine's name; 'auto' gives way to
            `$HF_SPARSE_CP_ATTENTION_ENGINE` when that is set.

    Returns:
        The engine name. 'triton' means the kernels whatever the device (on CPU inside Triton's
        interpreter); 'flex' needs a torch with FlexAttention. 'auto' walks `ENGINES` in order: among the
        engines that do not decline the call (`Engine.declines`), the kernels or Flex by the timing table when
        both may run it, else the first.
    """
    settings = engine_settings()
    if implementation not in settings:
        raise ValueError(f"implementation={implementation!r} is unknown; use one of {settings} (an engine of your "
                         "own: register_engine(instance) first).")
    given = None if implementation == "auto" else implementation
    name = choose_backend("Attention engine", ENGINE_ENV, settings, given)
    if name != "auto":
        missing = ENGINES[name].missing()
        if missing is not None:
            raise ImportError(f"The attention engine {name!r} {missing}; or set the attention engine to 'auto' "
                              "(--sparse_attention_engine auto).")
        return _chosen(name, "as set" if given else f"${ENGINE_ENV}")
    declined = {engine.name: engine.declines(q) for engine in ENGINES.values()}
    able = [name for name, reason in declined.items() if reason is None]
    passed = "; ".join(f"{name} declined: {reason}" for name, reason in declined.items() if reason is not None)
    if {"triton", "flex"} <= set(able):
        table = engine_table()
        if table is None:
            return _chosen(DEFAULT_ENGINE, f"auto: no ${TABLE_ENV}")
        return _chosen(pick_from_table(table, torch.cuda.get_device_name(q.device), CallShape.of(q, layout)),
                       "auto: the timing table's nearest row of this head_dim (none: the default)")
    if able[0] == "reference" and q.is_cuda:
        warnings.warn(f"block-sparse attention on CUDA uses the PyTorch reference (slow) for "
                      f"{declined[DEFAULT_ENGINE]} ({passed}).", stacklevel=3)
    return _chosen(able[0], f"auto; {passed}" if passed else "auto")


def check_engine_trains_on(setting: str, device_type: str) -> None:
    """Raise ValueError, naming the fix, when the engine `setting` names (for 'auto': the one `$ENGINE_ENV` names,
    if set) cannot train on `device_type` devices (`Engine.device_refusal`): what its first call would refuse, once
    the processes have built their model and data."""
    name = choose_backend("Attention engine", ENGINE_ENV, engine_settings(), None if setting == "auto" else setting)
    reason = None if name == "auto" else ENGINES[name].device_refusal(device_type)
    if reason is None:
        return
    where = "the CPU (--use_cpu, or no GPU here)" if device_type == "cpu" else f"{device_type!r} devices"
    given, fix = ((f"--sparse_attention_engine {name}", "use --sparse_attention_engine auto (the PyTorch reference off "
                   "CUDA) or reference") if setting != "auto" else
                  (f"${ENGINE_ENV}={name}", f"unset ${ENGINE_ENV} (auto: the PyTorch reference off CUDA)"))
    raise ValueError(f"{given}: {reason}, and this run trains on {where}: {fix}, or train on a CUDA GPU.")


def _kernels_unsupported(q: torch.Tensor, on_this_gpu: bool = True) -> str | None:
    """Why the kernels cannot take CUDA queries `q` (their dtype, head_dim; with `on_this_gpu`, also their GPU's
    shared memory), else None."""
    from ..kernels.limits import outside_limits, unsupported

    return unsupported(q) if on_this_gpu else outside_limits(q)


@functools.cache
def _logged(engine: str, why: str) -> None:
    logger.info("Block-sparse attention engine: %s (%s).", engine, why)


def _chosen(engine: str, why: str) -> str:
    """`engine`, its choice logged the first time it is made for this reason."""
    _logged(engine, why)
    return engine
