"""A model card that describes sparse long-context training: `write_sparse_model_card`.

The stock `Trainer.create_model_card` writes README.md from the training arguments alone, so a run with
the plugin gets a card that misstates two things and omits the rest:

* `total_train_batch_size` is `per-device batch x world size x accumulation`: under context parallelism
  every rank of a CP group trains the same sequence, so it counts each sequence `cp_size` times;
* the optimizer line names `--optim` (AdamW) when SMET stood in for it.

`write_sparse_model_card` calls the stock card, corrects those lines, adds the plugin's tags to the YAML
front matter and appends a "Sparse long-context training" section: sequence length, the sparse pattern,
the mean kept fraction per layer from the Trainer's log history (with a plot saved beside the card),
context parallelism, SMET and throughput.
"""

from __future__ import annotations

import functools
import json
import logging
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from transformers import DataCollatorWithFlattening, Trainer

from ..config import MODEL_CONFIG_ATTRIBUTE, SparseAttentionConfig
from ..distributed import ParallelDims
from ..smet import SMETConfig
from ..smet.factory import SMETOptimizerFactory
from .callbacks import unwrap_smet
from .kept_fraction import PLOT_EXTRA, kept_fraction_figure, mean_kept_fraction_per_layer

logger = logging.getLogger(__name__)

TAGS = ("hf-sparse-cp", "long-context", "sparse-attention")
KEPT_FRACTION_PLOT = "sparse_kept_fraction.png"
SECTION_TITLE = "## Sparse long-context training"

# Lines of the stock card's hyperparameter list that this module rewrites.
_TOTAL_BATCH = re.compile(r"^- total_train_batch_size: .*$", re.MULTILINE)
_TOTAL_EVAL_BATCH = re.compile(r"^- total_eval_batch_size: .*$", re.MULTILINE)
_OPTIMIZER = re.compile(r"^- optimizer: .*$", re.MULTILINE)
# Sentences of the stock card that are wrong for a model built from a config (its `_name_or_path` is "": an
# empty base-model link) and for an in-memory dataset (no builder name: "the None dataset").
_STOCK_FIXES = (("This model is a fine-tuned version of [](https://huggingface.co/) on",
                 "This model was trained from scratch on"),
                (" on the None dataset.", " on an unknown dataset."))


def smet_config_of(trainer: Trainer) -> SMETConfig | None:
    """The SMET config `trainer` trains (or trained) with, or None when its optimizer is not SMET."""
    smet = unwrap_smet(trainer.optimizer)
    if smet is not None:
        return smet.config
    factory, kwargs = trainer.optimizer_cls_and_kwargs or (None, {})
    return kwargs["config"] if factory is SMETOptimizerFactory else None


def distinct_train_batch_size(trainer: Trainer, cp_size: int) -> int:
    """Distinct sequences per optimizer step: the Trainer's total batch size, counted once per CP group.

    The Trainer divides by its `get_cp_size()`, which is the CP degree while the plugin's context
    parallelism is attached (or accelerate's ParallelismConfig sets it) and 1 otherwise; the ratio
    makes the count right either way.
    """
    return trainer.get_total_train_batch_size(trainer.args) * trainer.get_cp_size() // cp_size


def _sparse_config(trainer: Trainer) -> SparseAttentionConfig | None:
    raw = getattr(getattr(trainer.model, "config", None), MODEL_CONFIG_ATTRIBUTE, None)
    return None if raw is None else SparseAttentionConfig.from_dict(raw)


def _describe_pattern(config: SparseAttentionConfig) -> str:
    if config.pattern == "dense":
        text = "dense (exact causal attention through the block engine)"
    else:
        if config.budget_mode == "topk":
            budget = f"top-k: {config.vertical_topk} key columns and {config.slash_topk} diagonals per head"
        elif config.budget_mode == "mass":
            budget = (f"mass: key columns and block diagonals by estimated mass per block of work until "
                      f"{config.mass_target} of each head's attention"
                      + (f", and those with at least {config.mass_threshold} of their queries' attention per block"
                         if config.mass_threshold else "") + f" (at most {config.vertical_cap} columns)")
        else:
            budget = (f"top-p: {config.vertical_topp} / {config.slash_topp} of the score mass in key columns / "
                      f"diagonals (at most {config.vertical_cap} / {config.slash_cap}) per head")
        if config.estimation == "causal_chunks":
            estimated = (f"estimated causally at every call: each chunk of {config.estimation_chunk} tokens from the "
                         f"last {config.last_q} queries before it, the first chunk dense")
        else:
            estimated = f"estimated from the last {config.last_q} queries at every call"
        if config.sample_groups:
            estimated += f" and {config.sample_groups} groups of {config.sample_group_size} queries along the document"
        text = (f"vertical-slash (MTraining), {budget}, plus {config.sink_tokens} sink tokens and a local window of "
                f"{config.local_window}; {estimated}; documents under {config.min_seq_len:,} tokens dense")
    text += f"; blocks of {config.block_size} tokens"
    if config.dense_first_layers:
        text += f"; first {config.dense_first_layers} layer(s) dense"
    if config.layer_overrides:
        text += f"; per-layer overrides `{json.dumps(config.layer_overrides)}`"
    return text


def _describe_parallelism(trainer: Trainer, parallel: ParallelDims | None, cp_size: int) -> str:
    world = trainer.args.world_size
    if cp_size == 1:
        return "off (one process)" if world == 1 else f"off ({world} data-parallel processes, whole sequences each)"
    if parallel is None:
        return f"CP {cp_size} x DP {world // cp_size} ({world} processes); sharding and ring not recorded"
    ring = "flat ring"
    if parallel.hierarchical:
        ring = (f"hierarchical ring ({parallel.topology.num_nodes} nodes x {parallel.topology.node_size} ranks, "
                "the outer ring hidden behind the inner one)")
    return (f"CP {cp_size} x DP {parallel.dp_size} ({parallel.world_size} processes): each sequence split over "
            f"{cp_size} ranks, {parallel.sharding} sharding, {ring}")


def _describe_smet(config: SMETConfig, optim: str, args) -> str:
    return (f"SMET ({config.mode}, density {config.density}, blocks of {config.block_size} columns, topology update "
            f"every {config.update_interval} steps, {config.regrowth_rule} regrowth) over {optim} with "
            f"betas=({args.adam_beta1},{args.adam_beta2}) and epsilon={args.adam_epsilon}")


def _throughput(trainer: Trainer, max_length: int | None) -> str:
    final = next((log for log in reversed(trainer.state.log_history) if "train_runtime" in log), None)
    if final is None:
        return "not measured (the card was written before training ended)"
    if "train_tokens_per_second" in final:  # with include_num_input_tokens_seen (counted once per CP group)
        return f"{final['train_tokens_per_second']:,.0f} tokens/s (input tokens counted by the Trainer)"
    samples = final.get("train_samples_per_second")
    if samples is None or max_length is None:
        return "not recorded"
    # the Trainer's samples per second count distinct samples (its batch size is CP-aware); a flattening
    # collator packs each device batch of documents into one sequence of max_length tokens
    per_sequence = trainer.args.train_batch_size if isinstance(trainer.data_collator, DataCollatorWithFlattening) else 1
    return (f"{samples * max_length / per_sequence:,.0f} tokens/s (estimated: {samples:g} samples/s x "
            f"{max_length:,} tokens{f' / {per_sequence} documents per sequence' if per_sequence > 1 else ''})")


def _draw_plot(trainer: Trainer, output_dir: Path) -> str:
    """Save the kept-fraction plot beside the card; the markdown that shows it (or says why it is missing)."""
    try:
        figure = kept_fraction_figure(trainer.state.log_history,
                                      title=f"Sparse attention during training ({output_dir.name})")
    except ImportError:
        logger.warning("The model card's kept-fraction plot needs matplotlib: %s", PLOT_EXTRA)
        return f"(The plot of the kept fraction per layer needs matplotlib: `{PLOT_EXTRA}`.)"
    figure.savefig(output_dir / KEPT_FRACTION_PLOT, dpi=120)
    return f"![Kept fraction of attention blocks per layer over training]({KEPT_FRACTION_PLOT})"


def _section(trainer: Trainer, parallel: ParallelDims | None, max_length: int | None, cp_size: int,
             smet: SMETConfig | None, optimizer_line: str, output_dir: Path) -> str:
    sparse = _sparse_config(trainer)
    length = "not recorded" if max_length is None else f"{max_length:,} tokens"
    if isinstance(trainer.data_collator, DataCollatorWithFlattening):
        length += " (documents packed into each sequence, attention within each document only)"
    rows = [
        ("sequence length", length),
        ("attention", "dense (the sparse_cp backend was not used)" if sparse is None
         else f"`sparse_cp`: {_describe_pattern(sparse)}"),
        ("context parallelism", _describe_parallelism(trainer, parallel, cp_size)),
        ("total train batch size", f"{distinct_train_batch_size(trainer, cp_size)} distinct sequences per optimizer "
         "step"),
        ("optimizer", optimizer_line),
        ("throughput", _throughput(trainer, max_length)),
    ]
    lines = [SECTION_TITLE, "",
             "Trained with `hf-sparse-cp`: dynamic sparse attention, context parallelism and the SMET sparse "
             "optimizer for the stock `Trainer`.", "",
             "| | |", "|---|---|", *(f"| {name} | {value} |" for name, value in rows), ""]

    means = mean_kept_fraction_per_layer(trainer.state.log_history)
    lines += ["### Kept fraction of attention blocks", ""]
    if means:
        overall = sum(means.values()) / len(means)
        lines += [f"Computed blocks over the blocks of the causal triangle, logged by the Trainer "
                  f"(`sparse/kept_fraction/layer_NN`) and averaged over the logged steps: **{overall:.3f}** over "
                  "all layers.", "", "| layer | mean kept fraction |", "|---|---|",
                  *(f"| {layer} | {value:.3f} |" for layer, value in means.items()), "",
                  _draw_plot(trainer, output_dir), ""]
    else:
        lines += ["Not logged (sparsity logging is `--log_sparsity`, added by `attach_to_trainer`).", ""]

    if sparse is not None:
        lines += ["Sparse attention config (saved in config.json as `sparse_attention`):", "", "```yaml",
                  yaml.safe_dump(sparse.to_dict(), sort_keys=False).rstrip(), "```", ""]
    if smet is not None:
        lines += ["SMET config:", "", "```yaml", yaml.safe_dump(smet.to_dict(), sort_keys=False).rstrip(), "```", ""]
    lines += ["### Loading", "",
              "The weights are a standard transformers checkpoint: the model loads and generates without "
              "`hf-sparse-cp`, with any attention implementation (e.g. `attn_implementation=\"sdpa\"`). To train on "
              "with the sparse pattern, call `hf_sparse_cp.patch()` and load it with "
              "`attn_implementation=\"sparse_cp\"`.", ""]
    return "\n".join(lines)


def _add_tags(card: str) -> str:
    """`card` with `TAGS` added to the `tags` of its YAML front matter (created when it has none)."""
    if card.startswith("---\n") and "\n---\n" in card[3:]:
        end = card.index("\n---\n", 3)
        metadata, body = yaml.safe_load(card[4:end]) or {}, card[end + 5:]
    else:
        metadata, body = {}, card
    tags = list(metadata.get("tags") or [])
    metadata["tags"] = tags + [tag for tag in TAGS if tag not in tags]
    return f"---\n{yaml.dump(metadata, sort_keys=False)}---\n{body}"


def write_sparse_model_card(
    trainer: Trainer,
    *,
    parallel: ParallelDims | None = None,
    max_length: int | None = None,
    create_card: Callable[..., Any] | None = None,
    **create_model_card_kwargs: Any,
) -> Path | None:
    """Write the model card of a run with the plugin into `trainer.args.output_dir` (README.md).

    Args:
        trainer: the Trainer, after `train()` (before, the card has no kept fraction or throughput).
        parallel: what `attach_to_trainer` returned: CP size, sharding and ring (None: the CP size the
            Trainer reports, without sharding and ring).
        max_length: tokens per training sequence (the packed length when a flattening collator packs
            documents); None: not stated, and no throughput estimate.
        create_card: writes the stock card, called with `create_model_card_kwargs`; default
            `Trainer.create_model_card` (the base method: a subclass that overrides `create_model_card` to
            call this function passes `super().create_model_card`).
        create_model_card_kwargs: `Trainer.create_model_card`'s arguments (language, license, tags,
            model_name, finetuned_from, tasks, dataset_tags, dataset, dataset_args).

    Returns:
        The path of README.md on the main process (`sparse_kept_fraction.png` beside it when the kept
        fraction was logged and matplotlib is installed), None on the other processes, which write nothing.
    """
    create_card = functools.partial(Trainer.create_model_card, trainer) if create_card is None else create_card
    create_card(**create_model_card_kwargs)
    if not trainer.is_world_process_zero():
        return None
    output_dir = Path(trainer.args.output_dir)
    path = output_dir / "README.md"
    card = path.read_text(encoding="utf-8")
    card = card.split(f"\n{SECTION_TITLE}\n", 1)[0].rstrip("\n") + "\n"  # a card amended before: amend anew
    cp_size = parallel.cp_size if parallel is not None else trainer.get_cp_size()
    if cp_size > 1:
        total = distinct_train_batch_size(trainer, cp_size)
        note = f" (distinct sequences; each is split over {cp_size} context-parallel ranks)"
        card = _TOTAL_BATCH.sub(lambda _: f"- total_train_batch_size: {total}{note}", card)
        total_eval = trainer.args.eval_batch_size * trainer.args.world_size // cp_size
        card = _TOTAL_EVAL_BATCH.sub(lambda _: f"- total_eval_batch_size: {total_eval}", card)
    smet = smet_config_of(trainer)
    optim = getattr(trainer.args.optim, "value", trainer.args.optim)
    optimizer_line = optim if smet is None else _describe_smet(smet, optim, trainer.args)
    if smet is not None:
        card = _OPTIMIZER.sub(lambda _: f"- optimizer: {optimizer_line}", card)
    for wrong, right in _STOCK_FIXES:
        card = card.replace(wrong, right)
    card = _add_tags(card)
    card += "\n" + _section(trainer, parallel, max_length, cp_size, smet, optimizer_line, output_dir)
    path.write_text(card, encoding="utf-8")
    return path
