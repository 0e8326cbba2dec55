"""Validate the cluster simulator on this CPU: predicted vs measured ring attention over 2 and 4 gloo processes.

Calibration (on this CPU, in as many concurrent processes as the run it predicts):
* kernel costs in CPU seconds (thread time, which other jobs on this shared machine do not
  inflate): `attention_forward` (merging into a running out/lse, as the ring does) and
  `attention_backward` timed on random layouts of several shapes and densities
  (`random_layout`, independent of the validated layouts), least squares of
  call + row x rows + block x blocks + slot x padded (`KernelCosts`);
* the link: every process sends to the next and receives from the previous with batched
  isend/irecv (the ring's pattern) at sizes 16 KiB - 4 MiB; least squares of latency + bytes / bandwidth;
* the plan: `RingPlan` construction, which `ring_sparse_attention` does on every call, timed apart;
* the share of a core each process gets while the ring runs, measured during each measured call
  (the load of this machine changes within a call) from the scheduler statistics of the calling
  thread (`/proc/self/task/<tid>/schedstat`): seconds run / (seconds run + seconds waited,
  runnable, for a core that other jobs held). Each rank's compute costs are divided by its own
  share. A small matmul loop timed before and after each call is kept for comparison (`probe_share`).

Measurement: `ring_sparse_attention` forward + backward on each configuration, wall time and the
calling thread's CPU time (the slowest rank), with its system time and page faults. Calibration and
measurement alternate in rounds (this machine's 2 cores are shared with other jobs, so its speed
drifts); each round's measurement is predicted from that round's calibration, and the medians over
rounds are compared. Every process runs one torch thread (`run_gloo`), in calibration and ring alike.

Prediction: `plan_work` / `plan_traffic` of the same layout, `simulate_ring` forward and backward
with the calibrated costs, transfers not overlapping compute (gloo's transfers run on the same two
cores as the compute), plus the plan's construction; and, load-free, the CPU seconds of the
rank's compute (its kernels and the plan) against the calling thread's CPU time.

The allocator: the simulator costs a call by its work alone, as on a GPU, where kernels allocate
nothing and PyTorch's caching allocator recycles tensors. glibc's malloc instead hands every
allocation above its mmap threshold (at most 32 MiB) fresh pages from the kernel and returns them on
free, so the PyTorch reference's largest temporaries (64 MiB per chunk at 2K x 2K keys) page-fault on
every call: system time that grows faster than the work, and wall time beyond that on a loaded
machine. By default the gloo processes therefore run with glibc's allocator set to keep freed
memory (`GLIBC_TUNABLES`, `--allocator recycling`, the CPU analogue of the caching allocator);
`--allocator system` keeps glibc's defaults, and the JSON records every measured call's system time
and page faults either way.

    python benchmarks/validate_simulator_cpu.py            # ~10 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import threading
import time
from datetime import UTC, datetime
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from hf_sparse_cp.attention.build import dense_layout
from hf_sparse_cp.attention.ops import attention_backward, attention_forward
from hf_sparse_cp.attention.tokens import TokenMeta
from hf_sparse_cp.distributed import CPShard, ParallelDims, RingTopology, ShardPlan, ring_sparse_attention
from hf_sparse_cp.distributed.cp_config import ContextParallelConfig
from hf_sparse_cp.distributed.ring.plan import RingPlan
from hf_sparse_cp.env import environment
from hf_sparse_cp.simulator.simulate import Cluster, KernelCosts, Link, plan_work, simulate_ring
from hf_sparse_cp.simulator.traffic import plan_traffic
from hf_sparse_cp.simulator.workloads import random_vertical_slash_layout
from hf_sparse_cp.testing.benchmarking import ALLOCATORS, RECYCLING_MALLOC, spawned_allocator
from hf_sparse_cp.testing.layouts import random_layout
from hf_sparse_cp.testing.spawn import run_gloo

RESULTS = Path(__file__).resolve().parent / "results"
HQ, HKV, D, BS = 4, 2, 64, 64
# (name, sharding, ring shape as (nodes, ranks per node) or None for flat, layout kind)
CONFIGS = [("dense ring", "zigzag", None, "dense"), ("zigzag sparse", "zigzag", None, "sparse"),
           ("striped sparse", "striped", None, "sparse"), ("hierarchical striped sparse", "striped", (2, 2), "sparse")]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--world", type=int, nargs="+", default=[2, 4])
    p.add_argument("--rounds", type=int, default=4, help="rounds of calibration + measurement")
    p.add_argument("--repeats", type=int, default=2, help="timed repeats per round")
    p.add_argument("--allocator", choices=ALLOCATORS, default="recycling",
                   help="glibc malloc of the gloo processes: keeping freed memory, or its defaults")
    p.add_argument("--json", default=None, help="default: results/simulator-validation_cpu[_system-malloc].json")
    args = p.parse_args(argv)
    if args.json is None:
        suffix = "" if args.allocator == "recycling" else "_system-malloc"
        args.json = str(RESULTS / f"simulator-validation_cpu{suffix}.json")
    return args


def _layout(kind: str, seq: int) -> object:
    if kind == "dense":
        return dense_layout(TokenMeta.contiguous(1, seq), BS)
    nb = seq // BS
    return random_vertical_slash_layout(1, HQ, seq, BS, num_diagonals=max(1, nb // 10), num_verticals=64,
                                        sink_tokens=16, generator=torch.Generator().manual_seed(0))


def _thread_sys_faults() -> tuple[float, int]:
    """System seconds and minor page faults of the calling thread so far."""
    r = resource.getrusage(resource.RUSAGE_THREAD)
    return r.ru_stime, r.ru_minflt


def _median_time(fn, repeats: int, clock=time.perf_counter) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return statistics.median(times)


def _scheduled() -> tuple[float, float]:
    """Seconds the calling thread has run, and waited runnable for a core (Linux scheduler statistics)."""
    with open(f"/proc/self/task/{threading.get_native_id()}/schedstat") as f:
        run, wait = f.read().split()[:2]
    return int(run) * 1e-9, int(wait) * 1e-9


def _core_share() -> float:
    """The share of a core this process gets right now: CPU time over wall time of a fixed matmul loop."""
    a = torch.randn(192, 192)
    w0, c0 = time.perf_counter(), time.thread_time()
    for _ in range(60):
        a = torch.tanh(a @ a)
    return min(1.0, (time.thread_time() - c0) / (time.perf_counter() - w0))


def _features(layout) -> list[float]:
    """[calls, rows, blocks, padded] of one call (as `PlanWork` counts them; the layout has HQ heads)."""
    rows = float((layout.block_cnt > 0).sum() + ((layout.block_cnt == 0) & (layout.col_cnt > 0)).sum())
    blocks = float(layout.block_cnt.sum()) + float(layout.col_cnt.sum()) / BS
    width = layout.block_idx.shape[-1] + layout.col_idx.shape[-1] / BS
    return [1.0, rows, blocks, width * layout.block_cnt.numel()]


def _forward(q, k, v, layout, q_meta, k_meta, out, lse):
    return attention_forward(q, k, v, layout, scale=0.125, q_meta=q_meta, k_meta=k_meta, out=out.clone(),
                             lse=lse.clone(), implementation="reference")


def _backward(q, k, v, out, lse, dout, layout, q_meta, k_meta):
    return attention_backward(q, k, v, out, lse, dout, layout, scale=0.125, q_meta=q_meta, k_meta=k_meta,
                              implementation="reference")


def _calibrate(repeats: int) -> list[dict]:
    """Kernel timings on random layouts of the sizes of ring steps (1K and 2K local queries and
    keys): 3% to 100% of the blocks, causal (rows of every width up to the widest) or not, and one
    of columns only."""
    g = torch.Generator().manual_seed(1)
    samples = []
    for sq in (1024, 2048):
        for density, cols, causal in ((0.03, 0.0, False), (0.1, 0.0, False), (0.3, 0.0, False), (1.0, 0.0, False),
                                      (0.0, 0.02, False), (0.3, 0.0, True), (1.0, 0.0, True)):
            layout = random_layout(1, HQ, sq, sq, BS, density, cols, causal=causal, generator=g)
            q = torch.randn(1, HQ, sq, D, generator=g)
            k, v = (torch.randn(1, HKV, sq, D, generator=g) for _ in range(2))
            # queries after every key: all listed keys are visible
            qm = TokenMeta(torch.arange(sq, 2 * sq).view(1, -1), torch.zeros(1, sq, dtype=torch.int32))
            km = TokenMeta.contiguous(1, sq)
            out = torch.zeros(1, HQ, sq, D)
            lse = torch.full((1, HQ, sq), float("-inf"))
            fwd = _median_time(partial(_forward, q, k, v, layout, qm, km, out, lse), repeats, time.thread_time)
            o, lse_ = attention_forward(q, k, v, layout, scale=0.125, q_meta=qm, k_meta=km)
            dout = torch.randn(1, HQ, sq, D, generator=g)
            bwd = _median_time(partial(_backward, q, k, v, o, lse_, dout, layout, qm, km), repeats,
                               time.thread_time)
            samples.append({"features": _features(layout), "fwd_s": fwd, "bwd_s": bwd})
    return samples


def _probe(rank: int, world: int, repeats: int) -> list[dict]:
    """Ring exchange (send to next, receive from previous) at several sizes."""
    out = []
    for numel in (1 << 12, 1 << 15, 1 << 17, 1 << 19, 1 << 20):
        send, recv = torch.randn(numel), torch.empty(numel)
        dist.barrier()
        out.append({"bytes": numel * 4, "s": _median_time(partial(_exchange, rank, world, send, recv), repeats)})
    return out


def _exchange(rank: int, world: int, send: torch.Tensor, recv: torch.Tensor) -> None:
    ops = [dist.P2POp(dist.isend, send, (rank + 1) % world), dist.P2POp(dist.irecv, recv, (rank - 1) % world)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()


def _ring_step(q, k, v, dout, layout, shard) -> None:
    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    out, _ = ring_sparse_attention(q, k, v, layout, shard, check_layout=False)
    (out * dout).sum().backward()


def _measure(rank: int, world: int, seq: int, repeats: int) -> dict:
    res = {}
    g = torch.Generator().manual_seed(2)
    q = torch.randn(1, HQ, seq, D, generator=g)
    k, v = (torch.randn(1, HKV, seq, D, generator=g) for _ in range(2))
    dout = torch.randn(1, HQ, seq, D, generator=g)
    meta = TokenMeta.contiguous(1, seq)
    for name, sharding, shape, kind in CONFIGS:
        if shape is not None and shape[0] * shape[1] != world:
            continue
        ring = "flat" if shape is None else "hierarchical"
        par = ParallelDims.from_config(ContextParallelConfig(cp_size=world, cp_sharding=sharding, cp_ring=ring,
                                                             cp_node_size=None if shape is None else shape[1]))
        plan = ShardPlan(sharding, world, BS, seq)
        layout = _layout(kind, seq)
        shard = CPShard(par, plan, meta)
        step = partial(_ring_step, *(plan.shard(x, rank, dim=2) for x in (q, k, v, dout)), layout, shard)
        times, cpu, sys_s, faults, shares, probes = [], [], [], [], [], []
        step()
        for _ in range(repeats):
            dist.barrier()
            probe = _core_share()
            dist.barrier()
            t0, c0, (s0, f0), (r0, q0) = time.perf_counter(), time.thread_time(), _thread_sys_faults(), _scheduled()
            step()
            times.append(time.perf_counter() - t0)
            cpu.append(time.thread_time() - c0)
            (s1, f1), (r1, q1) = _thread_sys_faults(), _scheduled()
            sys_s.append(s1 - s0)
            faults.append(f1 - f0)
            shares.append((r1 - r0) / max(r1 - r0 + q1 - q0, 1e-9))
            probes.append((probe + _core_share()) / 2)  # before and after the call
        plan_s = _median_time(partial(RingPlan, layout, plan, meta, par.topology, par.cp_rank), repeats,
                              time.thread_time)
        res[name] = {"times": times, "cpu_times": cpu, "sys_times": sys_s, "page_faults": faults,
                     "core_share": shares, "probe_share": probes, "plan_s": plan_s}
    return res


def _worker(rank: int, world: int, seq: int, rounds: int, repeats: int) -> list[dict]:
    """Rounds of (probe, calibration, measurement) close in time, so that each prediction uses
    costs measured under the same load of this shared machine as the run it predicts."""
    out = []
    for _ in range(rounds):
        load = os.getloadavg()
        probe = _probe(rank, world, 2 * repeats)
        calib = _calibrate(repeats)
        out.append({"probe": probe, "calibration": calib, "measured": _measure(rank, world, seq, repeats),
                    "load_average": [load, os.getloadavg()], "torch_threads": torch.get_num_threads()})
    return out


def _lstsq(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Least squares of the relative error (calls of every size count alike) with non-negative
    coefficients (features with a negative one are dropped and refitted)."""
    keep = list(range(x.shape[1]))
    x, y = x / y.unsqueeze(1), torch.ones_like(y)
    while True:
        coef = torch.linalg.lstsq(x[:, keep], y.unsqueeze(1)).solution.flatten()
        if (coef >= 0).all():
            full = torch.zeros(x.shape[1], dtype=x.dtype)
            full[keep] = coef
            return full
        keep.pop(int(coef.argmin()))


def _fit(per_rank: list[dict]) -> tuple[KernelCosts, KernelCosts, Link, dict]:
    samples = [s for r in per_rank for s in r["calibration"]]
    x = torch.tensor([s["features"] for s in samples], dtype=torch.float64)
    costs, quality = [], {}
    for key in ("fwd_s", "bwd_s"):
        y = torch.tensor([s[key] for s in samples], dtype=torch.float64)
        c = _lstsq(x, y)
        quality[key] = float(((x @ c - y) / y).abs().median())
        costs.append(KernelCosts(*(float(v) for v in c)))
    probes = [p for r in per_rank for p in r["probe"]]
    px = torch.tensor([[1.0, p["bytes"]] for p in probes], dtype=torch.float64)
    py = torch.tensor([p["s"] for p in probes], dtype=torch.float64)
    lat, per_byte = (float(v) for v in _lstsq(px, py))
    quality["link"] = float(((px @ torch.tensor([lat, per_byte], dtype=torch.float64) - py) / py).abs().median())
    link = Link(1.0 / per_byte if per_byte > 0 else float("inf"), lat, "gloo ring-exchange probe on this CPU")
    return costs[0], costs[1], link, quality


def predict(name: str, seq: int, world: int, fwd: KernelCosts, bwd: KernelCosts, link: Link,
            shares: list[float]) -> dict:
    """Ring seconds of configuration `name`, every rank's compute costs (CPU seconds) divided by its
    core share; and the busiest rank's compute in CPU seconds."""
    _, sharding, shape, kind = next(c for c in CONFIGS if c[0] == name)
    cluster = Cluster("cpu-gloo", world, link, link, overlap=False)
    topo = RingTopology(*(shape or (1, world)))
    plan = ShardPlan(sharding, world, BS, seq)
    layout = _layout(kind, seq)
    work = plan_work(layout, plan, topo)
    traffic = plan_traffic(layout, plan, topo, kv_heads=HKV, head_dim=D, kv_bytes=4, acc_bytes=4)
    share = torch.tensor(shares, dtype=torch.float64).unsqueeze(1)
    fwd_s, bwd_s = fwd.time(work, HQ), bwd.time(work, HQ)
    f = simulate_ring(fwd_s / share, traffic, topo, cluster, backward=False).time
    b = simulate_ring(bwd_s / share, traffic, topo, cluster, backward=True).time
    return {"ring_s": f + b, "forward_s": f, "backward_s": b, "compute_cpu_s": float((fwd_s + bwd_s).sum(1).max())}


def main(argv=None) -> dict:
    args = parse_args(argv)
    report = {"what": "simulator prediction vs measured ring_sparse_attention fwd+bwd on CPU gloo processes",
              "created": datetime.now(UTC).isoformat(timespec="seconds"), "machine": environment(),
              "args": vars(args), "shapes": {"heads": HQ, "kv_heads": HKV, "head_dim": D, "block_size": BS,
                                             "dtype": "float32"},
              "glibc_tunables": RECYCLING_MALLOC if args.allocator == "recycling" else None,
              "runs": []}
    print(f"{'W':>2} {'configuration':<28}{'measured s':>11} {'predicted s':>12} {'error':>7} {'CPU s':>9} "
          f"{'pred CPU':>9} {'error':>7} {'sys s':>6}  (wall time, then the calling thread's CPU and system time; "
          "medians over rounds)")
    for world in args.world:
        with spawned_allocator(args.allocator):
            per_rank = run_gloo(_worker, world, args.seq, args.rounds, args.repeats, timeout_s=3000)
        run = {"world": world, "torch_threads_per_process": per_rank[0][0]["torch_threads"], "rounds": [],
               "configs": []}
        for i in range(args.rounds):
            fwd, bwd, link, quality = _fit([r[i] for r in per_rank])
            measured = {}
            for name in per_rank[0][i]["measured"]:
                runs = [r[i]["measured"][name] for r in per_rank]
                times = [max(m["times"][j] for m in runs) for j in range(args.repeats)]
                shares = [statistics.median(m["core_share"]) for m in runs]  # per rank
                plan_s = max(m["plan_s"] / sh for m, sh in zip(runs, shares))
                p = predict(name, args.seq, world, fwd, bwd, link, shares)
                cpu = [max(m["cpu_times"][j] for m in runs) for j in range(args.repeats)]
                sys_s = [max(m["sys_times"][j] for m in runs) for j in range(args.repeats)]
                faults = [max(m["page_faults"][j] for m in runs) for j in range(args.repeats)]
                measured[name] = {"measured_sys_s": statistics.median(sys_s), "page_faults": statistics.median(faults),
                                  "measured_s": statistics.median(times), "measured_all_s": times,
                                  "core_share": shares,
                                  "probe_share": [statistics.median(m["probe_share"]) for m in runs],
                                  "plan_build_s": plan_s, "predicted_ring_s": p["ring_s"],
                                  "predicted_s": p["ring_s"] + plan_s, "measured_cpu_s": statistics.median(cpu),
                                  "predicted_compute_cpu_s": p["compute_cpu_s"] + max(m["plan_s"] for m in runs)}
            run["rounds"].append({"kernel_fwd": vars(fwd), "kernel_bwd": vars(bwd),
                                  "calibration_samples": [r[i]["calibration"] for r in per_rank],
                                  "link": {"bandwidth_bytes_per_s": link.bandwidth, "latency_s": link.latency},
                                  "fit_median_relative_error": quality,
                                  "load_average_1_5_15min": per_rank[0][i]["load_average"], "configs": measured})
        for name in run["rounds"][0]["configs"]:
            per_round = [r["configs"][name] for r in run["rounds"]]
            measured = statistics.median(c["measured_s"] for c in per_round)
            predicted = statistics.median(c["predicted_s"] for c in per_round)
            cpu_m = statistics.median(c["measured_cpu_s"] for c in per_round)
            cpu_p = statistics.median(c["predicted_compute_cpu_s"] for c in per_round)
            sys_m = statistics.median(c["measured_sys_s"] for c in per_round)
            row = {"config": name, "measured_s": measured, "predicted_s": predicted, "error": predicted / measured - 1,
                   "round_errors": [c["predicted_s"] / c["measured_s"] - 1 for c in per_round],
                   "measured_cpu_s": cpu_m, "predicted_compute_cpu_s": cpu_p, "cpu_error": cpu_p / cpu_m - 1,
                   "measured_sys_s": sys_m, "page_faults": statistics.median(c["page_faults"] for c in per_round)}
            run["configs"].append(row)
            print(f"{world:>2} {name:<28}{measured:>11.3f} {predicted:>12.3f} {row['error']:>+7.1%} "
                  f"{cpu_m:>9.3f} {cpu_p:>9.3f} {row['cpu_error']:>+7.1%} {sys_m:>6.3f}  rounds: "
                  + " ".join(f"{e:+.0%}" for e in row["round_errors"]))
        report["runs"].append(run)
    errors = [abs(c["error"]) for r in report["runs"] for c in r["configs"]]
    report["max_abs_error"] = max(errors)
    report["within_25_percent"] = all(e <= 0.25 for e in errors)
    report["load_average_1_5_15min_end"] = os.getloadavg()
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    print(f"max |error| {report['max_abs_error']:.1%}; wrote {args.json}")
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
