"""The stages of a context-length curriculum (`--cp_schedule`) as written: their grammar and the flag. Light (no
Trainer): the launcher reads a schedule's CP degrees before it starts any process; the curriculum itself
(`curriculum.py`) runs them."""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ..config import SparseAttentionConfig
from ..config.files import (
    KnownKeywords,
    check_field_types,
    checks_unread_fields,
    plain_settings,
    unread_fields_checked_by_caller,
)
from ..distributed import ContextParallelConfig

_EPOCH_SUFFIX = "ep"


@dataclass(frozen=True)
class Stage:
    """One stage: from optimizer step `from_step` (or data epoch `from_epoch`) on, samples of
    `seq_len` tokens on CP groups of `cp_size` ranks, with the sparse-pattern fields in `sparse` and the
    CP fields in `cp` (`ContextParallelConfig`: cp_mode, cp_ulysses_size, ...) changed."""

    seq_len: int
    cp_size: int
    from_step: int | None = None
    from_epoch: float | None = None
    sparse: Mapping[str, Any] = field(default_factory=dict)
    cp: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if (self.from_step is None) == (self.from_epoch is None):
            raise ValueError(f"a stage starts at a step or at an epoch (got from_step={self.from_step}, from_epoch="
                             f"{self.from_epoch}): write `100:...` or `1.5ep:...`.")
        if self.seq_len < 1 or self.cp_size < 1:
            raise ValueError(f"SEQ_LEN {self.seq_len} and CP_SIZE {self.cp_size} must both be >= 1, e.g. '0:4096:1'.")
        start = self.from_step if self.from_step is not None else self.from_epoch
        if not 0 <= start < math.inf:  # (NaN and inf too: a start no step reaches, refused as the flags parse)
            raise ValueError(f"a stage starts at step or epoch {start}: use a finite value >= 0.")

    @property
    def text(self) -> str:
        start = str(self.from_step) if self.from_step is not None else f"{self.from_epoch:g}{_EPOCH_SUFFIX}"
        fields = [f"{k}.{n}={x}" if isinstance(v, Mapping) else f"{k}={v}" for k, v in self.sparse.items()
                  for n, x in (v.items() if isinstance(v, Mapping) else [(None, v)])]
        fields += [f"{k}={v}" for k, v in self.cp.items()]
        return ":".join([start, str(self.seq_len), str(self.cp_size), *fields])

    @contextlib.contextmanager
    def refusals(self, index: int) -> Iterator[None]:
        """Around the checks of this stage, the `index`-th of its schedule: a ValueError names the stage (which, in
        a schedule of several), and the configs' messages spell settings and fixes as the stage's fields do
        (`plain_settings`: `pattern=vertical_slash`, `cp_mode=hybrid`), which the stage syntax takes."""
        try:
            with plain_settings():
                yield
        except ValueError as error:
            raise ValueError(f"cp_schedule stage {index} ({self.text}): {error}") from None

    # (a stage's configs refuse the fields the stage gives that they do not read, not the run's: another stage may
    # read those, which the run's arguments check across the stages)
    def cp_config(self, base: ContextParallelConfig) -> ContextParallelConfig:
        """The run's CP flags `base` with this stage's degree and CP fields."""
        with unread_fields_checked_by_caller():
            config = dataclasses.replace(base, cp_size=self.cp_size, **self.cp)
        if checks_unread_fields():
            given = {name: value for name, value in self.cp.items() if name in ContextParallelConfig.PLANNER_FIELDS}
            # (spelled as the stage's fields inside `refusals`, where the schedule's checks build it)
            ContextParallelConfig.refuse_unread_planner_costs(given, [config], scope="this stage")
        return config

    def sparse_config(self, base: SparseAttentionConfig) -> SparseAttentionConfig:
        """The run's pattern `base` with this stage's pattern fields."""
        with unread_fields_checked_by_caller():
            config = base.replace(**self.sparse)
        if checks_unread_fields():  # (only the unread fields the stage gives, named as the stage's)
            config.refuse_unread_changes(self.sparse, scope="this stage")
        return config


def _value(text: str) -> Any:
    """A `key=value` value as the type it reads as (int, float, bool, else the text)."""
    for parse in (int, float):
        with contextlib.suppress(ValueError):
            return parse(text)
    return {"true": True, "false": False}.get(text.lower(), text)


# The stage fields that change the CP layout rather than the pattern.
_CP_FIELDS = frozenset(f.name for f in dataclasses.fields(ContextParallelConfig)) - {"cp_size"}


def parse_schedule(text: str) -> tuple[Stage, ...]:
    """Stages from `FROM:SEQ_LEN:CP_SIZE[:field=value...]` items separated by commas; FROM is an
    optimizer step (`100`) or a data epoch (`1.5ep`); a field is a flat key of the pattern
    (`mass_threshold=0.005`), a section's (`budget.mode=mass`, `scoring.last_q=64`) or a CP field
    (`ContextParallelConfig`, e.g. `cp_mode=ulysses`)."""
    if not isinstance(text, str):
        raise TypeError(f"parse_schedule(text): text must be a --cp_schedule string, e.g. '0:4096:1,2ep:16384:2', "
                        f"not {type(text).__name__}.")
    items = [part.strip() for part in text.split(",")]
    if not any(items):
        raise ValueError("cp_schedule is empty: give at least one stage, e.g. '0:4096:1'.")
    if not all(items):  # (it was skipped: a stage lost to a stray comma went unnoticed)
        where = items.index("")
        raise ValueError(f"cp_schedule {text!r}: stage {where + 1} of {len(items)} is empty (two commas in a row, or "
                         "one at an end): remove the stray comma, or give the stage there, e.g. "
                         "'0:4096:1,2ep:16384:2'.")
    stages = []
    for item in items:
        head, *extra = item.split(":")
        parts = [head, *extra]
        if len(parts) < 3 or any("=" in p for p in parts[:3]) or any("=" not in p for p in parts[3:]):
            raise ValueError(f"cp_schedule stage {item!r} must read FROM:SEQ_LEN:CP_SIZE[:field=value...], e.g. "
                             "'0:4096:1' or '2ep:16384:2:mass_threshold=0.005'.")
        try:
            start = (dict(from_epoch=float(parts[0].removesuffix(_EPOCH_SUFFIX))) if parts[0].endswith(_EPOCH_SUFFIX)
                     else dict(from_step=int(parts[0])))
            seq_len, cp_size = int(parts[1]), int(parts[2])
        except ValueError:
            raise ValueError(f"cp_schedule stage {item!r}: FROM must be a step (100) or an epoch (1.5ep), SEQ_LEN "
                             "and CP_SIZE whole numbers.") from None
        given = [(k, _value(v)) for k, v in (p.split("=", 1) for p in parts[3:])]
        keys = [k for k, _ in given]
        twice = sorted({k for k in keys if keys.count(k) > 1})
        if twice:  # (the last value won silently)
            raise ValueError(f"cp_schedule stage {item!r} gives {', '.join(twice)} more than once: give each field "
                             "once.")
        if "cp_size" in keys:
            raise ValueError(f"cp_schedule stage {item!r}: the CP degree is the stage's third field (FROM:SEQ_LEN:"
                             "CP_SIZE), not cp_size=.")
        cp = {k: v for k, v in given if k in _CP_FIELDS}
        sparse: dict[str, Any] = {}
        for key, value in given:
            if key not in _CP_FIELDS:
                section, _, name = key.rpartition(".")
                (sparse.setdefault(section, {}) if section else sparse)[name] = value
        try:
            stages.append(Stage(seq_len, cp_size, sparse=sparse, cp=cp, **start))
        except ValueError as error:  # (which stage, in a schedule of several)
            raise ValueError(f"cp_schedule stage {item!r}: {error}") from None
    return tuple(stages)


def stage_layouts(base: ContextParallelConfig, stages: Sequence[Stage]) -> list[ContextParallelConfig]:
    """The CP layouts of a run with the CP flags `base` and the schedule's `stages`: `base` and each stage's (a stage
    refused is left out: the schedule's own check refuses it, naming it)."""
    layouts = [base]
    for stage in stages:
        with contextlib.suppress(ValueError):
            layouts.append(stage.cp_config(base))
    return layouts


def schedule_cp_config(cp_schedule: str, **fields: Any) -> ContextParallelConfig:
    """`ContextParallelConfig(**fields)` as the base of the `cp_schedule` stages (for `attach_to_trainer(...,
    cp_config, cp_schedule=cp_schedule)`), whose stages may read what it does not: the document planner's weights it
    is given are refused only where no stage shards by document either, as --cp_planner_* with --cp_schedule."""
    if not isinstance(cp_schedule, str):
        raise TypeError(f"schedule_cp_config(cp_schedule, ...): cp_schedule must be a --cp_schedule string, e.g. "
                        f"'0:4096:1,100:16384:2:cp_sharding=document', not {type(cp_schedule).__name__}.")
    stages = parse_schedule(cp_schedule)
    with unread_fields_checked_by_caller():
        base = ContextParallelConfig(**fields)
    given = {name: getattr(base, name) for name in ContextParallelConfig.PLANNER_FIELDS if name in fields}
    ContextParallelConfig.refuse_unread_planner_costs(given, stage_layouts(base, stages))
    return base


@dataclass
class CurriculumArguments(KnownKeywords):
    """The flag of a context-length curriculum (`--cp_schedule`)."""

    KIND: ClassVar[str] = "curriculum"
    COMMON_FLAGS: ClassVar[tuple[str, ...]] = ("cp_schedule",)

    cp_schedule: str | None = field(
        default=None,
        metadata={"help": "Context-length curriculum in one run, switched online without a restart: comma-separated "
                  "stages FROM:SEQ_LEN:CP_SIZE[:field=value...], FROM an optimizer step (100) or a data epoch "
                  "(1.5ep), e.g. '0:4096:1,100:16384:2,300:65536:4:mass_threshold=0.005:cp_mode=ulysses' (a pattern "
                  "field, a section's field: budget.mode=topk, or a CP field: cp_mode, cp_ulysses_size). Samples are "
                  "cropped to their stage's SEQ_LEN (so they must be at least as long, one sample per row); needs "
                  "--max_steps; replaces --cp_size."},
    )

    def __post_init__(self) -> None:
        check_field_types(self)
        if self.cp_schedule is not None:
            parse_schedule(self.cp_schedule)
