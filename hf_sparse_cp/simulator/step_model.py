"""Training-step time of a model under context parallelism: model shapes, hardware calibrated from
measurements, cluster presets, and `predict_step`, which adds the layers' other work to the ring
of `simulate.py`.

Per layer and CP rank: linear layers over the rank's own tokens (forward, backward and, with gradient
checkpointing, a second forward), the layout estimation of sparse configurations (scoring of the last
`last_q` queries against the rank's keys, three small all-reduces, the slash sums' reduce-scatter and
the candidates' all-gather, the index build), and ring attention forward (twice with gradient
checkpointing) and backward. The estimation's collectives are where the ranks meet; between them each
rank runs its ring and its linear layers in order (`layer_time`), so a split that gives one rank more
tokens and less attention than another is charged as it runs, not as the busiest rank's tokens plus
the busiest rank's attention. A step is the layers plus the LM head, one sequence per CP group. Not
modelled: data-parallel / FSDP traffic (it overlaps the layers' compute), the optimizer step, and
kernel launch gaps.

Every number below is a measurement or a published figure, with its source in `sources`; the
A100 figures are the H100 measurements scaled by the ratio of the datasheets' dense BF16 peaks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch

from ..config import SparseAttentionConfig
from .shapes import MODELS, ModelShape
from .simulate import (
    Cluster,
    KernelCosts,
    Link,
    PlanWork,
    RingSetup,
    all_gather_time,
    all_reduce_time,
    plan_work,
    simulate_ring,
)
from .traffic import PlanTraffic, plan_traffic

ANCHORS = "/work/shared/research/anchors.md"


@dataclass(frozen=True)
class Hardware:
    """Per-unit costs of one GPU kind, per model head at `head_dim` and blocks of `block_size`
    (block costs scale with the model's head_dim; other block sizes are refused)."""

    name: str
    sparse_fwd: KernelCosts
    sparse_bwd: KernelCosts
    dense_fwd: KernelCosts
    dense_bwd: KernelCosts
    linear_flops_per_s: float
    attention_flops_per_s: float  # dense attention forward, for the estimation's scoring
    index_build_s: float  # per layer
    head_dim: int = 128
    block_size: int = 128
    sources: dict = field(default_factory=dict, compare=False)

    def scaled(self, name: str, factor: float, source: str) -> Hardware:
        """The same kernels on a GPU `factor` times as fast (costs / factor, rates x factor)."""
        def k(c: KernelCosts) -> KernelCosts:
            return KernelCosts(c.call / factor, c.row / factor, c.block / factor, c.slot / factor)
        return replace(self, name=name, sparse_fwd=k(self.sparse_fwd), sparse_bwd=k(self.sparse_bwd),
                       dense_fwd=k(self.dense_fwd), dense_bwd=k(self.dense_bwd),
                       linear_flops_per_s=self.linear_flops_per_s * factor,
                       attention_flops_per_s=self.attention_flops_per_s * factor,
                       index_build_s=self.index_build_s / factor,
                       sources={**self.sources, "scaling": source})


# anchors.md (measured): one H100 80GB, bf16, B=1, 16 query heads, 2 KV heads, head_dim 128, blocks of 128,
# causal; (S, density, fwd ms, fwd+bwd ms). FlexAttention on block layouts; SDPA cuDNN dense.
H100_FLEX = [(32768, 0.10, 1.14, 10.8), (32768, 0.05, 0.65, 9.7), (65536, 0.10, 4.2, 26.3), (65536, 0.05, 2.3, 21.1),
             (131072, 0.20, 33.6, 129.5), (131072, 0.10, 17.2, 75.3), (131072, 0.05, 9.0, 54.2)]
H100_DENSE = {"cudnn": [(32768, 1.0, 7.1, 28.6), (65536, 1.0, 28.3, 110.8), (131072, 1.0, 128.1, 464.9)],
              "fa2": [(32768, 1.0, 12.8, 46.7), (65536, 1.0, 49.6, 187.4), (131072, 1.0, 221.9, 762.3)]}
# Our kernels (bench_attention's `ours`: the Triton forward, dq and dk/dv kernels over vertical-slash layouts of 1000
# key columns), measured on one H100 80GB at the shapes above: (S, computed pairs over the causal pairs, fwd+bwd ms).
# The run timed fwd+bwd only; the forward's share is the H200's (same SM count and clocks, one 128K layout, each
# kernel timed alone by the tiles stage: forward 13.02 ms, backward 33.06 ms).
OURS_RESULTS = ("benchmarks/results/attention_nvidia-h100-80gb-hbm3_20261127-120941.json",
                "benchmarks/results/tiles_nvidia-h200_20261204-165514.json")
H100_OURS_FWD_BWD = [(32768, 0.0492, 6.21), (32768, 0.2014, 13.04), (32768, 1.0, 44.31), (131072, 0.0504, 43.76),
                     (131072, 0.2003, 150.05), (131072, 1.0, 684.08)]
OURS_FORWARD_SHARE = 13.02 / (13.02 + 33.06)
H100_OURS = [(s, d, t * OURS_FORWARD_SHARE, t) for s, d, t in H100_OURS_FWD_BWD]
# The sparse kernels a sparse ring can be priced with: rows of measurements, and whether their per-row cost is kept
# (False: FlexAttention's per-block cost alone, a bound for a kernel without per-row overhead, not a measurement).
SPARSE_KERNELS = {"ours": (H100_OURS, True), "flex": (H100_FLEX, True), "block-only": (H100_FLEX, False)}
BOUND_KERNELS = ("block-only",)
_SPARSE_SOURCES = {
    "ours": f"{OURS_RESULTS[0]}: our kernels (`ours`) on vertical-slash layouts, H100, S 32K-128K, 5%-100% of the "
            f"causal pairs computed (measured, fwd+bwd); forward share {OURS_FORWARD_SHARE:.3f} from {OURS_RESULTS[1]} "
            "(H200, measured)",
    "flex": f"{ANCHORS}: FlexAttention on block layouts, H100, S 32K-128K, density 0.05-0.20 (measured)",
}
_SPARSE_SOURCES["block-only"] = _SPARSE_SOURCES["flex"]
# anchors.md (measured): Qwen2.5 shapes, liger-kernel, gradient checkpointing, sdpa, one sequence: (S, step s).
H100_LIGER = {"qwen2.5-0.5b": [(32768, 0.78), (65536, 2.45), (131072, 8.75), (262144, 34.3)],
              "qwen2.5-1.5b": [(32768, 1.46), (65536, 4.34), (131072, 15.0), (262144, 55.7)]}
_HEADS, _BS = 16, 128


def _units(s: int, density: float) -> tuple[float, float]:
    """(query-block rows, block pairs) per head of a causal layout keeping `density` of its blocks."""
    nb = s // _BS
    return nb, density * nb * (nb + 1) / 2


def least_squares(x: list[list[float]], y: list[float]) -> list[float]:
    """The coefficients c minimising |x c - y| (x: rows of a few columns, of full column rank), by a QR factorisation
    (modified Gram-Schmidt) in Python floats: the same bits on every run, where LAPACK's least squares (torch.linalg
    .lstsq) gave fits differing in their last digits from one run of the same command to the next."""
    columns = [[row[j] for row in x] for j in range(len(x[0]))]
    q, r = [], [[0.0] * len(columns) for _ in columns]
    for j, column in enumerate(columns):
        v = list(column)
        for i, qi in enumerate(q):
            r[i][j] = sum(a * b for a, b in zip(qi, v))
            v = [a - r[i][j] * b for a, b in zip(v, qi)]
        r[j][j] = math.sqrt(sum(a * a for a in v))
        q.append([a / r[j][j] for a in v])
    qty = [sum(a * b for a, b in zip(qi, y)) for qi in q]
    coef = [0.0] * len(columns)
    for j in reversed(range(len(columns))):
        coef[j] = (qty[j] - sum(r[j][k] * coef[k] for k in range(j + 1, len(columns)))) / r[j][j]
    return coef


def _worst_error(x: list[list[float]], coef: list[float], y: list[float]) -> float:
    """The largest relative error of the fit `coef` over the rows."""
    return max(abs(sum(a * c for a, c in zip(row, coef)) - t) / abs(t) for row, t in zip(x, y))


def fit_kernel(rows: list[tuple], *, with_rows: bool) -> tuple[KernelCosts, KernelCosts, float]:
    """Least-squares per-head costs (forward, backward) from (S, density, fwd ms, fwd+bwd ms) rows;
    the worst relative error of the fit over the rows."""
    x = [[unit * _HEADS for unit in _units(s, d)][0 if with_rows else 1:] for s, d, _, _ in rows]
    fwd = [f * 1e-3 for _, _, f, _ in rows]
    bwd = [(t - f) * 1e-3 for _, _, f, t in rows]
    costs, worst = [], 0.0
    for y in (fwd, bwd):
        coef = least_squares(x, y)
        worst = max(worst, _worst_error(x, coef, y))
        row, block = (coef[0], coef[1]) if with_rows else (0.0, coef[0])
        costs.append(KernelCosts(row=row, block=block))
    return costs[0], costs[1], worst


def fit_linear(model: ModelShape, steps: list[tuple[int, float]]) -> tuple[float, float]:
    """(FLOP/s of the non-attention work, worst relative error): step = a S + c S^2 fitted by least
    squares, a read as the linear layers and LM head at one rate (gradient checkpointing on)."""
    x = [[float(s), float(s) * s] for s, _ in steps]
    y = [float(t) for _, t in steps]
    coef = least_squares(x, y)
    per_layer, head = model.linear_flops(recompute=True)
    rate = (model.layers * per_layer + head) / coef[0]
    return rate, _worst_error(x, coef, y)


def h100(*, dense_kernel: str = "cudnn", sparse_kernel: str = "ours") -> Hardware:
    """The H100 calibration from measurements (see `sources` for each figure and its fit error).

    dense_kernel: the dense ring's kernel, 'cudnn' (SDPA cuDNN, the fastest measured) or 'fa2'
    (SDPA flash, FlashAttention-2). sparse_kernel: what the sparse rings run (`SPARSE_KERNELS`): 'ours'
    (the plugin's kernels, as measured), 'flex' (FlexAttention on block layouts, as measured) or
    'block-only' (FlexAttention's per-block cost alone, what a sparse kernel without per-row overhead
    would reach: a bound, not a measurement of one)."""
    if sparse_kernel not in SPARSE_KERNELS:
        raise ValueError(f"sparse_kernel={sparse_kernel!r}: use one of {sorted(SPARSE_KERNELS)}.")
    rows, row_costs = SPARSE_KERNELS[sparse_kernel]
    sf, sb, s_err = fit_kernel(rows, with_rows=True)
    if not row_costs:
        sf, sb = replace(sf, row=0.0), replace(sb, row=0.0)
    df, db, d_err = fit_kernel(H100_DENSE[dense_kernel], with_rows=False)
    rates = {name: fit_linear(MODELS[name], steps) for name, steps in H100_LIGER.items()}
    linear = sum(r for r, _ in rates.values()) / len(rates)
    s, _, fwd_ms, _ = H100_DENSE["cudnn"][-1]
    attn_flops = 4 * s * s / 2 * _HEADS * 128 / (fwd_ms * 1e-3)
    return Hardware(
        "H100", sf, sb, df, db, linear, attn_flops, 1.1e-3,
        sources={
            "sparse attention": f"{_SPARSE_SOURCES[sparse_kernel]}; per-row + per-block least squares, worst error "
                                f"{s_err:.0%}" + ("" if row_costs else "; per-row cost dropped (bound)"),
            "dense attention": f"{ANCHORS}: SDPA {dense_kernel} causal, H100, S 32K-128K (measured); per-block "
                               f"least squares, worst error {d_err:.0%}",
            "linear layers": f"{ANCHORS}: liger-kernel training steps, Qwen2.5-0.5B/1.5B, S 32K-256K, H100 "
                             "(measured); step = a S + c S^2, a = linear layers + LM head; rates "
                             + ", ".join(f"{n} {r / 1e12:.0f} TFLOP/s (fit error {e:.0%})"
                                         for n, (r, e) in rates.items()) + ", mean used",
            "estimation scoring": f"{ANCHORS}: SDPA cuDNN causal forward at 128K, {attn_flops / 1e12:.0f} TFLOP/s",
            "index build": "MTraining (arXiv 2510.18830), reported: vertical-slash index build ~1.1 ms per layer",
        })


# Dense BF16 tensor peaks of the datasheets (TFLOP/s): what other GPUs' calibrations are scaled by.
PEAK_TFLOPS = {"H100": 989.4, "A100": 312.0}


def a100(**kwargs) -> Hardware:
    """The H100 calibration scaled to an A100 (arguments as for `h100`)."""
    return h100(**kwargs).scaled("A100", PEAK_TFLOPS["A100"] / PEAK_TFLOPS["H100"],
                                 "H100 figures x 312/989.4: dense BF16 tensor peak of the NVIDIA A100 SXM (312 "
                                 "TFLOP/s) and H100 SXM (989.4 TFLOP/s) datasheets; not measured on an A100")


_NVLINK_H100 = ("nccl-tests all_reduce busbw 460-480 GB/s on 8xH100 SXM5 NVLink "
                "(docs.alayanew.com/en/docs/tech-blog/2026-05-06-nccl-tests); lower end used")
_NVLINK_A100 = ("nccl-tests all_reduce busbw 230-250 GB/s on 8xA100 SXM4 NVLink "
                "(docs.alayanew.com/en/docs/tech-blog/2026-05-06-nccl-tests); lower end used")
_IB400 = ("NCCL all-reduce 44.1 GB/s (88% of 50 GB/s) on 400 Gb/s InfiniBand with GPUDirect RDMA, "
          "fridayswithfaraday.com/posts/nvidia-dynamo-network-optimization")
_IB200 = ("200 Gb/s HDR InfiniBand per GPU (DGX A100 datasheet) at the 88% efficiency measured on 400 Gb/s IB "
          "(fridayswithfaraday.com/posts/nvidia-dynamo-network-optimization): 22 GB/s; scaled, not measured")
_LAT = ("latency: NVSwitch ~1 us, InfiniBand same rack ~2 us "
        "(fridayswithfaraday.com/posts/nvidia-dynamo-network-optimization)")
CLUSTERS = {
    "8xH100-IB400": Cluster("8xH100-IB400", 8, Link(460e9, 1e-6, f"{_NVLINK_H100}; {_LAT}"),
                            Link(44.1e9, 2e-6, f"{_IB400}; {_LAT}")),
    "8xA100-IB200": Cluster("8xA100-IB200", 8, Link(230e9, 1e-6, f"{_NVLINK_A100}; {_LAT}"),
                            Link(22e9, 2e-6, f"{_IB200}; {_LAT}")),
}
HARDWARE = {"8xH100-IB400": h100, "8xA100-IB200": a100}


def ring_step_seconds(setup: RingSetup, model: ModelShape, hw: Hardware, work) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 [W, steps + 1] each: the compute of every ring step forward and backward, for `model`'s heads."""
    scale = model.head_dim / hw.head_dim
    fwd_costs, bwd_costs = (hw.sparse_fwd, hw.sparse_bwd) if setup.sparse else (hw.dense_fwd, hw.dense_bwd)
    return fwd_costs.time(work, model.heads) * scale, bwd_costs.time(work, model.heads) * scale


def ring_attention_time(setup: RingSetup, model: ModelShape, hw: Hardware, cluster: Cluster, work,
                        traffic) -> dict:
    """The ring's forward and backward (`RingTimeline` each, all ranks starting at 0) and their compute per
    step, for `model`'s heads."""
    fwd_s, bwd_s = ring_step_seconds(setup, model, hw, work)
    fwd = simulate_ring(fwd_s, traffic, setup.topology, cluster, backward=False)
    bwd = simulate_ring(bwd_s, traffic, setup.topology, cluster, backward=True)
    return {"fwd": fwd, "bwd": bwd, "fwd_s": fwd_s, "bwd_s": bwd_s}


def layer_time(setup: RingSetup, model: ModelShape, hw: Hardware, cluster: Cluster, work, traffic,
               linear: torch.Tensor, estimation: float, *, recompute: bool) -> tuple[float, float, dict]:
    """(forward seconds, backward seconds, the rings as `ring_attention_time`'s) of one layer, every rank with
    its own linear work.

    linear: float64 [W], seconds of the layer's matrix multiplications forward on each rank (its own tokens:
    a document split gives ranks different numbers). A sparse layer's estimation ends in collectives over
    the CP group, the one point where all ranks meet: from it each rank runs the ring, then the output
    projection and MLP and the next layer's query/key/value projections, so a rank with more tokens and less
    attention is as quick as one with fewer tokens and more attention (the ring's waits counted). The
    backward (recomputed forward, estimation included, then the MLP's backward, the ring's, the projections')
    likewise, each rank entering the backward ring when it gets there. Where nothing meets (no estimation:
    dense layers, or the backward without recompute) the layer is still charged from a common start: an
    upper bound."""
    before = model.qkv_params / model.active_params  # the share of a token's layer weights used before attention
    backward_linear = 2 * linear  # 4 FLOPs per weight backward, 2 forward
    fwd_s, bwd_s = ring_step_seconds(setup, model, hw, work)
    fwd = simulate_ring(fwd_s, traffic, setup.topology, cluster, backward=False)
    forward = estimation + float((fwd.end + linear).max())
    if recompute:  # the recomputed forward up to the MLP's backward, then the ring's backward
        start = fwd.end + (1 - before) * (linear + backward_linear)
        tail = before * (backward_linear + linear)  # the projections' backward, the layer below's recomputed ones
    else:
        start, tail = (1 - before) * backward_linear, before * backward_linear
    bwd = simulate_ring(bwd_s, traffic, setup.topology, cluster, backward=True, start=start)
    backward = (estimation if recompute else 0.0) + float((bwd.end + tail).max())
    return forward, backward, {"fwd": fwd, "bwd": bwd, "fwd_s": fwd_s, "bwd_s": bwd_s, "bwd_start": start}


def estimation_time(setup: RingSetup, model: ModelShape, hw: Hardware, cluster: Cluster,
                    cfg: SparseAttentionConfig) -> float:
    """One layer's layout estimation under CP (`estimation.py`) with the settings `cfg`: scoring (two
    passes over the rank's keys), three all-reduces (the scoring queries, row max, row sums), the
    reduce-scatter of the slash sums (each set's scored offsets; in 'mass' mode the block diagonals
    they are summed into), the all-gather of every rank's candidates (per set and head the best
    verticals and slashes a head can keep, as value and position, and its mass; in 'mass' mode every
    block diagonal the rank holds), the index build. With causal chunks a sequence of n chunks has
    n - 1 sets, each scored by its own queries over the keys before it: a key is scored by (n - 1) / 2
    sets on average (positions spread evenly over ranks), and every collective carries n - 1 sets.
    With `sample_groups` g, the group before cut i of g + 1 scores the keys before it: g / 2 x
    `sample_group_size` more scoring rows over the whole row."""
    budget, sc = cfg.budget, cfg.scoring
    if budget.far_blocks:
        raise ValueError(f"mass_near_blocks={budget.far_blocks} scores in PyTorch on CUDA, not in the Triton scoring "
                         "kernel whose rate the simulator charges, and that path was timed on no GPU: the simulator "
                         "cannot charge it. Simulate with mass_near_blocks=0 for the kernel's cost.")
    if not setup.sparse:
        return 0.0
    w, s, bs = setup.plan.cp_size, setup.plan.padded_len, setup.plan.block_size
    chunk = cfg.estimation_chunk if cfg.estimation == "causal_chunks" else None
    sets = 1 if chunk is None else max(1, -(-setup.plan.seq_len // chunk) - 1)
    keys = setup.plan.max_local_blocks * setup.plan.block_size  # the busiest rank's
    scored_keys = keys if chunk is None else keys * sets / 2
    rows = sc.last_q + sc.sample_groups * sc.sample_group_size / 2  # full-row equivalents
    score = 2 * 2 * rows * scored_keys * model.head_dim * model.heads / hw.attention_flops_per_s
    link = cluster.group_link(w)
    sent_rows = sc.last_q + sc.sample_groups * sc.sample_group_size  # every scoring query travels
    reduces = (model.heads * sent_rows * model.head_dim * 4, model.heads * sent_rows * 4, model.heads * sent_rows * 4)
    # the packed diagonals the budget ranks: each set's scored offsets (or the block diagonals they sum into)
    diagonals = (s if chunk is None else s * sets / 2) / budget.diagonal_step(bs)
    slash_sums = all_gather_time(model.heads * diagonals * 4 / w, w, link)  # a reduce-scatter: the same hops
    # candidates per set (the gather carries every set): what a rank offers of each set's columns and diagonals
    offered = [int(budget.offered(kind, torch.tensor(-(-int(held) // w)))) for kind, held in
               (("columns", s), ("diagonals", diagonals / sets))]
    gather = all_gather_time(model.heads * sets * (2 * sum(offered) + 2) * 4, w, link)
    local = (score + hw.index_build_s) * (WEIGHTED_ESTIMATION_RATIO if budget.weighted or sc.sample_groups else 1.0)
    return local + sum(all_reduce_time(n * sets, w, link) for n in reduces) + slash_sums + gather


_DEFAULTS = SparseAttentionConfig()
# Weighted estimation ('mass' mode or sample_groups: each scoring query's mass weighted by its stratum, and in
# 'mass' mode columns and block diagonals ranked together) over unweighted top-k, per call, with about the same
# scoring work: the defaults (mass_target 0.9, mass_threshold 0.0025, at most 1024 columns, 32 last queries and 4
# groups of 16) against top-k 512/1024 with 64 last queries, every layer of SmolLM2-135M at 8K, block 128, median
# of 90 interleaved calls each on a 2-core CPU (58.8 ms / 44.2 ms; benchmarks/results/
# pattern-frontier_cpu_8k_block128.json, estimation_cost; other runs gave 1.14x and 1.24x).
WEIGHTED_ESTIMATION_RATIO = 1.33


def ring_counts(setup: RingSetup, model: ModelShape) -> tuple[PlanWork, PlanTraffic]:
    """The ring's work and transfers for `model`'s K/V heads (bf16 K/V, fp32 dK/dV)."""
    return (plan_work(setup.layout, setup.plan, setup.topology),
            plan_traffic(setup.layout, setup.plan, setup.topology, kv_heads=model.kv_heads, head_dim=model.head_dim))


def dense_ring_counts(setup: RingSetup, dense: RingSetup | None, dense_layers: int,
                      model: ModelShape) -> tuple[int, tuple[PlanWork, PlanTraffic] | None]:
    """The global layers among the first `dense_layers` that a sparse `setup` keeps dense (none for a dense one; a
    sliding-window layer is `sliding_ring_counts`') and `ring_counts` of `dense`, the same split over the causal
    layout they run on; refuses a count outside the model or a missing `dense`."""
    if not 0 <= dense_layers <= model.layers:
        raise ValueError(f"dense_layers={dense_layers} must be within the model's 0-{model.layers} layers.")
    windows = model.windows or (None,) * model.layers
    dense_layers = sum(w is None for w in windows[:dense_layers]) if setup.sparse else 0
    if dense_layers and dense is None:
        raise ValueError("dense_layers needs `dense`: the same split over the causal layout (with_causal_layout).")
    return dense_layers, (ring_counts(dense, model) if dense_layers else None)


def sliding_ring_counts(sliding: RingSetup | None,
                        model: ModelShape) -> tuple[int, tuple[PlanWork, PlanTraffic] | None]:
    """The layers of `model` that attend within a sliding window (`ModelShape.windows`: they run dense, without
    estimation, over the window's blocks) and `ring_counts` of `sliding`, the same split over that layout; refuses
    a missing `sliding`."""
    layers = sum(w is not None for w in model.windows)
    if layers and sliding is None:
        raise ValueError(f"the model's {layers} sliding-window layers need `sliding`: the same split over the "
                         "window's layout (with_causal_layout).")
    return layers, (ring_counts(sliding, model) if layers else None)


def predict_step(setup: RingSetup, model: ModelShape, hw: Hardware, cluster: Cluster, *, recompute: bool = True,
                 last_q: int | None = None, estimation_chunk: int | None = None,
                 estimation: SparseAttentionConfig | None = None,
                 counts: tuple[PlanWork, PlanTraffic] | None = None, dense_layers: int = 0,
                 dense: RingSetup | None = None, sliding: RingSetup | None = None) -> dict:
    """Predicted seconds of one training step of `model` over one sequence split by `setup`.

    Returns a dict: step_s, tokens_per_s, per-layer seconds (layer_s, linear_s, estimation_s,
    attention forward / backward), comm_share (share of the step that free communication would
    save), comm_bound (the ring's transfers alone outlast its compute), the ring's per-step
    compute and transfer seconds of the forward pass, and the kept fraction of the layout.
    estimation: the pattern settings whose estimation is charged (default: `SparseAttentionConfig()`);
    last_q and estimation_chunk (`estimation="causal_chunks"` with that chunk) override its fields (the
    layout's work is the same: only the estimation's cost changes).
    counts: `ring_counts(setup, model)` when already computed (they depend on the plan, not on
    the hardware).
    dense_layers: the first layers a sparse setup keeps dense (`dense_first_layers`); under CP the plugin
    runs them through the same ring and kernels over the causal layout, without estimation: `dense` is
    that setup (`with_causal_layout`). The result adds their seconds and their share of the attention.
    sliding: the same split over the layout of the model's sliding window, which its sliding-window layers
    (`ModelShape.windows`) run dense without estimation, whatever `setup` runs (`sliding_ring_counts`)."""
    if setup.plan.block_size != hw.block_size:
        raise ValueError(f"the calibration is for blocks of {hw.block_size} tokens, the plan uses "
                         f"{setup.plan.block_size}: simulate with block_size={hw.block_size}.")
    work, traffic = ring_counts(setup, model) if counts is None else counts
    plan = setup.plan
    rank_tokens = torch.tensor([plan.blocks_of(r).numel() * plan.block_size for r in range(plan.cp_size)],
                               dtype=torch.float64)  # a split by documents gives ranks different numbers
    rank_linear = 2 * model.active_params * rank_tokens / hw.linear_flops_per_s  # one forward of a layer
    tokens = float(rank_tokens.max())
    per_layer_flops, head_flops = model.linear_flops(recompute=recompute)
    linear = per_layer_flops * tokens / hw.linear_flops_per_s  # reported: the busiest rank's
    head = head_flops * tokens / hw.linear_flops_per_s
    passes = 2 if recompute else 1
    cfg = _DEFAULTS if estimation is None else estimation
    if last_q is not None:
        cfg = cfg.replace(last_q=last_q)
    if estimation_chunk is not None:
        cfg = cfg.replace(estimation="causal_chunks", estimation_chunk=estimation_chunk)

    dense_layers, dense_counts = dense_ring_counts(setup, dense, dense_layers, model)
    sliding_layers, sliding_counts = sliding_ring_counts(sliding, model)

    def ring_seconds(att: dict, est: float) -> float:  # a layer's attention: estimation, rings from their start
        return passes * (est + att["fwd"].time) + float((att["bwd"].end - att["bwd_start"]).max())

    def step(c: Cluster) -> tuple[float, dict, float, float]:
        est = estimation_time(setup, model, hw, c, cfg)
        fwd, bwd, att = layer_time(setup, model, hw, c, work, traffic, rank_linear, est, recompute=recompute)
        dense_layer, dense_attention, sliding_layer = 0.0, 0.0, 0.0
        if dense_layers:
            d_fwd, d_bwd, d = layer_time(dense, model, hw, c, *dense_counts, rank_linear, 0.0, recompute=recompute)
            dense_layer, dense_attention = d_fwd + d_bwd, ring_seconds(d, 0.0)
        if sliding_layers:
            w_fwd, w_bwd, _ = layer_time(sliding, model, hw, c, *sliding_counts, rank_linear, 0.0,
                                         recompute=recompute)
            sliding_layer = w_fwd + w_bwd
        sparse_layers = model.layers - dense_layers - sliding_layers
        total = sparse_layers * (fwd + bwd) + dense_layers * dense_layer + sliding_layers * sliding_layer + head
        sparse_attention = ring_seconds(att, est)
        attention = dense_layers * dense_attention + sparse_layers * sparse_attention
        return total, att, est, dense_layers * dense_attention / attention if attention else 0.0

    total, att, est, dense_share = step(cluster)
    ideal = step(cluster.without_network())[0]
    fwd = att["fwd"]
    transfer_only = simulate_ring(torch.zeros_like(att["fwd_s"]), traffic, setup.topology, cluster,
                                  backward=False).time
    return {
        "step_s": total, "tokens_per_s": setup.plan.seq_len / total,
        "layer_s": (total - head) / model.layers, "linear_s": linear, "estimation_s": est,
        "attention_fwd_s": fwd.time, "attention_bwd_s": float((att["bwd"].end - att["bwd_start"]).max()),
        "lm_head_s": head,
        "comm_share": 1.0 - ideal / total, "comm_bound": transfer_only > float(fwd.compute.max()),
        "ring_step_compute_ms": [1e3 * float(x) for x in fwd.step_compute],
        "ring_step_transfer_ms": [1e3 * float(x) for x in fwd.step_transfer],
        "forward_bytes_per_rank": float(traffic.total(False).double().mean()),
        "kept": setup.kept_fraction(),
        "dense_layers": dense_layers, "dense_layers_attention_share": dense_share, "sliding_layers": sliding_layers,
    }


def with_causal_layout(setup: RingSetup, layout) -> RingSetup:
    """A sparse setup's split and ring over `layout`, the causal one of its rows: what its dense layers run."""
    return replace(setup, layout=layout)
