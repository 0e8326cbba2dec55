"""Typed configuration of the sparse attention pattern, and the names the plugin is known by.

`SparseAttentionConfig` is a plain dataclass: every field carries help text, so
`HfArgumentParser` turns it into command-line flags, and `from_file` / `to_dict` round-trip it
through YAML or JSON. Invalid values raise a `ValueError` that says how to fix them.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from .files import FileConfig, check_field_types

logger = logging.getLogger(__name__)

# `attn_implementation` name of the backend, and the model-config attribute that stores its settings.
BACKEND_NAME = "sparse_cp"
MODEL_CONFIG_ATTRIBUTE = "sparse_attention"
# Fields that one budget_mode alone reads: a value given for a mode that no layer selects in would do nothing and
# is refused, naming the mode (an unset budget_mode is 'topk' or 'topp' when that mode's budget is given, else
# 'mass').
MODE_ONLY: dict[str, tuple[str, ...]] = {
    "topk": ("vertical_topk", "slash_topk"),
    "topp": ("vertical_topp", "slash_topp"),
    "mass": ("mass_threshold", "mass_near_blocks"),
}
# The values that versions before the mode-only fields saved for them whatever the mode (`to_dict` writes every
# field): a saved config that holds them for a mode it does not select is read without them.
SAVED_BEFORE: dict[str, Any] = {"vertical_topk": 512, "slash_topk": 1024, "vertical_topp": 0.9, "slash_topp": 0.9,
                                "mass_threshold": 0.0, "mass_near_blocks": 0}
# What the fields left unset (None) take in each budget_mode: the mode-only ones, and the scoring queries ('mass',
# the default, was chosen with 32 last queries and 4 sampled groups; the others keep the last 64 queries alone).
MODE_DEFAULTS: dict[str, dict[str, Any]] = {
    "topk": {"vertical_topk": 512, "slash_topk": 1024, "last_q": 64, "sample_groups": 0},
    "topp": {"vertical_topp": 0.9, "slash_topp": 0.9, "last_q": 64, "sample_groups": 0},
    "mass": {"mass_threshold": 0.0025, "mass_near_blocks": 0, "last_q": 32, "sample_groups": 4},
}


def check_block_size(block_size: int, name: str = "block_size") -> None:
    """Raise ValueError unless `block_size` is a power of two >= 16 (what the layout and kernels take)."""
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"{name}={block_size} must be a power of two >= 16; use 64 or 128.")


@dataclass
class SparseAttentionConfig(FileConfig):
    """How the `sparse_cp` attention backend chooses which keys each query attends to.

    With `pattern="vertical_slash"` (MTraining), every attention call estimates, per query head,
    the key columns (verticals) and diagonals (slashes) that carry the attention mass of the last
    `last_q` queries, and computes exact attention restricted to those blocks and columns.

    The defaults ('mass' budget: mass_target 0.9, mass_threshold 0.0025, at most 1024 columns per head,
    scored by the last 32 queries and 4 groups of 16 along the document; the first layer dense) are the
    sparsest measured setting within 0.5% of dense perplexity at 8K tokens on a pretrained model
    (docs/accuracy.md): 51% of the causal blocks kept where the former top-k defaults kept 67%.
    """

    FILE_SECTION: ClassVar[str] = "sparse_attention"
    KIND: ClassVar[str] = "sparse attention"

    pattern: Literal["vertical_slash", "dense"] = field(
        default="vertical_slash",
        metadata={"help": "Attention pattern: 'vertical_slash' (dynamic sparse, estimated per head at every call) "
                  "or 'dense' (exact causal attention through the same block engine)."},
    )
    budget_mode: Literal["topk", "topp", "mass"] | None = field(
        default=None,
        metadata={"help": "How many verticals / slashes a head keeps (unset: 'topk' when vertical_topk or slash_topk "
                  "is given, 'topp' when vertical_topp or slash_topp is, else 'mass'): 'mass' ranks key columns and "
                  "block diagonals together by estimated attention mass per block of work they add and keeps the "
                  "best until their estimated mass reaches mass_target of the queries' attention, and beyond that "
                  "those with at least mass_threshold of their queries' attention per block (at most vertical_cap "
                  "columns): broad heads keep more, focused heads less; 'topk' keeps a fixed number (vertical_topk, "
                  "slash_topk); 'topp' the smallest set whose normalized score reaches the *_topp mass, capped at "
                  "*_cap."},
    )
    vertical_topk: int | None = field(
        default=None,
        metadata={"help": "Key columns kept per head in 'topk' mode, 512 unless given (sink tokens come on top); "
                  "given without budget_mode it selects 'topk', with another budget_mode it is refused."},
    )
    slash_topk: int | None = field(
        default=None,
        metadata={"help": "Diagonals kept per head in 'topk' mode, 1024 unless given (the local window comes on "
                  "top); given without budget_mode it selects 'topk', with another budget_mode it is refused."},
    )
    vertical_topp: float | None = field(
        default=None,
        metadata={"help": "Cumulative score mass of key columns kept per head in 'topp' mode, 0.9 unless given; "
                  "given without budget_mode it selects 'topp', with another budget_mode it is refused."},
    )
    slash_topp: float | None = field(
        default=None,
        metadata={"help": "Cumulative score mass of diagonals kept per head in 'topp' mode, 0.9 unless given; "
                  "given without budget_mode it selects 'topp', with another budget_mode it is refused."},
    )
    vertical_cap: int = field(default=1024,
                              metadata={"help": "Most key columns a head keeps in 'topp' and 'mass' modes."})
    slash_cap: int = field(default=4096, metadata={"help": "Most diagonals a head keeps in 'topp' mode."})
    mass_target: float = field(
        default=0.9,
        metadata={"help": "In 'mass' mode: the share of each head's estimated attention mass (per document, or per "
                  "chunk with causal_chunks) that its best columns and block diagonals must reach, in (0, 1]: a floor "
                  "that gives broad heads the blocks they need (mass in both a kept column and a kept diagonal counts "
                  "twice, so the mass kept is somewhat lower)."},
    )
    mass_threshold: float | None = field(
        default=None,
        metadata={"help": "In 'mass' mode: beyond mass_target, also keep every column or block diagonal whose "
                  "estimated mass per block of work is at least this share of the attention of the block's queries, "
                  "in [0, 1), 0.0025 unless given: one price of work for every head and layer, so that budget goes "
                  "where a block buys the most mass; 0 keeps mass_target alone. 0.01 is a block holding one "
                  "hundredth of its queries' attention."},
    )
    mass_near_blocks: int | None = field(
        default=None,
        metadata={"help": "In 'mass' mode: n > 0 leaves each query block's n nearest block diagonals (its own and "
                  "n - 1 before it) to serve the keys near it, so that no mass counts twice: a key column is valued "
                  "by the attention of the queries n or more blocks after its own and by that work alone, and the "
                  "block diagonals from n on lose the estimated mass of the kept columns that cross them (else a far "
                  "diagonal that crosses only a heavy kept column, such as the attention sink, looks valuable). 0: "
                  "every column and diagonal valued by all its mass (the default). On CUDA it scores in PyTorch, not "
                  "the Triton scoring kernel."},
    )
    sink_tokens: int = field(
        default=64, metadata={"help": "First tokens of every document always attended to (attention sinks)."}
    )
    local_window: int = field(
        default=128, metadata={"help": "Diagonals next to the main one always kept (local attention), >= 1."}
    )
    last_q: int | None = field(
        default=None,
        metadata={"help": "Number of final queries of each document used to estimate the pattern (unset: 32 in "
                  "'mass' mode, 64 in the others)."},
    )
    sample_groups: int | None = field(
        default=None,
        metadata={"help": "Groups of queries sampled along each document (unset: 4 in 'mass' mode, 0 in the "
                  "others; before each chunk with causal_chunks) "
                  "that estimate the pattern besides the last last_q: the document is cut into sample_groups + 1 "
                  "equal parts, each scored by its last queries (sample_group_size of them, last_q for the last "
                  "part), and each scoring query counts for the queries of its part. Catches the keys that earlier "
                  "queries use; costs about sample_groups x sample_group_size / 2 more scoring rows per document."},
    )
    sample_group_size: int = field(
        default=16, metadata={"help": "Queries per sampled group of sample_groups."}
    )
    estimation: Literal["last_queries", "causal_chunks"] = field(
        default="last_queries",
        metadata={"help": "Which queries choose a query's pattern: 'last_queries' (MTraining: the document's last "
                  "last_q queries, so in teacher-forced training a position's keys depend on later tokens) or "
                  "'causal_chunks' (the document is cut into chunks of estimation_chunk tokens; each chunk's pattern "
                  "comes from the last last_q queries before it and the first chunk is dense, so no query's pattern "
                  "depends on a later token)."},
    )
    estimation_chunk: int = field(
        default=1024,
        metadata={"help": "Tokens per chunk of 'causal_chunks' estimation (a multiple of block_size): smaller chunks "
                  "follow the text more closely but cost more: S / estimation_chunk sets of scores (2 x heads x S "
                  "fp32 values each per row) and of kept columns, and scoring S / (2 x estimation_chunk) times that "
                  "of 'last_queries'. Keep the sets few at long S (e.g. 8192 at 128K)."},
    )
    block_size: int = field(
        default=128, metadata={"help": "Query/key block size of the layout and of the kernels (power of two)."}
    )
    min_seq_len: int = field(
        default=8192,
        metadata={"help": "Documents shorter than this many tokens use dense (causal) attention; longer ones are "
                  "sparse."},
    )
    dense_first_layers: int = field(
        default=1,
        metadata={"help": "Keep the first N decoder layers dense: layer 0's attention is the broadest (on "
                  "SmolLM2-135M it loses the most mass to a top-k budget), 0 makes every layer sparse."},
    )
    attention_engine: Literal["auto", "triton", "flex", "reference"] = field(
        default="auto",
        metadata={"help": "What computes attention over the layout: 'triton' (our kernels), 'flex' (FlexAttention, "
                  "compiled, CUDA for training), 'reference' (PyTorch, any device) or 'auto': the faster of the "
                  "kernels and Flex per call on CUDA from the timing table $HF_SPARSE_CP_ENGINE_TABLE names (the "
                  "kernels without one), the reference elsewhere. $HF_SPARSE_CP_ATTENTION_ENGINE replaces 'auto'. "
                  "Dense calls go to flash-attn where installed, else to SDPA for plain causal rows "
                  "($HF_SPARSE_CP_DENSE_BACKEND)."},
    )
    layer_overrides: dict | str | None = field(
        default=None,
        metadata={"help": "Per-layer field overrides as a mapping (or its JSON text) from a layer index or an "
                  "inclusive range 'a-b' to fields, e.g. '{\"0-1\": {\"pattern\": \"dense\"}, \"27\": "
                  "{\"slash_topk\": 4096}}'."},
    )

    def __post_init__(self) -> None:
        if isinstance(self.layer_overrides, str):
            try:
                self.layer_overrides = json.loads(self.layer_overrides) if self.layer_overrides.strip() else None
            except json.JSONDecodeError as e:
                raise ValueError(
                    f"layer_overrides is not valid JSON ({e}); pass e.g. '{{\"0-1\": {{\"pattern\": \"dense\"}}}}'"
                ) from None
        check_field_types(self)  # (pattern and budget_mode too: their Literal lists the allowed values)
        if self.budget_mode is None:  # a top-k or top-p budget given alone asks for that selection
            asked = [m for m in ("topk", "topp") if any(getattr(self, n) is not None for n in MODE_ONLY[m])]
            if len(asked) > 1:
                raise ValueError(f"{'/'.join(MODE_ONLY['topk'])} and {'/'.join(MODE_ONLY['topp'])} are budgets of two "
                                 "modes; pass --sparse_budget_mode topk or --sparse_budget_mode topp with the one to "
                                 "use, and only its fields.")
            self.budget_mode = asked[0] if asked else "mass"
        self.__dict__.update({name: default for name, default in MODE_DEFAULTS.get(self.budget_mode, {}).items()
                              if getattr(self, name) is None})
        self._validate()

    def _validate(self) -> None:
        check_block_size(self.block_size)
        for name in ("vertical_topk", "slash_topk", "sink_tokens", "dense_first_layers", "min_seq_len",
                     "sample_groups", "mass_near_blocks"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 0.")
        for name in ("vertical_cap", "slash_cap", "last_q", "sample_group_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1.")
        if self.estimation == "causal_chunks" and (
            self.estimation_chunk < self.block_size or self.estimation_chunk % self.block_size
        ):
            fix = max(1, self.estimation_chunk // self.block_size) * self.block_size
            raise ValueError(
                f"estimation_chunk={self.estimation_chunk} must be a positive multiple of block_size={self.block_size} "
                f"(chunks of whole query blocks); e.g. {fix}."
            )
        if self.mass_threshold is not None and not 0.0 <= self.mass_threshold < 1.0:
            raise ValueError(f"mass_threshold={self.mass_threshold} must be in [0, 1): 0 turns it off, 0.001-0.01 are "
                             "usual.")
        for mode, name in _unread_mode_fields(self.budget_mode, self.layer_overrides):
            if getattr(self, name) is not None:
                raise ValueError(
                    f"{name}={getattr(self, name)} is read only in budget_mode={mode!r} and would do nothing with "
                    f"budget_mode={self.budget_mode!r}; pass --sparse_budget_mode {mode} (budget_mode={mode!r}) with "
                    f"it, or leave {name} unset."
                )
        if self.local_window < 1:
            raise ValueError(
                f"local_window={self.local_window} must be >= 1: every query needs its own diagonal; use 1 for "
                "'diagonal only' or the default 128."
            )
        for name in ("vertical_topp", "slash_topp", "mass_target"):
            p = getattr(self, name)
            if p is not None and not 0.0 < p <= 1.0:
                raise ValueError(f"{name}={p} must be in (0, 1]; 0.9 or 0.95 are usual.")
        if self.layer_overrides is not None:
            self._parsed_overrides()

    def _parsed_overrides(self) -> list[tuple[int, int, dict[str, Any]]]:
        """Overrides as (first_layer, last_layer, fields), validated."""
        names = {f.name for f in dataclasses.fields(self)} - {"layer_overrides", "dense_first_layers"}
        parsed = []
        for key, fields_ in self.layer_overrides.items():
            try:
                lo, _, hi = str(key).partition("-")
                first, last = int(lo), int(hi or lo)
            except ValueError:
                raise ValueError(
                    f"layer_overrides key {key!r} is not a layer index or a range 'a-b' (e.g. '0-3')."
                ) from None
            if first > last:
                raise ValueError(
                    f"layer_overrides key {key!r} is a reversed range and would match no layer; write the first "
                    f"layer first: '{last}-{first}'."
                )
            if not isinstance(fields_, dict):
                raise ValueError(f"layer_overrides[{key!r}] must be a mapping of fields, got {fields_!r}.")
            unknown = set(fields_) - names
            if unknown:
                raise ValueError(
                    f"layer_overrides[{key!r}] has unknown fields {sorted(unknown)}; allowed: {sorted(names)}."
                )
            try:  # the layer's whole config, so that a bad value is refused now, not at that layer's first call
                self._layer_config(fields_)
            except ValueError as e:
                raise ValueError(f"layer_overrides[{key!r}]: {e}") from None
            parsed.append((first, last, fields_))
        return parsed

    def check_sparse_at(self, seq_len: int, layers: Iterable[int] | None = None) -> None:
        """Raise ValueError, naming the fix, when layers whose pattern is vertical_slash would run dense on
        every document of up to `seq_len` tokens without saying so: with estimation='causal_chunks', a
        document's first `estimation_chunk` tokens are dense, so a chunk at least as long as the sequence
        makes the whole layer dense. (Documents shorter than `min_seq_len` are dense by choice, and the
        start-up line says so.)

        Args:
            seq_len: the longest training sequence (a curriculum stage's length).
            layers: the indices of the layers that run this config's pattern (`for_layer`); default: the
                config itself, without per-layer settings.
        """
        configs = {i: self.for_layer(i) for i in layers} if layers is not None else {None: self}
        dense = [i for i, cfg in configs.items()
                 if cfg.pattern == "vertical_slash" and cfg.estimation == "causal_chunks"
                 and seq_len >= max(cfg.min_seq_len, 1) and cfg.estimation_chunk >= seq_len]
        if not dense:
            return
        cfg = configs[dense[0]]
        which = ("every layer" if layers is None else
                 f"layer{'s' if len(dense) > 1 else ''} {', '.join(map(str, dense))}")
        fix = max(cfg.block_size, seq_len // 2 // cfg.block_size * cfg.block_size)
        raise ValueError(
            f"estimation_chunk={cfg.estimation_chunk} is not shorter than the {seq_len}-token training sequences: with "
            f"estimation='causal_chunks' the first chunk of a document is dense, so {which} would run dense (kept "
            f"fraction 1.0). Use an estimation_chunk below {seq_len} (a multiple of block_size={cfg.block_size}, e.g. "
            f"{fix}), or estimation='last_queries'."
        )

    def for_layer(self, layer_idx: int | None) -> SparseAttentionConfig:
        """The config one decoder layer uses, with `dense_first_layers` and `layer_overrides` applied."""
        if layer_idx is None or (not self.dense_first_layers and not self.layer_overrides):
            return self
        changes: dict[str, Any] = {}
        if layer_idx < self.dense_first_layers:
            changes["pattern"] = "dense"
        if self.layer_overrides:
            for first, last, fields_ in self._parsed_overrides():
                if first <= layer_idx <= last:
                    changes.update(fields_)
        if not changes:
            return self
        return self._layer_config(changes)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SparseAttentionConfig:
        """Build from a mapping (a saved config, a file's fields). A mapping that names its budget_mode may
        hold the `MODE_ONLY` fields of modes it does not select, as every config saved before they were
        mode-only does: they are dropped (they did nothing there), with a warning for a value other than the
        one those versions saved by default."""
        data = dict(data)
        mode = data.get("budget_mode")
        if mode in MODE_DEFAULTS:
            for other, name in _unread_mode_fields(mode, data.get("layer_overrides")):
                value = data.pop(name, None)
                if value is not None and value != SAVED_BEFORE[name]:
                    logger.warning("Ignoring %s=%r of a saved sparse attention config: only budget_mode=%r reads it, "
                                   "and this config selects %r.", name, value, other, mode)
        return super().from_dict(data)

    @classmethod
    def defaults_for(cls, flags: dict[str, Any]) -> SparseAttentionConfig:
        """The defaults of the budget mode these field values select (its scoring queries, its budgets)."""
        return cls(budget_mode=flags.get("budget_mode"))

    def _layer_config(self, changes: dict[str, Any]) -> SparseAttentionConfig:
        """This config with one layer's changes and no per-layer settings (`replace`: a layer overridden to
        another budget mode drops the fields it does not read)."""
        return self.replace(layer_overrides=None, dense_first_layers=0, **changes)

    def replace(self, **changes: Any) -> SparseAttentionConfig:
        """This config with `changes` (checked). Unlike `dataclasses.replace`, switching budget_mode needs
        no unsetting: the `MODE_ONLY` fields of a mode that neither the new config nor one of its layer
        overrides selects are dropped, and fields at the old mode's default (`MODE_DEFAULTS`) take the new
        mode's, unless the changes set them."""
        mode = changes.get("budget_mode", self.budget_mode)
        for _, name in _unread_mode_fields(mode, changes.get("layer_overrides", self.layer_overrides)):
            changes.setdefault(name, None)
        if mode != self.budget_mode:
            for name, default in MODE_DEFAULTS.get(self.budget_mode, {}).items():
                if getattr(self, name) == default:
                    changes.setdefault(name, None)
        return dataclasses.replace(self, **changes)


def _unread_mode_fields(mode: str, overrides: Any) -> Iterator[tuple[str, str]]:
    """(mode, field) for the `MODE_ONLY` fields that a config selecting budget `mode` with these layer overrides
    never reads: those of the modes that neither it nor an override selects."""
    for other, fields_ in MODE_ONLY.items():
        if other != mode and not _overrides_set(overrides, "budget_mode", other):
            yield from ((other, name) for name in fields_)


def _overrides_set(overrides: Any, name: str, value: Any) -> bool:
    """Whether some entry of `layer_overrides` (a mapping, before validation) sets field `name` to `value`."""
    return isinstance(overrides, dict) and any(isinstance(f, dict) and f.get(name) == value
                                               for f in overrides.values())
