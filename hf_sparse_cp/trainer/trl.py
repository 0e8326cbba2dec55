"""The one switch for TRL's `SFTTrainer`: `SparseSFTConfig` and `SparseSFTTrainer`.

A stock SFT script changes the two class names, as a Trainer script does:

    from hf_sparse_cp.trainer.trl import SparseSFTConfig as SFTConfig, SparseSFTTrainer as SFTTrainer

`SparseSFTConfig` is `SFTConfig` with the plugin's flags (its own `max_length` is the sequence length);
`SparseSFTTrainer` is `SFTTrainer` with what `SparseTrainer` adds (`sparse_trainer.SparseTrainerMixin`).
Packed SFT (`packing=True`, or `padding_free=True`: one flattened row with restarting position_ids)
keeps its document boundaries under sparse attention and context parallelism. The card TRL writes is
kept, with the plugin's section merged into it. Needs `pip install trl`.
"""

from __future__ import annotations

from trl import SFTConfig, SFTTrainer

from .sparse_trainer import sparse_arguments_class, sparse_trainer_class

SparseSFTConfig = sparse_arguments_class(SFTConfig)
SparseSFTTrainer = sparse_trainer_class(SFTTrainer)
