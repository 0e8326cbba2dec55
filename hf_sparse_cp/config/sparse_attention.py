"""Typed configuration of the sparse attention pattern, and the names the plugin is known by.

`SparseAttentionConfig` is a tree: the fields every pattern shares, a `budget` section (the mode and
its own fields, `hf_sparse_cp.attention.budgets`) and a `scoring` section (`sections.Scoring`). Every
field carries help text (`hf_sparse_cp.trainer.arguments` turns them into flat `--sparse_*` flags);
files, saved models and the constructor take the sections nested or the flat keys of every earlier
version. Invalid values raise a `ValueError` that says how to fix them.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from .files import (
    FileConfig,
    check_field_types,
    checks_unread_fields,
    read_mapping,
    setting,
    spelled_plainly,
    unread_fields_checked_by_caller,
    value_text,
)
from .flat_keys import nested
from .model_fields import language_config
from .registries import ENGINES_SETTING, is_plugin
from .sections import (
    BudgetSection,
    Scoring,
    budget_class,
    budget_field_names,
    budget_from,
    default_budget,
    given_sections,
    merged_sections,
    parsed_overrides,
    scoring_from,
)

logger = logging.getLogger(__name__)
_WARNED_UNREAD: set[tuple[str, str]] = set()

# `attn_implementation` name of the backend, and the model-config attribute that stores its settings.
BACKEND_NAME = "sparse_cp"
MODEL_CONFIG_ATTRIBUTE = "sparse_attention"
_SECTIONS = ("budget", "scoring")


def pattern_holders(model_config: Any) -> list[Any]:
    """The configs that must hold a model's `MODEL_CONFIG_ATTRIBUTE`: the model's and, for a composite model, its
    text config (`language_config`), which its attention layers read as their own."""
    text = language_config(model_config)
    return [model_config] if text is model_config else [model_config, text]


def block_size_name() -> str:
    """How messages name the pattern's block size: a run_clm-style script has a `--block_size` of its own (its sequence
    length), so the plugin's flag is named beside the field; a --cp_schedule stage's field alone (`plain_settings`)."""
    return "block_size" if spelled_plainly() else "block_size (--sparse_block_size)"


MIN_BLOCK_SIZE = 16  # the smallest block the layout and the kernels take (a tensor-core tile's side)


def check_block_size(block_size: int, name: str | None = None) -> None:
    """Raise ValueError unless `block_size` is a power of two >= 16 (what the layout and kernels take); `name`: how
    the message names it (default `block_size_name`)."""
    if block_size < MIN_BLOCK_SIZE or block_size & (block_size - 1):
        raise ValueError(f"{name or block_size_name()}={block_size} must be a power of two >= {MIN_BLOCK_SIZE}; use 64 "
                         "or 128.")


@dataclass(init=False)
class SparseAttentionConfig(FileConfig):
    """How the `sparse_cp` attention backend chooses which keys each query attends to: with
    `pattern="vertical_slash"` (MTraining) every call estimates, per query head, the key columns and
    diagonals that carry its scoring queries' attention mass, and the budget decides how many it keeps.
    The defaults ('mass', 32 last queries and 4 groups of 16, layer 0 dense) are the sparsest measured
    setting within 0.5% of dense perplexity at 8K tokens (docs/accuracy.md).

    Keywords: one per field (`budget`, `scoring`: a section or its mapping; a partial scoring goes over
    the budget's own), or flat keys as files of every version hold them (`vertical_topk=1024`,
    `budget_mode="topp"`, `last_q=64`; `flat_keys.nested`).
    """

    FILE_SECTION: ClassVar[str] = "sparse_attention"
    KIND: ClassVar[str] = "sparse attention"
    COMMON_FLAGS: ClassVar[tuple[str, ...]] = ("budget_mode", "block_size", "min_seq_len")
    # (its Literal lists the built-in engines; any registered engine is valid: `_check_engine`, its flag's
    # `registries.VariantFlag`)
    REGISTERED_FIELDS: ClassVar[tuple[str, ...]] = ("attention_engine",)

    pattern: Literal["vertical_slash", "dense"] = field(
        default="vertical_slash",
        metadata={"help": "Attention pattern: 'vertical_slash' (dynamic sparse, estimated per head at every call) "
                  "or 'dense' (exact causal attention through the same block engine)."},
    )
    budget: BudgetSection = field(
        default_factory=default_budget,
        metadata={"help": "How many verticals / slashes a head keeps: a `budget:` section with its `mode` and "
                  "that mode's fields only (flat: budget_mode and the fields)."},
    )
    sink_tokens: int = field(
        default=64, metadata={"help": "First tokens of every document always attended to (attention sinks)."}
    )
    local_window: int = field(
        default=128, metadata={"help": "Diagonals next to the main one always kept (local attention), >= 1."}
    )
    scoring: Scoring = field(
        default_factory=Scoring,
        metadata={"help": "Which queries estimate the pattern: a `scoring:` section (flat: its fields); unset "
                  "fields take the budget's own (32 last queries and 4 groups in 'mass' mode)."},
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
                  "int64 sums each per row: 3.7 GB in all for 14 heads at 128K with the default chunk, counted by "
                  "`hf-sparse-cp memory`) and of kept columns, and scoring S / (2 x estimation_chunk) times that of "
                  "'last_queries'. Keep the sets few at long S (e.g. 8192 at 128K)."},
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
    attention_engine: Literal["auto", "triton", "flex", "reference", "masked"] = field(
        default="auto",
        metadata={"help": "What computes attention over the layout: 'triton' (our kernels, CUDA), 'flex' "
                  "(FlexAttention, compiled, CUDA for training), 'reference' (PyTorch, any device), 'masked' "
                  "(PyTorch, any device: dense arithmetic with the layout as a mask, no work saved; faster than the "
                  "reference on a CPU at a few thousand tokens; named only) or 'auto': on CUDA the kernels for "
                  "layouts with key columns (vertical-slash), and for those without the faster of the kernels and "
                  "Flex from the timing table $HF_SPARSE_CP_ENGINE_TABLE names (the kernels without one or without "
                  "a row of the call's head_dim; Flex where "
                  "Triton is not installed); the reference elsewhere. $HF_SPARSE_CP_ATTENTION_ENGINE replaces "
                  "'auto'. Dense calls go to flash-attn where installed, else to SDPA for plain causal rows "
                  "($HF_SPARSE_CP_DENSE_BACKEND).", **ENGINES_SETTING.flag()},
    )
    layer_overrides: dict | str | None = field(
        default=None,
        metadata={"help": "Per-layer field overrides as a mapping (or its JSON text) from a layer index or an "
                  "inclusive range 'a-b' to fields, e.g. '{\"0-1\": {\"pattern\": \"dense\"}, \"27\": "
                  "{\"budget_mode\": \"topk\", \"slash_topk\": 4096}}'. Where keys overlap, the narrower one's "
                  "fields win (a layer's own key over a range's), whatever their order."},
    )

    def __init__(self, **values: Any) -> None:
        values = nested(values)  # (unknown keys were refused by name: `KnownKeywords`, of `keys()`)
        budget = budget_from(values.get("budget", {}))
        self.__dict__.update({f.name: values.get(f.name, f.default) for f in dataclasses.fields(self)},
                             budget=budget, scoring=scoring_from(values.get("scoring", {}), budget))
        self.__post_init__()

    def __post_init__(self) -> None:
        self.layer_overrides = parsed_overrides(self.layer_overrides)
        check_field_types(self)  # (pattern too: its Literal lists the allowed values)
        self._check_engine()
        check_block_size(self.block_size)
        for name in ("sink_tokens", "dense_first_layers", "min_seq_len"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 0.")
        chunk, bs = self.estimation_chunk, self.block_size
        if self.estimation == "causal_chunks" and (chunk < bs or chunk % bs):
            raise ValueError(f"estimation_chunk={chunk} must be a positive multiple of {block_size_name()}={bs} "
                             f"(chunks of whole query blocks); e.g. {max(1, chunk // bs) * bs}.")
        if self.local_window < 1:
            raise ValueError(f"local_window={self.local_window} must be >= 1: every query needs its own diagonal; "
                             "use 1 for 'diagonal only' or the default 128.")
        self._parsed_overrides()
        if checks_unread_fields():  # (a layer's config, a stage's, a saved model's: checked by whoever derives them)
            self.refuse_unread(self.fields_given(), self.layer_configs())

    def _check_engine(self) -> None:
        """Refuse an `attention_engine` that names no registered engine (`engines.register_engine`), naming them."""
        ENGINES_SETTING.check("attention_engine", self.attention_engine)

    @classmethod
    def keys(cls) -> list[str]:
        """Every key a mapping of this config may hold: the fields, and the sections' flat keys."""
        return [f.name for f in dataclasses.fields(cls)] + ["budget_mode", *budget_field_names(),
                                                            *(f.name for f in dataclasses.fields(Scoring))]

    keywords = keys  # (the constructor takes the flat keys too: `KnownKeywords`)

    def _parsed_overrides(self) -> list[tuple[int, int, dict[str, Any]]]:
        """Overrides as (first_layer, last_layer, fields), validated."""
        names = set(self.keys()) - {"layer_overrides", "dense_first_layers"}
        parsed = []
        spelled: dict[tuple[int, int], Any] = {}  # (first, last) -> the key that names those layers
        for key, fields_ in (self.layer_overrides or {}).items():
            try:
                lo, dash, hi = str(key).partition("-")
                first, last = int(lo), int(hi if dash else lo)  # ('0-' is refused: int(''))
            except ValueError:
                raise ValueError(f"layer_overrides key {key!r} is not a layer index or a range 'a-b' (e.g. "
                                 "'0-3').") from None
            if first > last:
                raise ValueError(f"layer_overrides key {key!r} is a reversed range and would match no layer; write "
                                 f"the first layer first: '{last}-{first}'.")
            # two spellings of the same layers ('3' and '03' or '3-3'): which one's fields win would hang on how the
            # keys sort, not on what they say (`_overrides_by_precedence`)
            if (first, last) in spelled:
                raise ValueError(f"layer_overrides keys {spelled[first, last]!r} and {key!r} name the same "
                                 f"layer{'s' if last > first else ''}: merge their fields under one key.")
            spelled[first, last] = key
            if not isinstance(fields_, dict):
                raise ValueError(f"layer_overrides[{key!r}] must be a mapping of fields, got {fields_!r}.")
            if set(fields_) - names:
                raise ValueError(f"layer_overrides[{key!r}] has unknown fields {sorted(set(fields_) - names)}; "
                                 f"allowed: {sorted(names)}.")
            try:  # the layer's whole config, so that a bad value is refused now, not at that layer's first call
                self._layer_config(fields_)
            except ValueError as e:
                raise ValueError(f"layer_overrides[{key!r}]: {e}") from None
            parsed.append((first, last, fields_))
        return parsed

    def _overrides_by_precedence(self) -> list[tuple[int, int, dict[str, Any]]]:
        """The overrides (`_parsed_overrides`) in the order `for_layer` applies them: the widest range first, so that
        where keys overlap a narrower one's fields win (a layer's own key over a range's), of two as wide the one
        that starts later. Not the mapping's order: a saved config.json holds its keys sorted (transformers writes
        them so), and a layer given a range and its own key ran one pattern in training and another once saved and
        loaded ('2-11' then '10' applied '10' last, loaded '10' then '2-11')."""
        keyed = sorted(zip(map(str, self.layer_overrides or {}), self._parsed_overrides()),
                       key=lambda item: (item[1][0] - item[1][1], item[1][0], item[0]))
        return [override for _, override in keyed]

    def check_layers(self, n_layers: int) -> None:
        """Raise ValueError, naming the model's layer count, when a `layer_overrides` key reaches past its layers."""
        for key, (first, last, _) in zip(self.layer_overrides or {}, self._parsed_overrides()):
            if last >= n_layers:
                fix = f"use '{first}-{n_layers - 1}'" if first < n_layers else f"use keys within 0-{n_layers - 1}"
                raise ValueError(f"layer_overrides key {key!r} reaches past the model's {n_layers} layers: {fix}.")

    def check_sparse_at(self, seq_len: int, layers: Iterable[int] | None = None) -> None:
        """Raise ValueError, naming the fix, when vertical_slash layers would run dense on every document of up
        to `seq_len` tokens (the longest training sequence) without saying so: with estimation='causal_chunks'
        a document's first `estimation_chunk` tokens are dense, so a chunk as long as the sequence makes the
        layer dense. `layers`: the layers that run this config (`for_layer`; default: the config itself)."""
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
            f"{setting('estimation', 'causal_chunks')} the first chunk of a document is dense, so {which} would run "
            f"dense (kept fraction 1.0). Use an estimation_chunk below {seq_len} (a multiple of "
            f"{block_size_name()}={cfg.block_size}, e.g. {fix}), or {setting('estimation', 'last_queries')}."
        )

    def layer_configs(self) -> list[SparseAttentionConfig]:
        """The distinct configs this config's layers run (`for_layer`), whatever the model's layer count: one for
        each run of layers that `dense_first_layers` and the `layer_overrides` ranges bound."""
        starts = {0, self.dense_first_layers}
        starts.update(edge for first, last, _ in self._parsed_overrides() for edge in (first, last + 1))
        configs: list[SparseAttentionConfig] = []
        for config in map(self.for_layer, sorted(starts)):
            if config not in configs:
                configs.append(config)
        return configs

    @classmethod
    def read_only_with(cls, key: str) -> dict[str, str]:
        """The settings under which a layer reads flat key `key` (field -> value; {}: always): the budget's and the
        scoring's keys choose a 'vertical_slash' pattern, `estimation_chunk` cuts its 'causal_chunks' estimation."""
        vertical_slash = {"pattern": "vertical_slash"}
        if key == "estimation_chunk":
            return {**vertical_slash, "estimation": "causal_chunks"}
        if key in ("budget_mode", *budget_field_names(), *(f.name for f in dataclasses.fields(Scoring))):
            return vertical_slash
        return {}

    @classmethod
    def refuse_unread(cls, given: Mapping[str, Any], patterns: Sequence[SparseAttentionConfig],
                      spell: Callable[[str, Any], str] = setting, scope: str = "this config") -> list[str]:
        """Raise ValueError, naming the fix, for keys of `given` (flat key -> value) that no config of `patterns` (the
        layers' configs of a config or of a run, `layer_configs`) reads (`reads`) where some layer is sparse: an
        estimation chunk without causal-chunk estimation would be ignored without a word. Where every layer is dense,
        return those keys (they have no effect; a recipe's dense baseline is the recipe with pattern 'dense': the
        caller may say so). `spell(key, value)` writes a setting as the message names it (`key=value`, or a flag);
        `scope` names what the patterns run."""
        unread = [key for key in given if not any(pattern.reads(key) for pattern in patterns)]
        if not unread or all(pattern.pattern == "dense" for pattern in patterns):
            return unread
        needed = cls.read_only_with(unread[0])
        # the fix: the settings no layer has (where each is on some layer, but never all on one: the first)
        missing = [(name, value) for name, value in needed.items()
                   if all(getattr(pattern, name) != value for pattern in patterns)]
        running = "; ".join(f"{name}={' / '.join(sorted({value_text(getattr(pattern, name)) for pattern in patterns}))}"
                            for name, _ in missing)
        same = [key for key in unread if cls.read_only_with(key) == needed]
        them = "them" if len(same) > 1 else "it"
        settings = " and ".join(setting(name, value) for name, value in needed.items())
        fix = " ".join(spell(name, value) for name, value in missing or list(needed.items())[:1])
        has = "it" if len(needed) == 1 else "them all"
        raise ValueError(f"{', '.join(spell(key, given[key]) for key in same)} would be ignored: only a layer with "
                         f"{settings} reads {them}, and no layer of {scope} has {has}"
                         f"{f' ({running})' if running else ''}: drop {them}, or add {fix}.")

    def reads(self, key: str) -> bool:
        """Whether a layer that runs this config reads flat key `key` (`read_only_with`)."""
        return all(getattr(self, name) == value for name, value in self.read_only_with(key).items())

    def for_layer(self, layer_idx: int | None) -> SparseAttentionConfig:
        """The config one decoder layer uses, with `dense_first_layers` and `layer_overrides` applied."""
        if layer_idx is None or (not self.dense_first_layers and not self.layer_overrides):
            return self
        changes: dict[str, Any] = {}
        if layer_idx < self.dense_first_layers:
            changes["pattern"] = "dense"
        for first, last, fields_ in self._overrides_by_precedence():
            if first <= layer_idx <= last:
                changes.update(fields_)
        if not changes:
            return self
        return self._layer_config(changes)

    def _layer_config(self, changes: dict[str, Any]) -> SparseAttentionConfig:
        """This config with one layer's changes and no per-layer settings (a field given for another layer is
        read there: `refuse_unread` looks at every layer's config)."""
        with unread_fields_checked_by_caller():
            return self.replace(layer_overrides=None, dense_first_layers=0, **changes)

    @classmethod
    def stored_on(cls, holder: Any) -> SparseAttentionConfig | None:
        """The settings `holder` (a model config) stores (`FileConfig.stored_on`); settings it cannot read are refused
        naming the fixes: a newer version's keys or a plug-in's budget mode or attention engine (`register_budget`,
        `register_engine`) cannot be read, a model's settings can be replaced (`configure`)."""
        try:
            return super().stored_on(holder)
        except ValueError as e:
            raise ValueError(f"{str(e).removesuffix('.')}. The model's config holds settings this installation cannot "
                             "read: if a newer hf-sparse-cp saved them, upgrade it (a plug-in's budget mode or "
                             "attention engine: register it before the model runs); else store settings of your own "
                             "over them "
                             f"(hf_sparse_cp.configure(model, SparseAttentionConfig(...))), or remove "
                             f"{cls.FILE_SECTION!r} from the config.") from None

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SparseAttentionConfig:
        """Build from a stored mapping (a saved model's config, a file): nested sections or the flat keys of
        any earlier version, which load as they ran (`flat_keys.nested` with `stored`)."""
        cls._check_mapping(data)
        return cls(**nested(data, stored=True))

    @classmethod
    def _note_unread(cls, path, config: SparseAttentionConfig, typed: Mapping[str, Any]) -> None:
        """A budget mode typed over a file's budget of another mode replaces that budget whole (`layered`): warn,
        naming the file's fields of the mode replaced, which the run does not read."""
        mode = typed.get("budget_mode")
        if mode is None or mode == config.budget.mode:
            return
        data = read_mapping(path)
        budget = nested(data.get(cls.FILE_SECTION, data), stored=True).get("budget", {})
        fields = [f"{name}={value!r}" for name, value in budget.items() if name != "mode"]
        if fields and (str(path), mode) not in _WARNED_UNREAD:  # (once: the arguments build their config often)
            _WARNED_UNREAD.add((str(path), mode))
            # (a mode of one's own has no flags: its fields go in the file)
            where = (f"in the file's budget section (mode: {mode}; a budget mode of your own has no flags)"
                     if is_plugin(budget_class(mode)) else "as flags")
            logger.warning("--sparse_budget_mode: budget_mode=%r replaces the %r budget of %s whole: its %s are not "
                           "read (a budget holds one mode's fields); give the %s budget's fields %s, or drop "
                           "--sparse_budget_mode to run the file's.", mode, config.budget.mode, path,
                           ", ".join(fields), mode, where)

    @classmethod
    def layered(cls, lower: Mapping[str, Any], upper: Mapping[str, Any]) -> SparseAttentionConfig:
        """`upper` on top of `lower` (fields, sections or flat keys): a budget mode that `upper` names and
        `lower` does not run replaces `lower`'s budget (`sections.merged_sections`)."""
        lower, upper = nested(lower), nested(upper)
        top = {name: value for name, value in {**lower, **upper}.items() if name not in _SECTIONS}
        return cls(**top, **merged_sections(lower, upper))

    def replace(self, **changes: Any) -> SparseAttentionConfig:
        """This config with `changes`, checked. Of the fields no layer reads, only those `changes` give are refused: one
        this config was given for a setting that `changes` turn off (an estimation chunk, where estimation becomes
        'last_queries') is kept unread, as a layer's config keeps it."""
        with unread_fields_checked_by_caller():
            config = super().replace(**changes)
        if checks_unread_fields():
            config.refuse_unread_changes(changes)
        return config

    def refuse_unread_changes(self, changes: Mapping[str, Any], scope: str = "this config") -> None:
        """`refuse_unread` for the fields of this config that `changes` (those of `replace`) gave; `scope` names
        what gave them (a `--cp_schedule` stage: "this stage")."""
        self.refuse_unread({k: v for k, v in self.fields_given().items() if k in changes}, self.layer_configs(),
                           scope=scope)

    def fields_given(self) -> dict[str, Any]:
        """The fields (not the sections) that differ from their defaults: those `refuse_unread` looks at."""
        return {name: value for name, value in self.given().items() if name not in _SECTIONS}

    def given(self) -> dict[str, Any]:
        """The values that differ from the defaults (the budget's for its fields and the scoring), as a
        mapping for `layered`: what a config built in code gave, a default being told from no value."""
        defaults = type(self).flag_defaults()
        return {**{name: value for name, value in self.to_dict().items()
                   if name in defaults and value != defaults[name]}, **given_sections(self.budget, self.scoring)}
