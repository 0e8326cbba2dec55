"""Tiny random-init models: a small config of any architecture, for the tests, the smoke benchmarks and the
demo's default model (`--tiny_model_type`)."""

from __future__ import annotations

import contextlib
import copy
import inspect
import math
import re
from itertools import chain

import torch
import transformers
from huggingface_hub.errors import StrictDataclassError
from transformers import CONFIG_MAPPING, AutoConfig, AutoModel, AutoModelForCausalLM, PretrainedConfig

from ..integration.architectures import CONFIG_DROPOUTS, PER_TOKEN_LAYER_TYPES, RECURRENT_LAYER_TYPES


def _derived(config_class: type, name: str) -> bool:
    """Whether `config_class` computes `name` from its other fields (a property without a setter: Falcon's
    `head_dim`), so that it cannot be given."""
    member = inspect.getattr_static(config_class, name, None)
    return isinstance(member, property) and member.fset is None


def _attends(layer_types) -> bool:
    """Whether a config's `layer_types` include an attention layer: a kind that neither mixes tokens without attention
    (Mamba, linear attention, convolutions, recurrences) nor treats each token on its own (MLP, experts), as the
    architecture table tells them (Zamba's and Falcon-H1's 'hybrid' layers attend)."""
    return any(kind not in RECURRENT_LAYER_TYPES + PER_TOKEN_LAYER_TYPES for kind in layer_types)


def _layer_kinds(config: PretrainedConfig) -> list:
    """`config.layer_types` (derived or given), or none."""
    try:
        return list(getattr(config, "layer_types", None) or ())
    except Exception:  # (a derived property that fails on these fields)
        return []


def _attention_placements(config_class: type, layers: int):
    """Edits of a hybrid's own fields (read from its defaults) that may place an attention layer last among
    `layers`: a list of layer kinds (Granite-MoE-Hybrid's layer_types, Zamba's layers_block_type, RecurrentGemma's
    repeated block_types) made the family's first token mixer and then an attention kind of its defaults (else
    full_attention); a list of attention layers' indices (Bamba's attn_layer_indices, None by default) made the last;
    a period and an offset of attention layers (Jamba's attn_layer_period, attn_layer_offset) that reach the last
    layer only. The caller keeps the first edit under which the config builds with an attention layer."""
    try:
        defaults = config_class().to_dict()
    except Exception:  # (defaults that do not build: nothing to read)
        return
    known = (*RECURRENT_LAYER_TYPES, *PER_TOKEN_LAYER_TYPES)
    for name, value in defaults.items():
        if (isinstance(value, list) and value and all(isinstance(kind, str) for kind in value)
                and any(kind in known for kind in value)):
            mixer = next(kind for kind in value if kind in known)
            attention = next((kind for kind in value if _attends([kind])), "full_attention")
            yield {name: [mixer] * (layers - 1) + [attention]}
            yield {name: [attention] * layers}  # (Zamba's shared attention ties its later layers to its first one)
    for name, value in defaults.items():
        if ("attn" in name or "attention" in name) and (value is None or isinstance(value, list) and all(
                isinstance(index, int) for index in value)) and any(w in name for w in ("ind", "idx", "ids")):
            yield {name: [layers - 1]}
    for name in defaults:
        period = name.replace("offset", "period")
        if "attn" in name and name.endswith("offset") and isinstance(defaults.get(period), int):
            yield {name: layers - 1, period: layers}


# The fields of every tiny config (`vocab_size` besides). max_position_embeddings: rotary models compute their
# positions, which the long-context demo takes far; `tiny_config` lowers it where tensors are sized by it.
TINY_FIELDS = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=32, max_position_embeddings=1 << 20, rope_theta=10000.0,
                   tie_word_embeddings=True, attention_dropout=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=2)
# A mixture of experts' sizes, for the architectures whose config has them (their defaults are a real model's: Qwen3-MoE
# 128 experts of 768): few, small experts, every one reached by a short sequence, in one routing group (DeepSeek V3's
# 8 groups of 256 experts would split 4 into groups of none).
TINY_EXPERTS = dict(num_experts=4, num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=128,
                    shared_expert_intermediate_size=128, n_group=1, topk_group=1)
# Multi-head latent attention (DeepSeek V2/V3, MiniCPM3, GLM-4 MoE Lite): small ranks, one key/value head per query
# head, queries and keys of 48 (16 of them rotary, the config's head_dim) and values of 32.
TINY_MLA = dict(num_key_value_heads=4, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32, kv_lora_rank=32,
                q_lora_rank=64)


# A decoder's own sizes in the configs that size it apart from the encoder (BART, Marian, Pegasus, Whisper: their
# `*ForCausalLM` builds the decoder alone), taken from the tiny model's fields of the same meaning.
TINY_DECODER = dict(decoder_layers="num_hidden_layers", decoder_attention_heads="num_attention_heads",
                    decoder_ffn_dim="intermediate_size")
# The sizes a family keeps in sub-configs of its own under other names (DBRX's attn_config and ffn_config), taken from
# the tiny model's fields of the same meaning.
TINY_SUB_FIELDS = dict(kv_n_heads="num_key_value_heads", ffn_hidden_size="intermediate_size",
                       moe_num_experts="num_local_experts", moe_top_k="num_experts_per_tok")
# Values such sub-configs take as a family's checkpoints set them: DBRX's bound on queries, keys and values (None by
# default, which its attention passes to torch.clamp as both bounds: a RuntimeError at the first forward).
TINY_SUB_VALUES = dict(clip_qkv=8.0)


def _default_layer_kinds(config_class: type) -> list:
    """The layer kinds `config_class`'s own defaults make (its `layer_types`, where they are a field: RecurrentGemma
    derives them), none where its defaults alone do not build."""
    if not _field_of(config_class, "layer_types"):
        return []
    try:
        return _layer_kinds(config_class())
    except Exception:  # (a config that its defaults alone do not build: nothing to learn from them)
        return []


def _field_of(config_class: type, name: str) -> bool:
    """Whether `config_class` takes a field `name`: an argument of its constructor, under that name or the one its
    `attribute_map` makes it an alias of (LongCat-Flash's num_local_experts: n_routed_experts)."""
    parameters = inspect.signature(config_class.__init__).parameters
    return name in parameters or getattr(config_class, "attribute_map", {}).get(name) in parameters


def _check_language_model_sized(model_type: str, config: PretrainedConfig, hidden_size: int) -> None:
    """Raise ValueError, naming the language model's own type, where `config` keeps its language model in a
    sub-config that the tiny fields did not reach (Gemma 3, Llama 4, Qwen 3.5: a vision-language model's defaults,
    2.7B to 108B parameters built for a 'tiny' model)."""
    try:
        text = config.get_text_config()
    except ValueError:  # (several text sub-configs, MusicGen's text encoder and decoder: none is the one to size)
        return
    if text is config or getattr(text, "hidden_size", hidden_size) == hidden_size:
        return
    raise ValueError(f"tiny model type {model_type!r} keeps its language model in a sub-config (model type "
                     f"{text.model_type!r}) that the tiny model's fields do not reach: it would be built at its full "
                     f"size ({text.num_hidden_layers} layers of {text.hidden_size}, its other towers too). Give the "
                     f"language model's type, --tiny_model_type {text.model_type} (tiny_config({text.model_type!r})), "
                     "or for a vision-language model hf_sparse_cp.testing.tiny_vlms.tiny_vlm_config.")


# What a tiny model may hold: in the tensors sized by its max_position_embeddings (learned or sinusoidal position
# tables, rotary tables, causal buffers of [n, n]), at most a table of 2**16 positions of 128 floats; in all, 256 MiB.
TINY_POSITION_BYTES = 32 << 20
TINY_MODEL_BYTES = 256 << 20
# The fewest positions `tiny_config` gives a model, however large its position-sized tensors (the tests' rows).
MIN_TINY_POSITIONS = 1024


def _meta_tensors(config: PretrainedConfig) -> dict[str, tuple[tuple[int, ...], int]] | None:
    """name -> (shape, bytes per element) of the parameters and buffers (tied ones once) of the model `config`
    builds (its causal LM, else its base model), built on the meta device (no memory, no initialization); None where
    transformers builds none from it (its own error comes when the caller builds it)."""
    config = copy.deepcopy(config)  # (a build sets fields of the config, e.g. its attention implementation)
    auto = next((a for a in (AutoModelForCausalLM, AutoModel) if type(config) in a._model_mapping), None)
    if auto is None:
        return None
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # (the caller's own build says what the architecture warns)
    try:
        with torch.device("meta"):
            model = auto.from_config(config)
    except Exception:
        return None
    finally:
        transformers.logging.set_verbosity(verbosity)
    return {name: (tuple(t.shape), t.element_size()) for name, t in chain(model.named_parameters(),
                                                                          model.named_buffers())}


def _model_error(config: PretrainedConfig) -> Exception | None:
    """What transformers raises building the model of `config` (its causal LM, else its base model) on the meta
    device; None where it builds, or where transformers has no model for it."""
    config = copy.deepcopy(config)
    auto = next((a for a in (AutoModelForCausalLM, AutoModel) if type(config) in a._model_mapping), None)
    if auto is None:
        return None
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        with torch.device("meta"):
            auto.from_config(config)
    except Exception as e:
        return e
    finally:
        transformers.logging.set_verbosity(verbosity)
    return None


def _model_builds(config: PretrainedConfig) -> bool:
    return _model_error(config) is None


def _nbytes(shape: tuple, element: int) -> int:
    return math.prod(shape) * element


class _ModelSize:
    """The bytes of a config's model as a function of its max_position_embeddings `n`: its tensors at the config's
    `n` and at half of it (two builds on the meta device, the second only where a tensor has a dimension of at least
    half of `n`), each dimension that differs taken as linear in `n` (a table of n rows, or n + 2: OPT's offset; a
    causal buffer of [n, n])."""

    def __init__(self, config: PretrainedConfig):
        self.positions = getattr(config, "max_position_embeddings", None)
        self.tensors = _meta_tensors(config)
        self.scaling: dict[str, list[tuple[float, float]]] = {}
        if self.tensors is None or not isinstance(self.positions, int) or self.positions < 2 or not any(
                max(shape, default=0) >= self.positions // 2 for shape, _ in self.tensors.values()):
            return
        half = copy.deepcopy(config)
        half.max_position_embeddings = self.positions // 2
        at_half = _meta_tensors(half) or {}
        step = self.positions - self.positions // 2
        for name, (shape, _) in self.tensors.items():
            other = at_half.get(name, (shape,))[0]
            if other != shape and len(other) == len(shape):
                slopes = [(d - h) / step for d, h in zip(shape, other)]
                self.scaling[name] = [(a, d - a * self.positions) for a, d in zip(slopes, shape)]

    def shapes(self, positions: int | None) -> dict[str, tuple[tuple[int, ...], int]]:
        """name -> (shape, bytes per element) of the model's tensors at `positions`."""
        return {name: (tuple(round(a * positions + b) for a, b in self.scaling[name]) if name in self.scaling else
                       shape, element) for name, (shape, element) in (self.tensors or {}).items()}

    def bytes(self, positions: int | None, sized_by_positions: bool = False) -> int:
        """The model's bytes at `positions`, or of its position-sized tensors only."""
        return sum(_nbytes(*tensor) for name, tensor in self.shapes(positions).items()
                   if name in self.scaling or not sized_by_positions)

    def largest(self, positions: int | None, count: int = 3) -> str:
        """The `count` largest tensors at `positions`, as 'name [shape] (size)'."""
        sized = sorted(((_nbytes(*tensor), name, tensor[0]) for name, tensor in self.shapes(positions).items()),
                       reverse=True)
        return ", ".join(f"{name} {list(shape)} ({_mib(size)})" for size, name, shape in sized[:count])


def _mib(size: int) -> str:
    return f"{size / 2**30:.1f} GiB" if size >= 2**30 else f"{size / 2**20:.{0 if size >= 10 << 20 else 1}f} MiB"


def _positions_given(config_class: type, overrides: dict) -> bool:
    """Whether `overrides` set the config's max_position_embeddings, under its name or an alias (GPT-2's
    n_positions)."""
    alias = getattr(config_class, "attribute_map", {}).get("max_position_embeddings")
    return bool({"max_position_embeddings", alias} & set(overrides))


def _size_fields(config: PretrainedConfig, size: int, overrides: dict) -> list[str]:
    """The integer fields of `config` (its top level) that neither the tiny model's fields nor `overrides` set, whose
    halving makes its model (of `size` bytes) a tenth smaller or more, as 'name=value' (a build on the meta device per
    field of at least 64)."""
    tiny = {"vocab_size", *TINY_FIELDS, *overrides} | {name for name in (*TINY_EXPERTS, *TINY_MLA, *TINY_DECODER)
                                                       if _field_of(type(config), name)}
    tiny |= {getattr(config, "attribute_map", {}).get(name, name) for name in tiny}  # (GPT-2's n_embd: hidden_size)
    found = []
    for name, value in config.to_dict().items():
        if type(value) is not int or value < 64 or name.endswith("_id") or name in tiny:
            continue
        halved = copy.deepcopy(config)
        with contextlib.suppress(Exception):
            halved.update({name: value // 2})
            tensors = _meta_tensors(halved)
            if tensors is not None and sum(_nbytes(*t) for t in tensors.values()) <= 0.9 * size:
                found.append(f"{name}={value}")
    return found


def tiny_config(model_type: str = "qwen2", vocab_size: int = 259, **overrides) -> PretrainedConfig:
    """A small config of any transformers `model_type` (`_tiny_config`'s fields), of a model that stays tiny: where
    the tensors sized by max_position_embeddings (1 << 20 by default: rotary models compute their positions, which the
    long-context demo takes far) would pass `TINY_POSITION_BYTES` (GPT-2's learned table of 2**20 x 128 floats:
    512 MiB; GPT-BigCode's and OpenAI GPT's causal buffers of [n, n]: 1 to 8 TiB), it is the largest power of two
    (from `MIN_TINY_POSITIONS`) whose tensors stay within it, unless an override gives it. A model still larger than
    `TINY_MODEL_BYTES` (measured on the meta device) is a ValueError naming its largest tensors and the fields that
    size them, to override (LongCat-Flash's 512 experts of 2048, BLT's hash embeddings)."""
    config = _tiny_config(model_type, vocab_size, overrides)
    size = _ModelSize(config)
    positions = size.positions
    if size.scaling and not _positions_given(type(config), overrides):
        while positions > MIN_TINY_POSITIONS and size.bytes(positions, sized_by_positions=True) > TINY_POSITION_BYTES:
            positions //= 2
        if positions != size.positions:
            config = _tiny_config(model_type, vocab_size, {**overrides, "max_position_embeddings": positions})
    total = size.bytes(positions)
    if total > TINY_MODEL_BYTES:
        fields = _size_fields(config, total, overrides)
        raise ValueError(
            f"tiny model type {model_type!r} builds a model of {_mib(total)} from the tiny model's fields, more than "
            f"a tiny model's {_mib(TINY_MODEL_BYTES)}: its largest tensors are {size.largest(positions)}. "
            + (f"Its fields {', '.join(fields)} size them: give smaller values as overrides "
               f"(tiny_config({model_type!r}, {fields[0].split('=')[0]}=...))" if fields else
               "Give the fields that size them smaller values as overrides (tiny_config(model_type, field=...))")
            + ", or train another --tiny_model_type (e.g. qwen2, llama, gpt2).")
    return config


def _tiny_config(model_type: str, vocab_size: int, overrides: dict) -> PretrainedConfig:
    """A small config of any transformers `model_type` (GQA 4:2, head_dim 32, 2 layers, no dropout, no sliding
    window: layer_types that default to sliding layers become full attention unless a `sliding_window` is given,
    the window then unused; half of a head's dimensions rotary where the config counts them (`rotary_dim`: CodeGen
    and GPT-J rotate 16 of 32, interleaved); a mixture of experts: `TINY_EXPERTS`; latent attention: `TINY_MLA`; a
    decoder sized apart from its encoder: `TINY_DECODER`; sizes in sub-configs of a family's own: `TINY_SUB_FIELDS`;
    an indexer's scoring heads (Kolibri's) the query heads of one key head; state-space heads (Mamba-2's) that split
    hidden_size * expand in heads of head_dim; a family that takes no full-attention layers (Kolibri): its sliding
    layers with a window no row reaches; a hybrid whose two layers would hold no attention: an
    attention layer last, placed by its own fields (`_attention_placements`); a family whose models hold a layer
    kind only every few layers (Kolibri 1.1's indexed every fifth, Llama 4's full every fourth): a layer of each
    (`_with_every_layer_kind`); a field the family's defaults leave
    unset that its model needs: given (`_repaired_for_its_model`)); any field can be overridden. A field the
    architecture derives from others (Falcon's `head_dim`) is left to it; an override of one it derives otherwise is a
    ValueError that names it, and so is a config transformers refuses to build from these fields, and a type that
    keeps its language model in a sub-config these fields do not reach (a vision-language model's), naming the
    language model's type."""
    fields = dict(TINY_FIELDS, vocab_size=vocab_size)
    fields["sliding_window"] = None
    if model_type not in CONFIG_MAPPING:
        raise ValueError(f"tiny model type {model_type!r} is not a transformers model type (the model_type of a "
                         "config.json): give one such as qwen2, llama or gpt2.")
    config_class = CONFIG_MAPPING[model_type]
    fields.update({name: value for name, value in TINY_EXPERTS.items() if _field_of(config_class, name)})
    if _field_of(config_class, "vocab_size_per_layer_input"):  # (Gemma 3n, Gemma 4: a per-layer embedding table of
        fields["vocab_size_per_layer_input"] = vocab_size  # 262144 rows by default, GiBs in the tiny model)
    # No attention dropout under any of its names (GPT-2's attn_pdrop is 0.1 by default): sparse_cp refuses it.
    fields.update({name: 0.0 for name in CONFIG_DROPOUTS if _field_of(config_class, name)})
    if _field_of(config_class, "rotary_dim"):  # (CodeGen, GPT-J: 64 rotary dimensions by default, wider than a head)
        fields["rotary_dim"] = fields["head_dim"] // 2
    mla = _field_of(config_class, "kv_lora_rank")
    if mla:
        fields.update(TINY_MLA)
    fields.update(overrides)
    for name, field in getattr(config_class, "attribute_map", {}).items():  # (an override under the config's own
        if field in overrides and name not in overrides:  # name, GPT-2's n_positions: it lost to the tiny field's
            fields[name] = fields.pop(field)  # standard name, max_position_embeddings)
    fields.update({name: fields[source] for name, source in TINY_DECODER.items()
                   if _field_of(config_class, name) and name not in overrides})
    sub_fields = _sub_config_fields(config_class, fields, overrides)
    if sub_fields:  # (DBRX sizes ffn_config.hidden_size from d_model before an alias given, hidden_size, reaches it:
        aliases = getattr(config_class, "attribute_map", {})  # its fields under its own names too)
        fields.update({aliases[name]: fields[name] for name in list(fields) if name in aliases}, **sub_fields)
    if _field_of(config_class, "index_num_heads") and "index_num_heads" not in overrides:
        # (Kolibri's indexer scores keys with leading query heads of key head 0, 12 by default: at most 2 here)
        fields["index_num_heads"] = fields["num_attention_heads"] // fields["num_key_value_heads"]
    if (_field_of(config_class, "num_heads") and _field_of(config_class, "expand")
            and not _field_of(config_class, "num_attention_heads") and "num_heads" not in overrides):
        # (Mamba-2: state-space heads of head_dim that split hidden_size * expand, 128 of 64 by default)
        expand = fields.get("expand", getattr(config_class, "expand", 2))
        fields["num_heads"] = fields["hidden_size"] * expand // fields["head_dim"]
    if mla and "head_dim" not in overrides:
        fields["head_dim"] = fields["qk_rope_head_dim"]
    derived = {name for name in fields if _derived(config_class, name)}
    given = {name: value for name, value in fields.items() if name not in derived}
    try:
        config, given, unwindowed = _first_config(model_type, config_class, given, overrides)
    except Exception as e:  # transformers' own checks of this architecture's fields
        raise _build_refusal(model_type, vocab_size, overrides, e) from e
    _check_language_model_sized(model_type, config, fields["hidden_size"])
    layer_types = getattr(config, "layer_types", None) or ()
    if layer_types and not _attends(layer_types) and "layer_types" not in overrides:
        # Hybrids (Qwen3-Next, Qwen3.5, LFM 3) place attention every few layers, none among two of them: the
        # last layer takes the family's attention kind (from its pattern at more layers), so that the model attends
        kinds = [t for t in getattr(AutoConfig.for_model(model_type, **{**given, "num_hidden_layers": 8}),
                                    "layer_types", None) or () if _attends([t])]
        with contextlib.suppress(AttributeError):  # (a family that derives its layer types: left as it builds them)
            if kinds:
                config.layer_types = layer_types = [*layer_types[:-1], kinds[0]]
    if layer_types and not _attends(_layer_kinds(config)):
        # (Bamba, Jamba, Granite-MoE-Hybrid, RecurrentGemma: layer types derived from fields of their own, or
        # defaults with attention nowhere or beyond two layers) one of those fields places it last
        placed = _placed_attention(model_type, config_class, given, overrides)
        if placed:
            config, given = placed
            layer_types = _layer_kinds(config)
    shared = getattr(config, "num_kv_shared_layers", 0)
    if shared and "num_kv_shared_layers" not in overrides and shared >= config.num_hidden_layers:
        # (Gemma 3n: the last 15 of its 35 layers reuse earlier layers' keys and values; of the tiny model's 2 layers,
        # all would, none left to store them: transformers fails to build the model) half the layers share, a field
        # given before layer kinds are chosen, which keep a layer of each kind that stores them
        given = {**given, "num_kv_shared_layers": config.num_hidden_layers // 2}
        config = AutoConfig.for_model(model_type, **given)
    windowless = getattr(config, "sliding_window", None) is None or unwindowed
    config, given = _with_every_layer_kind(model_type, config_class, config, given, overrides, windowless)
    config, given = _repaired_for_its_model(model_type, config_class, config, given, overrides)
    layer_types = _layer_kinds(config) or layer_types
    no_window = config.sliding_window is None or unwindowed
    if no_window and "layer_types" not in overrides and ("sliding_attention" in layer_types
                                                         or "sliding_attention" in _default_layer_kinds(config_class)):
        # Gemma 2/3, Cohere 2, OLMo 3 default to sliding layers, and build a sliding mask even when no layer reads
        # it, which transformers cannot do without a window: every layer full, and a window no layer uses.
        # (Ministral's config makes its layers full when given no window, and its model still builds that mask.)
        # Built again with them where the config takes them: what it derives per layer type (Dory's RoPE
        # parameters, Gemma 4's per-layer settings) then follows them (set afterwards, it did not: KeyError
        # 'full_attention' at the model's build).
        full = {"layer_types": ["full_attention" if t == "sliding_attention" else t for t in layer_types],
                "sliding_window": config.max_position_embeddings}
        if _field_of(config_class, "layer_types"):
            try:
                config = AutoConfig.for_model(model_type, **{**given, **full})
            except StrictDataclassError:  # (its own checks refuse full-attention layers, Kolibri 1.1's: its sliding
                if not unwindowed:  # layers keep the window no row reaches that built it)
                    raise
        else:
            with contextlib.suppress(AttributeError):  # (RecurrentGemma derives them from its block types: its
                config.layer_types = full["layer_types"]  # sliding layers keep a window no row reaches)
            config.sliding_window = full["sliding_window"]
    windowed = {kind for kind in _layer_kinds(config) if "sliding" in kind and kind != "sliding_attention"}
    if windowed and config.sliding_window is None and "sliding_window" not in overrides:
        # (Inkling's 'hybrid_sliding' layers size a relative position bias by their window: a kind the tiny model
        # cannot make full attention, nor give a window of a million positions) the family's default window
        with contextlib.suppress(Exception):
            config = AutoConfig.for_model(model_type, **{**given, "sliding_window": config_class().sliding_window})
    for name in sorted(derived & set(overrides)):
        if getattr(config, name) != overrides[name]:
            raise ValueError(f"{model_type}: {name}={overrides[name]} cannot be set, {config_class.__name__} derives "
                             f"it from its other fields ({name}={getattr(config, name)} here); change those instead "
                             "(e.g. hidden_size and num_attention_heads for head_dim).")
    return config


# Tiny fields a refusal that names them cannot be dropped for: the tiny model's sizes.
_SIZES = ("num_hidden_layers", "hidden_size", "vocab_size", "max_position_embeddings")


def _first_config(model_type: str, config_class: type, given: dict, overrides: dict):
    """(config, the fields that built it, whether they give a window no layer reaches): `given`, else the first
    repair of it under which transformers builds the config: a window no layer reaches (EXAONE-MoE, Laguna: an int
    window only; EXAONE 4, Kolibri: sliding layers need one), the tiny fields its complaint names left at the
    family's defaults where its model then builds (ZAYA routes each token to one expert), an attention layer placed
    last (Zamba's layer kinds, sized for more layers than two). An override is never repaired; the first complaint
    is the one raised."""
    try:
        return AutoConfig.for_model(model_type, **given), given, False
    except Exception as e:
        error = e
    named = [name for name in given if name not in overrides and name not in _SIZES
             and re.search(rf"\b{re.escape(name)}\b", str(error))]
    repairs = [({"sliding_window": given["max_position_embeddings"]}, ())] if "sliding_window" not in overrides else []
    if named:
        repairs.append(({}, named))
    for edit, dropped in repairs:
        fields = {name: value for name, value in {**given, **edit}.items() if name not in dropped}
        with contextlib.suppress(Exception):
            config = AutoConfig.for_model(model_type, **fields)
            if dropped:  # (DBRX without tied embeddings: its model builds once its attention sub-config is repaired)
                config, fields = _repaired_for_its_model(model_type, config_class, config, fields, overrides)
            if not dropped or _model_builds(config):
                return config, fields, "sliding_window" in edit
    placed = _placed_attention(model_type, config_class, given, overrides)
    if placed:
        return (*placed, False)
    raise error


def _placed_attention(model_type: str, config_class: type, given: dict, overrides: dict):
    """(config, fields) of the first of `_attention_placements` (none overridden) under which transformers builds a
    config whose layers attend, and its model; None where none does."""
    layers = given["num_hidden_layers"]
    for edit in _attention_placements(config_class, layers):
        if set(edit) & set(overrides):
            continue
        fields = {**given, **edit}
        with contextlib.suppress(Exception):
            config = AutoConfig.for_model(model_type, **fields)
            kinds = _layer_kinds(config)
            if len(kinds) == layers and _attends(kinds) and _model_builds(config):
                return config, fields
    return None


def _per_layer_fields(config: PretrainedConfig, layers: int) -> dict:
    """name -> value of `config`'s fields that hold one entry per layer (lists of `layers` entries: layer_types,
    Llama 4's no_rope_layers, DeepSeek-V4's mlp_layer_types), but for lists of layer indices (`_layer_indices`)."""
    return {name: value for name, value in config.to_dict().items()
            if isinstance(value, list) and len(value) == layers and not _layer_indices(value, layers)}


def _layer_indices(value, layers: int) -> bool:
    """Whether `value` may list layer indices among `layers` (Llama 4's moe_layers): increasing ints."""
    return (isinstance(value, list) and all(type(i) is int for i in value) and value == sorted(set(value))
            and all(0 <= i < layers for i in value))


def _layer_references(value: list) -> bool:
    """Whether per-layer `value` names a layer for each layer, its own or an earlier one (Kolibri 1.1's
    kv_source_layers), rather than a flag (Llama 4's no_rope_layers)."""
    return (all(type(v) is int and 0 <= v <= i for i, v in enumerate(value))
            and any(v == i >= 2 for i, v in enumerate(value)))


def _layer_kind_pairs(fields: dict, windowless: bool) -> set:
    """(field, kind) of each string entry of `fields` (per-layer lists): the kinds of layer a config holds, sliding
    attention counted as full where the tiny model gives no window (it makes those layers full, or gives them a
    window no row reaches)."""
    full = {"sliding_attention": "full_attention"} if windowless else {}
    return {(name, full.get(kind, kind)) for name, value in fields.items() for kind in value if isinstance(kind, str)}


def _tiny_per_layer_sizes(config: PretrainedConfig, given: dict) -> dict:
    """{field: {layer: {name: value}}} for `config`'s fields that set sizes per layer (Dots 3 Note's
    per_layer_config, its sliding layers' own), each size the tiny model gives (`given`) its tiny value; none where
    none differs."""
    sized = {}
    for name, value in config.to_dict().items():
        if isinstance(value, dict) and value and all(str(i).isdigit() and isinstance(entry, dict)
                                                     for i, entry in value.items()):
            tiny = {int(i): {key: given.get(key, size) for key, size in entry.items()} for i, entry in value.items()}
            if tiny != {int(i): entry for i, entry in value.items()}:
                sized[name] = tiny
    return sized


def _family_depth(config_class: type) -> int | None:
    """The layer count of `config_class`'s defaults (a real model's), None where they do not build or hold none."""
    try:
        depth = getattr(config_class(), "num_hidden_layers", None)
    except Exception:  # (defaults that do not build)
        return None
    return depth if type(depth) is int and depth > 0 else None


def _with_every_layer_kind(model_type: str, config_class: type, config: PretrainedConfig, given: dict,
                           overrides: dict, windowless: bool):
    """(config, fields) whose layers hold each kind of layer the family's models hold (each value of their per-layer
    string lists at the family's depth, `_family_depth`), where the tiny model's layers miss one: its layers are
    those of the family's at the fewest indices that hold every kind (greedy: the earliest layer that adds most),
    each per-layer field taken at those indices and index lists renumbered, at least as many layers as before.
    (Kolibri 1.1 indexes every fifth layer, Llama 4 a full NoPE one every fourth between chunked ones, Inkling
    attends globally every sixth, DeepSeek-V4 interleaves two compressions after two of one: none among two layers,
    so a sweep met them as no such model is.) `config` as it is where a per-layer field or the layer count is
    overridden, the family's depth is unknown, or the edited config or its model does not build."""
    layers = getattr(config, "num_hidden_layers", None)
    per_layer = _per_layer_fields(config, layers) if type(layers) is int else {}
    held = _layer_kind_pairs(per_layer, windowless)
    if not held or {*per_layer, "num_hidden_layers"} & set(overrides):
        return config, given
    depth = _family_depth(config_class)
    if not depth:
        return config, given
    base = {name: value for name, value in given.items() if name not in per_layer or not isinstance(value, list)}
    try:
        deep = AutoConfig.for_model(model_type, **{**base, "num_hidden_layers": depth})
    except Exception:  # (fields the family checks against its depth: left as it builds them)
        return config, given
    deep_fields = _per_layer_fields(deep, depth)
    kinds_at = [_layer_kind_pairs({name: [value[i]] for name, value in deep_fields.items()}, windowless)
                for i in range(depth)]
    needed = set().union(*kinds_at)
    if needed <= held:
        return config, given
    chosen = []
    while needed:
        index = max(range(depth), key=lambda i: (len(kinds_at[i] & needed), -i))
        chosen.append(index)
        needed -= kinds_at[index]
    chosen = sorted(chosen)
    while len(chosen) < layers:  # (the family's first layers that were not chosen)
        chosen = sorted({*chosen, next(i for i in range(depth) if i not in chosen)})
    edit = {name: [value[i] for i in chosen] for name, value in deep_fields.items()}
    for name, value in deep_fields.items():
        if "layer" in name and _layer_references(value):  # (Kolibri 1.1's kv_source_layers: a layer's own or an
            if any(value[i] not in chosen for i in chosen):  # earlier one's keys, renumbered)
                return config, given
            edit[name] = [chosen.index(value[i]) for i in chosen]
    edit.update({name: [j for j, i in enumerate(chosen) if i in value] for name, value in deep.to_dict().items()
                 if "layer" in name and name not in given and _layer_indices(value, depth)})
    fields = {**base, **edit, "num_hidden_layers": len(chosen)}
    with contextlib.suppress(Exception):
        edited = AutoConfig.for_model(model_type, **fields)
        sized = _tiny_per_layer_sizes(edited, given)
        if sized:  # (Dots 3 Note's sliding layers: 64 heads of 256 and ranks of 1024 by default, 40M parameters;
            # its checks refuse the tiny sizes, which keep its two indexed layers)
            fields.update(sized)
            edited = AutoConfig.for_model(model_type, **fields)
        if held <= _layer_kind_pairs(_per_layer_fields(edited, len(chosen)), windowless) and (
                _model_builds(edited) or not _model_builds(config)):
            return edited, fields  # (a model that builds only once later repairs apply: Inkling's window)
    return config, given


def _repaired_for_its_model(model_type: str, config_class: type, config: PretrainedConfig, given: dict,
                            overrides: dict):
    """(config, fields): where transformers builds no model from `config` (on the meta device), the first field a
    family's defaults leave unset that makes it build: a shared-expert count of None (Dots1's, which its model
    multiplies by) 1; layer types of None (LFM2-MoE's, which its model reads) every layer full attention; RoPE
    parameters kept per layer type and given for none (Cohere Compass's: KeyError 'full_attention') the default
    ones for each; a tiny field that a sub-config given tiny fields (`_sub_config_fields`) does not declare and its
    model reads there (DBRX's attention reads attn_config.rope_theta, which its checkpoints keep) given it. `config`
    as it is where it builds or no repair makes it. The model is built only where a repair may apply (a meta build
    took 50 ms, five times a tiny config's own time, on every `tiny_config` call)."""
    kinds = set(_layer_kinds(config))
    rope = getattr(config, "rope_parameters", None)
    repairs = []
    if getattr(config, "n_shared_experts", 0) is None:
        repairs.append({"n_shared_experts": 1})
    if _field_of(config_class, "layer_types") and getattr(config, "layer_types", 0) is None:
        repairs.append({"layer_types": ["full_attention"] * config.num_hidden_layers})
    if isinstance(rope, dict) and kinds and "rope_type" not in rope and not kinds <= set(rope):
        repairs.append({"rope_parameters": {kind: rope.get(kind) or {"rope_type": "default",
                                                                     "rope_theta": given["rope_theta"]}
                                            for kind in sorted(kinds)}})
    sub_configs = [key for key in getattr(config_class, "sub_configs", None) or () if isinstance(given.get(key), dict)]
    error = _model_error(config) if repairs or sub_configs else None
    # (a field the model read of an object that lacks it: DBRX's attention, attn_config.rope_theta)
    unread = error if isinstance(error, AttributeError) and error.obj is not None and error.name in given else None
    for key in sub_configs:
        if unread and type(getattr(config, key, None)) is type(unread.obj):
            repairs.append({key: {**given[key], unread.name: given[unread.name]}})
    repairs = [edit for edit in repairs if not set(edit) & set(overrides)]
    if not repairs or error is None:
        return config, given
    for edit in repairs:
        fields = {**given, **edit}
        with contextlib.suppress(Exception):
            repaired = AutoConfig.for_model(model_type, **fields)
            if _model_builds(repaired):
                return repaired, fields
    return config, given


def _sub_config_fields(config_class: type, fields: dict, overrides: dict) -> dict:
    """{key: {field: value}} for each sub-config of `config_class` that takes `TINY_SUB_FIELDS` (DBRX's attn_config
    and ffn_config), their values those of `fields`, and the `TINY_SUB_VALUES` it takes; none for a sub-config
    `overrides` give."""
    found = {}
    for key, sub_class in (getattr(config_class, "sub_configs", None) or {}).items():
        if key in overrides or not issubclass(sub_class, PretrainedConfig):
            continue
        sized = {name: fields.get(source, TINY_EXPERTS.get(source)) for name, source in TINY_SUB_FIELDS.items()
                 if _field_of(sub_class, name)}
        if sized:
            found[key] = {**sized, **{name: value for name, value in TINY_SUB_VALUES.items()
                                      if _field_of(sub_class, name)}}
    return found


def _build_refusal(model_type: str, vocab_size: int, overrides: dict, error: Exception) -> ValueError:
    """The ValueError for a config transformers refused to build (`error`, its complaint quoted): where the tiny
    model's fields alone build it, the overrides are at fault, named (those the complaint names, else all) with the
    fix, their value; else the type cannot be built tiny, and another type is the fix: its language model's, where it
    keeps one in a text sub-config (Dots 3 Note, whose vision and audio towers stay at their full sizes; Gemma 4's
    assistant)."""
    cause = str(error).strip().splitlines()
    complaint = f"{type(error).__name__}: {' '.join(line.strip() for line in cause[:2])}"
    if overrides and _builds(model_type, vocab_size):
        named = [name for name in overrides if name in str(error)] or list(overrides)
        return ValueError(f"tiny model type {model_type!r}: transformers refuses "
                          f"{', '.join(f'{name}={overrides[name]!r}' for name in named)} ({complaint}): give "
                          f"{' and '.join(named)} a value its config takes (the tiny model's fields alone build it).")
    text_type = _text_model_type(CONFIG_MAPPING[model_type])
    other = (f"its language model's type, --tiny_model_type {text_type} (tiny_config({text_type!r})), "
             if text_type else "another --tiny_model_type (e.g. qwen2, llama, gpt2) ")
    return ValueError(f"tiny model type {model_type!r}: transformers does not build its config from the tiny model's "
                      f"fields ({complaint}); train {other}or a model of this type from --model_name_or_path.")


def _text_model_type(config_class: type) -> str | None:
    """The model type of `config_class`'s text sub-config (its language model's), where it has one that is a
    model type of its own."""
    spec = (getattr(config_class, "sub_configs_defaults", None) or {}).get("text_config")
    text_type = getattr(spec, "model_type", None) or getattr(getattr(spec, "config_class", None), "model_type", None)
    return text_type if text_type in CONFIG_MAPPING and text_type != config_class.model_type else None


def _builds(model_type: str, vocab_size: int) -> bool:
    """Whether the tiny model's fields alone, no override, make a config of `model_type`."""
    try:
        _tiny_config(model_type, vocab_size, {})
    except ValueError:
        return False
    return True


def released_model_types(*model_types: str) -> list:
    """pytest parameters of `model_types`, each skipped where this transformers has no such model type (a family
    added in a later release)."""
    import pytest
    import transformers

    return [pytest.param(t, marks=pytest.mark.skipif(t not in CONFIG_MAPPING, reason=f"transformers "
                                                     f"{transformers.__version__} has no model type {t!r}"))
            for t in model_types]
