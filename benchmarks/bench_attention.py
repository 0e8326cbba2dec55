"""Attention kernel benchmark: our Triton block-sparse kernels against FlexAttention and dense SDPA.

One sequence (B = 1) of S tokens, Qwen2.5-3B head geometry (16 query heads, 2 key/value heads,
head_dim 128), bf16 (`--dtype`), causal, one document. For every S (32K, 64K, 128K, 256K by default):

* sparse layouts: random vertical-slash layouts at ~5%, 10% and 20% kept blocks (random block
  diagonals, the main one always, plus `num_verticals` random key columns per head), and layouts
  estimated by `hf_sparse_cp.attention.estimate_layout` from q/k with planted structure (columns
  and diagonals that carry the attention mass, as in real heads);
* on each sparse layout: `ours` (`hf_sparse_cp.attention.block_sparse_attention` with the Triton engine,
  the path training takes: kernels, autograd, output cast), `flex_engine` (the same call with the
  FlexAttention engine, `hf_sparse_cp.attention.flex`: the same function, columns included, through
  compiled Flex), `auto` (the same call with the 'auto' engine, reading the engine table this run
  writes, see below) and `flex` (FlexAttention, torch.compile'd, on exactly the same key blocks
  through a `BlockMask`: blocks strictly below the diagonal as full blocks, diagonal blocks with a
  causal mask_mod, see `flex_block_mask`), and `flex_flash`, the same with Flex's flash (CuTe DSL)
  backend (`kernel_options={"BACKEND": "FLASH"}`; an error row with torch's reason where the installed
  torch and flash-attn do not provide it). Raw `flex` cannot gather single key columns, so the
  layout's vertical columns are left out for it: ours computes that extra work (its share is the
  `cols` column of the table) and is still counted against Flex; `ours_blocks` is ours on that same
  layout without its columns, the pairs Flex computes: it compares the two kernels on equal work, and
  `ours` minus it is what the columns cost (the "columns" section);
* dense causal: `ours`, `flex_engine` and `auto` on the dense layout, `flex` with a causal BlockMask,
  SDPA with the cuDNN and the flash backends (K/V expanded to 16 heads beforehand, outside the
  timing: their GQA support differs between backends), and flash-attn's own `flash_attn_func` when
  installed.

The engine table (`--engine_table`, default `benchmarks/results/engine-table_<device>.json`): per
(S, layout) where both engines ran, their forward + backward times, rewritten after each layout; it
is what `hf_sparse_cp.attention.engines` reads for 'auto' when `$HF_SPARSE_CP_ENGINE_TABLE` names it
(this run sets it for its `auto` rows, which record the engine auto picked).

Times are CUDA-event medians of `--repeats` runs after `--warmup` runs, for the forward and for
forward + backward (gradients of q, k, v from a random output gradient). Effective TFLOP/s count
only the computed work: 4 * D * (computed query-key pairs) per head for the forward (full tiles
for listed blocks, one query block's rows per listed column; S(S+1)/2 pairs for dense causal
SDPA/flash), and 3.5x that for forward + backward.

Estimation: for every estimated layout, the time of one attention call's pattern estimation and
layout construction, as `hf_sparse_cp.attention` runs it (`estimate_layout` with the tokens'
metadata), in total and by stage (reading the documents, scoring, selection + layout build), and
as a share of our forward + backward on that layout (the issue's target: under 10% at 128K); and the
call's transient memory peak beside the layout it builds (`estimation_memory`).

Profile: at `--profile_seq_lens` (128K by default) every case's forward + backward step is also run
once under torch.profiler and its GPU time split by kernel (our forward, dq, dk/dv, preprocessing
and layout kernels; Flex's compiled kernels; cuDNN's), so that a missed target comes with where
the time went.

Check: at the first S, ours and the flex engine on each whole layout, and ours and compiled raw Flex
on each layout without its columns, must agree within bf16 rounding (`CHECK_RTOL`); the JSON says
pass, FAIL or error per layout and comparison. Flex is only ever timed compiled (`_flex`, and the
engine's own guard): past dynamo's recompile limit it would silently run its unfused eager path.

Prints a table (ours, ours_blocks and auto against every baseline measured, `ratios` in the JSON), the
columns' cost (`column_costs`: per sparse layout, ours minus ours_blocks, and the TFLOP/s of the column pairs
and of the block pairs beside Flex's on the same blocks), the estimation section, the kernel profiles and the
issues' targets (measured value and pass/fail: at 128K and ~5% kept blocks, fwd+bwd >= 1.7x compiled Flex on
the same blocks (Triton backend, and flash backend where measured), >= 12.5x dense cuDNN, >= 350 TFLOP/s on
the computed pairs (#50); >= 1.3x Flex at ~10%, dense within 1.25x of Flex dense, estimation < 10%; and #32's
engine targets against the flex engine, with auto within 5% of the faster engine), and writes JSON (GPU,
versions, settings, the command, results, ratios, checks, estimation, targets) to benchmarks/results/.
The JSON is rewritten after every S ("complete": false until the end), and an S whose set-up fails
(out of memory at 256K, say) is listed under "skipped", so a late failure or a timeout loses no
earlier result.

    python benchmarks/bench_attention.py
    python benchmarks/bench_attention.py --seq_lens 131072 --densities 0.05 --repeats 20

This is a GPU benchmark: without CUDA it refuses to run, except `--dry_run` (CPU, tiny sizes given
on the command line, our kernels in Triton's interpreter: `TRITON_INTERPRET=1`), which checks the
script, not the kernels' speed (`benchmarks/gpu_session.sh quick --dry-run`). The layout helpers (`density_layout`,
`estimated_layout`, `flex_block_mask`, `computed_pairs`), `time_estimation` and the report
helpers (`format_table`, `estimation_report`, `issue_targets`) run anywhere.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Literal

import torch

from hf_sparse_cp.attention.build import build_layout, dense_layout
from hf_sparse_cp.attention.engines import TABLE_ENV, TABLE_KIND, resolve_engine
from hf_sparse_cp.attention.estimate import (
    estimate_layout,
    estimation_segments,
    layout_from_scores,
    long_documents,
    score_rows,
)
from hf_sparse_cp.attention.layout import SparseLayout, compact_sorted
from hf_sparse_cp.attention.tokens import TokenMeta
from hf_sparse_cp.config import SparseAttentionConfig
from hf_sparse_cp.distributed.split.document_costs import ATTENTION_RATE_SHARE
from hf_sparse_cp.env import environment
from hf_sparse_cp.testing.allocations import AllocationRecorder
from hf_sparse_cp.testing.benchmarking import (
    ReportFile,
    device_slug,
    format_profiles,
    format_targets,
    kernel_profile,
    parse_gpu_benchmark_args,
    rel_rms,
    time_ms,
)
from hf_sparse_cp.testing.layouts import planted_qk

RESULTS_DIR = Path(__file__).resolve().parent / "results"
VARIANTS = ("ours", "ours_blocks", "flex_engine", "auto", "flex", "flex_flash", "sdpa_cudnn", "sdpa_flash",
            "flash_attn")
# The rows compared with every baseline (`baseline_ratios`).
COMPARED = ("ours", "ours_blocks", "auto")
# What ours (and auto) are compared with, fwd+bwd time over theirs, by column of the table: on the same layout the
# flex engine, compiled Flex on a BlockMask of the kept blocks (Triton backend, and Flex's flash backend where the
# torch provides it), on the dense causal layout of the same S cuDNN and flash SDPA and flash-attn.
BASELINES = {"flex_engine": ("fxe", False), "flex": ("flex", False), "flex_flash": ("fflash", False),
             "sdpa_cudnn": ("cudnn", True), "sdpa_flash": ("flash", True), "flash_attn": ("fa2", True)}
# Largest relative RMS difference between ours and Flex on the same blocks: both round their bf16
# output once after fp32 accumulation, so they differ by a few bf16 ulps (2^-8 relative), no more.
CHECK_RTOL = 2e-2


@dataclass
class BenchAttentionArguments:
    seq_lens: list[int] = field(
        default_factory=lambda: [32768, 65536, 131072, 262144],
        metadata={"help": "Sequence lengths; one that runs out of memory is reported and skipped."},
    )
    densities: list[float] = field(
        default_factory=lambda: [0.05, 0.10, 0.20],
        metadata={"help": "Target kept-block fractions of the random vertical-slash layouts."},
    )
    num_verticals: int = field(default=1000, metadata={"help": "Random key columns per head in those layouts."})
    estimated_budgets: list[str] = field(
        default_factory=lambda: ["1000:64", "1000:256"],
        metadata={"help": "Estimated layouts as 'vertical_topk:slash_topk' budgets (empty: none)."},
    )
    variants: list[str] = field(default_factory=lambda: list(VARIANTS), metadata={"help": f"From {VARIANTS}."})
    estimated_variants: list[str] | None = field(
        default=None,
        metadata={"help": "The variants timed on the estimated layouts (default: --variants); the estimation's share "
                  "needs `ours` there."},
    )
    dense: bool = field(default=True, metadata={"help": "Also time the dense causal case."})
    linear_intermediate: int = field(
        default=11008,
        metadata={"help": "At each S, also time a decoder MLP's matrix product over the S tokens, forward + backward "
                  "([S, num_q_heads x head_dim] by [num_q_heads x head_dim, this]; Qwen2.5-3B: 11008): the rate of "
                  "the linear layers on this GPU, beside which the document planner's ATTENTION_RATE_SHARE is "
                  "measured. 0: not timed."},
    )
    num_q_heads: int = field(default=16, metadata={"help": "Query heads (Qwen2.5-3B: 16)."})
    num_kv_heads: int = field(default=2, metadata={"help": "Key/value heads (Qwen2.5-3B: 2)."})
    head_dim: int = field(default=128, metadata={"help": "Head dimension (Qwen2.5-3B: 128)."})
    block_size: int = field(default=128, metadata={"help": "Layout block size."})
    dtype: Literal["bfloat16", "float16"] = field(
        default="bfloat16", metadata={"help": "dtype of q, k, v (Triton's interpreter, for --dry_run, has no bf16)."}
    )
    warmup: int = field(default=3, metadata={"help": "Untimed runs before timing (compilation, autotuning)."})
    repeats: int = field(default=10, metadata={"help": "Timed runs; the median is reported."})
    time_forward: bool = field(
        default=True,
        metadata={"help": "Also time the forward alone (without autograd: for Flex another compiled graph per "
                          "shape); forward + backward is always timed."},
    )
    check: bool = field(
        default=True,
        metadata={"help": "At the first S, compare ours with the flex engine on each layout, and with raw Flex on the "
                          "layout without its columns (rel. RMS), for the variants timed."},
    )
    engine_table: str | None = field(
        default=None,
        metadata={"help": "Where to write the engine table 'auto' reads (default "
                          "benchmarks/results/engine-table_<device>.json)."},
    )
    dry_run: bool = field(
        default=False,
        metadata={"help": "Run on the CPU (sizes from the command line; our kernels in Triton's interpreter, which "
                          "needs TRITON_INTERPRET=1): checks the script, measures nothing of the GPU."},
    )
    profile_seq_lens: list[int] = field(
        default_factory=lambda: [131072],
        metadata={"help": "Sequence lengths at which every case's forward + backward step is also profiled by "
                          "kernel (GPU time per kernel, printed and in the JSON: the profile behind a missed "
                          "target). Empty: none."},
    )
    seed: int = field(default=0, metadata={"help": "Seed of the layouts and inputs."})
    output: str | None = field(default=None, metadata={"help": "JSON path; default benchmarks/results/."})

    def __post_init__(self) -> None:
        unknown = (set(self.variants) | set(self.estimated_variants or ())) - set(VARIANTS)
        if unknown:
            raise ValueError(f"unknown variants {sorted(unknown)}; use {VARIANTS}.")
        if self.linear_intermediate < 0:
            raise ValueError(f"linear_intermediate must be >= 0 (0: not timed); got {self.linear_intermediate}.")
        if any(not 0 < d <= 1 for d in self.densities):
            raise ValueError(f"densities must be in (0, 1]; got {self.densities}.")
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError("num_q_heads must be a multiple of num_kv_heads.")
        if self.warmup < 0 or self.repeats < 1:
            raise ValueError("warmup must be >= 0 and repeats >= 1.")
        parse_budgets(self.estimated_budgets)


def parse_budgets(budgets: list[str]) -> list[tuple[int, int]]:
    try:
        return [tuple(int(x) for x in b.split(":")) for b in budgets if b]
    except ValueError:
        raise ValueError(f"estimated_budgets must look like '1000:64'; got {budgets}.") from None


# ---------------------------------------------------------------------------------------- layouts


@functools.lru_cache(maxsize=4)
def _random_draws(seq_len: int, heads: int, block_size: int, num_verticals: int, seed: int):
    """A random order of the off-main block diagonals and a random set of key columns, per head."""
    g = torch.Generator().manual_seed(seed)
    nb = -(-seq_len // block_size)
    order = torch.rand(1, heads, nb - 1, generator=g).argsort(-1) + 1
    verticals = torch.zeros(1, heads, seq_len, dtype=torch.bool)
    verticals.scatter_(-1, torch.rand(1, heads, seq_len, generator=g).argsort(-1)[..., :num_verticals], True)
    return order, verticals


def vertical_slash_layout(
    seq_len: int, heads: int, block_size: int, num_diagonals: int, num_verticals: int, seed: int, device
) -> SparseLayout:
    """Per head: the main block diagonal plus the first `num_diagonals - 1` of a fixed random order of the
    others (so the kept set only grows with `num_diagonals`), and `num_verticals` random key columns."""
    order, verticals = _random_draws(seq_len, heads, block_size, num_verticals, seed)
    diagonals = torch.zeros(1, heads, order.shape[-1] + 1, dtype=torch.bool)
    diagonals[..., 0] = True
    diagonals.scatter_(-1, order[..., : max(0, num_diagonals - 1)], True)
    meta = TokenMeta.contiguous(1, seq_len, device)
    return build_layout(meta, block_size, diagonals=diagonals.to(device), verticals=verticals.to(device))


def density_layout(
    seq_len: int, heads: int, block_size: int, density: float, num_verticals: int, seed: int, device
) -> SparseLayout:
    """The random vertical-slash layout whose kept fraction is closest to `density` (bisection on the
    number of diagonals; columns count as 1/block_size of a block each)."""
    nb = -(-seq_len // block_size)
    lo, hi = 1, nb
    while lo < hi:
        mid = (lo + hi) // 2
        layout = vertical_slash_layout(seq_len, heads, block_size, mid, num_verticals, seed, device)
        kept = float(layout.kept_fraction())
        if kept < density:
            lo = mid + 1
        else:
            hi = mid
    candidates = [n for n in (lo - 1, lo) if n >= 1]
    layouts = [vertical_slash_layout(seq_len, heads, block_size, n, num_verticals, seed, device) for n in candidates]
    return min(layouts, key=lambda lay: abs(float(lay.kept_fraction()) - density))


def planted_inputs(seq_len: int, num_q_heads: int, num_kv_heads: int, head_dim: int, seed: int):
    """q, k with planted columns and diagonals (a few per head, shared within a GQA group's key side)."""
    g = torch.Generator().manual_seed(seed)
    per_head_cols, per_head_offsets = 16, 8
    verticals = [sorted(torch.randperm(seq_len, generator=g)[:per_head_cols].tolist()) for _ in range(num_q_heads)]
    offsets = [sorted(torch.randint(1, seq_len // 2, (per_head_offsets,), generator=g).tolist())
               for _ in range(num_q_heads)]
    return planted_qk(num_q_heads, num_kv_heads, seq_len, head_dim, verticals, offsets, generator=g)


def estimation_config(vertical_topk: int, slash_topk: int, block_size: int) -> SparseAttentionConfig:
    """A top-k budget, MTraining's defaults otherwise, sparse at every length."""
    return SparseAttentionConfig(vertical_topk=vertical_topk, slash_topk=slash_topk, block_size=block_size,
                                 min_seq_len=1)


def estimated_layout(q: torch.Tensor, k: torch.Tensor, vertical_topk: int, slash_topk: int, block_size: int):
    """The layout `estimate_layout` picks for q, k under a top-k budget (MTraining's defaults otherwise)."""
    meta = TokenMeta.contiguous(q.shape[0], q.shape[2], q.device)
    with torch.no_grad():
        return estimate_layout(q, k, estimation_config(vertical_topk, slash_topk, block_size), meta)


def density_name(density: float) -> str:
    return f"vs@{density:.0%}"


def estimated_name(vertical_topk: int, slash_topk: int) -> str:
    return f"est v{vertical_topk}/s{slash_topk}"


def columns_removed(layout: SparseLayout) -> SparseLayout:
    empty = layout.col_idx[..., :0]
    return SparseLayout(layout.block_idx, layout.block_cnt, empty, torch.zeros_like(layout.col_cnt),
                        layout.block_size)


def causal_mask_mod(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def flex_block_mask(layout: SparseLayout, num_q_heads: int, seq_len: int):
    """A FlexAttention BlockMask with exactly the layout's key blocks (its columns are dropped): blocks
    below the diagonal as full blocks (no mask_mod evaluated), diagonal blocks as partial blocks with
    the causal mask_mod.

    This is the function compiled Flex computes, the only Flex `_flex` runs: its kernels visit the
    listed blocks alone and evaluate the mask_mod on the partial ones. (Flex's eager path evaluates
    the mask_mod over all pairs instead.) One module-level mask_mod for every layout and the dense
    case keeps one compiled graph per S, and the dense causal mask is built without materializing the
    S x S mask that `create_block_mask` makes (64 GiB at 256K).
    """
    from torch.nn.attention.flex_attention import BlockMask

    nkb = -(-seq_len // layout.block_size)
    blk = layout.block_idx.long()
    valid = torch.arange(blk.shape[-1], device=blk.device) < layout.block_cnt.unsqueeze(-1)
    qb = torch.arange(layout.num_q_blocks, device=blk.device).view(1, 1, -1, 1)
    heads = (layout.batch, num_q_heads, layout.num_q_blocks)

    def listed(keep):
        idx, cnt = compact_sorted(blk, keep)
        idx = torch.nn.functional.pad(idx.clamp_min(0), (0, nkb - idx.shape[-1]))
        return cnt.expand(*heads).contiguous(), idx.expand(*heads, nkb).contiguous()

    partial_cnt, partial_idx = listed(valid & (blk == qb))
    full_cnt, full_idx = listed(valid & (blk < qb))
    return BlockMask.from_kv_blocks(partial_cnt, partial_idx, full_cnt, full_idx, BLOCK_SIZE=layout.block_size,
                                    mask_mod=causal_mask_mod, seq_lengths=(seq_len, seq_len))


def computed_pairs(layout: SparseLayout, num_q_heads: int, include_columns: bool = True) -> float:
    """Query-key pairs the kernels compute, summed over batch and query heads (listed blocks as full
    block_size^2 tiles, each column against its query block's rows)."""
    bs = layout.block_size
    per_head = layout.block_cnt.sum(-1).double() * bs * bs
    if include_columns:
        per_head = per_head + layout.col_cnt.sum(-1).double() * bs
    return float(per_head.sum()) * (num_q_heads if layout.heads == 1 else 1)


# ---------------------------------------------------------------------------------------- timing


def time_estimation(q: torch.Tensor, k: torch.Tensor, cfg: SparseAttentionConfig, meta: TokenMeta, warmup: int,
                    repeats: int) -> dict:
    """Milliseconds of one attention call's pattern estimation + layout construction, as
    `hf_sparse_cp.attention` runs it (`estimate_layout` with the tokens' metadata): `total_ms`, and
    by stage `documents_ms` (reading the documents), `scoring_ms` (vertical/slash scores) and
    `layout_ms` (selection and layout build). Runs on any device (wall clock off CUDA)."""
    scale = q.shape[-1] ** -0.5
    docs = long_documents(meta, cfg)
    segments = estimation_segments(docs, cfg)
    scores = score_rows(q, k, segments, cfg, scale)
    stages = {
        "total_ms": lambda: estimate_layout(q, k, cfg, meta, scale=scale),
        "documents_ms": lambda: long_documents(meta, cfg),
        "scoring_ms": lambda: score_rows(q, k, segments, cfg, scale),
        "layout_ms": lambda: layout_from_scores(meta, cfg, docs, scores),
    }
    with torch.no_grad():
        return {name: time_ms(fn, warmup, repeats, q.device.type) for name, fn in stages.items()}


def estimation_memory(q: torch.Tensor, k: torch.Tensor, cfg: SparseAttentionConfig, meta: TokenMeta) -> dict:
    """The memory of one `estimate_layout` call (pattern estimation + layout build) beyond its inputs, in MiB: its
    transient peak (`peak_mib`: CUDA's allocator peak above what was allocated before; on a CPU the most bytes of
    the call's own tensors alive at once, `AllocationRecorder`) beside the layout it returns (`layout_mib`: the
    block and column lists and their counts) and their ratio."""
    scale = q.shape[-1] ** -0.5
    with torch.no_grad():
        if q.device.type == "cuda":
            torch.cuda.synchronize(q.device)
            before = torch.cuda.memory_allocated(q.device)
            torch.cuda.reset_peak_memory_stats(q.device)
            layout = estimate_layout(q, k, cfg, meta, scale=scale)
            torch.cuda.synchronize(q.device)
            peak = torch.cuda.max_memory_allocated(q.device) - before
        else:
            with AllocationRecorder(with_sites=False) as recorder:
                layout = estimate_layout(q, k, cfg, meta, scale=scale)
            peak = recorder.peak_bytes
    held = sum(t.untyped_storage().nbytes() for t in (layout.block_idx, layout.block_cnt, layout.col_idx,
                                                        layout.col_cnt))
    return {"peak_mib": peak / 2**20, "layout_mib": held / 2**20, "peak_over_layout": peak / held}


def steps(attend, tensors, dout):
    """The two timed steps of attend(*tensors) -> out: (forward without autograd, forward + backward)."""

    def forward():
        with torch.no_grad():
            attend(*tensors)

    def forward_backward():
        for t in tensors:
            t.grad = None
        attend(*tensors).backward(dout)

    return forward, forward_backward


# ---------------------------------------------------------------------------------------- runners


def _engine(layout: SparseLayout, implementation: str):
    """block_sparse_attention(q, k, v, layout) -> out with one engine ('triton', 'flex', 'auto', ...)."""
    from hf_sparse_cp.attention.ops import block_sparse_attention

    return lambda q, k, v: block_sparse_attention(q, k, v, layout, implementation=implementation)[0]


def _flex(block_mask, backend: str | None = None):
    """Compiled FlexAttention on `block_mask` (with `backend`, Flex's kernel_options BACKEND: "FLASH" for its
    flash backend), never Flex's unfused eager path.

    Every S compiles Flex anew (dynamic=False), with and without autograd: 2 graphs per S (all masks
    of one S share shapes and mask_mod, see `flex_block_mask`). The compiled function and the guard are
    the flex engine's (`hf_sparse_cp.attention.flex`): past dynamo's recompile limit Flex would
    silently run its eager path, which materializes the whole score matrix; the limit is raised to
    `FLEX_RECOMPILE_LIMIT` there, and hitting it raises (an error row) instead.
    """
    from hf_sparse_cp.attention.flex import flex_attention_compiled, recompile_guard

    options = {"kernel_options": {"BACKEND": backend}} if backend else {}

    def attend(q, k, v):
        with recompile_guard():
            return flex_attention_compiled()(q, k, v, block_mask=block_mask, enable_gqa=True, **options)

    return attend


def _sdpa(backend):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, backend)

    def attend(q, k, v):
        with sdpa_kernel(backend):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    return attend


def _flash_attn():
    from flash_attn import flash_attn_func

    return lambda q, k, v: flash_attn_func(q, k, v, causal=True)


class Bench:
    """The sweep. `device` is "cuda" for measurements; the orchestration also runs on "cpu" (tests)."""

    def __init__(self, args: BenchAttentionArguments, device: str = "cuda", table: Callable[[], None] | None = None):
        self.args = args
        self.device = device
        # `ours` is the Triton engine: compiled on CUDA, the interpreter on a CPU that runs it, else the reference
        interpreted = os.environ.get("TRITON_INTERPRET") == "1"
        self.ours = "triton" if device == "cuda" or interpreted else "reference"
        self.table = table  # writes the engine table (main); called before the `auto` rows
        self.rows: list[dict] = []
        self.checks: list[dict] = []
        # per (S, estimated layout): estimation + layout construction of one attention call (time_estimation)
        self.estimation: list[dict] = []
        self.skipped: list[dict] = []  # sequence lengths whose set-up failed
        self.linear: list[dict] = []  # per S: the MLP matrix product's rate (`linear_rate`)

    def release_memory(self) -> None:
        if self.device == "cuda":
            torch.cuda.empty_cache()

    def inputs(self, seq_len: int, q=None, k=None):
        a = self.args
        g = torch.Generator(device=self.device).manual_seed(a.seed)
        make = lambda h: torch.randn(1, h, seq_len, a.head_dim, generator=g, device=self.device)
        q = make(a.num_q_heads) if q is None else q.to(self.device)
        k = make(a.num_kv_heads) if k is None else k.to(self.device)
        v = make(a.num_kv_heads)
        dtype = getattr(torch, a.dtype)
        dout = make(a.num_q_heads).to(dtype)
        return [x.to(dtype).requires_grad_() for x in (q, k, v)], dout

    def record(self, seq_len: int, layout_name: str, variant: str, pairs: float, density, col_share,
               make_attend, tensors, dout, estimation_ms: float | None = None):
        """Time `make_attend()` on the inputs (forward, forward + backward) and, at the profiled S,
        profile one forward + backward step by kernel; one row, whatever happens."""
        a = self.args
        row = {"seq_len": seq_len, "layout": layout_name, "variant": variant, "density": density,
               "column_share": col_share, "pairs": pairs, "estimation_ms": estimation_ms}
        try:
            forward, forward_backward = steps(make_attend(), tensors, dout)
            fwd = time_ms(forward, a.warmup, a.repeats, self.device) if a.time_forward else None
            fwd_bwd = time_ms(forward_backward, a.warmup, a.repeats, self.device)
            flops = 4.0 * a.head_dim * pairs
            row.update(status="ok", fwd_ms=fwd, fwd_bwd_ms=fwd_bwd, fwd_bwd_tflops=3.5 * flops / fwd_bwd / 1e9,
                       fwd_tflops=None if fwd is None else flops / fwd / 1e9)
            if seq_len in a.profile_seq_lens:
                row["kernels"] = kernel_profile(forward_backward, self.device)
        except torch.OutOfMemoryError as e:
            row.update(status="oom", reason=str(e).splitlines()[0])
        except Exception as e:  # reported as data: one failing variant must not end the sweep
            row.update(status="error", reason=f"{type(e).__name__}: {e}"[:500])
        self.release_memory()
        self.rows.append(row)
        shown = row.get("reason", "")
        if row["status"] == "ok":
            shown = "" if row["fwd_ms"] is None else f"fwd {row['fwd_ms']:.2f} ms, "
            shown += f"fwd+bwd {row['fwd_bwd_ms']:.2f} ms"
        print(f"[S={seq_len} {layout_name} {variant}] {row['status']}: {shown}", flush=True)

    def sparse_case(self, seq_len: int, name: str, layout: SparseLayout, tensors, dout,
                    estimation_ms: float | None = None, variants: list[str] | None = None):
        a = self.args
        variants = variants or a.variants
        density = float(layout.kept_fraction())
        pairs = computed_pairs(layout, a.num_q_heads)
        col_share = 1.0 - computed_pairs(layout, a.num_q_heads, include_columns=False) / pairs
        self.engine_cases(seq_len, name, layout, pairs, density, col_share, tensors, dout, estimation_ms, variants)
        flex_pairs = computed_pairs(layout, a.num_q_heads, include_columns=False)
        if "ours_blocks" in variants and col_share > 0:
            self.record(seq_len, name, "ours_blocks", flex_pairs, density, 0.0,
                        functools.partial(_engine, columns_removed(layout), self.ours), tensors, dout)
        self.flex_cases(seq_len, name, layout, flex_pairs, density, tensors, dout, variants)

    def flex_cases(self, seq_len: int, name: str, layout: SparseLayout, pairs: float, density: float, tensors, dout,
                   variants: list[str]):
        """Compiled Flex on a BlockMask of the layout's blocks (its columns left out): `flex` (Triton backend) and
        `flex_flash` (Flex's flash backend), those of `variants`."""
        backends = [(v, b) for v, b in (("flex", None), ("flex_flash", "FLASH")) if v in variants]
        if not backends:
            return
        mask = flex_block_mask(layout, self.args.num_q_heads, seq_len)
        for variant, backend in backends:
            self.record(seq_len, name, variant, pairs, density, 0.0, functools.partial(_flex, mask, backend), tensors,
                        dout)

    def engine_cases(self, seq_len: int, name: str, layout: SparseLayout, pairs: float, density: float,
                     col_share: float, tensors, dout, estimation_ms: float | None = None,
                     variants: list[str] | None = None):
        """ours, flex_engine, then (after the engine table is rewritten with them) auto, on one layout."""
        variants = variants or self.args.variants
        for variant, engine in (("ours", self.ours), ("flex_engine", "flex")):
            if variant in variants:
                self.record(seq_len, name, variant, pairs, density, col_share,
                            functools.partial(_engine, layout, engine), tensors, dout,
                            estimation_ms if variant == "ours" else None)
        if "auto" in variants:
            if self.table is not None:
                self.table()
            self.record(seq_len, name, "auto", pairs, density, col_share, functools.partial(_engine, layout, "auto"),
                        tensors, dout)
            if self.rows[-1]["status"] == "ok":
                self.rows[-1]["auto_engine"] = resolve_engine(tensors[0], layout, "auto")

    def check(self, seq_len: int, name: str, layout: SparseLayout, tensors, against: str = "flex"):
        """ours vs Flex: `against` 'flex' on the same blocks (columns removed), 'flex_engine' on the whole
        layout. Both must compute the same function, up to bf16 rounding (`CHECK_RTOL`); a mismatch or an
        error is reported, and the timings still run. The flex engine's check keeps autograd on CUDA (the
        graph its timing compiles); Flex on CPU has no autograd."""
        entry = {"seq_len": seq_len, "layout": name, "against": against, "rel_rms": None, "rtol": CHECK_RTOL}
        try:
            if against == "flex":
                blocks = columns_removed(layout)
                inputs = [t.detach() for t in tensors]  # (Flex refuses inputs that require grad where it has no
                with torch.no_grad():                   # backward, on the CPU)
                    ours = _engine(blocks, self.ours)(*inputs)
                    flex = _flex(flex_block_mask(blocks, self.args.num_q_heads, seq_len))(*inputs)
            else:
                grad = torch.enable_grad() if self.device == "cuda" else torch.no_grad()
                with grad:
                    ours = _engine(layout, self.ours)(*tensors).detach()
                    flex = _engine(layout, "flex")(*tensors).detach()
            err = rel_rms(ours, flex)
            entry.update(rel_rms=err, status="pass" if err <= CHECK_RTOL else "FAIL")
            shown = f"rel. RMS ours vs {against} = {err:.2e} (<= {CHECK_RTOL:g}: {entry['status']})"
        except Exception as e:  # reported as data, like a failing variant
            entry.update(status="error", reason=f"{type(e).__name__}: {e}"[:500])
            shown = f"error: {entry['reason']}"
        self.release_memory()
        self.checks.append(entry)
        print(f"[S={seq_len} {name}] check: {shown}", flush=True)

    def dense_case(self, seq_len: int, tensors, dout):
        a = self.args
        layout = dense_layout(TokenMeta.contiguous(1, seq_len, self.device), a.block_size)
        pairs = computed_pairs(layout, a.num_q_heads)
        causal_pairs = a.num_q_heads * seq_len * (seq_len + 1) / 2
        self.engine_cases(seq_len, "dense", layout, pairs, 1.0, 0.0, tensors, dout)
        self.flex_cases(seq_len, "dense", layout, pairs, 1.0, tensors, dout, a.variants)
        group = a.num_q_heads // a.num_kv_heads
        dense_variants = [v for v in ("sdpa_cudnn", "sdpa_flash", "flash_attn") if v in a.variants]
        if not dense_variants:
            return
        q, k, v = (t.detach() for t in tensors)
        expanded = [q.clone().requires_grad_()] + [t.repeat_interleave(group, 1).requires_grad_() for t in (k, v)]
        for variant in dense_variants:
            if variant == "flash_attn":
                try:
                    attend = _flash_attn()
                except ImportError:
                    continue
                layout_bshd = [t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v)]
                self.record(seq_len, "dense", variant, causal_pairs, 1.0, 0.0, lambda attend=attend: attend,
                            layout_bshd, dout.transpose(1, 2).contiguous())
                continue
            backend = "CUDNN_ATTENTION" if variant == "sdpa_cudnn" else "FLASH_ATTENTION"
            self.record(seq_len, "dense", variant, causal_pairs, 1.0, 0.0, functools.partial(_sdpa, backend), expanded,
                        dout)

    def linear_rate(self, seq_len: int) -> None:
        """Time one matrix product of a decoder's MLP over `seq_len` tokens, forward + backward (y = x W; dx, dW:
        6 x S x hidden x intermediate FLOPs) in the run's dtype: the linear layers' rate on this device."""
        a = self.args
        hidden, wide = a.num_q_heads * a.head_dim, a.linear_intermediate
        g = torch.Generator(device=self.device).manual_seed(a.seed)
        dtype = getattr(torch, a.dtype)
        x, w = (torch.randn(*shape, generator=g, device=self.device).to(dtype).requires_grad_()
                for shape in ((seq_len, hidden), (hidden, wide)))
        dy = torch.randn(seq_len, wide, generator=g, device=self.device).to(dtype)

        def forward_backward():
            x.grad = w.grad = None
            (x @ w).backward(dy)

        row = {"seq_len": seq_len, "hidden": hidden, "intermediate": wide, "dtype": a.dtype}
        try:
            ms = time_ms(forward_backward, a.warmup, a.repeats, self.device)
            row.update(status="ok", fwd_bwd_ms=ms, fwd_bwd_tflops=6.0 * seq_len * hidden * wide / ms / 1e9)
            shown = f"fwd+bwd {ms:.2f} ms, {row['fwd_bwd_tflops']:.1f} TFLOP/s"
        except torch.OutOfMemoryError as e:
            row.update(status="oom", reason=str(e).splitlines()[0])
            shown = row["reason"]
        self.linear.append(row)  # (its tensors freed on return; `run` releases the cache after each S)
        print(f"[S={seq_len} linear {hidden}x{wide}] {row['status']}: {shown}", flush=True)

    def run(self, after_each_seq_len: Callable[[], None] | None = None):
        """The whole sweep. A sequence length whose set-up fails (inputs, layouts, estimation: out of
        memory at 256K, say) is recorded in `skipped` and the next one runs; `after_each_seq_len` is
        called after every S (main writes the JSON there, so a later failure loses nothing)."""
        for i, seq_len in enumerate(self.args.seq_lens):
            try:
                self.run_seq_len(seq_len, check=self.args.check and i == 0)
            except Exception as e:
                status = "oom" if isinstance(e, torch.OutOfMemoryError) else "error"
                reason = f"{type(e).__name__}: {e}".splitlines()[0][:500]
                self.skipped.append({"seq_len": seq_len, "status": status, "reason": reason})
                print(f"[S={seq_len}] skipped, {status} while setting up: {reason}", flush=True)
            self.release_memory()
            if after_each_seq_len is not None:
                after_each_seq_len()

    def run_seq_len(self, seq_len: int, check: bool):
        a = self.args
        tensors, dout = self.inputs(seq_len)
        cases = [(density_name(d), density_layout(seq_len, a.num_q_heads, a.block_size, d, a.num_verticals,
                                                   a.seed, self.device), tensors, dout, a.variants)
                 for d in a.densities]
        est_ms = {}
        if parse_budgets(a.estimated_budgets):
            q_pl, k_pl = planted_inputs(seq_len, a.num_q_heads, a.num_kv_heads, a.head_dim, a.seed)
            planted, planted_dout = self.inputs(seq_len, q_pl, k_pl)
            q_est, k_est = planted[0].detach(), planted[1].detach()
            meta = TokenMeta.contiguous(1, seq_len, self.device)
            for vt, st in parse_budgets(a.estimated_budgets):
                name = estimated_name(vt, st)
                cases.append((name, estimated_layout(q_est, k_est, vt, st, a.block_size), planted, planted_dout,
                              a.estimated_variants or a.variants))
                timing = time_estimation(q_est, k_est, estimation_config(vt, st, a.block_size), meta, a.warmup,
                                         a.repeats)
                memory = estimation_memory(q_est, k_est, estimation_config(vt, st, a.block_size), meta)
                self.estimation.append({"seq_len": seq_len, "layout": name, **timing, **memory})
                est_ms[name] = timing["total_ms"]
                print(f"[S={seq_len} {name}] estimation {timing['total_ms']:.2f} ms (documents "
                      f"{timing['documents_ms']:.2f}, scoring {timing['scoring_ms']:.2f}, layout "
                      f"{timing['layout_ms']:.2f}); peak {memory['peak_mib']:.1f} MiB for a layout of "
                      f"{memory['layout_mib']:.1f}", flush=True)
        for name, layout, inputs, grad, variants in cases:
            for against in ("flex_engine", "flex"):
                if check and against in variants:
                    self.check(seq_len, name, layout, inputs, against)
            self.sparse_case(seq_len, name, layout, inputs, grad, est_ms.get(name), variants)
        if a.dense:
            self.dense_case(seq_len, tensors, dout)
        if a.linear_intermediate:
            self.linear_rate(seq_len)


def baseline_ratios(rows: list[dict]) -> list[dict]:
    """For every `COMPARED` row, each baseline's fwd+bwd time over the row's (`BASELINES`: the Flex variants on
    the same layout, the dense ones on the dense layout of the same S), None where the baseline was not measured."""
    ok = _ok_rows(rows)
    out = []
    for r in ok.values():
        if r["variant"] not in COMPARED:
            continue
        against = {}
        for baseline, (_, dense_only) in BASELINES.items():
            ref = ok.get((r["seq_len"], "dense" if dense_only else r["layout"], baseline))
            against[baseline] = ref["fwd_bwd_ms"] / r["fwd_bwd_ms"] if ref else None
        out.append({"seq_len": r["seq_len"], "layout": r["layout"], "variant": r["variant"], "over": against})
    return out


def format_table(rows: list[dict]) -> str:
    """One line per row; on `COMPARED` rows one `x <name>` column per baseline (`BASELINES`): its fwd+bwd
    time over the row's (fxe: the flex engine, flex / fflash: compiled Flex on the same blocks, Triton / flash
    backend, cudnn / flash / fa2: dense SDPA cuDNN, SDPA flash, flash-attn at the same S); an auto row names the
    engine it picked (auto:flex)."""
    ratios = {(e["seq_len"], e["layout"], e["variant"]): e["over"] for e in baseline_ratios(rows)}
    header = (f"{'S':>5} {'layout':<14} {'variant':<11} {'kept':>6} {'cols':>5} {'fwd ms':>8} {'f+b ms':>8} "
              f"{'TF/s f':>7} {'TF/s f+b':>8} " + " ".join(f"{'x ' + name:>8}" for name, _ in BASELINES.values())
              + f" {'est %':>6}")
    lines = [header, "-" * len(header)]
    for r in rows:
        variant = f"auto:{r['auto_engine']}" if r.get("auto_engine") else r["variant"]
        head = (f"{r['seq_len'] // 1024:>4}K {r['layout']:<14} {variant:<11} {r['density']:6.3f} "
                f"{r['column_share']:5.2f} ")
        if r["status"] != "ok":
            lines.append(head + r["status"])
            continue
        over = ratios.get((r["seq_len"], r["layout"], r["variant"]), {})
        cells = " ".join(f"{over[b]:8.2f}" if over.get(b) is not None else " " * 8 for b in BASELINES)
        # estimation + layout construction as a share of the attention it serves (issue target: < 10% at 128K)
        est = r.get("estimation_ms")
        est_share = f"{100 * est / r['fwd_bwd_ms']:6.1f}" if est is not None else " " * 6
        fwd = (f"{r['fwd_ms']:8.2f}", f"{r['fwd_tflops']:7.0f}") if r["fwd_ms"] is not None else (" " * 8, " " * 7)
        lines.append(head + f"{fwd[0]} {r['fwd_bwd_ms']:8.2f} {fwd[1]} {r['fwd_bwd_tflops']:8.0f} {cells} {est_share}")
    return "\n".join(lines)


def _ok_rows(rows: list[dict]) -> dict[tuple[int, str, str], dict]:
    return {(r["seq_len"], r["layout"], r["variant"]): r for r in rows if r["status"] == "ok"}


def column_costs(rows: list[dict]) -> list[dict]:
    """Per (S, layout) where ours ran with and without the layout's columns: the columns' fwd+bwd time (ours minus
    ours_blocks) and share of ours, the TFLOP/s of the column pairs alone and of the block pairs (ours_blocks),
    beside compiled Flex's on the same blocks where it ran."""
    ok = _ok_rows(rows)
    out = []
    for (seq_len, layout, variant), blocks in ok.items():
        whole = ok.get((seq_len, layout, "ours"))
        if variant != "ours_blocks" or whole is None:
            continue
        flex = ok.get((seq_len, layout, "flex"))
        columns_ms = whole["fwd_bwd_ms"] - blocks["fwd_bwd_ms"]
        # the column pairs' work, from the rows' own counts (TFLOP/s x ms = GFLOP), as `record` counted it
        column_gflop = whole["fwd_bwd_tflops"] * whole["fwd_bwd_ms"] - blocks["fwd_bwd_tflops"] * blocks["fwd_bwd_ms"]
        out.append({"seq_len": seq_len, "layout": layout, "column_share": whole["column_share"],
                    "ours_ms": whole["fwd_bwd_ms"], "blocks_ms": blocks["fwd_bwd_ms"], "columns_ms": columns_ms,
                    "columns_time_share": columns_ms / whole["fwd_bwd_ms"],
                    # a difference of two timings: None when the columns cost nothing measurable
                    "columns_tflops": column_gflop / columns_ms if columns_ms > 0 else None,
                    "blocks_tflops": blocks["fwd_bwd_tflops"], "flex_tflops": flex["fwd_bwd_tflops"] if flex else None})
    return out


def format_column_costs(costs: list[dict]) -> str:
    header = (f"{'S':>5} {'layout':<14} {'cols':>5} {'ours ms':>8} {'blocks':>8} {'columns':>8} {'% time':>6} "
              f"{'TF/s cols':>9} {'TF/s blocks':>11} {'TF/s flex':>9}")
    lines = ["columns' cost: ours minus ours on the same layout without its columns (fwd+bwd)", header,
             "-" * len(header)]
    for c in costs:
        tf = lambda x, w: f"{x:{w}.0f}" if x is not None else " " * w
        lines.append(f"{c['seq_len'] // 1024:>4}K {c['layout']:<14} {c['column_share']:5.2f} {c['ours_ms']:8.2f} "
                     f"{c['blocks_ms']:8.2f} {c['columns_ms']:8.2f} {100 * c['columns_time_share']:6.1f} "
                     f"{tf(c['columns_tflops'], 9)} {tf(c['blocks_tflops'], 11)} {tf(c['flex_tflops'], 9)}")
    return "\n".join(lines)


def estimation_report(rows: list[dict], estimation: list[dict]) -> list[dict]:
    """Each estimation timing with our forward(+backward) time on the same layout and the shares it takes."""
    ours = _ok_rows(rows)
    report = []
    for e in estimation:
        r = ours.get((e["seq_len"], e["layout"], "ours"))
        report.append({
            **e,
            "kept_fraction": r["density"] if r else None,
            "ours_fwd_ms": r["fwd_ms"] if r else None,
            "ours_fwd_bwd_ms": r["fwd_bwd_ms"] if r else None,
            "share_of_fwd_bwd": e["total_ms"] / r["fwd_bwd_ms"] if r else None,
            "share_of_fwd": e["total_ms"] / r["fwd_ms"] if r and r["fwd_ms"] else None,  # (forward not timed)
        })
    return report


def format_estimation(report: list[dict]) -> str:
    header = (f"{'S':>5} {'layout':<14} {'kept':>6} {'est ms':>7} {'docs':>6} {'score':>6} {'layout':>7} "
              f"{'ours f+b':>9} {'% f+b':>6} {'peak MiB':>9} {'x layout':>8}")
    lines = [header, "-" * len(header)]
    for e in report:
        kept = f"{e['kept_fraction']:6.3f}" if e["kept_fraction"] is not None else " " * 6
        attn = (f"{e['ours_fwd_bwd_ms']:9.2f} {100 * e['share_of_fwd_bwd']:6.1f}" if e["ours_fwd_bwd_ms"] is not None
                else f"{'':9} {'':6}")
        memory = (f" {e['peak_mib']:9.1f} {e['peak_over_layout']:8.2f}" if e.get("peak_mib") is not None else "")
        lines.append(f"{e['seq_len'] // 1024:>4}K {e['layout']:<14} {kept} {e['total_ms']:7.2f} "
                     f"{e['documents_ms']:6.2f} {e['scoring_ms']:6.2f} {e['layout_ms']:7.2f} {attn}{memory}")
    return "\n".join(lines)


def issue_targets(rows: list[dict], estimation: list[dict], seq_len: int = 131072) -> list[dict]:
    """The issue's performance targets at `seq_len`, each with the measured value (None when the run
    did not measure it) and whether it passes. Ratios are fwd+bwd times (baseline / ours)."""
    ok = _ok_rows(rows)

    def ratio(layout: str, baseline: tuple[str, str]) -> float | None:
        ours, ref = ok.get((seq_len, layout, "ours")), ok.get((seq_len, *baseline))
        return ref["fwd_bwd_ms"] / ours["fwd_bwd_ms"] if ours and ref else None

    shares = [e["share_of_fwd_bwd"] for e in estimation_report(rows, estimation)
              if e["seq_len"] == seq_len and e["share_of_fwd_bwd"] is not None]
    five, ten = density_name(0.05), density_name(0.10)
    at = f"{seq_len // 1024}K"
    ours5 = ok.get((seq_len, five, "ours"))
    # The fastest rate any kernel of the run reached on the dense problem (cuDNN's, as measured so far): a target's
    # `ceiling` is its value had ours computed each of its pairs at that rate, and a bound above it asks more of the
    # sparse kernel than the best dense kernel does (on a GPU where that is not measured, no ceiling).
    dense_best = max((r["fwd_bwd_tflops"] for (s, layout, _), r in ok.items()
                      if s == seq_len and layout == "dense" and r.get("fwd_bwd_tflops")), default=None)

    def ceiling(layout: str, value: float | None, rate: bool = False) -> float | None:
        ours = ok.get((seq_len, layout, "ours"))
        if value is None or dense_best is None or not (ours and ours.get("fwd_bwd_tflops")):
            return None
        return dense_best if rate else value * dense_best / ours["fwd_bwd_tflops"]

    flex5, flash5, flex10 = ratio(five, (five, "flex")), ratio(five, (five, "flex_flash")), ratio(ten, (ten, "flex"))
    cudnn5, dense = ratio(five, ("dense", "sdpa_cudnn")), ratio("dense", ("dense", "flex"))
    rate5 = ours5["fwd_bwd_tflops"] if ours5 else None
    targets = [
        (f"{at} {five}: fwd+bwd speed-up over FlexAttention on a BlockMask of the same blocks (compiled, Triton "
         "backend; our columns left out for it)", flex5, ">=", 1.7, ceiling(five, flex5)),
        (f"{at} {five}: fwd+bwd speed-up over FlexAttention's flash backend on the same BlockMask",
         flash5, ">=", 1.7, ceiling(five, flash5)),
        (f"{at} {five}: fwd+bwd speed-up over dense SDPA cuDNN", cudnn5, ">=", 12.5, ceiling(five, cudnn5)),
        (f"{at} {five}: our fwd+bwd TFLOP/s on the computed pairs", rate5, ">=", 350.0, ceiling(five, rate5, True)),
        (f"{at} {ten}: fwd+bwd speed-up over FlexAttention, same blocks", flex10, ">=", 1.3, ceiling(ten, flex10)),
        (f"{at} dense: fwd+bwd speed relative to FlexAttention dense", dense, ">=", 1 / 1.25,
         ceiling("dense", dense)),
        (f"{at} estimation + layout build, share of our fwd+bwd (worst estimated layout)",
         max(shares, default=None), "<", 0.10, None),
    ]
    return [{"seq_len": seq_len, "target": name, "required": f"{op} {bound:.3g}", "measured": value,
             "pass": None if value is None else (value >= bound if op == ">=" else value < bound),
             "ceiling": top, "reachable": None if top is None else top >= bound}
            for name, value, op, bound, top in targets]


def engine_targets(rows: list[dict], seq_len: int = 131072) -> list[dict]:
    """#32's targets, each with the measured value (None when not measured) and whether it passes: at
    `seq_len`, our kernels' fwd+bwd speed-up over the flex engine (Flex on the same layout, columns
    included) at ~5% kept and on the dense layout, and over every (S, layout) measured, auto's time
    over the faster engine's."""
    ok = _ok_rows(rows)

    def ratio(layout: str) -> float | None:
        ours, flex = ok.get((seq_len, layout, "ours")), ok.get((seq_len, layout, "flex_engine"))
        return flex["fwd_bwd_ms"] / ours["fwd_bwd_ms"] if ours and flex else None

    auto = [r["fwd_bwd_ms"] / min(ok[(r["seq_len"], r["layout"], v)]["fwd_bwd_ms"] for v in ("ours", "flex_engine"))
            for r in ok.values() if r["variant"] == "auto"
            and all((r["seq_len"], r["layout"], v) in ok for v in ("ours", "flex_engine"))]
    at, five = f"{seq_len // 1024}K", density_name(0.05)
    targets = [
        (f"{at} {five}: our kernels' fwd+bwd speed-up over the flex engine (same layout, columns included)",
         ratio(five), ">=", 1.7),
        (f"{at} dense: our kernels' fwd+bwd speed relative to the flex engine", ratio("dense"), ">=", 1 / 1.25),
        ("every S and layout measured: auto's fwd+bwd time over the faster engine's (worst)", max(auto, default=None),
         "<=", 1.05),
    ]
    return [{"target": name, "required": f"{op} {bound:.3g}", "measured": value,
             "pass": None if value is None else (value >= bound if op == ">=" else value <= bound)}
            for name, value, op, bound in targets]


def engine_table(rows: list[dict], env: dict, args: BenchAttentionArguments, command: list[str]) -> dict:
    """The timing table `hf_sparse_cp.attention.engines` reads for 'auto': per (S, layout) where both
    engines ran, their fwd+bwd times and the call's shape."""
    ok = _ok_rows(rows)
    table = []
    for (seq_len, layout, variant), r in ok.items():
        flex = ok.get((seq_len, layout, "flex_engine"))
        if variant != "ours" or flex is None:
            continue
        table.append({"seq_len": seq_len, "layout": layout, "kept_fraction": r["density"],
                      "has_columns": r["column_share"] > 0, "head_dim": args.head_dim, "num_q_heads": args.num_q_heads,
                      "num_kv_heads": args.num_kv_heads, "dtype": args.dtype, "triton_ms": r["fwd_bwd_ms"],
                      "flex_ms": flex["fwd_bwd_ms"]})
    return {"kind": TABLE_KIND, "date": datetime.now(UTC).isoformat(timespec="seconds"), **env,
            "command": command, "rows": table}


def rate_shares(rows: list[dict], linear: list[dict]) -> list[dict]:
    """Per S and layout of ours: our fwd+bwd TFLOP/s on the computed pairs over the MLP matrix product's
    (`Bench.linear_rate`) at that S, beside the planner's `ATTENTION_RATE_SHARE`, which weighs a token's linear work
    against its attention pairs by this share."""
    rates = {r["seq_len"]: r["fwd_bwd_tflops"] for r in linear if r["status"] == "ok"}
    return [{"seq_len": r["seq_len"], "layout": r["layout"], "ours_tflops": r["fwd_bwd_tflops"],
             "linear_tflops": rates[r["seq_len"]], "measured_share": r["fwd_bwd_tflops"] / rates[r["seq_len"]],
             "planner_share": ATTENTION_RATE_SHARE}
            for r in rows if r["variant"] == "ours" and r["status"] == "ok" and r["seq_len"] in rates]


def format_rate_shares(shares: list[dict]) -> str:
    lines = ["our attention's rate over the MLP matrix product's (the planner's ATTENTION_RATE_SHARE: "
             f"{ATTENTION_RATE_SHARE})", f"{'S':>8} {'layout':<14} {'ours TFLOP/s':>13} {'linear TFLOP/s':>15} "
             f"{'share':>6}"]
    lines += [f"{s['seq_len']:>8} {s['layout']:<14} {s['ours_tflops']:>13.1f} {s['linear_tflops']:>15.1f} "
              f"{s['measured_share']:>6.2f}" for s in shares]
    return "\n".join(lines)


def build_report(bench: Bench, env: dict, complete: bool, command: list[str] | None = None) -> dict:
    a = bench.args
    return {
        "benchmark": "bench_attention",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "complete": complete,
        **env,
        "command": command,
        "settings": {**dataclasses.asdict(a), "batch_size": 1, "causal": True,
                     "flops": "fwd = 4 * head_dim * computed pairs; fwd+bwd = 3.5 * fwd"},
        "results": bench.rows,
        "skipped": bench.skipped,
        "checks": bench.checks,
        "estimation": estimation_report(bench.rows, bench.estimation),
        "ratios": baseline_ratios(bench.rows),
        "column_costs": column_costs(bench.rows),
        "linear": bench.linear,
        "rate_shares": rate_shares(bench.rows, bench.linear),
        "targets": issue_targets(bench.rows, bench.estimation),
        "engine_targets": engine_targets(bench.rows),
    }


def print_report(report: dict) -> None:
    print()
    print(f"{report['device']}, torch {report['torch']}, triton {report['triton']}, cuda {report['cuda']}")
    print(format_table(report["results"]))
    for s in report["skipped"]:
        print(f"S={s['seq_len']}: skipped ({s['status']} while setting up: {s['reason']})")
    for c in report["checks"]:
        if c["status"] == "error":
            print(f"CHECK error: S={c['seq_len']} {c['layout']} vs {c['against']}: {c['reason']}")
        elif c["status"] == "FAIL":
            print(f"CHECK FAIL: S={c['seq_len']} {c['layout']}: ours vs {c['against']} rel. RMS {c['rel_rms']:.2e} "
                  f"> {c['rtol']:g}")
    if report["column_costs"]:
        print()
        print(format_column_costs(report["column_costs"]))
    if report["estimation"]:
        print()
        print(format_estimation(report["estimation"]))
    if report["rate_shares"]:
        print()
        print(format_rate_shares(report["rate_shares"]))
    print(format_profiles(report["results"], lambda r: f"S={r['seq_len']} {r['layout']} {r['variant']}: one fwd+bwd "
                          f"step by kernel (timed median {r['fwd_bwd_ms']:.2f} ms)"), end="")
    print()
    print(format_targets(report["targets"]))
    print(format_targets(report["engine_targets"]))


def main(argv: list[str]) -> dict:
    args = parse_gpu_benchmark_args(BenchAttentionArguments, argv, "bench_attention.py")
    if args.dry_run and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("bench_attention.py --dry_run runs our kernels in Triton's interpreter: set "
                         "TRITON_INTERPRET=1.")
    device = "cpu" if args.dry_run else "cuda"
    env = environment(torch.device(device))
    command = [sys.executable, *sys.argv] if argv == sys.argv[1:] else ["bench_attention.py", *argv]
    out = ReportFile(RESULTS_DIR, "attention", args.output)
    table_path = Path(args.engine_table or RESULTS_DIR / f"engine-table_{device_slug(env['device'])}.json")
    os.environ[TABLE_ENV] = str(table_path)  # what this run's `auto` rows read

    def write_table():
        table_path.parent.mkdir(parents=True, exist_ok=True)
        table_path.write_text(json.dumps(engine_table(bench.rows, env, args, command), indent=2) + "\n")

    bench = Bench(args, device, table=write_table)
    bench.run(after_each_seq_len=lambda: (write_table(), out.write(build_report(bench, env, False, command))))
    write_table()
    report = {**build_report(bench, env, complete=True, command=command), "engine_table": str(table_path)}
    print_report(report)
    out.write(report)
    print(f"wrote {table_path}")
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
