"""A MoE router's load-balancing loss under context parallelism, as one process computes it.

transformers' `load_balancing_loss_func` (Mixtral's, PhiMoE's, Jamba's, ...: the module-level function each MoE causal
LM calls when `output_router_logits`; every one taking `architectures.ROUTER_LOSS_PARAMETERS`) averages the top-k
assignments and the router probabilities over the tokens, then sums their product: not a sum over tokens, so a CP rank's
shard gives another value. Inside a CP forward the wrapper gathers each layer's router logits over the CP group into the
whole batch (`CPShard.whole_sequence`, the split's padding dropped) and hands them, with the whole batch's attention
mask, to the model's own function: every rank computes one process's value L.

The gradient: every rank holds the same L, and its backward hands each rank the CP group's sum of the gradients of its
own positions (the ranks' upstream gradients are equal: cp_size x its positions' gradient). The ranks' gradients are
then averaged over the data-parallel x CP processes. A trainer that adds the term after its loss is scaled (TRL
SFTTrainer: `router_aux_loss_coef * aux_loss`, outside its multiplication by the processes), or without scaling, thus
gets one process's update. The Trainer's own loss with a token count (the model adds coef x L to its loss, which the
Trainer multiplies by the number of processes, the CP ranks among them, with `average_tokens_across_devices`, which
under CP it reads on during the call: `cp_group_steps`) gets the rank's share L / cp_size instead, whose CP group sum
the Trainer's report of the loss and the update take: `model_loss_share` tells which, around each compute_loss.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import sys
from collections.abc import Callable
from typing import Any

import torch
from transformers import Trainer

from ..integration.architectures import model_router_loss_modules
from ..integration.call_context import cp_forward_shard
from ..scoped import scoped

_SHARE: contextvars.ContextVar[float] = contextvars.ContextVar("router_loss_share", default=1.0)
# (while a wrapper runs the function it wraps: a wrapper of another trainer's CP, under it, passes the tokens through)
_GATHERED: contextvars.ContextVar[bool] = contextvars.ContextVar("router_logits_gathered", default=False)


def _over_cp_group(original: Callable) -> Callable:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def load_balancing_loss_func(*args, **kwargs):
        shard = cp_forward_shard()
        bound = signature.bind(*args, **kwargs)
        layers = bound.arguments.get("gate_logits")
        if shard is None or _GATHERED.get() or not isinstance(layers, tuple):
            return original(*args, **kwargs)
        b, n = shard.meta.index.shape[0], shard.plan.max_local_blocks * shard.plan.block_size
        rows = layers[0].shape[0] // b  # (this rank's shard tokens: every layer routes the same tokens)
        for logits in layers:
            if logits.dim() != 2 or rows * b != logits.shape[0] or rows > n:
                raise ValueError(f"{original.__module__}.load_balancing_loss_func under context parallelism got router "
                                 f"logits of shape {tuple(logits.shape)}, not [batch x shard tokens, experts] of a "
                                 f"batch of {b} rows like every layer's: the plugin cannot gather them into the whole "
                                 "sequence. Set router_aux_loss_coef 0 (or output_router_logits false), or run without "
                                 "CP.")
        # One all-gather for all the layers (not one per layer): their logits side by side along the experts, on the
        # device the model's function computes on. Its transient peak holds every layer's gathered logits at once.
        joined = torch.cat([logits.view(b, rows, -1).to(layers[0].device) for logits in layers], dim=-1)
        whole = shard.whole_sequence(joined).flatten(0, 1)
        bound.arguments["gate_logits"] = whole.split([logits.shape[-1] for logits in layers], dim=-1)
        bound.arguments["attention_mask"] = shard.attention_mask
        with scoped(_GATHERED, True):
            return original(*bound.args, **bound.kwargs) * _SHARE.get()

    return load_balancing_loss_func


def router_loss_over_cp_group(model: torch.nn.Module, patches) -> tuple[str, ...]:
    """Replace the `load_balancing_loss_func` of the modeling modules of `model`'s classes whose function has the
    form CP gathers (`architectures.model_router_loss_modules`) by the CP group's (recorded in `patches`). Returns
    those modules."""
    names = model_router_loss_modules(model)
    for name in names:
        module = sys.modules[name]
        patches.set_attr(module, "load_balancing_loss_func", _over_cp_group(module.load_balancing_loss_func))
    return names


def model_loss_share(trainer: Trainer, num_items_in_batch: Any, cp_size: int) -> float:
    """A CP rank's share of a term of the model's loss that every rank of the group computes alike: 1 / cp_size where
    the Trainer's own compute_loss multiplies the model's loss by the number of processes, else 1."""
    args = trainer.args
    scaled = (type(trainer).compute_loss is Trainer.compute_loss and args.average_tokens_across_devices
              and (trainer.model_accepts_loss_kwargs or trainer.compute_loss_func) and num_items_in_batch is not None)
    return 1.0 / cp_size if scaled else 1.0


def loss_share(share: float) -> contextlib.AbstractContextManager[None]:
    """Around a compute_loss under CP: the value of the router loss on each rank, L x `share` (`model_loss_share`)."""
    return scoped(_SHARE, share)
