"""The shipped recipes, installed as `hf_sparse_cp.recipes` (`hf-sparse-cp recipes` lists them).

* `train/*.yaml`: training recipes, `flag: value` pairs of `SparseTrainingArguments` (so
  `HfArgumentParser(SparseTrainingArguments).parse_yaml_file(path)` reads one, and
  `hf-sparse-cp train --recipe NAME` runs one);
* `accelerate/*.yaml`: `accelerate launch --config_file` configurations;
* `pattern/*.yaml`: sparse patterns (`SparseAttentionConfig` files) that `--sparse_config NAME` reads, e.g. `trial`:
  a pattern that stays sparse at the 1K-4K tokens of a trial run.
"""

from __future__ import annotations

import re
from importlib.resources import as_file, files
from pathlib import Path

from ..close_names import closest_names

KINDS = ("train", "accelerate", "pattern")
SUFFIX = ".yaml"
# The files a recipe of flags may be (`hf-sparse-cp train RECIPE_FILE ...`, `--recipe FILE`).
RECIPE_SUFFIXES = (".yaml", ".yml", ".json")


def _folder(kind: str) -> Path:
    with as_file(files(__name__) / kind) as folder:  # a real folder: the package is installed unzipped
        return Path(folder)


def recipe_names(kind: str = "train") -> list[str]:
    """The names of the shipped recipes of `kind` ('train' or 'accelerate'), e.g. 'qwen2.5-3b_32k'."""
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r}: one of {KINDS}.")
    return sorted(path.name.removesuffix(SUFFIX) for path in _folder(kind).glob(f"*{SUFFIX}"))


def recipe_path(name_or_path: str, kinds: tuple[str, ...] = KINDS) -> Path:
    """The file of a recipe: `name_or_path` itself when it is a file, else the shipped recipe of that
    name among `kinds` (in their order; with or without `.yaml`).

    Raises:
        FileNotFoundError: neither a file nor a shipped recipe; the message lists the shipped names.
    """
    path = Path(name_or_path)
    if path.is_file():
        return path
    name = name_or_path.removesuffix(SUFFIX)
    for kind in kinds:
        if name in recipe_names(kind):
            return _folder(kind) / f"{name}{SUFFIX}"
    folder = " (a folder)" if path.is_dir() else ""
    raise FileNotFoundError(f"recipe {name_or_path!r}{folder} is neither a file nor a shipped recipe "
                            f"{_shipped(name_or_path, kinds)}")


def _shipped(name_or_path: str, kinds: tuple[str, ...]) -> str:
    """The end of the refusal of a name that is no file and no shipped recipe of `kinds`: the shipped names, and
    those closest to it (a typo's fix, `closest_names`): the YAML / JSON files in the folder it names (the current
    one for a bare name: pattern.yaml for pattern.yml), then the shipped names."""
    shipped = [name for kind in kinds for name in recipe_names(kind)]
    beside = _files_beside(Path(name_or_path))
    close = [*(beside[name] for name in closest_names(Path(name_or_path).name, beside)),
             *closest_names(name_or_path.removesuffix(SUFFIX), shipped)]
    return (f"({', '.join(shipped)})" + (f"; did you mean {' or '.join(map(repr, close))}?" if close else ";")
            + " `hf-sparse-cp recipes` lists them.")


def _files_beside(path: Path) -> dict[str, str]:
    """{name: the file spelt as `path` is, with its folder} of the recipe files (`RECIPE_SUFFIXES`) in `path`'s
    folder (their names alone are compared: a long folder would make every file in it look alike)."""
    folder = path.parent
    if not folder.is_dir():
        return {}
    return {file.name: file.name if folder == Path() else str(folder / file.name) for file in sorted(folder.iterdir())
            if file.suffix in RECIPE_SUFFIXES and file.is_file()}


def pattern_path(name_or_path: str) -> str:
    """What `--sparse_config` reads: a file of that name, else the shipped pattern of that name (`trial`).

    Raises:
        FileNotFoundError: neither; the message lists the shipped patterns and the closest name.
    """
    try:
        return str(recipe_path(name_or_path, ("pattern",)))
    except FileNotFoundError:
        # (a folder was said not to exist)
        there = "is a folder, not a file" if Path(name_or_path).is_dir() else "does not exist"
        saved = Path(name_or_path) / "config.json"
        if saved.is_file():  # (a saved model's folder: its config.json holds the pattern it trained with, #50)
            raise FileNotFoundError(f"Config file {name_or_path!r} {there}: the pattern a saved model holds is in its "
                                    f"config.json; give {str(saved)!r}.") from None
        raise FileNotFoundError(f"Config file {name_or_path!r} {there}, nor is it a shipped pattern "
                                f"{_shipped(name_or_path, ('pattern',))}") from None


def recipe_summary(path: Path) -> str:
    """The first sentence of the recipe's leading comment (what it is for), joined over the lines it spans; one
    that introduces a command (`...model:` then the command) ends with a full stop."""
    lines = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.startswith("#") or line.startswith("#   "):  # (its end, or a command shown indented)
            break
        lines.append(line.lstrip("# ").strip())
    text = " ".join(lines)
    end = re.search(r"\.(?:\s+(?=[A-Z(`])|$)", text)  # (a full stop: not the one of 2.5, nor of e.g. before a word)
    return text[:end.start() + 1] if end else text.rstrip(":") + "."
