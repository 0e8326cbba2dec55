"""Decoder shapes the simulator's predictions take (step time, `step_model.py`; memory,
`memory_model/`): `ModelShape`, the presets `MODELS`, and any causal LM's shape from its transformers config
(`ModelShape.from_config`, which reads the MLP's form, or its experts', off the model that transformers builds from the
config on the meta device). It imports nothing of the package but what it shares with training of a config and of the
model built from it (`config.model_fields`: the expert counts, the decoder layers); what the layers save and the experts
allocate, measured on the same model, is the memory model's (`memory_model.measurements`)."""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass
from typing import Any

import torch

from ..config.model_fields import EXPERT_COUNTS, decoder_layers, language_config, learned_positions

# The fields of a decoder's config the predictions read (transformers' standard names; the MLP's width also under
# GPT-2's `n_inner`, `intermediate_width`).
DECODER_FIELDS = ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size", "vocab_size")
# The fields a config names its MLP's activation by (transformers' `ACT2FN` keys), for the refusals.
ACTIVATION_FIELDS = ("hidden_act", "hidden_activation", "activation_function")
# The mixtures of experts the predictions model: a Llama-like decoder layer whose MLP is transformers' sparse block
# (a router's top-k of gated experts run by `integrations.moe`'s grouped matmul, Qwen2-MoE's shared expert beside them)
# in every layer; what its block allocates is measured on the meta device (`memory_model.measurements.moe_bytes`),
# checked against the same block on a CPU and a CPU step (tests/unit/test_memory_moe.py).
MOE_FAMILIES = ("mixtral", "olmoe", "qwen2_moe", "qwen3_moe")
# Why other mixtures of experts are refused (model type -> what the predictions do not model of it).
MOE_REFUSED = {
    "deepseek_v2": "latent attention (MLA), dense first layers (first_k_dense_replace) and group-limited routing",
    "deepseek_v3": "latent attention (MLA), dense first layers (first_k_dense_replace) and group-limited sigmoid "
                   "routing",
    "gpt_oss": "attention sinks, and experts with biases and a clamped SwiGLU",
}


def intermediate_width(config: Any) -> int | None:
    """The MLP's width: a GPT-2-style config's `n_inner` (None there: 4 x the hidden size, as transformers' GPT-2,
    CodeGen and GPTBigCode MLPs build it, whatever else the config holds), else `intermediate_size`; None where the
    config names neither."""
    if hasattr(config, "n_inner"):
        return 4 * config.hidden_size if config.n_inner is None else config.n_inner
    return getattr(config, "intermediate_size", None)


def meta_model(config: Any, where: str) -> torch.nn.Module:
    """The causal LM transformers builds from `config`, on the meta device (no memory, no initialization).

    Raises:
        ValueError: transformers cannot build it, with its own message, after `where`.
    """
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config)
    except Exception as error:  # (any config error of any architecture: reported, never guessed around)
        raise ValueError(f"{where}: transformers cannot build the model from the config ({error}); the predictions "
                         "read its layers: give a config.json that transformers loads, or a preset (--model).") \
            from error


def activation_saved(activation: torch.nn.Module) -> float:
    """[tokens, intermediate] tensors an MLP keeps of its activation for backward, measured on `activation` itself: the
    storages its forward saves (SiLU and GELU: their input; ReLU: its output; GPT-2's tanh GELU: four of them) and its
    output, which the next matrix product saves; in units of its input's size, the larger of bf16's and fp32's."""
    units = []
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(4096, dtype=dtype).requires_grad_()
        saved: dict[int, int] = {}

        def pack(t: torch.Tensor, saved: dict[int, int] = saved) -> torch.Tensor:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = activation(x)
        saved[y.untyped_storage().data_ptr()] = y.untyped_storage().nbytes()
        units.append(sum(saved.values()) / x.untyped_storage().nbytes())
    return max(units)


def mlp_form(model: torch.nn.Module, config: Any, where: str) -> tuple[bool, float]:
    """(gated, `activation_saved`) of the MLP of `model`'s first decoder layer (its `mlp`, where token tiles find it
    too): gated where its matrices hold 3 x hidden x intermediate weights (gate, up, down; a fused gate_up counts as
    two), two-matrix where 2 x (fc1 and fc2: GPT-NeoX's, Phi's, StarCoder2's, GPT-2's).

    Raises:
        ValueError: no decoder layer with an `mlp`, an MLP of another size, or not one activation module in it; the
            message names the module, the config's fields and the fix, after `where`.
    """
    hidden, width = config.hidden_size, intermediate_width(config)
    layers = decoder_layers(model)
    mlp = getattr(layers[0], "mlp", None) if layers else None
    if not isinstance(mlp, torch.nn.Module):
        shown = type(layers[0]).__name__ if layers else type(model).__name__
        raise ValueError(f"{where}: {shown} has no decoder layer with an `mlp` module, whose form (gated or two "
                         "matrices) the predictions read; give a decoder with one, e.g. a Llama's config.json, or a "
                         "preset (--model).")
    weights = sum(p.numel() for p in mlp.parameters() if p.dim() == 2)
    if weights not in (2 * hidden * width, 3 * hidden * width):
        raise ValueError(f"{where}: the MLP ({type(mlp).__name__}) holds {weights:,} weights, neither two nor three "
                         f"matrices of hidden_size {hidden} x its width {width} (intermediate_size, or GPT-2's "
                         "n_inner); the predictions model those two forms only: give the config's own MLP width, or a "
                         "preset (--model).")
    # (its activation: the one module in it besides the matrices and dropout; one with weights of its own, xIELU's,
    # is built on the meta device and cannot run there)
    activations = [m for m in mlp.children() if not isinstance(m, torch.nn.Dropout) and not list(m.parameters())]
    field = ", ".join(f"{f}={getattr(config, f)!r}" for f in ACTIVATION_FIELDS if hasattr(config, f))
    if len(activations) != 1:
        raise ValueError(f"{where}: the MLP ({type(mlp).__name__}) has no single activation module without weights "
                         f"({field or 'no activation field'} in the config) whose saved tensors the predictions can "
                         "measure; give a decoder whose MLP has one (e.g. silu, gelu), or a preset (--model).")
    return weights == 3 * hidden * width, activation_saved(activations[0])


def moe_form(model: torch.nn.Module, config: Any, where: str) -> tuple[int, int, int, int, float]:
    """(experts, experts per token, an expert's width, the block's other weights, `activation_saved`) of the mixture
    of experts in `model`'s decoder layers (`MOE_FAMILIES`): each layer's `mlp` a block of `experts` (gated: gate and
    up fused, then down, without biases) and the rest (the router, Qwen2-MoE's shared expert and its gate).

    Raises:
        ValueError: a layer with a dense MLP (Qwen's mlp_only_layers, decoder_sparse_step), or experts of another
            form; the message names the fields and the fix, after `where`.
    """
    layers = decoder_layers(model)
    blocks = [getattr(getattr(layer, "mlp", None), "experts", None) for layer in layers]
    dense = [index for index, block in enumerate(blocks) if not isinstance(block, torch.nn.Module)]
    if dense:
        fields = ", ".join(f"{f}={getattr(config, f)!r}" for f in ("mlp_only_layers", "decoder_sparse_step")
                           if hasattr(config, f))
        raise ValueError(f"{where}: decoder layers {dense} of {len(layers)} have a dense MLP and the others experts "
                         f"({fields or 'the config'}); the predictions model every layer's MLP alike: give a config "
                         "whose layers all route to experts (mlp_only_layers [], decoder_sparse_step 1), or a dense "
                         "model's.")
    experts, hidden = blocks[0], config.hidden_size
    count, per_token = experts.num_experts, config.num_experts_per_tok
    weights = sum(p.numel() for p in experts.parameters() if p.dim() == 3)
    width = weights // (3 * count * hidden)
    activation = getattr(experts, "act_fn", None)
    if (not getattr(experts, "has_gate", False) or getattr(experts, "has_bias", True) or
            weights != 3 * count * hidden * width or any(p.dim() != 3 for p in experts.parameters()) or
            not isinstance(activation, torch.nn.Module)):
        raise ValueError(f"{where}: the experts ({type(experts).__name__}) are not {count} gated MLPs without biases "
                         f"of hidden_size {hidden} (gate and up fused, then down, and one activation), the form the "
                         f"predictions model ({', '.join(MOE_FAMILIES)}); give the config.json of one of those, or of "
                         "a dense model.")
    others = sum(p.numel() for p in layers[0].mlp.parameters() if p.dim() >= 2) - weights
    return count, per_token, width, others, activation_saved(activation)


def check_decoder_sizes(where: str, sizes: dict[str, Any]) -> None:
    """ValueError naming the `DECODER_FIELDS` among `sizes` below 1 (a config of 0 layers was predicted as a model
    of 0 parameters): `ModelShape.from_config`'s check, run on a config.json's fields where transformers' config
    class divides by a head count of 0 before it (`arguments.read_config`)."""
    empty = [f"{field}={value}" for field, value in sizes.items() if isinstance(value, int) and value < 1]
    if empty:
        raise ValueError(f"{where}: {', '.join(empty)} in the config; a decoder has at least one of each: give the "
                         "model's own config.json, or a preset (--model).")


def layer_windows(config: Any, where: str) -> tuple[int | None, ...]:
    """Each layer's sliding window (None: global attention) as the attention backend receives it: the layers that
    `layer_types` names 'sliding_attention' (Gemma 3, Cohere 2, Qwen2's `use_sliding_window` from
    `max_window_layers` on) attend within `sliding_window`; without `layer_types`, a `sliding_window` is every
    layer's (Mistral's, StarCoder2's and Phi-3's attention pass it to every call; `ModelShape.from_config` drops it
    where no code of the model reads it, `reads_sliding_window`: a Llama config's); () where no layer has one.

    Raises:
        ValueError: a layer type other than those two (e.g. Llama 4's 'chunked_attention'), `layer_types` of
            another length than the layers, or no positive whole `sliding_window` for sliding layers; the message
            names the field and the fix, after `where`.
    """
    window, types = getattr(config, "sliding_window", None), getattr(config, "layer_types", None)
    if types is None:
        types = [] if window is None else ["sliding_attention"] * config.num_hidden_layers
    unknown = sorted({kind for kind in types if kind not in ("full_attention", "sliding_attention")})
    if unknown or len(types) not in (0, config.num_hidden_layers):
        raise ValueError(f"{where}: layer_types {list(types)} (of {len(types)} layers) names "
                         f"{unknown or 'another count of layers'}: the predictions model 'full_attention' and "
                         f"'sliding_attention' layers, one for each of the {config.num_hidden_layers} layers; give "
                         "the model's own config.json, or a preset (--model).")
    if "sliding_attention" in types and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
        raise ValueError(f"{where}: sliding_window={window!r} for sliding-window layers; give the window in tokens (a "
                         "whole number >= 1), or a preset (--model).")
    windows = tuple(window if kind == "sliding_attention" else None for kind in types)
    return windows if any(w is not None for w in windows) else ()


def reads_sliding_window(model: torch.nn.Module) -> bool:
    """Whether the code of `model` (transformers' modeling modules of its classes) builds its config's
    `sliding_window` into a mask (imports masking_utils' `create_sliding_window_causal_mask`: Mistral, PhiMoE). False
    for a family that does not (Llama, GPT-2, OLMo 2, and OLMoE, whose attention passes the field to the attention
    function, which only flash-attention applies): a config that carries the field attends past it in SDPA and in
    sparse_cp (`call_refusals.mask_only_window`); True for any class outside transformers (remote code: not judged,
    as there)."""
    return any(_module_reads_sliding_window(type(m).__module__) for m in model.modules())


@functools.cache
def _module_reads_sliding_window(name: str) -> bool:
    if not name.startswith("transformers.models."):  # (torch's layers and transformers' shared ones read no config)
        return not name.startswith(("torch.", "transformers."))
    module = sys.modules.get(name)
    return module is None or hasattr(module, "create_sliding_window_causal_mask")


def _sectioned_expert_counts(config: Any) -> list[str]:
    """'section.field=count' of every positive expert count (a field ending in `num_experts`) in a section of `config`
    (a nested config or mapping, e.g. DBRX's `ffn_config.moe_num_experts`), but a model of its own (a multimodal
    config's `text_config`, which the text-config refusal names)."""
    found = []
    for name, section in vars(config).items():
        fields_ = section.to_dict() if hasattr(section, "to_dict") else section
        if name.startswith("_") or not isinstance(fields_, dict) or fields_.get("model_type"):
            continue
        found += [f"{name}.{key}={value}" for key, value in fields_.items() if str(key).endswith("num_experts")
                  and isinstance(value, int) and not isinstance(value, bool) and value > 0]
    return found


def check_decoder(config: Any, where: str) -> tuple[int, int, int]:
    """(heads, key/value heads, head_dim) of a decoder's transformers config, after `ModelShape.from_config`'s checks
    of its fields (run before a model is built from it, whose own errors would name less).

    Raises:
        ValueError: see `ModelShape.from_config`.
    """
    # (the config's own field before transformers' alias of it: DeepSeek's n_routed_experts, read as num_local_experts)
    aliases = getattr(config, "attribute_map", {})
    experts = sorted((field for field in EXPERT_COUNTS if getattr(config, field, None)), key=lambda f: f in aliases)
    family = getattr(config, "model_type", None)
    # (a count in a section of the config, DBRX's ffn_config.moe_num_experts: refused as such, not for the fields
    # its top level lacks, whose fix would name only the next refusal)
    given = [f"{experts[0]}={getattr(config, experts[0])}"] if experts else _sectioned_expert_counts(config)
    if given and family not in MOE_FAMILIES:
        why = MOE_REFUSED.get(family, "experts and routing (a form they are not checked on)")
        raise ValueError(f"{where}: {given[0]}: a mixture of experts of model_type "
                         f"{family!r}, whose {why} the predictions do not model (they model the experts of "
                         f"{', '.join(MOE_FAMILIES)}); give the config.json of one of those or of a dense model, or a "
                         "preset (--model).")
    missing = [field for field in DECODER_FIELDS if getattr(config, field, None) is None
               and not (field == "intermediate_size" and intermediate_width(config) is not None)]
    text = language_config(config)
    if missing and text is not config and not any(getattr(text, field, None) is None for field in DECODER_FIELDS[:3]):
        raise ValueError(f"{where}: model_type {config.model_type!r} holds its language model's fields under "
                         f"text_config (model_type {text.model_type!r}), beside its other towers; the predictions "
                         "count a decoder alone: give its language model's config.json, written by `python -c "
                         "\"from transformers import AutoConfig; AutoConfig.from_pretrained('DIR').get_text_config()"
                         ".save_pretrained('text_config')\"` (DIR: the model's folder), then --config text_config "
                         "(the other towers' weights and optimizer state not counted), or a preset (--model).")
    if missing:
        raise ValueError(f"{where}: no {', '.join(missing)} in the config; the predictions need a decoder's "
                         f"{', '.join(DECODER_FIELDS)} (a Llama-style config.json): add the missing field(s), or "
                         "give a preset (--model).")
    check_decoder_sizes(where, {**{field: getattr(config, field) for field in DECODER_FIELDS[:3]},
                                "intermediate_size": intermediate_width(config), "vocab_size": config.vocab_size})
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
    return heads, kv_heads, head_dim or config.hidden_size // heads


def _routes_to_experts(config: Any) -> bool:
    """Whether `config` gives an expert count (`EXPERT_COUNTS`) at its top level: a mixture of experts."""
    return any(getattr(config, field, None) for field in EXPERT_COUNTS)


def check_routing_tensors(config: Any, where: str) -> None:
    """Raise ValueError, naming the field and the fix, where a mixture of experts' config makes training hold tensors
    the memory predictions do not count: the router's auxiliary loss over every layer's router logits (kept to the
    loss), the noise multiplying each MLP's input. (Their time is a [tokens, experts] softmax and an elementwise
    product a layer: `simulate` takes them.)"""
    if not _routes_to_experts(config):
        return
    if getattr(config, "output_router_logits", False):
        raise ValueError(f"{where}: output_router_logits=True: the stock loss adds the router's auxiliary loss over "
                         "every layer's router logits, kept to the loss, which the predictions do not model; give "
                         "output_router_logits false, or a preset (--model).")
    if getattr(config, "router_jitter_noise", 0):
        raise ValueError(f"{where}: router_jitter_noise={config.router_jitter_noise}: training multiplies each MLP's "
                         "input by noise, whose tensors the predictions do not model; give 0.0, or a preset "
                         "(--model).")


@dataclass(frozen=True)
class ModelShape:
    """A decoder's shape (Qwen2Config fields), with its MLP's form: gated (SwiGLU, GeGLU: gate, up and down
    projections) or two matrices (fc1, fc2), how many [tokens, intermediate] tensors its activation keeps for
    backward (`activation_saved`; SiLU: its input and output), and which layers attend within a sliding window
    (`windows`, `layer_windows`). A mixture of experts (`experts` > 0, `MOE_FAMILIES`): each layer's MLP is `experts`
    gated MLPs of width `intermediate`, `experts_per_token` of them run for each token, beside `moe_weights` (the
    router's, a shared expert's). `max_positions`: the positions a learned position table holds, the longest sequence
    the model's forward takes (GPT-2's 1,024; None: positions computed, as RoPE's)."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    source: str = ""
    gated: bool = True
    activation_saved: float = 2.0
    windows: tuple[int | None, ...] = ()  # each layer's sliding window, None: global; (): every layer global
    experts: int = 0  # routed experts per layer (0: one dense MLP)
    experts_per_token: int = 0
    moe_weights: int = 0  # the MoE block's matrix weights besides the routed experts' (router, shared expert)
    max_positions: int | None = None

    @property
    def mlp_matrices(self) -> int:
        """The MLP's matrices (an expert's): gate, up and down, or fc1 and fc2."""
        return 3 if self.gated else 2

    @property
    def expert_params(self) -> int:
        """Weights of one layer's routed experts (0: a dense MLP): torch's grouped matmul runs them in their own
        dtype, which autocast does not cast."""
        return self.experts * self.mlp_matrices * self.hidden * self.intermediate

    @property
    def mlp_saved(self) -> float:
        """[tokens, intermediate] tensors the MLP keeps for backward: its activation's, and a gated MLP's up
        projection and product."""
        return self.activation_saved + (2 if self.gated else 0)

    def _layer_weights(self, experts: int) -> int:
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        mlp = self.mlp_matrices * self.hidden * self.intermediate
        return self.hidden * (2 * q + 2 * kv) + (experts * mlp + self.moe_weights if self.experts else mlp)

    @property
    def layer_params(self) -> int:
        """Weights of one layer's matrix multiplications (attention projections and the MLP's matrices; a mixture of
        experts': every expert's, the router's and a shared expert's)."""
        return self._layer_weights(self.experts)

    @property
    def active_params(self) -> int:
        """Weights a token's matrix products run through in one layer: `layer_params`, of a mixture of experts its
        `experts_per_token` experts only."""
        return self._layer_weights(self.experts_per_token)

    @property
    def linear_flop_pairs(self) -> float:
        """A token's linear work in one layer (its matrix products and a layer's share of the LM head), in
        attention token pairs by FLOPs: 2 x weights / (4 x heads x head_dim)."""
        return 2 * (self.active_params + self.vocab * self.hidden / self.layers) / (4 * self.heads * self.head_dim)

    @property
    def qkv_params(self) -> int:
        """Weights of the query, key and value projections: the layer's matrix multiplications before attention."""
        return self.hidden * (self.heads + 2 * self.kv_heads) * self.head_dim

    @classmethod
    def from_config(cls, config: Any, name: str | None = None, where: str | None = None,
                    model: torch.nn.Module | None = None) -> ModelShape:
        """The shape of a decoder from its transformers config (`AutoConfig`; the standard names, which
        transformers maps for GPT-2-style configs too): layers, hidden size, heads, KV heads, head_dim, the MLP's
        width, form and activation (`mlp_form`, on `model`: the config's, built on the meta device when not given;
        a mixture of experts': `moe_form`) and the vocabulary.

        Raises:
            ValueError: a field the predictions need is missing, the heads do not divide the hidden size (or the
                key/value heads the query heads), the model routes its tokens to experts in a form not modelled
                (`MOE_FAMILIES`, `moe_form`), its MLP is of neither form, its layers are of other sizes
                (`check_matrices`) or of another kind (`layer_windows`); the message names the field and the fix,
                after `where` (default: the name or model type; a command's flag and file).
        """
        where = where or name or getattr(config, "model_type", "the config")
        heads, kv_heads, head_dim = check_decoder(config, where)
        windows = layer_windows(config, where)
        model = model if model is not None else meta_model(config, where)
        if windows and getattr(config, "layer_types", None) is None and not reads_sliding_window(model):
            windows = ()  # (a field no code of the model reads: its attention, SDPA's and sparse_cp's, is global)
        if _routes_to_experts(config):
            experts, per_token, width, others, activation = moe_form(model, config, where)
            gated, moe = True, {"experts": experts, "experts_per_token": per_token, "moe_weights": others}
        else:
            (gated, activation), width, moe = mlp_form(model, config, where), intermediate_width(config), {}
        shape = cls(name or config.model_type, config.num_hidden_layers, config.hidden_size, heads, kv_heads,
                    head_dim, width, config.vocab_size, f"config.json of model_type {config.model_type!r}", gated,
                    activation, windows, **moe, max_positions=learned_positions(model))
        shape.check_matrices(model, where)
        return shape

    def check_matrices(self, model: torch.nn.Module, where: str) -> None:
        """Refuse (ValueError naming the numbers, the fields and the fix, after `where`) a `model` whose decoder
        layers' matrices or embedding are not this shape's: a field the model does not read (GPT-NeoX's attention
        has no key/value heads of its own), or attention of another form (latent, multi-query by a flag)."""
        layers = decoder_layers(model)
        matrices = {sum(p.numel() for p in layer.parameters() if p.dim() >= 2) for layer in layers}  # (experts: 3D)
        embedding = tuple(model.get_input_embeddings().weight.shape)
        if len(layers) != self.layers or matrices != {self.layer_params} or embedding != (self.vocab, self.hidden):
            raise ValueError(f"{where}: the model's {len(layers)} decoder layers hold {sorted(matrices)} matrix "
                             f"weights each and its embedding {embedding}, not the shape's {self.layers} of "
                             f"{self.layer_params} and {(self.vocab, self.hidden)} that its fields give "
                             "(num_key_value_heads, head_dim, the MLP's width: one the model does not read, or "
                             "attention of another form, e.g. latent); give the fields of the model's own "
                             "config.json, or a preset (--model).")

    def linear_flops(self, *, recompute: bool) -> tuple[float, float]:
        """(per token per layer, per token for the LM head) of one training step: 2 FLOPs per weight a token runs
        through (`active_params`) forward, 4 backward, and 2 more per layer weight for the recomputed forward."""
        per_weight = 8 if recompute else 6
        return per_weight * self.active_params, 6 * self.hidden * self.vocab


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
