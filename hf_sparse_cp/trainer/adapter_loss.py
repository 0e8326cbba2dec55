"""A PEFT adapter's regularizer under context parallelism, as one process weighs it.

AdaLoRA's model adds `orth_reg_weight x R` to the model's loss (R: the orthogonality of its A and B matrices, a
function of the weights alone, not a sum over tokens). Every CP rank adds the same R to its shard's share of the token
loss; the Trainer's own compute_loss then multiplies the rank's loss by the number of processes (the CP ranks among
them, `average_tokens_across_devices`) and the gradients are averaged over them: the CP group counted R cp_size times
(measured: the logged loss 22% above one process's after one step of a tiny model, the adapter weights 100% apart after
two). Inside such a compute_loss the weight is scaled by the rank's share (`router_loss.model_loss_share`, 1 / cp_size),
so the CP group's sum holds R once, as the router loss's does.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

import torch

from ..integration.patching import temporarily


def regularized_adapter_configs(model: torch.nn.Module) -> list:
    """The configs of `model`'s AdaLoRA adapters whose forward adds an orthogonal regularizer to the loss (the
    trained adapter's, `orth_reg_weight` above 0). A model is a PEFT model only where `peft` was imported."""
    peft = sys.modules.get("peft")
    adalora = getattr(peft, "AdaLoraModel", None)
    if adalora is None:
        return []
    return [config for module in model.modules() if isinstance(module, adalora)
            for config in [module.peft_config[module.trainable_adapter_name]] if config.orth_reg_weight > 0]


@contextlib.contextmanager
def regularizer_share(model: torch.nn.Module, share: float) -> Iterator[None]:
    """Around a compute_loss under CP: the weight of `model`'s adapter regularizers times `share` (the rank's share
    of a term every rank adds alike)."""
    with contextlib.ExitStack() as stack:
        if share != 1.0:
            for config in regularized_adapter_configs(model):
                stack.enter_context(temporarily(config, "orth_reg_weight", config.orth_reg_weight * share))
        yield
