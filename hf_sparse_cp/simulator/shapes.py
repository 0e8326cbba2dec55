"""Decoder shapes the simulator's predictions take (step time, `step_model.py`; memory,
`memory_model.py`): `ModelShape`, the presets `MODELS`, and any causal LM's shape from its transformers config
(`ModelShape.from_config`). A leaf: it imports nothing of the package but the config fields it shares with training
(`config.model_fields`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..config.model_fields import EXPERT_COUNTS  # (the predictions count one dense MLP per layer: refused)

# The fields of a decoder's config the predictions read (transformers' standard names).
DECODER_FIELDS = ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size", "vocab_size")


def check_decoder_sizes(where: str, sizes: dict[str, Any]) -> None:
    """ValueError naming the `DECODER_FIELDS` among `sizes` below 1 (a config of 0 layers was predicted as a model
    of 0 parameters): `ModelShape.from_config`'s check, run on a config.json's fields where transformers' config
    class divides by a head count of 0 before it (`arguments.read_config`)."""
    empty = [f"{field}={value}" for field, value in sizes.items() if isinstance(value, int) and value < 1]
    if empty:
        raise ValueError(f"{where}: {', '.join(empty)} in the config; a decoder has at least one of each: give the "
                         "model's own config.json, or a preset (--model).")


@dataclass(frozen=True)
class ModelShape:
    """A decoder's shape (Qwen2Config fields)."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    source: str = ""

    @property
    def layer_params(self) -> int:
        """Weights of one layer's matrix multiplications (attention projections and the SwiGLU MLP)."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return self.hidden * (2 * q + 2 * kv) + 3 * self.hidden * self.intermediate

    @property
    def linear_flop_pairs(self) -> float:
        """A token's linear work in one layer (its matrix products and a layer's share of the LM head), in
        attention token pairs by FLOPs: 2 x weights / (4 x heads x head_dim)."""
        return 2 * (self.layer_params + self.vocab * self.hidden / self.layers) / (4 * self.heads * self.head_dim)

    @property
    def qkv_params(self) -> int:
        """Weights of the query, key and value projections: the layer's matrix multiplications before attention."""
        return self.hidden * (self.heads + 2 * self.kv_heads) * self.head_dim

    @classmethod
    def from_config(cls, config: Any, name: str | None = None, where: str | None = None) -> ModelShape:
        """The shape of a decoder from its transformers config (`AutoConfig`; the standard names, which
        transformers maps for GPT-2-style configs too): layers, hidden size, heads, KV heads, head_dim, the gated
        MLP's width and the vocabulary.

        Raises:
            ValueError: a field the predictions need is missing, the heads do not divide the hidden size (or the
                key/value heads the query heads), or the model routes its tokens to experts; the message names
                the field and the fix, after `where` (default: the name or model type; a command's flag and file).
        """
        where = where or name or getattr(config, "model_type", "the config")
        experts = [field for field in EXPERT_COUNTS if getattr(config, field, None)]
        if experts:
            raise ValueError(f"{where}: {experts[0]}={getattr(config, experts[0])}: a mixture of experts, which the "
                             "predictions do not model (they count one dense MLP per layer); give a dense model's "
                             "config.json, or a preset (--model).")
        missing = [field for field in DECODER_FIELDS if getattr(config, field, None) is None]
        if missing:
            raise ValueError(f"{where}: no {', '.join(missing)} in the config; the predictions need a decoder's "
                             f"{', '.join(DECODER_FIELDS)} (a Llama-style config.json): add the missing field(s), or "
                             "give a preset (--model).")
        check_decoder_sizes(where, {field: getattr(config, field) for field in DECODER_FIELDS})
        heads, head_dim = config.num_attention_heads, getattr(config, "head_dim", None)
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        # (a field the file leaves out takes its model type's default: BERT's 12 heads over a hidden size of 64)
        if head_dim is None and config.hidden_size % heads:
            raise ValueError(f"{where}: hidden_size {config.hidden_size} is not divisible by num_attention_heads "
                             f"{heads}, and no head_dim says how wide a head is; give the config's own "
                             "num_attention_heads (or head_dim).")
        if heads % kv_heads:
            raise ValueError(f"{where}: num_attention_heads {heads} is not a multiple of num_key_value_heads "
                             f"{kv_heads} (each key/value head serves a group of query heads); give the config's "
                             "own head counts.")
        return cls(name or config.model_type, config.num_hidden_layers, config.hidden_size, heads, kv_heads,
                   head_dim or config.hidden_size // heads, config.intermediate_size,
                   config.vocab_size, f"config.json of model_type {config.model_type!r}")

    def linear_flops(self, *, recompute: bool) -> tuple[float, float]:
        """(per token per layer, per token for the LM head) of one training step: 2 FLOPs per weight
        forward, 4 backward, and 2 more per layer weight for the recomputed forward."""
        per_weight = 8 if recompute else 6
        return per_weight * self.layer_params, 6 * self.hidden * self.vocab


_QWEN = "Qwen/Qwen2.5-{} config.json on the Hugging Face Hub (as benchmarks/bench_e2e.py MODEL_SHAPES)"
MODELS = {
    "qwen2.5-0.5b": ModelShape("qwen2.5-0.5b", 24, 896, 14, 2, 64, 4864, 151936, _QWEN.format("0.5B")),
    "qwen2.5-1.5b": ModelShape("qwen2.5-1.5b", 28, 1536, 12, 2, 128, 8960, 151936, _QWEN.format("1.5B")),
    "qwen2.5-3b": ModelShape("qwen2.5-3b", 36, 2048, 16, 2, 128, 11008, 151936, _QWEN.format("3B")),
    "qwen2.5-7b": ModelShape("qwen2.5-7b", 28, 3584, 28, 4, 128, 18944, 152064, _QWEN.format("7B")),
    # the model of TRL's published long-context figure (benchmarks/simulate_cp_modes.py's check)
    "qwen3-8b": ModelShape("qwen3-8b", 36, 4096, 32, 8, 128, 12288, 151936,
                           "Qwen/Qwen3-8B config.json on the Hugging Face Hub"),
}
