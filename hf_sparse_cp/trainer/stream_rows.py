"""The rows of an iterable dataset's last batch that are the stream's, under data parallelism.

accelerate's `IterableDatasetShard` (a DP-only data loader's shard of an iterable dataset: `run_clm.py --streaming`)
gives each data-parallel rank its slice of every `batch_size x ranks` rows and completes the last, short, global batch
with rows from the first, so every rank steps as often with as many rows. Its loader has no length, so accelerate knows
no remainder: `eval_loss` counted those copies, and a rank's batch that mixed its last rows with copies had its loss
taken over both. `count_stream` counts the rows a shard reads; at the end of the loader, `stream_rows` is how many of
the last global batch's rows are the stream's and `rank_stream_rows` how many of this rank's batch.
"""

from __future__ import annotations

import logging

from torch.utils.data import DataLoader, IterableDataset

logger = logging.getLogger(__name__)
_warned = [False]


class CountedStream(IterableDataset):
    """`dataset`, counting the rows it yields: `rows` is their number once a pass has ended (None before)."""

    def __init__(self, dataset):
        self.dataset = dataset
        self.rows = None

    def __iter__(self):
        self.rows, n = None, 0
        for row in self.dataset:
            n += 1
            yield row
        self.rows = n

    def __len__(self):  # (the shard's length is its dataset's, where it has one)
        return len(self.dataset)

    def __getattr__(self, name):  # (the shard reads the dataset's `set_epoch` and `generator`)
        if name == "dataset":
            raise AttributeError(name)
        return getattr(self.dataset, name)


def read_whole_stream(loader: DataLoader, dp_size: int) -> DataLoader:
    """`loader`, or, where it reads a 🤗 datasets `IterableDataset` of at least `dp_size` files (shards), the same
    loader over that stream seen as a plain iterable dataset (`CountedStream`), for accelerate to prepare over
    `dp_size` ranks.

    accelerate gives each rank its own files of such a stream (`IterableDataset.shard`), whose rows differ in number
    from rank to rank: the ranks then take different numbers of steps and wait on each other's collectives for ever
    (an evaluation hung under DP 2 x CP 2), and a global batch holds rows one process reads apart. Seen as a plain
    iterable, every rank reads the stream and takes its slice of each global batch (`IterableDatasetShard`), as
    accelerate does for a stream of fewer files."""
    try:
        from datasets import IterableDataset as FileStream
    except ImportError:
        return loader
    dataset = loader.dataset
    if dp_size == 1 or not isinstance(dataset, FileStream) or dataset.n_shards < dp_size:
        return loader
    from accelerate.data_loader import _PYTORCH_DATALOADER_KWARGS

    # (an iterable dataset's loader takes no sampler: the torch loader builds its own)
    kept = set(_PYTORCH_DATALOADER_KWARGS) - {"shuffle", "sampler", "batch_sampler"}
    return DataLoader(CountedStream(dataset), **{k: getattr(loader, k) for k in kept if hasattr(loader, k)})


def _shard(loader):
    """The dataset `loader` reads (a prepared loader's: its base loader's), accelerate's shard where it made one."""
    return getattr(getattr(loader, "base_dataloader", loader), "dataset", None)


def count_stream(loader) -> None:
    """Count the rows the shard of an iterable dataset in `loader` (prepared over the DP ranks) reads, where it
    completes a short last batch with copies (no `drop_last`)."""
    from accelerate.data_loader import IterableDatasetShard

    shard = _shard(loader)
    if isinstance(shard, IterableDatasetShard) and not shard.drop_last and not isinstance(shard.dataset, CountedStream):
        shard.dataset = CountedStream(shard.dataset)


def _global_batch(shard) -> int:
    return shard.batch_size if shard.split_batches else shard.batch_size * shard.num_processes


def _last_batch(loader):
    """The counting shard of `loader` and how many rows of its last global batch are the stream's (None, None where
    it does not count them)."""
    shard = _shard(loader)
    if not isinstance(getattr(shard, "dataset", None), CountedStream):
        return None, None
    rows = shard.dataset.rows
    if rows is None:
        if not _warned[0]:
            # (a loader's workers read the stream in their own processes: their count never reaches this one)
            _warned[0] = True
            logger.warning(
                "An iterable dataset read by dataloader workers under data parallelism: where its rows are no "
                "multiple of the global batch, its last batch is completed with copies of its first rows, which "
                "eval_loss then counts. Give the set a length (a map-style Dataset) or set "
                "--dataloader_num_workers 0 for the exact loss.")
        return None, None
    return shard, rows % _global_batch(shard) or _global_batch(shard)


def stream_rows(loader) -> int | None:
    """How many rows of the last global batch of `loader` (at its end) are the stream's, in rank order the first ones;
    None where its shard does not count them (no shard, or one read by workers)."""
    return _last_batch(loader)[1]


def rank_stream_rows(loader) -> int | None:
    """How many rows of this rank's last batch of `loader` (at its end) are the stream's, the first ones, where the
    last global batch holds copies (0: none is); None, on every rank alike, where it holds none or they are not
    counted."""
    shard, last = _last_batch(loader)
    if last is None or last == _global_batch(shard):
        return None
    per_rank = _global_batch(shard) // shard.num_processes
    return min(max(last - shard.process_index * per_rank, 0), per_rank)
