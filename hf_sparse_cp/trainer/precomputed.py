"""The reference log-probs TRL's DPO and KTO precompute (`--precompute_ref_log_probs`) and cache.

Their `_precompute_ref_logps` pass, run in `__init__` before `train`, writes the log-probs to a 🤗 datasets file
beside the processed dataset's cache files, named by a hash of the dataset's fingerprint and of the reference's
weights, and a later run with the same key reads them instead of computing them.

* `keyed_by_pattern`: the key carries the pattern the reference attends with. The fingerprint carries the
  Trainer's arguments, the pattern's flags among them, only where TRL's filter of over-long prompts reads them
  (`truncation_mode` keep_start with a `max_length`), and never a pattern they do not give (a `--sparse_config` file
  changed in place): such a run read log-probs another pattern computed.
* `refuse_unshared_cache`: under several processes the main one writes that file and every process reads it, which
  works only for a dataset stored in files with caching on; TRL fails on the other ranks otherwise (refused first).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from transformers import Trainer

from ..config import BACKEND_NAME
from ..integration import upstream
from ..integration.layer_settings import model_config_for
from .arguments import flag_errors


def keyed_by_pattern(trainer: Trainer, dataset):
    """`dataset` (a processed 🤗 `Dataset`, which TRL's pass caches its log-probs beside) under a fingerprint of its
    own and of the trained model's pattern, which the reference attends with (`reference.attend_like_trained_model`),
    set by the public `select_columns(new_fingerprint=...)` (the same table, no copy of the data); as it is where the
    trained model does not run `sparse_cp` (TRL's key), or for another kind of dataset (TRL refuses an iterable one)."""
    from datasets import Dataset

    trained = trainer.accelerator.unwrap_model(trainer.model)
    sparse = upstream.attn_implementation(getattr(trained, "config", None)) == BACKEND_NAME
    if not sparse or not isinstance(dataset, Dataset):
        return dataset
    pattern = json.dumps(model_config_for(trained).to_dict(), sort_keys=True)
    fingerprint = hashlib.sha256(f"{dataset._fingerprint} {BACKEND_NAME} {pattern}".encode()).hexdigest()[:16]
    return dataset.select_columns(dataset.column_names, new_fingerprint=fingerprint)


def refuse_unshared_cache(trainer: Trainer, datasets: Mapping[str, Any]) -> None:
    """Refuse, naming the fix and the dataset, TRL's pass over `datasets` ({name: dataset}) under several processes
    where they cannot share its cache file: a dataset held in memory (`Dataset.from_dict`, ...) or 🤗 datasets'
    caching off gets a file of a random name in each process's own temporary folder, which only the main process
    writes (TRL 1.16: the other ranks failed with FileNotFoundError after the whole pass)."""
    from datasets import Dataset, is_caching_enabled

    if trainer.accelerator.num_processes == 1:
        return
    unshared = [name for name, dataset in datasets.items() if isinstance(dataset, Dataset)
                and not (is_caching_enabled() and dataset.cache_files)]
    if not unshared:
        return
    held = "held in memory" if is_caching_enabled() else "not cached (🤗 datasets' caching is disabled)"
    with flag_errors():
        raise ValueError(
            f"--precompute_ref_log_probs under {trainer.accelerator.num_processes} processes needs datasets stored in "
            f"files: the {' and '.join(map(repr, unshared))} {'dataset is' if len(unshared) == 1 else 'datasets are'} "
            f"{held}. TRL caches the reference log-probs in "
            "a file the main process writes and every process reads, named after the dataset's cache files; without "
            "them each process names its own temporary file and the others fail to read it (FileNotFoundError, after "
            "the whole pass). Load the data from files (datasets.load_dataset, or dataset.save_to_disk(path) then "
            "datasets.load_from_disk(path)) with caching on, or train with --precompute_ref_log_probs false.")
