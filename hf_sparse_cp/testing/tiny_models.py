"""Tiny random-init models: a small config of any architecture, for the tests, the smoke benchmarks and the
demo's default model (`--tiny_model_type`)."""

from __future__ import annotations

from transformers import AutoConfig, PretrainedConfig


def tiny_config(model_type: str = "qwen2", vocab_size: int = 259, **overrides) -> PretrainedConfig:
    """A small config of any transformers `model_type` (GQA 4:2, head_dim 32, 2 layers, no dropout,
    no sliding window); any field can be overridden."""
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
    fields.update(overrides)
    return AutoConfig.for_model(model_type, **fields)
