"""The plugin's flags (`--sparse_*`, `--cp_*`, `--smet*`) as dataclass fields, and `PluginArguments`, those flags alone.

`sparse_trainer.sparse_arguments_class` adds the fields to a `TrainingArguments` class; `PluginArguments` is what
`hf_sparse_cp.run` reads before a script's path. Light (no Trainer, no model code): the launcher checks the flags
here, once, before it starts any process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from collections.abc import Collection, Iterator, Mapping
from contextvars import ContextVar
from typing import Any, ClassVar

import torch

from ..attention.engines import check_engine_trains_on
from ..config import SparseAttentionConfig
from ..config.files import KnownKeywords, check_field_types, unread_fields_checked_by_caller
from ..distributed import ContextParallelConfig, check_launched, check_ring
from ..launch_env import launched_world_size
from ..scoped import scoped
from ..smet import SMETConfig
from ..smet.config import module_names
from .arguments import (
    FLAG_PREFIX,
    PATTERN_PREFIX,
    SMETArguments,
    SparseAttentionFlags,
    SparseCPArguments,
    copied_fields,
    flags_over_a_file,
    from_fields,
    unprefixed,
)
from .schedule import CurriculumArguments, Stage, parse_schedule, stage_layouts
from .stage_plan import check_schedule_flags

logger = logging.getLogger(__name__)
_WARNED: set[str] = set()  # (the arguments of one run are built more than once in a process: warned once)

# The dataclasses whose fields (command-line flags) the generated arguments carry.
_PARTS = (SparseCPArguments, SparseAttentionFlags, ContextParallelConfig, CurriculumArguments, SMETArguments)
# One switch: the class itself asks for sparse attention, so its flag defaults to on here.
_DEFAULTS = {"sparse_attention": True}
# Not a flag (init=False): the fields the command line or a recipe gave, set by the script that parsed them
# (`arguments.explicit_fields`); they beat --sparse_config / --smet_config whatever their value.
_EXPLICIT = dataclasses.field(init=False, default=None, repr=False, compare=False)
# The sequence length, for argument classes that have none (TRL's configs have `max_length`, with the same meaning,
# and the plugin reads theirs).
LENGTH_FIELD = "sparse_max_length"
_MAX_LENGTH = dataclasses.field(default=None, metadata={
    "help": "Tokens per training sequence. Turns gradient checkpointing on at or above "
            "--sparse_gradient_checkpointing_min_length (token tiles at --sparse_token_tiling_min_length) and decides "
            "which documents reach --sparse_min_seq_len; default: the length of the training set's first sample "
            "(TRL's SFTConfig: its own --max_length). The first batch of longer rows that would have turned a memory "
            "saver on is logged, naming the length to pass."})
# Fields of earlier releases under their names now: arguments saved by them (a checkpoint's training_args.bin)
# load with the new names.
RENAMED_FIELDS = {"max_length": LENGTH_FIELD}
# The flags a user sets first (`--help` and docs/flags.md list them first): each part's `COMMON_FLAGS`.
COMMON_FLAGS = (LENGTH_FIELD, *(name for part in _PARTS for name in part.COMMON_FLAGS))


# True while a launcher parses a script's flags once before starting its processes (`parsing_for_launch`).
_PARSING_FOR_LAUNCH: ContextVar[bool] = ContextVar("hf_sparse_cp_parsing_for_launch", default=False)


# The processes the launcher parsing a script's flags will start (`parsing_for_launch`), where it says.
_LAUNCH_PROCESSES: ContextVar[int | None] = ContextVar("hf_sparse_cp_launch_processes", default=None)


@contextlib.contextmanager
def parsing_for_launch(processes: int | None = None) -> Iterator[None]:
    """Inside the block, training arguments parse as in one of several launched processes: a setting that needs
    several (--fsdp) is not refused for running alone (the launcher checks a script's flags here, once, before it
    starts the processes), and a Trainer that a script launched here builds is refused (`hf-sparse-cp launch` runs a
    script here for its --help alone). `processes`: how many the launcher starts (`launch_world_size`)."""
    with scoped(_PARSING_FOR_LAUNCH, True), scoped(_LAUNCH_PROCESSES, processes):
        yield


def is_parsing_for_launch() -> bool:
    """Whether a launcher is parsing a script's flags before starting its processes (`parsing_for_launch`)."""
    return _PARSING_FOR_LAUNCH.get()


def launch_world_size() -> int | None:
    """The processes of the run whose flags parse: the launcher's count as it parses them before starting the
    processes (`parsing_for_launch`), WORLD_SIZE in a launched process, None where not known (a process alone)."""
    processes = _LAUNCH_PROCESSES.get() if is_parsing_for_launch() else None
    return launched_world_size() if processes is None else processes


# True inside `parsing_for_cpu`: the script's arguments give --use_cpu, a field the plugin's own arguments lack.
_PARSING_FOR_CPU: ContextVar[bool] = ContextVar("hf_sparse_cp_parsing_for_cpu", default=False)


def parsing_for_cpu(use_cpu: bool) -> contextlib.AbstractContextManager[None]:
    """Inside the block, with `use_cpu`, the plugin's arguments built check their settings for a run on the CPU (a
    script's --use_cpu, which the launcher reads among the script's arguments: `PluginArguments` has no such
    field)."""
    return scoped(_PARSING_FOR_CPU, use_cpu)


# The flags typed on the command line being parsed (`parsing_typed_flags`).
_TYPED_FLAGS: ContextVar[frozenset[str] | None] = ContextVar("hf_sparse_cp_typed_flags", default=None)


def parsing_typed_flags(explicit: Collection[str]) -> contextlib.AbstractContextManager[None]:
    """Inside the block, the plugin's arguments built know the flags `explicit` (`explicit_fields`: those the command
    line or a recipe typed, whatever their value) as they check themselves, not only once the parser sets their
    `explicit_flags` after: a flag typed at its default value that no setting of the run reads is refused (or said to
    have no effect) as the same flag at another value is."""
    return scoped(_TYPED_FLAGS, frozenset(explicit))


def _flag(name: str, value: Any) -> str:
    """A setting as the command line gives it: `--name value`."""
    return f"--{name} {value}"


def _pattern_flag(key: str, value: Any) -> str:
    """A pattern setting (by flat key) as its flag gives it: `--sparse_key value`."""
    return _flag(PATTERN_PREFIX + key, value)


class PluginArgumentsMixin(KnownKeywords):
    """The plugin's fields on a generated dataclass (`sparse_arguments_class`, `PluginArguments`): their checks
    and the configs they make up. A keyword argument it does not take is refused naming the close one
    (`KnownKeywords`)."""

    KIND: ClassVar[str] = "plugin"

    @classmethod
    def known_keys(cls, known: list[str]) -> str:
        # (some 60 flags, with a Trainer's some 200 fields: too many to read in a message)
        base = getattr(cls, "_sparse_base", None)
        return (f"the fields of {base.__name__} and " if base else "") + "the plugin's flags (docs/flags.md lists them)"

    _sparse_fields: frozenset[str]  # the plugin's fields (type-checked at construction)
    _length_field: str  # the field that holds the sequence length: LENGTH_FIELD, or the base's `max_length`

    def _check_plugin_fields(self) -> None:
        """The plugin's fields, whatever built them (the command line, a YAML/JSON file or a dict through
        HfArgumentParser, direct construction), before anything reads them: text in a switch would be true."""
        self.smet_target_modules = module_names(self.smet_target_modules)  # (as SMETConfig takes them)
        check_field_types(self, self._sparse_fields)
        if self.explicit_flags is None:  # (a parser sets them once the arguments are built: `parsing_typed_flags`)
            self.explicit_flags = _TYPED_FLAGS.get()

    def _validate_plugin_fields(self) -> None:
        with unread_fields_checked_by_caller():  # (values no setting reads: below, across the run, naming the flags)
            for part in _PARTS:  # each part validates its own fields, naming them (the pattern's over its file)
                self.pattern_flags() if part is SparseAttentionFlags else from_fields(self, part)
            pattern, layout = self.sparse_attention_config(), self.context_parallel_config()
        self.smet_optimizer_config()  # (its --smet_config file)
        if not self.smet:  # (the flags typed at their default value too: SMETArguments sees the values alone)
            flags, default = self.smet_arguments().values(), SMETConfig()
            SMETArguments.refuse_without_smet(list(self._typed(
                flags, {name: getattr(default, name) for name in flags}, FLAG_PREFIX)))
        check_sequence_length(self._length_field, self.sequence_length)
        split = next(((where, degree) for where, degree in self.cp_degrees() if degree > 1), None)
        if split and not self.sparse_attention:  # (the Trainer refused it only after the script built its data)
            where, degree = split
            raise ValueError(
                f"{where or f'--cp_size {degree}: '}context parallelism runs its ring in the sparse_cp backend, which "
                "--sparse_attention false turns off: drop --sparse_attention false (add --sparse_pattern dense for "
                "exact causal attention under CP), or train without context parallelism (drop --cp_size and "
                "--cp_schedule).")
        self._refuse_unread_planner_costs(layout)
        if not self.sparse_attention:
            self._note_unread_pattern_flags()
            return
        patterns = self._run_patterns(pattern)
        self._check_unread_pattern_flags(patterns)
        # and the values of the --sparse_config file that no layer of the run reads
        SparseAttentionConfig.refuse_unread(pattern.fields_given(), patterns, scope="this run")
        for engine in dict.fromkeys(pattern.attention_engine for pattern in patterns):
            check_engine_trains_on(engine, self._device_type())

    def _typed(self, flags: Mapping[str, Any], defaults: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
        """The `flags` (name -> value; a flag's name is `prefix + name`) the user gave: those typed (`explicit_flags`:
        on the command line, in a recipe), whatever their value, and those away from their `defaults` (a script's
        config file sets them, or code)."""
        explicit = unprefixed(self.explicit_flags or (), prefix)
        return {name: value for name, value in flags.items() if name in explicit or value != defaults.get(name)}

    def _typed_pattern_flags(self) -> dict[str, Any]:
        """The pattern flags typed, by flat key (`vertical_topk`)."""
        return self._typed(self.pattern_flags().values(), SparseAttentionConfig.flag_defaults(), PATTERN_PREFIX)

    def _stages(self) -> tuple[Stage, ...]:
        """The run's `--cp_schedule` stages (none without one)."""
        return parse_schedule(self.cp_schedule) if self.cp_schedule else ()

    def _run_patterns(self, pattern: SparseAttentionConfig) -> list[SparseAttentionConfig]:
        """The patterns the run's layers may train with: each layer's (`layer_configs`) of the run's `pattern` and of
        each `--cp_schedule` stage's (its fields over the pattern)."""
        stages = [pattern]
        for stage in self._stages():
            with contextlib.suppress(ValueError):  # (refused, naming the stage, by the schedule's own check)
                stages.append(stage.sparse_config(pattern))
        configs: list[SparseAttentionConfig] = []
        for config in (config for stage in stages for config in stage.layer_configs()):
            if config not in configs:  # (configs compare equal by their fields, and hash by none)
                configs.append(config)
        return configs

    def _check_unread_pattern_flags(self, patterns: list[SparseAttentionConfig]) -> None:
        """Pattern flags typed that no layer of `patterns` reads: where every layer is dense, a warning that they have
        no effect (a recipe's dense baseline under CP is the recipe with --sparse_pattern dense); else a refusal
        naming the fix (`SparseAttentionConfig.refuse_unread`: an estimation chunk without causal-chunk estimation),
        as they would be ignored without a word."""
        unread = SparseAttentionConfig.refuse_unread(self._typed_pattern_flags(), patterns, _pattern_flag, "this run")
        if unread:
            them = "them" if len(unread) > 1 else "it"
            self._note_no_effect([f"--{PATTERN_PREFIX}{key}" for key in unread], f"only a vertical_slash pattern "
                                 f"reads {them}, and every layer of this run is dense (--sparse_pattern dense)")

    def _note_unread_pattern_flags(self) -> None:
        """Warn that the pattern flags typed have no effect with --sparse_attention false: not refused, so that a
        recipe's dense baseline is the recipe with --sparse_attention false."""
        given = [f"--{PATTERN_PREFIX}{key}" for key in self._typed_pattern_flags()]
        given += ["--sparse_config"] if self.sparse_config is not None else []
        self._note_no_effect(given, "--sparse_attention false turns the sparse_cp backend off, so the model trains "
                             "with its own attention")

    @staticmethod
    def _note_no_effect(flags: list[str], why: str) -> None:
        """Warn, once per run (the launcher's parse before its processes and ranks other than 0 stay silent), that
        `flags` (none: nothing to say) have no effect, and `why`."""
        if not flags or is_parsing_for_launch() or os.environ.get("RANK", "0") != "0":
            return
        message = f"{', '.join(flags)} {'have' if len(flags) > 1 else 'has'} no effect: {why}."
        if message not in _WARNED:
            _WARNED.add(message)
            logger.warning(message)

    def _refuse_unread_planner_costs(self, base: ContextParallelConfig) -> None:
        """Refuse, naming the fix, document-planner weights typed for a run (its CP flags: `base`) that no stage
        shards by document (`ContextParallelConfig.refuse_unread_planner_costs`)."""
        costs = {name: getattr(base, name) for name in ContextParallelConfig.PLANNER_FIELDS}
        typed = self._typed(costs, {f.name: f.default for f in dataclasses.fields(ContextParallelConfig)})
        ContextParallelConfig.refuse_unread_planner_costs(typed, stage_layouts(base, self._stages()), _flag,
                                                          "this run")

    def _device_type(self) -> str:
        """The type of the devices the run trains on: 'cpu' with --use_cpu (`parsing_for_cpu`) or without an
        accelerator."""
        if getattr(self, "use_cpu", False) or _PARSING_FOR_CPU.get() or not torch.accelerator.is_available():
            return "cpu"
        return torch.accelerator.current_accelerator().type

    @property
    def sequence_length(self) -> int | None:
        """Tokens per training sequence as the arguments give it (`--sparse_max_length`, or TRL's `--max_length`)."""
        return getattr(self, self._length_field)

    def plugin_arguments(self) -> SparseCPArguments:
        return from_fields(self, SparseCPArguments)

    def pattern_flags(self) -> SparseAttentionFlags:
        """The pattern flags as given, before `--sparse_config` is read (with one, they are validated on top of it:
        `sparse_attention_config`)."""
        with flags_over_a_file() if self.sparse_config is not None else contextlib.nullcontext():
            return from_fields(self, SparseAttentionFlags)

    def sparse_attention_config(self) -> SparseAttentionConfig:
        """The pattern: the `--sparse_config` file if given, with the pattern flags on top."""
        with self._checked_across_stages():
            return self.plugin_arguments().attention_config(self.pattern_flags(), self.explicit_flags)

    def context_parallel_config(self) -> ContextParallelConfig:
        with self._checked_across_stages():
            return from_fields(self, ContextParallelConfig)

    def _checked_across_stages(self) -> contextlib.AbstractContextManager:
        """Around building the run's base config: with a `--cp_schedule`, a stage may read what the base does not
        (an estimation chunk, planner costs), which the arguments checked across the stages as they were built."""
        return unread_fields_checked_by_caller() if self.cp_schedule else contextlib.nullcontext()

    def cp_degrees(self) -> list[tuple[str, int]]:
        """The run's CP degrees, each with where it is set as a message starts: `--cp_size`'s (''), or each
        `--cp_schedule` stage's ('--cp_schedule stage 1 (2:512:2): ')."""
        if not self.cp_schedule:
            return [("", self.cp_size)]
        return [(f"--cp_schedule stage {i} ({stage.text}): ", stage.cp_size)
                for i, stage in enumerate(parse_schedule(self.cp_schedule))]

    def check_schedule(self, max_steps: int = -1) -> None:
        """`stage_plan.check_schedule_flags` for the run's `--cp_schedule` (nothing without one): what the flags
        alone decide of its stages (their fields, their CP layouts, whole blocks per CP rank with the run's pattern
        where the flags give it: no `--sparse_config` file, or the flags typed known), and their starts against
        `max_steps` (-1: not known). The launcher runs it on the flags of a launched script, which the processes
        refused only once each had built its data and model."""
        if not self.cp_schedule:
            return
        known = self.sparse_attention and (self.sparse_config is None or self.explicit_flags is not None)
        check_schedule_flags(self.cp_schedule, self.sparse_attention_config() if known else None, max_steps,
                             self.context_parallel_config())

    def check_launch(self, env: Mapping[str, str] = os.environ, ring: bool = True) -> None:
        """`mesh.check_launched` for the run's CP degrees (`cp_degrees`; a refusal names the stage) in a launch
        described by `env` (WORLD_SIZE), and, with `ring`, `mesh.check_ring` for a run of one CP degree (its
        hierarchical ring over the launch's nodes: LOCAL_WORLD_SIZE, or --cp_node_size; how many ranks it spans is
        the CP mode's)."""
        for where, cp_size in self.cp_degrees():
            try:
                check_launched([cp_size], env)
            except ValueError as e:
                raise ValueError(f"{where}{e}") from None
        if ring and not self.cp_schedule and self.cp_size > 1:
            check_ring(self.context_parallel_config(), env)

    def smet_arguments(self) -> SMETArguments:
        return from_fields(self, SMETArguments)

    def smet_optimizer_config(self) -> SMETConfig | None:
        """The SMET settings when `--smet` is on, else None."""
        flags = self.smet_arguments()
        return flags.to_config(self.explicit_flags) if flags.smet else None


def check_sequence_length(name: str, value: Any) -> None:
    """Raise ValueError, naming the flag and the fix, for a training sequence length below 2 tokens (a causal LM
    learns from at least 2: the first predicts the second); None (unset) passes."""
    if isinstance(value, int) and not isinstance(value, bool) and value < 2:
        raise ValueError(f"--{name} {value}: a training sequence needs at least 2 tokens; e.g. --{name} 4096 (or "
                         "leave it unset).")


def plugin_fields(base: type | None = None) -> list[tuple[str, Any, dataclasses.Field]]:
    """The plugin's fields as `make_dataclass` takes them: `sparse_max_length` (unless `base` has its own
    `max_length`), `explicit_flags` (not a flag) and every field of `_PARTS` under its command-line name."""
    base_fields = set() if base is None else {f.name for f in dataclasses.fields(base)}
    fields = [] if "max_length" in base_fields else [(LENGTH_FIELD, int | None, _MAX_LENGTH)]
    fields.append(("explicit_flags", Collection[str] | None, _EXPLICIT))
    for part in _PARTS:
        fields += copied_fields(part, defaults=_DEFAULTS)
    clash = {name for name, _, _ in fields} & base_fields
    if clash:
        raise TypeError(f"plugin flags {sorted(clash)} collide with fields of {base.__name__}; rename them.")
    return fields


def class_namespace(fields: list[tuple[str, Any, dataclasses.Field]], **extra: Any) -> dict[str, Any]:
    """The class attributes of a generated class with the plugin's `fields` (and `extra`: `__module__`, where the
    class is generated elsewhere)."""
    names = {name for name, _, f in fields if f.init}
    return {"__module__": __name__, "_sparse_fields": frozenset(names),
            # (a registered variant's name, checked by its part: see `check_field_types`)
            "REGISTERED_FIELDS": tuple(name for part in _PARTS for name in getattr(part, "REGISTERED_FIELDS", ())),
            "_length_field": LENGTH_FIELD if LENGTH_FIELD in names else "max_length", **extra}


class _PluginOnly(PluginArgumentsMixin):
    def __post_init__(self) -> None:
        self._check_plugin_fields()
        self._validate_plugin_fields()


_PLUGIN_FIELDS = plugin_fields()
# The plugin's flags alone, with the defaults of `SparseTrainingArguments`: what `hf_sparse_cp.run` reads before
# the script path, for the arguments a script builds in code.
PluginArguments = dataclasses.make_dataclass(
    "PluginArguments", _PLUGIN_FIELDS, bases=(_PluginOnly,),
    namespace=class_namespace(_PLUGIN_FIELDS, __doc__="The plugin's flags alone (those of `sparse_arguments_class`)."))
