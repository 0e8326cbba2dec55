"""A model card that describes sparse long-context training: `write_sparse_model_card`.

The stock `Trainer.create_model_card` writes README.md from the training arguments alone, so a run with
the plugin gets a card that misstates three things and omits the rest:

* `total_train_batch_size` is `per-device batch x world size x accumulation`: under context parallelism
  every rank of a CP group trains the same sequence, so it counts each sequence `cp_size` times;
* the optimizer line names `--optim` (AdamW) when SMET stood in for it;
* the distributed type says "multi-GPU" for CPU processes joined with gloo.

`write_sparse_model_card` calls the card writer of the Trainer class (the stock one, or TRL's), corrects
those lines, makes its YAML front matter one the Hub accepts, with the plugin's tags (`card_metadata.py`), and
appends a "Sparse long-context training" section that states only what the run did: base model and data when known,
sequence length, the sparse pattern, the distributed set-up (CPU/gloo or GPU/NCCL processes, FSDP), context
parallelism and SMET when used, batch size, optimizer, throughput, the losses per logging step (and every
evaluation's metrics: the stock card's "Training results" gives way to it), the mean kept fraction per layer (with a
plot saved beside the card), the versions of the packages that trained it, and how to load the model
(`card_quick_start.py`; a PEFT run saves only its adapter: the card then holds the pattern and loads the adapter onto
its base model).
"""

from __future__ import annotations

import functools
import importlib.metadata
import inspect
import json
import logging
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch
import yaml
from transformers import DataCollatorWithFlattening, Trainer

from ..backends import PLOT_EXTRA
from ..config import BACKEND_NAME, SparseAttentionConfig, language_config
from ..distributed import ParallelDims
from ..integration import fsdp_class_names, upstream
from ..integration.given import require_trainer
from ..integration.stats import PEAK_MEMORY, TOKENS_PER_SECOND
from ..smet import SMETConfig, unwrap_smet
from ..smet.factory import SMETOptimizerFactory
from .card_metadata import FROM_SCRATCH, GENERATOR, hub_metadata, is_hub_id, split_front_matter
from .card_quick_start import peft_model_of, quick_start
from .kept_fraction_figure import kept_fraction_figure, mean_kept_fraction_per_layer

logger = logging.getLogger(__name__)

KEPT_FRACTION_PLOT = "sparse_kept_fraction.png"
SECTION_TITLE = "## Sparse long-context training"
FRAMEWORK_VERSIONS = "### Framework versions"
# The card's own list of package versions (the stock card's and TRL's), up to the next blank line or heading.
_FRAMEWORK_VERSIONS = re.compile(rf"^({re.escape(FRAMEWORK_VERSIONS)}\n\n)((?:- [^\n]*\n)*- [^\n]*)", re.MULTILINE)
# How the stock card (and TRL's) name the packages.
_VERSION_NAMES = {"transformers": "Transformers", "torch": "Pytorch", "accelerate": "Accelerate", "trl": "TRL",
                  "peft": "PEFT"}

# Lines of the stock card's hyperparameter list that this module rewrites.
_TOTAL_BATCH = re.compile(r"^- total_train_batch_size: .*$", re.MULTILINE)
_TOTAL_EVAL_BATCH = re.compile(r"^- total_eval_batch_size: .*$", re.MULTILINE)
_OPTIMIZER = re.compile(r"^- optimizer: .*$", re.MULTILINE)
_DISTRIBUTED_TYPE = re.compile(r"^- distributed_type: multi-GPU$", re.MULTILINE)
# Sentences of the stock card that are wrong for a model built from a config (its `_name_or_path` is "": an
# empty base-model link) and for an in-memory dataset (no builder name: "the None dataset"; a generator's).
_STOCK_FIXES = (("This model is a fine-tuned version of [](https://huggingface.co/) on", FROM_SCRATCH),
                (" on the None dataset.", " on an unknown dataset."),
                (f" on the {GENERATOR} dataset.", " on an unknown dataset."))
# The stock card's results (its table of evaluations, empty without one), up to its next heading: the plugin's section
# states them (the losses per step, every evaluation's metrics) under the one heading of this name.
RESULTS_TITLE = "### Training results"
_STOCK_RESULTS = re.compile(rf"^{re.escape(RESULTS_TITLE)}\n.*?(?=^#{{1,3}} |\Z)", re.MULTILINE | re.DOTALL)
# Keys of an evaluation's log that are no metric of the model (the stock card leaves them out of its table too).
_EVAL_TIMINGS = ("eval_runtime", "eval_samples_per_second", "eval_steps_per_second", "total_flos")


def smet_config_of(trainer: Trainer) -> SMETConfig | None:
    """The SMET config `trainer` trains (or trained) with, or None when its optimizer is not SMET."""
    smet = unwrap_smet(trainer.optimizer)
    if smet is not None:
        return smet.config
    factory, kwargs = trainer.optimizer_cls_and_kwargs or (None, {})
    return kwargs["config"] if factory is SMETOptimizerFactory else None


class CardStage(NamedTuple):
    """A stage of a context-length curriculum (`--cp_schedule`) as the card states it: from optimizer step
    `from_step` on, samples of `seq_len` tokens on the CP layout `parallel`."""

    from_step: int
    seq_len: int
    parallel: ParallelDims


def _stage_batches(trainer: Trainer, stages: Sequence[CardStage], unit: str = "", evaluation: bool = False) -> str:
    """Distinct sequences per optimizer step of every stage: '2 from step 0, 1 from step 2' (`unit` after the first
    number); where the collator packs each device batch into one row (`_packs_documents`), the examples and the
    sequences they are packed into: '4 from step 0 (packed into 2), 2 from step 2 (packed into 1)'. With
    `evaluation`, per evaluation batch (the evaluation loader follows the stage's data-parallel degree)."""
    device_batch = trainer.args.eval_batch_size if evaluation else trainer.args.per_device_train_batch_size
    rows = 1 if evaluation else trainer.args.gradient_accumulation_steps  # (each data-parallel group's, a step)
    packs = _packs_documents(trainer)

    def stage(i: int, s: CardStage) -> str:
        packed = f" (packed into {rows * s.parallel.dp_size})" if packs else ""
        return f"{device_batch * rows * s.parallel.dp_size}{unit if i == 0 else ''} from step {s.from_step}{packed}"

    return ", ".join(stage(i, s) for i, s in enumerate(stages))


def _batch_unit(trainer: Trainer) -> str:
    """What the card's batch sizes count: distinct sequences, or the examples a packing collator packs into them."""
    return "examples" if _packs_documents(trainer) else "distinct sequences"


def _describe_stages(schedule: str | None, stages: Sequence[CardStage]) -> str:
    def layout(p: ParallelDims) -> str:
        return f"without CP (DP {p.dp_size})" if p.cp_size == 1 else f"on {p.describe()}"

    return f"--cp_schedule {schedule}: " + "; ".join(
        f"from step {s.from_step}, {s.seq_len}-token samples {layout(s.parallel)}" for s in stages)


def distinct_train_batch_size(trainer: Trainer, cp_size: int) -> int:
    """Distinct sequences per optimizer step: the Trainer's total batch size, counted once per CP group.

    The Trainer divides by its `get_cp_size()`, which is the CP degree while the plugin's context
    parallelism is attached (or accelerate's ParallelismConfig sets it) and 1 otherwise; the ratio
    makes the count right either way.
    """
    return trainer.get_total_train_batch_size(trainer.args) * trainer.get_cp_size() // cp_size


def _sparse_config(trainer: Trainer) -> SparseAttentionConfig | None:
    """The pattern the model attends with: the one its config stores, where its (language model's) attention runs
    `sparse_cp`. A model loaded from an earlier run's folder stores that run's pattern (config.json's
    `sparse_attention`) whatever this run attends with: a dense run of it (--sparse_attention false, sdpa) had a card
    saying it trained with that pattern."""
    config = getattr(trainer.model, "config", None)
    if config is None or upstream.attn_implementation(language_config(config)) != BACKEND_NAME:
        return None
    return SparseAttentionConfig.stored_on(config)


def _describe_pattern(config: SparseAttentionConfig) -> str:
    if config.pattern == "dense":
        text = "dense (exact causal attention through the block engine)"
    else:
        budget, scoring = config.budget.describe(), config.scoring
        if config.estimation == "causal_chunks":
            estimated = (f"estimated causally at every call: each chunk of {config.estimation_chunk} tokens from the "
                         f"last {scoring.last_q} queries before it, the first chunk dense")
        else:
            estimated = f"estimated from the last {scoring.last_q} queries at every call"
        if scoring.sample_groups:
            estimated += (f" and {scoring.sample_groups} groups of {scoring.sample_group_size} queries along the "
                          "document")
        text = (f"vertical-slash (MTraining), {budget}, plus {config.sink_tokens} sink tokens and a local window of "
                f"{config.local_window}; {estimated}")
        if config.min_seq_len:
            text += f"; documents under {config.min_seq_len:,} tokens dense"
    text += f"; blocks of {config.block_size} tokens"
    if config.attention_engine != "auto":  # (auto: the engine chosen per call, the kernels where they run)
        text += f"; attention engine `{config.attention_engine}`"
    if config.dense_first_layers:
        text += f"; first {config.dense_first_layers} layer(s) dense"
    if config.layer_overrides:
        text += f"; per-layer overrides `{json.dumps(config.layer_overrides)}`"
    return text


def _processes(trainer: Trainer) -> tuple[int, str, str | None]:
    """(processes, "CPU" or "GPU" (the device type), the process group's backend or None)."""
    world = trainer.args.world_size
    kind = "GPU" if trainer.args.device.type == "cuda" else trainer.args.device.type.upper()
    backend = torch.distributed.get_backend() if world > 1 and torch.distributed.is_initialized() else None
    return world, kind, backend


def _describe_setup(trainer: Trainer, cp_size: int) -> str:
    world, kind, backend = _processes(trainer)
    text = f"{world} {kind} process{'es' if world > 1 else ''}" + (f" ({backend})" if backend else "")
    if world > 1 and not getattr(trainer, "is_fsdp_enabled", False):
        # (with CP the ranks' split is the context-parallelism row's: DDP then syncs the gradients of CP x DP ranks)
        text += ", data parallel (DDP)" if cp_size == 1 else ", gradients averaged over the processes by DDP"
    if getattr(trainer, "is_fsdp_enabled", False):
        version = 2 if getattr(trainer.accelerator, "is_fsdp2", False) else trainer.args.fsdp_config.get(
            "fsdp_version", 1)
        text += f", FSDP{version}: parameters, gradients and optimizer state sharded over the processes"
    return text


def _dp_size(trainer: Trainer, parallel: ParallelDims | None, cp_size: int) -> int:
    """The data-parallel degree of the run: `parallel`'s; not given, that of accelerate's ParallelismConfig, whose
    mesh (dp_replicate x dp_shard x cp x tp) set `cp_size` (the processes over `cp_size` counted its tensor-parallel
    ranks as data-parallel ones); without one, that of CP groups of `cp_size` over the Trainer's processes."""
    if parallel is not None:
        return parallel.dp_size
    pc = getattr(trainer.accelerator, "parallelism_config", None)
    if pc is not None:
        return pc.data_parallel_size
    return ParallelDims.dp_size_for(trainer.args.world_size, cp_size)


def _describe_parallelism(trainer: Trainer, parallel: ParallelDims | None, cp_size: int) -> str:
    if parallel is None:
        world = trainer.args.world_size
        tp = getattr(getattr(trainer.accelerator, "parallelism_config", None), "tp_size", 1)
        return (f"CP {cp_size} x DP {_dp_size(trainer, None, cp_size)}{f' x TP {tp}' if tp > 1 else ''} ({world} "
                "processes); sharding and ring not recorded")
    return parallel.describe()


def _describe_smet(config: SMETConfig, optim: str, args, trained: float | None = None) -> str:
    """SMET's settings; `trained`: the density its weights train at, stated where whole blocks per row move it."""
    density = f"density {config.density}, blocks of {config.block_size} columns"
    if trained is not None and abs(trained - config.density) > 1e-6 * config.density:
        density = (f"density {config.density} asked, {trained:.3g} trained (whole blocks of {config.block_size} "
                   "columns per row, at least one)")
    return (f"SMET ({config.mode}, {density}, topology update "
            f"every {config.update_interval} steps, {config.regrowth_rule} regrowth) over {optim} with "
            f"betas=({args.adam_beta1},{args.adam_beta2}) and epsilon={args.adam_epsilon}")


def _smet_settings(config: SMETConfig) -> dict[str, Any]:
    """The config as saved, with the regrowth rule the mode chose filled in (the YAML says what the table says)."""
    return config.to_dict() | {"regrowth": config.regrowth_rule}


def _base_model(trainer: Trainer, given: str | None) -> str:
    name = given or getattr(getattr(trainer.model, "config", None), "_name_or_path", "") or ""
    if not name:
        return "none: trained from a config (random initialization)"
    return f"`{name}`" + ("" if is_hub_id(name) else " (a local model)")


def _training_data(trainer: Trainer, dataset_tags: Any) -> str | None:
    """The dataset's name (given to the card, or recorded by `datasets`) and its size, when known: its rows are
    examples the collator packs into sequences where it packs a batch into one row (`_packs_documents`)."""
    data = trainer.train_dataset
    info = getattr(data, "info", None)
    name = dataset_tags or getattr(info, "dataset_name", None) or getattr(info, "builder_name", None)
    name = None if name == GENERATOR else name
    if isinstance(name, list | tuple):
        name = ", ".join(map(str, name))
    try:
        size = None if data is None else f"{len(data):,} training " + (
            f"examples (the collator packs each device batch of {trainer.args.per_device_train_batch_size} into one "
            "sequence)" if _packs_documents(trainer) else "sequences")
    except TypeError:  # an iterable dataset
        size = None
    parts = [f"`{name}`" if name else None, size]
    return ", ".join(part for part in parts if part) or None


def _merge_versions(card: str, versions: dict[str, str]) -> str:
    """`card` with the packages of `versions` its "Framework versions" section lacks added to it, in its own
    style (the stock card's `- Transformers 5.24.0`, TRL's `- TRL: 1.16.0`); a card without one gets one."""
    names = {package: _VERSION_NAMES.get(package, package) for package in versions}
    match = _FRAMEWORK_VERSIONS.search(card)
    if match is None:
        listed = "".join(f"- {names[p]} {v}\n" for p, v in versions.items())
        return card.rstrip("\n") + f"\n\n{FRAMEWORK_VERSIONS}\n\n{listed}"
    lines = match.group(2).splitlines()
    separator = ": " if any(": " in line for line in lines) else " "
    present = {line[2:].split(separator, 1)[0].strip().lower() for line in lines}
    added = [f"- {names[p]}{separator}{v}" for p, v in versions.items() if names[p].lower() not in present]
    return card[:match.end(2)] + "".join(f"\n{line}" for line in added) + card[match.end(2):]


def _versions(trainer: Trainer) -> dict[str, str]:
    """The versions of the packages that trained the model: TRL when the Trainer class is TRL's, PEFT when
    the model is a PEFT model."""
    names = ["hf-sparse-cp", "transformers", "accelerate", "torch"]
    if any(cls.__module__.startswith("trl.") for cls in type(trainer).__mro__):
        names.append("trl")
    if peft_model_of(trainer) is not None:
        names.append("peft")
    return {name: importlib.metadata.version(name) for name in names}


def _results(log_history: list[dict], first_step: int = 0) -> list[str]:
    """The losses per logging step, the final loss and every evaluation's metrics, from the Trainer's log history. The
    Trainer's final loss is the mean over the steps of its last `train()` call: after `first_step` where it resumed
    there."""
    train = [log for log in log_history if "loss" in log]
    evals = [log for log in log_history if "eval_loss" in log]
    final = next((log for log in reversed(log_history) if "train_loss" in log), None)
    if not train and not evals and final is None:
        return ["Not logged (the card was written before the first logging step)."]
    # (#50: a run that ended before its first logging step was said to have a card written before it, its final loss
    # left out)
    lines = ["| step | epoch | training loss |", "|---|---|---|",
             *(f"| {log['step']} | {log.get('epoch', 0):.3g} | {log['loss']:.4f} |" for log in train)] if train else \
        ["No step's loss logged (the run ended before its first logging step, --logging_steps)."]
    if final is not None:
        steps = f"step {final['step']}" if final["step"] == first_step + 1 else \
            f"steps {first_step + 1}-{final['step']}"
        over = "the run" if not first_step else f"{steps}, trained after resuming from step {first_step}"
        lines += ["", f"Final training loss (mean over {over}): **{final['train_loss']:.4f}** after "
                  f"{final['step']} steps."]
    if evals:
        # every metric an evaluation logged (the stock card's table showed them: its section gives way to this one)
        metrics = list(dict.fromkeys(key for log in evals for key in log
                                     if key.startswith("eval_") and key not in _EVAL_TIMINGS))
        lines += ["", f"| step | {' | '.join(key.replace('_', ' ') for key in metrics)} |",
                  "|---|" + "---|" * len(metrics),
                  *(f"| {log['step']} | {' | '.join(_metric(log.get(key)) for key in metrics)} |" for log in evals)]
    return lines


def _metric(value: Any) -> str:
    """A logged metric for a table: 4 decimals, a count (a float holding an integer, as TRL's num_tokens) without."""
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{int(value):,}" if value.is_integer() else f"{value:.4f}"
    return str(value)


def _throughput(trainer: Trainer, max_length: int | None) -> str:
    measured = [log[TOKENS_PER_SECOND] for log in trainer.state.log_history if TOKENS_PER_SECOND in log]
    peaks = [log[PEAK_MEMORY] for log in trainer.state.log_history if PEAK_MEMORY in log]
    if measured:
        peak = f"; peak memory {max(peaks):.2f} GiB per process" if peaks else ""
        return (f"{sum(measured) / len(measured):,.0f} tokens/s (measured: real tokens per second of wall time over "
                f"all processes, the mean of {len(measured)} logged interval(s)){peak}")
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


def _packs_documents(trainer: Trainer) -> bool:
    """Whether the collator packs a batch's documents into one row (transformers' flattening, TRL's padding-free)."""
    collator = trainer.data_collator
    return isinstance(collator, DataCollatorWithFlattening) or bool(getattr(collator, "padding_free", False))


def _sequence_length(max_length: int | None, longest_trained: int | None) -> str:
    """The card's sequence length: the one the run was set to, and the longest it trained where they differ (a
    length set above the data's is not what the model saw)."""
    if longest_trained is None or longest_trained == max_length:
        return "not recorded" if max_length is None else f"{max_length:,} tokens"
    if max_length is None:
        return f"{longest_trained:,} tokens (the longest sequence trained)"
    return f"{max_length:,} tokens set; the longest sequence trained held {longest_trained:,}"


def _train_batch(trainer: Trainer, cp_size: int) -> str:
    """The card's total train batch size: distinct sequences per optimizer step, or, where the collator packs each
    device batch into one row, the examples it packs and the sequences they make (#50: it called the examples
    sequences, a pack's worth of them per sequence of the stated length)."""
    total = distinct_train_batch_size(trainer, cp_size)
    if not _packs_documents(trainer):
        return f"{total} distinct sequences per optimizer step"
    return f"{total} examples per optimizer step, {_packed_into(trainer, total)}"


def _packed_into(trainer: Trainer, examples: int) -> str:
    """The sequences a packing collator makes of `examples` training examples, one per device batch."""
    rows = max(1, examples // trainer.args.per_device_train_batch_size)
    return f"packed into {rows} distinct sequence{'s' * (rows != 1)}"


def _section(trainer: Trainer, parallel: ParallelDims | None, max_length: int | None, longest_trained: int | None,
             cp_size: int, smet: SMETConfig | None, optimizer_line: str, output_dir: Path,
             card_kwargs: dict[str, Any], license_: str | None, cp_schedule: str | None = None,
             cp_stages: Sequence[CardStage] = (), first_step: int = 0) -> str:
    sparse = _sparse_config(trainer)
    length = _sequence_length(max_length, longest_trained)
    if _packs_documents(trainer):
        length += " (documents packed into each sequence, attention within each document only)"
    over = f"up to {cp_size} ranks (a context-length curriculum)" if cp_stages else f"{cp_size} ranks"
    used = (["dynamic sparse attention"] if sparse is not None else []) + (
        [f"context parallelism over {over}"] if cp_size > 1 else []) + (
        ["the SMET sparse optimizer"] if smet is not None else [])
    data = _training_data(trainer, card_kwargs.get("dataset_tags") or card_kwargs.get("dataset_name")
                          or card_kwargs.get("dataset"))
    rows = [("base model", _base_model(trainer, card_kwargs.get("base_model") or card_kwargs.get("finetuned_from"))),
            ("training data", data), ("sequence length", length),
            ("attention", "dense (the sparse_cp backend was not used)" if sparse is None
             else f"`sparse_cp`: {_describe_pattern(sparse)}"),
            ("distributed set-up", _describe_setup(trainer, cp_size)),
            ("context parallelism", _describe_stages(cp_schedule, cp_stages) if cp_stages
             else _describe_parallelism(trainer, parallel, cp_size) if cp_size > 1 else None),
            ("total train batch size", _stage_batches(trainer, cp_stages, f" {_batch_unit(trainer)} per optimizer step")
             if cp_stages else _train_batch(trainer, cp_size)),
            ("optimizer", optimizer_line),
            ("throughput", _throughput(trainer, max_length)),
            ("license", license_)]
    trainer_name = next(cls.__name__ for cls in type(trainer).__mro__ if not cls.__module__.startswith(
        "hf_sparse_cp."))
    lines = [SECTION_TITLE, "",
             f"Trained with `hf-sparse-cp` ({', '.join(used) or 'no plugin feature on'}) under the `{trainer_name}`.",
             "", "| | |", "|---|---|", *(f"| {name} | {value} |" for name, value in rows if value is not None), "",
             RESULTS_TITLE, "", *_results(trainer.state.log_history, first_step), ""]

    means = mean_kept_fraction_per_layer(trainer.state.log_history)
    lines += ["### Kept fraction of attention blocks", ""]
    if means:
        overall = sum(means.values()) / len(means)
        lines += [f"Computed blocks over the blocks dense attention computes on the same batches (1.0: dense; "
                  "packed documents and sliding windows count only the blocks dense attention visits), logged by "
                  f"the Trainer (`sparse/kept_fraction/layer_NN`) and averaged over the logged steps: "
                  f"**{overall:.3f}** over all layers.", "", "| layer | mean kept fraction |", "|---|---|",
                  *(f"| {layer} | {value:.3f} |" for layer, value in means.items()), "",
                  _draw_plot(trainer, output_dir), ""]
    else:
        # (#50: a plot an earlier run's card drew in this folder stayed beside this card, and went to the Hub with it)
        (output_dir / KEPT_FRACTION_PLOT).unlink(missing_ok=True)
        lines += ["None: dense attention computes every block (a kept fraction of 1.0)." if sparse is None else
                  "Not logged (sparsity logging is `--sparse_log_sparsity`, added by `attach_to_trainer`).", ""]

    if sparse is not None:
        saved = ("not saved with the adapter: it has no config.json; this card holds it" if peft_model_of(trainer)
                 else "saved in config.json as `sparse_attention`")
        lines += [f"Sparse attention config ({saved}):", "", "```yaml",
                  yaml.safe_dump(sparse.to_dict(), sort_keys=False).rstrip(), "```", ""]
    if smet is not None:
        lines += ["SMET config:", "", "```yaml", yaml.safe_dump(_smet_settings(smet), sort_keys=False).rstrip(), "```",
                  ""]
    lines += ["### Quick start", "", *quick_start(trainer, sparse, output_dir)]
    return "\n".join(lines)


def _accepted(create_card: Callable[..., Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The arguments of `kwargs` that `create_card` (a Trainer class's own card writer) takes: the plugin's card
    takes license, base_model and datasets for every Trainer class, TRL's writer does not."""
    parameters = inspect.signature(create_card).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return kwargs
    return {name: value for name, value in kwargs.items() if name in parameters}


def _with_task(trainer: Trainer, create_card: Callable[..., Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """`kwargs` with the task of the model's class (`fsdp_class_names.card_tasks`) where the card writer takes
    `tasks`, none is given and FSDP2 renamed the class, whose name the stock card infers the task from (else it drops
    the card's model-index results)."""
    model = trainer.model
    if (kwargs.get("tasks") is not None or "tasks" not in inspect.signature(create_card).parameters
            or fsdp_class_names.unsharded_class(model) is type(model)):
        return kwargs
    return {**kwargs, "tasks": fsdp_class_names.card_tasks(model)}


def write_sparse_model_card(
    trainer: Trainer,
    *,
    parallel: ParallelDims | None = None,
    max_length: int | None = None,
    longest_trained: int | None = None,
    cp_schedule: str | None = None,
    cp_stages: Sequence[CardStage] = (),
    first_step: int = 0,
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
        longest_trained: the most tokens of any sequence the run trained (`StepMetricsCallback.longest_trained`),
            stated beside `max_length` where they differ.
        cp_schedule, cp_stages: a context-length curriculum's schedule (its `--cp_schedule` text) and its stages
            (`CardStage`: each its start step, sample length and CP layout), stated in place of `parallel`'s.
        first_step: the step the last `train()` call started from (`StepMetricsCallback.first_step`: a resume's
            checkpoint step), whose steps alone the Trainer's final training loss averages.
        create_card: writes the stock card, called with `create_model_card_kwargs`; default
            `Trainer.create_model_card` (the base method: a subclass that overrides `create_model_card` to
            call this function passes `super().create_model_card`).
        create_model_card_kwargs: the arguments of the Trainer class's `create_model_card` (the stock one:
            language, license, tags, model_name, finetuned_from, tasks, dataset_tags, dataset, dataset_args;
            TRL's: model_name, dataset_name, tags); a license and a dataset name given here are stated.

    Returns:
        The path of README.md on the main process (`sparse_kept_fraction.png` beside it when the kept
        fraction was logged and matplotlib is installed), None on the other processes, which write nothing.
    """
    require_trainer(trainer, "write_sparse_model_card(trainer, ...)")
    create_card = functools.partial(Trainer.create_model_card, trainer) if create_card is None else create_card
    create_card(**_accepted(create_card, _with_task(trainer, create_card, create_model_card_kwargs)))
    if not trainer.is_world_process_zero():
        return None
    output_dir = Path(trainer.args.output_dir)
    path = output_dir / "README.md"
    card = path.read_text(encoding="utf-8")
    card = card.split(f"\n{SECTION_TITLE}\n", 1)[0].rstrip("\n") + "\n"  # a card amended before: amend anew
    cp_size = parallel.cp_size if parallel is not None else trainer.get_cp_size()
    if cp_stages:  # (a curriculum: each stage its own CP degree and distinct sequences per step)
        cp_size = max(s.parallel.cp_size for s in cp_stages)
        totals = (f"{_stage_batches(trainer, cp_stages)} ({_batch_unit(trainer)} per optimizer step, by cp_schedule "
                  "stage)")
        card = _TOTAL_BATCH.sub(lambda _: f"- total_train_batch_size: {totals}", card)
        evals = (f"{_stage_batches(trainer, cp_stages, evaluation=True)} ({_batch_unit(trainer)} per evaluation "
                 "batch, by cp_schedule stage)")
        card = _TOTAL_EVAL_BATCH.sub(lambda _: f"- total_eval_batch_size: {evals}", card)
    elif cp_size > 1:
        total = distinct_train_batch_size(trainer, cp_size)
        note = f" (distinct sequences; each is split over {cp_size} context-parallel ranks)"
        if _packs_documents(trainer):
            note = f" (examples, {_packed_into(trainer, total)}; each is split over {cp_size} context-parallel ranks)"
        card = _TOTAL_BATCH.sub(lambda _: f"- total_train_batch_size: {total}{note}", card)
        total_eval = trainer.args.eval_batch_size * _dp_size(trainer, parallel, cp_size)
        card = _TOTAL_EVAL_BATCH.sub(lambda _: f"- total_eval_batch_size: {total_eval}", card)
    smet = smet_config_of(trainer)
    optim = getattr(trainer.args.optim, "value", trainer.args.optim)
    built = unwrap_smet(trainer.optimizer)
    trained = None if built is None else built.trained_density()
    optimizer_line = optim if smet is None else _describe_smet(smet, optim, trainer.args, trained)
    if smet is not None:
        card = _OPTIMIZER.sub(lambda _: f"- optimizer: {optimizer_line}", card)
    world, kind, backend = _processes(trainer)
    if kind != "GPU":
        card = _DISTRIBUTED_TYPE.sub(lambda _: f"- distributed_type: multi-{kind}" + (
            f" ({backend})" if backend else ""), card)
    for wrong, right in _STOCK_FIXES:
        card = card.replace(wrong, right)
    card = _STOCK_RESULTS.sub("", card)  # (stated in the plugin's section, with the losses per step)
    card = hub_metadata(card, trainer, create_model_card_kwargs)
    license_ = split_front_matter(card)[0].get("license")
    card = _merge_versions(card, _versions(trainer))
    card += "\n" + _section(trainer, parallel, max_length, longest_trained, cp_size, smet, optimizer_line, output_dir,
                            create_model_card_kwargs, license_, cp_schedule, cp_stages, first_step)
    path.write_text(card, encoding="utf-8")
    return path
