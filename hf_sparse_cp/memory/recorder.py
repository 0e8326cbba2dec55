"""What the ops of a piece of PyTorch code allocate and free, on any device (the CPU's and the meta device's too,
where no allocator keeps statistics): `StorageRecorder`, the one dispatch mode that both the simulator's measure of a
mixture of experts' block (`simulator.memory_model.measurements.moe_at`) and the tests'
`testing.allocations.AllocationRecorder` read.

A storage that an op returns and the mode has not seen is a fresh allocation; an op whose schema says its output
aliases an input (a view, an in-place or `out=` write) allocates nothing. A `weakref.finalize` on the storage sees it
go, when its last tensor does. Allocations made outside the mode (before it, or by a kernel writing in place) are not
counted; the frees of those it saw are, after it too. A leaf of the package: torch only.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def storage_id(t: torch.Tensor) -> int:
    """The identity of `t`'s storage: its StorageImpl's address, the same for every view of it (on the meta device,
    where every data pointer is 0, too). A freed storage's address is reused."""
    return t.untyped_storage()._cdata


class StorageRecorder(TorchDispatchMode):
    """Records every fresh storage an op returns while the mode is on, and its free (see the module docstring).

    `events` is the ordered log: (number, bytes) at a storage's creation and (number, -bytes) when it goes, the
    storages numbered 0, 1, ... in the order they came (numbers, not addresses: a freed storage's address is reused).
    `number(t)` gives a live tensor's storage's number, `curve` replays the log; `alive_bytes` and `peak_bytes` are
    the bytes alive now and at the most, `numbers_alive()` and `numbers_at_peak()` the storages alive now and at the
    peak, `largest` the largest one's bytes.
    Subclasses note more of each fresh storage in `_created`."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[tuple[int, int]] = []
        self._live: dict[int, int] = {}  # storage id -> its number, those alive now (in the order they came)
        self._sizes: list[int] = []  # bytes, by number
        self.alive_bytes = 0
        self.peak_bytes = 0
        self._peak_event = -1  # (the index of the event that reached the peak)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if any(r.alias_info is not None for r in func._schema.returns):  # a view or an in-place op: no allocation
            return out
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            storage, key = t.untyped_storage(), storage_id(t)
            if key in self._live or storage.nbytes() == 0:  # a view, an in-place result or nothing at all
                continue
            number, nbytes = len(self._sizes), storage.nbytes()
            self._sizes.append(nbytes)
            self._live[key] = number
            self.events.append((number, nbytes))
            self.alive_bytes += nbytes
            if self.alive_bytes > self.peak_bytes:
                self.peak_bytes, self._peak_event = self.alive_bytes, len(self.events) - 1
            self._created(number, t, func, args)
            weakref.finalize(storage, self._free, key, number, nbytes)
        return out

    def _created(self, number: int, t: torch.Tensor, func, args: tuple) -> None:
        """Called for each fresh storage (`number`; `t`, the output of `func(*args)` that holds it): nothing here."""

    def _free(self, key: int, number: int, nbytes: int) -> None:
        if self._live.get(key) == number:
            del self._live[key]
        self.events.append((number, -nbytes))
        self.alive_bytes -= nbytes

    def number(self, t: torch.Tensor) -> int | None:
        """The number of `t`'s storage (None: not made while the mode was on, or gone)."""
        return self._live.get(storage_id(t))

    def nbytes(self, number: int) -> int:
        """The bytes of storage `number`."""
        return self._sizes[number]

    def numbers_alive(self) -> list[int]:
        """The numbers of the storages alive now, in the order they came."""
        return list(self._live.values())

    def numbers_at_peak(self) -> list[int]:
        """The numbers of the storages alive at the peak (the first time it was reached), largest first (those of a
        size in the order they came)."""
        alive: dict[int, None] = {}
        for number, n in self.events[:self._peak_event + 1]:
            if n > 0:
                alive[number] = None
            else:
                del alive[number]
        return sorted(alive, key=lambda number: -self.nbytes(number))

    @property
    def largest(self) -> int:
        """The largest single storage recorded (bytes; 0 for none)."""
        return max(self._sizes, default=0)

    def curve(self, start: int, end: int, left_out: set[int] = frozenset()) -> list[int]:
        """The bytes alive after each event from `start` to `end` (the first number: before them), the storages
        numbered in `left_out` not counted."""
        alive = [sum(n for number, n in self.events[:start] if number not in left_out)]
        for number, n in self.events[start:end]:
            alive.append(alive[-1] + (0 if number in left_out else n))
        return alive
