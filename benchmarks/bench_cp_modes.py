"""Ring vs head-parallel (Ulysses) vs hybrid sparse context parallelism on CPU processes (gloo), side by side.

    python benchmarks/bench_cp_modes.py                        # 4 processes, Qwen2.5-0.5B's attention, 32K tokens
    python benchmarks/bench_cp_modes.py --seq 16384 --repeats 1 --rounds 2   # the committed runs: 16K, 32K

Each layout runs in its own spawned group of --world gloo processes, one after the other: 'ring' (CP 4,
striped), 'ulysses' (heads over 4 ranks) and 'hybrid' (heads over 2 ranks x a ring of 2), each doing what
the attention backend does for one layer (`context_parallel_attention`, with
the default pattern settings but top-k budgets of 1024 columns and 1024 diagonals, PyTorch's reference
engine on CPU), forward and backward, on the same sequence and q, k, v. q and k attend locally
(`testing.layouts.local_qk`, scores decaying over --span tokens), so that the budgets keep a few
contiguous blocks per row: i.i.d. random q and k spread their mass evenly, so a top-k budget would keep
columns and diagonals scattered over every block, and the default 'mass' budget nearly every block.
Every layout runs --rounds times, in turn (ring, ulysses, hybrid, ring, ...), so that a change of the
machine's load falls on every layout, each layout's fastest round reported; the machine's load average
before and after goes into the JSON. The processes run with glibc keeping freed memory
(`hf_sparse_cp.backends.RECYCLING_MALLOC`, as PyTorch's caching allocator does on a GPU; --allocator
system for glibc's defaults). Per rank: the median seconds of a forward + backward over --repeats (after
one warm-up), the bytes it sent (forward / backward: the ring's K/V and dK/dV transfers and column
collectives, the all-to-alls; not counted: the ring estimation's small collectives of scoring queries,
normalisers, slash sums and candidates), and the peak resident memory of the timed calls above what the
process held before them (inputs included in neither). Every layout's output is checked against the
ring's (relative RMS error, the ranks' pieces put back in global order).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import time
from pathlib import Path

import torch

RESULTS_DIR = Path(__file__).resolve().parent / "results"
MODES = {"ring": {"cp_mode": "ring"}, "ulysses": {"cp_mode": "ulysses"},
         "hybrid": {"cp_mode": "hybrid", "cp_ulysses_size": 2}}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, default=32768, help="tokens of the sequence")
    p.add_argument("--world", type=int, default=4, help="processes (the CP degree); hybrid: head groups of 2")
    p.add_argument("--heads", type=int, nargs=2, default=[14, 2], metavar=("Q", "KV"),
                   help="query and key/value heads (default: Qwen2.5-0.5B's)")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--vertical-topk", type=int, default=1024,
                   help="the pattern's top-k budgets; 0 with --slash-topk 0: the default pattern ('mass' budget)")
    p.add_argument("--slash-topk", type=int, default=1024)
    p.add_argument("--span", type=float, default=1024.0,
                   help="tokens over which q.k decays (exp(-d^2 / (2 span^2)) of the distance d)")
    p.add_argument("--repeats", type=int, default=2, help="timed forward + backward calls after one warm-up")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("--rounds", type=int, default=2, help="times every layout runs, in turn")
    p.add_argument("--allocator", default="recycling", choices=["recycling", "system"])
    p.add_argument("--output", default=None, help="JSON path (default: benchmarks/results/cp-modes_cpu_<S>.json)")
    return p.parse_args(argv)


def _rss() -> int:
    with open("/proc/self/status") as f:
        return int(re.search(r"VmRSS:\s+(\d+) kB", f.read()).group(1)) * 1024


def _measure(rank: int, world: int, mode: str, args: argparse.Namespace) -> dict:
    """One rank of one layout: times, bytes sent, peak memory, and its output with its tokens' positions."""
    from hf_sparse_cp import SparseAttentionConfig
    from hf_sparse_cp.distributed import (
        ContextParallelConfig,
        ParallelDims,
        RingStats,
        context_parallel_attention,
        prepare_context_parallel_inputs,
    )
    from hf_sparse_cp.testing.benchmarking import peak_rss
    from hf_sparse_cp.testing.layouts import local_qk

    topk = {"vertical_topk": args.vertical_topk, "slash_topk": args.slash_topk} if args.vertical_topk else {}
    cfg = SparseAttentionConfig(**topk)
    par = ParallelDims.from_config(ContextParallelConfig(cp_size=world, **MODES[mode]))
    g = torch.Generator().manual_seed(0)  # the same sequence and q, k, v in every layout
    hq, hkv = args.heads
    full = [*local_qk(hq, hkv, args.seq, args.head_dim, args.span, generator=g),
            *(torch.randn(1, h, args.seq, args.head_dim, generator=g) for h in (hkv, hq))]
    shard = prepare_context_parallel_inputs({"input_ids": torch.zeros(1, args.seq, dtype=torch.long)}, par,
                                            block_size=cfg.block_size, sparse_config=cfg)["cp_shard"]
    q, k, v, dout = (shard.plan.shard(x, par.cp_rank, dim=2) for x in full)
    del full
    stats = RingStats()

    def step() -> torch.Tensor:
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
        result = context_parallel_attention(*leaves, shard, cfg, stats=stats)
        (result.out * dout).sum().backward()
        return result

    step()  # warm-up
    stats.forward_bytes = stats.backward_bytes = 0
    held, times = _rss(), []
    peak_rss()
    for _ in range(args.repeats):
        start = time.perf_counter()
        result = step()
        times.append(time.perf_counter() - start)
    peak = peak_rss()
    return {"times_s": times, "step_s": statistics.median(times), "kept_fraction": float(result.kept_fraction),
            "forward_bytes": stats.forward_bytes // args.repeats,
            "backward_bytes": stats.backward_bytes // args.repeats,
            "peak_extra_bytes": peak - held, "held_bytes": held, "tokens": q.shape[2],
            "positions": shard.plan.token_index(par.cp_rank), "out": result.out.detach()}


def _global(ranks: list[dict], seq: int) -> torch.Tensor:
    """The ranks' outputs in global order, padding dropped."""
    b, h, _, d = ranks[0]["out"].shape
    full = torch.zeros(b, h, max(int(r["positions"].max()) for r in ranks) + 1, d)
    for r in ranks:
        full[:, :, r["positions"]] = r["out"]
    return full[:, :, :seq]


def main(argv=None) -> dict:
    from hf_sparse_cp.env import environment
    from hf_sparse_cp.testing.benchmarking import rel_rms, spawned_allocator, write_report
    from hf_sparse_cp.testing.spawn import run_gloo

    args = parse_args(argv)
    load_before = os.getloadavg()
    runs, outputs = {mode: [] for mode in args.modes}, {}
    with spawned_allocator(args.allocator):
        for _ in range(args.rounds):
            for mode in args.modes:
                ranks = run_gloo(_measure, args.world, mode, args, timeout_s=3600)
                outputs[mode] = _global(ranks, args.seq)
                runs[mode].append([{k: v for k, v in r.items() if k not in ("out", "positions")} for r in ranks])
    rows = []
    for mode, rounds in runs.items():
        slowest = [max(r["step_s"] for r in ranks) for ranks in rounds]
        ranks = rounds[slowest.index(min(slowest))]
        rows.append({"mode": mode, "per_rank": ranks, "rounds_step_s": slowest, "step_s": min(slowest),
                     "forward_bytes_per_rank": max(r["forward_bytes"] for r in ranks),
                     "backward_bytes_per_rank": max(r["backward_bytes"] for r in ranks),
                     "peak_extra_bytes_per_rank": max(r["peak_extra_bytes"] for r in ranks),
                     "kept_fraction": ranks[0]["kept_fraction"]})
    first = args.modes[0]
    for row in rows:
        row[f"out_rel_rms_vs_{first}"] = rel_rms(outputs[row["mode"]], outputs[first])
    print(f"{args.world} CPU processes (gloo), {args.seq} tokens, {args.heads[0]} query / {args.heads[1]} key-value "
          f"heads of {args.head_dim}, top-k {args.vertical_topk}/{args.slash_topk}, span {args.span:g}; slowest rank "
          f"(fastest of {args.rounds} rounds) / busiest rank")
    print(f"{'mode':<9}{'fwd+bwd s':>10}{'fwd MiB sent':>14}{'bwd MiB sent':>14}{'peak MiB':>10}{'kept':>8}"
          f"{'vs ' + first:>12}")
    for row in rows:
        print(f"{row['mode']:<9}{row['step_s']:>10.2f}{row['forward_bytes_per_rank'] / 2**20:>14.1f}"
              f"{row['backward_bytes_per_rank'] / 2**20:>14.1f}{row['peak_extra_bytes_per_rank'] / 2**20:>10.0f}"
              f"{row['kept_fraction']:>8.3f}{row[f'out_rel_rms_vs_{first}']:>12.1e}")
    report = {"what": "one attention layer's forward + backward under each CP layout on CPU processes (gloo): "
                      "seconds (median of the timed calls, slowest rank, fastest round), bytes sent and peak "
                      "resident memory above what was held before (busiest rank)",
              "device": "cpu", "environment": environment(), "args": vars(args), "rows": rows,
              "load_average_1_5_15min": {"before": load_before, "after": os.getloadavg()}}
    out = args.output or str(RESULTS_DIR / f"cp-modes_cpu_{args.seq // 1024}k.json")
    write_report(report, RESULTS_DIR, "cp-modes", out)
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
