"""Position tables fed the positions their decoder counts from the length of its input: the BART family's decoders
(BART, mBART, PLBart, Blenderbot, Blenderbot-Small, Marian, Pegasus) hand their learned (BART's: offset 2) or
sinusoidal table `arange(seq_len) + cache length` whatever `position_ids` the model was given. Under context
parallelism that input is a rank's shard, so every rank would count its own tokens from 0 (and the striped or zigzag
order would not count at all): a forward pre-hook on each such table hands it the positions of the shard's tokens
in the row instead, those one process counts (the split's padding gets position 0, as `shard_inputs` gives it).
Outside a CP forward the hook does nothing.
"""

from __future__ import annotations

import inspect

import torch
from torch.utils.hooks import RemovableHandle

from ..distributed.shard import CPShard
from .call_context import cp_forward_shard, guard_context_parallel

# Marks a table whose pre-hook is in place (`hook_length_counted_tables`), read by the CP model check.
_HOOKED = "_hf_sparse_cp_counted_positions"


def _takes(module: torch.nn.Module, name: str) -> bool:
    return name in inspect.signature(module.forward).parameters


def length_counted_tables(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module, torch.nn.Module]]:
    """(name, table, owner) for every position table of `model` whose owner counts the positions it hands it: an
    embedding class of its own whose forward takes `position_ids`, held by a module whose forward takes none (BART's
    decoder). A decoder that takes `position_ids` (Whisper's) gets the shard's from the CP inputs, and its table
    is not listed."""
    modules = dict(model.named_modules())
    return [(name, module, owner) for name, module in modules.items()
            if name and isinstance(module, torch.nn.Embedding) and type(module) is not torch.nn.Embedding
            and _takes(module, "position_ids")
            and not _takes(owner := modules[name.rpartition(".")[0]], "position_ids")]


def unhooked_length_counted_tables(model: torch.nn.Module) -> list[str]:
    """The names of `length_counted_tables` of `model` without the pre-hook (a model not switched by `configure`)."""
    return [name for name, table, _ in length_counted_tables(model) if not table.__dict__.get(_HOOKED)]


def hook_length_counted_tables(model: torch.nn.Module) -> list[RemovableHandle]:
    """Hook every `length_counted_tables` entry of `model` (and guard its owner, whose forward gets the CP shard, so
    that the hook finds it: `call_context.cp_forward_shard`). Returns the handles; removing them does not clear the mark
    the CP check reads, `unhook` does."""
    handles, owners = [], set()
    for _, table, owner in length_counted_tables(model):
        handles.append(table.register_forward_pre_hook(_one_process_positions, with_kwargs=True))
        table.__dict__[_HOOKED] = True
        if id(owner) not in owners:
            owners.add(id(owner))
            handles += guard_context_parallel(owner)
    return handles


def unhook(model: torch.nn.Module) -> None:
    """Clear the marks `hook_length_counted_tables` left on `model`'s tables (with its handles removed)."""
    for _, table, _ in length_counted_tables(model):
        table.__dict__.pop(_HOOKED, None)


def _one_process_positions(table: torch.nn.Module, args, kwargs):
    """Forward pre-hook of a length-counted table: under a CP forward, its `position_ids` are the shard's tokens'
    positions in the row (1D, as the decoders pass them: one row of positions for the whole batch)."""
    shard = cp_forward_shard()
    if not isinstance(shard, CPShard):  # (outside a CP forward, or a probe forward: `models._probe`)
        return None
    plan = shard.plan
    positions = plan.shard(torch.arange(plan.seq_len, device=table.weight.device), shard.rank, dim=0, pad_value=0)
    bound = inspect.signature(table.forward).bind(*args, **kwargs)
    bound.arguments["position_ids"] = positions
    return bound.args, bound.kwargs
