"""Load balance and traffic of sparse ring attention under contiguous, zigzag and striped sharding.

For every sequence length S and CP size: the computed work of every rank at every ring step and
the bytes every rank sends, counted from the plan the ring executes
(`hf_sparse_cp.simulator.traffic.ring_cost`): blocks nobody downstream reads are not sent,
steps without work are skipped. No attention is computed; runs on a CPU.

Layouts (say which when quoting numbers):
* vertical-slash: random vertical-slash layouts, per head the sink columns and the main block
  diagonal forced (MTraining's forced parts) and `--diagonals` block diagonals (uniformly among
  the nearest `--spread` fraction) and `--verticals` columns drawn uniformly
  (`hf_sparse_cp.simulator.workloads.random_vertical_slash_layout`); not estimated from a model;
* dense: the causal layout (every block at or below the diagonal), i.e. a dense ring.

Columns: kept = computed blocks / causal blocks; rank = max/mean over ranks of a rank's total
work; step = ring time over ideal (sum over steps of the busiest rank's work / mean work);
fwd/bwd = total bytes sent by all ranks in forward (K/V) and backward (K/V + fp32 dK/dV);
full = forward bytes of a dense ring that sends every shard W - 1 hops; outer = forward bytes
between nodes (with --node-size, hierarchical ring rows).

    python benchmarks/cp_balance.py                       # S = 128K, 512K; CP = 4, 8, 32
    python benchmarks/cp_balance.py --seq 65536 --cp 8 32 --block-size 64 --node-size 8
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from hf_sparse_cp.attention.build import dense_layout
from hf_sparse_cp.attention.tokens import TokenMeta
from hf_sparse_cp.distributed.comm import RingTopology
from hf_sparse_cp.distributed.split.blocks import SHARDINGS, ShardPlan
from hf_sparse_cp.simulator.traffic import ring_cost
from hf_sparse_cp.simulator.workloads import random_vertical_slash_layout

GIB = float(1 << 30)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, nargs="+", default=[131072, 524288], help="sequence lengths")
    p.add_argument("--cp", type=int, nargs="+", default=[4, 8, 32], help="CP sizes")
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--heads", type=int, default=4, help="query heads of the layout (one pattern per head)")
    p.add_argument("--diagonals", type=float, default=0.02,
                   help="random block diagonals per head, as a fraction of the block count")
    p.add_argument("--spread", type=float, default=1.0,
                   help="random diagonals lie among the nearest SPREAD fraction of block diagonals (1: anywhere)")
    p.add_argument("--verticals", type=int, default=1024, help="random key columns per head")
    p.add_argument("--sink", type=int, default=32, help="forced sink columns")
    p.add_argument("--kv-heads", type=int, default=2, help="key/value heads (bytes per block)")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--node-size", type=int, default=None, help="also show the hierarchical ring with this many ranks "
                   "per node (striped sharding)")
    p.add_argument("--no-dense", action="store_true", help="skip the dense-ring rows")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the rows to this file")
    return p.parse_args(argv)


def _layouts(args, seq: int, padded: int):
    causal = TokenMeta.contiguous(1, seq).pad_to(padded)
    nb = padded // args.block_size
    gen = torch.Generator().manual_seed(args.seed)
    sparse = random_vertical_slash_layout(1, args.heads, seq, args.block_size,
                                          num_diagonals=max(1, round(args.diagonals * nb)),
                                          num_verticals=args.verticals, sink_tokens=args.sink,
                                          diagonal_spread=args.spread, padded_len=padded, generator=gen)
    yield "vertical-slash", sparse
    if not args.no_dense:
        yield "dense", dense_layout(causal, args.block_size)


def run(args) -> list[dict]:
    rows = []
    for seq in args.seq:
        for cp in args.cp:
            # One padded length for all shardings of this CP size (zigzag's is the coarsest).
            padded = ShardPlan("zigzag", cp, args.block_size, seq).padded_len
            for pattern, layout in _layouts(args, seq, padded):
                kept = float(layout.kept_fraction())
                rings = [("flat", RingTopology(1, cp))]
                if args.node_size and 1 < args.node_size < cp and cp % args.node_size == 0:
                    rings.append(("hierarchical", RingTopology(cp // args.node_size, args.node_size)))
                for sharding in SHARDINGS:
                    plan = ShardPlan(sharding, cp, args.block_size, padded)
                    for ring, topo in rings:
                        if ring != "flat" and sharding != "striped":
                            continue
                        cost = ring_cost(layout, plan, topo, kv_heads=args.kv_heads, head_dim=args.head_dim)
                        rows.append({
                            "seq": seq, "cp": cp, "pattern": pattern, "sharding": sharding, "ring": ring,
                            "kept": kept, "rank_imbalance": cost.rank_imbalance,
                            "step_imbalance": cost.step_imbalance,
                            "forward_gib": float(cost.forward_bytes.sum()) / GIB,
                            "backward_gib": float(cost.backward_bytes.sum()) / GIB,
                            "full_ring_gib": cost.full_ring_bytes * cp / GIB, "outer_gib": cost.outer_bytes / GIB,
                        })
                        print(_format(rows[-1]), flush=True)
    return rows


HEADER = (f"{'S':>8} {'CP':>3} {'pattern':<15}{'sharding':<11}{'ring':<13}{'kept':>6} {'rank':>6} {'step':>6} "
          f"{'fwd GiB':>9} {'bwd GiB':>9} {'full GiB':>9} {'outer GiB':>9}")


def _format(r: dict) -> str:
    return (f"{r['seq']:>8} {r['cp']:>3} {r['pattern']:<15}{r['sharding']:<11}{r['ring']:<13}{r['kept']:>6.3f} "
            f"{r['rank_imbalance']:>6.3f} {r['step_imbalance']:>6.3f} {r['forward_gib']:>9.3f} "
            f"{r['backward_gib']:>9.3f} {r['full_ring_gib']:>9.3f} {r['outer_gib']:>9.3f}")


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    print(f"random vertical-slash layouts: {args.heads} heads, {args.diagonals:.3f} x blocks random diagonals (within "
          f"{args.spread:.2f} of the blocks) + main, "
          f"{args.verticals} random + {args.sink} sink columns; block {args.block_size}; bytes for {args.kv_heads} KV "
          f"heads x head_dim {args.head_dim}, bf16 K/V, fp32 dK/dV")
    print(HEADER)
    rows = run(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
