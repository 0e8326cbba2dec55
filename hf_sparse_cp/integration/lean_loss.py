"""Causal-LM `forward` that trains without materializing [B, S, vocab] logits: `enable_lean_loss()`.

The stock forward of the supported `*ForCausalLM` classes computes `lm_head` over every position
and then an fp32 cross-entropy: at 64K tokens and a 151936-token vocabulary that alone is tens of
GiB. The replacement runs the base model, then `linear_cross_entropy` straight from the final
hidden states (liger-kernel on CUDA when installed, chunked PyTorch otherwise) and returns
`logits=None`, like liger-kernel does. It takes this path only for models configured for the plugin
(`hf_sparse_cp.configure(model)`, or the Trainer glue: their config holds `sparse_attention`), and
only when it can reproduce the stock loss: training mode, labels or `shift_labels` given, the default
`ForCausalLM` loss, a plain linear `lm_head` with a local weight or sharded by FSDP2, no logit soft-capping.
An FSDP2-sharded head (accelerate shards it with the final norm as one unit) computes the loss inside a
call of the module, so that FSDP2's hooks gather its weight for it and reduce-scatter its gradient after,
as around the stock forward's `lm_head(hidden)` (before, the lean path was never taken under FSDP2: every
training step built the full logits). Every other
call, and every other model, goes to the original forward, unchanged. One difference: stock computes
a loss only when `labels` is given, the lean path also from `shift_labels` alone (as liger-kernel
does), which is how context parallelism passes them.

The replacement is a named opt-in, separate from registering the attention backend:
`enable_lean_loss()` patches the classes' `forward` (recorded), `disable_lean_loss()` restores
each one that is still ours (a forward another library installed after us stays).
"""

from __future__ import annotations

import functools
import inspect

import torch
import torch.nn.functional as F
import transformers
from transformers.modeling_outputs import CausalLMOutputWithPast

from ..config import MODEL_CONFIG_ATTRIBUTE
from ..loss import linear_cross_entropy
from . import upstream
from .architectures import lean_loss_classes
from .patching import PatchSet


def _is_distributed_tensor(tensor: torch.Tensor) -> bool:
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def _is_fsdp2_module(module: torch.nn.Module) -> bool:
    if not torch.distributed.is_available():
        return False
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def _through_fsdp2(lm_head: torch.nn.Module) -> bool:
    """Whether `lm_head` is a module of an FSDP2 unit (its weight sharded outside the unit's forward) whose
    forward the lean path can run the loss in (`_head_loss`): no forward of its instance's own."""
    return _is_fsdp2_module(lm_head) and "forward" not in vars(lm_head)


def _takes_lean_path(model, labels, shift_labels) -> bool:
    lm_head = model.lm_head
    return (
        # Only models configured for the plugin (`hf_sparse_cp.configure`, the Trainer glue): the class forward is
        # replaced for every model of the process, and another model's caller may read the logits.
        getattr(model.config, MODEL_CONFIG_ATTRIBUTE, None) is not None
        and model.training
        and (labels is not None or shift_labels is not None)
        and model.loss_function is upstream.stock_causal_lm_loss()
        and getattr(model.config, "final_logit_softcapping", None) is None
        # A PEFT-wrapped head (LoRA, modules_to_save) is not an nn.Linear: its weight alone is not the head.
        and isinstance(lm_head, torch.nn.Linear)
        # A head of an FSDP2 unit goes through the module's hooks (`_head_loss`), where it has no forward of its own;
        # another distributed weight (tensor parallelism) takes the stock forward.
        and (_through_fsdp2(lm_head) if _is_fsdp2_module(lm_head) else not _is_distributed_tensor(lm_head.weight))
    )


def _head_loss(lm_head: torch.nn.Linear, hidden: torch.Tensor, labels: torch.Tensor, **loss_kwargs) -> torch.Tensor:
    """`linear_cross_entropy` of `lm_head` over `hidden`: computed directly from a local weight, or, for a module of
    an FSDP2 unit, as the forward of a call of the module, whose hooks unshard the weight for it (the unit's final norm
    may have already), end the unit's forward and reduce-scatter its gradient in the backward, as for the stock
    `lm_head(hidden)`."""

    def loss(h: torch.Tensor) -> torch.Tensor:  # (the weight as it is inside the call: FSDP2's unsharded one)
        return linear_cross_entropy(h, lm_head.weight, labels, bias=lm_head.bias, **loss_kwargs)

    if not _is_fsdp2_module(lm_head):
        return loss(hidden)
    lm_head.forward = loss  # (the instance's forward for this one call: `_through_fsdp2` checked it had none)
    try:
        return lm_head(hidden)
    finally:
        del lm_head.forward


# transformers 5.24 renamed the KV cache `past_key_values` -> `cache` (arguments and output fields; the old
# name warns, and goes in 5.40). The lean path passes the caller's arguments on under the names given and
# returns the base model's cache under the name this release's outputs use (`upstream.cache_field`).
_CACHE_FIELD = upstream.cache_field()


@upstream.can_return_tuple
def _forward_with_lean_loss(model, *, labels=None, logits_to_keep=0, shift_labels=None, num_items_in_batch=None,
                            ignore_index=-100, **base_inputs) -> CausalLMOutputWithPast:
    outputs = model.model(**base_inputs)
    hidden = outputs.last_hidden_state
    hidden = upstream.slice_logits_to_keep(hidden, logits_to_keep)
    if shift_labels is None:
        # Position i predicts token i + 1; the last position has no target.
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    if shift_labels.shape != hidden.shape[:-1]:
        raise ValueError(
            f"The labels cover {tuple(shift_labels.shape)} positions but the kept hidden states are "
            f"{tuple(hidden.shape[:-1])} (logits_to_keep={logits_to_keep!r}); pass labels for exactly the kept "
            "positions."
        )
    loss = _head_loss(model.lm_head, hidden.reshape(-1, hidden.shape[-1]), shift_labels.reshape(-1),
                      num_items_in_batch=num_items_in_batch, ignore_index=ignore_index)
    return CausalLMOutputWithPast(
        loss=loss,
        logits=None,
        hidden_states=outputs.hidden_states,
        attentions=outputs.attentions,
        **{_CACHE_FIELD: getattr(outputs, _CACHE_FIELD, None)},
    )


def lean_causal_lm_forward(original):
    """`forward` for a `*ForCausalLM` class: the memory-lean loss when training, else `original`, called
    with exactly the caller's arguments."""
    signature = inspect.signature(original)
    var_keyword = next(p.name for p in signature.parameters.values() if p.kind is inspect.Parameter.VAR_KEYWORD)

    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        given = signature.bind(self, *args, **kwargs).arguments  # by name, as the caller gave them
        given.pop("self")
        given.update(given.pop(var_keyword, {}))
        if _takes_lean_path(self, given.get("labels"), given.get("shift_labels")):
            return _forward_with_lean_loss(self, **given)
        return original(self, *args, **kwargs)

    return forward


_active: PatchSet | None = None


def enable_lean_loss() -> None:
    """Replace `forward` of the supported causal-LM classes (`architectures.lean_loss_classes`, each
    `model -> lm_head(hidden[:, logits_to_keep]) -> ForCausalLMLoss`) by the
    memory-lean one, which models configured with `hf_sparse_cp.configure` take in training (others keep
    the stock forward's logits). Idempotent; `disable_lean_loss()` undoes it."""
    global _active
    if _active is not None:
        return
    patches = PatchSet()
    for name in lean_loss_classes():
        cls = getattr(transformers, name)
        patches.set_attr(cls, "forward", lean_causal_lm_forward(cls.__dict__["forward"]))
    _active = patches


def disable_lean_loss() -> None:
    """Restore the forwards `enable_lean_loss()` replaced (those still ours); a no-op when not enabled."""
    global _active
    if _active is not None:
        _active.undo()
        _active = None


def is_lean_loss_enabled() -> bool:
    """Whether `enable_lean_loss()` replaced the causal-LM forwards and `disable_lean_loss()` has not restored them."""
    return _active is not None
