"""Count the reads of tensor data back to the host (`count_host_reads`): on a GPU each one stalls the host until the
device's queue drains, so the kernels after it cannot be queued ahead. Counted on any device, a CPU included, by
patching the Python entry points that read a tensor's values or make a shape depend on them: `item`, `tolist`,
`numpy`, `cpu`, `bool()` / `int()` / `float()` / `index()` of a tensor, `nonzero` / `argwhere` / one-argument
`where`, `unique` / `unique_consecutive`, `masked_select`, `bincount`, a tensor-valued `repeat_interleave` without
`output_size`, and indexing with a boolean tensor, of a tensor that would be on the device on a GPU run
(`_HostTensors`: the host copies and what is computed from them read nothing). Reads inside C++ (a size given as a
tensor) are not seen.

Each read is recorded at the innermost Python frame outside torch and this module (`file:line function`), so a
table says which line of the plugin, of transformers or of a test asked for it."""

from __future__ import annotations

import collections
import contextlib
import os
import sys
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

import hf_sparse_cp

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_HERE = os.path.abspath(__file__)
# The sites are named relative to the repository, or to the folder that holds the package where it is installed
# (not editable: site-packages), so that a plugin line reads `hf_sparse_cp/...` either way.
_ROOTS = (os.path.dirname(os.path.dirname(_HERE)) + os.sep,
          os.path.dirname(os.path.dirname(os.path.abspath(hf_sparse_cp.__file__))) + os.sep)

_METHODS = ("item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__float__", "__index__", "nonzero", "argwhere",
            "unique", "unique_consecutive", "masked_select", "bincount")
_FUNCTIONS = ("nonzero", "argwhere", "unique", "unique_consecutive", "masked_select", "bincount")
# Indexing with a boolean tensor, counted by the torch-function mode rather than patched onto torch.Tensor: a
# __getitem__ set on the Python class (even once deleted again) leaves CPython's sequence slot filled, so every tensor,
# a 0-d one included, passes for a sequence (torch.tensor([t0, t1]) then asks a 0-d tensor for its len()).
_MASK_INDEXING = {torch.Tensor.__getitem__: "bool-mask index", torch.Tensor.__setitem__: "bool-mask assign"}


@dataclass
class HostReads:
    """The reads seen: `sites` counts them by `(site, kind)`; `site` is `path:line function` relative to the
    repository or to the installed package's folder (absolute outside them)."""

    sites: collections.Counter = field(default_factory=collections.Counter)

    @property
    def total(self) -> int:
        return sum(self.sites.values())

    def table(self) -> str:
        """One line per site and kind, most frequent first."""
        return "\n".join(f"{n:6d}  {kind:<22} {site}" for (site, kind), n in self.sites.most_common())


_state = threading.local()


def _site() -> str:
    frame = sys._getframe(2)
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if not path.startswith(_TORCH_DIR) and path != _HERE and not path.startswith("<"):
            root = next((r for r in _ROOTS if path.startswith(r)), "")
            return f"{path.removeprefix(root)}:{frame.f_lineno} {frame.f_code.co_name}"
        frame = frame.f_back
    return "<torch>"


def _is_bool_tensor(index) -> bool:
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts)


def _device_given(func, args, kwargs) -> str | None:
    """Where an op is told to put its result: "host" for the device named "cpu" in a string (code that means the
    host), "device" for any other device or a `torch.device` (code that means the data's device: on a CPU run that
    is "cpu" too), None when not told."""
    given = "cuda" if func.__name__ == "cuda" else kwargs.get("device")
    if given is None and func.__name__ == "to":
        given = next((a for a in args[1:] if isinstance(a, (str, torch.device, torch.Tensor))), None)
    if given is None:
        return None
    return "host" if isinstance(given, str) and torch.device(given).type == "cpu" else "device"


class _HostTensors(TorchFunctionMode):
    """Tells the tensors that live on the host on a GPU run apart from those on the device, on any device: a tensor
    is on the host when `cpu()` made it (always a copy here, as from a GPU), an op given the device "cpu" by name
    (a string) made it, or an op made it from host tensors only and was given no device (a factory without one included,
    `torch.arange(n)`; `to(dtype)`); an op given a `torch.device` (the data's) or another device makes a device tensor.
    Reading a host tensor reads nothing back."""

    def __init__(self, reads: HostReads) -> None:
        super().__init__()
        self._host: dict[int, weakref.ref] = {}
        self._reads = reads

    def holds(self, t) -> bool:
        """Whether `t`, or the tensor it views, is on the host (a view made where the mode does not reach, as in a
        custom autograd function's backward, is known by its base)."""
        for x in (t, getattr(t, "_base", None)):
            ref = self._host.get(id(x))
            if ref is not None and ref() is x:
                return True
        return False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind = _MASK_INDEXING.get(func)
        if kind and _is_bool_tensor(args[1]) and not self.holds(args[0]) and not getattr(_state, "busy", False):
            self._reads.sites[(_site(), kind)] += 1
        if func.__name__ == "cpu" and isinstance(args[0], torch.Tensor):  # (the method, patched or not)
            out = func(*args, **kwargs)
            out = out.clone() if out is args[0] else out
            host = True
        else:
            out = func(*args, **kwargs)
            tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            target = _device_given(func, args, kwargs)
            host = (target is None and all(self.holds(t) for t in tensors)) or target == "host"
        if host:
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self._host[id(t)] = weakref.ref(t)
        return out


def _recording(original, kind: str, reads: HostReads, host: _HostTensors, reads_if=None):
    def wrapper(*args, **kwargs):
        if getattr(_state, "busy", False) or (kind != "cpu" and host.holds(args[0])):
            return original(*args, **kwargs)
        _state.busy = True
        try:
            if reads_if is None or reads_if(*args, **kwargs):
                reads.sites[(_site(), kind)] += 1
            return original(*args, **kwargs)
        finally:
            _state.busy = False
    wrapper.__name__ = original.__name__
    return wrapper


def _unsized_repeats(self_or_input, repeats=None, *args, output_size=None, **kwargs) -> bool:
    return isinstance(repeats, torch.Tensor) and repeats.numel() > 1 and output_size is None


def _one_argument_where(condition, *args, **kwargs) -> bool:
    return not args and not kwargs


@contextlib.contextmanager
def count_host_reads() -> Iterator[HostReads]:
    """Within the block, every host read of a tensor's data (see the module) is counted in the yielded `HostReads`;
    everything patched is restored on exit. One thread counts: the patches are process-wide."""
    reads = HostReads()
    host = _HostTensors(reads)
    saved: list[tuple[object, str, object, bool]] = []

    def patch(owner, name: str, kind: str, reads_if=None) -> None:
        original = getattr(owner, name)
        saved.append((owner, name, original, name in vars(owner)))
        setattr(owner, name, _recording(original, kind, reads, host, reads_if))

    for name in _METHODS:
        patch(torch.Tensor, name, name.strip("_"))
    for name in _FUNCTIONS:
        patch(torch, name, name)
    patch(torch, "where", "where(condition)", _one_argument_where)
    patch(torch.Tensor, "repeat_interleave", "repeat_interleave", _unsized_repeats)
    patch(torch, "repeat_interleave", "repeat_interleave", _unsized_repeats)
    try:
        with host:
            yield reads
    finally:
        # (an attribute the class only inherited, as torch.Tensor's item from TensorBase, is deleted, not left set)
        for owner, name, original, own in reversed(saved):
            if own:
                setattr(owner, name, original)
            else:
                delattr(owner, name)
