"""The aliasing of tied weights, given back to a state dict gathered from shards.

A full state dict gathered from FSDP2's shards (`accelerator.get_state_dict`) holds a tensor per name: the LM head
tied to the input embeddings comes back as two equal tensors, and `save_pretrained`, which recognises tied weights by
their shared storage, saved both (a tiny Llama's model.safetensors: 21 tensors instead of the 20 of the same model
saved without FSDP; for Qwen2.5-0.5B the [151936, 896] matrix twice). `alias_tied_weights` makes the names of one
parameter name one tensor again, so the file is the one an unsharded save writes.
"""

from __future__ import annotations

import torch


def alias_tied_weights(model: torch.nn.Module, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state_dict` (`model`'s, gathered) with every name of a parameter or buffer that `model` shares under several
    names mapped to the tensor of its first name, where the gathered tensors are equal (a copy of `state_dict`)."""
    names: dict[int, list[str]] = {}
    for name, tensor in (*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)):
        names.setdefault(id(tensor), []).append(name)
    aliased = dict(state_dict)
    for shared in names.values():
        first, *others = [name for name in shared if name in state_dict] or [None]
        for other in others:
            if torch.equal(aliased[other], aliased[first]):
                aliased[other] = aliased[first]
    return aliased
