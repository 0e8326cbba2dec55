"""The storage recorder that the simulator's measure of a mixture of experts' block
(`memory_model.measurements.moe_at`) and the tests' `AllocationRecorder` share (`hf_sparse_cp.memory.recorder`): its
ordered log, its peak and what it does not count."""

import pytest
import torch

from hf_sparse_cp.memory.recorder import StorageRecorder
from hf_sparse_cp.testing.allocations import AllocationRecorder


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_the_recorder_logs_fresh_storages_and_their_frees_in_order(device):
    """A fresh storage is an allocation (numbered in the order they came), its last tensor's end its free; views,
    in-place and `out=` writes allocate nothing; the peak is the most bytes alive at once, and what was alive then."""
    with StorageRecorder() as rec:
        a = torch.zeros(1000, device=device)  # 0: 4000 bytes
        a.view(10, 100).add_(1)  # a view and an in-place write: nothing new
        torch.add(a[:500], 1, out=a[500:])  # a slice and an out= write: nothing new
        b = a * 2  # 1: 4000 bytes
        assert rec.number(b) == 1 and rec.number(b[3:]) == 1
        del a
        c = torch.ones(3000, device=device)  # 2: 12000 bytes
        d = c.to(torch.float64)  # 3: 24000 bytes
        del c
    assert rec.events == [(0, 4000), (1, 4000), (0, -4000), (2, 12000), (3, 24000), (2, -12000)]
    assert rec.peak_bytes == 4000 + 12000 + 24000 and rec.alive_bytes == 4000 + 24000
    assert rec.numbers_at_peak() == [3, 2, 1] and rec.numbers_alive() == [1, 3]
    assert rec.largest == 24000 and rec.nbytes(2) == 12000
    assert rec.curve(0, 4) == [0, 4000, 8000, 4000, 16000]
    assert rec.curve(2, 6, left_out={3}) == [8000, 4000, 16000, 16000, 4000]
    del b
    assert rec.events[-1] == (1, -4000) and rec.alive_bytes == 24000  # (a free after the mode is logged too)
    assert rec.number(d) == 3 and rec.peak_bytes == 40000
    del d


def test_what_was_made_before_the_recorder_is_not_counted():
    """Tensors made before the mode are neither allocations nor frees; the recorder's own frees of what it saw are."""
    a = torch.zeros(1000)
    with StorageRecorder() as rec:
        b = a + 1
        del a
    assert rec.events == [(0, 4000)] and rec.number(b) == 0
    del b
    assert rec.events == [(0, 4000), (0, -4000)] and rec.alive_bytes == 0 and rec.peak_bytes == 4000


def test_the_allocation_recorder_reads_the_shared_log():
    """`AllocationRecorder` is the same recorder: its allocations in the log's order, its peak and its largest the
    log's, with each allocation's op, shape, dtype and the test's line as its site (no hf_sparse_cp frame)."""
    with AllocationRecorder() as rec:
        a = torch.zeros(10, 100)
        b = a.sum(0)
        del a
    assert [(x.op, x.shape, x.nbytes) for x in rec.allocations] == [("zeros", (10, 100), 4000), ("sum", (100,), 400)]
    assert rec.events == [(0, 4000), (1, 400), (0, -4000)] and rec.peak_bytes == 4400 and rec.largest == 4000
    assert rec.alive == [rec.allocations[1]] and rec.at_peak == rec.allocations
    assert rec.allocations[1].site.startswith(f"{__file__}:") and rec.allocations[1].site.endswith(
        " test_the_allocation_recorder_reads_the_shared_log")
    del b
