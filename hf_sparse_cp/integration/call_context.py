"""What a forward in progress tells the attention calls inside it: a probe that stands in for the CP shard and records
each call (`AttentionProbe`, `probing`), or the CP shard of a forward under context parallelism, which a hooked model
makes every call carry (`guard_context_parallel`, `cp_forward_shard`)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from typing import NamedTuple

import torch

from ..distributed.shard import CP_SHARD_KWARG

_GUARD_TOKENS = "_hf_sparse_cp_cp_forward"


# The CP shard of the model forward under context parallelism in progress, None outside one (see
# `guard_context_parallel`).
_CP_FORWARD: ContextVar = ContextVar("hf_sparse_cp_cp_forward", default=None)


class ProbedCall(NamedTuple):
    """One attention call of a probe forward: the attention module, whether the probe arrived in place of
    the CP shard, the dimensions of the mask it got (None: none; the registered mask function gives
    None or the 2D padding mask, so anything else is a mask the model built itself), the sliding window it
    passed and what it asked that sparse_cp does not implement (`unsupported_feature`)."""

    module: torch.nn.Module
    reached: bool
    mask_dims: int | None
    sliding_window: int | None = None
    unsupported: str | None = None


class AttentionProbe:
    """Stands in for the CP shard in a probe forward (`models.check_attention_routed`,
    `models.check_model_supports_context_parallel`): the backend records every attention call
    (`ProbedCall`) and returns zeros."""

    def __init__(self) -> None:
        self.calls: list[ProbedCall] = []


_PROBE: ContextVar[AttentionProbe | None] = ContextVar("hf_sparse_cp_probe", default=None)

# How many probes and forwards under context parallelism are in progress in this process (the context variables
# above, counted): while any is, calls inside a trace go outside the graph, where those are read. A trace guards on
# this global's value (reading a context variable would break the graph).
IN_PROGRESS = {"probes and CP forwards": 0}


def _count_in_progress(change: int) -> None:
    IN_PROGRESS["probes and CP forwards"] += change


@contextlib.contextmanager
def probing(probe: AttentionProbe) -> Iterator[None]:
    """Attention calls inside the block go to `probe` instead of computing."""
    token = _PROBE.set(probe)
    _count_in_progress(1)
    try:
        yield
    finally:
        _count_in_progress(-1)
        _PROBE.reset(token)


def guard_context_parallel(model: torch.nn.Module) -> list:
    """Make an attention call that arrives without the CP shard an error while a forward of `model`
    with the shard runs: such a call would attend within this rank's shard only. Returns the hook
    handles (remove them to undo). The hooks are module-level functions: the model still pickles."""
    return [model.register_forward_pre_hook(_enter_cp_forward, with_kwargs=True),
            model.register_forward_hook(_leave_cp_forward, with_kwargs=True, always_call=True)]


# How many forwards with the CP shard began in this process (`cp_forwards_begun`).
_BEGUN = [0]


def cp_forwards_begun() -> int:
    """How many forwards of a model `guard_context_parallel` hooks began with the CP shard in this process so far."""
    return _BEGUN[0]


def _enter_cp_forward(module: torch.nn.Module, args, kwargs) -> None:
    if kwargs.get(CP_SHARD_KWARG) is not None:
        _BEGUN[0] += 1
        module.__dict__.setdefault(_GUARD_TOKENS, []).append(_CP_FORWARD.set(kwargs[CP_SHARD_KWARG]))
        _count_in_progress(1)


def _leave_cp_forward(module: torch.nn.Module, args, kwargs, output) -> None:
    tokens = module.__dict__.get(_GUARD_TOKENS)
    if tokens and kwargs.get(CP_SHARD_KWARG) is not None:
        _CP_FORWARD.reset(tokens.pop())
        _count_in_progress(-1)
        if not tokens:  # (the outermost forward: nothing stays on the module)
            del module.__dict__[_GUARD_TOKENS]


def cp_forward_shard():
    """The `CPShard` of the forward under context parallelism in progress of a model `guard_context_parallel` hooks,
    or None outside one."""
    return _CP_FORWARD.get()


def current_probe() -> AttentionProbe | None:
    """The probe the attention calls in progress go to (`probing`), or None."""
    return _PROBE.get()
