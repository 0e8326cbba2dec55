"""YAML/JSON files behind the plugin's config dataclasses (and the example's recipes)."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any, ClassVar

import yaml

logger = logging.getLogger(__name__)


def read_mapping(path: str | Path, what: str = "fields") -> dict[str, Any]:
    """The mapping stored in a .yaml/.yml or .json file; clear errors, naming the file, for a missing
    file, another suffix, a syntax error, or content that is not a mapping (`what` names the
    expected keys in that error)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"Config file {str(path)!r} does not exist.")
    if path.suffix not in (".yaml", ".yml", ".json"):
        raise ValueError(f"Config file {str(path)!r} must end in .yaml, .yml or .json.")
    text = path.read_text()
    try:
        data = json.loads(text) if path.suffix == ".json" else (yaml.safe_load(text) or {})
    except (json.JSONDecodeError, yaml.YAMLError) as e:
        raise ValueError(f"Config file {str(path)!r} is not valid {path.suffix[1:].upper()}: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"Config file {str(path)!r} must hold a mapping of {what}.")
    return data


class FileConfig:
    """Mixin for config dataclasses: dict and YAML/JSON round trips with unknown keys refused.

    Subclasses set `FILE_SECTION` (a file may nest the fields under this top-level key) and
    `KIND` (the config's name in error messages).
    """

    FILE_SECTION: ClassVar[str]
    KIND: ClassVar[str]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]):
        """Build from a mapping; unknown keys are an error that lists the known ones."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"Unknown {cls.KIND} config keys {sorted(unknown)}; known keys: {sorted(known)}.")
        return cls(**data)

    @classmethod
    def from_file(cls, path: str | Path):
        """Load from a .yaml/.yml or .json file (the fields may sit under a top-level `FILE_SECTION` key)."""
        data = read_mapping(path, f"{cls.KIND} fields")
        if isinstance(data.get(cls.FILE_SECTION), dict):
            data = data[cls.FILE_SECTION]
        try:
            return cls.from_dict(data)
        except (TypeError, ValueError) as e:
            raise ValueError(f"Config file {str(path)!r}: {e}") from None

    @classmethod
    def from_file_and_flags(cls, path: str | Path | None, flags: dict[str, Any]):
        """The config in `path` (the defaults when None) with the `flags` (field -> value, e.g. parsed
        from the command line) that differ from the defaults on top: explicit flags win over the file."""
        default = cls()
        changed = {name: value for name, value in flags.items() if value != getattr(default, name)}
        if path is None:
            return dataclasses.replace(default, **changed)
        config = cls.from_file(path)
        if changed:
            logger.info("Command-line %s flags override %s: %s", cls.KIND, path, changed)
        return dataclasses.replace(config, **changed)

    def save(self, path: str | Path) -> None:
        """Write as YAML or JSON, chosen by the file suffix."""
        path = Path(path)
        if path.suffix in (".yaml", ".yml"):
            path.write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))
        else:
            path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
