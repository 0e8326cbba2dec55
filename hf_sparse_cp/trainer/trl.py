"""The one switch for TRL's trainers: `SparseSFTConfig` / `SparseSFTTrainer`, and the same for DPO, KTO and Reward.

A stock SFT script changes the two class names, as a Trainer script does:

    from hf_sparse_cp.trainer.trl import SparseSFTConfig as SFTConfig, SparseSFTTrainer as SFTTrainer

`SparseSFTConfig` is `SFTConfig` with the plugin's flags (its own `max_length` is the sequence length);
`SparseSFTTrainer` is `SFTTrainer` with what `SparseTrainer` adds (`sparse_trainer.SparseTrainerMixin`).
Packed SFT (`packing=True`, or `padding_free=True`: one flattened row with restarting position_ids)
keeps its document boundaries under sparse attention and context parallelism. The card TRL writes is
kept, with the plugin's section merged into it. `SparseDPOConfig` / `SparseDPOTrainer`, `SparseKTOConfig` /
`SparseKTOTrainer` and `SparseRewardConfig` / `SparseRewardTrainer` are TRL's preference trainers switched alike:
under context parallelism their per-token log-probabilities (a reward model's score of each row's last token) come
back whole on every rank, so TRL's losses, rewards and metrics are one process's. Needs `pip install trl`.
"""

from __future__ import annotations

import trl
from trl import SFTConfig, SFTTrainer

from .sparse_trainer import sparse_arguments_class, sparse_trainer_class

SparseSFTConfig = sparse_arguments_class(SFTConfig)
SparseSFTTrainer = sparse_trainer_class(SFTTrainer)


# DPO's, KTO's and Reward's switched classes, by name: TRL's class and the switch for it
_PREFERENCE = {f"Sparse{kind}{part}": (f"{kind}{part}", switch) for kind in ("DPO", "KTO", "Reward")
               for part, switch in (("Config", sparse_arguments_class), ("Trainer", sparse_trainer_class))}


def __getattr__(name: str) -> type:
    """`SparseDPOConfig`, `SparseDPOTrainer`, `SparseKTOConfig`, `SparseKTOTrainer`, `SparseRewardConfig`,
    `SparseRewardTrainer`, switched at first use (the same class every time): a TRL that moved its preference
    trainers leaves the SFT names working."""
    if name not in _PREFERENCE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    base, switch = _PREFERENCE[name]
    return switch(getattr(trl, base))
