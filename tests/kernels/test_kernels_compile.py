"""The kernels compile for Hopper (sm_90) as real launches build them, without a GPU.

CI catches a kernel that no longer builds, outgrows an H100's shared memory, leaves the wgmma
tensor-core path, issues quarter-width (n16) wgmma, spills, or loses the multi-stage pipelining of
its key-block loop with the launchers' tiles, before
any GPU run. The builds take the arguments of real launches (`kernels.sm90`), so each carries the
divisibility hints the JIT gives a launch.
"""

import dataclasses
import re

import pytest
import torch

from hf_sparse_cp.kernels import configs, limits
from hf_sparse_cp.kernels.configs import Tiles
from hf_sparse_cp.testing import sm90

from benchmark_loader import load_benchmark

# Stack bytes per thread the launchers' builds may hold. Triton 3.9 keeps 8 in the dk/dv kernel at
# head_dim 128 when it writes the input dtype seeded by the columns' sums (one loop-invariant register
# reloaded per step; 32-row steps build without it but issue m64n32) and none elsewhere. Triton 3.6 (the
# GPU image's) kept 16 bytes in that kernel before it wrote the input dtype, and keeps 56 since (24 with 2
# stages; its spill-free head_dim-128 dk/dv tiles are 32x128 and 64x64 at 8 warps: builds of 2026-11-25 in
# benchmarks/results/), so this bound holds for 3.9, which CI installs; which 3.6 tile is fastest needs a
# GPU (benchmarks/tune_tiles.py). Before the hinted builds, 128-key dk/dv tiles were recorded at over 2 KB.
MAX_STACK_BYTES = 16


def _hints_of_a_launch(args: tuple) -> int:
    """Arguments a launch marks 16-divisible: every tensor (torch allocations are 256-byte aligned) and
    every integer divisible by 16 (an integer equal to 1 becomes a constant instead)."""
    return sum(isinstance(a, torch.Tensor) or (isinstance(a, int) and a % 16 == 0) for a in args)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_launched_builds_are_hinted_spill_free_and_on_full_wgmma(head_dim, dtype):
    launches = sm90.recorded_launches(sm90.launch_for(head_dim, dtype))
    builds = sm90.launcher_builds(head_dim, dtype)
    assert set(builds) == set(sm90.VARIANTS) == set(launches)
    for name, (tiles, build) in builds.items():
        use = sm90.usage(build)
        assert "cubin" in build.asm, name
        # FP fusion asked for at every launch, not left to Triton's default (off from 3.10): FMAs in the build
        assert launches[name][2]["enable_fp_fusion"] is configs.FP_FUSION is True, name
        assert build.metadata.enable_fp_fusion and "fma.rn.f32" in build.asm["ptx"], name
        assert use.hinted_args == _hints_of_a_launch(launches[name][1]) > 0, (name, use)
        assert use.wide_loads > 0, (name, use)  # 16-byte loads, which the hints make possible
        assert use.shared_bytes <= sm90.H100_SHARED_BYTES, (name, tiles, use)
        assert use.wgmma > 0 and use.mma_sync == 0, (name, tiles, use)
        assert use.narrowest_wgmma_n() >= configs.MIN_WGMMA_N, (name, tiles, use)
        assert use.stack_bytes <= MAX_STACK_BYTES, (name, tiles, use)
        if name in sm90.TUNED_KERNEL:  # the key-block loop keeps loads more than one step ahead
            assert use.copies_in_flight > 0, (name, tiles, use)


@pytest.mark.parametrize("variant", ["forward", "dq_column_grads"])
def test_the_column_range_check_reads_a_row_in_one_load(variant):
    """The range check before the column loops (`tiles.columns_out_of_range`) waits for each of its loads before
    issuing the next, at the start of each program (one per SM): in the column step's 64 slots a row of
    bench_attention's 128K layout (about 500 columns) took 8 round trips to memory before the first product.
    Launches read `configs.COLUMN_CHECK_CHUNK` slots per load: the Launch's rows of 1000 columns in one."""
    tiles, build = sm90.build(variant)
    first_loop = re.search(r"scf\.for %\S+ = %\S+ to %\S+ step %c(\d+)_i32", build.asm["ttgir"])
    assert int(first_loop.group(1)) == configs.COLUMN_CHECK_CHUNK >= sm90.Launch().max_cols > tiles.block_c


@pytest.mark.parametrize("variant,head_dim", [("forward", 64), ("dq_column_grads", 128), ("dkdv", 128),
                                              ("scoring_row_stats", 256)])
def test_fp32_launches_fit_the_shared_memory_of_an_h100(variant, head_dim):
    """fp32 inputs (a model trained without bf16/fp16) take their own small tiles: with the 16-bit inputs' tiles
    these builds needed 288-320 KB of shared memory (the H100 has 227 KB), so the launch failed on the GPU (the
    scoring's at Gemma 3's head_dim 256)."""
    tiles, build = sm90.build(variant, launch=sm90.launch_for(head_dim, "fp32"))
    assert sm90.usage(build).shared_bytes <= sm90.H100_SHARED_BYTES, tiles
    if variant in sm90.TUNED_KERNEL:
        assert tiles == configs.FP32_TILES[sm90.TUNED_KERNEL[variant]]


# Stack bytes per thread of the 16-bit launches above 128 lanes (`configs.WIDE_HEAD_TILES`, Triton 3.9): dk/dv's two
# 64 x 256 fp32 accumulators take 128 registers of the 255 (320 B at head_dim 256 with the columns' seed, 344 at 160
# and 192; 200-216 without), dq's column pass 224-232 B, dq alone 56; the forward none. Every other tile built
# spilled as much or more, or overflowed shared memory.
WIDE_HEAD_MAX_STACK_BYTES = 344


@pytest.mark.parametrize("head_dim,dtype", [(256, "bf16"), (160, "fp16"), (256, "fp32")])
def test_heads_above_128_lanes_fit_the_shared_memory_of_an_h100(head_dim, dtype):
    """Gemma's head_dim 256 (and 160 or 192: the same 256-lane tiles) takes its own tiles: with the narrower heads'
    tiles dq with column gradients needed 256 KB and the forward at 3 stages 232 KB (the H100 has 227 KB). Every
    launched variant builds within `limits.WIDE_HEAD_SHARED_BYTES`, the 16-bit ones on wgmma at least 32 wide; the
    forward and the fp32 launches keep every register, the 16-bit backward spills a bounded few hundred bytes."""
    for name, (tiles, build) in sm90.launcher_builds(head_dim, dtype).items():
        use = sm90.usage(build)
        assert use.shared_bytes <= limits.WIDE_HEAD_SHARED_BYTES <= sm90.H100_SHARED_BYTES, (name, tiles, use)
        if name in sm90.TUNED_KERNEL:
            wide = configs.FP32_WIDE_HEAD_TILES if dtype == "fp32" else configs.WIDE_HEAD_TILES
            assert dataclasses.replace(tiles, block_c=wide[sm90.TUNED_KERNEL[name]].block_c) == wide[
                sm90.TUNED_KERNEL[name]], name
            assert use.stack_bytes <= (0 if dtype == "fp32" or name.startswith("forward") else
                                       WIDE_HEAD_MAX_STACK_BYTES), (name, tiles, use)
        if dtype != "fp32" and not name.startswith("scoring"):
            assert use.wgmma > 0 and use.mma_sync == 0, (name, tiles, use)
            assert use.narrowest_wgmma_n() >= configs.MIN_WGMMA_N, (name, tiles, use)


def test_quarter_width_wgmma_is_caught():
    """The dk/dv tile launched before the hinted builds (64 keys x 32 query rows at head_dim 128)
    issues m64n16 wgmma: the build shows it, the tile model predicts it, and the candidates leave it out."""
    old = Tiles(32, 64, 64, 8, 3)
    _, build = sm90.build("dkdv", old, sm90.launch_for(128))
    assert sm90.usage(build).narrowest_wgmma_n() == 16 == configs.narrowest_wgmma_n("dkdv", old, 128)
    assert old not in configs.tile_candidates("dkdv", 128, 128)


def test_candidate_sweep_records_each_build_and_each_failure(monkeypatch):
    """kernel_resources --candidates: one row per candidate tile, usage where it builds, the error
    where it does not (a 48-row tile is no power of two: `configs.tiles_override` refuses it)."""
    def candidates(kernel, block_size, head_dim, warps):
        assert warps == (4, 8)
        return [Tiles(64, 64, 64, 8, 2)] + ([Tiles(48, 64, 64, 8, 2)] if kernel == "forward" else [])

    with load_benchmark("kernel_resources") as kr:
        monkeypatch.setattr(kr.configs, "tile_candidates", candidates)
        rows = kr.measure_candidates(head_dims=(64,))
        table = kr.format_table(rows)
    assert [r["kernel"] for r in rows] == ["forward", "forward", "dq_column_grads", "dkdv", "columns"]
    built = [r for r in rows if "error" not in r]
    assert len(built) == 4 and all(r["wgmma"] > 0 and r["registers"] > 0 for r in built)
    assert rows[1]["tiles"]["block_m"] == 48 and rows[1]["error"].startswith("ValueError: forward tiles: block_m=48;")
    assert len(table.splitlines()) == 2 + len(rows)


@pytest.mark.parametrize("variant,head_dim", [("forward", 64), ("forward", 128), ("dq_column_grads", 128)])
def test_key_blocks_with_tensor_descriptors_build_tma_copies(variant, head_dim):
    """With `Tiles.kv_descriptors` the key-block K/V tiles of the forward and dq come through TMA (bulk
    tensor copies in the PTX) in builds as clean as the launched ones: no spill, shared memory under
    the H100's, full-width wgmma."""
    launched = configs.forward_tiles(128, head_dim, True) if variant == "forward" else configs.dq_tiles(
        128, head_dim, True)
    tiles, build = sm90.build(variant, dataclasses.replace(launched, kv_descriptors=True), sm90.launch_for(head_dim))
    use = sm90.usage(build)
    assert tiles.kv_descriptors and "cp.async.bulk.tensor" in build.asm["ptx"], use
    assert use.stack_bytes == 0 and use.shared_bytes <= sm90.H100_SHARED_BYTES, use
    assert use.mma_sync == 0 and use.narrowest_wgmma_n() >= configs.MIN_WGMMA_N, use
    _, pointer_build = sm90.build(variant, launched, sm90.launch_for(head_dim))
    assert "cp.async.bulk.tensor" not in pointer_build.asm["ptx"]


@pytest.mark.parametrize("variant", ["forward", "dq_column_grads", "dkdv"])
def test_the_tile_major_grid_builds_as_the_launched_one(variant):
    """`Tiles.tile_major` only swaps which program id counts the tiles: the sm_90 build keeps the launched
    build's shared memory, wgmma and pipelining and spills no more (head_dim 128; the forward's and dq's are the
    same build, dk/dv's drops the 8 B of stack Triton 3.9 keeps), reading the tile from the grid's x axis."""
    launched = {"forward": configs.forward_tiles, "dq_column_grads": configs.dq_tiles,
                "dkdv": configs.dkdv_tiles}[variant](128, 128, True)
    tiles, build = sm90.build(variant, dataclasses.replace(launched, tile_major=True))
    _, base = sm90.build(variant, launched)
    use, launched_use = sm90.usage(build), sm90.usage(base)
    assert tiles.tile_major and use.stack_bytes <= launched_use.stack_bytes, use
    assert dataclasses.replace(use, registers=0, stack_bytes=0) == dataclasses.replace(launched_use, registers=0,
                                                                                       stack_bytes=0), use
    first = lambda ttir: re.search(r"tt\.get_program_id (\w)", ttir).group(1)  # the (batch x head) index's axis
    assert first(build.asm["ttir"]) == "y" and first(base.asm["ttir"]) == "x"


def test_warp_specialize_probe_builds_every_case(tmp_path):
    """warp_specialize_probe: one row per case (the forward's loop by query load, masked steps, column loop;
    dq's loop by query tile), each a build with whether Triton split the loop into warpgroups, or the
    compiler's error; the JSON holds them all."""
    with load_benchmark("warp_specialize_probe") as probe:
        report = probe.main(["--num_warps", "8", "--output", str(tmp_path / "probe.json")])
        table = probe.format_table(report["rows"])
    rows = report["rows"]
    cases = {(r["loop"], r["block_m"], r["q"], r["masked_steps"], r["column_loop"]) for r in rows}
    assert len(rows) == len(cases) == 14 and all(r["num_warps"] == 8 for r in rows)
    assert sum(r["loop"] == "dq" for r in rows) == 2
    for r in rows:
        assert ("error" in r) != ("partitioned" in r), r
        assert "error" in r or (r["registers"] > 0 and r["shared_bytes"] > 0 and r["overfilled_copies"] >= 0), r
    assert (tmp_path / "probe.json").exists() and len(table.splitlines()) == 2 + len(rows)


def test_probe_counts_tma_copies_whose_box_overfills_their_buffer():
    """A copy overfills its shared buffer when its host descriptor's box (`tensordesc_meta`, in the order of the
    signature's descriptors) has more rows than the buffer: Triton 3.6's split of a 128-row query tile into two
    64-row consumer halves kept the 128-row box (the copies of its TTGIR, abridged)."""
    def copy(desc: str, buffer: str) -> str:
        return (f"ttng.async_tma_copy_global_to_local %{desc}[%c0_i32, %c0_i32] %62, %61, %true : "
                f"!tt.tensordesc<tensor<128x128xbf16, #shared>>, !ttg.memdesc<1xi64, #shared1, #smem, mutable> -> "
                f"!ttg.memdesc<{buffer}xbf16, #shared2, #smem, mutable>")

    ttgir = "\n".join([
        "tt.func public @k(%q_src: !tt.tensordesc<tensor<128x128xbf16, #shared>>, %n: i32, "
        "%k_desc: !tt.tensordesc<tensor<64x128xbf16, #shared>>) {",
        copy("q_src", "64x128"), copy("q_src", "64x128"), copy("k_desc", "1x64x128")])
    meta = lambda q_rows: [{"block_size": [q_rows, 64]}, {"block_size": [64, 64]}]
    with load_benchmark("warp_specialize_probe") as probe:
        assert probe.overfilled_copies(ttgir, meta(128)) == 2
        assert probe.overfilled_copies(ttgir, meta(64)) == 0
        assert probe.overfilled_copies(ttgir.replace("64x128xbf16, #shared2", "128x128xbf16, #shared2"), meta(128)) == 0



@pytest.mark.parametrize("steps", [16, 32])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_key_major_column_kernel_builds_on_full_wgmma_without_spilling(head_dim, steps):
    """The key-major column kernel (`column_bwd`, launched only under a "columns" override) with its short-list
    tiles (chunks of 64 columns on the M side of every product, 64-row query steps, 8 warps, 16 or 32 steps)
    builds for sm_90 from a launch's arguments: hinted, 16-byte loads, every product on wgmma at least 32 wide
    as the tile model predicts, shared memory under the H100's, and no spilled register (Triton 3.9: 218 / 216
    registers at head_dim 128, 200 / 194 at 64; 40 and 48 B of stack at 128 before #50 restructured its step
    loop). A candidate for a GPU to time, not a launched kernel."""
    tiles = Tiles(64, 0, 64, 8, 2, query_steps=steps)
    with configs.tiles_override(columns=tiles):
        kernel, args, kwargs = sm90.recorded_launches(sm90.launch_for(head_dim))["columns"]
    assert "columns" not in sm90.recorded_launches(sm90.launch_for(head_dim))  # not launched by default
    use = sm90.usage(sm90.compile_launch(kernel, args, kwargs))
    assert kwargs["STEPS"] == steps and kwargs["BLOCK_C"] == 64 and kwargs["BLOCK_M"] == 64
    assert use.hinted_args == _hints_of_a_launch(args) > 0 and use.wide_loads > 0, use
    assert use.wgmma > 0 and use.mma_sync == 0, use
    assert use.narrowest_wgmma_n() == configs.narrowest_wgmma_n("columns", tiles, head_dim) >= configs.MIN_WGMMA_N
    assert use.shared_bytes <= sm90.H100_SHARED_BYTES and use.stack_bytes == 0, use


@pytest.mark.parametrize("variant", ["forward", "dq_column_grads", "dkdv"])
def test_lean_index_builds_drop_per_step_index_arithmetic(variant):
    """`Tiles.lean_index` as the quick call times it (`configs.SHORTLIST`: the forward and dk/dv in the tile-major
    order, dq in the launched one) builds as the same tiles without it: the same shared memory, wgmma and pipelining,
    stack within MAX_STACK_BYTES, and fewer of the PTX instructions its addressing removes: 64-bit multiplies of row
    offsets (the forward's and dq's key blocks) and divisions (dk/dv's CSR entries). head_dim 128, 128K tokens."""
    lean = next(t for t in configs.SHORTLIST[sm90.TUNED_KERNEL[variant]] if t.lean_index)
    tiles, build = sm90.build(variant, lean)
    _, base = sm90.build(variant, dataclasses.replace(lean, lean_index=False))
    use, base_use = sm90.usage(build), sm90.usage(base)
    assert tiles.lean_index and use.stack_bytes <= MAX_STACK_BYTES, use
    assert dataclasses.replace(use, registers=0, stack_bytes=0) == dataclasses.replace(base_use, registers=0,
                                                                                       stack_bytes=0), use
    if variant == "dkdv":
        count = lambda ptx: len(re.findall(r"\b(?:div|rem)\.[su]32\b", ptx))
    else:
        count = lambda ptx: ptx.count("mul.wide")
    assert count(build.asm["ptx"]) < count(base.asm["ptx"]), variant
