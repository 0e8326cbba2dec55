"""Command-line arguments of the plugin, for `HfArgumentParser` next to `TrainingArguments`:
`SparseCPArguments` (sparse attention switches), `SparseAttentionFlags` (the pattern),
`SMETArguments` (the SMET optimizer), and `explicit_fields` (which flags a command line gives, so
that they beat a config file).

Every plugin flag starts with `sparse_`, `cp_` or `smet` (`--smet`, `--smet_*`), so that it never meets a flag of
the script it joins (run_clm's `--block_size` is its sequence length; TRL's configs have their own fields): each
flat key `<f>` of `SparseAttentionConfig` is the flag `--sparse_<f>` (`--sparse_block_size`; its
sections' fields flat: `--sparse_budget_mode`, `--sparse_vertical_topk`, `--sparse_last_q`), each
`SMETConfig` field `--smet_<f>`; the config classes and their YAML/JSON files keep the plain names.

Flags are a public contract: a new knob enters a config (a section of the file) first, and becomes a
flag by decision. Each flag is common (named in its class's `COMMON_FLAGS`: the few a user sets first;
`--help` and docs/flags.md list them first) or expert (every other)."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import typing
from collections.abc import Collection, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, ClassVar, Literal

from ..config import SparseAttentionConfig
from ..config.files import KnownKeywords, check_field_types, typed_flags, unread_fields_checked_by_caller
from ..config.sections import (
    BUDGET_MODES,
    DEFAULT_MODE,
    Scoring,
    budget_class,
    budget_modes,
    builtin_budget_modes,
    field_names,
    scoring_from,
)
from ..config.sparse_attention import MIN_BLOCK_SIZE
from ..memory import CHECKPOINTING_MIN_LENGTH, TILING_MIN_LENGTH, MemorySavers, from_min_length
from ..recipes import pattern_path
from ..scoped import scoped
from ..smet import SMETConfig
from ..smet.config import check_values, module_names


@contextlib.contextmanager
def flag_errors(kinds: tuple[type[Exception], ...] = (ValueError, TypeError, OSError)):
    """Mark an error of `kinds` raised inside the block (a plugin flag's value, the config file it names, or a setup
    the plugin cannot run, refused naming the fix) as the user's: `hf_sparse_cp.run` ends with its message alone,
    once, as argparse ends a bad flag, instead of a traceback through the script from every rank
    (`launch/refusals.py`). The exception itself is unchanged: a library caller catches it as before."""
    try:
        yield
    except kinds as e:
        e.hf_sparse_cp_flag_error = True  # (an exception of this call: nothing of anyone else's changes)
        raise


def is_flag_error(error: BaseException) -> bool:
    """Whether `error` was raised refusing a plugin flag (`flag_errors`)."""
    return getattr(error, "hf_sparse_cp_flag_error", False)


@dataclass
class SparseCPArguments(KnownKeywords):
    """Plugin switches for a Trainer script (`--sparse_attention`, `--sparse_config PATH`, ...)."""

    KIND: ClassVar[str] = "plugin"
    COMMON_FLAGS: ClassVar[tuple[str, ...]] = ("sparse_attention", "sparse_config")

    sparse_attention: bool = field(
        default=False,
        metadata={"help": "Train with the sparse_cp attention backend (dynamic vertical-slash sparse attention)."},
    )
    sparse_config: str | None = field(
        default=None,
        metadata={"help": "YAML/JSON file with the SparseAttentionConfig, or a shipped pattern's name: `trial` stays "
                  "sparse at the 1K-4K tokens of a trial run (`hf-sparse-cp recipes` lists them); pattern flags given "
                  "on the command line override it."},
    )
    sparse_fused_loss: bool = field(
        default=True,
        metadata={"help": "Compute the causal-LM loss without materializing [tokens, vocab] logits (liger-kernel "
                  "on CUDA when installed, but for fp16, whose weight gradient it would overflow; chunked PyTorch "
                  "otherwise); under FSDP2 too, inside a call of the sharded LM head."},
    )
    sparse_fused_ops: Literal["auto", "liger", "compile", "off"] = field(
        default="auto",
        metadata={"help": "Fuse the work around attention (RMSNorm, RoPE, the MLP's activation): 'liger' "
                  "liger-kernel's kernels (CUDA; what --use_liger_kernel asks, with the loss left to "
                  "--sparse_fused_loss), 'compile' torch.compile on the MLPs and RMSNorms, 'off' stock PyTorch; "
                  "'auto' is 'liger' on CUDA when liger-kernel is installed (pip install 'hf-sparse-cp[liger]'), "
                  "else 'off', and 'off' under --torch_compile (or accelerate's dynamo backend), whose inductor fuses "
                  "that work in the model it compiles whole. The start-up line says what runs."},
    )
    sparse_gradient_checkpointing_min_length: int = field(
        default=CHECKPOINTING_MIN_LENGTH,
        metadata={"help": "Turn gradient checkpointing on when the training sequence length is at least this "
                  "(0 disables the automatic switch)."},
    )
    sparse_token_tiling_min_length: int = field(
        default=TILING_MIN_LENGTH,
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
    sparse_card_license: str | None = field(
        default=None,
        metadata={"help": "The model card's license (a Hub license id, e.g. apache-2.0); the card is written to "
                  "output_dir whenever the final model is saved there."},
    )
    sparse_card_base_model: str | None = field(
        default=None,
        metadata={"help": "The model card's base_model (a Hub id). Unset: the model's own Hub id, or for a folder "
                  "an earlier run saved, the base model its card records."},
    )
    sparse_card_datasets: list[str] | None = field(
        default=None,
        metadata={"help": "The model card's datasets (Hub ids). Unset: the script's --dataset_name under "
                  "hf_sparse_cp.run, or what the card is given."},
    )
    sparse_card_tags: list[str] | None = field(
        default=None, metadata={"help": "More tags for the model card (besides the Trainer's and the plugin's)."},
    )

    def __post_init__(self) -> None:
        check_field_types(self)
        if self.sparse_token_tiling_min_length < 0:
            raise ValueError(f"--sparse_token_tiling_min_length {self.sparse_token_tiling_min_length} must be >= 0 "
                             "(0: never tile).")
        threshold = self.sparse_gradient_checkpointing_min_length
        if threshold < 0:  # (a negative one turned checkpointing on at any length)
            raise ValueError(f"--sparse_gradient_checkpointing_min_length {threshold} must be >= 0 (0: never switch "
                             "gradient checkpointing on; --gradient_checkpointing turns it on at every length).")
        MemorySavers(tile_tokens=self.sparse_token_tile_size)  # validates the tile

    def card_metadata(self) -> dict[str, Any]:
        """The model card's metadata given by the flags (`license`, `base_model`, `datasets`, `tags`): the
        keywords `write_sparse_model_card` takes."""
        given = {"license": self.sparse_card_license, "base_model": self.sparse_card_base_model,
                 "datasets": self.sparse_card_datasets, "tags": self.sparse_card_tags}
        return {name: value for name, value in given.items() if value}

    def checkpointing_due(self, max_length: int | None) -> bool:
        """Whether sequences of `max_length` tokens (None: unknown, no) turn gradient checkpointing on
        (`--sparse_gradient_checkpointing_min_length`; 0: never)."""
        return from_min_length(self.sparse_gradient_checkpointing_min_length, max_length)

    def memory_savers(self, max_length: int | None) -> MemorySavers:
        """The memory savers for sequences of `max_length` tokens (None: unknown, no token tiles)."""
        return MemorySavers(tiled=from_min_length(self.sparse_token_tiling_min_length, max_length),
                            tile_tokens=self.sparse_token_tile_size,
                            offload_layer_inputs=self.sparse_offload_layer_inputs)

    def attention_config(
        self, from_flags: SparseAttentionConfig | SparseAttentionFlags | None = None,
        explicit: Collection[str] | None = None,
    ) -> SparseAttentionConfig:
        """The pattern config: the `--sparse_config` file with the pattern flags (`from_flags`, as parsed from
        the command line) on top by `FileConfig.from_file_and_flags`' rule: those named in `explicit` (the
        argument names given on the command line, e.g. `sparse_vertical_topk`, see `explicit_fields`) beat
        the file whatever their value, the others (defaults) never do; without `explicit`, those that differ
        from the defaults count as given. A config passed as `from_flags` gives what differs from its
        defaults (`SparseAttentionConfig.given`), and without a file is the config itself."""
        if isinstance(from_flags, SparseAttentionConfig):
            if self.sparse_config is None:
                return from_flags
            flags = from_flags.given()
        else:
            flags = {} if from_flags is None else from_flags.values()
        fields = None if explicit is None else unprefixed(explicit, PATTERN_PREFIX)
        path = None if self.sparse_config is None else pattern_path(self.sparse_config)  # (a file, or `trial`)
        return SparseAttentionConfig.from_file_and_flags(path, flags, fields)


# The command-line prefixes of the pattern's and SMET's fields.
PATTERN_PREFIX = "sparse_"
FLAG_PREFIX = "smet_"


def unprefixed(names: Collection[str], prefix: str) -> set[str]:
    """The names in `names` that start with `prefix`, without it (`sparse_block_size` -> `block_size`)."""
    return {name.removeprefix(prefix) for name in names if name.startswith(prefix)}


def from_fields(args: Any, cls: type) -> Any:
    """Dataclass `cls` built from the attributes of `args` named as its fields (the inverse of `copied_fields`)."""
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})


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


def _by_mode(values: dict[str, Any]) -> str:
    """A value per budget mode in words: '512', or '32 in 'mass'; 64 in 'topk' and 'topp''."""
    modes: dict[Any, list[str]] = {}
    for mode, value in values.items():
        modes.setdefault(value, []).append(repr(mode))
    if len(modes) == 1:
        return str(next(iter(modes)))
    return "; ".join(f"{value} in {' and '.join(names)}" for value, names in modes.items())


def _first_sentence(doc: str) -> str:
    text = " ".join(doc.split()).split(". ")[0].rstrip(".")
    return text[:1].lower() + text[1:]


def _field(cls: type, name: str) -> dataclasses.Field:
    return next(f for f in dataclasses.fields(cls) if f.name == name)


def pattern_flag_fields() -> list[tuple[str, Any, dataclasses.Field]]:
    """The flat keys of `SparseAttentionConfig` as `make_dataclass` fields: every field, its `budget` section
    as `budget_mode` and every mode's fields, its `scoring` section as its fields. A section's flag defaults
    to unset (None): the config file's value, else the budget mode's."""
    # (the built-in modes' fields only: a mode registered before this module was imported has no field flags, as one
    # registered after; --sparse_budget_mode takes either, reading the registry as it parses: `BUDGET_MODES.flag()`)
    hints, modes = typing.get_type_hints(SparseAttentionConfig), builtin_budget_modes()
    out = []
    for f in dataclasses.fields(SparseAttentionConfig):
        if f.name == "budget":
            about = "; ".join(f"'{m}': {_first_sentence(budget_class(m).__doc__)}"
                              for m in modes)
            out.append(("budget_mode", Literal[modes] | None, field(default=None, metadata={
                "help": f"How many verticals / slashes a head keeps. {about}. Unset: the --sparse_config file's, "
                        f"else the mode whose fields are given, else {DEFAULT_MODE!r}.", **BUDGET_MODES.flag()})))
            for name in dict.fromkeys(name for m in modes for name in field_names(budget_class(m))):
                owners = {m: _field(budget_class(m), name) for m in modes if name in field_names(budget_class(m))}
                first = next(iter(owners.values()))
                help_text = (f"{first.metadata['help']} Read in budget_mode {' and '.join(map(repr, owners))} "
                             f"(default {_by_mode({m: x.default for m, x in owners.items()})}); given without a "
                             f"budget_mode it selects {'that mode' if len(owners) == 1 else 'one of them'}, with "
                             "another it is refused.")
                hint = typing.get_type_hints(budget_class(next(iter(owners))))[name]
                out.append((name, hint | None, field(default=None, metadata={**first.metadata, "help": help_text})))
        elif f.name == "scoring":
            for sf in dataclasses.fields(Scoring):
                own = _by_mode({m: getattr(scoring_from({}, budget_class(m)()), sf.name) for m in modes})
                out.append((sf.name, typing.get_type_hints(Scoring)[sf.name] | None, field(default=None, metadata={
                    **sf.metadata, "help": f"{sf.metadata['help']} Unset: the budget's own ({own})."})))
        else:
            out.append((f.name, hints[f.name], field(default=f.default, metadata=f.metadata)))
    return out


# False while pattern flags are built to go on top of a --sparse_config file (`flags_over_a_file`): alone, on the
# library's defaults, a value was refused against a setting the file changes (an estimation chunk of the file's block
# size, a layer's top-k under the file's top-k budget)
_CHECK_FLAGS_ALONE: ContextVar[bool] = ContextVar("hf_sparse_cp_check_flags_alone", default=True)


def flags_over_a_file() -> contextlib.AbstractContextManager[None]:
    """Inside the block, the `SparseAttentionFlags` built do not validate themselves alone: they go on top of a
    `--sparse_config` file, and the config the two make up validates them (`SparseCPArguments.attention_config`)."""
    return scoped(_CHECK_FLAGS_ALONE, False)


class _PatternFlags(KnownKeywords):
    """The methods of `SparseAttentionFlags` (its fields are generated from `SparseAttentionConfig`)."""

    KIND: ClassVar[str] = "sparse attention flag"

    def __post_init__(self) -> None:
        # the config validates the values, naming the field (what no setting reads: on the pattern they make up with
        # a --sparse_config file, or the flags alone, `to_config()`). Parsed as their own dataclass (HfArgumentParser,
        # the functional API) the flags cannot know of a --sparse_config file parsed beside them, whose settings may
        # make valid what the library's defaults do not: refused now only where no file could (`_valid_over_a_file`);
        # else when the pattern is built (`to_config`, `SparseCPArguments.attention_config` on top of the file).
        if _CHECK_FLAGS_ALONE.get():
            with unread_fields_checked_by_caller():
                try:
                    self.to_config()
                except ValueError:
                    if not self._valid_over_a_file():
                        raise

    def _valid_over_a_file(self) -> bool:
        """Whether the flags given (those off their defaults) make a valid pattern on top of some file: one of each
        budget mode at the smallest block size (of which every block multiple is a multiple), the settings a cross
        check of the flags reads."""
        given = typed_flags(self.values(), SparseAttentionConfig.flag_defaults())
        for mode in budget_modes():
            try:
                SparseAttentionConfig(budget_mode=mode, block_size=MIN_BLOCK_SIZE).replace(**given)
                return True
            except ValueError:
                pass
        return False

    def values(self) -> dict[str, Any]:
        """The flags by flat key, as given (None: unset)."""
        return {name.removeprefix(PATTERN_PREFIX): value for name, value in vars(self).items()
                if name.startswith(PATTERN_PREFIX)}

    def to_config(self) -> SparseAttentionConfig:
        """The `SparseAttentionConfig` these flags give."""
        return SparseAttentionConfig(**self.values())


# Every flat key of SparseAttentionConfig as a `--sparse_<key>` flag and every SMETConfig field as a `--smet_<field>`
# flag, generated so that help texts and defaults live once.
SparseAttentionFlags = dataclasses.make_dataclass(
    "SparseAttentionFlags", [(PATTERN_PREFIX + name, hint, f) for name, hint, f in pattern_flag_fields()],
    bases=(_PatternFlags,),
    namespace={"__doc__": "The sparse pattern as flags: `--sparse_<key>` for every flat key of "
               "`SparseAttentionConfig` (e.g. `--sparse_vertical_topk 1024 --sparse_block_size 64`); `to_config()` "
               "gives the config.", "__module__": __name__,
               # (checked against their registries as the flags make up the config: `to_config`)
               "REGISTERED_FIELDS": (PATTERN_PREFIX + "budget_mode", *(PATTERN_PREFIX + name for name in
                                                                        SparseAttentionConfig.REGISTERED_FIELDS)),
               "COMMON_FLAGS": tuple(PATTERN_PREFIX + name for cls in (SparseAttentionConfig, *map(budget_class,
                                                                                                 builtin_budget_modes()))
                                     for name in cls.COMMON_FLAGS)})
SMETFlags = dataclasses.make_dataclass("SMETFlags", copied_fields(SMETConfig, FLAG_PREFIX), bases=(KnownKeywords,),
                                       namespace={"KIND": "SMET flag", "COMMON_FLAGS": tuple(
                                           FLAG_PREFIX + name for name in SMETConfig.COMMON_FLAGS),
                                           "REGISTERED_FIELDS": tuple(
                                           FLAG_PREFIX + name for name in SMETConfig.REGISTERED_FIELDS)})
SMETFlags.__module__ = __name__


@dataclass
class SMETArguments(SMETFlags):
    """Switches for a Trainer script: `--smet`, `--smet_config FILE`, and `--smet_<field>` for every
    `SMETConfig` field (e.g. `--smet_density 0.1 --smet_update_interval 50`)."""

    COMMON_FLAGS: ClassVar[tuple[str, ...]] = ("smet", "smet_config", *SMETFlags.COMMON_FLAGS)

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
        if self.smet:  # the values, as the flags name them: refused here, not once the script has built its model
            check_values(SimpleNamespace(**self.values()), prefix="--" + FLAG_PREFIX)
            return
        # Without --smet the Trainer keeps its own optimizer: SMET settings would be ignored without a word.
        if self.smet_config is not None:
            raise ValueError(
                f"--smet_config {self.smet_config} given without --smet would be ignored: add --smet to train with "
                "SMET, or drop --smet_config."
            )
        default = SMETConfig()
        self.refuse_without_smet([name for name, value in self.values().items() if value != getattr(default, name)])

    @staticmethod
    def refuse_without_smet(names: Sequence[str]) -> None:
        """Raise ValueError, naming the fix, for the `--smet_<name>` flags given (`names`: SMETConfig fields; none:
        nothing to refuse) in a run without --smet, whose Trainer keeps its own optimizer."""
        if names:
            raise ValueError(
                f"{', '.join('--' + FLAG_PREFIX + name for name in names)} given without --smet would be ignored: "
                "add --smet to train with SMET, or drop them."
            )

    def values(self) -> dict[str, Any]:
        """The `--smet_<field>` values by SMETConfig field name."""
        return {f.name: getattr(self, FLAG_PREFIX + f.name) for f in dataclasses.fields(SMETConfig)}

    def to_config(self, explicit: Collection[str] | None = None) -> SMETConfig:
        """The SMET config: the `--smet_*` flags without a `--smet_config` file; with one, the file with
        flags on top: those named in `explicit` (argument names given on the command line, e.g.
        `smet_density`, see `explicit_fields`) whatever their value, or without `explicit`, those that
        differ from the defaults (see `FileConfig.from_file_and_flags`)."""
        fields = None if explicit is None else unprefixed(explicit, FLAG_PREFIX)
        return SMETConfig.from_file_and_flags(self.smet_config, self.values(), fields)


def help_groups(cls: type, common: Collection[str]) -> tuple[type, type]:
    """The flags of dataclass `cls` as two dataclasses for one `HfArgumentParser`, each an argument group of
    its `--help`: the `common` flags (listed first when passed first) and every other flag;
    `cls(**vars(first), **vars(second))` builds `cls` from what it parses."""
    flags = [copied for copied, f in zip(copied_fields(cls), dataclasses.fields(cls)) if f.init]

    def group(title: str, keep: bool) -> type:
        return dataclasses.make_dataclass(title.title().replace(" ", ""),
                                          [flag for flag in flags if (flag[0] in common) == keep],
                                          namespace={"_argument_group_name": title})

    return group("common flags", True), group("other flags", False)


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
    if not isinstance(parser, argparse.ArgumentParser) or isinstance(args, str):
        raise TypeError("explicit_fields(parser, args) takes the parser (an HfArgumentParser) and the command line "
                        f"as a list of strings (e.g. sys.argv[1:]), not {type(parser).__name__} and "
                        f"{type(args).__name__}.")
    args = [arg for arg in args if arg not in ("-h", "--help")]
    names = vars(parser.parse_known_args(args)[0])
    unset = argparse.Namespace(**dict.fromkeys(names, _NOT_GIVEN))
    given = vars(parser.parse_known_args(args, namespace=unset)[0])
    return {name for name, value in given.items() if value is not _NOT_GIVEN}
