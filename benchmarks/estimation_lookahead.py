"""The estimation's look-ahead on real weights (issue #19): does it matter that the pattern of every
query is chosen from the sequence's last `last_q` queries, i.e. from tokens after it?

Passkey retrieval (the demo's prompt, `examples/passkey.py`, in SmolLM2-135M-Instruct's own
tokenizer): the loss and greedy accuracy of the answer tokens (the key and its full stop) with

* dense attention (sdpa);
* `sparse_cp` as it runs in teacher-forced training: the pattern is estimated from the last
  `last_q` queries of the whole sequence, which include the question and the answer itself;
* the same pattern settings estimated from the last `last_q` queries *before the answer* only (the
  prefix a generating model would have), through the library's own scoring and layout pieces
  (`score_vertical_slash`, `layout_from_scores`) on a benchmark-only backend;
* `sparse_cp` with `estimation="causal_chunks"` (one row per `estimation_chunk`): every chunk's
  pattern estimated from the queries before it, the first chunk dense, so no position's keys
  depend on later tokens: what training can use without the look-ahead.

A gap between the two sparse rows is what the look-ahead gives teacher-forced training and
evaluation that inference would not have. The script checks first that its prefix backend with the
prefix = the whole sequence reproduces `sparse_cp` exactly.

    python benchmarks/estimation_lookahead.py                  # 1024 tokens, 6 prompts
    python benchmarks/estimation_lookahead.py --samples 4 --reuse old.json  # measure only what old.json lacks
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, HfArgumentParser
from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

import hf_sparse_cp
from hf_sparse_cp.attention.build import dense_layout
from hf_sparse_cp.attention.estimate import layout_from_scores
from hf_sparse_cp.attention.ops import block_sparse_attention
from hf_sparse_cp.attention.scoring import score_vertical_slash
from hf_sparse_cp.attention.tokens import TokenMeta
from hf_sparse_cp.config import SparseAttentionConfig
from hf_sparse_cp.env import environment
from hf_sparse_cp.examples.passkey import passkey_text
from hf_sparse_cp.integration import upstream
from hf_sparse_cp.integration.layer_settings import layer_config
from hf_sparse_cp.testing import pretrained
from hf_sparse_cp.testing.benchmarking import write_report

RESULTS_DIR = Path(__file__).resolve().parent / "results"
PREFIX_BACKEND = "sparse_cp_prefix_estimation"


@dataclass
class LookaheadArguments:
    seq_len: int = field(default=1024, metadata={"help": "Tokens per prompt."})
    samples: int = field(default=6, metadata={"help": "Prompts (random keys and needle depths)."})
    vertical_topk: int = field(default=64, metadata={"help": "Verticals per head."})
    slash_topk: int = field(default=64, metadata={"help": "Slashes per head."})
    sink_tokens: int = field(default=16, metadata={"help": "Sink tokens."})
    local_window: int = field(default=64, metadata={"help": "Local window."})
    last_q: int = field(default=64, metadata={"help": "Estimation queries."})
    block_size: int = field(default=64, metadata={"help": "Layout block size."})
    dense_first_layers: int = field(default=0, metadata={"help": "Layers kept dense (0: every layer sparse)."})
    estimation_chunks: list[int] = field(default_factory=lambda: [128, 256],
                                         metadata={"help": "estimation_chunk of the 'causal_chunks' rows."})
    seed: int = field(default=0, metadata={"help": "Seed of the prompts."})
    output: str | None = field(default=None, metadata={"help": "JSON path (default: benchmarks/results/...)."})
    reuse: str | None = field(
        default=None, metadata={"help": "A report of this script with the same prompts and pattern settings: its "
                                "measured variants are taken from it, only the others are measured (a slow CPU)."})

    def matches(self, other: dict) -> bool:
        """Whether a report's settings give the same prompts and pattern (all but the chunks and files)."""
        skip = {"estimation_chunks", "output", "reuse"}
        before = {"dense_first_layers": 0}  # reports from before that field ran every layer sparse
        return all(other.get(k, before.get(k)) == v for k, v in dataclasses.asdict(self).items() if k not in skip)


class PrefixEstimation:
    """A `sparse_cp`-like backend whose pattern comes from the last `last_q` queries before `prefix`."""

    def __init__(self) -> None:
        self.prefix = 0

    def __call__(self, module, query, key, value, attention_mask, dropout=0.0, scaling=None, sliding_window=None,
                 **kwargs):
        if attention_mask is not None or query.shape[0] != 1 or sliding_window is not None:
            raise ValueError("the prefix-estimation backend takes one unpadded row without a sliding window.")
        cfg = layer_config(module)
        s, d = query.shape[2], query.shape[3]
        scale = 1.0 / math.sqrt(d) if scaling is None else scaling
        meta = TokenMeta.contiguous(1, s)
        if cfg.pattern == "dense" or s < cfg.min_seq_len:
            layout = dense_layout(meta, cfg.block_size)
        else:
            with torch.no_grad():
                scores = score_vertical_slash(query[0], key[0], [(0, self.prefix)], cfg.scoring.last_q, scale)
                layout = layout_from_scores(meta, cfg, [[(0, s)]], [scores])
        out, _ = block_sparse_attention(query, key, value, layout, scale=scale, q_meta=meta, k_meta=meta)
        return out.transpose(1, 2).contiguous(), None


def prompts(tokenizer, args: LookaheadArguments) -> list[tuple[torch.Tensor, int]]:
    """(ids [1, seq_len], index of the first answer token) per prompt; the answer is the key and '.'."""
    rng = random.Random(args.seed)
    out = []
    while len(out) < args.samples:
        text, key = passkey_text(args.seq_len * 5, rng)
        question = tokenizer(text[: -len(key) - 1], add_special_tokens=False)["input_ids"]
        answer = tokenizer(key + ".", add_special_tokens=False)["input_ids"]
        keep = args.seq_len - len(answer)
        if f"The pass key is {key}" in tokenizer.decode(question[-keep:]):  # the trim kept the needle
            out.append((torch.tensor(question[-keep:] + answer).unsqueeze(0), keep))
    return out


@torch.no_grad()
def answer_loss(model, ids: torch.Tensor, start: int) -> tuple[float, float]:
    """(mean loss of the answer tokens, share of them predicted by argmax)."""
    logits = model(ids).logits[0, start - 1 : -1].float()
    target = ids[0, start:]
    return float(F.cross_entropy(logits, target)), float((logits.argmax(-1) == target).float().mean())


def main(argv: list[str] | None = None) -> dict:
    (args,) = HfArgumentParser(LookaheadArguments).parse_args_into_dataclasses(argv)
    tokenizer, model = pretrained.load_tokenizer(), pretrained.load_model()
    cfg = SparseAttentionConfig(min_seq_len=0, vertical_topk=args.vertical_topk, slash_topk=args.slash_topk,
                                sink_tokens=args.sink_tokens, local_window=args.local_window, last_q=args.last_q,
                                block_size=args.block_size, dense_first_layers=args.dense_first_layers)
    data = prompts(tokenizer, args)
    variants = ["dense", "sparse_whole_sequence", "sparse_prefix_only",
                *(f"sparse_causal_chunks_{c}" for c in args.estimation_chunks)]
    rows = [{"answer_tokens": ids.shape[1] - start} for ids, start in data]
    reused = []
    if args.reuse:
        old = json.loads(Path(args.reuse).read_text())
        if not args.matches(old["settings"]) or [r["answer_tokens"] for r in old["rows"]] != [
                r["answer_tokens"] for r in rows]:
            raise ValueError(f"{args.reuse} measured other prompts or pattern settings; rerun without --reuse.")
        reused = [v for v in variants if all(v in r for r in old["rows"])]
        for row, was in zip(rows, old["rows"]):
            row.update({v: was[v] for v in reused})
    prefix = PrefixEstimation()
    hf_sparse_cp.patch()
    AttentionInterface.register(PREFIX_BACKEND, prefix)
    AttentionMaskInterface.register(PREFIX_BACKEND, flash_attention_mask)
    try:
        hf_sparse_cp.configure(model, cfg, select=False)
        if "sparse_prefix_only" not in reused:  # self-check: from the whole sequence, the prefix backend is sparse_cp
            ids, start = data[0]
            prefix.prefix = ids.shape[1]
            model.set_attn_implementation(PREFIX_BACKEND)
            whole = answer_loss(model, ids, start)
            model.set_attn_implementation(hf_sparse_cp.BACKEND_NAME)
            if not math.isclose(whole[0], answer_loss(model, ids, start)[0], rel_tol=1e-5):
                raise RuntimeError("the prefix backend does not reproduce sparse_cp with the whole sequence as prefix.")
        for i, ((ids, start), row) in enumerate(zip(data, rows)):
            t0 = time.perf_counter()
            for variant in variants:
                if variant in row:
                    continue
                hf_sparse_cp.configure(model, cfg, select=False)
                if variant == "dense":
                    model.set_attn_implementation("sdpa")
                elif variant == "sparse_prefix_only":
                    prefix.prefix = start
                    model.set_attn_implementation(PREFIX_BACKEND)
                else:
                    model.set_attn_implementation(hf_sparse_cp.BACKEND_NAME)
                    if variant.startswith("sparse_causal_chunks_"):
                        chunk = int(variant.rsplit("_", 1)[1])
                        hf_sparse_cp.configure(model, dataclasses.replace(cfg, estimation="causal_chunks",
                                                                          estimation_chunk=chunk), select=False)
                row[variant] = answer_loss(model, ids, start)
            print(f"prompt {i}: {row} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
    finally:
        model.set_attn_implementation("sdpa")
        upstream.unregister(AttentionInterface, PREFIX_BACKEND)
        upstream.unregister(AttentionMaskInterface, PREFIX_BACKEND)
        hf_sparse_cp.unpatch()
    summary = {}
    print(f"{'variant':<26} {'answer loss':>11} {'accuracy':>8}")
    for variant in variants:
        loss = sum(r[variant][0] for r in rows) / len(rows)
        acc = sum(r[variant][1] for r in rows) / len(rows)
        summary[variant] = {"answer_loss": loss, "answer_accuracy": acc}
        print(f"{variant:<26} {loss:11.4f} {acc:8.3f}")
    report = {**environment("cpu"), "settings": dataclasses.asdict(args), "config": cfg.to_dict(),
              "prompts": len(rows), "rows": rows, "summary": summary,
              "reused": {"from": Path(args.reuse).name, "variants": reused} if args.reuse else None}
    write_report(report, RESULTS_DIR, "estimation-lookahead", args.output)
    return report


if __name__ == "__main__":
    main()
