"""Modules whose class routes a function through the Hub's `kernels` package (`@use_kernelized_func`: transformers'
attention classes with `apply_rotary_pos_emb`, the Mamba mixers with their convolutions) set a module-wide
context variable around each forward, so that a kernelized copy of the function runs inside. Under torch.compile that
setting is a side effect, which the higher-order op of an activation-checkpointed layer cannot trace: each checkpointed
decoder layer broke the graph and ran in eager PyTorch (a tiny 4-layer Llama with gradient checkpointing compiled to 5
graphs with 4 breaks; none without the `kernels` package, or without checkpointing). Where no function of a module
is kernelized, the routing changes nothing (the function runs as written): such a module's forward skips it, and
goes through it again once `kernelize` replaces one of its functions."""

from __future__ import annotations

import torch

from .memory_savers import ReplacedForward
from .patching import attached_patches, record_on, undo_recorded

_FEATURE = "unrouted_kernel_funcs"


def _routing_forward(cls: type) -> bool:
    """Whether `cls.forward` is the `kernels` package's routing wrapper (`use_kernelized_func`'s, which keeps the
    class's own forward as `__wrapped__`)."""
    forward = cls.__dict__.get("forward")
    code, module = getattr(forward, "__code__", None), getattr(forward, "__globals__", {}).get("__name__", "")
    return (code is not None and code.co_name == "new_forward" and module.split(".")[0] == "kernels"
            and callable(getattr(forward, "__wrapped__", None)))


class _UnroutedForward(ReplacedForward):
    """The class's own forward (the routing wrapper's `__wrapped__`, read at each call: a copy of the model pickles
    the class by name, not the wrapped function, which its module no longer holds) while none of the module's
    functions is kernelized, else the routing one."""

    def __call__(self, *args, **kwargs):
        # (`kernelize` gives a kernelized function's private copy a forward of its own)
        if any("forward" in func.__dict__ for func in self.module.__dict__["_kernel_funcs"].values()):
            return self.replaced(*args, **kwargs)
        return type(self.module).forward.__wrapped__(self.module, *args, **kwargs)


def unroute_kernel_funcs(model: torch.nn.Module) -> int:
    """Have each module of `model` that routes functions through the `kernels` package skip the routing while none
    of its functions is kernelized (instance forwards, recorded on `model`; `route_kernel_funcs` undoes them). Returns
    how many modules it changed (0 where the package, or such a module, is absent)."""
    if attached_patches(model, _FEATURE) is not None:
        return 0
    found = []
    for module in model.modules():
        cls = next(c for c in type(module).__mro__ if "forward" in c.__dict__)  # (the forward a call runs)
        if _routing_forward(cls) and "_kernel_funcs" in module.__dict__ and "forward" not in module.__dict__:
            found.append(module)
    if found:
        patches = record_on(model, _FEATURE)
        for module in found:
            patches.set_attr(module, "forward", _UnroutedForward(module))
    return len(found)


def route_kernel_funcs(model: torch.nn.Module) -> bool:
    """Undo `unroute_kernel_funcs(model)`; False when it changed nothing."""
    return undo_recorded(model, _FEATURE)
