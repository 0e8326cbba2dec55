"""`distributed.inputs.batch_fingerprint`, what `check_same_batch` compares across the CP ranks: its value and
what it allocates (issue #50)."""

import torch

from hf_sparse_cp.distributed import inputs
from hf_sparse_cp.testing.allocations import AllocationRecorder


def _direct(x: torch.Tensor) -> float:
    """The weighted sum widened all at once, in float64."""
    flat = x.double().reshape(x.shape[0] * x.shape[1], -1).sum(-1)
    weights = torch.rand(flat.numel(), generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    return float((flat * weights).sum())


def test_embeddings_are_widened_a_slice_at_a_time(monkeypatch):
    """inputs_embeds [2, 1024, 256] bf16 (1 MiB): its float64 copy would be 4 MiB; the fingerprint allocates less
    than the embeddings themselves, and equals the sum widened all at once."""
    monkeypatch.setattr(inputs, "FINGERPRINT_ELEMENTS", 1 << 14)
    x = torch.randn(2, 1024, 256, generator=torch.Generator().manual_seed(0)).bfloat16()
    with AllocationRecorder(with_sites=False) as rec:
        got = inputs.batch_fingerprint(x)
    assert rec.peak_bytes < x.numel() * x.element_size(), rec.peak_bytes
    assert got.dtype == torch.float64 and got[:3].tolist() == [2.0, 1024.0, x.numel()]
    assert torch.allclose(got[3], torch.tensor(_direct(x), dtype=torch.float64), rtol=1e-12, atol=0)


def test_token_ids_of_either_integer_type_and_rows_swapped():
    ids = torch.randint(0, 50_000, (3, 77), generator=torch.Generator().manual_seed(1))
    wide, narrow = inputs.batch_fingerprint(ids), inputs.batch_fingerprint(ids.int())
    assert torch.equal(wide, narrow) and float(wide[3]) == _direct(ids)
    swapped = ids.clone()
    swapped[[0, 1]] = swapped[[1, 0]]
    assert not torch.equal(inputs.batch_fingerprint(swapped), wide)
