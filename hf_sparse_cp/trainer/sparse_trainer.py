"""One switch for a stock Trainer script: `SparseTrainingArguments` and `SparseTrainer`.

A script written for `TrainingArguments` and `Trainer` changes the two class names:

    parser = HfArgumentParser(SparseTrainingArguments)       # every Trainer flag, plus the plugin's
    (args,) = parser.parse_args_into_dataclasses()
    trainer = SparseTrainer(model=model, args=args, train_dataset=data)
    trainer.train()

`SparseTrainingArguments` carries the plugin's settings as fields with help text (the sparse
attention switches, the pattern, context parallelism and SMET: the same flags as the example
script, `--vertical_topk 1024`, `--cp_size 2`, `--smet`), so `HfArgumentParser`, YAML recipes and
`accelerate launch` work as for any `TrainingArguments`. `SparseTrainer` does what the functional
API (`enable_sparse_attention`, `attach_to_trainer`, `install_smet`) does by hand: it registers and
configures the backend, opts into the lean loss, turns gradient checkpointing on at long lengths,
sets up context parallelism and SMET (and runs `--fsdp` as FSDP2 on CPU processes too, where
accelerate alone would run DDP), adds the logging callbacks, checks the launch, says at start
which layers run sparse, writes a model card that says how the model was trained, and tears the
process groups down cleanly at exit after training.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import logging
from collections.abc import Collection
from typing import Any

import torch
from transformers import Trainer, TrainingArguments

from ..config import MODEL_CONFIG_ATTRIBUTE, SparseAttentionConfig
from ..distributed import ContextParallelConfig, quiesce_process_groups
from ..files import check_field_types
from ..integration import compat
from ..reporting.model_card import write_sparse_model_card
from ..smet import SMETConfig
from ..smet.config import module_names
from .arguments import SMETArguments, SparseCPArguments, copied_fields
from .attach import attach_to_trainer, enable_sparse_attention
from .cpu_fsdp import disable_cpu_fsdp2, enable_cpu_fsdp2
from .curriculum import CurriculumArguments, parse_schedule
from .smet import install_smet

logger = logging.getLogger(__name__)

# The dataclasses whose fields SparseTrainingArguments carries, flags unchanged.
_PARTS = (SparseCPArguments, SparseAttentionConfig, ContextParallelConfig, CurriculumArguments, SMETArguments)
# One switch: the class itself asks for sparse attention, so its flag defaults to on here.
_DEFAULTS = {"sparse_attention": True}
# Not a flag (init=False): the fields the command line or a recipe gave, set by the script that parsed them
# (`arguments.explicit_fields`); they beat --sparse_config / --smet_config whatever their value.
_EXPLICIT = dataclasses.field(init=False, default=None, repr=False, compare=False)
_MAX_LENGTH = dataclasses.field(default=None, metadata={
    "help": "Tokens per training sequence. Turns gradient checkpointing on at or above "
            "--gradient_checkpointing_min_length and decides which documents reach --min_seq_len; default: the "
            "length of the training set's first sample."})


def _part(args, cls: type):
    """`cls` built from the fields of `args` that it declares."""
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})


class _PluginSettings:
    """The methods of `SparseTrainingArguments` (its fields are generated from `_PARTS`)."""

    def __post_init__(self) -> None:
        # The plugin's fields, whatever built them (the command line, a YAML/JSON file or a dict through
        # HfArgumentParser, direct construction), before anything reads them: text in a switch would be true.
        self.smet_target_modules = module_names(self.smet_target_modules)  # (as SMETConfig takes them)
        check_field_types(self, _PLUGIN_FIELDS)
        super().__post_init__()
        for part in _PARTS:  # each part validates its own fields, naming them
            _part(self, part)
        self.sparse_attention_config()

    def plugin_arguments(self) -> SparseCPArguments:
        return _part(self, SparseCPArguments)

    def pattern_flags(self) -> SparseAttentionConfig:
        """The pattern flags as given, before `--sparse_config` is read."""
        return _part(self, SparseAttentionConfig)

    def sparse_attention_config(self) -> SparseAttentionConfig:
        """The pattern: the `--sparse_config` file if given, with the pattern flags on top."""
        return self.plugin_arguments().attention_config(self.pattern_flags(), self.explicit_flags)

    def context_parallel_config(self) -> ContextParallelConfig:
        return _part(self, ContextParallelConfig)

    def smet_arguments(self) -> SMETArguments:
        return _part(self, SMETArguments)

    def smet_optimizer_config(self) -> SMETConfig | None:
        """The SMET settings when `--smet` is on, else None."""
        flags = self.smet_arguments()
        return flags.to_config(self.explicit_flags) if flags.smet else None


def _fields() -> list[tuple[str, Any, dataclasses.Field]]:
    fields = [("max_length", int | None, _MAX_LENGTH), ("explicit_flags", Collection[str] | None, _EXPLICIT)]
    for part in _PARTS:
        fields += copied_fields(part, defaults=_DEFAULTS)
    clash = {name for name, _, _ in fields} & {f.name for f in dataclasses.fields(TrainingArguments)}
    if clash:
        raise TypeError(f"plugin flags {sorted(clash)} collide with TrainingArguments fields; rename them.")
    return fields


_PLUGIN_FIELDS = frozenset(name for name, _, f in _fields() if f.init)
SparseTrainingArguments = dataclasses.make_dataclass(
    "SparseTrainingArguments", _fields(), bases=(_PluginSettings, TrainingArguments),
    namespace={"__doc__": "`TrainingArguments` plus the plugin's flags: `--sparse_attention` (on by default), "
               "`--sparse_config`, the pattern (`--vertical_topk`, `--block_size`, ...), context parallelism "
               "(`--cp_size`, ...), a context-length curriculum (`--cp_schedule`), SMET (`--smet`, "
               "`--smet_density`, ...) and `--max_length`.",
               "__module__": __name__},
)


def _first_length(dataset) -> int | None:
    """The token count of the first sample of a map-style dataset with `input_ids`, or None."""
    try:
        return len(dataset[0]["input_ids"])
    except (TypeError, KeyError, IndexError):
        return None


class SparseTrainer(Trainer):
    """A `Trainer` that trains with the plugin as `SparseTrainingArguments` say.

    Args:
        model: a transformers causal LM (not `model_init`: the backend is configured on the model).
        args: the `SparseTrainingArguments`.
        *rest, **kwargs: as for `Trainer` (train_dataset, data_collator, processing_class, callbacks, ...).
    """

    def __init__(self, model: torch.nn.Module | None = None, args: TrainingArguments | None = None, *rest, **kwargs):
        if not isinstance(args, SparseTrainingArguments):
            raise TypeError(f"SparseTrainer takes SparseTrainingArguments (got {type(args).__name__}): parse the "
                            "command line with HfArgumentParser(SparseTrainingArguments).")
        if model is None:
            raise ValueError("SparseTrainer needs the model itself (model_init is not supported): the sparse backend "
                             "is configured on it before training.")
        longest_stage = max((s.seq_len for s in parse_schedule(args.cp_schedule)), default=None) if (
            args.cp_schedule) else None
        self.max_length = args.max_length or longest_stage or _first_length(kwargs.get("train_dataset"))
        if args.sparse_attention:
            enable_sparse_attention(model, args.plugin_arguments(), args.pattern_flags(), args, self.max_length,
                                    explicit=args.explicit_flags)
        elif getattr(model.config, MODEL_CONFIG_ATTRIBUTE, None) is not None:
            logger.warning("The model's config holds sparse attention settings (%s: saved by an hf-sparse-cp run), "
                           "which this run ignores: --sparse_attention is off, so attention runs %r. Pass "
                           "--sparse_attention true to train with them.", MODEL_CONFIG_ATTRIBUTE,
                           compat.attn_implementation(model.config))
        super().__init__(model, args, *rest, **kwargs)
        self.parallel = attach_to_trainer(self, args.plugin_arguments(), args.context_parallel_config(),
                                          max_length=self.max_length, cp_schedule=args.cp_schedule)
        smet = args.smet_optimizer_config()
        if smet is not None:
            install_smet(self, smet)

    def create_accelerator_and_postprocess(self) -> None:
        """The stock accelerator, with `--fsdp` running FSDP2 on CPU processes too (`cpu_fsdp.py`)."""
        super().create_accelerator_and_postprocess()
        disable_cpu_fsdp2(self)  # a hyperparameter search builds the accelerator again
        enable_cpu_fsdp2(self)

    def train(self, *args, **kwargs):
        result = super().train(*args, **kwargs)
        _tear_down_at_exit()  # only after a finished run: every rank then reaches the exit barrier
        return result

    def create_model_card(self, **kwargs):
        """The stock card, amended: sequence length, pattern, kept fraction per layer (and its plot), CP,
        SMET, tokens/s, the batch size of distinct sequences (`model_card.write_sparse_model_card`)."""
        return write_sparse_model_card(self, parallel=self.parallel, max_length=self.max_length,
                                       create_card=super().create_model_card, **kwargs)


@functools.cache
def _tear_down_at_exit() -> None:
    """At interpreter exit, end the process groups while the interpreter is whole (once per process)."""

    def tear_down() -> None:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            quiesce_process_groups()
            torch.distributed.destroy_process_group()

    atexit.register(tear_down)
