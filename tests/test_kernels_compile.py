"""The kernels compile for Hopper (sm_90) with the tile shapes the launchers pick, without a GPU.

CI catches a kernel that no longer builds, outgrows an H100's shared memory, leaves the wgmma
tensor-core path or spills heavily with its tiles, before any GPU run (see `kernels.sm90`).
"""

import pytest
from hf_sparse_cp.kernels import sm90

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
