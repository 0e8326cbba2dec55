"""One switch for a stock Trainer script: `SparseTrainingArguments` and `SparseTrainer`.

A script written for `TrainingArguments` and `Trainer` changes the two class names:

    parser = HfArgumentParser(SparseTrainingArguments)       # every Trainer flag, plus the plugin's
    (args,) = parser.parse_args_into_dataclasses()
    trainer = SparseTrainer(model=model, args=args, train_dataset=data)
    trainer.train()

`SparseTrainingArguments` carries the plugin's settings as fields with help text (the sparse
attention switches, the pattern, context parallelism and SMET: `--sparse_vertical_topk 1024`,
`--cp_size 2`, `--smet`; every plugin flag starts with `sparse_`, `cp_` or `smet`), so
`HfArgumentParser`, YAML recipes and `accelerate launch` work as for any `TrainingArguments`.
`SparseTrainer` does what the functional API (`enable_sparse_attention`, `attach_to_trainer`,
`install_smet`) does by hand: it registers and configures the backend, opts into the lean loss, turns
gradient checkpointing on at long lengths, sets up context parallelism and SMET (and runs `--fsdp` as
FSDP2 on CPU processes too, where accelerate alone would run DDP), adds the logging callbacks, checks
the launch, says at start which layers run sparse, writes a model card that says how the model was
trained, and tears the process groups down cleanly at exit after training.

The same switch serves any Trainer subclass: `sparse_arguments_class(SFTConfig)` and
`sparse_trainer_class(SFTTrainer)` build the pair for TRL's SFT (`hf_sparse_cp.trainer.trl` holds
them as `SparseSFTConfig` and `SparseSFTTrainer`).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import functools
import logging
import math
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import torch
from transformers import DataCollatorWithFlattening, Trainer, TrainingArguments

from ..config import BACKEND_NAME, MODEL_CONFIG_ATTRIBUTE, SparseAttentionConfig
from ..distributed import quiesce_process_groups, settle_gloo_workers
from ..distributed.mesh import every_rank_at_exit
from ..integration import upstream
from ..integration.given import require_subclass
from ..integration.patching import PatchSet
from ..launch_env import in_launched_group, launched_env
from ..reporting.model_card import write_sparse_model_card
from .arguments import (
    flag_errors,
)
from .attach import (
    attach_to_rebuilt_model,
    attach_to_trainer,
    enable_sparse_attention,
    skip_unused_parameter_search,
    training_fused_ops,
)
from .callbacks import StepMetricsCallback
from .cp_checks import check_training_arguments
from .cpu_fsdp import check_cpu_fsdp_version, disable_cpu_fsdp2, set_up_fsdp2
from .curriculum import card_stages
from .generated_rows import generation_batch_counted_by_trl
from .plugin_arguments import (
    LENGTH_FIELD,
    RENAMED_FIELDS,
    PluginArguments,
    PluginArgumentsMixin,
    class_namespace,
    is_parsing_for_launch,
    launch_world_size,
    plugin_fields,
)
from .precomputed import keyed_by_pattern, refuse_unshared_cache
from .reference import attend_like_trained_model
from .schedule import parse_schedule
from .smet import check_smet_optim, install_smet
from .tied_weights import alias_tied_weights

logger = logging.getLogger(__name__)

# (a trainer's flag: the model its Trainer class loads in its own __init__ is yet to be set up for the plugin)
_LOADED_MODEL_TO_SET_UP = "_hf_sparse_cp_loaded_model_to_set_up"


def _has_accelerator() -> bool:
    return torch.accelerator.is_available()


# Trainer arguments that transformers takes as given and whose bad values failed only once the run trained, after
# the data and the model were built: deep in torch (a sampler's batch_size=0) or as NaN weights (a NaN learning rate)
_AT_LEAST_ONE = ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps")
_NUMBERS = ("learning_rate", "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon", "max_grad_norm")


def check_trainer_numbers(args: TrainingArguments) -> None:
    """Raise ValueError, naming the flag and its default, for a batch size or accumulation below 1, or a NaN (or,
    but for max_grad_norm, whose infinity clips nothing, an infinite) optimizer setting."""
    defaults = {f.name: f.default for f in dataclasses.fields(TrainingArguments)}
    for name in _AT_LEAST_ONE:
        value = getattr(args, name, None)
        if isinstance(value, int) and value < 1:
            raise ValueError(f"--{name} {value} must be >= 1; e.g. --{name} {defaults[name]} (the default).")
    for name in _NUMBERS:
        value = getattr(args, name, None)
        if isinstance(value, float) and (math.isnan(value) or (math.isinf(value) and name != "max_grad_norm")):
            raise ValueError(f"--{name} {value} is not a finite number; e.g. --{name} {defaults[name]} (the "
                             "default).")


class SparseArgumentsMixin(PluginArgumentsMixin):
    """The methods of the generated argument classes (`sparse_arguments_class`); their fields are
    generated from `plugin_arguments.plugin_fields`."""

    _sparse_base: type[TrainingArguments]
    KIND: ClassVar[str] = "training argument"

    def __post_init__(self) -> None:
        if os.environ.get("ACCELERATE_USE_PARALLELISM_CONFIG", "").lower() == "true" and not _has_accelerator():
            # (accelerate refuses it on CPU processes only when the Trainer builds its Accelerator, after the data;
            # as a bad flag: the message once, not a traceback through the script from every process)
            with flag_errors():
                raise ValueError(
                    "The accelerate config sets a ParallelismConfig (parallelism_config_cp_size "
                    f"{os.environ.get('PARALLELISM_CONFIG_CP_SIZE', '1')}), which accelerate runs only on GPUs, and "
                    "this machine has no GPU: launch CPU processes with `accelerate launch --config_file \"$("
                    "hf-sparse-cp recipes --path cpu_2proc_cp2)\"` (its num_processes set to N) or `hf-sparse-cp "
                    "launch --nproc N`, and give the CP degree as --cp_size N."
                )
        if not self.use_cpu and not _has_accelerator():
            # accelerate joins CPU processes (gloo) only when told: without this, `torchrun --nproc_per_node 2` or
            # `accelerate launch` on a machine without an accelerator would run N unsynchronized single-process jobs
            logger.info("No accelerator found: training on CPU (use_cpu=True).")
            self.use_cpu = True
        # (transformers' own error comes later and names no fix; the launcher's parse before starting the processes
        # stands for one of them)
        if self.fsdp and not in_launched_group() and not is_parsing_for_launch():
            with flag_errors():
                raise ValueError(
                    "--fsdp shards the model over processes, and this one runs alone: launch several, e.g. "
                    "`torchrun --nproc_per_node 2 train.py --fsdp ...` or `hf-sparse-cp launch --nproc 2 train.py "
                    "--fsdp ...`; or drop --fsdp."
                )
        with flag_errors():
            check_trainer_numbers(self)
            self._check_plugin_fields()
        with generation_batch_counted_by_trl(self):
            super().__post_init__()
        with flag_errors():
            if not _has_accelerator():
                check_cpu_fsdp_version(self)
            self._validate_plugin_fields()
            if self.smet:  # (before the processes build their data and model, as the other flags)
                check_smet_optim(self)
            if self.sparse_attention:  # (what the Trainer refuses, once the script has built its data)
                training_fused_ops(self.sparse_fused_ops, self)
            if self.cp_schedule:
                world = launch_world_size()
                if world is not None:
                    # each stage's CP degree against the processes first: a length refused for its blocks per CP
                    # rank named other lengths, which the processes then refused for the degree (3:256:3 on 2)
                    self.check_launch(launched_env(world))
                self.check_schedule(self.max_steps)
            cp_size = max(cp_size for _, cp_size in self.cp_degrees())
            if cp_size > 1:
                check_training_arguments(self, cp_size)

    def __reduce__(self):
        # The class is generated: pickle (the Trainer saves its arguments in every checkpoint) by its base class
        return _rebuild_arguments, (self._sparse_base, self.__dict__.copy())


def _refuse_sparse_model_with_switch_off(model: Any) -> None:
    """Refuse, naming both ways out, a model that runs `sparse_cp` in a run with `--sparse_attention false`: it would
    train sparse with the pattern it holds (or the backend's default), never configured from the run's flags."""
    config = getattr(model, "config", None)
    if config is not None and upstream.attn_implementation(config) == BACKEND_NAME:
        with flag_errors():
            raise ValueError(
                f"--sparse_attention false, but {type(model).__name__} runs attn_implementation='{BACKEND_NAME}' (it "
                "was loaded or configured with it), so it would train sparse, its pattern not the run's flags: load it "
                "with attn_implementation='sdpa' or 'eager' (the script's --attn_implementation) to train dense, or "
                "drop --sparse_attention false to train sparse.")


def _rebuild_arguments(base: type[TrainingArguments], state: dict[str, Any]) -> SparseArgumentsMixin:
    cls = sparse_arguments_class(base)
    for old, new in RENAMED_FIELDS.items():  # saved by an earlier release
        if old in state and new in cls._sparse_fields and new not in state:
            state[new] = state.pop(old)
    args = object.__new__(cls)
    args.__dict__.update(state)
    return args


def sparse_arguments_class(base: type[TrainingArguments]) -> type:
    """`base` (`TrainingArguments` or a subclass, e.g. TRL's `SFTConfig`) plus the plugin's flags.

    Args:
        base: the argument class the script uses.

    Returns:
        The dataclass `Sparse<base name>`: every field of `base` and `--sparse_attention` (on by default),
        `--sparse_config`, the pattern (`--sparse_vertical_topk`, `--sparse_block_size`, ...), context
        parallelism (`--cp_size`, ...), a context-length curriculum (`--cp_schedule`), SMET (`--smet`,
        `--smet_density`, ...) and `--sparse_max_length` (unless the base has its own `max_length`). The same
        class for the same base.
    """
    require_subclass(base, TrainingArguments, "sparse_arguments_class(base)", "e.g. TRL's SFTConfig")
    return _sparse_arguments_class(base)


@functools.cache
def _sparse_arguments_class(base: type[TrainingArguments]) -> type:
    fields = plugin_fields(base)
    return dataclasses.make_dataclass(
        f"Sparse{base.__name__}", fields, bases=(SparseArgumentsMixin, base),
        namespace=class_namespace(fields, __module__=__name__, _sparse_base=base,
                             __doc__=f"`{base.__name__}` plus the plugin's flags (`sparse_arguments_class`)."))


def with_plugin_arguments(args: TrainingArguments, plugin: PluginArguments) -> SparseArgumentsMixin:
    """`args`, built in code, as `sparse_arguments_class(type(args))` with the plugin's settings in `plugin`
    (every field of `args` as it is: its `__post_init__` already ran, and its devices may be set up)."""
    cls = sparse_arguments_class(type(args))
    if cls._length_field != LENGTH_FIELD and plugin.sparse_max_length is not None:
        raise ValueError(f"--sparse_max_length {plugin.sparse_max_length}: the script's {type(args).__name__} has its "
                         f"own max_length ({args.max_length}), which the plugin reads; drop --sparse_max_length.")
    out = object.__new__(cls)
    out.__dict__.update(vars(args))
    out.__dict__.update({name: getattr(plugin, name) for name in cls._sparse_fields})
    out.explicit_flags = plugin.explicit_flags
    if not out.use_cpu and not _has_accelerator():
        # as `SparseArgumentsMixin.__post_init__` does (else launched CPU processes would each train alone); the
        # base's __post_init__ set the devices up without it: set them up again now, before the Trainer builds its
        # Accelerator on them (a later first read would reset accelerate's state under it)
        out.use_cpu = True
        out.__dict__.pop("_setup_devices", None)
        _ = out.device
    out._check_plugin_fields()
    out._validate_plugin_fields()
    return out


SparseTrainingArguments = sparse_arguments_class(TrainingArguments)


def _first_length(dataset) -> int | None:
    """The token count of the first sample of a map-style dataset with `input_ids`, or None."""
    try:
        return len(dataset[0]["input_ids"])
    except (TypeError, KeyError, IndexError):
        return None


def _refuse_empty_datasets(trainer: str, kwargs: dict[str, Any]) -> None:
    """Raise ValueError naming the dataset when `train_dataset` or an `eval_dataset` has no sample (TRL's trainers
    stop in a bare StopIteration on one, the Trainer in its sampler; a dataset without a length is not read here)."""
    evaluation = kwargs.get("eval_dataset")
    named = {"train_dataset": kwargs.get("train_dataset")}
    if isinstance(evaluation, dict):
        named.update({f"eval_dataset[{key!r}]": dataset for key, dataset in evaluation.items()})
    else:
        named["eval_dataset"] = evaluation
    for name, dataset in named.items():
        if dataset is not None and hasattr(dataset, "__len__") and len(dataset) == 0:
            fix = ("there is nothing to train on: check how it was built or filtered" if name == "train_dataset" else
                   "give it samples, or pass eval_dataset=None to skip evaluation")
            raise ValueError(f"{trainer}: {name} is empty (0 samples): {fix}.")


def _refuse_dequantized_gguf(trainer: str, model: Any) -> None:
    """Raise ValueError naming the fix for a model loaded from a GGUF file with its weights dequantized: transformers
    still marks it quantized, and the Trainer refuses it with advice that does not apply (attach adapters: with a
    LoRA adapter it is refused too, as a method that does not train)."""
    quantizer = getattr(model, "hf_quantizer", None)
    config = getattr(quantizer, "quantization_config", None)
    # (dequantized where every weight loaded as a float tensor: transformers' own loader of the architecture, or
    # without the GGUF kernels; weights it keeps packed, in GGUF modules, do not train, and the Trainer says so)
    if (getattr(config, "quant_method", None) != "gguf" or getattr(quantizer, "packed_modules", None)
            or not all(p.is_floating_point() for p in model.parameters())):
        return
    raise ValueError(
        f"{trainer}: this model was loaded from a GGUF file (from_pretrained(..., gguf_file=...)); its weights are "
        "dequantized to floats and train, but transformers still marks the model quantized, which the Trainer "
        "refuses. Call `model.hf_quantizer.remove_quantization_config(model)` after loading (before attaching a "
        "LoRA adapter), as `hf-sparse-cp train --model_name_or_path <file>.gguf` does.")


# TRL SFTConfig's packing settings (`_packing_kept_under_accelerates_cp`)
_TRL_PACKING = ("packing", "eval_packing")


def _packs_documents(collator, args) -> bool:
    """Whether training rows pack several documents: transformers' flattening collator, a padding-free one, or TRL's
    `packing` / `padding_free`."""
    return (isinstance(collator, DataCollatorWithFlattening) or bool(getattr(collator, "padding_free", False))
            or bool(getattr(args, "packing", False)) or bool(getattr(args, "padding_free", False)))


class SparseTrainerMixin:
    """What makes a Trainer class train with the plugin as its arguments say (`sparse_trainer_class`).

    Args:
        model: a transformers causal LM, or what the Trainer class itself takes for one (TRL: a Hub id); or None
            with `model_init=` in `kwargs`, whose every model (built in `__init__` and again at each `train()`) is
            configured as a model given here is (`call_model_init`).
        args: arguments of a class from `sparse_arguments_class` (`SparseTrainingArguments`, ...).
        *rest, **kwargs: as for the Trainer class (train_dataset, data_collator, processing_class, model_init, ...).
    """

    def __init__(self, model: torch.nn.Module | str | None = None, args: TrainingArguments | None = None, *rest,
                 **kwargs):
        self._init_with_plugin(super().__init__, model, args, *rest, **kwargs)

    def _init_with_plugin(self, trainer_init: Callable[..., None], model: torch.nn.Module | str | None,
                          args: TrainingArguments | None, *rest, **kwargs) -> None:
        """`trainer_init(model, args, *rest, **kwargs)`, the Trainer class's own `__init__`, with the plugin around
        it: the checks and the model's backend before, context parallelism, logging and SMET after (`__init__`, and
        `hf_sparse_cp.run` for the Trainer a launched script builds)."""
        if not isinstance(args, SparseArgumentsMixin):
            raise TypeError(
                f"{type(self).__name__} takes arguments with the plugin's flags (got {type(args).__name__}): parse "
                "the command line with HfArgumentParser(SparseTrainingArguments), or for another argument class "
                "with HfArgumentParser(sparse_arguments_class(ThatClass)).")
        with flag_errors():  # (the user's: a launched script ends with the message alone)
            _refuse_empty_datasets(type(self).__name__, kwargs)
            _refuse_dequantized_gguf(type(self).__name__, model)
            if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
                # CP in a lone process (a script building its arguments in code, the flags before its path, which no
                # parser checked), before the model is set up; a group the caller joined itself is checked on it
                args.check_launch(ring=False)
        longest_stage = max((s.seq_len for s in parse_schedule(args.cp_schedule)), default=None) if (
            args.cp_schedule) else None
        self._length_set = args.sequence_length or longest_stage
        self.max_length = self._length_set or _first_length(kwargs.get("train_dataset"))
        self._packed_documents = _packs_documents(kwargs.get("data_collator"), args)
        loaded_here = isinstance(model, str)  # (TRL loads a model named by its Hub id in its own __init__)
        self.__dict__[_LOADED_MODEL_TO_SET_UP] = loaded_here
        if model is not None and not loaded_here:  # (None: `model_init`'s, configured in `call_model_init`)
            self._configure_model(model, args)
        skip_unused_parameter_search(self, model, args)  # (model_init's model: in `call_model_init`)
        with self._packing_kept_under_accelerates_cp(args):
            if rest:  # (positional as the caller gave them)
                trainer_init(model, args, *rest, **kwargs)
            else:  # by name: a Trainer class's second parameter may be another (TRL DPOTrainer's is ref_model)
                trainer_init(model, args=args, **kwargs)
        self._configure_loaded_model()
        self.parallel = attach_to_trainer(self, args.plugin_arguments(), args.context_parallel_config(),
                                          max_length=self.max_length, cp_schedule=args.cp_schedule)
        smet = args.smet_optimizer_config()
        if smet is not None:
            with flag_errors():  # (settings against the model: a block size that does not divide a weight's columns)
                install_smet(self, smet)

    def _configure_loaded_model(self) -> None:
        """Set up the model the Trainer class loaded in its own `__init__` (TRL, from a Hub id), once: after that
        `__init__`, or within it where it runs the model first (`_precompute_ref_logps`)."""
        if not self.__dict__.get(_LOADED_MODEL_TO_SET_UP):
            return
        self.__dict__[_LOADED_MODEL_TO_SET_UP] = False
        self._packed_documents = _packs_documents(self.data_collator, self.args)
        self._configure_model(self.model, self.args)
        skip_unused_parameter_search(self, self.model, self.args)

    def _configure_model(self, model: torch.nn.Module, args: SparseArgumentsMixin) -> None:
        """Switch `model` to the sparse backend with the run's pattern; with `--sparse_attention false`, refuse one
        that runs it and say that a saved sparse pattern goes unused."""
        if args.sparse_attention:
            saved = _stored_pattern(model)
            config = enable_sparse_attention(model, args.plugin_arguments(), args.pattern_flags(), args,
                                             self.max_length, explicit=args.explicit_flags,
                                             packed_documents=self._packed_documents)
            if saved is not None and saved != config:
                logger.warning("The model's config holds a sparse attention pattern (%s: saved by an hf-sparse-cp "
                               "run, or set by hf_sparse_cp.configure) that this run replaces with the pattern of its "
                               "flags and --sparse_config, which differs in %s. To train with the model's pattern, "
                               "pass --sparse_config <the model's folder>/config.json.", MODEL_CONFIG_ATTRIBUTE,
                               ", ".join(_differing_fields(saved.to_dict(), config.to_dict())))
            return
        _refuse_sparse_model_with_switch_off(model)
        if getattr(getattr(model, "config", None), MODEL_CONFIG_ATTRIBUTE, None):
            logger.warning("The model's config holds sparse attention settings (%s: saved by an hf-sparse-cp run), "
                           "which this run ignores: --sparse_attention is off, so attention runs %r. Pass "
                           "--sparse_attention true to train with them.", MODEL_CONFIG_ATTRIBUTE,
                           upstream.attn_implementation(model.config))

    def call_model_init(self, trial=None) -> torch.nn.Module:
        """The Trainer's `call_model_init`, which builds the model from `model_init` in `__init__` and again at every
        `train()` (a hyperparameter search's trial, a reproducible re-initialisation): each model it returns is
        configured as a model given directly is (`_configure_model`, `skip_unused_parameter_search`), and at `train()`
        context parallelism and a `--cp_schedule` are set up again on the new model (`attach.attach_to_rebuilt_model`),
        on the process groups of the first. A hyperparameter search under CP is refused, naming the fix: each trial
        builds the Trainer's accelerator anew, which CP's data loading and gathering are set up on."""
        if trial is not None and max(d for _, d in self.args.cp_degrees()) > 1:
            with flag_errors():
                raise ValueError(
                    "hyperparameter_search under context parallelism (--cp_size / --cp_schedule) is not supported: "
                    "each trial builds the Trainer's accelerator anew, without the CP data loading and gathering set "
                    "up on it. Search without CP (drop --cp_size / --cp_schedule, e.g. at a shorter "
                    "--sparse_max_length), then train the chosen settings under CP.")
        model = super().call_model_init(trial)
        self._configure_model(model, self.args)
        skip_unused_parameter_search(self, model, self.args)  # (the first model comes after the accelerator)
        if getattr(self, "parallel", None) is not None:  # train(): the plugin is attached to the previous model
            self.model = model
            self.parallel = attach_to_rebuilt_model(self, self.args.context_parallel_config(), self.args.cp_schedule)
        return model

    @contextlib.contextmanager
    def _packing_kept_under_accelerates_cp(self, args: SparseArgumentsMixin) -> Iterator[None]:
        """The Trainer class's `__init__` inside: TRL's SFTTrainer refuses packing under accelerate's CP group, whose
        attention drops the mask that keeps packed documents apart; the sparse ring keeps them apart (it reads each
        token's document), so its check, after the accelerator is built and the datasets packed, sees packing off
        (`create_accelerator_and_postprocess`), and the arguments say it again after it."""
        packs = args.sparse_attention and any(getattr(args, name, None) for name in _TRL_PACKING)
        self._packing_hidden = PatchSet() if packs else None
        try:
            yield
        finally:
            if self._packing_hidden is not None:
                self._packing_hidden.undo()
            self._packing_hidden = None

    def create_accelerator_and_postprocess(self) -> None:
        """The stock accelerator, with `--fsdp` running FSDP2 on CPU processes too (`cpu_fsdp.py`)."""
        super().create_accelerator_and_postprocess()
        disable_cpu_fsdp2(self)  # a hyperparameter search builds the accelerator again
        set_up_fsdp2(self)
        hidden, pc = getattr(self, "_packing_hidden", None), self.accelerator.parallelism_config
        if hidden is not None and pc is not None and pc.cp_size > 1:
            for name in _TRL_PACKING:
                hidden.set_attr(self.args, name, False)

    def _attend_like_trained_model(self) -> None:
        """TRL's reference model, loaded in the Trainer subclass's `__init__` after the plugin's part of it, attends
        with the trained model's pattern (`reference.py`); before anything runs it."""
        attend_like_trained_model(self, self.args.plugin_arguments(), self.max_length)

    def _precompute_ref_logps(self, dataset, name, batch_size):
        """TRL DPO's and KTO's `--precompute_ref_log_probs` pass, run in their `__init__` before `train`, with the
        reference it runs (a given one; under FSDP, one TRL loads from the model's path and frees after the pass)
        attending as the trained model does: it ran the stock attention, a bias in every reward. The key of its cache
        carries that pattern, and a dataset whose cache the processes cannot share is refused (`precomputed.py`)."""
        datasets = {name: dataset}
        if name == "train":  # (TRL's first pass, in __init__: its eval datasets' follow it, checked now, before it)
            datasets.update(self.eval_dataset if isinstance(self.eval_dataset, dict) else {"eval": self.eval_dataset})
        refuse_unshared_cache(self, datasets)
        self._configure_loaded_model()  # (a Hub id: TRL loaded the model in this __init__, not yet set up)
        self._attend_like_trained_model()
        return super()._precompute_ref_logps(keyed_by_pattern(self, dataset), name, batch_size)

    def train(self, *args, **kwargs):
        """The Trainer's `train`, with a TRL reference model attending as the trained model does, and the plugin's
        process-wide state torn down at exit once the run finished."""
        self._attend_like_trained_model()
        result = super().train(*args, **kwargs)
        _tear_down_at_exit()  # only after a finished run: every rank then reaches the exit barrier
        return result

    def end(self):
        """The Trainer's `end` (TRL's scripts call it last), which destroys the process group, once the
        collectives are settled (`quiesce_process_groups`); every rank calls it."""
        quiesce_process_groups()
        super().end()

    def evaluate(self, *args, **kwargs):
        """The Trainer's `evaluate`, with a TRL reference model attending as the trained model does."""
        self._attend_like_trained_model()
        return super().evaluate(*args, **kwargs)

    def predict(self, *args, **kwargs):
        """The Trainer's `predict`, with a TRL reference model attending as the trained model does."""
        self._attend_like_trained_model()
        return super().predict(*args, **kwargs)

    def create_model_card(self, **kwargs):
        """The Trainer class's own card, amended and merged with the plugin's section: versions, the
        distributed set-up, sequence length, pattern, kept fraction per layer (and its plot), CP, SMET,
        losses, tokens/s (`model_card.write_sparse_model_card`). Metadata not given here comes from the
        `--sparse_card_*` flags."""
        given = {name: value for name, value in kwargs.items() if value is not None}
        metrics = StepMetricsCallback.of(self)
        schedule, stages = card_stages(self)
        longest = getattr(metrics, "longest_trained", None)
        # (a length the arguments set; the first row's length, what `max_length` holds without one, is no setting:
        # the card said "96 tokens set" beside the 144-token rows trained, where nothing set a length)
        length = self._length_set if longest is not None else self.max_length
        return write_sparse_model_card(self, parallel=self.parallel, max_length=length, longest_trained=longest,
                                       cp_schedule=schedule, cp_stages=stages,
                                       first_step=getattr(metrics, "first_step", 0),
                                       create_card=super().create_model_card,
                                       **(self.args.plugin_arguments().card_metadata() | given))

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        # (a state dict gathered from FSDP2's shards holds a tied head apart from its embeddings: saved twice)
        if state_dict:
            state_dict = alias_tied_weights(self.accelerator.unwrap_model(self.model), state_dict)
        super()._save(output_dir, state_dict)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """The Trainer's `save_model`; saving the final model into `output_dir` also writes its card there (a stock
        script that saves without pushing, TRL's included, gets one), checkpoints do not. A save of the user's under
        FSDP2 with a sharded `fsdp_config.state_dict_type` writes the whole model, where the Trainer writes nothing
        (it saves a model under FSDP only with FULL_STATE_DICT; the sharded type stays the checkpoints')."""
        super().save_model(output_dir, _internal_call)
        if not _internal_call and _sharded_fsdp2_saves_nothing(self):
            # (every rank: the state dict's gather is collective; the main process writes it)
            state_dict = self.accelerator.get_state_dict(self.model)
            if self.args.should_save:
                self._save(output_dir or self.args.output_dir, state_dict=state_dict)
        final = output_dir is None or os.path.abspath(output_dir) == os.path.abspath(self.args.output_dir)
        if final and not _internal_call:
            self.create_model_card()


def _sharded_fsdp2_saves_nothing(trainer: Trainer) -> bool:
    """Whether the Trainer's `save_model` wrote no model: FSDP2 with a state_dict_type other than FULL_STATE_DICT
    (accelerate's `get_state_dict` gathers the whole model under FSDP2 whatever that type)."""
    plugin = getattr(trainer.accelerator.state, "fsdp_plugin", None) if trainer.is_fsdp_enabled else None
    return (plugin is not None and getattr(trainer.accelerator, "is_fsdp2", False)
            and "FULL_STATE_DICT" not in str(plugin.state_dict_type))


class SparseTrainer(SparseTrainerMixin, Trainer):
    """A `Trainer` that trains with the plugin as `SparseTrainingArguments` say.

    Args:
        model: a transformers causal LM (or None with `model_init=`: each model it builds is configured alike).
        args: the `SparseTrainingArguments`.
        *rest, **kwargs: as for `Trainer` (train_dataset, data_collator, processing_class, callbacks, ...).
    """


def sparse_trainer_class(base: type[Trainer]) -> type:
    """`base` (a `Trainer` subclass, e.g. TRL's `SFTTrainer`) that trains with the plugin: the class
    `Sparse<base name>`, taking arguments from `sparse_arguments_class` (the same class for the same base)."""
    require_subclass(base, Trainer, "sparse_trainer_class(base)", "e.g. TRL's SFTTrainer")
    return _sparse_trainer_class(base)


@functools.cache
def _sparse_trainer_class(base: type[Trainer]) -> type:
    if base is Trainer:
        return SparseTrainer
    return type(f"Sparse{base.__name__}", (SparseTrainerMixin, base),
                {"__module__": __name__, "__doc__": f"`{base.__name__}` with the plugin (`sparse_trainer_class`)."})


@functools.cache
def _tear_down_at_exit() -> None:
    """At interpreter exit, end the process groups while the interpreter is whole (once per process), when every
    rank gets to its exit (`mesh.every_rank_at_exit`); where the script destroyed them itself, the process ends on
    an uncaught exception or a failing `sys.exit`, or a rank did not come, still let the gloo workers finish before
    the interpreter finalises."""

    def tear_down() -> None:
        if _ending_on_an_exception():
            # (this rank alone may have failed, after training: the others, inside another collective, would keep
            # its exit barrier waiting until the group's timeout; its exit ends the job through the launcher)
            settle_gloo_workers()
        elif torch.distributed.is_available() and torch.distributed.is_initialized() and every_rank_at_exit(
                upstream.default_store()):
            quiesce_process_groups()
            torch.distributed.destroy_process_group()
        else:
            # (a group the script still holds, a device mesh's, outlives the destroy; or a rank never came to its
            # exit: a failing `sys.exit` outside our launcher, which python records nowhere)
            settle_gloo_workers()

    atexit.register(tear_down)


_failing_exit: list[object] = []  # (a failing exit code the launcher saw leave the script; python keeps none)


def note_failing_exit(code: object) -> None:
    """Record that the script left with `sys.exit(code)`, `code` not 0 or None (the launcher sees it leave
    `run_target`): this rank may fail alone, so its exit handler skips the exit barrier as on an uncaught exception."""
    _failing_exit.append(code)


def _ending_on_an_exception() -> bool:
    """Whether the interpreter ends on an uncaught exception: python records it (`sys.last_exc`; before 3.12
    `sys.last_value`) as it prints it, before the exit handlers run; or on a failing `sys.exit` the launcher saw
    (`note_failing_exit`), which python does not record."""
    return bool(_failing_exit) or getattr(sys, "last_exc", getattr(sys, "last_value", None)) is not None


def _stored_pattern(model: torch.nn.Module) -> SparseAttentionConfig | None:
    """The sparse pattern the model's config holds (a saved run's, or `configure`'s), or None where it holds none or
    none this installation reads (the run's pattern replaces it either way)."""
    try:
        return SparseAttentionConfig.stored_on(getattr(model, "config", None))
    except ValueError:
        return None


def _differing_fields(before: dict, after: dict, prefix: str = "") -> list[str]:
    """The dotted keys whose values differ between two nested pattern dicts, as `name: before -> after`."""
    fields = []
    for key in sorted(before.keys() | after.keys(), key=str):
        a, b = before.get(key), after.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            fields += _differing_fields(a, b, f"{prefix}{key}.")
        elif a != b:
            fields.append(f"{prefix}{key}: {a!r} -> {b!r}")
    return fields
