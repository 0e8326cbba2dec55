"""The flat keys of files, flags and saved configs of every earlier version (`budget_mode`, `vertical_topk`,
`last_q`, ...), and where they go in the config tree (`nested`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import Any

from .files import section_setting, setting
from .sections import (
    Scoring,
    budget_class,
    budget_field_names,
    budget_keys,
    budget_modes,
    field_names,
    merged_sections,
    mode_words,
    modes_of,
    parsed_overrides,
    refuse_unknown,
    section_mapping,
)

logger = logging.getLogger(__name__)

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
    flat = {name: value for name, value in flat.items() if value is not None}  # None: unset (flags, saved configs)
    scoring = {name: value for name, value in scoring.items() if value is not None}
    _refuse_given_twice(sections, flat, scoring)
    if "budget_mode" in flat and sections.get("budget") and "mode" not in sections["budget"]:
        sections["budget"] = {"mode": flat["budget_mode"], **sections["budget"]}  # (its fields are the mode's)
    if stored and SAVED_BY_EVERY_VERSION <= {*data, *flat, *scoring}:
        flat = {**BEFORE_ADDED, **flat}
    mode = flat.pop("budget_mode", None)
    if mode is not None:
        own, shared = field_names(budget_class(mode)), set()
        if "layer_overrides" in data:
            data["layer_overrides"], shared = _shared_with_overrides(flat, mode, data["layer_overrides"])
        for name in [name for name in flat if name not in own and (stored or name in shared)]:
            value = flat.pop(name)
            if name not in shared and value not in SAVED_UNREAD.get(name, ()):
                logger.warning("Ignoring %s=%r of a saved sparse attention config: only %s reads it, and this "
                               "config selects budget_mode=%r.", name, value, mode_words(modes_of(name)), mode)
        flat["mode"] = mode
    return {**data, **merged_sections(sections, {"budget": flat, "scoring": scoring})}


def _refuse_given_twice(sections: Mapping[str, Mapping[str, Any]], flat: Mapping[str, Any],
                        scoring: Mapping[str, Any]) -> None:
    """Refuse, naming both, a field that one mapping (a file, a curriculum stage, a constructor call) gives twice
    with two values: a flat key beside its twin in the `budget` or `scoring` section, `budget_mode` beside the
    section's `mode`, or `budget_mode` beside a section holding fields that mode does not have (they would be
    dropped). Across mappings the upper one wins (a flag given beats the file: `merged_sections`)."""
    budget = sections.get("budget", {})
    twins = [(setting(name, value), section_setting("budget", name, budget[name])) for name, value in flat.items()
             if name in budget and budget[name] != value]
    if "budget_mode" in flat and budget.get("mode", flat["budget_mode"]) != flat["budget_mode"]:
        twins.append((setting("budget_mode", flat["budget_mode"]), section_setting("budget", "mode", budget["mode"])))
    nested_scoring = sections.get("scoring", {})
    twins += [(setting(name, value), section_setting("scoring", name, nested_scoring[name]))
              for name, value in scoring.items() if name in nested_scoring and nested_scoring[name] != value]
    if twins:
        first, second = twins[0]
        raise ValueError(f"{first} and {second} give one field two values in one mapping: keep one of them (the "
                         "section's key or the flat one).")
    if isinstance(budget.get("mode"), str):
        # the section's mode before its keys: the fields of a mode nobody registered (yet: a launcher's check, before
        # the script registers it) are its own, and a mode's name is the error to report (`UnregisteredVariant`)
        budget_class(budget["mode"])
    refuse_unknown("budget", budget, budget_keys())
    mode = flat.get("budget_mode")
    others = [name for name in budget if name != "mode" and name not in field_names(budget_class(mode))] \
        if mode is not None and "mode" not in budget else []
    if others:
        owners = modes_of(others[0])
        raise ValueError(f"{setting('budget_mode', mode)} and a budget section holding {others[0]} (read only in "
                         f"{mode_words(owners)}): the section's field would be dropped. Give the mode once, in the "
                         f"section ({section_setting('budget', 'mode', owners[0])}) with its own fields, or drop "
                         f"{others[0]}.")


def _shared_with_overrides(flat: Mapping[str, Any], mode: str, overrides: Any) -> tuple[Any, set[str]]:
    """(`overrides` with the flat budget fields that each override's own budget_mode reads, the names of those
    that `mode` does not read). Only overrides written with flat keys share them."""
    overrides = parsed_overrides(overrides)
    if not isinstance(overrides, dict):
        return overrides, set()
    own, out, shared = field_names(budget_class(mode)), {}, set()
    for key, fields_ in overrides.items():
        other = fields_.get("budget_mode") if isinstance(fields_, dict) else None
        if other in budget_modes() and other != mode:
            inherited = {name: value for name, value in flat.items()
                         if name in field_names(budget_class(other)) and name not in fields_}
            fields_ = {**inherited, **fields_}
            shared |= {name for name in inherited if name not in own}
        out[key] = fields_
    return out, shared
