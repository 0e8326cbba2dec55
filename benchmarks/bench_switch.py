"""Switching the shard layout online (slice intersection) against the checkpoint baseline.

For each model shape (tiny, small, 0.5B-shaped like Qwen2.5-0.5B) the fp32 weights and both AdamW
moments are sharded FSDP2-style (`Shard(0)` over all ranks) on `--world` gloo processes, then moved
to another layout of the same ranks:

* `switch`: `hf_sparse_cp.resharding.boxes.move_state`, point to point, bucket by bucket;
  its peak extra memory is what the move holds beyond the state (`MemoryMeter`), compared with one
  rank's shard of the whole state;
* `link`: the same point-to-point traffic (the bytes the plan has each rank send each other rank) as
  plain 64 MiB messages, all in flight at once, with nothing else to do: the floor of any
  point-to-point mover on this transport (gloo over the loopback interface on CPU); timed right after
  each switch, so that both see the same load on the machine;
* `checkpoint`: a sharded distributed checkpoint (`torch.distributed.checkpoint.save`), the old state
  dropped, the new layout allocated and loaded (`torch.distributed.checkpoint.load` reshards); plus
  `restart`: the measured start of `--world` fresh Python processes at once, each importing torch,
  transformers and the plugin and joining a gloo process group (what a job restart pays at least once
  more, before building its model).

The allocator: every process runs with glibc's malloc keeping freed memory (`--allocator recycling`,
`GLIBC_TUNABLES`), as PyTorch's caching allocator does on a GPU, where a switch at a step boundary
allocates its new shards from memory the step just freed. With glibc's defaults (`--allocator system`)
every large new tensor, the switch's destinations and the reload's alike, first pays a page fault per
4 KiB page, which on this machine costs more than moving the bytes.

Targets (issue #17): switch >= 20x faster than the checkpoint baseline (save, restart, reload), peak extra
memory <= one shard; the ratio without the restart is reported too, beside what the bare transport reaches
(`ckpt/link`). A context-parallel switch at constant world size moves nothing (FSDP2's mesh over
dp_shard x cp keeps its flattened size, `trainer/curriculum.py`); this measures the layout change.

    python benchmarks/bench_switch.py                          # tiny, small, 0.5B-shaped on 4 processes
    python benchmarks/bench_switch.py --models tiny --repeats 3
"""

from __future__ import annotations

import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import Shard

from hf_sparse_cp.env import environment
from hf_sparse_cp.testing.benchmarking import ALLOCATORS, format_targets, spawned_allocator, write_report

RESULTS_DIR = Path(__file__).resolve().parent / "results"

# (hidden, intermediate, layers, query heads, kv heads, head_dim, vocab): Llama/Qwen2-shaped decoders.
MODELS = {
    "tiny": (128, 256, 2, 4, 2, 32, 259),
    "small": (512, 1408, 8, 8, 2, 64, 32000),
    "0.5B-shaped": (896, 4864, 24, 14, 2, 64, 151936),  # Qwen2.5-0.5B, tied embeddings: 494M parameters
}
# What the state moves to on the same ranks, as (mesh rank grid, placements), for --world 4 (2 x 2):
# dp_shard x cp as two mesh dimensions each splitting the rows again (rank 0 keeps its rows, the others'
# boundaries shift), and the same with the flattened order transposed (DP innermost instead of CP:
# ranks 1 and 2 swap their whole shards), the case where every moving byte moves.
TARGETS = {
    "dp x cp nested": lambda w: (torch.arange(w).view(2, w // 2), (Shard(0), Shard(0))),
    "dp x cp transposed": lambda w: (torch.arange(w).view(w // 2, 2).t().contiguous(), (Shard(0), Shard(0))),
}


@dataclass
class BenchSwitchArguments:
    models: list[str] = field(default_factory=lambda: list(MODELS), metadata={"help": f"Of {list(MODELS)}."})
    world: int = field(default=4, metadata={"help": "Processes (a multiple of 4: the target meshes are 2 x world/2)."})
    repeats: int = field(default=5, metadata={
        "help": "Switches and link exchanges timed per model and target, alternately, after one uncounted round "
                "(medians); the baseline runs once."})
    allocator: str = field(default="recycling", metadata={
        "help": "glibc malloc of the processes: 'recycling' keeps freed memory (as a GPU's caching allocator "
                "does), 'system' its defaults.", "choices": ALLOCATORS})
    output: str | None = field(default=None, metadata={"help": "JSON path (default: benchmarks/results/...)."})


def parameter_shapes(name: str) -> dict[str, tuple[int, ...]]:
    hidden, inter, layers, heads, kv, head_dim, vocab = MODELS[name]
    shapes = {"embed_tokens.weight": (vocab, hidden), "norm.weight": (hidden,)}
    for i in range(layers):
        p = f"layers.{i}."
        shapes.update({
            p + "q_proj.weight": (heads * head_dim, hidden), p + "q_proj.bias": (heads * head_dim,),
            p + "k_proj.weight": (kv * head_dim, hidden), p + "k_proj.bias": (kv * head_dim,),
            p + "v_proj.weight": (kv * head_dim, hidden), p + "v_proj.bias": (kv * head_dim,),
            p + "o_proj.weight": (hidden, heads * head_dim), p + "gate_proj.weight": (inter, hidden),
            p + "up_proj.weight": (inter, hidden), p + "down_proj.weight": (hidden, inter),
            p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,),
        })
    return shapes


def _sharded_state(name: str, mesh, placements, fill: bool) -> dict:
    """Weights and AdamW moments as DTensors laid out by (mesh, placements), from local random shards."""
    from torch.distributed.tensor import DTensor

    from hf_sparse_cp.resharding.boxes import shard_boxes

    rank, state = dist.get_rank(), {}
    for pname, shape in parameter_shapes(name).items():
        box = shard_boxes(shape, mesh.mesh, placements)[rank]
        for key in ("", "/exp_avg", "/exp_avg_sq"):
            local = torch.randn(box.shape) if fill else torch.empty(box.shape)
            state[pname + key] = DTensor.from_local(local, mesh, placements, run_check=False, shape=torch.Size(shape),
                                                    stride=_stride(shape))
    return state


def _stride(shape) -> tuple[int, ...]:
    return tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))


def _local_bytes(state: dict) -> int:
    return sum(t.to_local().numel() * t.to_local().element_size() for t in state.values())


def _timed(fn, *args, **kwargs):
    dist.barrier()
    start = time.perf_counter()
    out = fn(*args, **kwargs)
    dist.barrier()
    return time.perf_counter() - start, out


def _link_seconds(name: str, world: int, grid: torch.Tensor, placements) -> float:
    """The same traffic with nothing else to do: the bytes the plan has each rank send each other rank,
    as 64 MiB messages (sent from one buffer, received into one per peer), every message to and from
    every peer in flight at once; what any point-to-point mover needs at least on this machine's gloo
    transport."""
    from hf_sparse_cp.resharding.boxes import plan_transfers, shard_boxes

    rank, chunk = dist.get_rank(), 16 << 20  # floats per message
    sends, receives = [0] * world, [0] * world
    for shape in parameter_shapes(name).values():
        source, goal = shard_boxes(shape, torch.arange(world), (Shard(0),)), shard_boxes(shape, grid, placements)
        for t in plan_transfers(shape, source, goal):
            if t.src != t.dst and rank in (t.src, t.dst):
                (sends if t.src == rank else receives)[t.dst if t.src == rank else t.src] += 3 * t.box.numel
    out = torch.randn(min(chunk, max(sends)))
    into = {p: torch.zeros(n) for p, n in enumerate(receives) if n}  # pages touched before the clock starts

    def exchange():
        ops = [dist.irecv(into[p][start : start + chunk], p) for p, n in enumerate(receives)
               for start in range(0, n, chunk)]
        ops += [dist.isend(out[: min(chunk, n - start)], p) for p, n in enumerate(sends)
                for start in range(0, n, chunk)]
        for op in ops:
            op.wait()

    return _timed(exchange)[0]


def _measure(name: str, world: int, repeats: int, workdir: str) -> list[dict]:
    """Switch times and peaks to each target, then the checkpoint baseline to the first one (DCP)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    from hf_sparse_cp.resharding.boxes import MemoryMeter, TargetLayout, move_state

    flat = init_device_mesh("cpu", (world,))
    source = (Shard(0),)
    rows = []
    for target_name, make in TARGETS.items():
        grid, placements = make(world)
        layout = TargetLayout(grid, placements)  # plain local shards: the data move alone is timed
        seconds, links, peaks = [], [], []
        for i in range(repeats + 1):  # the first round warms the allocator up, uncounted
            state = _sharded_state(name, flat, source, fill=True)
            shard = _local_bytes(state)
            meter = MemoryMeter()
            elapsed, moved = _timed(move_state, state, lambda *_, layout=layout: layout, meter=meter)
            del state, moved
            link = _link_seconds(name, world, grid, placements)  # right after: the same load on the machine
            if i:
                seconds.append(elapsed)
                links.append(link)
            peaks.append(meter.peak)
        rows.append({"model": name, "target": target_name,
                     "parameters": sum(math.prod(s) for s in parameter_shapes(name).values()), "shard_bytes": shard,
                     "switch_s": statistics.median(seconds), "switch_peak_extra_bytes": max(peaks),
                     "link_s": statistics.median(links), "switch_runs_s": seconds, "link_runs_s": links})
    grid = init_device_mesh("cpu", (2, world // 2))
    state = _sharded_state(name, flat, source, fill=True)
    folder = os.path.join(workdir, name)
    save_s, _ = _timed(dcp.save, state, checkpoint_id=folder)
    del state

    def reload():
        fresh = _sharded_state(name, grid, (Shard(0), Shard(0)), fill=False)
        dcp.load(fresh, checkpoint_id=folder)
        return fresh

    load_s, _ = _timed(reload)
    return [dict(row, save_s=save_s, load_s=load_s) for row in rows]


def _worker(rank: int, world: int, models: list[str], repeats: int, workdir: str) -> list[dict]:
    return [row for name in models for row in _measure(name, world, repeats, workdir)]


_RESTART = """
import sys, torch, torch.distributed as dist, transformers, hf_sparse_cp.integration
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=int(sys.argv[2]), world_size=int(sys.argv[3]))
dist.barrier()
dist.destroy_process_group()
"""


def _restart_seconds(world: int) -> float:
    """A job's restart before it builds its model: `world` fresh interpreters at once, each importing what
    a training job imports and joining the process group."""
    with tempfile.TemporaryDirectory() as folder:
        start = time.perf_counter()
        store = os.path.join(folder, "store")
        procs = [subprocess.Popen([sys.executable, "-c", _RESTART, store, str(rank), str(world)])
                 for rank in range(world)]
        if any(proc.wait() for proc in procs):
            raise RuntimeError("a restarted process failed; see its output above.")
        return time.perf_counter() - start


def format_table(rows: list[dict]) -> str:
    head = (f"{'model':>12} {'target':>19} {'params':>8} {'shard MB':>9} {'switch s':>9} {'link s':>7} "
            f"{'peak extra MB':>14} {'save s':>7} {'load s':>7} {'ckpt/switch':>12} {'ckpt/link':>10} {'+restart':>9}")
    lines = [head]
    for r in rows:
        lines.append(f"{r['model']:>12} {r['target']:>19} {r['parameters'] / 1e6:>7.1f}M "
                     f"{r['shard_bytes'] / 2**20:>9.1f} "
                     f"{r['switch_s']:>9.4f} {r['link_s']:>7.4f} {r['switch_peak_extra_bytes'] / 2**20:>14.2f} "
                     f"{r['save_s']:>7.3f} "
                     f"{r['load_s']:>7.3f} {r['speedup']:>11.1f}x {r['link_speedup']:>9.1f}x "
                     f"{r['speedup_with_restart']:>8.1f}x")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    from transformers import HfArgumentParser

    from hf_sparse_cp.testing.spawn import run_gloo

    (args,) = HfArgumentParser(BenchSwitchArguments).parse_args_into_dataclasses(argv)
    unknown = set(args.models) - set(MODELS)
    if unknown or args.world % 4 or args.repeats < 1:
        raise SystemExit(f"--models from {list(MODELS)}, a --world that is a multiple of 4 and --repeats >= 1 (got "
                         f"{args.models}, {args.world}, {args.repeats}).")
    restart = _restart_seconds(args.world)
    with tempfile.TemporaryDirectory() as workdir, spawned_allocator(args.allocator) as tunables:
        per_rank = run_gloo(_worker, args.world, args.models, args.repeats, workdir, timeout_s=3600)
    rows = []
    for i, row in enumerate(per_rank[0]):
        ranks = [r[i] for r in per_rank]
        row = dict(row, shard_bytes=max(r["shard_bytes"] for r in ranks),
                   switch_peak_extra_bytes=max(r["switch_peak_extra_bytes"] for r in ranks))
        baseline = row["save_s"] + row["load_s"]
        # link_speedup: the ratio the bare transport itself reaches, the ceiling of any point-to-point mover here
        row.update(restart_s=restart, speedup=baseline / row["switch_s"],
                   speedup_with_restart=(baseline + restart) / row["switch_s"], link_speedup=baseline / row["link_s"])
        rows.append(row)
    targets = [
        {"target": "switch vs the checkpoint baseline, save + restart + reload (issue #17; smallest ratio over rows)",
         "required": ">= 20x", "measured": min(r["speedup_with_restart"] for r in rows),
         "pass": min(r["speedup_with_restart"] for r in rows) >= 20},
        {"target": "switch vs save + reload without the restart (stricter; smallest ratio over rows)",
         "required": ">= 20x", "measured": min(r["speedup"] for r in rows),
         "pass": min(r["speedup"] for r in rows) >= 20},
        {"target": "peak extra memory / one rank's shard (largest over models and ranks)", "required": "<= 1",
         "measured": max(r["switch_peak_extra_bytes"] / r["shard_bytes"] for r in rows),
         "pass": all(r["switch_peak_extra_bytes"] <= r["shard_bytes"] for r in rows)},
    ]
    env = environment("cpu")
    print(f"Layout switch on {args.world} gloo processes ({env['device']}, torch {env['torch']}): flat FSDP2 "
          f"Shard(0) -> each target; weights + AdamW moments in fp32; checkpoint baseline to the nested layout; "
          f"restart = {restart:.2f} s (measured); {args.allocator} malloc")
    print(format_table(rows))
    print(format_targets(targets))
    report = {**env, "world": args.world, "repeats": args.repeats, "allocator": args.allocator,
              "glibc_tunables": tunables, "rows": rows,
              "targets": targets}
    write_report(report, RESULTS_DIR, "switch", args.output)
    return report


if __name__ == "__main__":
    main()
