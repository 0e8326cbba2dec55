"""Which tensors a piece of PyTorch code allocates and holds, on any device (CPU included): the way to find
what grows as S^2 without a GPU's allocator statistics.

`AllocationRecorder` is the package's storage recorder (`hf_sparse_cp.memory.recorder.StorageRecorder`: a dispatch
mode that sees every op's output, a storage it has not seen a fresh allocation, followed to its free by a finalizer,
views and in-place writes none) that also notes each allocation's op, shape, dtype and the innermost `hf_sparse_cp`
frame that called it: the bytes alive at any moment, their peak and what was alive then. Allocations made outside
the mode (before it, or by a kernel writing in place) are not counted.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass

import torch

from ..memory import recorder

# The recorder's own frames, which no allocation is made by.
_OWN_FILES = {__file__, recorder.__file__}


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
    frames = [f for f in traceback.extract_stack() if f.filename not in _OWN_FILES]
    ours = [f for f in frames if "hf_sparse_cp" in f.filename]
    f = (ours or [f for f in frames if "site-packages" not in f.filename] or frames)[-1]
    return f"{f.filename.rsplit('hf_sparse_cp/', 1)[-1]}:{f.lineno} {f.name}"


class AllocationRecorder(recorder.StorageRecorder):
    """Records every fresh storage an op returns while the mode is on (see the module docstring).

    After the run: `allocations` (all of them, in order), `peak_bytes` (the most bytes alive at once among
    those recorded), `at_peak` (what was alive then, largest first), `largest` (the largest allocation's bytes) and
    `alive` (what is alive now). `with_sites=False` skips the stack walk (faster)."""

    def __init__(self, with_sites: bool = True):
        super().__init__()
        self.with_sites = with_sites
        self.allocations: list[Allocation] = []  # (by the recorder's number: the order they came)

    def _created(self, number: int, t: torch.Tensor, func, args: tuple) -> None:
        self.allocations.append(Allocation(self.nbytes(number), str(func.overloadpacket.__name__), tuple(t.shape),
                                           t.dtype, _site() if self.with_sites else ""))

    @property
    def at_peak(self) -> list[Allocation]:
        """The allocations alive at the peak, largest first."""
        return [self.allocations[number] for number in self.numbers_at_peak()]

    @property
    def alive(self) -> list[Allocation]:
        """The allocations alive now, in the order they came."""
        return [self.allocations[number] for number in self.numbers_alive()]
