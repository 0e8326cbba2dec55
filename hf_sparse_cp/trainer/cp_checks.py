"""What of a training run context parallelism refuses, naming the fix, or computes near one process only: the
Trainer's arguments (`check_training_arguments`), its loss and the model's head (`check_loss`, `own_loss_refusal`),
and the notes rank 0 logs at CP's start (`warn_inexact`: dropout, random MoE routing, a router loss CP does not
gather)."""

from __future__ import annotations

import inspect
import logging
import os
import sys
from collections.abc import Mapping

import torch
from accelerate.utils import str_to_bool
from transformers import Trainer

from ..config import language_config
from ..distributed import ParallelDims
from ..integration import trainer_losses
from ..integration.architectures import (
    ROUTER_LOSS_PARAMETERS,
    computes_unshifted_loss,
    gathered_router_loss,
    model_router_loss_modules,
)
from ..integration.heads import LANGUAGE_MODEL, SEQUENCE_CLASSIFICATION, TOKEN_CLASSIFICATION, base_model, model_head
from .generated_rows import check_generating_trainer
from .whole_rows import check_whole_row_trainer

logger = logging.getLogger(__name__)


def check_training_arguments(args, cp_size: int, env: Mapping[str, str] | None = None) -> None:
    """Raise ValueError, naming the setting and the fix, for a setting of the Trainer's arguments `args` that cannot run
    under CP `cp_size` as it runs in one process. Checked as the plugin's arguments parse (`SparseArgumentsMixin`) and
    at CP's start (`enable_trainer_context_parallel`, a curriculum's), for arguments built in code, and by the
    launcher before it starts the processes, in `env`: theirs as their launcher sets it (default this process's)."""
    fix = "or run without CP (drop --cp_size; a --cp_schedule keeps every stage at CP 1)"
    # (`accelerate launch` with a DeepSpeed config sets ACCELERATE_USE_DEEPSPEED, without --deepspeed)
    if getattr(args, "deepspeed", None) or str_to_bool((os.environ if env is None else env).get(
            "ACCELERATE_USE_DEEPSPEED", "false")):
        raise ValueError(
            f"DeepSpeed (--deepspeed {getattr(args, 'deepspeed', None) or '<the accelerate config>'}) under context "
            f"parallelism (CP {cp_size}) is not supported: the plugin's CP is tested under DDP and FSDP2 only. Shard "
            "with FSDP2 instead (--fsdp 'full_shard auto_wrap' --fsdp_config '{\"fsdp_version\": 2}', or an "
            f"accelerate config with fsdp_version: 2), {fix}.")
    if getattr(args, "train_sampling_strategy", None) == "batch_rebalance":
        raise ValueError(
            f"--train_sampling_strategy batch_rebalance under context parallelism (CP {cp_size}): transformers' "
            "BatchRebalanceSampler deals each batch's rows over every process (its world_size), so the ranks of a CP "
            "group, which must share every row, would hold different ones. Use --train_sampling_strategy "
            f"group_by_length (batches of similar lengths, exact under CP), {fix}.")


def check_loss(trainer: Trainer, cp_size: int, parallel: ParallelDims | None = None) -> None:
    """Raise ValueError, naming the fix, when the Trainer computes a loss of its own (TRL's distillation trainers;
    a script's `compute_loss` or `compute_loss_func`): under CP each rank's forward
    covers only its shard of every sequence, so a loss built from the outputs (per-sequence log-prob sums, a last
    token's score, generations, labels shifted within a shard) is the shard's, not the sequence's; such a run
    crashed mid-step or trained on wrong values. TRL's DPOTrainer, KTOTrainer, RewardTrainer, GRPOTrainer and
    RLOOTrainer, whose forwards' outputs are gathered into whole rows (`whole_rows.py`; GRPO's and RLOO's generated
    rows: `generated_rows.py`), pass, unless a setting of it cannot (`check_whole_row_trainer`,
    `check_generating_trainer`, at the data-parallel degree of `parallel`, the layout the run trains in; None: CP
    groups of `cp_size` over the accelerator's processes, `ParallelDims.dp_size_for`)."""
    method = type(trainer).compute_loss
    # (the Trainer's own loss hands the logits and the rank's labels to it instead of the model's loss; label
    # smoothing's, the other such loss, is made the CP group's by `smooth_labels_over_cp_group`, for the Trainer's
    # own compute_loss: TRL SFTTrainer's also computes its token accuracy from the labels it is handed, which that
    # wrapper replaces by the shard's targets)
    if trainer.compute_loss_func is not None:
        what = (f"a compute_loss_func ({getattr(trainer.compute_loss_func, '__qualname__', 'given')}) under context "
                f"parallelism (CP {cp_size}) is not supported: it gets the outputs and labels of each rank's shard")
        fix = "drop compute_loss_func, or run without CP"
    elif trainer.label_smoother is not None and method is not Trainer.compute_loss:
        what = (f"label smoothing (--label_smoothing_factor {trainer.args.label_smoothing_factor}) with "
                f"{method.__qualname__.rsplit('.', 1)[0]}'s own compute_loss under context parallelism (CP {cp_size}) "
                "is not supported: it reads the labels of each rank's shard beside the smoothed loss (TRL "
                "SFTTrainer's token accuracy; the Trainer's own compute_loss smooths exactly under CP)")
        fix = "drop --label_smoothing_factor (TRL deprecates it in SFTTrainer), or run without CP"
    elif method in trainer_losses.cp_exact_losses() and method is not Trainer.compute_loss \
            and trainer.label_smoother is None and computes_unshifted_loss(trainer.model.config):
        # (the Trainer's own compute_loss hands CP the model's loss, `smooth_labels_over_cp_group`; with label
        # smoothing a trainer smooths the logits, shifted, instead of the model's loss: exact)
        what = (f"{type(trainer.model).__name__}'s forward computes its loss itself, the mean cross-entropy of the "
                "labels it is given, unshifted (each position predicts its own label), not through transformers' "
                f"loss_function with the loss keywords: under context parallelism (CP {cp_size}) that is each rank's "
                f"mean over its shard, which {method.__qualname__.rsplit('.', 1)[0]}'s count and scaling do not make "
                "one process's (transformers' Trainer computes it over the CP group)")
        fix = "train it with transformers' Trainer, or run without CP"
    elif method in trainer_losses.cp_exact_losses():
        _check_head(trainer.model, cp_size, whole_rows=False, own_loss=method is Trainer.compute_loss)
        return
    elif method in trainer_losses.cp_whole_row_losses():
        _check_head(trainer.model, cp_size, whole_rows=True, own_loss=False,
                    scores_rows=method in trainer_losses.cp_row_score_losses())
        check_whole_row_trainer(trainer, cp_size)
        if method in trainer_losses.cp_generated_row_losses():
            dp_size = (parallel.dp_size if parallel is not None
                       else ParallelDims.dp_size_for(trainer.accelerator.num_processes, cp_size))
            check_generating_trainer(trainer, cp_size, dp_size)
        return
    else:
        raise ValueError(own_loss_refusal(type(trainer), cp_size))
    raise ValueError(_loss_refusal(what, fix))


def own_loss_refusal(trainer_class: type[Trainer], cp_size: int) -> str | None:
    """`check_loss`'s refusal of every Trainer of `trainer_class` under CP `cp_size`: its compute_loss is none that
    CP reproduces (TRL's distillation trainers); None when it is one of them (a Trainer of it may still
    be refused for its settings or model). The launcher asks it of the TRL trainer a script builds
    (`launch.known_scripts`), before any process starts and builds the script's data."""
    method = trainer_class.compute_loss
    if method in trainer_losses.cp_exact_losses() or method in trainer_losses.cp_whole_row_losses():
        return None
    return _loss_refusal(f"{method.__qualname__.rsplit('.', 1)[0]} under context parallelism (CP {cp_size}) is not "
                         f"supported: its compute_loss ({method.__module__}) builds its loss from the model's "
                         "outputs", "run without CP")


def _loss_refusal(what: str, fix: str) -> str:
    return (f"{what}, and each CP rank's outputs cover only its shard of every sequence. CP trains the model's own "
            f"causal-LM loss (the Trainer's and TRL SFTTrainer's compute_loss). Fix: {fix} (drop --cp_size; a "
            "--cp_schedule keeps every stage at CP 1): sparse attention alone trains it, on one process or with data "
            "parallelism.")


def _check_head(model: torch.nn.Module, cp_size: int, *, whole_rows: bool, own_loss: bool,
                scores_rows: bool = False) -> None:
    """Refuse a head that CP does not train as one process (`heads.model_head`). A language-model head trains under
    the trainers of `trainer_losses.cp_exact_losses` and `cp_whole_row_losses`; a token- or sequence-classification or a
    question-answering head under the Trainer's own compute_loss (`own_loss`), whose loss CP makes the group's
    (`smooth_labels_over_cp_group`, `cp_group_steps`); a sequence-classification head under a whole-row trainer whose
    loss is built from it (`scores_rows`: TRL's RewardTrainer), whose pooled score every rank of the group holds
    (`heads.pool_over_cp_group`). Before, a head
    that pools the row's last token crashed at the first step sharding its per-row labels, and a token-classification
    head took its shard's mean (2.269 logged at step 1 under CP 2 against 1.134 for one process)."""
    head = model_head(model)
    if head == LANGUAGE_MODEL or (head is not None and own_loss) or (scores_rows and head == SEQUENCE_CLASSIFICATION):
        return
    name = type(model).__name__
    if head is not None:
        trainer = ("a whole-row trainer (TRL DPO, KTO: a language model's loss; TRL RewardTrainer: a "
                   "sequence-classification head's)" if whole_rows else
                   "a trainer whose compute_loss is its own (TRL SFTTrainer: a language model's loss)")
        what = (f"its {head} head under {trainer} is not trained under CP as one process: CP computes a "
                "classification or question-answering head's loss through the Trainer's own compute_loss (run_glue, "
                "run_ner, run_classification, run_qa). Fix: train it with transformers' Trainer, or run without CP")
    else:
        what = ("it has neither a language-model head nor transformers' generic token-classification, "
                "sequence-classification or question-answering head (GenericForTokenClassification, "
                "GenericForSequenceClassification, GenericForQuestionAnswering: Llama, Qwen2, Mistral, ...), which CP "
                f"trains as one process: {name}.forward is its architecture's own, whose pooling or loss CP does not "
                "reproduce. Fix: run without CP")
    raise ValueError(
        f"{name} under context parallelism (CP {cp_size}) is not supported: {what} (drop --cp_size; a --cp_schedule "
        "keeps every stage at CP 1): sparse attention alone trains it, on one process or with data parallelism.")


# Attributes under which a module holds the probability of a dropout its forward applies as a function.
FUNCTIONAL_DROPOUTS = ("dropout", "activation_dropout")


def dropout_note(model: torch.nn.Module) -> str | None:
    """A warning when `model` has dropout modules that drop something (TRL's LoRA: `--lora_dropout 0.05`): each CP
    rank draws the masks of its own shard, so the run equals one without CP in distribution only, not to rounding
    as the docs promise for fp32. None without them."""
    active = [f"{name} (p={module.p})" for name, module in model.named_modules()
              if isinstance(module, torch.nn.Dropout) and module.p > 0]
    # (functional dropout of a probability a module holds: the BART family's decoder and layers, `dropout` and
    # `activation_dropout`)
    active += [f"{name}.{attr} (p={p})" for name, module in model.named_modules() for attr in FUNCTIONAL_DROPOUTS
               if isinstance(p := getattr(module, attr, None), float) and p > 0]
    if not active:
        return None
    fields = _dropout_fields(model)
    return (f"context parallelism: {len(active)} dropout modules drop activations (e.g. {active[0]}): each CP rank "
            "draws the masks of its own shard, so this run equals a run without CP in distribution, not to rounding. "
            "For a run that must compare with one process, set them to 0 (LoRA: --lora_dropout 0; else the model "
            f"config's dropout fields{': ' + ', '.join(fields) if fields else ''}).")


def _dropout_fields(model: torch.nn.Module) -> list[str]:
    """The fields of `model`'s config that set a dropout above 0 (`name=value`), and a token-classification head's
    `classifier_dropout` where the config sets neither it nor `hidden_dropout`: transformers' head then drops 0.1, a
    value no config.json shows."""
    config = getattr(base_model(model), "config", None)
    if config is None:
        return []
    fields = [f"{name}={value}" for name, value in config.to_dict().items()
              if "dropout" in name and isinstance(value, float) and value > 0]
    if model_head(model) == TOKEN_CLASSIFICATION and all(
            getattr(config, name, None) is None for name in ("classifier_dropout", "hidden_dropout")):
        fields.append('classifier_dropout, unset, which the token-classification head takes as 0.1 (add '
                      '"classifier_dropout": 0.0 to the config)')
    return fields


def random_routing_note(model: torch.nn.Module) -> str | None:
    """A warning when `model`'s MoE routing draws random numbers in training: a config's `*jitter_noise` above 0
    (Mixtral's, PhiMoE's, MiniMax's: router logits or inputs scaled by uniform noise) or a modeling module with
    PhiMoE's `sparsemixer` (it samples the experts while training, whatever the jitter). Each CP rank draws for its
    own shard, as with dropout, so the run equals one without CP in distribution only. None without them."""
    config = language_config(getattr(model, "config", None))
    fields = [f"{name}={value}" for name, value in sorted(vars(config).items() if config is not None else ())
              if name.endswith("jitter_noise") and isinstance(value, (int, float)) and value > 0]
    samplers = sorted({f"{type(m).__module__}.sparsemixer" for m in model.modules()
                       if callable(getattr(sys.modules.get(type(m).__module__), "sparsemixer", None))})
    if not fields and not samplers:
        return None
    return (f"context parallelism: the model's MoE routing is random in training ({', '.join(fields + samplers)}): "
            "each CP rank draws for its own shard, so this run equals a run without CP in distribution, not to "
            "rounding. For a run that must compare with one process, set the config's jitter fields to 0"
            + (" (the sampling of sparsemixer stays: run without CP)." if samplers else "."))


def router_aux_loss_note(trainer: Trainer) -> str | None:
    """A warning when the trained model computes a MoE router load-balancing loss (`output_router_logits` with a
    non-zero `router_aux_loss_coef`; TRL SFTTrainer's `aux_loss_enabled`, on by default for MoE models) that CP does
    not compute over the CP group (`router_loss.py`: a modeling module's `load_balancing_loss_func` of another form
    than `architectures.ROUTER_LOSS_PARAMETERS`, or none): each CP rank computes it from the router logits of its own
    shard, and it is not a sum over tokens (the product of per-expert means), so the update and the logged losses
    differ from one process's. None without it."""
    if model_router_loss_modules(trainer.model):
        return None
    config = language_config(trainer.model.config)
    coef = getattr(config, "router_aux_loss_coef", None)
    enabled = getattr(trainer, "aux_loss_enabled", None)
    if enabled is None:
        enabled = bool(getattr(config, "output_router_logits", False)) and coef != 0
    if not enabled:
        return None
    modules = {sys.modules.get(type(m).__module__) for m in trainer.model.modules()}
    functions = [f for f in (getattr(module, "load_balancing_loss_func", None) for module in modules) if callable(f)]
    if not functions and coef is None:
        return None  # (no router loss: DeepSeek-V3's, Hunyuan-MoE's output_router_logits only return the logits)
    named = ", ".join(sorted(f"{f.__module__}.load_balancing_loss_func({', '.join(inspect.signature(f).parameters)})"
                             for f in functions))
    if any(gathered_router_loss(f) for f in functions):  # (remote code: not a module compat.PATCHES lists)
        why = f"its {named} is outside the installed transformers, whose modules only the plugin patches, so"
    elif functions:
        why = (f"its {named} is not the form the plugin gathers over the CP group (every layer's router logits of "
               f"the batch's tokens, then {', '.join(ROUTER_LOSS_PARAMETERS[1:])}), so")
    else:
        why = ("the plugin finds no load_balancing_loss_func in its modeling modules to gather over the CP group (a "
               "model computing it otherwise, or not at all: Llama 4), so if it adds one")
    return ("context parallelism: the model is set to add a MoE router load-balancing loss (output_router_logits, "
            f"router_aux_loss_coef {coef}) and {why} each CP rank computes it from the router logits of its own "
            "shard of every sequence; it is not a sum over tokens, so the update and TRL's logged aux_loss differ "
            "from a run without CP, and the loss the stock Trainer logs (--average_tokens_across_devices, the "
            "default) counts it once per CP rank. For a run that must compare with one process, turn it off "
            "(--router_aux_loss_coef 0 with TRL; else the model config's output_router_logits false or "
            "router_aux_loss_coef 0), or run without CP.")


def warn_inexact(trainer: Trainer) -> None:
    """Rank 0 logs, at CP start, what of the run CP computes near one process only (dropout, random MoE routing, a MoE
    router loss)."""
    for note in (dropout_note(trainer.model), random_routing_note(trainer.model), router_aux_loss_note(trainer)):
        if note is not None and trainer.is_world_process_zero():
            logger.warning(note)
