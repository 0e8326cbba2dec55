"""The kernels compile for Hopper (sm_90) with the tile shapes the launchers pick, without a GPU.

CI catches a kernel that no longer builds, outgrows an H100's shared memory, leaves the wgmma
tensor-core path or spills heavily with its tiles, before any GPU run (see `kernels.sm90`).
"""

import pytest

from hf_sparse_cp.kernels import sm90
from hf_sparse_cp.kernels.configs import Tiles

from benchmark_loader import load_benchmark

# Stack bytes per thread that the launchers' tiles stay under (spilled registers; the largest is the
# dq kernel's column pass at head_dim 128, ~220 with Triton 3.6). For scale: dk/dv with 128-key tiles
# at head_dim 128 spilled over 2 KB with Triton 3.6 and 3.9, the columns' dk/dv inside the dq loop ~650.
MAX_STACK_BYTES = 512


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_kernels_compile_for_sm90_within_limits(head_dim, dtype):
    builds = sm90.launcher_builds(head_dim, dtype)
    assert {"forward", "forward_merge", "dq", "dq_column_grads", "dkdv"} <= set(builds)
    for name, (tiles, build) in builds.items():
        use = sm90.usage(build)
        assert "cubin" in build.asm, name
        assert use.shared_bytes <= sm90.H100_SHARED_BYTES, (name, tiles, use)
        assert use.wgmma > 0 and use.mma_sync == 0, (name, tiles, use)
        assert use.stack_bytes <= MAX_STACK_BYTES, (name, tiles, use)


def test_candidate_sweep_records_each_build_and_each_failure(monkeypatch):
    """kernel_resources --candidates: one row per candidate tile, usage where it builds, the
    compiler's error where it does not (a 48-row tile is no power of two)."""
    def candidates(kernel, block_size, head_dim, warps):
        assert warps == (4, 8)
        return [Tiles(64, 64, 64, 8, 2)] + ([Tiles(48, 64, 64, 8, 2)] if kernel == "forward" else [])

    with load_benchmark("kernel_resources") as kr:
        monkeypatch.setattr(kr.configs, "tile_candidates", candidates)
        rows = kr.measure_candidates(head_dims=(64,))
        table = kr.format_table(rows)
    assert [r["kernel"] for r in rows] == ["forward", "forward", "dq_column_grads", "dkdv"]
    built = [r for r in rows if "error" not in r]
    assert len(built) == 3 and all(r["wgmma"] > 0 and r["registers"] > 0 for r in built)
    assert rows[1]["tiles"]["block_m"] == 48 and rows[1]["error"]
    assert len(table.splitlines()) == 2 + len(rows)
