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
pattern keeps at that length: read from a measured kept-fraction curve (`kept_curve.py`; the shipped one
is Gemma 3 270M's global layers at 1K-32K, extrapolated past 32K; every row names its source and basis), or
one `--density` at every length (MTraining reports 93.7% sparsity: 0.063), with `--verticals` columns
(MTraining's budget of 1000) and `--sink` sink tokens. On one sequence the planner splits it striped, as
striped sparse does. The first `--dense-first-layers` layers (the plugin's default: 1) run the same ring over the causal
layout without estimation, as the plugin runs them under CP; each row gives their share of the attention.
A length off a split's grid is padded as training pads it, each configuration and CP size to its own grid, over
the one layout drawn on the sequence's own blocks (the padding's blocks list nothing).

Packed rows (`--mix long-tail|uniform|one`): each row of S tokens packs documents of a length mix
of `hf_sparse_cp.simulator.workloads` (those of `benchmarks/cp_packing.py`), with per-document
patterns (the library's selection from random scores at the default budgets; documents shorter
than `min_seq_len` dense) built in every split's own order; the dense ring attends causally
within documents.

Sparse rings are costed with our kernels as measured on an H100 ("ours", the default); `--sparse-kernels` (or
`--all`) adds FlexAttention on block layouts as measured ("flex") and its per-block cost alone ("block-only", a bound
for a kernel without per-row overhead).

    hf-sparse-cp simulate                        # Qwen2.5-3B on 8xH100 nodes + MTraining's setting
    hf-sparse-cp simulate --model qwen2.5-7b --cluster 8xA100-IB200 --seq 262144 --cp 8 16
    python benchmarks/simulate_cluster.py        # the same, results in benchmarks/results/
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
from collections.abc import Iterable, Iterator
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path

import torch

from ..attention.build import dense_layout
from ..attention.tokens import TokenMeta
from ..backends import PLOT_EXTRA, require_matplotlib
from ..config import SparseAttentionConfig
from ..distributed.heads.split import HeadSplit
from ..distributed.modes import CPMode
from ..distributed.split.blocks import ShardPlan
from ..distributed.split.document_costs import PlannerCosts, kept_blocks_per_row, linear_weight
from ..distributed.split.document_runs import row_runs
from ..env import environment
from .arguments import (
    CHECKPOINTING_ALIAS,
    FlagParser,
    HelpFormatter,
    add_checkpointing_argument,
    add_cluster_arguments,
    add_cp_mode_arguments,
    add_model_arguments,
    at_least,
    check_output_file,
    checkpointed,
    cluster_of,
    cp_layout,
    custom_parts,
    fraction,
    model_name,
    model_shape,
    refuse_group_settings_without_cp,
    write_output,
)
from .head_parallel import head_parallel_setup, predict_head_parallel_step
from .kept_curve import DEFAULT_CURVE, KeptAt, KeptCurve
from .shapes import MODELS, ModelShape
from .simulate import CONFIGURATIONS, Cluster, RingSetup, Workload
from .step_model import (
    BOUND_KERNELS,
    CLUSTERS,
    HARDWARE,
    SPARSE_KERNELS,
    predict_step,
    ring_counts,
    with_causal_layout,
)
from .workloads import (
    MIXES,
    document_scores,
    mix_lengths,
    packed_layout,
    random_vertical_slash_layout,
    row_layouts,
    row_meta,
)

BLOCK = 128
MTRAINING = {"model": "qwen2.5-3b", "cluster": "8xA100-IB200", "seq": 524288, "cp": 32, "reported_speedup": 6.0,
             "density": 0.063,
             "source": "MTraining (arXiv 2510.18830), reported: up to 6x training throughput vs dense ring attention, "
                       "Qwen2.5-3B at 512K on 32 A100s (zigzag variant 2.9x, without hierarchy 4.6x); "
                       "their reported 93.7% sparsity is simulated as density 0.063"}
# The command's peak memory per (query block, key block) pair of one sequence, whose layouts it holds whole: the
# causal layout's, or per layout head where those weigh more. Measured as the peak resident memory of
# `hf-sparse-cp simulate --cp 8 --no-mtraining` above the interpreter's own 0.55 GB: 1.33 GB at 512K tokens and
# 3.53 GB at 1M with 1-4 layout heads (46 bytes a pair), 2.30 GB at 512K with 16 (6.5 bytes a pair and head).
PEAK_BYTES_PER_BLOCK_PAIR, PEAK_BYTES_PER_BLOCK_PAIR_AND_HEAD = 46, 6.5


# The rows of the question (the default): the dense ring, and the sparse ring as the plugin runs it by default
# (--cp_sharding striped, --cp_ring flat); `--all` adds every configuration, the bounds and MTraining's setting.
DEFAULT_CONFIGS = ("dense ring", "striped sparse")


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = FlagParser(prog=prog, description=__doc__, formatter_class=HelpFormatter,
                   aliases={"--cp_size": "--cp", "--seq_len": "--seq", **CHECKPOINTING_ALIAS})
    add_model_arguments(p, MODELS, default="qwen2.5-3b")
    add_cluster_arguments(p, default="8xH100-IB400")
    add_cp_mode_arguments(p)
    p.add_argument("--seq", type=at_least(1), nargs="+", default=[131072, 262144, 524288, 1048576],
                   help="Sequence lengths in tokens (one sequence per CP group per step); each configuration pads "
                   "it to its split's grid as training does, the pattern drawn over the real tokens; `memory`'s "
                   "--seq-len is taken too.")
    p.add_argument("--cp", type=at_least(1), nargs="+", default=[8, 16, 32, 64],
                   help="CP sizes: GPUs that split one sequence (training's --cp_size, which is taken too).")
    p.add_argument("--configs", nargs="+", default=None, choices=list(CONFIGURATIONS),
                   help="Configurations to predict (default: 'dense ring' and 'striped sparse', the plugin's default "
                   "split and ring; with --all, every one).")
    p.add_argument("--all", action="store_true",
                   help="The full table: every configuration, each sparse one also at its block-only bound, and the "
                   "prediction for MTraining's published setting.")
    p.add_argument("--mtraining", action=argparse.BooleanOptionalAction, default=None,
                   help="Also predict MTraining's published setting (Qwen2.5-3B, 512K, 32 A100s; default: with --all).")
    p.add_argument("--sparse-kernels", nargs="+", default=None, choices=list(SPARSE_KERNELS),
                   help="What the sparse rings' kernels cost: 'ours' (the plugin's kernels, measured on an H100), "
                   "'flex' (FlexAttention on block layouts, measured), 'block-only' (FlexAttention's per-block cost "
                   "alone: a bound); each a row of its own (default: ours; with --all, every one).")
    p.add_argument("--dense-kernel", default="cudnn", choices=["cudnn", "fa2"],
                   help="The dense ring's kernel (SDPA cuDNN or FlashAttention-2, both measured in anchors.md).")
    p.add_argument("--density", type=fraction, default=None,
                   help="Kept fraction of the causal blocks of the sparse layouts at every length (default: the "
                   "kept-curve's at each length).")
    p.add_argument("--kept-curve", default=None,
                   help="A `benchmarks/pattern_quality.py --curve` report whose 'defaults' setting gives the kept "
                   f"fraction at each length (default: the shipped measurement, {DEFAULT_CURVE.source}).")
    p.add_argument("--dense-first-layers", type=at_least(0), default=SparseAttentionConfig().dense_first_layers,
                   help="Layers kept dense at the start of the model (the plugin's --sparse_dense_first_layers).")
    p.add_argument("--spread", type=fraction, default=1.0,
                   help="Random diagonals lie among the nearest SPREAD fraction of block diagonals (1: anywhere).")
    p.add_argument("--verticals", type=at_least(0), default=1000,
                   help="Key columns of the synthetic sparse layouts (MTraining's budget).")
    p.add_argument("--sink", type=at_least(0), default=32, help="Sink tokens of the synthetic sparse layouts.")
    p.add_argument("--layout-heads", type=at_least(1), default=4,
                   help="Heads of the synthetic layout (work is scaled to the model's heads).")
    p.add_argument("--mix", default=None, choices=MIXES,
                   help="Pack each row with documents of this length mix (hf_sparse_cp.simulator.workloads) instead of "
                   "one sequence.")
    p.add_argument("--estimation-chunk", type=at_least(BLOCK), default=None,
                   help="Charge the estimation of estimation='causal_chunks' with this chunk (default: each "
                   "document's last queries); a packed row is charged as one sequence (an upper bound).")
    add_checkpointing_argument(p)
    p.add_argument("--seed", type=at_least(0), default=0, help="Seed of the synthetic layouts and packed rows.")
    p.add_argument("--json", default=None,
                   help="Output file (default: simulate-cluster_<model>_<cluster>[_<mix>].json in the results folder: "
                   "the current directory, benchmarks/results for benchmarks/simulate_cluster.py; a missing folder is "
                   "created).")
    p.add_argument("--png", default=None, help="Plot file (default: next to the JSON, when matplotlib is installed; a "
                   "missing folder is created).")
    return p


def parse_args(argv=None, prog: str | None = None) -> argparse.Namespace:
    """The command's arguments, every one checked before anything prints or runs: a refusal is argparse's (the
    usage, 'PROG: error: MESSAGE', exit status 2)."""
    p = build_parser(prog)
    args = p.parse_args(argv)
    if args.config is not None:  # (the preset default is not the model: the report's arguments said qwen2.5-3b)
        args.model = None
    args.configs = args.configs or (list(CONFIGURATIONS) if args.all else list(DEFAULT_CONFIGS))
    args.mtraining = args.all if args.mtraining is None else args.mtraining
    if not args.mtraining and all(CONFIGURATIONS[name].kind != "sparse" for name in args.configs):
        for flag, value in (("--sparse-kernels", args.sparse_kernels and " ".join(args.sparse_kernels)),
                            ("--density", args.density), ("--kept-curve", args.kept_curve)):
            if value is not None:  # (read by the sparse rows alone: the table would not change)
                p.error(f"{flag} {value} would not be read: --configs {' '.join(map(repr, args.configs))} has no "
                        f"sparse configuration; add one (e.g. --configs 'dense ring' 'striped sparse'), or drop "
                        f"{flag}.")
    args.sparse_kernels = tuple(dict.fromkeys(args.sparse_kernels or (SPARSE_KERNELS if args.all else ("ours",))))
    _check_lengths(p, args.seq, args.layout_heads)
    for cp in args.cp:  # (the mode's refusals, named before any simulation)
        try:
            cp_layout(args, cp)
        except ValueError as e:
            p.error(f"--cp {cp}: {e}")
    unread = "--density" if args.density is not None else "--mix" if args.mix is not None else None
    if args.kept_curve and unread:  # a file named and never read would be silently ignored
        p.error(f"--kept-curve {args.kept_curve} would not be read: "
                + ("--density gives the kept fraction at every length" if unread == "--density" else
                   f"--mix {args.mix} packs rows whose documents keep what their own patterns select")
                + f"; drop {unread} to take the shares from the curve, or drop --kept-curve.")
    if args.kept_curve:
        try:
            _read_curve(args.kept_curve).at(max(args.seq))
        except ValueError as e:  # (KeptCurve.from_report names the file and the entry)
            p.error(f"--kept-curve {args.kept_curve}: {e}")
    try:
        model = model_shape(args, MODELS)
    except ValueError as e:  # (a --config it cannot read, naming the file and the field)
        p.error(str(e))
    beyond = [seq for seq in args.seq if seq > (model.max_positions or seq)]
    if beyond:  # (its forward refuses them whatever the time)
        p.error(f"--seq {beyond[0]}: {model_name(args)} takes at most {model.max_positions:,} tokens (its learned "
                "position embeddings); give lengths up to that, or a model whose positions are computed (RoPE).")
    if args.dense_first_layers > model.layers:  # (predict_step refuses it, as a traceback, after the first rows)
        p.error(f"--dense-first-layers {args.dense_first_layers}: {model_name(args)} has {model.layers} layers; give "
                f"at most {model.layers} (all of them dense).")
    refuse_group_settings_without_cp(args, p, args.cp)  # (as training refuses them at CP 1, and memory)
    for cp in args.cp:  # (the model's heads bound the head groups)
        try:
            HeadSplit(model.heads, model.kv_heads, cp_layout(args, cp)[1])
        except ValueError as e:
            p.error(f"--cp {cp} --cp_mode {args.cp_mode}: {e}")
    try:
        if args.png:  # (a plot asked for by name: refused before minutes of simulation, not after)
            require_matplotlib()
            _check_image_format(args.png)
        for flag, path in (("--json", args.json), ("--png", args.png)):
            if path:
                check_output_file(path, flag)
    except (ImportError, ValueError) as e:
        p.error(str(e))
    return args


def _check_image_format(path: str) -> None:
    """ValueError naming the fix unless `path` ends in an image format matplotlib writes (another suffix failed in
    matplotlib after the simulation; none wrote `path`.png while the command named `path`)."""
    from matplotlib.backend_bases import FigureCanvasBase

    suffix = Path(path).suffix
    formats = FigureCanvasBase.get_supported_filetypes()
    if suffix[1:].lower() not in formats:
        named = "no suffix names its image format" if not suffix else \
            f"{suffix!r} is no image format matplotlib writes"
        raise ValueError(f"--png {path}: {named}; give a file ending in .png, .pdf or .svg (or another of "
                         f"{', '.join(sorted(formats))}).")


def peak_bytes(seq: int, layout_heads: int) -> float:
    """The memory the command needs to simulate one sequence of `seq` tokens (`PEAK_BYTES_PER_BLOCK_PAIR`)."""
    per_pair = max(PEAK_BYTES_PER_BLOCK_PAIR, PEAK_BYTES_PER_BLOCK_PAIR_AND_HEAD * layout_heads)
    blocks = -(-seq // BLOCK)
    return per_pair * blocks * blocks


def _machine_memory() -> int | None:
    """This machine's physical memory in bytes (None where the system does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def _check_lengths(parser: argparse.ArgumentParser, seqs: list[int], layout_heads: int) -> None:
    """Refuse, naming the limit, a length whose layouts need more memory than this machine has (the layouts of a
    sequence hold every pair of its blocks: a length past the limit would fail allocating them)."""
    memory = _machine_memory()
    too_long = [s for s in seqs if memory is not None and peak_bytes(s, layout_heads) > memory]
    if too_long:
        per_pair = peak_bytes(BLOCK, layout_heads)
        longest = math.isqrt(int(memory / per_pair)) * BLOCK
        parser.error(f"--seq {too_long[0]}: simulating it holds its layouts of ({too_long[0]} / {BLOCK})^2 block "
                     f"pairs, about {peak_bytes(too_long[0], layout_heads) / 1e9:,.0f} GB, and this machine has "
                     f"{memory / 1e9:,.0f} GB: the longest length it simulates (--layout-heads {layout_heads}) is "
                     f"about {longest:,} tokens; give --seq at most that.")


def kept_target(args, seq: int) -> KeptAt:
    """The kept fraction the sparse layout of one sequence of `seq` tokens is drawn with, and where it comes from."""
    if args.density is not None:
        return KeptAt(seq, args.density, 1.0, "given", "--density")
    return (_read_curve(args.kept_curve) if args.kept_curve else DEFAULT_CURVE).at(seq)


@functools.lru_cache(maxsize=4)
def _read_curve(path: str) -> KeptCurve:
    return KeptCurve.from_report(path)


def sequence_workload(args, seq: int) -> Workload:
    """One sequence of `seq` tokens: the causal layout, and a random vertical-slash one (see the module docstring),
    each drawn once over the sequence's own blocks and padded to every split's grid (`row_layouts`)."""
    density = kept_target(args, seq).kept
    meta = TokenMeta.contiguous(1, seq)

    def build(kind: str, plan, window: int | None) -> object:
        if not plan.keeps_order:
            raise ValueError("one sequence keeps its order under every split of it.")
        return dense_layout(meta.pad_to(plan.padded_len), BLOCK, window) if kind == "dense" else \
            random_vertical_slash_layout(1, args.layout_heads, seq, BLOCK, num_diagonals=round(density * seq // BLOCK),
                                         num_verticals=args.verticals, sink_tokens=args.sink,
                                         diagonal_spread=args.spread, padded_len=plan.padded_len,
                                         generator=torch.Generator().manual_seed(args.seed))

    return Workload((seq,), ("sparse",), row_layouts(seq, BLOCK, build))


def realized_kept(workload: Workload, seq: int) -> float:
    """The kept fraction of the sparse layout of `workload` (`sequence_workload`'s of `seq` tokens), the table's kept:
    the target's diagonals (`kept_target`) with the verticals and sink tokens on top. The layout is the one the rows
    then read from the workload's cache, over the sequence's own blocks (a split's padding blocks list nothing)."""
    plan = ShardPlan("striped", 1, BLOCK, seq)  # (no split's padding: the sequence's own blocks)
    return float(workload.layout("sparse", plan).kept_fraction())


def packed_workload(mix: str, seq: int, seed: int) -> Workload:
    """A row of `seq` tokens packing documents of `mix` with cp_packing's per-document patterns (the block shardings
    share the row's, padded to their grids: `row_layouts`)."""
    cfg = SparseAttentionConfig(block_size=BLOCK)
    lengths = mix_lengths(mix, seq, seed)
    meta = row_meta(lengths)
    scores = document_scores(lengths, seed)
    runs, kinds = row_runs(meta, cfg)

    def build(kind: str, plan, window: int | None) -> object:
        return dense_layout(plan.global_meta(meta), BLOCK, window) if kind == "dense" else \
            packed_layout(plan, meta, cfg, scores)[0]

    return Workload(tuple(runs), tuple(kinds), row_layouts(seq, BLOCK, build), kept_blocks_per_row(cfg))


def workload_for(args, seq: int, model: ModelShape) -> Workload:
    """The row of `seq` tokens to simulate; its document planner weighs `model`'s linear layers as training does
    (`planner_weights`)."""
    workload = sequence_workload(args, seq) if args.mix is None else packed_workload(args.mix, seq, args.seed)
    return replace(workload, planner_costs=PlannerCosts(linear_per_token=linear_weight(model.linear_flop_pairs)))


def simulate(args, model_name: str, model: ModelShape, cluster: Cluster, hardware_of,
             workloads: Iterable[tuple[int, Workload]], cps: list[int], configs: list[str], dense_kernel: str,
             kernels: tuple[str, ...] = ("ours",)) -> list[dict]:
    """The predicted rows, printed as they come: each sparse configuration with each of `kernels` (keys of
    `SPARSE_KERNELS`; 'block-only' rows are bounds, labelled so), the dense ring with `dense_kernel`. workloads:
    (length, `workload_for` its row) per length, in order; an iterator that lets each go (`_handed_over`) frees its
    layouts, the command's memory, once its rows are done."""
    hardware = {k: hardware_of(dense_kernel=dense_kernel, sparse_kernel=k) for k in kernels}
    windows = {w for w in model.windows if w is not None}  # (a config's sliding layers share its sliding_window)
    if len(windows) > 1:
        raise ValueError(f"{model_name}: sliding windows of {sorted(windows)} tokens; the simulator charges one "
                         "window's layout: give one sliding_window.")
    window = next(iter(windows), None)
    rows = []
    for seq, workload in workloads:
        target = kept_target(args, seq) if args.mix is None else None
        for cp in cps:
            base = None
            mode, head_size = cp_layout(args, cp)
            for name in configs:
                setup = CONFIGURATIONS[name](workload, cp, BLOCK, cluster.gpus_per_node)
                in_mode = setup.sparse and head_size > 1  # (the dense ring stays every mode's baseline)
                if in_mode:
                    try:
                        setup = head_group_setup(workload, cp, mode, head_size, "sparse",
                                                 getattr(setup.plan, "sharding", "document"),
                                                 hierarchical=setup.topology.num_nodes > 1)
                    except ValueError as e:
                        print(f"{seq:>8} {cp:>3}  {name:<28}skipped under --cp_mode {mode.name}: {e}", flush=True)
                        continue
                counts = ring_counts(setup, model) if not in_mode else None
                dense = with_causal_layout(setup, workload.layout("dense", setup.plan)) \
                    if setup.sparse and args.dense_first_layers else None
                sliding = with_causal_layout(setup, workload.layout("dense", setup.plan, window)) if window else None
                for kernel, hw in hardware.items():
                    if not setup.sparse and kernel != kernels[0]:  # (the dense ring's row, once)
                        continue
                    if in_mode:
                        r = predict_head_parallel_step(setup, model, hw, cluster, head_size=head_size,
                                                       estimation=_estimation(args),
                                                       dense_layers=args.dense_first_layers, dense=dense,
                                                       sliding=sliding, recompute=checkpointed(args, seq))
                    else:
                        r = predict_step(setup, model, hw, cluster, estimation_chunk=args.estimation_chunk,
                                         counts=counts, dense_layers=args.dense_first_layers, dense=dense,
                                         sliding=sliding, recompute=checkpointed(args, seq))
                    r.update(mode=mode.name if in_mode else "ring", head_size=head_size if in_mode else 1)
                    if target is not None and setup.sparse:
                        r.update(kept_target=target.kept, kept_basis=target.basis, kept_source=target.source)
                    r.update(model=model_name, cluster=cluster.name, seq=seq, cp=cp, config=name,
                             gradient_checkpointing=checkpointed(args, seq),
                             kernel=kernel if setup.sparse else dense_kernel,
                             bound=setup.sparse and kernel in BOUND_KERNELS,
                             mix=args.mix or "one sequence",
                             documents=len(workload.lengths), local_blocks=[int(b.numel()) for b in
                                                                           setup.plan.rank_blocks])
                    if not setup.sparse:
                        base = r["step_s"]
                    r["speedup_vs_dense_ring"] = base / r["step_s"] if base else None
                    rows.append(r)
                    print(format_row(r), flush=True)
    return rows


def head_group_setup(workload: Workload, cp: int, mode: CPMode, head_size: int, kind: str, sharding: str, *,
                     hierarchical: bool = False) -> RingSetup:
    """The split `mode` runs with head groups of `head_size` GPUs (`head_parallel_setup`: `sharding` over the ring
    across the head groups, each shard cut into one piece per GPU of a group) over the workload's `kind` layout;
    ValueError naming why the mode cannot run it (the sharding, as training refuses it, or a hierarchical ring,
    which the ring across head groups is not costed as)."""
    if hierarchical:
        raise ValueError("the ring across head groups is costed as a flat ring; predict the flat configuration")
    mode.check_sharding(sharding)
    return head_parallel_setup(workload, cp, head_size, BLOCK, kind, sharding)


def _estimation(args) -> SparseAttentionConfig | None:
    """The pattern whose estimation is charged: the defaults, or causal chunks of --estimation-chunk."""
    if args.estimation_chunk is None:
        return None
    return SparseAttentionConfig(estimation="causal_chunks", estimation_chunk=args.estimation_chunk)


HEADER = (f"{'S':>8} {'CP':>3}  {'configuration':<28}{'kernel':<18}{'kept':>6} {'step s':>8} {'tok/s':>9} "
          f"{'speedup':>8} {'comm':>6} {'limit':>6}")
BOUND_NOTE = ("rows marked 'bound': FlexAttention's per-block cost alone, what a sparse kernel without per-row "
              "overhead could reach; an optimistic bound, not a prediction of a kernel that exists")


def row_label(r: dict) -> str:
    """The row's configuration, with the CP mode and head-group size where it has head groups."""
    return r["config"] if r.get("head_size", 1) == 1 else f"{r['config']} / {r['mode']} h{r['head_size']}"


def format_row(r: dict) -> str:
    speed = f"{r['speedup_vs_dense_ring']:.2f}x" if r["speedup_vs_dense_ring"] else "-"
    kernel = f"{r['kernel']} (bound)" if r.get("bound") else r["kernel"]
    # (a label with its mode and head-group size may be wider than its column: a space keeps it off the kernel)
    return (f"{r['seq']:>8} {r['cp']:>3}  {row_label(r):<27} {kernel:<18}{r['kept']:>6.3f} {r['step_s']:>8.2f} "
            f"{r['tokens_per_s']:>9.0f} {speed:>8} {r['comm_share']:>6.1%} {'comm' if r['comm_bound'] else '':>6}")


def comm_bound_from(rows: list[dict]) -> dict:
    """Per (configuration, kernel, S): the smallest CP size whose ring is communication-bound (None: none)."""
    out: dict = {}
    for r in rows:
        key = f"{row_label(r)} / {r['kernel']} / {r['seq']}"
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
            style = {"ours": "-", "flex": ":"}.get(kernel, "--")
            label = f"{row_label(sel[0])} ({kernel}{', bound' if kernel in BOUND_KERNELS else ''})"
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
    args = parse_args(argv, prog)  # (every refusal, before anything prints)
    targets = [kept_target(args, seq) for seq in args.seq]
    name, model = model_name(args), model_shape(args, MODELS)
    workloads = [(seq, workload_for(args, seq, model)) for seq in args.seq]  # (their layouts drawn once, as read)
    cluster, hardware_of = cluster_of(args)
    if args.mix is None:
        print(f"{name} on {cluster.name}; sparse layouts ({args.layout_heads} layout heads): diagonals for the target "
              f"kept fraction of the causal blocks, {args.verticals} verticals + {args.sink} sink tokens on top (the "
              "realized fraction, the table's kept)")
        for t, (seq, workload) in zip(targets, workloads, strict=True):  # (the realized one: the rows' layout)
            print(f"  {seq} tokens: kept target {t.kept:.3f}, realized {realized_kept(workload, seq):.3f}; "
                  f"layout width {t.width_share:.3f} of the rows ({t.basis}; {t.source})")
        print(f"first {args.dense_first_layers} layer(s) dense; PREDICTED")
    else:
        print(f"{name} on {cluster.name}; rows packed with the {args.mix} mix (seed {args.seed}), "
              "per-document patterns at the default budgets; PREDICTED")
    if args.estimation_chunk:
        print(f"estimation: causal chunks of {args.estimation_chunk} tokens (estimation='causal_chunks')")
    layouts = {cp: cp_layout(args, cp) for cp in args.cp}
    print(f"CP mode {args.cp_mode}: " + "; ".join(
        f"CP {cp} runs {mode.name}" + (f" (heads over {h} GPUs" + (f", a ring of {cp // h} across them)" if h < cp
                                                                  else ")") if h > 1 else "")
        for cp, (mode, h) in layouts.items()) + "; the dense ring is every mode's baseline")
    kernels = args.sparse_kernels
    if set(kernels) & set(BOUND_KERNELS):
        print(BOUND_NOTE)
    print(HEADER)
    rows = simulate(args, name, model, cluster, hardware_of, _handed_over(workloads), args.cp, args.configs,
                    args.dense_kernel, kernels)
    if not args.all:
        print("(the rows asked for; --all: every configuration, every sparse kernel's cost and MTraining's setting)")
    hw = hardware_of(dense_kernel=args.dense_kernel, sparse_kernel=kernels[0])
    report = {
        "what": "predicted training-step time (simulation, not a measurement) of one sequence per CP group",
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine_that_simulated": environment(),
        "args": vars(args),
        "model": vars(model),
        "cluster": {"name": cluster.name, "gpus_per_node": cluster.gpus_per_node,
                    "intra": vars(cluster.intra), "inter": vars(cluster.inter), "overlap": cluster.overlap},
        "calibration": {"sources": hw.sources, "sparse_fwd": vars(hw.sparse_fwd), "sparse_bwd": vars(hw.sparse_bwd),
                        "dense_fwd": vars(hw.dense_fwd), "dense_bwd": vars(hw.dense_bwd),
                        "linear_flops_per_s": hw.linear_flops_per_s},
        "assumptions": ASSUMPTIONS,
        "rows": rows,
        "comm_bound_from_cp": comm_bound_from(rows),
    }
    if args.mtraining:
        m = MTRAINING
        print(f"\nMTraining's setting: {m['model']}, {m['seq'] // 1024}K, {m['cp']} GPUs of {m['cluster']}")
        print(HEADER)
        mt = []
        for dense_kernel in ("fa2", "cudnn"):
            mt_args = argparse.Namespace(**{**vars(args), "mix": None, "density": args.density or m["density"]})
            mt += simulate(mt_args, m["model"], MODELS[m["model"]], CLUSTERS[m["cluster"]], HARDWARE[m["cluster"]],
                           [(m["seq"], workload_for(mt_args, m["seq"], MODELS[m["model"]]))], [m["cp"]],
                           list(CONFIGURATIONS), dense_kernel, tuple(SPARSE_KERNELS))
        report["mtraining"] = {**m, "rows": mt}
    cluster_tag = args.cluster + ("_custom" if custom_parts(args) else "")
    file_name = f"simulate-cluster_{name}_{cluster_tag}" + (f"_{args.mix}" if args.mix else "") + ".json"
    out = Path(args.json) if args.json else (results or Path.cwd()) / file_name
    write_output(out, json.dumps(report, indent=1) + "\n")
    try:
        require_matplotlib()
    except ImportError:  # (only the default plot gets here: the JSON holds every row it would draw)
        print(f"wrote {out} (no plot: drawing it needs matplotlib, {PLOT_EXTRA})")
        return report
    png = Path(args.png) if args.png else out.with_suffix(".png")
    png.parent.mkdir(parents=True, exist_ok=True)
    plot(rows, png, f"{name} on {cluster.name}" + (f", rows packed with the {args.mix} mix" if args.mix else ""))
    print(f"wrote {out} and {png}")
    return report


def _handed_over(items: list) -> Iterator:
    """`items`' entries in order, each removed from the list as it is handed over (so that the list holds no
    simulated length's layouts past its rows)."""
    while items:
        yield items.pop(0)


ASSUMPTIONS = [
    "one sequence per CP group per step; tokens/s = sequence length / step time",
    "gradient checkpointing from --gradient-checkpointing-min-length on (training's threshold; each row's "
    "gradient_checkpointing): each layer's forward (estimation + ring) runs twice; shorter sequences run it once",
    "the dense ring: zigzag sharding, causal layout, no estimation, dense kernel costs",
    "sparse layouts are synthetic vertical-slash layouts of one density for every sparse layer (MTraining's grows "
    "with depth), that density the measured kept-fraction curve's at each length (kept_basis: measured, interpolated "
    "or extrapolated) unless --density gives one; layout-heads heads stand for all heads (work scaled, bytes from "
    "their union)",
    "the first --dense-first-layers layers run the ring over the causal layout with the same kernel, no estimation",
    "compute per ring step = linear cost model of its work (per row, per block pair; the key columns' pairs at the "
    "block pairs' cost), calibrated on H100 measurements of the sparse kernel of the row (ours or FlexAttention) and "
    "of cuDNN / FA2 at head_dim 128, scaled by head_dim; no kernel launch gaps",
    "transfers: latency + bytes / bandwidth per link, NVLink inside a node and InfiniBand across; a rank's sends of "
    "one slot on one kind of link go one after the other; receivers' links and collectives do not contend",
    "ring collectives (all-gather, all-reduce) at the slowest link of the group",
    "not modelled: FSDP / data-parallel traffic, the optimizer step, memory limits",
]


if __name__ == "__main__":
    main(sys.argv[1:])
