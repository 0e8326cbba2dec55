"""A decoder as its memory depends on it (`Architecture`): its shape, its parameters beside the shape's matrices,
and what its layers save for backward, measured on the model transformers builds from its config."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import torch

from ...config.model_fields import LEAN_LOSS_FAMILIES, decoder_layers
from ..lora import LORA_FAMILIES, MODULE_INPUTS, module_features
from ..shapes import ModelShape, check_decoder, check_routing_tensors, meta_model
from .measurements import LayerSaved, MoeBytes, SavedBytes, layer_saved, moe_bytes
from .settings import DTYPE_BYTES


def _parts(saved: LayerSaved) -> tuple[SavedBytes, SavedBytes, SavedBytes]:
    return saved.before, saved.inputs, saved.after


class _SavedByDtype(Mapping[str, tuple[LayerSaved, ...]]):
    """`measurements.layer_saved` of the meta-device `model` for each activation dtype of `DTYPE_BYTES`, measured at its
    first lookup (a dtype's is three forwards of the whole model: an 8B config's three dtypes took 5 s, and a
    prediction reads one); bfloat16's at once, so that a model the measurement refuses is refused when it is read.
    `measure` takes the other regimes: LoRA's frozen layers, autocast over fp32 weights. `twin`: builds the Llama model
    of the same shape (`beyond_llama`), for a family that token tiles run."""

    def __init__(self, model: torch.nn.Module, kv_heads: int, where: str,
                 twin: Callable[[], torch.nn.Module] | None = None) -> None:
        self._model, self._kv_heads, self._where, self._twin = model, kv_heads, where, twin
        self._measured: dict[tuple[str, bool, bool], tuple[LayerSaved, ...]] = {}
        self._beyond: dict[tuple[str, bool, bool], tuple[LayerSaved, ...] | None] = {}
        self._moe: dict[tuple[str, bool], MoeBytes] = {}
        self["bfloat16"]  # noqa: B018 (measured for its errors)

    def measure(self, dtype: str, frozen: bool = False, autocast: bool = False) -> tuple[LayerSaved, ...]:
        """What the layers save in `dtype`: `frozen`, with their weights frozen (LoRA's base:
        `layer_saved(frozen=True)`); `autocast`, fp32 weights with autocast to `dtype` (an fp32 residual stream)."""
        key = dtype, frozen, autocast
        if key not in self._measured:
            self._measured[key] = layer_saved(self._model, getattr(torch, dtype), self._kv_heads, self._where,
                                              frozen=frozen, autocast=autocast)
        return self._measured[key]

    def moe(self, dtype: str, autocast: bool = False) -> MoeBytes:
        """What the layers' mixture of experts allocates in `dtype` (`measurements.moe_bytes`; `autocast` as
        `measure`)."""
        key = dtype, autocast
        if key not in self._moe:
            self._moe[key] = moe_bytes(self._model, getattr(torch, dtype), self._where, autocast=autocast)
        return self._moe[key]

    def beyond_llama(self, dtype: str, frozen: bool = False, autocast: bool = False
                     ) -> tuple[LayerSaved, ...] | None:
        """What each layer saves beyond the Llama layer of its shape (Qwen3's q/k norms: their fp32 inputs, rsqrt
        and outputs), measured on both models as `measure` does: what stays when token tiles replace the Llama
        layer's norms and MLP. None without a twin (a Llama's own layer, or a family tiles do not run)."""
        if self._twin is None:
            return None
        key = dtype, frozen, autocast
        if key not in self._beyond:
            llama = layer_saved(self._twin(), getattr(torch, dtype), self._kv_heads, self._where, frozen=frozen,
                                autocast=autocast)
            self._beyond[key] = tuple(
                LayerSaved(*(SavedBytes(a.per_token - b.per_token, a.const - b.const)
                             for a, b in zip(_parts(mine), _parts(theirs))))
                for mine, theirs in zip(self.measure(*key), llama))
        return self._beyond[key]

    def __getitem__(self, dtype: str) -> tuple[LayerSaved, ...]:
        if dtype not in DTYPE_BYTES:
            raise KeyError(dtype)
        return self.measure(dtype)

    def __iter__(self) -> Iterator[str]:
        return iter(DTYPE_BYTES)

    def __len__(self) -> int:
        return len(DTYPE_BYTES)


@dataclass(frozen=True)
class Architecture:
    """A decoder's shape as its memory depends on it: `ModelShape` (layers, hidden, heads, the MLP's form, ...) plus
    whether the LM head shares the embedding, and the parameters beside the shape's matrices: a layer's
    (`layer_extra`: biases, norm weights) and the model's outside its layers (`model_extra`: the final norm,
    position embeddings, an LM head's bias); whether training computes its loss with the lean loss (`lean_loss`:
    the Llama-like families, `LEAN_LOSS_FAMILIES`) or its stock forward's [tokens, vocab] logits; the elements of
    its largest parameter where that is not the embedding (`largest_param`: GPT-2's learned positions; 0: none);
    what each decoder layer saves for backward besides its attention core and MLP, measured on the model by
    activation dtype (`layer_saved`: `measurements.LayerSaved`, measured when first read; None: a Llama layer's, counted
    on its code); whether LoRA's count reads its layers (`lora_layers`: a family of `lora.LORA_FAMILIES` whose layer
    holds `lora.MODULE_INPUTS` by name and size, and no other matrix)."""

    shape: ModelShape
    tied_embeddings: bool
    layer_extra: int
    model_extra: int
    lean_loss: bool = True
    largest_param: int = 0
    layer_saved: Mapping[str, tuple[LayerSaved, ...]] | None = None
    lora_layers: bool = True

    @property
    def name(self) -> str:
        return self.shape.name

    @property
    def max_positions(self) -> int | None:
        """The positions a learned position table holds (`ModelShape.max_positions`), or None."""
        return self.shape.max_positions

    @property
    def layer_params(self) -> int:
        """Parameters of one decoder layer: its matrices, biases and norm weights."""
        return self.shape.layer_params + self.layer_extra

    @property
    def cast_params(self) -> int:
        """Parameters of one decoder layer that autocast casts to the compute dtype: all but a mixture of experts'
        routed experts (torch's grouped matmul, not autocast's, runs them in their own dtype)."""
        return self.layer_params - self.shape.expert_params

    @property
    def token_tiles(self) -> bool:
        """Whether training runs this model's MLPs and norms in token tiles: the Llama-like families' modules only
        (`LEAN_LOSS_FAMILIES`, as the lean loss); training refuses tiles for any other model at start."""
        return self.lean_loss

    @property
    def embedding_params(self) -> int:
        return self.shape.vocab * self.shape.hidden

    @property
    def params(self) -> int:
        """Every parameter: embedding (and an untied LM head), the layers, the rest (final norm, ...)."""
        heads = 1 if self.tied_embeddings else 2
        return heads * self.embedding_params + self.shape.layers * self.layer_params + self.model_extra

    @classmethod
    def from_config(cls, config, name: str | None = None, where: str | None = None) -> Architecture:
        """From a transformers config of a decoder (`ModelShape.from_config`, which names a missing field), its
        parameters counted on the model transformers builds from it on the meta device: whether the LM head is the
        embedding, the layers' and the rest's parameters (biases, LayerNorms' or RMSNorms' weights, position
        embeddings, an LM head's bias), and what its layers save for backward (`measurements.layer_saved`, in each
        activation dtype).

        Raises:
            ValueError: `ModelShape.from_config`'s and `measurements.layer_saved`'s (naming the field and the fix, after
                `where`), or a model without the lean loss that soft-caps its logits (temporaries not modelled).
        """
        where = where or name or getattr(config, "model_type", "the config")
        kv_heads = check_decoder(config, where)[1]  # (before the build, whose own errors would name less)
        check_routing_tensors(config, where)
        lean = config.model_type in LEAN_LOSS_FAMILIES
        if not lean and getattr(config, "final_logit_softcapping", None) is not None:
            raise ValueError(f"{where}: final_logit_softcapping={config.final_logit_softcapping}: the stock loss of "
                             f"{config.model_type} soft-caps its [tokens, vocab] logits, whose temporaries the "
                             "predictions do not model; give a config without it (null), or a preset (--model).")
        model = meta_model(config, where)
        shape = ModelShape.from_config(config, name, where, model)
        layers = decoder_layers(model)
        embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
        tied = head is not None and head.weight is embedding.weight
        layer = sum(p.numel() for p in layers[0].parameters())
        total = sum(p.numel() for p in model.parameters())
        rest = total - shape.layers * layer - (1 if tied else 2) * shape.vocab * shape.hidden
        largest = max(p.numel() for p in model.parameters())
        # (a Llama has nothing beyond its own layer: no twin to measure)
        twin = lean and config.model_type != "llama"
        saved = _SavedByDtype(model, kv_heads, where, twin=(lambda: meta_model(_llama_twin(config), where))
                              if twin else None)
        return cls(shape, tied, layer - shape.layer_params, rest, lean,
                   largest if largest > shape.vocab * shape.hidden else 0, saved,
                   config.model_type in LORA_FAMILIES and _llama_matrices(layers[0], shape))


def _llama_matrices(layer: torch.nn.Module, shape: ModelShape) -> bool:
    """Whether `layer`'s matrices are a Llama layer's of `shape` (`Architecture.lora_layers`): one of each name of
    `lora.MODULE_INPUTS`, of its (in, out) features, and no other (a fused q/k/v, fc1/fc2, a mixture's experts)."""
    matrices = [(name.split(".")[-2], tuple(p.shape)) for name, p in layer.named_parameters() if p.dim() >= 2]
    expected = sorted((name, module_features(shape, name)[::-1]) for name in MODULE_INPUTS)
    return sorted(matrices) == expected


def _llama_twin(config):
    """The Llama config of `config`'s shape (a family token tiles run: `LEAN_LOSS_FAMILIES`)."""
    from transformers import LlamaConfig

    text = config.get_text_config()
    fields = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "vocab_size", "hidden_act", "rms_norm_eps", "tie_word_embeddings")
    return LlamaConfig(**{name: getattr(text, name) for name in fields},
                       head_dim=getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads)
