"""The sections of `SparseAttentionConfig`: `Scoring` (which queries score a document) and `BudgetSection`,
the base of the budget modes, which `hf_sparse_cp.attention.budgets` registers by name (`register_budget`);
and where the flat keys of files and flags of every earlier version (`budget_mode`, `vertical_topk`,
`last_q`, ...) go in the tree.

A budget mode is a dataclass holding only its own fields, with their real defaults: a field of another
mode cannot be given to it, so "read only in its mode" is its constructor's rule, not a table's.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from .files import FileConfig, check_field_types

logger = logging.getLogger(__name__)

# The mode a config without a budget runs (the sparsest measured setting within 0.5% of dense perplexity).
DEFAULT_MODE = "mass"
_BUDGETS: dict[str, type[BudgetSection]] = {}
BUILTIN_BUDGETS = "hf_sparse_cp.attention.budgets"  # the module that registers the built-in modes


@dataclass
class Scoring(FileConfig):
    """Which queries of a document score its keys: the last `last_q`, and `sample_groups` groups along it.
    A budget may have been measured with other values than these defaults (`BudgetSection.scoring`)."""

    KIND: ClassVar[str] = "scoring"

    last_q: int = field(
        default=64, metadata={"help": "Number of final queries of each document used to estimate the pattern."})
    sample_groups: int = field(
        default=0,
        metadata={"help": "Groups of queries sampled along each document (before each chunk with causal_chunks) "
                  "that estimate the pattern besides the last last_q: the document is cut into sample_groups + 1 "
                  "equal parts, each scored by its last queries (sample_group_size of them, last_q for the last "
                  "part), and each scoring query counts for the queries of its part. Catches the keys that earlier "
                  "queries use; costs about sample_groups x sample_group_size / 2 more scoring rows per document."},
    )
    sample_group_size: int = field(default=16, metadata={"help": "Queries per sampled group of sample_groups."})

    def __post_init__(self) -> None:
        check_field_types(self)
        for name, least in (("last_q", 1), ("sample_groups", 0), ("sample_group_size", 1)):
            if getattr(self, name) < least:
                raise ValueError(f"{name}={getattr(self, name)} must be >= {least}.")


class BudgetSection(FileConfig):
    """How many key columns and diagonals a head keeps: one dataclass per mode, registered under `mode`.

    Subclasses (`hf_sparse_cp.attention.budgets`) say what they compute; here they are fields in a file.
    `scoring`: the `Scoring` fields this mode was measured with, where they differ from its defaults.
    """

    KIND: ClassVar[str] = "budget"
    mode: ClassVar[str]
    scoring: ClassVar[Mapping[str, Any]] = {}

    def __post_init__(self) -> None:
        check_field_types(self)

    def to_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, **dataclasses.asdict(self)}


def _registered() -> dict[str, type[BudgetSection]]:
    """The registered budget modes. The built-in ones register when `hf_sparse_cp.attention.budgets` is imported,
    which this makes sure of (once imported, a lookup in `sys.modules`), so that a config read before anything
    imported the attention package (the package root imports nothing) knows them."""
    importlib.import_module(BUILTIN_BUDGETS)
    return _BUDGETS


def register_budget(cls: type[BudgetSection]) -> type[BudgetSection]:
    """Register a budget mode under `cls.mode` (a class decorator)."""
    _BUDGETS[cls.mode] = cls
    return cls


def budget_modes() -> tuple[str, ...]:
    return tuple(_registered())


def budget_class(mode: str) -> type[BudgetSection]:
    if mode not in _registered():
        raise ValueError(f"budget_mode={mode!r} is not valid: use one of {', '.join(map(repr, _registered()))}.")
    return _registered()[mode]


def default_budget() -> BudgetSection:
    return budget_class(DEFAULT_MODE)()


def modes_of(name: str) -> list[str]:
    """The budget modes that have field `name`."""
    return [m for m, cls in _registered().items() if name in _names(cls)]


def budget_field_names() -> list[str]:
    """Every budget mode's fields, each once, in registration order (their flat keys)."""
    return list(dict.fromkeys(name for cls in _registered().values() for name in _names(cls)))


def _names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))


def _mode_words(modes: list[str]) -> str:
    return " or ".join(f"budget_mode={m!r}" for m in modes)


def inferred_mode(fields_: Mapping[str, Any]) -> str | None:
    """The mode that budget fields given without one select: the default mode if it has them all, else the
    one mode that does (None without fields). Fields of no common mode are refused, naming their modes."""
    if not fields_:
        return None
    holders = [m for m, cls in _registered().items() if set(fields_) <= set(_names(cls))]
    if DEFAULT_MODE in holders or len(holders) == 1:
        return DEFAULT_MODE if DEFAULT_MODE in holders else holders[0]
    owners = {m for name in fields_ for m in modes_of(name)}
    raise ValueError(f"{', '.join(sorted(fields_))} are budgets of {len(owners)} modes; pass "
                     f"{' or '.join(f'--sparse_budget_mode {m}' for m in sorted(owners))} with the one to use, "
                     "and only its fields.")


def budget_from(section: Mapping[str, Any] | BudgetSection) -> BudgetSection:
    """The budget of a `budget` section: its `mode` (or the one its fields select) with its fields. A field
    the mode does not have would do nothing there, and is refused, naming the mode that reads it."""
    if isinstance(section, BudgetSection):
        return section
    section = dict(section)
    mode = section.pop("mode", None) or inferred_mode(section) or DEFAULT_MODE
    cls = budget_class(mode)
    for name, value in section.items():
        if name not in _names(cls):
            owners = modes_of(name)
            if not owners:
                raise ValueError(f"Unknown budget key {name!r}; the budget modes' keys: {budget_field_names()}.")
            raise ValueError(
                f"{name}={value!r} is read only in {_mode_words(owners)} and would do nothing with "
                f"budget_mode={mode!r}; pass --sparse_budget_mode {owners[0]} (budget_mode={owners[0]!r}) with it, "
                f"or leave {name} unset.")
    return cls(**section)


def section_mapping(name: str, value: Any) -> dict[str, Any]:
    """Section `name` as a mapping of what it holds (a section object: every field; `budget`: with its mode)."""
    if isinstance(value, FileConfig):
        return value.to_dict()
    if not isinstance(value, Mapping):
        raise ValueError(f"{name}={value!r} ({type(value).__name__}) is not valid: use a mapping of its fields, e.g. "
                         f"{name}: {{{'mode: topk, vertical_topk: 1024' if name == 'budget' else 'last_q: 64'}}}.")
    return dict(value)


def merged_sections(lower: Mapping[str, Any], upper: Mapping[str, Any]) -> dict[str, Any]:
    """`upper`'s `budget` and `scoring` sections on top of `lower`'s (partial mappings). A mode that `upper`
    names and `lower`'s budget does not have replaces that budget whole, and `lower`'s scoring fields left at
    its mode's `BudgetSection.scoring` defaults take the new mode's; otherwise fields merge one by one."""
    budget, scoring = dict(lower.get("budget", {})), dict(lower.get("scoring", {}))
    top = dict(upper.get("budget", {}))
    old = budget.get("mode") or inferred_mode(budget)
    if top.get("mode") and old and top["mode"] != old:
        defaults = {**dataclasses.asdict(Scoring()), **budget_class(old).scoring}
        budget = {}
        scoring = {name: value for name, value in scoring.items() if value != defaults.get(name)}
    return {"budget": {**budget, **top}, "scoring": {**scoring, **upper.get("scoring", {})}}


def scoring_from(section: Mapping[str, Any] | Scoring, budget: BudgetSection) -> Scoring:
    """The scoring of a `scoring` section: its fields over the ones `budget` was measured with."""
    if isinstance(section, Scoring):
        return section
    return Scoring(**{**budget.scoring, **section})


def given_sections(budget: BudgetSection, scoring: Scoring) -> dict[str, Any]:
    """The sections' values that differ from their defaults (those of the budget's mode): what a config built
    in code gave (a default cannot be told from a value not given)."""
    out: dict[str, Any] = {}
    changed = {f.name: getattr(budget, f.name) for f in dataclasses.fields(budget)
               if getattr(budget, f.name) != f.default}
    if changed or budget.mode != DEFAULT_MODE:
        out["budget"] = {"mode": budget.mode, **changed}
    defaults = scoring_from({}, budget)
    changed = {f.name: getattr(scoring, f.name) for f in dataclasses.fields(scoring)
               if getattr(scoring, f.name) != getattr(defaults, f.name)}
    if changed:
        out["scoring"] = changed
    return out


# --------------------------------------------------------------------------- flat keys of earlier versions

# The fields that every earlier version's `to_dict` saved: a flat mapping holding all of them is a saved config.
SAVED_BY_EVERY_VERSION = frozenset((
    "pattern", "budget_mode", "vertical_topk", "slash_topk", "vertical_topp", "slash_topp", "vertical_cap",
    "slash_cap", "sink_tokens", "local_window", "last_q", "block_size", "min_seq_len", "dense_first_layers",
    "layer_overrides"))
# What a saved config ran with for a field added after it was saved, where that is not the field's default.
BEFORE_ADDED = {"mass_threshold": 0.0}
# The values earlier versions saved for fields whose mode was not selected (a value other than these, dropped
# from a saved config, earns a warning: it did nothing there).
SAVED_UNREAD = {"vertical_topk": (512, 1024), "slash_topk": (1024, 2048), "vertical_topp": (0.9,),
                "slash_topp": (0.9,), "vertical_cap": (1024, 4096), "slash_cap": (4096,), "mass_target": (0.9, 0.95),
                "mass_threshold": (0.0,), "mass_near_blocks": (0,)}


def nested(data: Mapping[str, Any], stored: bool = False) -> dict[str, Any]:
    """`data` (a config's fields with `budget` / `scoring` sections, flat keys of any version, or both) as
    top-level fields and the two sections; flat keys go on top of the sections given.

    Flat keys as earlier versions read them, where the flat mapping names its budget_mode: a budget field of
    a mode that a layer override selects is that override's too (the fields were shared), unless it sets
    the field; one that neither the mode nor an override reads did nothing: refused, or in a `stored` mapping
    (a saved config: every version saved every field) dropped, with a warning for a value that those versions
    did not save by default. A saved config ran without the fields added after it (`BEFORE_ADDED`)."""
    data = dict(data)
    sections = {name: section_mapping(name, data.pop(name)) for name in ("budget", "scoring") if name in data}
    flat = {name: data.pop(name) for name in (*budget_field_names(), "budget_mode") if name in data}
    scoring = {f.name: data.pop(f.name) for f in dataclasses.fields(Scoring) if f.name in data}
    if stored and SAVED_BY_EVERY_VERSION <= {*data, *flat, *scoring}:
        flat = {**BEFORE_ADDED, **flat}
    flat = {name: value for name, value in flat.items() if value is not None}  # None: unset (flags, saved configs)
    scoring = {name: value for name, value in scoring.items() if value is not None}
    mode = flat.pop("budget_mode", None)
    if mode is not None:
        own, shared = _names(budget_class(mode)), set()
        if "layer_overrides" in data:
            data["layer_overrides"], shared = _shared_with_overrides(flat, mode, data["layer_overrides"])
        for name in [name for name in flat if name not in own and (stored or name in shared)]:
            value = flat.pop(name)
            if name not in shared and value not in SAVED_UNREAD.get(name, ()):
                logger.warning("Ignoring %s=%r of a saved sparse attention config: only %s reads it, and this "
                               "config selects budget_mode=%r.", name, value, _mode_words(modes_of(name)), mode)
        flat["mode"] = mode
    return {**data, **merged_sections(sections, {"budget": flat, "scoring": scoring})}


def parsed_overrides(overrides: Any) -> Any:
    """`layer_overrides` given as JSON text, parsed (None for blank text); any other value as it is."""
    if not isinstance(overrides, str):
        return overrides
    try:
        return json.loads(overrides) if overrides.strip() else None
    except json.JSONDecodeError as e:
        raise ValueError(
            f"layer_overrides is not valid JSON ({e}); pass e.g. '{{\"0-1\": {{\"pattern\": \"dense\"}}}}'"
        ) from None


def _shared_with_overrides(flat: Mapping[str, Any], mode: str, overrides: Any) -> tuple[Any, set[str]]:
    """(`overrides` with the flat budget fields that each override's own budget_mode reads, the names of those
    that `mode` does not read). Only overrides written with flat keys share them."""
    overrides = parsed_overrides(overrides)
    if not isinstance(overrides, dict):
        return overrides, set()
    own, out, shared = _names(budget_class(mode)), {}, set()
    for key, fields_ in overrides.items():
        other = fields_.get("budget_mode") if isinstance(fields_, dict) else None
        if other in _registered() and other != mode:
            inherited = {name: value for name, value in flat.items()
                         if name in _names(budget_class(other)) and name not in fields_}
            fields_ = {**inherited, **fields_}
            shared |= {name for name in inherited if name not in own}
        out[key] = fields_
    return out, shared
