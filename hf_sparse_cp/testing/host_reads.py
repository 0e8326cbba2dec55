"""Count the reads of tensor data back to the host (`count_host_reads`): on a GPU each one stalls the host until the
device's queue drains, so the kernels after it cannot be queued ahead. Counted on any device, a CPU included, by
patching the Python entry points that read a tensor's values or make a shape depend on them: `item`, `tolist`,
`numpy`, `cpu`, `bool()` / `int()` / `float()` / `index()` of a tensor, `nonzero` / `argwhere` / one-argument
`where`, `unique` / `unique_consecutive`, `masked_select`, `bincount`, a tensor-valued `repeat_interleave` without
`output_size`, and indexing with a boolean tensor. Reads inside C++ (a size given as a tensor) are not seen; nor
is the first read of the host copy a counted `cpu()` made (`x.cpu().numpy()` is one read).

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

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_HERE = os.path.abspath(__file__)
_REPO = os.path.dirname(os.path.dirname(os.path.dirname(_HERE))) + os.sep

_METHODS = ("item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__float__", "__index__", "nonzero", "argwhere",
            "unique", "unique_consecutive", "masked_select", "bincount")
_FUNCTIONS = ("nonzero", "argwhere", "unique", "unique_consecutive", "masked_select", "bincount")


@dataclass
class HostReads:
    """The reads seen: `sites` counts them by `(site, kind)`; `site` is `path:line function` relative to the
    repository (absolute outside it)."""

    sites: collections.Counter = field(default_factory=collections.Counter)
    copies: dict = field(default_factory=dict)  # the host copies made by cpu(), until their first use

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
            return f"{path.removeprefix(_REPO)}:{frame.f_lineno} {frame.f_code.co_name}"
        frame = frame.f_back
    return "<torch>"


def _is_bool_tensor(index) -> bool:
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts)


def _recording(original, kind: str, reads: HostReads, reads_if=None):
    def wrapper(*args, **kwargs):
        if getattr(_state, "busy", False):
            return original(*args, **kwargs)
        _state.busy = True
        try:
            copy = reads.copies.pop(id(args[0]), None)  # (the first use of a counted copy: one read, not two)
            host_copy = copy is not None and copy() is args[0]
            if not host_copy and (reads_if is None or reads_if(*args, **kwargs)):
                reads.sites[(_site(), kind)] += 1
            result = original(*args, **kwargs)
            if kind == "cpu":
                reads.copies[id(result)] = weakref.ref(result)
            return result
        finally:
            _state.busy = False
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
    saved: list[tuple[object, str, object]] = []

    def patch(owner, name: str, kind: str, reads_if=None) -> None:
        original = getattr(owner, name)
        saved.append((owner, name, original))
        setattr(owner, name, _recording(original, kind, reads, reads_if))

    for name in _METHODS:
        patch(torch.Tensor, name, name.strip("_"))
    for name in _FUNCTIONS:
        patch(torch, name, name)
    patch(torch, "where", "where(condition)", _one_argument_where)
    patch(torch.Tensor, "repeat_interleave", "repeat_interleave", _unsized_repeats)
    patch(torch, "repeat_interleave", "repeat_interleave", _unsized_repeats)
    patch(torch.Tensor, "__getitem__", "bool-mask index", lambda self, index: _is_bool_tensor(index))
    patch(torch.Tensor, "__setitem__", "bool-mask assign", lambda self, index, value: _is_bool_tensor(index))
    try:
        yield reads
    finally:
        for owner, name, original in reversed(saved):
            setattr(owner, name, original)
