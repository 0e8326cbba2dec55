"""Does Triton's automatic warp specialization apply to a block-sparse flash-attention loop on sm_90?

Triton partitions a loop tagged `tl.range(..., warp_specialize=True)` into a producer warpgroup (TMA
loads) and consumer warpgroups (wgmma, softmax) on Hopper (`ttg.warp_specialize` in the TTGIR,
`setmaxnreg` in the PTX), or leaves it as it was, or fails to compile. This probe builds, for sm_90
without a GPU, a flash-attention loop over listed key blocks in the shapes our forward kernel has, one
feature at a time, at query tiles of 64 and 128 rows: the query tile through a pointer load or a tensor
descriptor; every step unmasked (our
full blocks) or steps past a count masked from token metadata loaded through pointers (our partial
blocks); with or without a second loop over gathered key columns after it (our vertical columns). Then
the dq kernel's loop over full key blocks (probabilities recomputed from lse, dq accumulated; Q, dout,
K and V through descriptors) at query tiles of 64 and 128 rows. Each row says whether the loop was
partitioned, with registers, stack bytes and shared memory of the build, and how many of its TMA copies
overfill their buffer (a host descriptor's box of more rows than the shared buffer the copy lands in: each
such copy writes past its buffer and delivers more bytes than its mbarrier expects, the miscompile behind an
illegal memory access on the H200, benchmarks/results/README.md).
Nothing here ran or was timed; see benchmarks/results/README.md for what the rows decided.

    python benchmarks/warp_specialize_probe.py
"""

from __future__ import annotations

import argparse
import functools
import itertools
import re
import sys
from pathlib import Path

import triton
import triton.language as tl
from triton.compiler import ASTSource

from hf_sparse_cp.kernels.configs import FP_FUSION
from hf_sparse_cp.testing import sm90
from hf_sparse_cp.testing.benchmarking import write_report

RESULTS_DIR = Path(__file__).resolve().parent / "results"


@triton.jit
def _softmax_step(s, v, m_i, l_i, acc):
    """One online-softmax step of scores `s` with values `v` (base 2)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    return m_new, l_i * alpha + tl.sum(p, 1), acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)


@triton.jit
def _probe_kernel(q_src, k_desc, v_desc, out_ptr, block_ptr, meta_ptr, col_ptr, k_ptr, v_ptr, n_steps, n_full, n_cols,
                  Q_DESCRIPTOR: tl.constexpr, MASKED_STEPS: tl.constexpr, COLUMN_LOOP: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr):
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    if Q_DESCRIPTOR:
        q = q_src.load([0, 0])
    else:
        q = tl.load(q_src + offs_m[:, None] * D + offs_d[None, :])
    q_meta = tl.load(meta_ptr + offs_m)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    for i in tl.range(n_steps, warp_specialize=True):
        n0 = tl.load(block_ptr + i) * BLOCK_N
        k = k_desc.load([n0, 0])
        v = v_desc.load([n0, 0])
        s = tl.dot(q, tl.trans(k))
        if MASKED_STEPS:
            if i >= n_full:
                k_meta = tl.load(meta_ptr + n0 + tl.arange(0, BLOCK_N))
                s = tl.where(k_meta[None, :] <= q_meta[:, None], s, float("-inf"))
        m_i, l_i, acc = _softmax_step(s, v, m_i, l_i, acc)
    if COLUMN_LOOP:
        for c0 in range(0, n_cols, BLOCK_N):
            col = tl.load(col_ptr + c0 + tl.arange(0, BLOCK_N))
            k = tl.load(k_ptr + col[:, None] * D + offs_d[None, :])
            v = tl.load(v_ptr + col[:, None] * D + offs_d[None, :])
            s = tl.dot(q, tl.trans(k))
            m_i, l_i, acc = _softmax_step(s, v, m_i, l_i, acc)
    tl.store(out_ptr + offs_m[:, None] * D + offs_d[None, :], acc / l_i[:, None])


@triton.jit
def _dq_probe_kernel(q_desc, do_desc, k_desc, v_desc, lse_ptr, delta_ptr, dq_ptr, block_ptr, n_steps,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr):
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    q = q_desc.load([0, 0])
    do = do_desc.load([0, 0])
    lse2 = tl.load(lse_ptr + offs_m)
    delta = tl.load(delta_ptr + offs_m)
    dq = tl.zeros([BLOCK_M, D], tl.float32)
    for i in tl.range(n_steps, warp_specialize=True):
        n0 = tl.load(block_ptr + i) * BLOCK_N
        k = k_desc.load([n0, 0])
        v = v_desc.load([n0, 0])
        p = tl.exp2(tl.dot(q, tl.trans(k)) - lse2[:, None])
        ds = p * (tl.dot(do, tl.trans(v)) - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k)
    tl.store(dq_ptr + offs_m[:, None] * D + offs_d[None, :], dq)


def _compile(kernel, sig: dict, constants: dict, num_warps: int, num_stages: int):
    """`kernel` built for sm_90 with this signature, its constexprs last, every pointer 16-byte aligned."""
    names = list(sig) + list(constants)
    sig = sig | dict.fromkeys(constants, "constexpr")
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if sig[n].startswith("*")}
    source = ASTSource(kernel, sig, {(names.index(n),): v for n, v in constants.items()}, attrs)
    return triton.compile(source, target=sm90.TARGET,
                          options={"num_warps": num_warps, "num_stages": num_stages, "enable_fp_fusion": FP_FUSION})


def build_dq(num_warps: int, block_m: int, block_n: int = 64, head_dim: int = 128, num_stages: int = 2):
    """The dq probe kernel built for sm_90 (bf16 inputs)."""
    rows, keys = f"tensordesc<bf16[{block_m}, {head_dim}]>", f"tensordesc<bf16[{block_n}, {head_dim}]>"
    sig = {"q_desc": rows, "do_desc": rows, "k_desc": keys, "v_desc": keys, "lse_ptr": "*fp32", "delta_ptr": "*fp32",
           "dq_ptr": "*fp32", "block_ptr": "*i32", "n_steps": "i32"}
    return _compile(_dq_probe_kernel, sig, dict(BLOCK_M=block_m, BLOCK_N=block_n, D=head_dim), num_warps, num_stages)


def build(q_descriptor: bool, masked_steps: bool, column_loop: bool, num_warps: int, block_m: int = 128,
          block_n: int = 64, head_dim: int = 128, num_stages: int = 3):
    """The probe kernel built for sm_90 (bf16 inputs, every pointer 16-byte aligned)."""
    sig = {"q_src": f"tensordesc<bf16[{block_m}, {head_dim}]>" if q_descriptor else "*bf16",
           "k_desc": f"tensordesc<bf16[{block_n}, {head_dim}]>", "v_desc": f"tensordesc<bf16[{block_n}, {head_dim}]>",
           "out_ptr": "*fp32", "block_ptr": "*i32", "meta_ptr": "*i32", "col_ptr": "*i32", "k_ptr": "*bf16",
           "v_ptr": "*bf16", "n_steps": "i32", "n_full": "i32", "n_cols": "i32"}
    constants = dict(Q_DESCRIPTOR=q_descriptor, MASKED_STEPS=masked_steps, COLUMN_LOOP=column_loop,
                     BLOCK_M=block_m, BLOCK_N=block_n, D=head_dim)
    return _compile(_probe_kernel, sig, constants, num_warps, num_stages)


def overfilled_copies(ttgir: str, tensordesc_meta: list[dict] | None) -> int:
    """How many TMA copies of a build (`ttng.async_tma_copy_global_to_local` in its TTGIR) land in a shared
    buffer of fewer rows than their host descriptor's box (`tensordesc_meta`, one entry per descriptor argument
    in the order of the kernel's signature), which is what the copy writes."""
    signature = re.search(r"tt\.func public @.*", ttgir).group(0)
    names = re.findall(r"%(\w+): !tt\.tensordesc", signature)
    box_rows = {n: m["block_size"][-2] for n, m in zip(names, tensordesc_meta or [])}
    copies = re.findall(r"async_tma_copy_global_to_local %(\w+)\[.*-> !ttg\.memdesc<((?:\d+x)+)", ttgir)
    return sum(int(shape.split("x")[-3]) < box_rows[name] for name, shape in copies)


def _row(case: dict, make) -> dict:
    """`case` with what the build `make()` gives: whether its loop was partitioned, its resources and overfilled
    TMA copies, or the compiler's error."""
    row = dict(case)
    try:
        b = make()
        u = sm90.usage(b)
        row.update(partitioned=u.warp_specialized, setmaxnreg=b.asm["ptx"].count("setmaxnreg"),
                   registers=u.registers, stack_bytes=u.stack_bytes, shared_bytes=u.shared_bytes,
                   overfilled_copies=overfilled_copies(b.asm["ttgir"], b.metadata.tensordesc_meta))
    except Exception as e:  # an assertion inside the pass surfaces as a failed pass pipeline
        row["error"] = f"{type(e).__name__}: {e}".splitlines()[0][:120]
    print(row, flush=True)
    return row


def probe(num_warps=(4, 8)) -> list[dict]:
    rows = []
    features = ((False, False), (True, False), (False, True))
    for block_m, warps, q_desc, (masked, columns) in itertools.product((64, 128), num_warps, (False, True), features):
        case = {"loop": "forward", "block_m": block_m, "num_warps": warps, "q": "descriptor" if q_desc else "pointer",
                "masked_steps": masked, "column_loop": columns}
        rows.append(_row(case, functools.partial(build, q_desc, masked, columns, warps, block_m)))
    for warps, block_m in itertools.product(num_warps, (64, 128)):
        case = {"loop": "dq", "block_m": block_m, "num_warps": warps, "q": "descriptor", "masked_steps": False,
                "column_loop": False}
        rows.append(_row(case, functools.partial(build_dq, warps, block_m)))
    return rows


def format_table(rows: list[dict]) -> str:
    head = f"{'loop':<7} {'m':>3} {'warps':>5} {'q':<10} {'masked':<6} {'columns':<7}  result"
    lines = [head, "-" * 84]
    for r in rows:
        result = r.get("error") or (
            f"{'PARTITIONED' if r['partitioned'] else 'not partitioned'}, {r['registers']} regs, "
            f"{r['stack_bytes']} B stack, {r['shared_bytes'] / 1024:.0f} KB shared, setmaxnreg x{r['setmaxnreg']}, "
            f"{r['overfilled_copies']} TMA copies overfill their buffer")
        case = (f"{r['loop']:<7} {r['block_m']:>3} {r['num_warps']:>5} {r['q']:<10} {str(r['masked_steps']):<6} "
                f"{str(r['column_loop']):<7}")
        lines.append(f"{case}  {result}")
    return "\n".join(lines)


def main(argv: list[str]) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num_warps", type=int, nargs="+", default=[4, 8], help="Warps per program to build with.")
    p.add_argument("--output", default=None, help="JSON path; default benchmarks/results/.")
    args = p.parse_args(argv)
    rows = probe(tuple(args.num_warps))
    report = sm90.build_report("warp_specialize_probe", rows,
                               shapes="key steps 64, head_dim 128, bf16; forward: 3 stages; dq: 2 stages")
    print(f"sm_90 builds with triton {report['triton']}: is the key-block loop warp-specialized?")
    print(format_table(rows))
    write_report(report, RESULTS_DIR, f"warp-specialize-probe_triton-{report['triton']}", args.output)
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
