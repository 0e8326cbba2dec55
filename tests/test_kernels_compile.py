"""The kernels compile for Hopper (sm_90) with the tile shapes the launchers pick, without a GPU.

Triton compiles ahead of time for a named target (its bundled ptxas makes the cubin), so CI
catches a kernel that no longer builds, or outgrows an H100's shared memory, before a GPU run.
"""

import inspect

import pytest
import triton
from hf_sparse_cp.kernels import block_sparse_bwd, block_sparse_fwd, configs, vertical_slash
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

H100_SHARED_BYTES = 227 * 1024
FLOAT_ARGS = {"qk_scale", "scale"}
INT64_POINTERS = {"QIndex", "KIndex"}
FP32_POINTERS = {"Out", "Lse", "Lse2", "Delta", "DQ", "DK", "DV", "ColDK", "ColDV", "PartDK", "PartDV", "RowMax",
                 "RowSum", "Vertical", "Chunks"}
INT32_POINTERS = {"BlockIdx", "BlockCnt", "ColIdx", "ColCnt", "QSegment", "KSegment", "QSummary", "KSummary",
                  "RowPtr", "Entries"}


def _signature(kernel, constexprs: dict, dtype: str) -> dict:
    sig = {}
    for name in inspect.signature(kernel.fn).parameters:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in FLOAT_ARGS:
            sig[name] = "fp32"
        elif name in INT64_POINTERS:
            sig[name] = "*i64"
        elif name in FP32_POINTERS:
            sig[name] = "*fp32"
        elif name in INT32_POINTERS:
            sig[name] = "*i32"
        elif name[0].isupper():  # Q, K, V, DOut
            sig[name] = f"*{dtype}"
        else:
            sig[name] = "i32"
    return sig


def _compile(kernel, tiles: configs.Tiles, constexprs: dict, dtype: str):
    params = list(inspect.signature(kernel.fn).parameters)
    src = ASTSource(kernel, _signature(kernel, constexprs, dtype),
                    constexprs={(params.index(k),): v for k, v in constexprs.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": tiles.num_warps, "num_stages": tiles.num_stages})


def _on_tensor_cores(build) -> bool:
    return "wgmma" in build.asm["ptx"]


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_kernels_compile_for_sm90_within_shared_memory(head_dim, dtype):
    bs = 128
    common = dict(HEAD_DIM=head_dim, BLOCK_D=head_dim, LAYOUT_BLOCK=bs, HAS_WINDOW=False, PRECISION="tf32")
    fwd = configs.forward_tiles(bs, head_dim, on_gpu=True)
    dq = configs.dq_tiles(bs, head_dim, on_gpu=True)
    kv = configs.dkdv_tiles(bs, head_dim, on_gpu=True)
    builds = [
        _compile(block_sparse_fwd._forward_kernel, fwd,
                 dict(common, BLOCK_M=fwd.block_m, BLOCK_N=fwd.block_n, BLOCK_C=fwd.block_c, MERGE=True), dtype),
        _compile(block_sparse_bwd._dq_kernel, dq,
                 dict(common, BLOCK_M=dq.block_m, BLOCK_N=dq.block_n, BLOCK_C=dq.block_c, COLUMN_GRADS=1), dtype),
        _compile(block_sparse_bwd._dkdv_kernel, kv,
                 dict(common, BLOCK_M=kv.block_m, BLOCK_N=kv.block_n, ACCUMULATE=True), dtype),
    ]
    for build in builds:
        assert "cubin" in build.asm
        assert build.metadata.shared <= H100_SHARED_BYTES


@pytest.mark.parametrize("head_dim", [64, 128])
def test_scoring_kernels_compile_for_sm90(head_dim):
    """The estimation kernels (`tl.gather` skew included) build for Hopper with the launcher's tiles,
    their products on wgmma."""
    t = configs.scoring_tiles(on_gpu=True)
    common = dict(HEAD_DIM=head_dim, BLOCK_D=head_dim, PRECISION="tf32")
    builds = [
        _compile(vertical_slash._row_stats_kernel, configs.Tiles(t.block_m, t.block_n, 0, t.num_warps, t.stats_stages),
                 dict(common, BLOCK_M=t.block_m, BLOCK_N=t.block_n), "bf16"),
        _compile(vertical_slash._scores_kernel, configs.Tiles(t.block, t.block, 0, t.num_warps, 1),
                 dict(common, BLOCK=t.block), "bf16"),
    ]
    for build in builds:
        assert "cubin" in build.asm and _on_tensor_cores(build)
        assert build.metadata.shared <= H100_SHARED_BYTES
