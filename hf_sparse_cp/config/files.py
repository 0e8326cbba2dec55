"""YAML/JSON files behind the plugin's config dataclasses (and the example's recipes), and the type
check those dataclasses run on their fields."""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import functools
import json
import logging
import types
import typing
from collections.abc import Collection, Mapping, Sequence
from contextvars import ContextVar
from pathlib import Path
from typing import Any, ClassVar, Literal

import yaml

from ..close_names import closest_names
from ..scoped import scoped

logger = logging.getLogger(__name__)


def adapter_base(adapter_config: str | Path) -> str | None:
    """The base model a PEFT adapter's adapter_config.json names (`base_model_name_or_path`); None where it names
    none or the file is not a readable JSON mapping."""
    try:
        data = json.loads(Path(adapter_config).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    base = data.get("base_model_name_or_path") if isinstance(data, dict) else None
    return base if isinstance(base, str) and base else None


class KeyGivenTwice(ValueError):
    """A key given twice in one mapping of JSON text."""


def unique_json_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object's pairs as a dict (`json.loads`' object_pairs_hook), refusing a key given twice (json keeps the
    last without a word)."""
    data: dict[str, Any] = {}
    for key, value in pairs:
        if key in data:
            raise KeyGivenTwice(f"key {key!r} is given twice in one mapping ({value_text(data[key])} and "
                            f"{value_text(value)}): keep one")
        data[key] = value
    return data


class _UniqueKeyLoader(yaml.SafeLoader):
    """`yaml.safe_load`'s loader, refusing a key given twice in one mapping (PyYAML keeps the last without a word,
    so the first value a user wrote was dropped); keys a merge (`<<: *anchor`) brings in may still be replaced."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            lines: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=deep)
                if isinstance(key, typing.Hashable):
                    if key in lines:
                        raise yaml.constructor.ConstructorError(
                            "while constructing a mapping", node.start_mark,
                            f"found key {key!r} again (first on line {lines[key]}): keep one", key_node.start_mark)
                    lines[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


def read_mapping(path: str | Path, what: str = "fields", kind: str = "Config file") -> dict[str, Any]:
    """The mapping stored in a .yaml/.yml or .json file; clear errors, naming the file (as `kind`), for a
    missing file, another suffix, a syntax error, a key given twice in one mapping, an empty file (or one of
    comments only: a mistake, which read as every default), or content that is not a mapping (`what` names the
    expected keys in those errors)."""
    given, path = str(path), Path(path)
    if not path.is_file():  # ('' is the working folder: named as given)
        raise FileNotFoundError(f"{kind} {given!r} " + ("is a folder, not a file (give the file's path)."
                                                        if path.is_dir() else "does not exist."))
    if path.suffix not in (".yaml", ".yml", ".json"):
        raise ValueError(f"{kind} {str(path)!r} must end in .yaml, .yml or .json.")
    try:
        with path.open(encoding="utf-8") as stream:  # (a stream, so that YAML's error marks name the file and line)
            if path.suffix != ".json":
                data = yaml.load(stream, Loader=_UniqueKeyLoader)  # (safe_load's loader, keys checked)
            else:
                data = json.load(stream, object_pairs_hook=unique_json_pairs) if path.stat().st_size else None
    except (json.JSONDecodeError, yaml.YAMLError, KeyGivenTwice) as e:
        raise ValueError(f"{kind} {str(path)!r} is not valid {path.suffix[1:].upper()}: {e}") from None
    except UnicodeDecodeError:  # (a weights file under a config's name: the decoder's message names neither)
        raise ValueError(f"{kind} {str(path)!r} is not valid {path.suffix[1:].upper()}: not UTF-8 text (a binary "
                         f"file?); give the {what} as a .yaml or .json text file.") from None
    if data is None:
        raise ValueError(f"{kind} {str(path)!r} is empty (or holds only comments): write the {what} it should set in "
                         "it ({} to keep every default), or do not pass it.")
    if not isinstance(data, dict):
        raise ValueError(f"{kind} {str(path)!r} must hold a mapping of {what}.")
    return data


@functools.cache
def _field_types(cls: type) -> dict[str, Any]:
    """The resolved annotations of dataclass `cls` (cached: a config is built for every layer)."""
    return typing.get_type_hints(cls)


def _matches(value: Any, annotation: Any) -> bool:
    """Whether `value` has the type `annotation` describes: the annotations of the config dataclasses
    (bool, int, float, str, Literal[...], unions with None, list[X], dict); an int is a float."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Literal:
        # (by type too: True == 1, but True is not the literal 1)
        return any(type(value) is type(arg) and value == arg for arg in args)
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, arg) for arg in args)
    if annotation is type(None):
        return value is None
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if origin is list:
        return isinstance(value, list) and all(_matches(item, args[0]) for item in value)
    return isinstance(value, origin or annotation)


def _describe(annotation: Any) -> str:
    """What `_matches` accepts, in words."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Literal:
        return "one of " + ", ".join(map(value_text, args))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(arg) for arg in args)
    if origin is list:
        return f"a list of {_describe(args[0])} values"
    words = {type(None): "unset (None, null in YAML/JSON)", bool: "true or false", int: "a whole number",
             float: "a number", str: "text", dict: "a mapping"}
    return words.get(annotation, getattr(annotation, "__name__", str(annotation)))


class UnregisteredVariant(ValueError):
    """A setting names a variant (a budget mode, a CP mode, an attention engine, a SMET mode) that nobody registered
    in this process (`registries.check_registered`), kept as such through a config file's wrapping (`from_section`).
    A launcher that checks a script's flags before the script runs (and registers its plug-ins) leaves such a setting
    to the script's processes."""


def check_field_types(config: Any, names: Collection[str] | None = None) -> None:
    """Raise a ValueError naming the field, its value and what to write instead for the first field of
    the dataclass instance `config` (of those in `names`, default every field) whose value does not
    have the type of its annotation.

    Every plugin dataclass calls this in `__post_init__`, before its value checks, so that a value of
    the wrong type (from a YAML/JSON file, `HfArgumentParser.parse_dict`, or passed directly) is refused
    by name instead of failing later in a comparison, or being used as something else: text such as
    "false" in a boolean field would be true. `HfArgumentParser` already converts command-line text to
    the annotated types, so flags always pass.

    A field the class names in `REGISTERED_FIELDS` (a class attribute) names a registered variant: its Literal lists
    the built-in ones (for typing and the flag reference), while any registered one is valid, so text there is left to
    the class, which checks it against its registry (`registries.check_registered`, naming how to register one; its
    flag reads the registry as it parses: `registries.VariantFlag`).
    """
    types_ = _field_types(type(config))
    registered = getattr(type(config), "REGISTERED_FIELDS", ())
    for f in dataclasses.fields(config):
        if names is not None and f.name not in names:
            continue
        value, annotation = getattr(config, f.name), types_[f.name]
        if _matches(value, annotation) or (f.name in registered and isinstance(value, str)):
            continue
        fix = f"use {_describe(annotation)}"
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if typing.get_origin(annotation) is not Literal and default not in (None, dataclasses.MISSING):
            fix += f", e.g. {setting(f.name, default)} (the default)"
        if isinstance(value, str) and _is_number(value) and _matches(0, annotation):
            fix += ("; this is a number written as text: write it without quotes"
                    + (" (YAML reads an exponent without a dot and a sign, like 1e-3, as text: write 0.001 or "
                       "1.0e-3)" if "e" in value.lower() else ""))
        elif isinstance(value, str) and _matches(True, annotation):
            fix += "; a switch takes true or false without quotes (quoted, YAML and JSON read them as text)"
        raise ValueError(f"{setting(f.name, value)} ({type(value).__name__}) is not valid: {fix}.")


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def close_keys(unknown: Collection[str], known: Collection[str]) -> str:
    """' (did you mean 'a' for 'b'?)' for the keys among `unknown` that are close to one of `known`
    (`closest_names`; those as close as the closest joined by 'or': slash_top is slash_topk or slash_topp), '' for
    none: what an unknown-key error says after naming the keys."""
    guesses = []
    for key in sorted(unknown, key=str):
        close = " or ".join(map(repr, closest_names(str(key), known)))
        if close:
            guesses.append(f"{close} for {key!r}" if len(unknown) > 1 else close)
    return f" (did you mean {', '.join(guesses)}?)" if guesses else ""


def did_you_mean(parser: argparse.ArgumentParser, unknown: Sequence[str], also: Sequence[str] = ()) -> str:
    """'; did you mean --x for --y?' for the flags among `unknown` that are close to one `parser` takes
    (`closest_names`, dashes read as underscores; those as close as the closest joined by 'or'), '' when none is: the
    suffix of an "unrecognized arguments" error. A flag in the other spelling of one the parser takes in one
    spelling only (`--config-file` to a plain argparse `--config_file`) is named with that one. `also`: the options
    that the command running the parser takes besides (the launcher's `--nproc` for `hf-sparse-cp train`'s script)."""
    spellings = [*(option for action in parser._actions for option in action.option_strings), *also]
    options: dict[str, str] = {}  # a flag's name with underscores -> how the parser spells it (the '_' one if both)
    for option in spellings:  # (argparse's own list, then `also`)
        name = option[2:].replace("-", "_")
        if option.startswith("--") and (name not in options or option[2:] == name):
            options[name] = option
    spelt = set(spellings)
    # (a positional argument given as a flag: `plot --run_dir RUN` is named so, not with a flag of a close name)
    positional = {action.dest: action.metavar or action.dest for action in parser._actions if not action.option_strings}
    guesses = []
    for arg in unknown:
        flag = arg.split("=", 1)[0]
        name = flag[2:].replace("-", "_")
        if flag.startswith("--") and flag not in spelt and name in positional:
            guesses.append(f"the value alone for {flag} ({positional[name]} is positional)")
            continue
        close = closest_names(name, options, prefix="--") if flag.startswith("--") and flag not in spelt else []
        if close:
            guesses.append(f"{' or '.join(options[c] for c in close)} for {flag}")
    return f"; did you mean {', '.join(guesses)}?" if guesses else ""


def typed_flags(flags: Mapping[str, Any], defaults: Mapping[str, Any],
                explicit: Collection[str] | None = None) -> dict[str, Any]:
    """The `flags` (name -> value) the user typed: those `explicit` names (whatever their value), or without it
    (None: not known) those whose value differs from `defaults` (a name missing there defaults to unset, None)."""
    if explicit is None:
        return {name: value for name, value in flags.items() if value != defaults.get(name)}
    return {name: value for name, value in flags.items() if name in explicit}


# True inside `plain_settings`: messages write settings as a --cp_schedule stage's fields.
_PLAIN_SETTINGS: ContextVar[bool] = ContextVar("hf_sparse_cp_plain_settings", default=False)


def plain_settings() -> contextlib.AbstractContextManager[None]:
    """Inside the block, the configs' messages write the settings they refuse and the fixes they name as a
    `--cp_schedule` stage's fields give them, `name=value` with the value as typed (`pattern=vertical_slash`): the
    stage syntax takes neither Python's repr (`pattern='vertical_slash'`) nor a flag (`--cp_mode hybrid`)."""
    return scoped(_PLAIN_SETTINGS, True)


def spelled_plainly() -> bool:
    """Whether messages spell settings as a stage's fields now (inside `plain_settings`)."""
    return _PLAIN_SETTINGS.get()


def value_text(value: Any) -> str:
    """A setting's value as config messages write it: Python's repr (`'causal_chunks'`), or in `plain_settings` as
    typed (`causal_chunks`)."""
    return str(value) if spelled_plainly() else repr(value)


def setting(name: str, value: Any) -> str:
    """A config's setting as its messages name it: `name=value` (`estimation='causal_chunks'`; `value_text`)."""
    return f"{name}={value_text(value)}"


def flag_setting(name: str, value: Any = None, flag: str | None = None) -> str:
    """A setting as the messages of the flags' configs name it: its flag `--flag value` (`flag` defaults to `name`;
    where it differs, the setting follows: `--sparse_budget_mode topk (budget_mode='topk')`), without a value the
    flag alone; in `plain_settings` the stage's field (`budget_mode=topk`, `cp_ulysses_size`)."""
    if spelled_plainly():
        return name if value is None else setting(name, value)
    if value is None:
        return f"--{flag or name}"
    return f"--{flag} {value} ({setting(name, value)})" if flag and flag != name else f"--{name} {value}"


def section_setting(section: str, name: str, value: Any) -> str:
    """A section's field as config messages name it: as a file nests it (`budget: {mode: 'topk'}`), or in
    `plain_settings` as a stage gives it (`budget.mode=topk`)."""
    if spelled_plainly():
        return setting(f"{section}.{name}", value)
    return f"{section}: {{{name}: {value!r}}}"


# False inside `unread_fields_checked_by_caller`: configs built there skip their refusal of a value no setting of
# theirs reads (`checks_unread_fields`).
_CHECK_UNREAD: ContextVar[bool] = ContextVar("hf_sparse_cp_check_unread_fields", default=True)


def unread_fields_checked_by_caller() -> contextlib.AbstractContextManager[None]:
    """Inside the block, the configs built do not refuse a field given away from its default that none of their
    settings reads (`SparseAttentionConfig`'s estimation chunk, `ContextParallelConfig`'s planner costs): for a config
    derived from one already checked (a layer's, a curriculum stage's), one stored by a model (it loads as it ran),
    and a run's base config whose `--cp_schedule` stages may read what it does not (the caller checks across them)."""
    return scoped(_CHECK_UNREAD, False)


def checks_unread_fields() -> bool:
    """Whether a config built now refuses fields none of its settings reads (`unread_fields_checked_by_caller`)."""
    return _CHECK_UNREAD.get()


class UnknownKeyError(TypeError, ValueError):
    """A key that a config does not have: a TypeError, as Python's for an unexpected keyword argument, and a
    ValueError, as for an unknown key in a file or mapping."""


class KnownKeywords:
    """Mixin for the plugin's config dataclasses: a keyword argument that is not one of `keywords()` is refused,
    naming the close keys (`close_keys`) and the known ones, where the generated `__init__` would only call it
    unexpected (`SMETConfig(densty=0.1)`). `KIND`: the config's name in the error."""

    KIND: ClassVar[str]

    def __new__(cls, *args: Any, **kwargs: Any):
        known = cls.keywords()
        unknown = [name for name in kwargs if name not in known]
        if unknown:
            raise UnknownKeyError(f"Unknown {cls.KIND} config keys {sorted(unknown)}{close_keys(unknown, known)}; "
                                  f"known keys: {cls.known_keys(known)}.")
        return super().__new__(cls)

    @classmethod
    def known_keys(cls, known: list[str]) -> str:
        """How the error names the `known` keys: all of them (a class with too many to read overrides it)."""
        return str(sorted(known))

    @classmethod
    def keywords(cls) -> list[str]:
        """The keyword arguments the constructor takes: the fields it sets."""
        return [f.name for f in dataclasses.fields(cls) if f.init]


class FileConfig(KnownKeywords):
    """Mixin for config dataclasses: dict and YAML/JSON round trips with unknown keys refused, and the one
    rule by which command-line flags meet a config file (`from_file_and_flags`).

    Subclasses set `FILE_SECTION` (a file may nest the fields under this top-level key) and `KIND` (the
    config's name in error messages). A field holding a `FileConfig` is a section: a nested mapping in files.
    `COMMON_FLAGS`: the fields whose flags are common (listed first; the others are expert); a class, not
    field metadata, says it, as `HfArgumentParser` hands every metadata key of a field to argparse.
    """

    FILE_SECTION: ClassVar[str]
    KIND: ClassVar[str]
    COMMON_FLAGS: ClassVar[tuple[str, ...]] = ()

    def to_dict(self) -> dict[str, Any]:
        return {f.name: (v.to_dict() if isinstance(v := getattr(self, f.name), FileConfig) else copy.deepcopy(v))
                for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]):
        """Build from a mapping; unknown keys are an error that names the close ones and lists the known ones."""
        cls._check_mapping(data)
        return cls(**data)  # (unknown keys are refused by name: `KnownKeywords`)

    @classmethod
    def _check_mapping(cls, data: Any) -> None:
        """Raise TypeError, naming the fix, when `data` (given to `from_dict`) is not a mapping of fields."""
        if not isinstance(data, Mapping):
            raise TypeError(f"{cls.__name__}.from_dict takes a mapping of {cls.KIND} fields (name -> value; {{}} for "
                            f"the defaults), not {type(data).__name__} {data!r}; for a file, use "
                            f"{cls.__name__}.from_file(path).")

    @classmethod
    def from_file(cls, path: str | Path):
        """Load from a .yaml/.yml or .json file (the fields may sit under a top-level `FILE_SECTION` key)."""
        data = read_mapping(path, f"{cls.KIND} fields")
        section = data.get(cls.FILE_SECTION, data)
        if isinstance(section, bool) and len(data) > 1:  # (`smet: true` beside other flags: a recipe's switch)
            others = sorted(set(data) - {cls.FILE_SECTION})
            raise ValueError(f"Config file {str(path)!r} holds flags, as a training recipe does (`{cls.FILE_SECTION}: "
                             f"{json.dumps(section)}` is the flag --{cls.FILE_SECTION}; {', '.join(others[:3])}"
                             f"{', ...' if len(others) > 3 else ''}), not the {cls.KIND} fields: give it as "
                             f"`hf-sparse-cp train --recipe {path}`, and here a file of {cls.KIND} fields.")
        return cls.from_section(section, f"Config file {str(path)!r}")

    @classmethod
    def from_section(cls, value: Any, where: str):
        """Build from the mapping a file or a saved model holds under `FILE_SECTION`; errors start with `where`."""
        if not isinstance(value, Mapping):
            raise ValueError(f"{where}: key {cls.FILE_SECTION!r} holds {value!r}; it must hold a mapping of "
                             f"{cls.KIND} fields (as the plugin saves them, e.g. {{}} for the defaults), or be "
                             "removed.")
        try:
            return cls.from_dict(dict(value))
        except (TypeError, ValueError) as e:
            # (a variant nobody registered yet stays one: a launcher leaves it to the script, which may register it)
            raise (UnregisteredVariant if isinstance(e, UnregisteredVariant) else ValueError)(f"{where}: {e}") from None

    @classmethod
    def stored_on(cls, holder: Any):
        """The config that `holder` (a transformers model config) stores as its attribute `FILE_SECTION`, as
        its config.json saves it; None when it stores none."""
        value = getattr(holder, cls.FILE_SECTION, None)
        if value is None:
            return None
        source = getattr(holder, "name_or_path", "")
        where = (f"Model config {str(Path(source) / 'config.json')!r}" if source and Path(source).is_dir() else
                 f"The model config ({type(holder).__name__})")
        with unread_fields_checked_by_caller():  # (a saved model loads as it ran)
            return cls.from_section(value, where)

    @classmethod
    def from_file_and_flags(cls, path: str | Path | None, flags: Mapping[str, Any],
                            explicit: Collection[str] | None = None):
        """The config from a file and command-line `flags` (name -> value), by one rule: a flag the user typed
        beats the file, a default never does. Without a file, the flags (typed or not) are the config.

        `explicit`: the names of the flags the user typed (on the command line or in a recipe), whatever their
        value (`hf_sparse_cp.trainer.arguments.explicit_fields` finds them for an `HfArgumentParser`); names
        that are not in `flags` are ignored, so one set can serve every config of a parser. Without it (None),
        the flags that differ from their defaults (`flag_defaults`) count as typed: a flag set to its default
        value cannot be told from one not given.
        """
        typed = typed_flags(flags, cls.flag_defaults(), explicit)
        if path is None:
            return cls.layered({name: value for name, value in flags.items() if name not in typed}, typed)
        config = cls.from_file(path)
        if typed:
            logger.info("Command-line %s flags override %s: %s", cls.KIND, path, typed)
            cls._note_unread(path, config, typed)
        return config.replace(**typed)

    @classmethod
    def _note_unread(cls, path: str | Path, config, typed: Mapping[str, Any]) -> None:
        """Say which of the file's values the `typed` flags leave unread beyond those they replace one by one
        (`from_file_and_flags`; none by default)."""

    @classmethod
    def flag_defaults(cls) -> dict[str, Any]:
        """The value of each flag when not given (`from_file_and_flags`): the fields' defaults. A section's
        flags (its fields) default to unset (None), whatever the section holds then."""
        defaults = {f.name: f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
                    for f in dataclasses.fields(cls)}
        return {name: value for name, value in defaults.items() if not isinstance(value, FileConfig)}

    @classmethod
    def layered(cls, lower: Mapping[str, Any], upper: Mapping[str, Any]):
        """The config of `upper`'s values on top of `lower`'s, checked."""
        return cls.from_dict({**lower, **upper})

    def replace(self, **changes: Any):
        """This config with `changes`, checked."""
        return type(self).layered(self.to_dict(), changes)

    def save(self, path: str | Path) -> None:
        """Write as YAML or JSON, chosen by the file suffix."""
        path = Path(path)
        if path.suffix in (".yaml", ".yml"):
            path.write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))
        else:
            path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
