"""Compiling the kernels for Hopper (sm_90) without a GPU, and reading what the build uses.

Triton compiles ahead of time for a named target (`triton.compile` with `GPUTarget("cuda", 90,
32)`; its bundled ptxas makes the cubin), so the tile shapes in `configs` can be checked on any
machine: shared memory against the H100's 227 KB, matrix products on wgmma (the Hopper tensor-
core path; `mma.sync` would be the older, slower one), and the registers and stack frame that
ptxas gave each thread, read from the cubin with Triton's bundled `cuobjdump`. Registers cap at
255 per thread; a stack frame beyond a few bytes holds spilled registers, local-memory traffic in
the inner loops. Signatures carry no divisibility hints (a GPU launch marks 16-divisible pointers
and strides, which may vectorize loads further), so the figures are those of the plainest build.
"""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from . import block_sparse_bwd, block_sparse_fwd, vertical_slash
from .configs import Tiles, dkdv_tiles, dq_tiles, forward_tiles, scoring_tiles

H100_SHARED_BYTES = 227 * 1024
_FLOAT_ARGS = {"qk_scale", "scale"}
_INT64_POINTERS = {"QIndex", "KIndex"}
_FP32_POINTERS = {"Out", "Lse", "Lse2", "Delta", "DQ", "DK", "DV", "ColDK", "ColDV", "PartDK", "PartDV", "RowMax",
                  "RowSum", "Vertical", "Chunks"}
_INT32_POINTERS = {"BlockIdx", "BlockCnt", "ColIdx", "ColCnt", "QSegment", "KSegment", "QSummary", "KSummary",
                   "RowPtr", "Entries"}


def _signature(kernel, constexprs: dict, dtype: str) -> dict:
    sig = {}
    for name in inspect.signature(kernel.fn).parameters:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in _FLOAT_ARGS:
            sig[name] = "fp32"
        elif name in _INT64_POINTERS:
            sig[name] = "*i64"
        elif name in _FP32_POINTERS:
            sig[name] = "*fp32"
        elif name in _INT32_POINTERS:
            sig[name] = "*i32"
        elif name[0].isupper():  # Q, K, V, DOut
            sig[name] = f"*{dtype}"
        else:
            sig[name] = "i32"
    return sig


def compile_for_sm90(kernel, tiles: Tiles, constexprs: dict, dtype: str = "bf16"):
    """Build `kernel` (a `@triton.jit` function) for sm_90 with `tiles`' warps and stages."""
    params = list(inspect.signature(kernel.fn).parameters)
    src = ASTSource(kernel, _signature(kernel, constexprs, dtype),
                    constexprs={(params.index(k),): v for k, v in constexprs.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": tiles.num_warps, "num_stages": tiles.num_stages})


@dataclass(frozen=True)
class Usage:
    """What one build uses per thread (registers, stack bytes) and per program (shared bytes)."""

    registers: int
    stack_bytes: int
    shared_bytes: int
    wgmma: int
    mma_sync: int


def usage(build) -> Usage:
    """Resources of a `compile_for_sm90` build, from its cubin (cuobjdump) and its PTX."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "kernel.cubin")
        with open(cubin, "wb") as f:
            f.write(build.asm["cubin"])
        report = subprocess.run([tool, "-res-usage", cubin], capture_output=True, text=True, check=True).stdout
    field = lambda name: int(re.search(rf"{name}:(\d+)", report).group(1))
    ptx = build.asm["ptx"]
    return Usage(field("REG"), field("STACK"), build.metadata.shared, ptx.count("wgmma.mma_async"),
                 ptx.count("mma.sync"))


def _variant(name: str, tiles: Tiles, head_dim: int, block_size: int):
    """(kernel, constexprs) of one named kernel variant built with `tiles`."""
    common = dict(HEAD_DIM=head_dim, BLOCK_D=head_dim, LAYOUT_BLOCK=block_size, HAS_WINDOW=False, PRECISION="tf32")
    rows = dict(common, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n)
    scoring = dict(HEAD_DIM=head_dim, BLOCK_D=head_dim, PRECISION="tf32")
    dq = dict(rows, BLOCK_C=tiles.block_c, SEPARATE_COLUMNS=tiles.separate_columns)
    variants = {
        "forward": (block_sparse_fwd._forward_kernel, dict(rows, BLOCK_C=tiles.block_c, MERGE=False)),
        "forward_merge": (block_sparse_fwd._forward_kernel, dict(rows, BLOCK_C=tiles.block_c, MERGE=True)),
        "dq": (block_sparse_bwd._dq_kernel, dict(dq, COLUMN_GRADS=0)),
        "dq_column_grads": (block_sparse_bwd._dq_kernel, dict(dq, COLUMN_GRADS=1)),
        "dkdv": (block_sparse_bwd._dkdv_kernel, dict(rows, ACCUMULATE=True)),
        "scoring_row_stats": (vertical_slash._row_stats_kernel,
                              dict(scoring, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n)),
        "scoring_scores": (vertical_slash._scores_kernel, dict(scoring, BLOCK=tiles.block_m)),
    }
    return variants[name]


def build(name: str, tiles: Tiles, head_dim: int, dtype: str = "bf16", block_size: int = 128):
    """Build the named kernel variant ("forward", "forward_merge", "dq", "dq_column_grads", "dkdv",
    "scoring_row_stats", "scoring_scores") for sm_90 with `tiles`."""
    kernel, constexprs = _variant(name, tiles, head_dim, block_size)
    return compile_for_sm90(kernel, tiles, constexprs, dtype)


def launcher_builds(head_dim: int, dtype: str = "bf16", block_size: int = 128) -> dict[str, tuple[Tiles, object]]:
    """Every kernel variant a GPU run launches at this head_dim, built with the launchers' tiles:
    name -> (tiles, build)."""
    fwd = forward_tiles(block_size, head_dim, on_gpu=True)
    dq = dq_tiles(block_size, head_dim, on_gpu=True)
    s = scoring_tiles(on_gpu=True)
    tiles = {
        "forward": fwd,
        "forward_merge": fwd,
        "dq": dq,
        "dq_column_grads": dq,
        "dkdv": dkdv_tiles(block_size, head_dim, on_gpu=True),
        "scoring_row_stats": Tiles(s.block_m, s.block_n, 0, s.num_warps, s.stats_stages),
        "scoring_scores": Tiles(s.block, s.block, 0, s.num_warps, 1),
    }
    return {name: (t, build(name, t, head_dim, dtype, block_size)) for name, t in tiles.items()}
