"""The transformers architectures the plugin knows, in one table keyed by `model_type` (Liger-Kernel's
`MODEL_TYPE_TO_APPLY_LIGER_FN` is the model): what the lean loss patches, which modules token tiles run
row by row, and whether sparse context parallelism was tested exact against one process. The lean
loss, the token tiles, the record of what the plugin changes (`compat.PATCHES`), the CP checks and the
tests read it; a model type outside it still trains with the `sparse_cp` attention backend.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import inspect
import pathlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from ..config.model_fields import EXPERT_COUNTS, LEAN_LOSS_FAMILIES


@dataclass(frozen=True)
class Support:
    """What the plugin does for one architecture.

    causal_lm: its `*ForCausalLM` class, whose forward the lean loss replaces (None: the stock forward).
    rowwise: its MLP and RMSNorm classes, each with the name of its forward's input, that token tiles run a
        tile of tokens at a time (each treats every token on its own, as read in transformers' code).
    cp_tested: its result under context parallelism equals one process (tests/distributed/test_cp_models.py);
        an architecture outside the table trains under CP when it passes the model checks
        (`models.check_model_supports_context_parallel`), which name what they refuse.
    seq2seq_decoder: its causal LM is the decoder of an encoder-decoder family: it holds parameters its forward
        leaves without a gradient (the cross-attention, which a decoder-only forward never calls), and its forward
        computes its loss itself, the mean cross-entropy of its labels unshifted (each position predicts its own
        label), not through `loss_function` with the loss keywords.
    routed_since: the transformers release from which its modeling code routes attention through AttentionInterface
        (an older one keeps eager attention: the model is refused, naming that release, and counts as untested).
    """

    causal_lm: str | None = None
    rowwise: Mapping[str, str] = field(default_factory=dict)
    cp_tested: bool = False
    seq2seq_decoder: bool = False
    routed_since: tuple[int, ...] = ()


def _llama_like(family: str) -> Support:
    """The Llama family's layout: `{family}ForCausalLM`, a SwiGLU `{family}MLP` and `{family}RMSNorm`."""
    return Support(f"{family}ForCausalLM", {f"{family}MLP": "x", f"{family}RMSNorm": "hidden_states"}, cp_tested=True)


ARCHITECTURES: dict[str, Support] = {
    **{model_type: _llama_like(family) for model_type, family in LEAN_LOSS_FAMILIES.items()},
    **{model_type: Support(cp_tested=True) for model_type in (
        "phi3", "olmo2", "granite", "gemma3_text", "glm4", "helium", "smollm3", "cohere2", "gemma", "cohere",
        "gpt_neox", "starcoder2", "phi", "gpt2", "opt", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe",
        "deepseek_v3", "gpt_oss", "llama4_text", "gpt_bigcode", "persimmon", "diffllama", "gemma3n_text",
        "jetmoe", "ctrl", "biogpt", "deepseek_v2", "glm4_moe", "afmoe", "apertus", "gemma4_text", "granite_swa",
        "modernbert-decoder")},
    "codegen": Support(cp_tested=True, routed_since=(5, 24)),  # (5.15-5.23's CodeGen computes attention itself)
    # The decoders of encoder-decoder families, trained decoder-only (`*ForCausalLM` without encoder_hidden_states:
    # their cross-attention is never called, and refused at a call that gets them). The BART family's decoders count
    # their positions from their input's length (`positions.hook_length_counted_tables`); Whisper's takes position_ids.
    **{model_type: Support(cp_tested=True, seq2seq_decoder=True) for model_type in (
        "bart", "mbart", "plbart", "blenderbot", "blenderbot-small", "marian", "pegasus", "whisper")},
}


# The parameters of the router load-balancing loss the plugin computes over the CP group (`trainer/router_loss.py`):
# a modeling module's `load_balancing_loss_func` (the loss its MoE causal LM adds with `output_router_logits`) that
# takes every layer's router logits of the batch's tokens and the batch's padding mask, which the CP wrapper gathers
# into the whole batch's. Another form (Doge's product-key router `num_keys`, SwitchTransformers' `router_probs`) is
# left as it is, and CP's start warns (`cp_checks.router_aux_loss_note`).
ROUTER_LOSS_PARAMETERS = ("gate_logits", "num_experts", "top_k", "attention_mask")
_ROUTER_LOSS = "load_balancing_loss_func"

# The models that run their KV-shared layers (those reusing an earlier layer's keys and values) on the kept logits'
# queries only, by the method that slices their inputs, with its parameters (integration/kv_sharing.py): those of the
# installed transformers are `kv_shared_slicers()`.
_KV_SHARED_SLICERS = {
    "transformers.models.gemma4.modeling_gemma4.Gemma4TextModel":
        ("self", "hidden_states", "per_layer_inputs", "position_embeddings", "causal_mask_mapping", "logits_to_keep",
         "cache", "**kwargs"),
    "transformers.models.gemma4_unified.modeling_gemma4_unified.Gemma4UnifiedTextModel":
        ("self", "hidden_states", "position_embeddings", "causal_mask_mapping", "logits_to_keep", "cache", "**kwargs"),
}
KV_SHARED_SLICER = "_maybe_slice_kv_shared_inputs"


@functools.cache
def kv_shared_slicers() -> dict[str, tuple[str, ...]]:
    """The installed models of `_KV_SHARED_SLICERS` (Gemma 4 came with a 5.x release), found unimported."""
    return {owner: parameters for owner, parameters in _KV_SHARED_SLICERS.items()
            if importlib.util.find_spec(owner.rpartition(".")[0].rpartition(".")[0]) is not None}


def gathered_router_loss(function) -> bool:
    """Whether `function` (a modeling module's `load_balancing_loss_func`) has the form CP gathers."""
    return callable(function) and tuple(inspect.signature(function).parameters) == ROUTER_LOSS_PARAMETERS


def _signature_of(source: str) -> tuple[str, ...]:
    """The parameter names of the module-level `def load_balancing_loss_func(...)` in `source` (unimported)."""
    lines = source[source.index(f"\ndef {_ROUTER_LOSS}(") + 1:].splitlines()
    for end in range(1, len(lines) + 1):  # (the def's lines up to its colon: the first prefix that parses)
        try:
            tree = ast.parse("\n".join(lines[:end]) + "\n    pass")
        except SyntaxError:
            continue
        arguments = tree.body[0].args
        return tuple(a.arg for a in (*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs))
    return ()


@functools.cache
def router_loss_modules() -> tuple[str, ...]:
    """Every installed transformers modeling module whose `load_balancing_loss_func` has the form CP gathers: found
    in their source, not imported (`compat.PATCHES` lists each; the unit tests check it against the imported
    functions)."""
    spec = importlib.util.find_spec("transformers")
    models = pathlib.Path(spec.submodule_search_locations[0]) / "models"
    found = []
    for path in sorted(models.glob("*/modeling_*.py")):
        source = path.read_text(encoding="utf-8")
        if f"\ndef {_ROUTER_LOSS}(" in source and _signature_of(source) == ROUTER_LOSS_PARAMETERS:
            found.append(f"transformers.models.{path.parent.name}.{path.stem}")
    return tuple(found)


def model_router_loss_modules(model: torch.nn.Module) -> tuple[str, ...]:
    """The modeling modules of `model`'s classes whose router loss CP gathers (`router_loss_modules`)."""
    return tuple(sorted({type(m).__module__ for m in model.modules()} & set(router_loss_modules())))


def length_counted_query_scales(module) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """For an attention layer that scales its queries by their positions counted from the length of the tensor it
    gets, not from `position_ids` (Llama 4's temperature tuning in its no-RoPE layers: log1p(floor((i + 1) /
    floor_scale)) * attn_scale + 1 for the i-th token of the call), the function that gives the float32 scales of
    the tokens at int64 `positions` as the layer computes them; else None. Under CP that tensor is a rank's shard:
    the backend moves its queries from the scales of the shard's positions to those of the tokens' positions in the
    row."""
    floor_scale = getattr(module, "floor_scale", None)
    tuned = getattr(module, "attn_temperature_tuning", False) and not getattr(module, "use_rope", True)
    if not (tuned and floor_scale):
        return None
    return lambda positions: torch.log1p(torch.floor((positions.float() + 1.0) / floor_scale)) * module.attn_scale + 1.0


def moved_query_scales(query: torch.Tensor, scales: Callable[[torch.Tensor], torch.Tensor],
                       positions: torch.Tensor) -> torch.Tensor:
    """`query` [B, H, L, D], which its layer scaled by `scales` of the positions 0 .. L-1 of its tensor, scaled by
    those of `positions` [L] instead (the tokens' positions in their row), as one process scales them: the ratio in
    float32 (or the query's wider dtype) and one rounding to the query's dtype (a ratio in bf16 or fp16
    put 3x to 8x one process's error into the scale of each query)."""
    wide = torch.promote_types(query.dtype, torch.float32)
    counted = torch.arange(query.shape[2], device=query.device)
    ratio = scales(positions).to(wide) / scales(counted).to(wide)
    return (query.to(wide) * ratio[:, None]).to(query.dtype)


# Values of `config.layer_types` that are attention layers (anything else mixes tokens otherwise, or attends over
# keys of its own making, such as DeepSeek-V4's compressed ones).
ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")
# Values of `config.layer_types` whose layers treat every token on its own (Nemotron-H's MLP and mixture-of-experts
# layers, between its Mamba and attention ones): no token mixer.
PER_TOKEN_LAYER_TYPES = ("mlp", "moe")
# Values of `config.layer_types` whose layers mix tokens without attention (Mamba, linear attention, short
# convolutions, RecurrentGemma's and RWKV's recurrences): a model of these (and per-token ones) alone has no attention
# layer. Another value ('hybrid', 'hybrid_sliding', ...) may attend.
RECURRENT_LAYER_TYPES = ("linear_attention", "mamba", "conv", "recurrent", "rwkv")

# Config fields that set attention dropout (the Llama family's, GPT-2's and GPT-BigCode's, BERT-style), which the
# backend refuses (it computes attention without dropout) and the tiny models set to 0.
CONFIG_DROPOUTS = ("attention_dropout", "attn_pdrop", "attention_probs_dropout_prob", "attn_dropout")


def uses_every_parameter(config) -> bool:
    """Whether every trainable parameter of a model of this transformers config gets a gradient at every step: a
    tested architecture that routes no tokens to experts (a mixture of experts may leave an expert unused) and holds
    no unused parameters (`Support.seq2seq_decoder`)."""
    support = ARCHITECTURES.get(config.model_type)
    return (support is not None and not support.seq2seq_decoder
            and not any(getattr(config, name, 0) for name in EXPERT_COUNTS))


def computes_unshifted_loss(config) -> bool:
    """Whether the causal LM of this transformers config computes its own loss of unshifted labels
    (`Support.seq2seq_decoder`)."""
    support = ARCHITECTURES.get(getattr(config, "model_type", None))
    return support is not None and support.seq2seq_decoder


def lean_loss_classes() -> tuple[str, ...]:
    """The `*ForCausalLM` classes (names in `transformers`) whose forward the lean loss replaces."""
    return tuple(s.causal_lm for s in ARCHITECTURES.values() if s.causal_lm)


def rowwise_classes() -> dict[str, tuple[str, str]]:
    """Class name -> (its module in transformers, its forward's input) of every module token tiles run."""
    return {name: (f"transformers.models.{model_type}.modeling_{model_type}", argument)
            for model_type, s in ARCHITECTURES.items() for name, argument in s.rowwise.items()}


# liger-kernel's replacements of the row-wise classes (its `apply_liger_kernel_to_*` swaps them into the models'
# modules, where `compat.PATCHES` then finds them under the replaced class's name).
LIGER_ROWWISE = ("LigerRMSNorm", "LigerSwiGLUMLP")


def tileable_classes() -> frozenset[str]:
    """The class names token tiles take: every architecture's row-wise classes and liger-kernel's."""
    return frozenset({*rowwise_classes(), *LIGER_ROWWISE})


def transformers_release() -> tuple[int, ...]:
    """The installed transformers release, e.g. (5, 24, 0)."""
    import transformers
    from packaging.version import Version

    return Version(transformers.__version__).release


def later_routing_release(model_type: str) -> tuple[int, ...] | None:
    """The transformers release from which `model_type` routes its attention through AttentionInterface, where the
    installed one is older; None otherwise (routed here, or outside the table)."""
    support = ARCHITECTURES.get(model_type)
    if support is None or transformers_release() >= support.routed_since:
        return None
    return support.routed_since


def cp_tested_model_types() -> tuple[str, ...]:
    """The model types tested exact under CP that the installed transformers routes through the backend."""
    return tuple(model_type for model_type, s in ARCHITECTURES.items()
                 if s.cp_tested and later_routing_release(model_type) is None)


# Vision-language models whose text-only batches under context parallelism equal one process
# (tests/distributed/test_cp_vision_language_models.py).
CP_TESTED_VISION_LANGUAGE_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "gemma3", "mllama", "llava", "llava_next",
                                   "idefics3", "smolvlm", "mistral3")


def lean_loss_model_types() -> tuple[str, ...]:
    """The model types whose causal LM trains through the lean loss (the single-process tests cover each)."""
    return tuple(model_type for model_type, s in ARCHITECTURES.items() if s.causal_lm)
