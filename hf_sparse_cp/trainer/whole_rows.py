"""Context parallelism for a trainer whose loss is built from the outputs of whole rows (TRL's DPOTrainer and
KTOTrainer: per-sequence sums of per-token log-probabilities, of the trained model and of its reference; TRL's
RewardTrainer: a sequence-classification head's score of each row's last token).

Such a loss is not a sum over tokens that each CP rank could take its share of, so the batch is not sharded before
the trainer's `compute_loss`: each forward of the trained model and of the reference model inside a training or
prediction step takes the whole rows, as in one process, and hooks on the model make it a CP forward. A forward
pre-hook shards its inputs (`input_ids`, `attention_mask`, `position_ids`, the labels, shifted before sharding, as the
Trainer's CP input preparation does); a forward hook gathers every per-token output (TRL's fused LM head's
`log_probs`, `entropy`, `mean_logits`, ...; a plain forward's logits) into the whole rows on every rank of the CP
group (`CPShard.whole_sequence`), in the one-process shape: a fused head called with `labels` scores each position's
next token, so its outputs drop the last position. A sequence-classification head's pooled score is already the
batch's on every rank (`heads.pool_over_cp_group`) and passes as it is. The trainer's own code (every DPO loss type,
`ld_alpha`, the IPO normalization by completion length, KTO's KL estimate, the reward model's pairwise loss, rewards
and metrics) then runs on whole rows, the same on every rank of the group. `whole_sequence`'s backward sums the
group's gradients of the whole rows and hands each rank its own positions': averaged over the ranks (DDP, FSDP2), the
gradients are one process's.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ..distributed import CP_SHARD_KWARG, CPShard, ParallelDims
from ..distributed.comm import all_reduce
from ..distributed.split.blocks import CONSUMED_KEYS
from ..integration.call_context import guard_context_parallel
from ..integration.heads import BATCH_OUTPUT_HEADS, model_head

# The inputs of a forward that the CP input preparation shards along the sequence, or folds into the CPShard (the
# attention mask, flattened packing's sequence lengths).
SHARDED_INPUTS = ("input_ids", "inputs_embeds", "position_ids", "labels", "shift_labels", *CONSUMED_KEYS)
# The reference model TRL's trainers keep beside the trained one (None under PEFT or with precomputed log-probs).
REFERENCE_MODEL = "ref_model"
_FIX = ("run this trainer without CP (drop --cp_size): sparse attention alone trains it, on one process or with data "
        "parallelism")


# What a prediction step does with an output that is not per token (`whole_sequence_outputs`).
_PREDICTION_FIX = ("Leave it out of the predictions (ignore_keys=[its name] in evaluate() or predict(), or the model "
                   "config's keys_to_ignore_at_inference), or pass --prediction_loss_only for eval_loss alone, or "
                   "evaluate without --cp_size")


def whole_sequence_outputs(outputs: Any, shard: CPShard, what: str = "a prediction step",
                           fix: str = _PREDICTION_FIX) -> Any:
    """The per-token outputs of `what` (a prediction step's logits; a forward's outputs: a tensor, or nested tuples or
    dicts of them), each over the batch's whole sequence in its order, on every rank of the CP group
    (`CPShard.whole_sequence`, differentiable), as one process returns them. Raises ValueError, naming the output and
    `fix`, for a tensor that is not per token ([B, this rank's shard length, ...]: a MoE's auxiliary loss or router
    logits), which a rank computes from its shard alone."""
    from accelerate.utils import recursively_apply

    plan, cp = shard.plan, shard.parallel.cp_size
    batch, length = shard.meta.index.shape[0], plan.local_len_of(shard.rank)
    shapes: list[torch.Size] = []
    recursively_apply(lambda x: shapes.append(x.shape), outputs)
    per_token = torch.tensor([len(shape) >= 2 and tuple(shape[:2]) == (batch, length) for shape in shapes],
                             dtype=torch.int32, device=shard.meta.index.device)
    if len({plan.local_len_of(rank) for rank in range(cp)}) > 1:
        # Shards of different lengths (a document plan): an output whose shape does not depend on the rank may match
        # this rank's length and not another's. The ranks agree before gathering, so that all raise or none waits.
        all_reduce(per_token, shard.parallel.cp_group, "the check of per-token outputs", op=dist.ReduceOp.MIN)
    if not bool(per_token.all()):
        shape = shapes[int((per_token == 0).nonzero()[0])]
        raise ValueError(
            f"{what} under context parallelism (CP {cp}) returned an output of shape {tuple(shape)}: only per-token "
            f"outputs ([batch {batch}, this rank's {length} tokens, ...]: logits, hidden states) are gathered over "
            "the sequence, and this one each rank computes from its shard of the sequence alone (or a rank of the "
            f"group found it so). {fix}.")
    return recursively_apply(shard.whole_sequence, outputs)


def check_whole_row_trainer(trainer, cp_size: int) -> None:
    """Raise ValueError, naming the setting and the fix, for a setting of a whole-row trainer (TRL's DPO, KTO, Reward,
    experimental ORPO, CPO) that CP cannot run as one process does: a MoE's load-balancing loss (TRL's
    `aux_loss_enabled`, or a model config that asks for router logits, which TRL's fused head then adds to its loss):
    it multiplies means over all the tokens of the batch, which no rank's shard gives, and these trainers are not
    tested with `router_loss.py`'s gather."""
    config = getattr(trainer.model, "config", None)
    routed = config is not None and getattr(config.get_text_config(), "output_router_logits", False)
    if getattr(trainer, "aux_loss_enabled", False) or routed:
        raise ValueError(
            f"{type(trainer).__name__} with a MoE's load-balancing loss (router_aux_loss_coef "
            f"{getattr(trainer, 'router_aux_loss_coef', None)}, output_router_logits {routed}) under context "
            f"parallelism (CP {cp_size}) is not supported: that loss multiplies means over all the tokens of the "
            "batch, and this trainer's whole-row forwards are not tested with the router loss gathered over the CP "
            "group (the Trainer's and SFTTrainer's are, for Mixtral, Qwen2/3-MoE, OLMoE and GPT-OSS; other models' "
            "router logits cover each rank's shard alone). Fix: --router_aux_loss_coef 0 (TRL's "
            "DPOConfig, KTOConfig) and output_router_logits=False in the model config, or run without CP (drop "
            "--cp_size).")


def hook_whole_row_forwards(trainer, patches, parallel: Callable[[], ParallelDims],
                            prepare: Callable[[dict[str, Any]], dict[str, Any]],
                            active: Callable[[], bool]) -> Callable[[], None]:
    """A function that makes the forwards of `trainer.model` and of its reference model (`trainer.ref_model`, when it
    has one) CP forwards over whole rows while `active()` (a training or prediction step runs) and the step's layout
    `parallel()` has a CP degree above 1: each forward's inputs are sharded by `prepare` (the CP input preparation),
    its per-token outputs gathered back into the whole rows. Call it at every step: it hooks the models it has not
    hooked yet (TRL builds its reference model after the Trainer's `__init__`, where a launched script's CP starts).
    `patches` removes the hooks."""
    hooked: set[int] = set()

    def hook() -> None:
        reference = getattr(trainer, REFERENCE_MODEL, None)
        if id(trainer.model) not in hooked:  # (its CP guard is CP's own, `guard_context_parallel`)
            hooked.add(id(trainer.model))
            _hook(trainer.model, patches, parallel, prepare, active)
        if isinstance(reference, torch.nn.Module) and id(reference) not in hooked:
            hooked.add(id(reference))
            for handle in guard_context_parallel(reference):  # (they see the inputs the pre-hook, run first, shards)
                patches.on_undo(handle.remove)
            _hook(reference, patches, parallel, prepare, active)

    return hook


def _hook(model: torch.nn.Module, patches, parallel, prepare, active) -> None:
    # the shards of the forwards this hook sharded, each with whether the forward got `labels` (which a fused head
    # shifts itself); weak: a forward that raised leaves nothing behind
    sharded_here: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
    # (a sequence-classification head's pooled score is the batch's on every rank already: `pool_over_cp_group`)
    batch_outputs = BATCH_OUTPUT_HEADS.get(model_head(model), 0)

    def shard(module, args, kwargs):
        if not active() or parallel().cp_size == 1 or kwargs.get(CP_SHARD_KWARG) is not None:
            return None
        named = _by_name(module, args, kwargs)  # (labels may come positionally too)
        inputs = _sharded_inputs(type(module).__name__, named, prepare)
        sharded_here[inputs[CP_SHARD_KWARG]] = named.get("labels") is not None and named.get("shift_labels") is None
        return (), inputs

    def gather(module, args, kwargs, output):
        cp_shard = kwargs.get(CP_SHARD_KWARG)
        shifted_by_head = None if cp_shard is None else sharded_here.pop(cp_shard, None)
        if shifted_by_head is None:
            return None
        return _whole_row_outputs(type(module).__name__, output, kwargs, shifted_by_head, batch_outputs)

    # (first: the CP guard's pre-hook then sees the shard, and NEFTune's scale the forward's CPShard)
    patches.on_undo(model.register_forward_pre_hook(shard, with_kwargs=True, prepend=True).remove)
    patches.on_undo(model.register_forward_hook(gather, with_kwargs=True).remove)


def _by_name(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The inputs of a forward of `module` called with `args` and `kwargs`, each by its parameter's name (TRL's ORPO
    and CPO trainers pass input_ids positionally), a PEFT model's by its base model's forward. Raises ValueError,
    naming the fix, where the forward's signature does not name them."""
    if not args:
        return kwargs
    signature = inspect.signature(module.forward)
    # (a PEFT model without a task type, `PeftModel`, takes `*args` and hands them to its base model as they are)
    if hasattr(module, "get_base_model") and any(parameter.kind is inspect.Parameter.VAR_POSITIONAL
                                                 for parameter in signature.parameters.values()):
        signature = inspect.signature(module.get_base_model().forward)
    try:
        bound = signature.bind_partial(*args)
    except TypeError:
        bound = None
    if bound is None or any(signature.parameters[name].kind is inspect.Parameter.VAR_POSITIONAL
                            for name in bound.arguments):
        raise ValueError(
            f"a forward of {type(module).__name__} under context parallelism got {len(args)} positional inputs that "
            "its signature does not name: the plugin shards the inputs of a whole-row forward by name (input_ids=..., "
            f"attention_mask=...); pass them by name, or {_FIX}.")
    return {**bound.arguments, **kwargs}


def _sharded_inputs(model: str, kwargs: dict[str, Any], prepare) -> dict[str, Any]:
    """This rank's keyword inputs for a forward of `model` called with whole rows (`kwargs`, every input by name): the
    CP input preparation of its sequence inputs, with the other keywords as given. Raises ValueError, naming the input
    and the fix, for a per-token input the preparation does not shard, and for labels handed to a forward without
    TRL's fused LM head (the model's own loss would be this rank's shard's)."""
    batch = {key: kwargs[key] for key in SHARDED_INPUTS if kwargs.get(key) is not None}
    rest = {key: value for key, value in kwargs.items() if key not in SHARDED_INPUTS}
    rows = batch.get("input_ids", batch.get("inputs_embeds"))
    if rows is None:
        raise ValueError(f"a forward of {model} under context parallelism got neither input_ids nor inputs_embeds, "
                         f"which the plugin shards along the sequence: {_FIX}.")
    for key, value in rest.items():
        if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[:2] == rows.shape[:2]:
            raise ValueError(
                f"a forward of {model} under context parallelism got `{key}` of shape {tuple(value.shape)}, an input "
                f"per token that the plugin does not shard (it shards {', '.join(SHARDED_INPUTS)}): each rank would "
                f"pair this rank's tokens with the whole sequence's `{key}`. Drop it from the batch, or {_FIX}.")
    fused = bool(rest.get("fused_lm_head"))
    if not fused and ("labels" in batch or "shift_labels" in batch):
        raise ValueError(
            f"a forward of {model} under context parallelism got labels without TRL's fused LM head "
            "(fused_lm_head=True): the model's own loss would be each rank's shard's, not the rows'. Compute the loss "
            f"from the gathered per-token outputs, or {_FIX}.")
    sharded = prepare(batch)
    sharded.pop("labels", None)  # (the fused head scores the shifted targets of this rank's positions)
    if not fused:
        sharded.pop("shift_labels", None)
    return {**rest, **sharded}


def _whole_row_outputs(model: str, output, kwargs: dict[str, Any], shifted_by_head: bool, batch_outputs: int):
    """`output` of a CP forward of `model` as one process returns it for the whole rows: its first `batch_outputs`
    fields as they are (a sequence-classification head's pooled logits, the batch's on every rank), every per-token
    output gathered over the CP group (`whole_sequence_outputs`), without the last position where TRL's fused head was
    given `labels` (it shifts them: one process scores seq_len - 1 positions), and the fused head's loss (its mean
    over the label tokens, or their sum over `num_items_in_batch`) recomputed from the whole rows."""
    shard = kwargs[CP_SHARD_KWARG]
    fix = (f"Fix: {_FIX}; a MoE's load-balancing loss (`aux_loss`), not a sum over tokens, is left out with TRL's "
           "--router_aux_loss_coef 0 and the model config's output_router_logits=False")
    fields = {key: value for key, value in output.items() if key != "loss"}
    pooled = dict(list(fields.items())[:batch_outputs])
    whole = whole_sequence_outputs({key: value for key, value in fields.items() if key not in pooled}, shard,
                                   f"a forward of {model}", fix)
    if shifted_by_head:
        whole = {key: value[:, :-1] for key, value in whole.items()}
    if kwargs.get("fused_lm_head"):
        count = kwargs.get("num_items_in_batch")
        whole["loss"] = -whole["log_probs"].sum() / (whole["label_mask"].sum().clamp(min=1) if count is None else count)
    return type(output)(**pooled, **whole)
