"""The class a model was built as, past FSDP2's renaming (`unsharded_class`), for the upstream checks that go by a
class's name and miss FSDPLlamaForCausalLM: whether the Trainer's label smoother shifts the labels
(`smoother_shifts_labels`) and the task the Trainer's model card infers (`card_tasks`)."""

from __future__ import annotations

from typing import Any


def unsharded_class(model: Any) -> type:
    """The class `model` was built as: FSDP2's `fully_shard` replaces a module's class with one it derives from it,
    named FSDP<name> (FSDPLlamaForCausalLM; Replicate<name> for `replicate`), which upstream checks of the class's
    name (`smoother_shifts_labels`, `card_tasks`) do not know; a module not sharded keeps its own class."""
    cls = type(model)
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # (a torch build without distributed: no FSDP2 class to look past)
        return cls
    return next(c for c in cls.__mro__ if not issubclass(c, FSDPModule))


def smoother_shifts_labels(model: Any) -> bool:
    """Whether the Trainer's compute_loss has its label smoother shift the labels of `model` (the Trainer's model):
    its class, a PEFT model's base model's, is one of transformers' causal LMs. The Trainer asks by the class's name,
    which FSDP2's `fully_shard` replaces with its own class FSDP<name>: its check then missed every causal LM, so the
    smoother scored each position's logits against its own token, not the next (FSDP2 with --label_smoothing_factor:
    eval_loss 4.17 where one process has 5.59). This reads the name of the class that `fully_shard` derived from."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    base = getattr(model, "get_base_model", None)
    return unsharded_class(base() if callable(base) else model).__name__ in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()


def card_tasks(model: Any) -> str | None:
    """The task tag (e.g. 'text-generation') that the Trainer's model card infers from the class of `model` (the
    Trainer's model) when none is given, or None. The card (`transformers.modelcard.TrainingSummary.from_trainer`)
    looks the class's name up in `TASK_MAPPING`, which misses a class FSDP2 renamed (FSDPLlamaForCausalLM): the card
    of a run under FSDP2 had no task, and with it dropped the model-index results (task, dataset, metrics) that one
    process's card holds. This looks up the name of the class `fully_shard` derived from (the last task that names
    it, as the card does)."""
    from transformers.modelcard import TASK_MAPPING

    name, found = unsharded_class(model).__name__, None
    for task, mapping in TASK_MAPPING.items():
        names = [n for value in mapping.values() for n in (value if isinstance(value, (list, tuple)) else (value,))]
        if name in names:
            found = task
    return found
