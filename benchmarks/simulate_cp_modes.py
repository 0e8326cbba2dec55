"""Ring vs head-parallel (Ulysses) vs hybrid context parallelism, predicted side by side on GPU clusters,
and the dense ring checked against a published figure. Written to benchmarks/results/.

    python benchmarks/simulate_cp_modes.py                       # Qwen2.5 0.5B-7B, 128K-1M, 8 and 4 x 8 H100s
    python benchmarks/simulate_cp_modes.py --models qwen2.5-3b --seq 131072 --gpus 8

For every model, sequence length, GPU count (one CP group: 8 = one node, 32 = four nodes of 8) and kind
(dense causal attention, or a synthetic vertical-slash layout keeping `--density` of the blocks, as
`simulate_cluster.py` builds it), the step time of:

* ring: the sparse ring over all GPUs (zigzag sharding for dense, striped for sparse), `predict_step`;
  over several nodes also the hierarchical ring (sparse: `hierarchical striped sparse`), and "vs ring" is
  against the faster of the two;
* ulysses: heads over all GPUs, each attending the whole sequence (`predict_head_parallel_step`); refused
  when the GPUs outnumber the query heads;
* hybrid hN: heads over N GPUs of a node, the ring across the CP / N head groups.

Sparse kernels are costed by default with FlexAttention's measured per-row cost ("flex") and without it
("block-only", the bound `simulate_cluster.py` also reports), the kernels of the committed results;
`--kernels ours` prices them with the plugin's kernels as measured on an H100 (`hf-sparse-cp simulate`'s default).
The check: Qwen3-8B at 1,048,576 tokens on one node of 8 H100s, FSDP2 + CP 8, dense; TRL measured 364 s per step
(published; the research note). Nothing runs on a GPU: these are predictions from the simulator's calibration
(sources in the JSON).
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import UTC, datetime
from pathlib import Path

from hf_sparse_cp.env import environment
from hf_sparse_cp.simulator.arguments import cp_layout
from hf_sparse_cp.simulator.head_parallel import predict_head_parallel_step
from hf_sparse_cp.simulator.shapes import MODELS
from hf_sparse_cp.simulator.simulate import CONFIGURATIONS
from hf_sparse_cp.simulator.simulate_cli import head_group_setup, sequence_workload
from hf_sparse_cp.simulator.step_model import CLUSTERS, HARDWARE, SPARSE_KERNELS, predict_step

RESULTS = Path(__file__).resolve().parent / "results"
BLOCK = 128
CLUSTER = "8xH100-IB400"
TRL = {"model": "qwen3-8b", "seq": 1048576, "gpus": 8, "measured_step_s": 364.0,
       "source": "TRL long-context guide (TRL PRs #6845/#6846), reported: Qwen3-8B, 1,048,576 tokens, one 8xH100 "
                 "node, bf16, batch 1, FSDP2 + CP 8 (torch CP, SDPA), chunked NLL loss, gradient-checkpointing "
                 "offload: 364 s per step, 56.2 GB per GPU"}
# (mode, kind) -> the simulator's ring configuration (its hierarchical ring is a sparse one)
RINGS = {("ring", "dense"): "dense ring", ("ring", "sparse"): "striped sparse",
         ("ring hier.", "sparse"): "hierarchical striped sparse"}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-3b", "qwen2.5-7b"],
                   choices=sorted(MODELS))
    p.add_argument("--seq", type=int, nargs="+", default=[131072, 262144, 524288, 1048576])
    p.add_argument("--gpus", type=int, nargs="+", default=[8, 32], help="CP degree (one CP group, GPUs of 8-GPU nodes)")
    p.add_argument("--heads", type=int, nargs="+", default=[2, 4, 8], help="hybrid head-group sizes tried")
    p.add_argument("--density", type=float, default=0.063, help="kept fraction of a sparse layout's causal blocks")
    p.add_argument("--kernels", nargs="+", default=["flex", "block-only"], choices=list(SPARSE_KERNELS),
                   help="what the sparse kernels cost (step_model.SPARSE_KERNELS), a row each")
    p.add_argument("--verticals", type=int, default=1000)
    p.add_argument("--sink", type=int, default=32)
    p.add_argument("--spread", type=float, default=1.0, help="as simulate_cluster.py's --spread")
    p.add_argument("--layout-heads", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-check", action="store_true", help="skip the TRL check")
    p.add_argument("--json", default=str(RESULTS / "simulate-cp-modes_8xH100-IB400.json"))
    return p.parse_args(argv)


def _modes(gpus: int, heads: list[int], per_node: int) -> list[tuple[str, int]]:
    """(name, head-group size) of every layout to predict: ring (hierarchical too across nodes), ulysses,
    hybrids inside a node."""
    out = [("ring", 1)] + ([("ring hier.", 1)] if gpus > per_node else []) + [("ulysses", gpus)]
    out += [(f"hybrid h{h}", h) for h in heads if 1 < h < gpus and gpus % h == 0 and per_node % h == 0]
    return out


def predict(model_name: str, seq: int, gpus: int, kind: str, mode: str, head_size: int, workload, hardware: dict
            ) -> list[dict]:
    """The rows (one per kernel costing) of one layout, through `hf-sparse-cp simulate`'s code: the ring's
    configuration, or the layout a CP mode with head groups resolves to (`cp_layout`) over its sharding
    (`head_group_setup`); a refused one as a row with its reason."""
    model, cluster = MODELS[model_name], CLUSTERS[CLUSTER]
    base = {"model": model_name, "seq": seq, "gpus": gpus, "kind": kind, "mode": mode, "head_size": head_size}
    ring = RINGS.get((mode, kind))
    if head_size == 1 and ring is None:
        return []
    rows = []
    for kernel, hw in hardware.items():
        if kind == "dense" and kernel != next(iter(hardware)):  # (a dense layout's row, once)
            continue
        row = {**base, "kernel": kernel if kind == "sparse" else "cudnn"}
        try:
            if head_size == 1:
                row.update(predict_step(CONFIGURATIONS[ring](workload, gpus, BLOCK, cluster.gpus_per_node),
                                        model, hw, cluster))
            else:
                flags = argparse.Namespace(cp_mode="ulysses" if head_size == gpus else "hybrid",
                                           cp_ulysses_size=None if head_size == gpus else head_size)
                cp_mode, h = cp_layout(flags, gpus)
                sharding = "contiguous" if h == gpus else "zigzag" if kind == "dense" else "striped"
                setup = head_group_setup(workload, gpus, cp_mode, h, kind, sharding)
                row.update(predict_head_parallel_step(setup, model, hw, cluster, head_size=h))
        except ValueError as error:
            row.update(refused=str(error).split(":")[0])
        for key in ("ring_step_compute_ms", "ring_step_transfer_ms"):
            row.pop(key, None)
        rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    """Step seconds per (model, S, GPUs, kind, kernel), one column per layout, and the best."""
    order = ["ring", "ring hier.", "ulysses"]  # then the hybrids by head-group size
    modes = sorted({r["mode"] for r in rows}, key=lambda m: (order.index(m) if m in order else 3, len(m), m))
    head = f"{'model':<13}{'S':>8}{'GPUs':>5} {'kind':<7}{'kernel':<11}" + "".join(f"{m:>11}" for m in modes)
    lines = [head + f"  {'best':<11}{'vs ring':>8}", "-" * (len(head) + 21)]
    keys = list(dict.fromkeys((r["model"], r["seq"], r["gpus"], r["kind"], r["kernel"]) for r in rows))
    for key in keys:
        got = {r["mode"]: r for r in rows if (r["model"], r["seq"], r["gpus"], r["kind"], r["kernel"]) == key}
        cells = [f"{got[m]['step_s']:>11.2f}" if m in got and "step_s" in got[m] else
                 f"{'refused' if m in got else '-':>11}" for m in modes]
        timed = {m: r["step_s"] for m, r in got.items() if "step_s" in r}
        best = min(timed, key=timed.get)
        ring = min(t for m, t in timed.items() if m.startswith("ring"))
        gain = ring / timed[best]
        model, seq, gpus, kind, kernel = key
        lines.append(f"{model:<13}{seq // 1024:>7}K{gpus:>5} {kind:<7}{kernel:<11}" + "".join(cells)
                     + f"  {best:<11}{gain:>7.2f}x")
    return "\n".join(lines)


def main(argv=None) -> dict:
    args = parse_args(argv)
    hardware = {k: HARDWARE[CLUSTER](dense_kernel="cudnn", sparse_kernel=k) for k in dict.fromkeys(args.kernels)}
    per_node = CLUSTERS[CLUSTER].gpus_per_node
    rows = []
    for seq in args.seq:
        workload = sequence_workload(args, seq)
        for model in args.models:
            for gpus in args.gpus:
                for kind in ("dense", "sparse"):
                    for mode, h in _modes(gpus, args.heads, per_node):
                        rows += predict(model, seq, gpus, kind, mode, h, workload, hardware)
                    print(table([r for r in rows if (r["model"], r["seq"], r["gpus"], r["kind"])
                                 == (model, seq, gpus, kind)]).splitlines()[-1], flush=True)
    print("\n" + table(rows))
    report = {"what": "predicted training-step seconds (simulation, not a measurement) of one sequence per CP group: "
                      "ring vs head-parallel (ulysses) vs hybrid",
              "created": datetime.now(UTC).isoformat(timespec="seconds"), "machine_that_simulated": environment(),
              "cluster": CLUSTER, "args": vars(args), "calibration": next(iter(hardware.values())).sources,
              "rows": rows}
    if not args.no_check:
        workload = sequence_workload(args, TRL["seq"])
        checks = []
        for dense_kernel in ("cudnn", "fa2"):
            hw = HARDWARE[CLUSTER](dense_kernel=dense_kernel)
            setup = CONFIGURATIONS["dense ring"](workload, TRL["gpus"], BLOCK, per_node)
            r = predict_step(setup, MODELS[TRL["model"]], hw, CLUSTERS[CLUSTER])
            checks.append({"dense_kernel": dense_kernel, "predicted_step_s": r["step_s"],
                           "difference": r["step_s"] / TRL["measured_step_s"] - 1.0})
            print(f"TRL check, {TRL['model']} {TRL['seq']:,} tokens, dense ring CP {TRL['gpus']} ({dense_kernel}): "
                  f"predicted {r['step_s']:.0f} s, measured {TRL['measured_step_s']:.0f} s "
                  f"({checks[-1]['difference']:+.1%})")
        setting = [r for kind in ("dense", "sparse") for mode, h in _modes(TRL["gpus"], args.heads, per_node)
                   for r in predict(TRL["model"], TRL["seq"], TRL["gpus"], kind, mode, h, workload, hardware)]
        print(f"\n{TRL['model']} in TRL's setting, every layout:\n" + table(setting))
        report["trl_check"] = {**TRL, "predictions": checks, "modes": setting,
                               "not_modelled": "FSDP2 parameter traffic, gradient-checkpointing offload to host "
                                               "memory, the optimizer step, kernel launch gaps"}
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {out}")
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
