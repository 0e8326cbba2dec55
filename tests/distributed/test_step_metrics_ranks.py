"""`StepMetricsCallback`'s longest row trained over several processes where only some know one: a resume without
shared storage gives the checkpoint's longest (its marker) to the first node's processes alone."""

from hf_sparse_cp.testing.spawn import run_gloo


def _ends(rank: int, world: int) -> tuple[int | None, int | None]:
    from types import SimpleNamespace

    import torch

    from hf_sparse_cp.trainer.callbacks import StepMetricsCallback

    metrics = StepMetricsCallback()
    if rank == 0:
        metrics.resume_longest(64)  # (this node's checkpoint folder holds the marker)
    args = SimpleNamespace(device=torch.device("cpu"))
    metrics.on_train_end(args, None, None)  # a resume at the last step: no row trained
    at_end = metrics.longest_trained
    metrics.count({"input_ids": torch.ones(1, 24 + 8 * rank, dtype=torch.long)}, cp_size=1)
    metrics.on_save(args, None, None)
    return at_end, metrics.longest_trained


def test_every_process_learns_the_longest_row_where_one_knows_it():
    # (before: the process without a row skipped the all-reduce the other waited in, until the timeout)
    assert run_gloo(_ends, 2, timeout_s=60) == [(64, 64), (64, 64)]
