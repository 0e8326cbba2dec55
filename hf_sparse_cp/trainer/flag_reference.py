"""The flag reference page (docs/flags.md), generated from the argument classes' own help text.

    python -m hf_sparse_cp.trainer.flag_reference > docs/flags.md

`tests/unit/test_flag_names.py` fails when the page differs from what this prints.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

from ..config import SparseAttentionConfig
from ..distributed import ContextParallelConfig
from .arguments import PATTERN_PREFIX, SMETArguments, SparseCPArguments
from .curriculum import CurriculumArguments
from .sparse_trainer import LENGTH_FIELD, SparseTrainingArguments

# (title, what the group does, the dataclass, its command-line prefix)
GROUPS = (
    ("Switches", "The backend, its config file, the loss and the logging (`SparseCPArguments`).",
     SparseCPArguments, ""),
    ("Sparse pattern", "Each `SparseAttentionConfig` field `<f>` as `--sparse_<f>`; a `--sparse_config` YAML/JSON "
     "file uses the plain field names, and pattern flags given on the command line or in a recipe override it.",
     SparseAttentionConfig, PATTERN_PREFIX),
    ("Context parallelism", "`ContextParallelConfig`.", ContextParallelConfig, ""),
    ("Context-length curriculum", "`CurriculumArguments`.", CurriculumArguments, ""),
    ("SMET", "The sparse optimizer (`SMETArguments`): `--smet` and each `SMETConfig` field `<f>` as `--smet_<f>`; a "
     "`--smet_config` file uses the plain field names.", SMETArguments, ""),
)


def _default(field: dataclasses.Field) -> str:
    value: Any = field.default
    if value is dataclasses.MISSING and field.default_factory is not dataclasses.MISSING:
        value = field.default_factory()
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "on" if value else "off"
    return f"`{value}`"


def _row(name: str, default: str, help_text: str) -> str:
    return f"| `--{name}` | {default} | {help_text.replace('|', '/')} |"


def flag_reference() -> str:
    """The markdown of docs/flags.md: every plugin flag of `SparseTrainingArguments`, with its default and help."""
    defaults = {f.name: f for f in dataclasses.fields(SparseTrainingArguments)}
    lines = ["# Flag reference", "",
             "Generated from the argument classes' help text by `python -m hf_sparse_cp.trainer.flag_reference > "
             "docs/flags.md`; do not edit by hand.", "",
             "`SparseTrainingArguments` (and `SparseSFTConfig`) are the Trainer's (or TRL's `SFTConfig`'s) arguments "
             "plus the flags below, so a recipe file, `HfArgumentParser` and `accelerate launch` take them as any "
             "Trainer flag. Every plugin flag starts with `sparse_`, `cp_` or `smet_`. The defaults are "
             "`SparseTrainingArguments`' (`--sparse_attention` is on there: the class is the switch).", "",
             "| flag | default | what it does |", "|---|---|---|",
             _row(LENGTH_FIELD, _default(defaults[LENGTH_FIELD]), defaults[LENGTH_FIELD].metadata["help"]), ""]
    for title, about, cls, prefix in GROUPS:
        lines += [f"## {title}", "", about, "", "| flag | default | what it does |", "|---|---|---|"]
        for f in dataclasses.fields(cls):
            name = prefix + f.name
            lines.append(_row(name, _default(defaults[name]), f.metadata["help"]))
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.stdout.write(flag_reference())
