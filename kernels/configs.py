"""Tile sizes, warps and pipeline depth of the kernels, chosen per launch (no autotuning).

Autotuning is left out on purpose: the forward can merge into its output in place, so a tuner's
repeated trial launches would corrupt it, and per-shape tuning would stall the first training
steps. The CUDA choices were made without a GPU, from compiling the kernels for sm_90 (Triton's
ahead-of-time `triton.compile` with a `GPUTarget("cuda", 90, 32)`, pointer and stride arguments
marked 16-divisible as the launcher's specialization does) and reading the resource usage: every
choice keeps all matrix products on wgmma (HGMMA in the SASS, no HMMA fallback, which is why
column tiles are 64 rows: transposed column products need M >= 64), K/V loads pipelined with
cp.async, no register spills (bf16, head_dim 64 and 128; the 128x128 forward tile spills at
head_dim 128, 4 warps spill everywhere) and shared memory under 227 KB. Timing them against
alternatives on an H100 is the next step (benchmarks/bench_attention.py). Under Triton's
interpreter (CPU tensors) tiles are small so that the tests cover the sub-tiling loops.

Head dims above 128 spill heavily with any wgmma-sized tile (and the dq kernel overflows shared
memory at 256), so the kernels stop at 128 (`ops.MAX_HEAD_DIM`); larger heads use the reference.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Tiles:
    """Tile shape of one kernel launch.

    block_m: query rows of a program (forward, dq) or of one inner step (dk/dv).
    block_n: key rows of one inner step (forward, dq) or of a program (dk/dv).
    block_c: gathered key columns of one inner step.
    """

    block_m: int
    block_n: int
    block_c: int
    num_warps: int
    num_stages: int


def forward_tiles(block_size: int, head_dim: int, on_gpu: bool) -> Tiles:
    if not on_gpu:
        return Tiles(min(block_size, 32), min(block_size, 32), 16, 1, 1)
    if head_dim <= 64:
        return Tiles(min(block_size, 128), min(block_size, 128), 64, 8, 3)
    return Tiles(min(block_size, 128), min(block_size, 64), 64, 8, 3)


def dq_tiles(block_size: int, head_dim: int, on_gpu: bool) -> Tiles:
    if not on_gpu:
        return Tiles(min(block_size, 32), 16, 16, 1, 1)
    return Tiles(min(block_size, 128), min(block_size, 64), 64, 8, 3)


def dkdv_tiles(block_size: int, head_dim: int, on_gpu: bool) -> Tiles:
    if not on_gpu:
        return Tiles(16, min(block_size, 32), 16, 1, 1)
    return Tiles(min(block_size, 64), min(block_size, 128), 64, 8, 3)


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


def scoring_tiles(on_gpu: bool) -> ScoringTiles:
    # 64-row tiles hold MTraining's default 64 scoring queries in one tile and keep the skewed
    # [64, 64] tile (gathered through shared memory) small; both kernels' products stay on wgmma
    # (checked by compiling for sm_90). Under the interpreter tiles are tiny so tests cover every loop.
    if not on_gpu:
        return ScoringTiles(16, 16, 16, 48, 1, 1)
    return ScoringTiles(64, 64, 128, 4096, 4, 3)
