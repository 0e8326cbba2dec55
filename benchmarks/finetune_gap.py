"""A short fine-tune of real weights with sparse_cp against sdpa (issue #19): do the losses track?

SmolLM2-135M-Instruct (the `eval` extra) trains for a few AdamW steps on consecutive windows of the
King James Bible, once with `attn_implementation="sdpa"` and once with `sparse_cp` (a vertical-slash
pattern sparse at this length), from the same weights, on the same data, with the same seed. Prints
both loss curves and their gap, and writes JSON to benchmarks/results/.

    python benchmarks/finetune_gap.py                      # 4 steps of 1024 tokens (CPU)
"""

from __future__ import annotations

import copy
import dataclasses
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import HfArgumentParser

import hf_sparse_cp
from hf_sparse_cp.config import SparseAttentionConfig
from hf_sparse_cp.env import environment
from hf_sparse_cp.integration.stats import pop_kept_fractions
from hf_sparse_cp.testing import pretrained
from hf_sparse_cp.testing.benchmarking import write_report

RESULTS_DIR = Path(__file__).resolve().parent / "results"


@dataclass
class FinetuneGapArguments:
    seq_len: int = field(default=1024, metadata={"help": "Tokens per step (one sequence)."})
    steps: int = field(default=4, metadata={"help": "Optimizer steps per run."})
    lr: float = field(default=2e-5, metadata={"help": "AdamW learning rate."})
    vertical_topk: int = field(default=64, metadata={"help": "Verticals per head of the sparse run."})
    slash_topk: int = field(default=64, metadata={"help": "Slashes per head of the sparse run."})
    sink_tokens: int = field(default=16, metadata={"help": "Sink tokens of the sparse run."})
    local_window: int = field(default=64, metadata={"help": "Local window of the sparse run."})
    block_size: int = field(default=64, metadata={"help": "Block size of the sparse run."})
    dense_first_layers: int = field(default=0, metadata={"help": "Layers kept dense in the sparse run."})
    seed: int = field(default=0, metadata={"help": "Seed of both runs."})
    output: str | None = field(default=None, metadata={"help": "JSON path (default: benchmarks/results/...)."})


def train(model, batches: list[torch.Tensor], args: FinetuneGapArguments) -> tuple[list[float], list[float]]:
    """Losses of `args.steps` AdamW steps, one batch each, and each step's kept block fraction (the
    mean over the sparse layers; empty for a dense run)."""
    torch.manual_seed(args.seed)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    losses, kept = [], []
    for step, ids in enumerate(batches):
        t0 = time.perf_counter()
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        per_layer = pop_kept_fractions(model)
        if per_layer:
            kept.append(sum(per_layer.values()) / len(per_layer))
        print(f"  {model.config._attn_implementation} step {step}: loss {losses[-1]:.4f} "
              f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
    return losses, kept


def main(argv: list[str] | None = None) -> dict:
    (args,) = HfArgumentParser(FinetuneGapArguments).parse_args_into_dataclasses(argv)
    tokenizer, base = pretrained.load_tokenizer(), pretrained.load_model()
    ids = pretrained.text_token_ids(tokenizer, args.seq_len * args.steps, start_char=200_000)
    batches = list(ids.split(args.seq_len, dim=1))
    cfg = SparseAttentionConfig(min_seq_len=0, vertical_topk=args.vertical_topk, slash_topk=args.slash_topk,
                                sink_tokens=args.sink_tokens, local_window=args.local_window,
                                block_size=args.block_size, dense_first_layers=args.dense_first_layers)
    dense, _ = train(copy.deepcopy(base), batches, args)
    hf_sparse_cp.patch()
    try:
        model = copy.deepcopy(base)
        hf_sparse_cp.configure(model, cfg)
        sparse, kept = train(model, batches, args)
    finally:
        hf_sparse_cp.unpatch()
    gaps = [s / d - 1 for s, d in zip(sparse, dense)]
    print(f"{'step':>4} {'sdpa':>8} {'sparse_cp':>9} {'gap':>7} {'kept':>6}")
    for i, (d, s, g, f) in enumerate(zip(dense, sparse, gaps, kept)):
        print(f"{i:4d} {d:8.4f} {s:9.4f} {g:+7.2%} {f:6.1%}")
    report = {**environment("cpu"), "settings": dataclasses.asdict(args), "config": cfg.to_dict(),
              "loss_sdpa": dense, "loss_sparse_cp": sparse, "relative_gap": gaps, "kept_fraction": kept,
              "max_abs_relative_gap": max(abs(g) for g in gaps)}
    write_report(report, RESULTS_DIR, "finetune-gap", args.output)
    return report


if __name__ == "__main__":
    main()
