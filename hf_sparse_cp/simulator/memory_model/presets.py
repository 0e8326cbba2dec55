"""The size presets `--model` names, as `Architecture`s (`PRESETS`)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import replace

from ..shapes import MODELS, ModelShape
from .architecture import Architecture


def _qwen_like(shape: ModelShape, tied_embeddings: bool, qkv_bias: bool) -> Architecture:
    """A Qwen2/Llama layout: RMSNorm weights before attention and the MLP and at the end, q/k/v biases or none."""
    bias = (shape.heads + 2 * shape.kv_heads) * shape.head_dim if qkv_bias else 0
    return Architecture(shape, tied_embeddings, bias + 2 * shape.hidden, shape.hidden)


def _qwen3(shape: ModelShape) -> Architecture:
    """Qwen3 of `shape` (no biases, no tying), built from its config on the meta device: its q/k RMSNorms' weights and
    what they save are measured (`Architecture.from_config`), not a Llama layer's counted."""
    from transformers import Qwen3Config

    config = Qwen3Config(hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                         num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                         num_key_value_heads=shape.kv_heads, head_dim=shape.head_dim, vocab_size=shape.vocab,
                         tie_word_embeddings=False)
    arch = Architecture.from_config(config, shape.name)
    return replace(arch, shape=replace(arch.shape, source=shape.source))


class _Presets(Mapping[str, Architecture]):
    """The size presets `--model` names, the simulator's (`shapes.MODELS`), each built at its first lookup: Qwen2.5
    (config.json on the Hugging Face Hub), q/k/v biases, 0.5B, 1.5B and 3B tying the LM head to the embedding, a
    Llama layer's tensors counted on its code; Qwen3-8B (`_qwen3`: its layers measured on the meta device,
    seconds)."""

    def __init__(self) -> None:
        self._built: dict[str, Architecture] = {}

    def __getitem__(self, name: str) -> Architecture:
        if name not in self._built:
            shape = MODELS[name]
            self._built[name] = _qwen3(shape) if name.startswith("qwen3") else _qwen_like(
                shape, tied_embeddings=name != "qwen2.5-7b", qkv_bias=True)
        return self._built[name]

    def __iter__(self) -> Iterator[str]:
        return iter(MODELS)

    def __len__(self) -> int:
        return len(MODELS)


PRESETS = _Presets()
