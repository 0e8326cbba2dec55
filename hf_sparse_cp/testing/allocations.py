"""Which tensors a piece of PyTorch code allocates and holds, on any device (CPU included): the way to find
what grows as S^2 without a GPU's allocator statistics.

`AllocationRecorder` is a dispatch mode that sees every op's output. A storage it has not seen is a fresh
allocation: it records its bytes, the op and the innermost `hf_sparse_cp` frame that called it, and follows
its life through a finalizer on the storage, so that it knows the bytes alive at any moment, their peak and
what was alive then. Allocations made outside the mode (before it, or by a kernel writing in place) are not
counted; views and in-place writes are not allocations.
"""

from __future__ import annotations

import traceback
import weakref
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


@dataclass(frozen=True)
class Allocation:
    """One fresh storage: its bytes, the op that made it, its output's shape and where in hf_sparse_cp."""

    nbytes: int
    op: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    site: str


def _site() -> str:
    """The innermost frame of the plugin that led to this op (file:line function), else the innermost one."""
    frames = traceback.extract_stack()[:-3]
    ours = [f for f in frames if "hf_sparse_cp" in f.filename and "testing/allocations" not in f.filename]
    f = (ours or [f for f in frames if "site-packages" not in f.filename] or frames)[-1]
    return f"{f.filename.rsplit('hf_sparse_cp/', 1)[-1]}:{f.lineno} {f.name}"


class AllocationRecorder(TorchDispatchMode):
    """Records every fresh storage an op returns while the mode is on (see the module docstring).

    After the run: `allocations` (all of them, in order), `peak_bytes` (the most bytes alive at once among
    those recorded) and `at_peak` (what was alive then, largest first). `with_sites=False` skips the stack
    walk (faster)."""

    def __init__(self, with_sites: bool = True):
        super().__init__()
        self.with_sites = with_sites
        self.allocations: list[Allocation] = []
        self._live: dict[int, Allocation] = {}  # by storage id: those alive now
        self._bytes = 0
        self.peak_bytes = 0
        self.at_peak: list[Allocation] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if any(r.alias_info is not None for r in func._schema.returns):  # a view or an in-place op: no allocation
            return out
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._track(t, func)
        return out

    def _track(self, t: torch.Tensor, func) -> None:
        storage = t.untyped_storage()
        key = storage._cdata  # the StorageImpl's address: the same for every view of it
        if key in self._live or storage.nbytes() == 0:  # a view, an in-place result or nothing at all
            return
        alloc = Allocation(storage.nbytes(), str(func.overloadpacket.__name__), tuple(t.shape), t.dtype,
                           _site() if self.with_sites else "")
        self.allocations.append(alloc)
        self._live[key] = alloc
        self._bytes += alloc.nbytes
        if self._bytes > self.peak_bytes:
            self.peak_bytes = self._bytes
            self.at_peak = sorted(self._live.values(), key=lambda a: -a.nbytes)
        weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        alloc = self._live.pop(key, None)
        if alloc is not None:
            self._bytes -= alloc.nbytes

    @property
    def largest(self) -> int:
        """The largest single allocation recorded (bytes; 0 for none)."""
        return max((a.nbytes for a in self.allocations), default=0)
