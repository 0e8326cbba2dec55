"""The simulator against measured GPU steps: `hf-sparse-cp simulate`'s step model at CP 1 beside every warm
one-GPU training step of benchmarks/bench_e2e.py committed in benchmarks/results/.

A measured row is taken when it is a warm step (its run timed steps after at least one warm-up step, at a length up
to the run's --max_seq: the longest-fit steps beyond it are cold) of `sparse_cp` or `sdpa + liger-kernel` without
torch.compile, on a model the simulator has a shape of. It is predicted as the simulator predicts a CP group of
one GPU: `predict_step` (the H100 calibration; the H200 has the same SMs and clocks), the sparse rows through the
striped ring over a synthetic vertical-slash layout keeping what the step's sparse layers kept (the mean of its
`kept_fraction_per_layer` past the dense first layers; found by bisection on the layout's diagonals), with the run's
dense first layers, priced with each sparse kernel of `SPARSE_KERNELS`; the liger rows as the dense ring with cuDNN's
and FlashAttention-2's costs (SDPA's choice between them is not recorded). Nothing runs on a GPU; the measurements
are the committed JSON files' and the predictions the simulator's, so the table says how far the simulator's absolute
step times are from measured ones, row by row (the fused operations around attention, and the code, differ between
the runs: each row names its file and what ran around attention).

    python benchmarks/simulator_vs_gpu.py     # ~1 minute; writes benchmarks/results/simulator-vs-gpu.json
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import UTC, datetime
from pathlib import Path

from hf_sparse_cp.env import environment
from hf_sparse_cp.simulator import simulate_cli
from hf_sparse_cp.simulator.shapes import MODELS
from hf_sparse_cp.simulator.simulate import CONFIGURATIONS
from hf_sparse_cp.simulator.step_model import CLUSTERS, HARDWARE, SPARSE_KERNELS, predict_step, with_causal_layout

RESULTS = Path(__file__).resolve().parent / "results"
CLUSTER = "8xH100-IB400"
VARIANTS = ("sparse_cp", "sdpa+liger")
BENCH_MODELS = {"0.5b": "qwen2.5-0.5b", "1.5b": "qwen2.5-1.5b"}  # bench_e2e's model names -> the simulator's
# Our Triton attention kernels, by the names a profiled step (`kernels`, its largest kernels) lists them under
OUR_KERNELS = ("_forward_kernel", "_preprocess_kernel", "_dq_kernel", "_dkdv_kernel", "_column_sum_kernel",
               "_column_kernel")


def _flag(command: list[str], name: str, default: str) -> str:
    """The last value of `name` in a recorded command line (as argparse reads repeated flags)."""
    values = [command[i + 1] for i, word in enumerate(command[:-1]) if word == name]
    return values[-1] if values else default


def measured_rows(folder: Path) -> list[dict]:
    """The warm one-GPU steps of the committed bench_e2e runs (see the module docstring)."""
    rows = []
    for path in sorted(folder.glob("e2e*_nvidia-*.json")):
        run = json.loads(path.read_text())
        settings, command = run.get("settings", {}), run.get("command", [])
        if run.get("benchmark", "bench_e2e") != "bench_e2e" or settings.get("torch_compile") or \
                settings.get("warmup_steps", 0) < 1:
            continue
        for r in run.get("results", []):
            if r.get("status") != "ok" or r["variant"] not in VARIANTS or r["model"] not in BENCH_MODELS or \
                    r["seq_len"] > settings["max_seq"]:
                continue
            fused = (r.get("fused_ops") or {}).get("choice", "none (before fused ops)") \
                if r["variant"] == "sparse_cp" else "liger"
            dense_layers = int(_flag(command, "--sparse_dense_first_layers", "1"))
            ours_ms = sum(k["ms"] for k in r.get("kernels") or () if k["name"] in OUR_KERNELS)
            rows.append({"file": path.name, "device": run["device"], "model": BENCH_MODELS[r["model"]],
                         "variant": r["variant"], "seq": r["seq_len"], "measured_s": r["step_s"],
                         "kept": sparse_layers_kept(r, dense_layers, MODELS[BENCH_MODELS[r["model"]]].layers),
                         "fused_ops": fused, "dense_first_layers": dense_layers,
                         "attention_kernels_ms": ours_ms or None})
    return rows


def sparse_layers_kept(row: dict, dense_layers: int, layers: int) -> float | None:
    """The mean kept fraction of a step's sparse layers: bench_e2e's `kept_fraction` averages every layer, the
    dense first ones at 1 (their own entries of `kept_fraction_per_layer` where the row has them)."""
    if row["variant"] != "sparse_cp":
        return None
    per_layer = row.get("kept_fraction_per_layer")
    if per_layer:
        sparse = [float(v) for k, v in per_layer.items() if int(k) >= dense_layers]
        return sum(sparse) / len(sparse)
    return (row["kept_fraction"] * layers - dense_layers) / (layers - dense_layers)


def matched_workload(model: str, seq: int, kept: float, tol: float = 0.002):
    """(setup, workload, its kept fraction) of one sequence on one GPU whose synthetic sparse layout keeps `kept` of
    the causal blocks within `tol`, or as near as its whole block diagonals allow: bisection on the diagonals'
    share (the key columns and the sink keep the rest)."""
    lo, hi, best = 0.0, kept, None
    while hi - lo >= 1e-4:
        density = (lo + hi) / 2
        args = simulate_cli.parse_args(["--model", model, "--seq", str(seq), "--cp", "1", "--density", f"{density}"])
        workload = simulate_cli.sequence_workload(args, seq)
        setup = CONFIGURATIONS["striped sparse"](workload, 1, simulate_cli.BLOCK, CLUSTERS[CLUSTER].gpus_per_node)
        got = float(setup.layout.kept_fraction())
        if best is None or abs(got - kept) < abs(best[2] - kept):
            best = setup, workload, got
        if abs(got - kept) <= tol:
            break
        lo, hi = (density, hi) if got < kept else (lo, density)
    return best


def predict(row: dict) -> dict:
    """The row with the simulator's step seconds (`predicted_s` per kernel) and their ratio to the measured one."""
    model, cluster, seq = MODELS[row["model"]], CLUSTERS[CLUSTER], row["seq"]
    if row["variant"] == "sparse_cp":
        setup, workload, kept = matched_workload(row["model"], seq, row["kept"])
        dense = with_causal_layout(setup, workload.layout("dense", setup.plan))
        steps = {k: predict_step(setup, model, HARDWARE[CLUSTER](sparse_kernel=k), cluster,
                                 dense_layers=row["dense_first_layers"], dense=dense) for k in SPARSE_KERNELS}
        predicted = {k: r["step_s"] for k, r in steps.items()}
        # the sparse layers' attention kernels, forward twice (gradient checkpointing) and backward: beside what a
        # profiled step measured of ours (the dense first layer runs SDPA on one GPU)
        sparse_layers = model.layers - row["dense_first_layers"]
        row["predicted_attention_kernels_ms"] = {
            k: 1e3 * sparse_layers * (2 * r["attention_fwd_s"] + r["attention_bwd_s"]) for k, r in steps.items()}
        row["simulated_kept"] = kept
    else:
        args = simulate_cli.parse_args(["--model", row["model"], "--seq", str(seq), "--cp", "1"])
        setup = CONFIGURATIONS["dense ring"](simulate_cli.sequence_workload(args, seq), 1, simulate_cli.BLOCK,
                                             cluster.gpus_per_node)
        predicted = {k: predict_step(setup, model, HARDWARE[CLUSTER](dense_kernel=k), cluster)["step_s"]
                     for k in ("cudnn", "fa2")}
    return {**row, "predicted_s": predicted, "predicted_over_measured": {k: v / row["measured_s"]
                                                                          for k, v in predicted.items()}}


def table(rows: list[dict]) -> str:
    kernels = [*SPARSE_KERNELS, "cudnn", "fa2"]
    lines = [f"{'run':<46}{'variant':<11}{'S':>8}{'kept':>7}{'measured s':>11}"
             + "".join(f"{k:>11}" for k in kernels) + "  around attention",
             "-" * (83 + 11 * len(kernels) + 18)]
    for r in rows:
        cells = "".join(f"{r['predicted_s'][k]:>7.2f} {r['predicted_over_measured'][k]:>3.0%}"
                        if k in r["predicted_s"] else f"{'':>11}" for k in kernels)
        kept = f"{r['kept']:.3f}" if r["kept"] else "1"
        lines.append(f"{r['file'][:45]:<46}{r['variant']:<11}{r['seq']:>8}{kept:>7}{r['measured_s']:>11.2f}"
                     + cells + f"  {r['fused_ops']}")
    return "\n".join(lines)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--results", type=Path, default=RESULTS, help="the folder of the bench_e2e JSON files")
    p.add_argument("--json", type=Path, default=RESULTS / "simulator-vs-gpu.json")
    args = p.parse_args(argv)
    rows = []
    for row in measured_rows(args.results):
        rows.append(predict(row))
        print(f"{row['file']} {row['variant']} {row['seq']}: measured {row['measured_s']:.2f} s, predicted "
              + ", ".join(f"{k} {v:.2f}" for k, v in rows[-1]["predicted_s"].items()), flush=True)
    if not rows:
        raise SystemExit(f"no warm bench_e2e step in {args.results} (e2e*_nvidia-*.json): nothing to compare.")
    print("\npredicted step seconds, and predicted over measured\n" + table(rows))
    for r in rows:
        if r.get("attention_kernels_ms"):
            print(f"{r['file']} {r['seq']}: our attention kernels, profiled {r['attention_kernels_ms']:.0f} ms a step; "
                  "predicted " + ", ".join(f"{k} {v:.0f} ({v / r['attention_kernels_ms']:.0%})"
                                          for k, v in r["predicted_attention_kernels_ms"].items()))
    report = {"what": "the simulator's one-GPU step predictions (CP 1) beside measured warm bench_e2e steps",
              "created": datetime.now(UTC).isoformat(timespec="seconds"), "machine_that_simulated": environment(),
              "cluster_calibration": CLUSTER, "rows": rows,
              "not_modelled": "kernel launch gaps, the optimizer step, per-token work beyond what the liger-kernel "
                              "steps the linear layers' rate is fitted to contain"}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.json}")
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
