"""Compiling the kernels for Hopper (sm_90) as a real launch would, without a GPU, and reading what
each build uses.

Triton compiles ahead of time for a named target (`triton.compile` with `GPUTarget("cuda", 90,
32)`; its bundled ptxas makes the cubin), so the tiles in `configs` can be checked on any machine.
A build is only as good as its signature, though: at a launch the JIT specializes every argument
(a pointer or an integer divisible by 16 gets `tt.divisibility = 16`, which lets loads and
stores use 16-byte vectors and `cp.async`; an integer equal to 1 becomes a constant). So the
builds here take the arguments of real launches: the launchers (`block_sparse_fwd.forward`,
`block_sparse_bwd.backward`, `vertical_slash.vertical_slash_scores`) run on meta tensors of a
representative geometry (`Launch`), the kernel launches they make are recorded instead of run, and
each recorded argument list is specialized by Triton's own rule (`native_specialize_impl`, as the
JIT does) before `triton.compile`.

From a build `usage` reads: shared memory (against the H100's 227 KB), the registers and stack
frame ptxas gave each thread (cubin, Triton's bundled `cuobjdump`; registers cap at 255, a stack
frame beyond a few bytes holds spilled registers), the wgmma instruction shapes in the PTX (a
Hopper tensor-core product; `m64n16` would run a quarter-wide tile, `mma.sync` the older path),
the divisibility hints the build saw, and how deep its loops keep loads in flight.
"""

from __future__ import annotations

import collections
import contextlib
import os
import re
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime

import torch
import triton
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend

from ..env import environment
from ..kernels import block_sparse_bwd, block_sparse_fwd, column_bwd, configs, vertical_slash
from ..kernels.configs import Tiles

H100_SHARED_BYTES = 227 * 1024
TARGET = GPUTarget("cuda", 90, 32)

# The kernel variants a training run launches, and the `configs` kernel whose tiles each one takes.
VARIANTS = ("forward", "forward_merge", "dq", "dq_column_grads", "dkdv", "dkdv_no_columns", "scoring_row_stats",
            "scoring_scores")
# Variants launched only under a tile override (`configs.OPTIONAL_KERNELS`): `build` takes them with tiles.
OPTIONAL_VARIANTS = ("columns",)
TUNED_KERNEL = {"forward": "forward", "forward_merge": "forward", "dq": "dq", "dq_column_grads": "dq", "dkdv": "dkdv",
                "dkdv_no_columns": "dkdv", "columns": "columns"}


@dataclass(frozen=True)
class Launch:
    """The geometry of the recorded launches: a Qwen2.5-3B-like attention layer (16 query heads,
    2 key/value heads) at 128K tokens in transformers' [B, S, H, D] layout, per-head layouts.

    max_blocks, max_cols: widths of the layout's index tensors; they depend on the data, so they are
    chosen *not* divisible by 16 (no hint a launch might lack).
    """

    head_dim: int = 128
    dtype: torch.dtype = torch.bfloat16
    q_heads: int = 16
    kv_heads: int = 2
    seq_len: int = 131072
    block_size: int = 128
    max_blocks: int = 83
    max_cols: int = 1000
    scoring_rows: int = 64


_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def launch_for(head_dim: int, dtype: str = "bf16") -> Launch:
    """The default `Launch` with this head_dim and dtype name ("bf16", "fp16", "fp32")."""
    return Launch(head_dim=head_dim, dtype=_DTYPES[dtype])


@contextlib.contextmanager
def _recorded(calls: list) -> Iterator[None]:
    """Kernel launches inside the block append (kernel, args, kwargs) to `calls` instead of running."""
    kernels = (block_sparse_fwd._forward_kernel, block_sparse_bwd._preprocess_kernel, block_sparse_bwd._dq_kernel,
               block_sparse_bwd._dkdv_kernel, block_sparse_bwd._column_sum_kernel, column_bwd._column_kernel,
               vertical_slash._row_stats_kernel, vertical_slash._scores_kernel)

    def recorder(kernel):
        return lambda *args, grid, warmup, **kwargs: calls.append((kernel, args, kwargs))

    for k in kernels:
        k.run = recorder(k)  # an instance attribute in front of JITFunction.run, which `kernel[grid](...)` calls
    try:
        yield
    finally:
        for k in kernels:
            del k.run


def recorded_launches(launch: Launch) -> dict[str, tuple]:
    """Variant name -> (kernel, args, kwargs) of the launches the launchers make for `launch`, on meta
    tensors (nothing is allocated or run); "columns" only under its tile override."""
    meta = torch.device("meta")
    b, s, hq, hk, d, bs = 1, launch.seq_len, launch.q_heads, launch.kv_heads, launch.head_dim, launch.block_size
    nqb = -(-s // bs)

    def heads_last(h):  # [B, H, S, D] views of [B, S, H, D] tensors, as transformers passes them
        return torch.empty(b, s, h, d, dtype=launch.dtype, device=meta).transpose(1, 2)

    q, k, v, dout = heads_last(hq), heads_last(hk), heads_last(hk), heads_last(hq)
    i32 = dict(dtype=torch.int32, device=meta)
    block_idx, cnt = torch.empty(b, hq, nqb, launch.max_blocks, **i32), torch.empty(b, hq, nqb, **i32)
    partial = torch.empty(b, hq, nqb, launch.max_blocks, dtype=torch.bool, device=meta)
    col_idx, no_cols = torch.empty(b, hq, nqb, launch.max_cols, **i32), torch.empty(b, hq, nqb, 0, **i32)
    col_full = torch.empty(b, hq, nqb, 2, **i32)
    tokens = (torch.empty(b, s, dtype=torch.int64, device=meta), torch.empty(b, s, **i32))
    out = heads_last(hq)  # a training step's fresh output: the input dtype in [B, S, H, D] memory
    merged = torch.empty(b, hq, s, d, dtype=torch.float32, device=meta)  # a ring's running result
    lse = torch.empty(b, hq, s, dtype=torch.float32, device=meta)
    common = dict(scale=d ** -0.5, block_size=bs, window=None)

    def record(fn, *args, **kwargs) -> list:
        calls = []
        with _recorded(calls):
            fn(*args, **kwargs)
        return calls

    fwd = lambda merge: record(block_sparse_fwd.forward, q, k, v, block_idx, cnt, cnt, col_idx, cnt, col_full,
                               *tokens, *tokens, merged if merge else out, lse, merge=merge, **common)
    bwd = lambda cols: record(block_sparse_bwd.backward, q, k, v, out, lse, dout, None, block_idx, cnt, cnt, partial,
                              cols, cnt, col_full, *tokens, *tokens, deterministic=False, grads_in_input_dtype=True,
                              **common)
    _, dq, dkdv_no_cols = bwd(no_cols)
    _, dq_cols, *key_major, dkdv = bwd(col_idx)
    q_rows = torch.empty(hq, launch.scoring_rows, d, dtype=launch.dtype, device=meta)
    row_stats, scores = record(vertical_slash.vertical_slash_scores, q_rows, k[0], d ** -0.5)
    return {"forward": fwd(False)[0], "forward_merge": fwd(True)[0], "dq": dq, "dq_column_grads": dq_cols,
            "dkdv": dkdv, "dkdv_no_columns": dkdv_no_cols, "scoring_row_stats": row_stats, "scoring_scores": scores,
            **dict(zip(OPTIONAL_VARIANTS, key_major))}


def compile_launch(kernel, args: tuple, kwargs: dict):
    """Build one recorded launch for sm_90, each argument specialized as the JIT specializes it."""
    kwargs = dict(kwargs)
    options = {name: kwargs.pop(name) for name in ("num_warps", "num_stages", "enable_fp_fusion") if name in kwargs}
    values = dict(zip(kernel.arg_names, args)) | kwargs
    backend = make_backend(TARGET)
    signature, constexprs, attrs = {}, {}, {}
    for i, p in enumerate(kernel.params):
        value = values[p.name]
        if p.is_constexpr:
            signature[p.name], constexprs[(i,)] = "constexpr", value
            continue
        ty, attr = native_specialize_impl(type(backend), value, False, not p.do_not_specialize,
                                          not p.do_not_specialize_on_alignment)
        if ty == "constexpr":  # an integer equal to 1
            signature[p.name], constexprs[(i,)] = "constexpr", attr
            continue
        signature[p.name] = ty
        if isinstance(attr, str) and attr:
            attrs[(i,)] = backend.parse_attr(attr)
    return triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=TARGET, options=options)


def _tiles_of(kwargs: dict) -> Tiles:
    return Tiles(kwargs.get("BLOCK_M", kwargs.get("BLOCK", 0)), kwargs.get("BLOCK_N", kwargs.get("BLOCK", 0)),
                 kwargs.get("BLOCK_C", 0), kwargs["num_warps"], kwargs["num_stages"],
                 kwargs.get("SEPARATE_COLUMNS", False), kwargs.get("KV_DESCRIPTORS", False), kwargs.get("STEPS", 1),
                 kwargs.get("TILE_MAJOR", False), kwargs.get("META_RELOAD", False),
                 any(kwargs.get(name, False) for name in ("LEAN", "ROWS_I32", "WHOLE_ROWS")))


def build(name: str, tiles: Tiles | None = None, launch: Launch | None = None):
    """Build variant `name` (one of `VARIANTS`, or of `OPTIONAL_VARIANTS` with `tiles`) of `launch` (default
    `Launch()`) for sm_90, with the launchers' tiles or, for the tuned kernels, with `tiles`. Returns (tiles,
    build)."""
    if name not in VARIANTS + OPTIONAL_VARIANTS or (name in OPTIONAL_VARIANTS and tiles is None):
        raise ValueError(f"unknown variant {name!r}; use {VARIANTS}, or {OPTIONAL_VARIANTS} with tiles.")
    override = {}
    if tiles is not None:
        if name not in TUNED_KERNEL:
            raise ValueError(f"{name} takes no tile override (the scoring tiles are fixed in configs).")
        override = {TUNED_KERNEL[name]: tiles}
    with configs.tiles_override(**override):
        kernel, args, kwargs = recorded_launches(launch or Launch())[name]
    return _tiles_of(kwargs), compile_launch(kernel, args, kwargs)


def launcher_builds(head_dim: int, dtype: str = "bf16") -> dict[str, tuple[Tiles, object]]:
    """Every kernel variant a GPU run launches at this head_dim, as the launchers launch it:
    name -> (tiles, build)."""
    launches = recorded_launches(launch_for(head_dim, dtype))
    return {name: (_tiles_of(kw), compile_launch(kernel, args, kw)) for name, (kernel, args, kw) in launches.items()}


@dataclass(frozen=True)
class Usage:
    """What one build uses per thread (registers, stack bytes) and per program (shared bytes); its
    wgmma instructions by shape ("m64n64k16": count) and mma.sync count; how many kernel arguments
    carry the 16-divisibility hint, and 16-byte global loads (ld.global.v4 / 16-byte cp.async);
    copies_in_flight: the most asynchronous copies any loop leaves in flight when it waits (0: every
    loop waits for all its loads each step, so loads run at most one step ahead); warp_specialized: Triton
    split a loop into producer and consumer warpgroups (`ttg.warp_specialize` in the TTGIR)."""

    registers: int
    stack_bytes: int
    shared_bytes: int
    wgmma: int
    mma_sync: int
    wgmma_shapes: dict = field(default_factory=dict)
    hinted_args: int = 0
    wide_loads: int = 0
    copies_in_flight: int = 0
    warp_specialized: bool = False

    def narrowest_wgmma_n(self) -> int:
        """The smallest N of the build's wgmma shapes (0 without wgmma)."""
        return min((int(re.search(r"n(\d+)", s).group(1)) for s in self.wgmma_shapes), default=0)


def build_report(benchmark: str, rows: list[dict], **details) -> dict:
    """The JSON report of sm_90 builds made on this machine: the benchmark's name, the date, this machine's
    environment (Triton's version among it), what was built and that nothing ran, then `details` and `rows`."""
    return {"benchmark": benchmark, "date": datetime.now(UTC).isoformat(timespec="seconds"),
            **environment(torch.device("cpu")), "target": "sm_90 (ahead-of-time build, no GPU)",
            "measured": "cpu build: nothing here ran or was timed", **details, "rows": rows}


def usage(build) -> Usage:
    """Resources of a build, from its cubin (cuobjdump), PTX, TTIR and TTGIR."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "kernel.cubin")
        with open(cubin, "wb") as f:
            f.write(build.asm["cubin"])
        report = subprocess.run([tool, "-res-usage", cubin], capture_output=True, text=True, check=True).stdout
    reg = lambda name: int(re.search(rf"{name}:(\d+)", report).group(1))
    ptx = build.asm["ptx"]
    signature = re.search(r"tt\.func public @.*", build.asm["ttir"]).group(0)  # the kernel's argument list
    shapes = collections.Counter(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)", ptx))
    wide = len(re.findall(r"ld\.global(?:\.\w+)*\.v4\.b32|cp\.async\.cg\.shared\.global[^;]*, 0x10\b", ptx))
    waits = [int(n) for n in re.findall(r"ttg\.async_wait[^{\n]*\{num = (\d+)", build.asm["ttgir"])]
    return Usage(reg("REG"), reg("STACK"), build.metadata.shared, ptx.count("wgmma.mma_async"),
                 ptx.count("mma.sync"), dict(sorted(shapes.items())), signature.count("tt.divisibility = 16"), wide,
                 max(waits, default=0), "ttg.warp_specialize(" in build.asm["ttgir"])
