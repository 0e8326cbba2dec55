"""Command-line arguments of the plugin, for `HfArgumentParser` next to `TrainingArguments`."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field

from .config import SparseAttentionConfig

logger = logging.getLogger(__name__)


@dataclass
class SparseCPArguments:
    """Plugin switches for a Trainer script (`--sparse_attention`, `--sparse_config PATH`, ...)."""

    sparse_attention: bool = field(
        default=False,
        metadata={"help": "Train with the sparse_cp attention backend (dynamic vertical-slash sparse attention)."},
    )
    sparse_config: str | None = field(
        default=None,
        metadata={"help": "YAML/JSON file with the SparseAttentionConfig; pattern flags given on the command line "
                  "that differ from their defaults override it."},
    )
    fused_loss: bool = field(
        default=True,
        metadata={"help": "Compute the causal-LM loss without materializing [tokens, vocab] logits (liger-kernel "
                  "on CUDA when installed, chunked PyTorch otherwise)."},
    )
    gradient_checkpointing_min_length: int = field(
        default=16384,
        metadata={"help": "Turn gradient checkpointing on when the training sequence length is at least this "
                  "(0 disables the automatic switch)."},
    )
    log_sparsity: bool = field(
        default=True,
        metadata={"help": "Log the per-layer kept fraction of attention blocks into the Trainer's logs."},
    )

    def attention_config(self, from_flags: SparseAttentionConfig | None = None) -> SparseAttentionConfig:
        """The pattern config: `--sparse_config` file if given, with non-default flags on top."""
        if self.sparse_config is None:
            return from_flags if from_flags is not None else SparseAttentionConfig()
        config = SparseAttentionConfig.from_file(self.sparse_config)
        if from_flags is None:
            return config
        default = SparseAttentionConfig()
        changed = {
            f.name: getattr(from_flags, f.name)
            for f in dataclasses.fields(from_flags)
            if getattr(from_flags, f.name) != getattr(default, f.name)
        }
        if changed:
            logger.info("Command-line sparse attention flags override %s: %s", self.sparse_config, changed)
            config = dataclasses.replace(config, **changed)
        return config
