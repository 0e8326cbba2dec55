"""Command-line arguments of the plugin, for `HfArgumentParser` next to `TrainingArguments`:
`SparseCPArguments` (sparse attention switches) and `SMETArguments` (the SMET optimizer)."""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any

from ..config import SparseAttentionConfig
from ..smet import SMETConfig


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
        """The pattern config: the `--sparse_config` file if given, with flags that differ from the
        defaults on top (`from_flags`: the config parsed from the command line)."""
        if self.sparse_config is None and from_flags is not None:
            return from_flags
        flags = {} if from_flags is None else dataclasses.asdict(from_flags)
        return SparseAttentionConfig.from_file_and_flags(self.sparse_config, flags)


FLAG_PREFIX = "smet_"


def _prefixed_fields(cls: type, prefix: str) -> list[tuple[str, Any, dataclasses.Field]]:
    """The fields of dataclass `cls` renamed `prefix + name`, with their types, defaults and help."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        if f.default_factory is not dataclasses.MISSING:
            new = field(default_factory=f.default_factory, metadata=f.metadata)
        else:
            new = field(default=f.default, metadata=f.metadata)
        out.append((prefix + f.name, hints[f.name], new))
    return out


# Every SMETConfig field as a `--smet_<field>` flag, generated so help texts and defaults live once.
SMETFlags = dataclasses.make_dataclass("SMETFlags", _prefixed_fields(SMETConfig, FLAG_PREFIX))
SMETFlags.__module__ = __name__


@dataclass
class SMETArguments(SMETFlags):
    """Switches for a Trainer script: `--smet`, `--smet_config FILE`, and `--smet_<field>` for every
    `SMETConfig` field (e.g. `--smet_density 0.1 --smet_update_interval 50`)."""

    smet: bool = field(
        default=False,
        metadata={"help": "Train with the SMET optimizer (dynamic sparse training / sparse fine-tuning with a "
                  "stable Adam and compact optimizer state)."},
    )
    smet_config: str | None = field(
        default=None,
        metadata={"help": "YAML/JSON file with the SMETConfig; --smet_* flags that differ from their defaults "
                  "override it."},
    )

    def __post_init__(self) -> None:
        # Without --smet the Trainer keeps its own optimizer: SMET settings would be ignored without a word.
        if self.smet:
            return
        if self.smet_config is not None:
            raise ValueError(
                f"--smet_config {self.smet_config} given without --smet would be ignored: add --smet to train with "
                "SMET, or drop --smet_config."
            )
        default = SMETConfig()
        changed = [name for name, value in self._flags().items() if value != getattr(default, name)]
        if changed:
            raise ValueError(
                f"{', '.join('--' + FLAG_PREFIX + name for name in changed)} given without --smet would be ignored: "
                "add --smet to train with SMET, or drop them."
            )

    def _flags(self) -> dict[str, Any]:
        """The `--smet_<field>` values by SMETConfig field name."""
        return {f.name: getattr(self, FLAG_PREFIX + f.name) for f in dataclasses.fields(SMETConfig)}

    def to_config(self) -> SMETConfig:
        """The SMET config: the `--smet_config` file if given, with non-default flags on top."""
        return SMETConfig.from_file_and_flags(self.smet_config, self._flags())
