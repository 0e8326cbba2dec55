"""Tiny random-init model configs of the supported families (demo, tests, smoke benchmarks)."""

from __future__ import annotations

from transformers import AutoConfig, PretrainedConfig

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")


def tiny_config(model_type: str = "qwen2", vocab_size: int = 259, **overrides) -> PretrainedConfig:
    """A small config of `model_type` (GQA 4:2, head_dim 32); any field can be overridden."""
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model_type={model_type!r}; tiny configs exist for {SUPPORTED_MODEL_TYPES}.")
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
    if model_type in ("mistral", "qwen3", "qwen2"):
        fields["sliding_window"] = None
    fields.update(overrides)
    return AutoConfig.for_model(model_type, **fields)
