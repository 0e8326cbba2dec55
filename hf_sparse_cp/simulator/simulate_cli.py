"""How far does it scale? Predicted training-step time of context parallelism on a GPU cluster.

For a model shape, a cluster preset, sequence lengths and CP sizes, every configuration of
`hf_sparse_cp.simulator.simulate.CONFIGURATIONS` (dense ring, zigzag sparse, striped sparse,
hierarchical striped sparse, and the document planner, flat and hierarchical) is simulated from
the ring plan our code executes (`predict_step`): per rank and per ring step, compute from the
plan's work and transfers from its bytes, overlapped as the ring schedules them. Nothing runs on
a GPU: these are predictions, calibrated on measured H100 figures (anchors.md) and published NCCL
bandwidths, each with its source in the JSON.

Layouts, one sequence per row (default): the dense ring uses the causal layout; the sparse
configurations a random vertical-slash layout (`random_vertical_slash_layout`, `--layout-heads`
heads standing for all of the model's heads) keeping the share of the causal blocks that the default
pattern keeps at that length: read from a measured kept-share curve (`kept_curve.py`; the shipped one
is Gemma 3 270M's global layers at 1K-32K, extrapolated past 32K; every row names its source and basis), or
one `--density` at every length (MTraining reports 93.7% sparsity: 0.063), with `--verticals` columns
(MTraining's budget of 1000) and `--sink` sink tokens. On one sequence the planner splits it striped, as
striped sparse does. The first `--dense-first-layers` layers (the plugin's default: 1) run the same ring over the causal
layout without estimation, as the plugin runs them under CP; each row gives their share of the attention.

Packed rows (`--mix long-tail|uniform|one`): each row of S tokens packs documents of a length mix
of `hf_sparse_cp.simulator.workloads` (those of `benchmarks/cp_packing.py`), with per-document
patterns (the library's selection from random scores at the default budgets; documents shorter
than `min_seq_len` dense) built in every split's own order; the dense ring attends causally
within documents.

Sparse kernels are costed twice: with FlexAttention's measured per-row cost ("flex"), and with its
per-block cost only ("block-only", a bound for a kernel without per-row overhead).

    hf-sparse-cp simulate                        # Qwen2.5-3B on 8xH100 nodes + MTraining's setting
    hf-sparse-cp simulate --model qwen2.5-7b --cluster 8xA100-IB200 --seq 262144 --cp 8 16
    python benchmarks/simulate_cluster.py        # the same, results in benchmarks/results/
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from datetime import UTC, datetime
from pathlib import Path

import torch

from ..attention.build import dense_layout
from ..attention.tokens import TokenMeta
from ..backends import require_matplotlib
from ..config import SparseAttentionConfig
from ..distributed.split.documents import kept_blocks_per_row, row_runs
from ..env import environment
from .kept_curve import DEFAULT_CURVE, KeptAt, KeptCurve
from .shapes import MODELS
from .simulate import CONFIGURATIONS, Workload
from .step_model import CLUSTERS, HARDWARE, predict_step, ring_counts, with_causal_layout
from .workloads import (
    MIXES,
    document_scores,
    mix_lengths,
    packed_layout,
    random_vertical_slash_layout,
    row_meta,
)

BLOCK = 128
MTRAINING = {"model": "qwen2.5-3b", "cluster": "8xA100-IB200", "seq": 524288, "cp": 32, "reported_speedup": 6.0,
             "density": 0.063,
             "source": "MTraining (arXiv 2510.18830), reported: up to 6x training throughput vs dense ring attention, "
                       "Qwen2.5-3B at 512K on 32 A100s (zigzag variant 2.9x, without hierarchy 4.6x); "
                       "their reported 93.7% sparsity is simulated as density 0.063"}
KERNELS = {"flex": {"sparse_row_costs": True}, "block-only": {"sparse_row_costs": False}}


def _at_least(low: int):
    """An argparse type: a whole number >= `low`."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{value} must be >= {low}")
        return value

    return parse


def _fraction(text: str) -> float:
    """An argparse type: a number in (0, 1]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"{value} must be in (0, 1], a fraction (e.g. 0.063 for 6.3%)")
    return value


def parse_args(argv=None, prog: str | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-3b", choices=sorted(MODELS))
    p.add_argument("--cluster", default="8xH100-IB400", choices=sorted(CLUSTERS))
    p.add_argument("--seq", type=_at_least(1), nargs="+", default=[131072, 262144, 524288, 1048576])
    p.add_argument("--cp", type=_at_least(1), nargs="+", default=[8, 16, 32, 64])
    p.add_argument("--configs", nargs="+", default=list(CONFIGURATIONS), choices=list(CONFIGURATIONS))
    p.add_argument("--dense-kernel", default="cudnn", choices=["cudnn", "fa2"],
                   help="the dense ring's kernel (SDPA cuDNN or FlashAttention-2, both measured in anchors.md)")
    p.add_argument("--density", type=_fraction, default=None,
                   help="kept fraction of the causal blocks of the sparse layouts at every length (default: the "
                        "kept-curve's at each length)")
    p.add_argument("--kept-curve", default=None,
                   help="a `benchmarks/pattern_quality.py --curve` report whose 'defaults' setting gives the kept "
                        f"share at each length (default: the shipped measurement, {DEFAULT_CURVE.source})")
    p.add_argument("--dense-first-layers", type=_at_least(0), default=SparseAttentionConfig().dense_first_layers,
                   help="layers kept dense at the start of the model (the plugin's --sparse_dense_first_layers)")
    p.add_argument("--spread", type=_fraction, default=1.0,
                   help="random diagonals lie among the nearest SPREAD fraction of block diagonals (1: anywhere)")
    p.add_argument("--verticals", type=_at_least(0), default=1000)
    p.add_argument("--sink", type=_at_least(0), default=32)
    p.add_argument("--layout-heads", type=_at_least(1), default=4,
                   help="heads of the synthetic layout (work is scaled to the model's heads)")
    p.add_argument("--mix", default=None, choices=MIXES,
                   help="pack each row with documents of this length mix (hf_sparse_cp.simulator.workloads) instead of "
                        "one sequence")
    p.add_argument("--estimation-chunk", type=_at_least(BLOCK), default=None,
                   help="charge the estimation of estimation='causal_chunks' with this chunk (default: each "
                        "document's last queries); a packed row is charged as one sequence (an upper bound)")
    p.add_argument("--no-mtraining", action="store_true", help="skip the prediction for MTraining's setting")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None,
                   help="output file (default: simulate-cluster_<model>_<cluster>[_<mix>].json in the results folder: "
                        "the current directory, benchmarks/results for benchmarks/simulate_cluster.py)")
    p.add_argument("--png", default=None, help="plot file (default next to the JSON)")
    return p.parse_args(argv)


def kept_target(args, seq: int) -> KeptAt:
    """The kept share the sparse layout of one sequence of `seq` tokens is drawn with, and where it comes from."""
    if args.density is not None:
        return KeptAt(seq, args.density, 1.0, "given", "--density")
    return (_read_curve(args.kept_curve) if args.kept_curve else DEFAULT_CURVE).at(seq)


@functools.lru_cache(maxsize=4)
def _read_curve(path: str) -> KeptCurve:
    return KeptCurve.from_report(path)


def sequence_workload(args, seq: int) -> Workload:
    """One sequence of `seq` tokens: the causal layout, and a random vertical-slash one (see the module docstring)."""
    cache = {}
    density = kept_target(args, seq).kept

    def layout(kind: str, plan) -> object:
        if not plan.keeps_order:
            raise ValueError("one sequence keeps its order under every split of it.")
        if (kind, plan.padded_len) not in cache:
            meta = TokenMeta.contiguous(1, seq).pad_to(plan.padded_len)
            cache[kind, plan.padded_len] = dense_layout(meta, BLOCK) if kind == "dense" else \
                random_vertical_slash_layout(1, args.layout_heads, seq, BLOCK,
                                             num_diagonals=round(density * seq // BLOCK),
                                             num_verticals=args.verticals, sink_tokens=args.sink,
                                             diagonal_spread=args.spread, padded_len=plan.padded_len,
                                             generator=torch.Generator().manual_seed(args.seed))
        return cache[kind, plan.padded_len]

    return Workload((seq,), ("sparse",), layout)


def packed_workload(mix: str, seq: int, seed: int) -> Workload:
    """A row of `seq` tokens packing documents of `mix` with cp_packing's per-document patterns."""
    cfg = SparseAttentionConfig(block_size=BLOCK)
    lengths = mix_lengths(mix, seq, seed)
    meta = row_meta(lengths)
    scores = document_scores(lengths, seed)
    runs, kinds = row_runs(meta, cfg)
    cache = {}

    def layout(kind: str, plan) -> object:
        key = (kind, plan.padded_len) if plan.keeps_order else None  # block shardings share the row's layout
        if key in cache:
            return cache[key]
        out = dense_layout(plan.global_meta(meta), BLOCK) if kind == "dense" else \
            packed_layout(plan, meta, cfg, scores)[0]
        if key is not None:
            cache[key] = out
        return out

    return Workload(tuple(runs), tuple(kinds), layout, kept_blocks_per_row(cfg))


def workload_for(args, seq: int) -> Workload:
    return sequence_workload(args, seq) if args.mix is None else packed_workload(args.mix, seq, args.seed)


def simulate(args, model_name: str, cluster_name: str, seqs: list[int], cps: list[int], configs: list[str],
             dense_kernel: str) -> list[dict]:
    model, cluster = MODELS[model_name], CLUSTERS[cluster_name]
    hardware = {k: HARDWARE[cluster_name](dense_kernel=dense_kernel, **v) for k, v in KERNELS.items()}
    rows = []
    for seq in seqs:
        if seq % (2 * BLOCK * max(cps)):
            raise SystemExit(f"--seq {seq} must be a multiple of {2 * BLOCK * max(cps)} (whole zigzag chunks).")
        workload = workload_for(args, seq)
        target = kept_target(args, seq) if args.mix is None else None
        for cp in cps:
            base = None
            for name in configs:
                setup = CONFIGURATIONS[name](workload, cp, BLOCK, cluster.gpus_per_node)
                counts = ring_counts(setup, model)
                dense = with_causal_layout(setup, workload.layout("dense", setup.plan)) \
                    if setup.sparse and args.dense_first_layers else None
                for kernel, hw in hardware.items():
                    if not setup.sparse and kernel != "flex":
                        continue
                    r = predict_step(setup, model, hw, cluster, estimation_chunk=args.estimation_chunk,
                                     counts=counts, dense_layers=args.dense_first_layers, dense=dense)
                    if target is not None and setup.sparse:
                        r.update(kept_target=target.kept, kept_basis=target.basis, kept_source=target.source)
                    r.update(model=model_name, cluster=cluster_name, seq=seq, cp=cp, config=name,
                             kernel=kernel if setup.sparse else dense_kernel, mix=args.mix or "one sequence",
                             documents=len(workload.lengths), local_blocks=[int(b.numel()) for b in
                                                                           setup.plan.rank_blocks])
                    if not setup.sparse:
                        base = r["step_s"]
                    r["speedup_vs_dense_ring"] = base / r["step_s"] if base else None
                    rows.append(r)
                    print(format_row(r), flush=True)
    return rows


HEADER = (f"{'S':>8} {'CP':>3}  {'configuration':<28}{'kernel':<11}{'kept':>6} {'step s':>8} {'tok/s':>9} "
          f"{'speedup':>8} {'comm':>6} {'bound':>6}")


def format_row(r: dict) -> str:
    speed = f"{r['speedup_vs_dense_ring']:.2f}x" if r["speedup_vs_dense_ring"] else "-"
    return (f"{r['seq']:>8} {r['cp']:>3}  {r['config']:<28}{r['kernel']:<11}{r['kept']:>6.3f} {r['step_s']:>8.2f} "
            f"{r['tokens_per_s']:>9.0f} {speed:>8} {r['comm_share']:>6.1%} {'comm' if r['comm_bound'] else '':>6}")


def comm_bound_from(rows: list[dict]) -> dict:
    """Per (configuration, kernel, S): the smallest CP size whose ring is communication-bound (None: none)."""
    out: dict = {}
    for r in rows:
        key = f"{r['config']} / {r['kernel']} / {r['seq']}"
        out.setdefault(key, None)
        if r["comm_bound"] and (out[key] is None or r["cp"] < out[key]):
            out[key] = r["cp"]
    return out


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seqs = sorted({r["seq"] for r in rows})
    colors = {name: f"C{i}" for i, name in enumerate(CONFIGURATIONS)}
    fig, axes = plt.subplots(3, len(seqs), figsize=(4.2 * len(seqs), 10), squeeze=False, sharex=True)
    for j, seq in enumerate(seqs):
        for (config, kernel) in sorted({(r["config"], r["kernel"]) for r in rows if r["seq"] == seq}):
            sel = sorted((r for r in rows if (r["seq"], r["config"], r["kernel"]) == (seq, config, kernel)),
                         key=lambda r: r["cp"])
            cps = [r["cp"] for r in sel]
            style = "--" if kernel == "block-only" else "-"
            label = f"{config} ({kernel})"
            kw = {"marker": "o", "label": label, "color": colors[config]}
            axes[0, j].plot(cps, [r["tokens_per_s"] / 1e3 for r in sel], style, **kw)
            axes[1, j].plot(cps, [r["speedup_vs_dense_ring"] for r in sel], style, **kw)
            axes[2, j].plot(cps, [100 * r["comm_share"] for r in sel], style, **kw)
        axes[0, j].set_title(f"S = {seq // 1024}K")
        axes[2, j].set_xlabel("CP size (GPUs)")
        axes[2, j].set_xscale("log", base=2)
        axes[2, j].set_xticks(sorted({r["cp"] for r in rows}), [str(c) for c in sorted({r["cp"] for r in rows})])
    axes[0, 0].set_ylabel("predicted K tokens/s")
    axes[1, 0].set_ylabel("speedup over dense ring")
    axes[2, 0].set_ylabel("communication share of step %")
    axes[0, 0].legend(fontsize=7)
    fig.suptitle(title + " (predicted, not measured)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None, results: Path | None = None, prog: str | None = None) -> dict:
    """Simulate, print the table, write the JSON and the plot (into `results`, default the current
    directory, unless --json names the file); returns the report. prog: the command's name in --help."""
    args = parse_args(argv, prog)
    require_matplotlib()  # before minutes of simulation, not after
    try:
        targets = [kept_target(args, seq) for seq in args.seq]
    except (OSError, ValueError, KeyError) as e:
        raise SystemExit(f"--kept-curve {args.kept_curve}: {e}") from None
    if args.mix is None:
        print(f"{args.model} on {args.cluster}; sparse layouts: {args.verticals} verticals + {args.sink} sink tokens "
              f"({args.layout_heads} layout heads) and diagonals for a kept share of")
        for target in targets:
            print(f"  {target.describe()}")
        print(f"first {args.dense_first_layers} layer(s) dense; PREDICTED")
    else:
        print(f"{args.model} on {args.cluster}; rows packed with the {args.mix} mix (seed {args.seed}), "
              "per-document patterns at the default budgets; PREDICTED")
    if args.estimation_chunk:
        print(f"estimation: causal chunks of {args.estimation_chunk} tokens (estimation='causal_chunks')")
    print(HEADER)
    rows = simulate(args, args.model, args.cluster, args.seq, args.cp, args.configs, args.dense_kernel)
    hw = HARDWARE[args.cluster](dense_kernel=args.dense_kernel)
    cluster = CLUSTERS[args.cluster]
    report = {
        "what": "predicted training-step time (simulation, not a measurement) of one sequence per CP group",
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine_that_simulated": environment(),
        "args": vars(args),
        "model": vars(MODELS[args.model]),
        "cluster": {"name": cluster.name, "gpus_per_node": cluster.gpus_per_node,
                    "intra": vars(cluster.intra), "inter": vars(cluster.inter), "overlap": cluster.overlap},
        "calibration": {"sources": hw.sources, "sparse_fwd": vars(hw.sparse_fwd), "sparse_bwd": vars(hw.sparse_bwd),
                        "dense_fwd": vars(hw.dense_fwd), "dense_bwd": vars(hw.dense_bwd),
                        "linear_flops_per_s": hw.linear_flops_per_s},
        "assumptions": ASSUMPTIONS,
        "rows": rows,
        "comm_bound_from_cp": comm_bound_from(rows),
    }
    if not args.no_mtraining:
        m = MTRAINING
        print(f"\nMTraining's setting: {m['model']}, {m['seq'] // 1024}K, {m['cp']} GPUs of {m['cluster']}")
        print(HEADER)
        mt = []
        for dense_kernel in ("fa2", "cudnn"):
            mt_args = {**vars(args), "mix": None, "density": args.density or m["density"]}
            mt += simulate(argparse.Namespace(**mt_args), m["model"], m["cluster"], [m["seq"]],
                           [m["cp"]], list(CONFIGURATIONS), dense_kernel)
        report["mtraining"] = {**m, "rows": mt}
    name = f"simulate-cluster_{args.model}_{args.cluster}" + (f"_{args.mix}" if args.mix else "") + ".json"
    out = Path(args.json) if args.json else (results or Path.cwd()) / name
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    png = Path(args.png) if args.png else out.with_suffix(".png")
    plot(rows, png, f"{args.model} on {args.cluster}" + (f", rows packed with the {args.mix} mix" if args.mix else ""))
    print(f"wrote {out} and {png}")
    return report


ASSUMPTIONS = [
    "one sequence per CP group per step; tokens/s = sequence length / step time",
    "gradient checkpointing: each layer's forward (estimation + ring) runs twice",
    "the dense ring: zigzag sharding, causal layout, no estimation, dense kernel costs",
    "sparse layouts are synthetic vertical-slash layouts of one density for every sparse layer (MTraining's grows "
    "with depth), that density the measured kept-share curve's at each length (kept_basis: measured, interpolated "
    "or extrapolated) unless --density gives one; layout-heads heads stand for all heads (work scaled, bytes from "
    "their union)",
    "the first --dense-first-layers layers run the ring over the causal layout with the same kernel, no estimation",
    "compute per ring step = linear cost model of its work (per row, per block pair), calibrated on H100 "
    "FlexAttention / cuDNN / FA2 at head_dim 128, scaled by head_dim; no kernel launch gaps",
    "transfers: latency + bytes / bandwidth per link, NVLink inside a node and InfiniBand across; a rank's sends of "
    "one slot on one kind of link go one after the other; receivers' links and collectives do not contend",
    "ring collectives (all-gather, all-reduce) at the slowest link of the group",
    "not modelled: FSDP / data-parallel traffic, the optimizer step, memory limits",
]


if __name__ == "__main__":
    main(sys.argv[1:])
