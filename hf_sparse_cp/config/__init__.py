"""The configuration tree and the files behind it.

* `sparse_attention.py`: `SparseAttentionConfig`, the pattern's settings (a tree: fields, a `budget` and a
  `scoring` section), and the names the plugin is known by;
* `sections.py`: the sections (`Scoring`, `BudgetSection`, the base the budget modes register under);
* `flat_keys.py`: the flat keys of files, flags and saved configs of every earlier version, put into the tree;
* `files.py`: `FileConfig`, the YAML / JSON files behind every config (`--sparse_config`), the one merge rule
  (a flag given beats the file) and the field type checks;
* `model_fields.py`: fields of a transformers model config that training and the predictions both read;
* `registries.py`: how a plug-in (an attention engine, a budget mode, a CP mode) joins its registry and how a setting
  naming one is checked, and the engines' registry.
"""

from .files import FileConfig, check_field_types, read_mapping
from .model_fields import language_config
from .sparse_attention import (
    BACKEND_NAME,
    MODEL_CONFIG_ATTRIBUTE,
    SparseAttentionConfig,
    check_block_size,
    pattern_holders,
)

__all__ = [
    "BACKEND_NAME",
    "MODEL_CONFIG_ATTRIBUTE",
    "FileConfig",
    "SparseAttentionConfig",
    "check_block_size",
    "check_field_types",
    "language_config",
    "pattern_holders",
    "read_mapping",
]
