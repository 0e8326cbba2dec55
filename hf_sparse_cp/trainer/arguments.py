"""Command-line arguments of the plugin, for `HfArgumentParser` next to `TrainingArguments`:
`SparseCPArguments` (sparse attention switches), `SparseAttentionFlags` (the pattern),
`SMETArguments` (the SMET optimizer), and `explicit_fields` (which flags a command line gives, so
that they beat a config file).

Every plugin flag starts with `sparse_`, `cp_` or `smet_`, so that it never meets a flag of the script
it joins (run_clm's `--block_size` is its sequence length; TRL's configs have their own fields): each
`SparseAttentionConfig` field `<f>` is the flag `--sparse_<f>` (`--sparse_block_size`), each
`SMETConfig` field `--smet_<f>`; the config classes and their YAML/JSON files keep the plain names."""

from __future__ import annotations

import argparse
import dataclasses
import typing
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..config import SparseAttentionConfig
from ..files import check_field_types
from ..memory import MemorySavers
from ..smet import SMETConfig
from ..smet.config import module_names


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
                  "override it."},
    )
    sparse_fused_loss: bool = field(
        default=True,
        metadata={"help": "Compute the causal-LM loss without materializing [tokens, vocab] logits (liger-kernel "
                  "on CUDA when installed, chunked PyTorch otherwise)."},
    )
    sparse_gradient_checkpointing_min_length: int = field(
        default=16384,
        metadata={"help": "Turn gradient checkpointing on when the training sequence length is at least this "
                  "(0 disables the automatic switch)."},
    )
    sparse_token_tiling_min_length: int = field(
        default=32768,
        metadata={"help": "Compute every decoder layer's MLP and RMSNorms in token tiles (--sparse_token_tile_size) "
                  "when the training sequence length is at least this (0 never): exact, one more MLP forward per "
                  "layer, and no [tokens, intermediate] activation kept (`hf-sparse-cp memory` shows what it saves)."},
    )
    sparse_token_tile_size: int = field(
        default=8192, metadata={"help": "Tokens per tile of --sparse_token_tiling_min_length."})
    sparse_offload_layer_inputs: bool = field(
        default=False,
        metadata={"help": "With gradient checkpointing, keep each decoder layer's saved input in pinned host memory "
                  "until backward (copied asynchronously on a GPU): frees layers x tokens x hidden x 2 bytes of GPU "
                  "memory for as much host memory."},
    )
    sparse_log_sparsity: bool = field(
        default=True,
        metadata={"help": "Log the per-layer kept fraction of attention blocks into the Trainer's logs."},
    )

    def __post_init__(self) -> None:
        check_field_types(self)
        if self.sparse_token_tiling_min_length < 0:
            raise ValueError(f"--sparse_token_tiling_min_length {self.sparse_token_tiling_min_length} must be >= 0 "
                             "(0: never tile).")
        MemorySavers(tile_tokens=self.sparse_token_tile_size)  # validates the tile

    def memory_savers(self, max_length: int | None) -> MemorySavers:
        """The memory savers for sequences of `max_length` tokens (None: unknown, no token tiles)."""
        tiled = bool(self.sparse_token_tiling_min_length) and max_length is not None and (
            max_length >= self.sparse_token_tiling_min_length)
        return MemorySavers(tiled=tiled, tile_tokens=self.sparse_token_tile_size,
                            offload_layer_inputs=self.sparse_offload_layer_inputs)

    def attention_config(
        self, from_flags: SparseAttentionConfig | SparseAttentionFlags | None = None,
        explicit: Collection[str] | None = None,
    ) -> SparseAttentionConfig:
        """The pattern config: `from_flags` (the pattern parsed from the command line) without a
        `--sparse_config` file; with one, the file with flags on top: those named in `explicit` (the
        argument names given on the command line, e.g. `sparse_vertical_topk`, see `explicit_fields`)
        whatever their value, or without `explicit`, those that differ from the defaults (see
        `FileConfig.from_file_and_flags`)."""
        if isinstance(from_flags, SparseAttentionFlags):  # as given: an unset field stays unset (None)
            flags = prefixed_values(from_flags, SparseAttentionConfig, PATTERN_PREFIX)
            from_flags = from_flags.to_config()
        else:
            flags = {} if from_flags is None else dataclasses.asdict(from_flags)
        if self.sparse_config is None and from_flags is not None:
            return from_flags
        fields = None if explicit is None else unprefixed(explicit, PATTERN_PREFIX)
        return SparseAttentionConfig.from_file_and_flags(self.sparse_config, flags, fields)


# The command-line prefixes of the pattern's and SMET's fields.
PATTERN_PREFIX = "sparse_"
FLAG_PREFIX = "smet_"


def unprefixed(names: Collection[str], prefix: str) -> set[str]:
    """The names in `names` that start with `prefix`, without it (`sparse_block_size` -> `block_size`)."""
    return {name.removeprefix(prefix) for name in names if name.startswith(prefix)}


def prefixed_values(args: Any, cls: type, prefix: str = "") -> dict[str, Any]:
    """Field of dataclass `cls` -> the attribute `prefix + field` of `args`, as given (the inverse of
    `copied_fields`)."""
    return {f.name: getattr(args, prefix + f.name) for f in dataclasses.fields(cls)}


def from_prefixed(args: Any, cls: type, prefix: str = "") -> Any:
    """Dataclass `cls` built from the attributes `prefix + field` of `args` (`prefixed_values`)."""
    return cls(**prefixed_values(args, cls, prefix))


def copied_fields(
    cls: type, prefix: str = "", defaults: dict[str, Any] | None = None
) -> list[tuple[str, Any, dataclasses.Field]]:
    """The fields of dataclass `cls` as `make_dataclass` takes them, renamed `prefix + name`, with their
    types, defaults (or those in `defaults`, by new name) and help, so that generated argument classes
    keep one source for each flag."""
    hints = typing.get_type_hints(cls)
    defaults = defaults or {}
    out = []
    for f in dataclasses.fields(cls):
        name = prefix + f.name
        if f.default_factory is not dataclasses.MISSING and name not in defaults:
            new = field(default_factory=f.default_factory, metadata=f.metadata)
        else:
            new = field(default=defaults.get(name, f.default), metadata=f.metadata)
        out.append((name, hints[f.name], new))
    return out


class _PatternFlags:
    """The methods of `SparseAttentionFlags` (its fields are generated from `SparseAttentionConfig`)."""

    def __post_init__(self) -> None:
        self.to_config()  # the config validates the values, naming the field

    def to_config(self) -> SparseAttentionConfig:
        """The `SparseAttentionConfig` these flags give."""
        return from_prefixed(self, SparseAttentionConfig, PATTERN_PREFIX)


# Every SparseAttentionConfig field as a `--sparse_<field>` flag and every SMETConfig field as a `--smet_<field>`
# flag, generated so that help texts and defaults live once.
SparseAttentionFlags = dataclasses.make_dataclass(
    "SparseAttentionFlags", copied_fields(SparseAttentionConfig, PATTERN_PREFIX), bases=(_PatternFlags,),
    namespace={"__doc__": "The sparse pattern as flags: `--sparse_<field>` for every `SparseAttentionConfig` field "
               "(e.g. `--sparse_vertical_topk 1024 --sparse_block_size 64`); `to_config()` gives the config.",
               "__module__": __name__})
SMETFlags = dataclasses.make_dataclass("SMETFlags", copied_fields(SMETConfig, FLAG_PREFIX))
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
        metadata={"help": "YAML/JSON file with the SMETConfig; --smet_* flags given on the command line override "
                  "it."},
    )

    def __post_init__(self) -> None:
        self.smet_target_modules = module_names(self.smet_target_modules)  # (as SMETConfig takes them)
        check_field_types(self)
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

    def to_config(self, explicit: Collection[str] | None = None) -> SMETConfig:
        """The SMET config: the `--smet_*` flags without a `--smet_config` file; with one, the file with
        flags on top: those named in `explicit` (argument names given on the command line, e.g.
        `smet_density`, see `explicit_fields`) whatever their value, or without `explicit`, those that
        differ from the defaults (see `FileConfig.from_file_and_flags`)."""
        fields = None if explicit is None else unprefixed(explicit, FLAG_PREFIX)
        return SMETConfig.from_file_and_flags(self.smet_config, self._flags(), fields)


# Marks the arguments a command line does not set (argparse leaves a namespace's existing values alone).
_NOT_GIVEN = object()


def explicit_fields(parser: argparse.ArgumentParser, args: Sequence[str]) -> set[str]:
    """The arguments `args` sets explicitly, by destination (for an `HfArgumentParser`, the dataclass
    field names, e.g. `sparse_vertical_topk`, `smet_density`): any spelling argparse takes counts
    (`--sparse-vertical-topk=1024`, `--no_sparse_fused_loss`, an unambiguous prefix), and so does a value equal to
    the default. Pass the set as `explicit` to `SparseCPArguments.attention_config` and
    `SMETArguments.to_config` so that every flag given beats the config file.

    `args` must parse (this parses them, twice); `-h`/`--help` are skipped, unknown arguments ignored.
    """
    args = [arg for arg in args if arg not in ("-h", "--help")]
    names = vars(parser.parse_known_args(args)[0])
    unset = argparse.Namespace(**dict.fromkeys(names, _NOT_GIVEN))
    given = vars(parser.parse_known_args(args, namespace=unset)[0])
    return {name for name, value in given.items() if value is not _NOT_GIVEN}
