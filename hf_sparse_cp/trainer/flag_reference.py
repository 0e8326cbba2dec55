"""The flag reference page (docs/flags.md), generated from the argument classes' own help text.

    python -m hf_sparse_cp.trainer.flag_reference > docs/flags.md

`tests/unit/test_flag_names.py` fails when the page differs from what this prints.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

from ..distributed import ContextParallelConfig
from .arguments import SMETArguments, SparseAttentionFlags, SparseCPArguments
from .plugin_arguments import COMMON_FLAGS, LENGTH_FIELD
from .schedule import CurriculumArguments
from .sparse_trainer import SparseTrainingArguments

# (title, what the group does, the dataclass of its flags)
GROUPS = (
    ("Switches", "The backend, its config file, the loss and the logging (`SparseCPArguments`).", SparseCPArguments),
    ("Sparse pattern", "Each flat key `<k>` of `SparseAttentionConfig` as `--sparse_<k>`: its fields, and its `budget` "
     "and `scoring` sections' fields (`budget_mode`, then every mode's own). A `--sparse_config` YAML/JSON file "
     "holds them as sections (`budget: {mode: topk, vertical_topk: 1024}`) or under the flat keys, and pattern "
     "flags given on the command line or in a recipe override it.", SparseAttentionFlags),
    ("Context parallelism", "`ContextParallelConfig`.", ContextParallelConfig),
    ("Context-length curriculum", "`CurriculumArguments`.", CurriculumArguments),
    ("SMET", "The sparse optimizer (`SMETArguments`): `--smet` and each `SMETConfig` field `<f>` as `--smet_<f>`; a "
     "`--smet_config` file uses the plain field names.", SMETArguments),
)
HEADER = ["| flag | default | what it does |", "|---|---|---|"]


def _default(field: dataclasses.Field) -> str:
    value: Any = field.default
    if value is dataclasses.MISSING and field.default_factory is not dataclasses.MISSING:
        value = field.default_factory()
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "on" if value else "off"
    return f"`{value}`"


def _row(field: dataclasses.Field) -> str:
    return f"| `--{field.name}` | {_default(field)} | {field.metadata['help'].replace('|', '/')} |"


def flag_reference() -> str:
    """The markdown of docs/flags.md: every plugin flag of `SparseTrainingArguments`, with its default and help,
    the common ones first."""
    fields = {f.name: f for f in dataclasses.fields(SparseTrainingArguments)}
    groups = [(title, about, [fields[f.name] for f in dataclasses.fields(cls)]) for title, about, cls in GROUPS]
    lines = ["# Flag reference", "",
             "Generated from the argument classes' help text by `python -m hf_sparse_cp.trainer.flag_reference > "
             "docs/flags.md`; do not edit by hand.", "",
             "`SparseTrainingArguments` (and `SparseSFTConfig`) are the Trainer's (or TRL's `SFTConfig`'s) arguments "
             "plus the flags below, so a recipe file, `HfArgumentParser` and `accelerate launch` take them as any "
             "Trainer flag. Every plugin flag starts with `sparse_`, `cp_` or `smet` (`--smet`, `--smet_*`). The "
             "defaults are "
             "`SparseTrainingArguments`' (`--sparse_attention` is on there: the class is the switch). A flag that "
             "the run's other settings leave unread is refused as the flags parse, naming the flag to drop or the "
             "one to add (--sparse_estimation_chunk without --sparse_estimation causal_chunks, --cp_planner_* "
             "without --cp_sharding document, --smet_* without --smet; the first two typed at their default value "
             "too, and in a SparseAttentionConfig or ContextParallelConfig built in code), and so is an attention "
             "engine the run's device cannot train with; pattern flags with --sparse_attention false, and budget or "
             "scoring flags on a dense pattern, are taken with a warning that they have no effect (a recipe's dense "
             "baseline). `hf-sparse-cp launch` checks the plugin flags before and after the script path (on the CPU "
             "with the script's `--use_cpu`) before it starts any process, and the keys of TRL's `--config` file too "
             "where the script's source calls `parse_args_and_config()` without arguments of its own (so reads the "
             "file from its command line); for any other script, each process checks the keys its TRL parser read "
             "from the file, as it parses its arguments. "
             "In code, the base config of a `cp_schedule` whose later stage shards by document takes the planner "
             "costs through `hf_sparse_cp.schedule_cp_config(cp_schedule, ...)`.",
             "",
             "## Common flags", "",
             "The few flags a run usually sets (each argument class names its own in `COMMON_FLAGS`). Every other "
             "flag is expert: its default serves unless a measurement says otherwise (CONTRIBUTING.md says how a "
             "knob becomes a flag).", "", *HEADER, _row(fields[LENGTH_FIELD])]
    lines += [_row(f) for _, _, group in groups for f in group if f.name in COMMON_FLAGS]
    lines += ["", "## Expert flags", ""]
    for title, about, group in groups:
        lines += [f"### {title}", "", about, "", *HEADER, *(_row(f) for f in group if f.name not in COMMON_FLAGS), ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.stdout.write(flag_reference())
