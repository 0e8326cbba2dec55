"""Tile sizes, warps and pipeline depth of the kernels, chosen per launch (no autotuning).

Autotuning is left out on purpose: the forward can merge into its output in place, so a tuner's
repeated trial launches would corrupt it, and per-shape tuning would stall the first training steps.
The CUDA choices were made without a GPU, from sm_90 builds with the arguments of real launches,
divisibility hints included (`sm90`, `benchmarks/kernel_resources.py`): every choice keeps all
matrix products on wgmma at least 32 wide (no m64n16; column tiles are 64 rows: transposed column
products need M >= 64), shared memory under 227 KB and no spilled register; the builds behind each
choice are in `benchmarks/results/README.md`. `benchmarks/tune_tiles.py` times the candidates on a GPU
through `tiles_override`; its winners belong here once measured, and until then a GPU run can launch
them from its report (the tile table, `TILES_ENV`). fp32 inputs (FMA products, no wgmma) take small tiles of
their own (`FP32_TILES`: shared memory). Under Triton's interpreter (CPU tensors) tiles are
small so that the tests cover the sub-tiling loops. Heads above 128 lanes (up to `limits.MAX_HEAD_DIM`,
256: Gemma) take tiles of their own (`WIDE_HEAD_TILES`, `FP32_WIDE_HEAD_TILES`).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

from .limits import NARROW_HEAD_DIM


@dataclass(frozen=True)
class Tiles:
    """Tile shape of one kernel launch.

    block_m: query rows of a program (forward, dq) or of one inner step (dk/dv).
    block_n: key rows of one inner step (forward, dq) or of a program (dk/dv).
    block_c: gathered key columns of one inner step.
    separate_columns: dq only: the vertical columns' dk/dv come from a second pass over the columns
        after dq is stored, instead of inside the dq loop. The pass recomputes two of the five
        products per column step, but the dq accumulator is no longer live beside the columns'
        dk/dv tiles.
    kv_descriptors: forward and dq: the key-block loop loads its K/V tiles through TMA tensor
        descriptors (one bulk copy per tile on sm_90; the columns keep their gathers), where the
        tensors allow it (`block_sparse_fwd.descriptors_fit`), else through pointers. Off in the
        launched tiles until a GPU has timed it; builds for sm_90 (tests/kernels/test_kernels_compile.py).
    query_steps: columns only: the query tiles (block_m rows each) one program walks for every chunk of
        block_c column tokens (`column_bwd`); the columns kernel takes no block_n.
    tile_major: forward and dq: the grid runs the query tiles of one head next to each other (FlexAttention's
        order) instead of the heads of one query tile (`tiles.program_tile`); dk/dv: the key tiles of one kv head
        instead of alternating kv heads. Along a layout's diagonals the tiles in flight then read the K/V (Q/dO)
        tiles their neighbours read a step before, from L2 rather than HBM; each program computes what it did.
        Off in the launched tiles until a GPU has timed it.
    column_meta_reload: forward and dq: a masked column step reads its slots again for the token metadata
        (`tiles.column_step_meta`) instead of using the tokens its K/V gather loaded. Triton 3.6 (the GPU image's)
        otherwise loads every step's tokens twice, in the gather's layout and in the scores' (4-byte copies, 16 a
        thread): sm_90 builds at head_dim 128 issue 21% (forward), 26% (dq) and 15% (dq with the columns' dk/dv)
        fewer instructions per unmasked column step, at the price of one more dependent load in a masked one (at
        most one step a row without documents or a window: the row's last, partly used). Triton 3.9 already loads
        them once (3-4% fewer). Off in the launched tiles until a GPU has timed it (benchmarks/results/README.md).
    lean_index: rows addressed as FlexAttention's statically shaped kernels address theirs: the key-block loads of the
        forward and dq (pointer loads; TMA descriptors take their own) and the query rows of each dk/dv step (Q, dO,
        lse, delta) are offset in int32 from their (batch row, head)'s base where the tensors' rows fit int32, and
        load without masks where the rows fill whole layout blocks and the head the tile's lanes
        (`block_sparse_fwd.lean_rows`); dk/dv's key-block CSR entries carry the query head in their high bits
        (`indexing.key_block_csr` `packed`), so a step finds its head and query block with a shift and a mask
        instead of two divisions by runtime values, with the heads an entry stands for a compile-time constant.
        The same products in the same order. Off in the launched tiles until a GPU has timed it.
    """

    block_m: int
    block_n: int
    block_c: int
    num_warps: int
    num_stages: int
    separate_columns: bool = False
    kv_descriptors: bool = False
    query_steps: int = 1
    tile_major: bool = False
    column_meta_reload: bool = False
    lean_index: bool = False


# Tiles set by `tiles_override` (tuning runs), by kernel name.
_overrides: dict[str, Tiles] = {}
KERNELS = ("forward", "dq", "dkdv")
# Kernels launched only when their tiles are overridden (candidates not yet timed on a GPU).
OPTIONAL_KERNELS = ("columns",)


@contextlib.contextmanager
def tiles_override(**tiles: Tiles) -> Iterator[None]:
    """Launch the named kernels ("forward", "dq", "dkdv", "columns") with these tiles inside the block, on
    any device (`benchmarks/tune_tiles.py` times candidates this way); block_m/block_n are capped at
    the layout block size. Tiles are checked first (`check_tiles`). "columns" has no tiles otherwise: with
    them, the columns' dk/dv come from the key-major kernel (`column_bwd`) instead of the dq kernel's
    atomics (the deterministic mode keeps its partial sums)."""
    unknown = set(tiles) - set(KERNELS + OPTIONAL_KERNELS)
    if unknown:
        raise ValueError(f"unknown kernels {sorted(unknown)}; use {KERNELS + OPTIONAL_KERNELS}.")
    for kernel, t in tiles.items():
        check_tiles(kernel, t)
    previous = dict(_overrides)
    _overrides.update(tiles)
    try:
        yield
    finally:
        _overrides.clear()
        _overrides.update(previous)


# Tile fields a kernel does not read, which may be 0: the columns kernel takes no key step (its candidates say
# block_n 0), the dk/dv kernel no column step.
UNREAD_FIELDS = {"columns": ("block_n",), "dkdv": ("block_c",)}


def _power_of_two(n) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and n >= 1 and n & (n - 1) == 0


def check_tiles(kernel: str, tiles: Tiles) -> None:
    """Raise a ValueError naming the kernel, field and value unless block_m, block_n, block_c and query_steps
    are powers of two (Triton's tl.arange lengths; 0 for a field the kernel does not read, `UNREAD_FIELDS`),
    num_warps is a power of two and num_stages at least 1."""
    for name in ("block_m", "block_n", "block_c", "query_steps", "num_warps"):
        value = getattr(tiles, name)
        unread = name in UNREAD_FIELDS.get(kernel, ())
        if not (_power_of_two(value) or (unread and value == 0)):
            allowed = "a power of two" + (" or 0 (the kernel does not read it)" if unread else "")
            raise ValueError(f"{kernel} tiles: {name}={value!r}; it must be {allowed}.")
    if not (isinstance(tiles.num_stages, int) and tiles.num_stages >= 1):
        raise ValueError(f"{kernel} tiles: num_stages={tiles.num_stages!r}; it must be an integer of at least 1.")


def _overridden(kernel: str, block_size: int) -> Tiles | None:
    t = _overrides.get(kernel)
    return t and _capped(t, block_size)


# The tile table: the JSON report of a `benchmarks/tune_tiles.py` run on a GPU. Its `chosen` tiles (per kernel, the
# fastest candidate that computed the launched tiles' result and beat their time by the run's `min_gain`) are
# launched in place of the tiles below, but only on the GPU model, head_dim, layout block and dtype that run
# measured (`chosen.applies_to`); anywhere else, and without the variable, the tiles below.
TILES_ENV = "HF_SPARSE_CP_TILES"


@functools.cache
def _read_tile_table(path: str, version: tuple[int, int]) -> tuple[tuple, dict[str, Tiles]]:
    del version  # (modification time, size): part of the cache key only, so that a rewritten file is read again
    try:
        chosen = json.loads(Path(path).read_text())["chosen"]
        where = chosen["applies_to"]
        key = (str(where["device"]), int(where["head_dim"]), int(where["block_size"]), str(where["dtype"]))
        tiles = {kernel: Tiles(**t) for kernel, t in chosen["tiles"].items()}
        for kernel, t in tiles.items():
            if kernel not in KERNELS + OPTIONAL_KERNELS:
                raise ValueError(f"unknown kernel {kernel!r}")
            check_tiles(kernel, t)
    except (OSError, ValueError, KeyError, TypeError) as e:  # (json's decode error is a ValueError)
        raise ValueError(f"${TILES_ENV}={path!r} is not a tile table ({type(e).__name__}: {e}); point it at the JSON "
                         "that benchmarks/tune_tiles.py writes, or unset it.") from None
    return key, tiles


def _tabled(kernel: str, block_size: int, head_dim: int, dtype) -> Tiles | None:
    """The tile table's tiles of `kernel` for a launch of this layout block, head_dim and dtype (a torch dtype) on
    the current CUDA device, or None (no table, no entry for the kernel, another geometry or GPU)."""
    path = os.environ.get(TILES_ENV)
    if not path or dtype is None:
        return None
    if not Path(path).is_file():
        raise ValueError(f"${TILES_ENV}={path!r} does not exist; point it at the JSON that benchmarks/tune_tiles.py "
                         "writes, or unset it.")
    stat = Path(path).stat()
    (device, dim, block, dtype_name), tiles = _read_tile_table(path, (stat.st_mtime_ns, stat.st_size))
    t = tiles.get(kernel)
    if t is None or (dim, block, dtype_name) != (head_dim, block_size, str(dtype).removeprefix("torch.")):
        return None
    import torch

    return t if torch.cuda.is_available() and torch.cuda.get_device_name() == device else None


def _chosen(kernel: str, block_size: int, head_dim: int, on_gpu: bool, dtype) -> Tiles | None:
    """Tiles from `tiles_override`, else (compiled launches only) from the tile table, else None."""
    return _overridden(kernel, block_size) or (_tabled(kernel, block_size, head_dim, dtype) if on_gpu else None)


def tile_candidates(kernel: str, block_size: int, head_dim: int, warps: tuple[int, ...] | None = None) -> list[Tiles]:
    """The tiles worth timing for `kernel` ("forward", "dq", "dkdv", "columns"): wgmma-sized products (64
    rows on the M side of every product), 2 to 4 pipeline stages, for dq the columns' dk/dv in the dq loop
    or in a separate pass, for the forward and dq the key blocks through pointer loads or TMA tensor
    descriptors (`Tiles.kv_descriptors`), for these and dk/dv either grid order (`Tiles.tile_major`), for the
    forward and dq masked column steps with and without their own read of the slots (`Tiles.column_meta_reload`),
    for all three the rows of each step addressed either way (`Tiles.lean_index`); sizes above the layout block are
    dropped. The columns kernel: chunks of 64 columns, 64- or 128-row query steps, 16 or 32 steps a program,
    2 stages (its inner loop is not pipelined: its sm_90 builds are the same at 1 to 3).

    Warps (unless given): 8 only above head_dim 64, where every 4-warp build spilled more (see
    benchmarks/results/README.md); 4 and 8 at head_dim 64 and below."""
    if kernel not in KERNELS + OPTIONAL_KERNELS:
        raise ValueError(f"unknown kernel {kernel!r}; use {KERNELS + OPTIONAL_KERNELS}.")
    if warps is None:
        warps = (8,) if head_dim > 64 else (4, 8)
    separate = (False, True) if kernel == "dq" else (False,)
    if kernel == "dkdv":  # block_n: keys of a program (M side); block_m: query rows of a step
        grid = itertools.product((32, 64, 128), (64, 128), (64,), warps, (2, 3, 4), separate, (False,), (1,),
                                 (False, True), (False,), (False, True))
    elif kernel == "columns":  # block_c: column tokens of a chunk (M side); block_m: query rows of a step
        grid = itertools.product((64, 128), (0,), (64,), warps, (2,), separate, (False,), (16, 32), (False,), (False,),
                                 (False,))
    else:  # forward, dq: block_m query rows of a program (M side); block_n key rows of a step
        grid = itertools.product((64, 128), (32, 64, 128), (64,), warps, (2, 3, 4), separate, (False, True), (1,),
                                 (False, True), (False, True), (False, True))
    tiles = [Tiles(*t) for t in grid if t[0] <= block_size and t[1] <= block_size]
    return [t for t in tiles if narrowest_wgmma_n(kernel, t, head_dim) >= MIN_WGMMA_N]


# The few candidates per kernel that one short GPU call times (`benchmarks/tune_tiles.py --shortlist`, benchmarks/
# gpu_session.sh quick), at
# head_dim 128, 8 warps: those whose sm_90 builds on the GPU image's Triton (3.6) keep every register in registers
# and fit shared memory (kernel-candidates_triton-3.6.0_*.json; dq with column gradients, its heaviest variant),
# the launched tiles (the dk/dv one keeps 56 B of stack there), and for the forward and dq the same tiles with
# their key blocks through TMA tensor descriptors (`Tiles.kv_descriptors`; on the H200 at 32K no faster: dq 3.68 vs
# 3.67 ms, the forward 1.73 vs 1.54, tiles_nvidia-h200_20261129-221239.json).
# Since then (benchmarks/results/README.md): the kernels in FlexAttention's grid order (`Tiles.tile_major`; the forward
# and dq with and without TMA) replace the candidates the H200 timed slowest (dq's separate column pass and 128 x 32,
# the forward's TMA alone, dk/dv at 2 stages and 64 x 64); dq's TMA alone, a tie there, stays. Then (2026-12-01) the
# column steps that read their tokens once (`Tiles.column_meta_reload`: fewer instructions per column step on Triton
# 3.6) replaced the forward's and dq's TMA with the grid order together. Since 2026-12-05 FlexAttention's row
# addressing (`Tiles.lean_index`: 9-27% fewer instructions per key-block step on Triton 3.6, benchmarks/results/
# README.md) replaces what the H200 timed slowest or level on 2026-12-04: the forward's column_meta_reload (+1.6%),
# dq's (-0.5%) and dk/dv's 32 x 128 (+9.7%); the forward and dk/dv take it beside the tile-major order (the forward's
# choice there; dk/dv's lean build spills in the loop in the launched order, not in this one).
SHORTLIST = {
    "forward": [Tiles(128, 64, 64, 8, 3), Tiles(128, 64, 64, 8, 3, tile_major=True),
                Tiles(128, 64, 64, 8, 3, tile_major=True, lean_index=True)],
    "dq": [Tiles(128, 64, 64, 8, 3), Tiles(128, 64, 64, 8, 3, kv_descriptors=True),
           Tiles(128, 64, 64, 8, 3, tile_major=True), Tiles(128, 64, 64, 8, 3, lean_index=True)],
    "dkdv": [Tiles(64, 128, 64, 8, 3), Tiles(64, 128, 64, 8, 3, tile_major=True),
             Tiles(64, 128, 64, 8, 3, tile_major=True, lean_index=True)],
    # (128-row steps: no spill at head_dim 128 since the kernel's rework, benchmarks/results/README.md)
    "columns": [Tiles(64, 0, 64, 8, 2, query_steps=16), Tiles(64, 0, 64, 8, 2, query_steps=32),
                Tiles(128, 0, 64, 8, 2, query_steps=16)],
}
# Above head_dim 128 (`NARROW_HEAD_DIM`; the 16-bit `WIDE_HEAD_TILES`, sm_90 builds only, benchmarks/results/README.md,
# heads above 128 lanes): the launched tiles, the same in FlexAttention's grid order, and the builds that fit shared
# memory with a little stack: the forward's 128-row tiles (192 KB, 16 B), dq with the columns' dk/dv in its loop
# (512-576 B); and the key-major column kernel at 16 steps (136 KB, 192 B). FlexAttention's sm_90 forward tiles at
# head_dim 256 (64 x 32, 4 warps, 3 stages: 252 registers, no stack, 128 KB, full-width m64n256 products where the
# 8-warp tiles issue m64n128 and m64n32) and a dk/dv tile without spill (64 x 32, 8 warps: 178 registers, where the
# launched 64 x 64 keeps 320 B of stack) after the H200 timed ours at 0.31x Flex on the same blocks (32K, vs@5%,
# 2026-12-04; benchmarks/results/README.md); sm_90 builds with Triton 3.6.
WIDE_HEAD_SHORTLIST = {
    "forward": [Tiles(64, 64, 64, 8, 2), Tiles(64, 64, 64, 8, 2, tile_major=True), Tiles(128, 64, 64, 8, 2),
                Tiles(64, 32, 32, 4, 3)],
    "dq": [Tiles(64, 64, 64, 8, 1, separate_columns=True), Tiles(64, 64, 64, 8, 1, separate_columns=True,
                                                                 tile_major=True), Tiles(64, 64, 64, 8, 1)],
    "dkdv": [Tiles(64, 64, 0, 8, 2), Tiles(64, 64, 0, 8, 2, tile_major=True), Tiles(64, 32, 0, 8, 2)],
    "columns": [Tiles(64, 0, 64, 8, 2, query_steps=16)],
}


def shortlist(kernel: str, head_dim: int) -> list[Tiles]:
    """The candidates of `kernel` that a short GPU call times at `head_dim` (`tune_tiles.py --shortlist`):
    `SHORTLIST` up to `NARROW_HEAD_DIM` lanes, `WIDE_HEAD_SHORTLIST` above."""
    return (WIDE_HEAD_SHORTLIST if head_dim > NARROW_HEAD_DIM else SHORTLIST)[kernel]


# Every launch asks for FP fusion (a * b + c contracted to one FMA, one rounding) explicitly: Triton 3.10 turns it
# off by default (3.9 warns that it will); the kernels' accuracy and their sm_90 builds were checked with it on.
FP_FUSION = True

# Narrowest wgmma N worth launching: an m64n16 product runs a quarter of a full-width tile per
# instruction (seen at head_dim 128 in the 64-key x 32-row dk/dv tile, benchmarks/results/README.md).
MIN_WGMMA_N = 32


def narrowest_wgmma_n(kernel: str, tiles: Tiles, head_dim: int) -> int:
    """The N of the narrowest wgmma a launch with `tiles` issues, as Triton lays products out on
    sm_90: each warpgroup (4 warps) takes 64-row slices of a product's M side, and warpgroups left
    over split its N side. Products as (M, N): forward and dq (query rows, key step / head_dim /
    column step), dq's column gradients (column step, head_dim); dk/dv (keys, query-row step /
    head_dim); columns (column chunk, query-row step / head_dim)."""
    if kernel == "dkdv":
        products = [(tiles.block_n, tiles.block_m), (tiles.block_n, head_dim)]
    elif kernel == "columns":
        products = [(tiles.block_c, tiles.block_m), (tiles.block_c, head_dim)]
    else:
        products = [(tiles.block_m, tiles.block_n), (tiles.block_m, head_dim), (tiles.block_m, tiles.block_c)]
        if kernel == "dq":
            products.append((tiles.block_c, head_dim))
    warpgroups = max(1, tiles.num_warps // 4)
    return min(n // max(1, warpgroups // max(1, m // 64)) for m, n in products)


def compiled(device) -> bool:
    """Whether launches on `device` run compiled kernels (CUDA; meta tensors, which `sm90` launches to
    record a real launch's arguments) rather than Triton's interpreter (CPU tensors), which gets small
    tiles."""
    return device.type != "cpu"


# fp32 inputs (exact "ieee" products: FMA loops, no tensor cores) stage 4-byte tiles in shared memory, where the
# 16-bit inputs' tiles below needed up to 295 KB at head_dim 64 to 128 (the forward at 64, dq and dk/dv at 128: over
# the H100's 227 KB, so the launch failed). These need 74-115 KB at head_dim 128 (sm_90 builds,
# tests/kernels/test_kernels_compile.py), as FlexAttention also takes small tiles for fp32.
FP32_TILES = {"forward": Tiles(64, 32, 32, 4, 2), "dq": Tiles(64, 32, 32, 4, 2), "dkdv": Tiles(32, 64, 0, 4, 2)}


# Heads above 128 lanes (160 to 256, all of them 256-lane tiles: `BLOCK_D` is the next power of two) hold
# accumulators and staged K/V/Q/dO rows twice as wide, so the tiles above overflow shared memory (dq with column
# gradients 256-260 KB at 2-3 stages, the forward 232 KB at 3) or spill hundreds of bytes. sm_90 builds at head_dim
# 256 (benchmarks/results/README.md, tests/kernels/test_kernels_compile.py), 16-bit inputs: the forward in 64 x 64
# tiles at 2 stages (168 KB, 212 registers, no spill; m64n32 and wider), dq in 64 x 64 with the columns' dk/dv in
# their own pass at 1 stage (132 KB; 56 B of stack without columns, 224-232 with), dk/dv in 64-key programs of
# 64-row steps at 2 stages (200.5 KB; 200-216 B of stack without columns, 320-344 with: the two 64 x 256 fp32
# accumulators alone take 128 of a thread's 255 registers). 16 warps cap registers at 128 (spilling 0.5-1 KB); 4
# warps spill more. Timing these against other tiles waits for a GPU (`benchmarks/tune_tiles.py`).
WIDE_HEAD_TILES = {"forward": Tiles(64, 64, 64, 8, 2), "dq": Tiles(64, 64, 64, 8, 1, separate_columns=True),
                   "dkdv": Tiles(64, 64, 0, 8, 2)}
# fp32 inputs at head_dim 256: `FP32_TILES` fit (136-208 KB) but spill 1-35 KB per thread (ptxas gave dq and dk/dv
# 32 registers and the rest on the stack). With 8 warps and 32 rows (dq: 16) every launched build keeps its registers
# (sm_90: 65-132 KB, 76-204 registers, no stack; benchmarks/results/README.md).
FP32_WIDE_HEAD_TILES = {"forward": Tiles(32, 32, 32, 8, 2), "dq": Tiles(16, 16, 16, 8, 2),
                        "dkdv": Tiles(32, 32, 0, 8, 2)}


def _fixed(kernel: str, block_size: int, head_dim: int, dtype) -> Tiles | None:
    """The fixed tiles of a compiled launch of fp32 inputs or of a head above `NARROW_HEAD_DIM`, else None."""
    wide = head_dim > NARROW_HEAD_DIM
    if _four_byte(dtype):
        return _capped((FP32_WIDE_HEAD_TILES if wide else FP32_TILES)[kernel], block_size)
    return _capped(WIDE_HEAD_TILES[kernel], block_size) if wide else None


def _four_byte(dtype) -> bool:
    """Whether a launch's inputs have 4-byte elements (fp32); None (no dtype given) counts as 16-bit."""
    return dtype is not None and dtype.itemsize == 4


def _capped(tiles: Tiles, block_size: int) -> Tiles:
    return replace(tiles, block_m=min(tiles.block_m, block_size), block_n=min(tiles.block_n, block_size))


def forward_tiles(block_size: int, head_dim: int, on_gpu: bool, dtype=None) -> Tiles:
    if t := _chosen("forward", block_size, head_dim, on_gpu, dtype):
        return t
    if not on_gpu:
        return Tiles(min(block_size, 32), min(block_size, 32), 16, 1, 1)
    if t := _fixed("forward", block_size, head_dim, dtype):
        return t
    if head_dim <= 64:
        # 4 stages: 210 registers and no spill, where 3 stages sit at 253 of the 255 (hinted builds of the
        # warps/stages sweep, benchmarks/results/README.md); loads four steps ahead, 144 KB of shared memory
        return Tiles(min(block_size, 128), min(block_size, 128), 64, 8, 4)
    return Tiles(min(block_size, 128), min(block_size, 64), 64, 8, 3)


def dq_tiles(block_size: int, head_dim: int, on_gpu: bool, dtype=None) -> Tiles:
    if t := _chosen("dq", block_size, head_dim, on_gpu, dtype):
        return t
    if not on_gpu:
        return Tiles(min(block_size, 32), 16, 16, 1, 1)
    if t := _fixed("dq", block_size, head_dim, dtype):
        return t
    # The columns' dk/dv stay in the dq loop: with the launch's divisibility hints that builds without
    # spilling at head_dim 128 too (a separate pass recomputes two products per column step).
    return Tiles(min(block_size, 128), min(block_size, 64), 64, 8, 3)


def dkdv_tiles(block_size: int, head_dim: int, on_gpu: bool, dtype=None) -> Tiles:
    if t := _chosen("dkdv", block_size, head_dim, on_gpu, dtype):
        return t
    if not on_gpu:
        return Tiles(16, min(block_size, 32), 16, 1, 1)
    if t := _fixed("dkdv", block_size, head_dim, dtype):
        return t
    # 128 keys per program in 64-row query steps (FlexAttention's backward class): every product is
    # m64n64 or wider; at head_dim 128 the hinted build holds its dk/dv accumulators in 250 registers
    # without spilling (64 keys x 32 rows issued m64n16 for half its products).
    return Tiles(min(block_size, 64), min(block_size, 128), 64, 8, 3)


# Column slots the forward and dq kernels read per load in the range check before their column loops
# (`tiles.columns_out_of_range`): each load is waited for before the next (a loop at the program's start, with
# one program per SM), so at the column step's 64 slots a row of n columns cost n / 64 round trips to memory
# (8 at the ~500 columns a row of bench_attention's 128K layout lists) before the first product; 1024 slots (4
# per thread at 8 warps) read such a row in one. Under the interpreter the column step's slots, so that tests
# cover several passes.
COLUMN_CHECK_CHUNK = 1024


def column_check_chunk(on_gpu: bool, block_c: int) -> int:
    return COLUMN_CHECK_CHUNK if on_gpu else block_c


def column_tiles(block_size: int, head_dim: int = 0, on_gpu: bool = False, dtype=None) -> Tiles | None:
    """Tiles of the key-major column kernel, only where overridden or in the tile table: the dq kernel's
    atomics stay the default until a GPU has timed both (`benchmarks/tune_tiles.py`)."""
    return _chosen("columns", block_size, head_dim, on_gpu, dtype)


@dataclass(frozen=True)
class ScoringTiles:
    """Tiles of the vertical-slash scoring kernels (`vertical_slash`).

    block: query rows and keys of one skewed probability tile (scores kernel; square for the skew).
    block_m, block_n: query rows and key steps of the row-statistics kernel.
    keys_per_split: keys one row-statistics program covers (splits spread long documents over the GPU).
    """

    block: int
    block_m: int
    block_n: int
    keys_per_split: int
    num_warps: int
    stats_stages: int


def scoring_tiles(on_gpu: bool, dtype=None) -> ScoringTiles:
    # 64-row tiles hold MTraining's default 64 scoring queries in one tile and keep the skewed
    # [64, 64] tile (gathered through shared memory) small; both kernels' products stay on wgmma
    # (checked by compiling for sm_90). Under the interpreter tiles are tiny so tests cover every loop.
    # fp32 inputs above head_dim 128 (Gemma 3's 256) needed 320 KB of shared memory for the row statistics' three
    # stages of 128 keys (the launch failed): 64-key steps in two stages.
    if not on_gpu:
        return ScoringTiles(16, 16, 16, 48, 1, 1)
    if _four_byte(dtype):
        return ScoringTiles(64, 64, 64, 4096, 4, 2)
    return ScoringTiles(64, 64, 128, 4096, 4, 3)
