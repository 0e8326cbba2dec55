"""Tiny random-init models: a small config of any architecture, for the tests, the smoke benchmarks and the
demo's default model (`--tiny_model_type`)."""

from __future__ import annotations

import contextlib
import inspect

from transformers import CONFIG_MAPPING, AutoConfig, PretrainedConfig

from ..integration.architectures import CONFIG_DROPOUTS


def _derived(config_class: type, name: str) -> bool:
    """Whether `config_class` computes `name` from its other fields (a property without a setter: Falcon's
    `head_dim`), so that it cannot be given."""
    member = inspect.getattr_static(config_class, name, None)
    return isinstance(member, property) and member.fset is None


def _attends(layer_types) -> bool:
    """Whether a config's `layer_types` include an attention layer (not a linear-attention, recurrent or conv one)."""
    return any("attention" in kind and kind != "linear_attention" for kind in layer_types)


# A mixture of experts' sizes, for the architectures whose config has them (their defaults are a real model's: Qwen3-MoE
# 128 experts of 768): few, small experts, every one reached by a short sequence.
TINY_EXPERTS = dict(num_experts=4, num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=128,
                    shared_expert_intermediate_size=128)
# Multi-head latent attention (DeepSeek V2/V3, MiniCPM3, GLM-4 MoE Lite): small ranks, one key/value head per query
# head, queries and keys of 48 (16 of them rotary, the config's head_dim) and values of 32.
TINY_MLA = dict(num_key_value_heads=4, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32, kv_lora_rank=32,
                q_lora_rank=64)


# A decoder's own sizes in the configs that size it apart from the encoder (BART, Marian, Pegasus, Whisper: their
# `*ForCausalLM` builds the decoder alone), taken from the tiny model's fields of the same meaning.
TINY_DECODER = dict(decoder_layers="num_hidden_layers", decoder_attention_heads="num_attention_heads",
                    decoder_ffn_dim="intermediate_size")


def _field_of(config_class: type, name: str) -> bool:
    """Whether `config_class` takes a field `name` (an argument of its constructor)."""
    return name in inspect.signature(config_class.__init__).parameters


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


def tiny_config(model_type: str = "qwen2", vocab_size: int = 259, **overrides) -> PretrainedConfig:
    """A small config of any transformers `model_type` (GQA 4:2, head_dim 32, 2 layers, no dropout, no sliding
    window: layer_types that default to sliding layers become full attention unless a `sliding_window` is given,
    the window then unused; half of a head's dimensions rotary where the config counts them (`rotary_dim`: CodeGen
    and GPT-J rotate 16 of 32, interleaved); a mixture of experts: `TINY_EXPERTS`; latent attention: `TINY_MLA`; a
    decoder sized apart from its encoder: `TINY_DECODER`); any field can be overridden. A field the architecture
    derives from others (Falcon's `head_dim`) is left to it; an override of one it derives otherwise is a ValueError
    that names it, and so is a config transformers refuses to build from these fields, and a type that keeps its
    language model in a sub-config these fields do not reach (a vision-language model's), naming the language
    model's type."""
    fields = dict(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=1 << 20,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        attention_dropout=0.0,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
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
    fields.update({name: fields[source] for name, source in TINY_DECODER.items()
                   if _field_of(config_class, name) and name not in overrides})
    if mla and "head_dim" not in overrides:
        fields["head_dim"] = fields["qk_rope_head_dim"]
    derived = {name for name in fields if _derived(config_class, name)}
    given = {name: value for name, value in fields.items() if name not in derived}
    unwindowed = False
    try:
        try:
            config = AutoConfig.for_model(model_type, **given)
        except Exception as e:  # (EXAONE-MoE, Laguna: an int window only; EXAONE 4, Kolibri: sliding layers need one)
            if "sliding_window" in overrides:  # one no layer reaches, as below
                raise
            unwindowed, given["sliding_window"] = True, fields["max_position_embeddings"]
            try:
                config = AutoConfig.for_model(model_type, **given)
            except Exception:  # (not the window: the first cause is the one to name)
                raise e from None
    except Exception as e:  # transformers' own checks of this architecture's fields
        cause = str(e).strip().splitlines()
        raise ValueError(f"tiny model type {model_type!r}: transformers does not build its config from the tiny "
                         f"model's fields ({type(e).__name__}: {' '.join(line.strip() for line in cause[:2])}); train "
                         "another --tiny_model_type (e.g. qwen2, llama, gpt2) or a model of this type from "
                         "--model_name_or_path.") from e
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
    no_window = config.sliding_window is None or unwindowed
    if no_window and "sliding_attention" in layer_types and "layer_types" not in overrides:
        # Gemma 2/3, Cohere 2, OLMo 3 default to sliding layers, and build a sliding mask even when no layer reads
        # it, which transformers cannot do without a window: every layer full, and a window no layer uses.
        # Built again with them where the config takes them: what it derives per layer type (Dory's RoPE
        # parameters, Gemma 4's per-layer settings) then follows them (set afterwards, it did not: KeyError
        # 'full_attention' at the model's build).
        full = {"layer_types": ["full_attention" if t == "sliding_attention" else t for t in layer_types],
                "sliding_window": config.max_position_embeddings}
        if _field_of(config_class, "layer_types"):
            config = AutoConfig.for_model(model_type, **{**given, **full})
        else:
            config.layer_types, config.sliding_window = full["layer_types"], full["sliding_window"]
    for name in sorted(derived & set(overrides)):
        if getattr(config, name) != overrides[name]:
            raise ValueError(f"{model_type}: {name}={overrides[name]} cannot be set, {config_class.__name__} derives "
                             f"it from its other fields ({name}={getattr(config, name)} here); change those instead "
                             "(e.g. hidden_size and num_attention_heads for head_dim).")
    return config


def released_model_types(*model_types: str) -> list:
    """pytest parameters of `model_types`, each skipped where this transformers has no such model type (a family
    added in a later release)."""
    import pytest
    import transformers

    return [pytest.param(t, marks=pytest.mark.skipif(t not in CONFIG_MAPPING, reason=f"transformers "
                                                     f"{transformers.__version__} has no model type {t!r}"))
            for t in model_types]
