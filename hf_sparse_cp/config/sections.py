"""The sections of `SparseAttentionConfig`: `Scoring` (which queries score a document) and `BudgetSection`,
the base of the budget modes, which `hf_sparse_cp.attention.budgets` registers by name (`register_budget`);
the flat keys of earlier versions go into them in `flat_keys.py`.

A budget mode is a dataclass holding only its own fields, with their real defaults: a field of another
mode cannot be given to it, so "read only in its mode" is its constructor's rule, not a table's.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from .files import FileConfig, KeyGivenTwice, check_field_types, close_keys, flag_setting, setting, unique_json_pairs
from .registries import Variants, register_in

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
    """Register a budget mode under `cls.mode` (a class decorator, above `@dataclass`): a dataclass subclass of
    `hf_sparse_cp.attention.budgets.Budget` that implements its abstract methods, whose fields are its own. A mode
    name registered to another class is refused (registering the same class again does nothing), so that neither
    a built-in mode nor a plug-in's is replaced by accident (a class redefined under its name, a notebook's cell
    run again, replaces its earlier self)."""
    _check_budget_class(cls)
    register_in(_BUDGETS, cls.mode, cls, "budget mode", "mode")
    return cls


def _check_budget_class(cls: Any) -> None:
    """Raise TypeError / ValueError, naming the fix, unless `cls` can be registered as a budget mode."""
    fix = ("subclass hf_sparse_cp.attention.budgets.Budget, decorate the class with @dataclass, set its `mode`, "
           "implement most_kept, select and describe, and put @register_budget above @dataclass")
    if not isinstance(cls, type) or not issubclass(cls, BudgetSection) or not dataclasses.is_dataclass(cls):
        raise TypeError(f"register_budget takes a budget mode's dataclass, not {cls!r}: {fix}.")
    missing = sorted(getattr(cls, "__abstractmethods__", ()))
    if missing:
        raise TypeError(f"budget mode {cls.__qualname__} does not implement {', '.join(missing)}: {fix}.")
    mode = getattr(cls, "mode", None)
    if not isinstance(mode, str) or not mode:
        raise ValueError(f"budget mode {cls.__qualname__} has no `mode` (a class attribute, the budget_mode value "
                         f"that selects it): {fix}.")
    taken = {"mode", *field_names(Scoring)} & set(field_names(cls))
    if taken:
        raise ValueError(f"budget mode {mode!r} has a field named {sorted(taken)[0]!r}, which is the budget section's "
                         "mode or a scoring field (their flat keys are one set): rename it.")


def budget_modes() -> tuple[str, ...]:
    return tuple(_registered())


# What `budget_mode` takes (its flag: `--sparse_budget_mode`).
BUDGET_MODES = Variants(budget_modes, "a mode", "@hf_sparse_cp.config.sections.register_budget on its class")


def builtin_budget_modes() -> tuple[str, ...]:
    """The built-in budget modes (those `hf_sparse_cp.attention.budgets` defines), in registration order: the ones
    whose fields are flags. A mode a user registers is selected in code, in a config file read after it is
    registered, or by --sparse_budget_mode parsed after it is registered (`registries.VariantFlag`); its fields are no
    flags, whichever was imported first (the flags are built once, on import)."""
    return tuple(mode for mode, cls in _registered().items()
                 if cls.__module__ == BUILTIN_BUDGETS or cls.__module__.startswith(BUILTIN_BUDGETS + "."))


def budget_class(mode: str) -> type[BudgetSection]:
    BUDGET_MODES.check("budget_mode", mode)
    return _registered()[mode]


def default_budget() -> BudgetSection:
    return budget_class(DEFAULT_MODE)()


def modes_of(name: str) -> list[str]:
    """The budget modes that have field `name`."""
    return [m for m, cls in _registered().items() if name in field_names(cls)]


def budget_field_names() -> list[str]:
    """Every budget mode's fields, each once, in registration order (their flat keys)."""
    return list(dict.fromkeys(name for cls in _registered().values() for name in field_names(cls)))


def budget_keys() -> list[str]:
    """The keys a `budget` section may hold: `mode` and every mode's fields."""
    return ["mode", *budget_field_names()]


def field_names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))


def mode_words(modes: list[str]) -> str:
    return " or ".join(setting("budget_mode", m) for m in modes)


def inferred_mode(fields_: Mapping[str, Any]) -> str | None:
    """The mode that budget fields given without one select: the default mode if it has them all, else the
    one mode that does (None without fields). Fields of no common mode are refused, naming their modes."""
    if not fields_:
        return None
    refuse_unknown("budget", fields_, budget_keys())
    holders = [m for m, cls in _registered().items() if set(fields_) <= set(field_names(cls))]
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
    mode = section.pop("mode", None)  # (None, YAML's `mode:` left empty: the mode its fields select; '' is refused)
    cls = budget_class(inferred_mode(section) or DEFAULT_MODE if mode is None else mode)
    for name, value in section.items():
        if name not in field_names(cls):
            refuse_unknown("budget", [name], budget_keys())
            owners = modes_of(name)
            fix = flag_setting("budget_mode", owners[0], "sparse_budget_mode")
            raise ValueError(f"{setting(name, value)} is read only in {mode_words(owners)} and would do nothing with "
                             f"{setting('budget_mode', cls.mode)}; pass {fix} with it, or leave {name} unset.")
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
    old = budget.get("mode")
    old = inferred_mode({name: value for name, value in budget.items() if name != "mode"}) if old is None else old
    if top.get("mode") and old and top["mode"] != old:
        defaults = {**dataclasses.asdict(Scoring()), **budget_class(old).scoring}
        budget = {}
        scoring = {name: value for name, value in scoring.items() if value != defaults.get(name)}
    return {"budget": {**budget, **top}, "scoring": {**scoring, **upper.get("scoring", {})}}


def scoring_from(section: Mapping[str, Any] | Scoring, budget: BudgetSection) -> Scoring:
    """The scoring of a `scoring` section: its fields over the ones `budget` was measured with."""
    if isinstance(section, Scoring):
        return section
    refuse_unknown("scoring", section, field_names(Scoring))
    return Scoring(**{**budget.scoring, **section})


def refuse_unknown(section: str, names: Iterable[str], known: Iterable[str]) -> None:
    """Raise ValueError naming the first of `names` that the `section` does not have, and listing those it has."""
    known = list(known)
    unknown = [name for name in names if name not in known]
    if unknown:
        raise ValueError(f"Unknown {section} key {unknown[0]!r}{close_keys(unknown[:1], known)}; the {section} "
                         f"section's keys: {list(known)}.")


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


def _override_key(key: Any) -> Any:
    """A `layer_overrides` key as a saved config.json holds it: a layer index given as an int as its text (JSON keys
    are text: the settings loaded back compared unequal to those saved), any other key as it is."""
    return str(key) if isinstance(key, int) and not isinstance(key, bool) else key


def parsed_overrides(overrides: Any) -> Any:
    """`layer_overrides` given as JSON text, parsed (None for blank text); a mapping with its layers' section objects
    (`budget=TopK(...)`, `scoring=Scoring(...)`) as the mappings of what they hold (`section_mapping`) and its int
    keys as text (`_override_key`), as a saved config.json holds them (json cannot write the objects: saving a model
    so configured failed); any other value as it is."""
    if isinstance(overrides, dict):
        keys = [_override_key(key) for key in overrides]
        twice = sorted({key for key in keys if keys.count(key) > 1})
        if twice:
            raise ValueError(f"layer_overrides names layer {twice[0]} twice (as {twice[0]} and {twice[0]!r}): merge "
                             "their fields under one key.")
        return {key: {name: section_mapping(name, value) if isinstance(value, FileConfig) else value
                      for name, value in fields_.items()} if isinstance(fields_, dict) else fields_
                for key, fields_ in zip(keys, overrides.values())}
    if not isinstance(overrides, str):
        return overrides
    try:
        return json.loads(overrides, object_pairs_hook=unique_json_pairs) if overrides.strip() else None
    except (json.JSONDecodeError, KeyGivenTwice) as e:
        raise ValueError(
            f"layer_overrides is not valid JSON ({e}); pass e.g. '{{\"0-1\": {{\"pattern\": \"dense\"}}}}'"
        ) from None
