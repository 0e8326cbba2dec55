"""`stream_rows` against accelerate's own shard of an iterable dataset: at the end of a DP-only loader, the rows it
says are the stream's are exactly those the shard did not copy from the first batch, on every rank."""

import pytest
import torch
from accelerate.data_loader import prepare_data_loader
from torch.utils.data import DataLoader, IterableDataset

from hf_sparse_cp.trainer.stream_rows import count_stream, rank_stream_rows, read_whole_stream, stream_rows


class _Rows(IterableDataset):
    def __init__(self, n: int):
        self.n = n

    def __iter__(self):
        return iter(range(self.n))


def _last_batch(rows: int, batch: int, ranks: int, rank: int, split: bool):
    loader = prepare_data_loader(DataLoader(_Rows(rows), batch_size=batch), torch.device("cpu"), num_processes=ranks,
                                 process_index=rank, put_on_device=False, split_batches=split)
    count_stream(loader)
    *_, last = iter(loader)
    return loader, last.tolist()


@pytest.mark.parametrize("split", [False, True], ids=["per-rank", "split"])
@pytest.mark.parametrize("rows", [1, 3, 5, 8, 11])
def test_the_rows_counted_in_the_last_batch_are_those_the_shard_did_not_copy(rows, split):
    ranks, batch = 2, 4
    global_batch = batch if split else batch * ranks
    first = (rows - 1) // global_batch * global_batch  # the stream's first row in the last global batch
    kept = []
    for rank in range(ranks):
        loader, last = _last_batch(rows, batch, ranks, rank, split)
        real = rank_stream_rows(loader)
        if rows % global_batch == 0:
            assert real is None and stream_rows(loader) == global_batch
            continue
        # the stream's rows come first, then copies of the first batch's
        assert all(r >= first for r in last[:real]) and all(r < first or rows <= global_batch for r in last[real:])
        kept += last[:real]
    if rows % global_batch:
        assert kept == list(range(first, rows)) and stream_rows(loader) == rows - first


def test_a_loader_without_a_counting_shard_counts_nothing():
    loader = prepare_data_loader(DataLoader(range(5), batch_size=2), torch.device("cpu"), num_processes=2,
                                 process_index=0, put_on_device=False)
    count_stream(loader)
    *_, _ = iter(loader)
    assert stream_rows(loader) is None and rank_stream_rows(loader) is None


def test_a_stream_read_by_workers_is_not_counted_and_says_so(monkeypatch, caplog):
    """A loader's workers read it through their own copy of the shard (pickled): the count never reaches the loop's,
    which warns once, naming the fixes, and keeps every rank's last batch (the copies counted)."""
    import pickle

    import hf_sparse_cp.trainer.stream_rows as stream

    monkeypatch.setattr(stream, "_warned", [False])
    loader = prepare_data_loader(DataLoader(_Rows(5), batch_size=2), torch.device("cpu"), num_processes=2,
                                 process_index=0, put_on_device=False)
    count_stream(loader)
    worker_copy = pickle.loads(pickle.dumps(loader.base_dataloader.dataset))
    assert list(worker_copy) == [0, 1, 4, 0] and worker_copy.dataset.rows == 5
    assert rank_stream_rows(loader) is None and stream_rows(loader) is None
    assert [r.message for r in caplog.records if "dataloader_num_workers 0" in r.message][0].count("map-style") == 1
    caplog.clear()
    assert stream_rows(loader) is None and not caplog.records


def _file_stream(files: int):
    from datasets import Dataset

    return Dataset.from_dict({"x": list(range(5))}).to_iterable_dataset(files).shuffle(seed=0, buffer_size=8)


@pytest.mark.parametrize("files", [1, 2, 3])
def test_every_rank_reads_the_whole_stream_of_several_files_and_takes_its_slice(files):
    """A 🤗 datasets stream of at least as many files as ranks, which accelerate would split file by file (ranks of
    3 and 2 rows), is read whole by every rank, each taking its slice of every global batch as of one file; the loader
    keeps its settings, and the epoch still reaches the stream's shuffle."""
    collate = lambda rows: [r["x"] for r in rows]  # noqa: E731
    ranks = []
    for rank in range(2):
        given = DataLoader(_file_stream(files), batch_size=1, collate_fn=collate, drop_last=False)
        loader = read_whole_stream(given, 2)
        assert (loader is given) == (files < 2)
        assert (loader.batch_size, loader.collate_fn, loader.drop_last) == (1, collate, False)
        prepared = prepare_data_loader(loader, torch.device("cpu"), num_processes=2, process_index=rank,
                                       put_on_device=False)
        prepared.set_epoch(1)
        ranks.append([row for batch in prepared for row in batch])
    one = [r["x"] for r in _with_epoch(_file_stream(files), 1)]
    assert len(ranks[0]) == len(ranks[1]) == 3
    assert [row for pair in zip(*ranks) for row in pair][:5] == one


def _with_epoch(stream, epoch: int):
    stream.set_epoch(epoch)
    return stream
