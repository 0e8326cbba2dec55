"""Fields of a transformers model config, and the layers of the model it builds, that both the training path and the
predictions on paper read (a leaf)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

# The fields that give a mixture of experts its expert count (Mixtral, Qwen2-MoE / Qwen3-MoE, OLMoE, DeepSeek).
EXPERT_COUNTS = ("num_local_experts", "num_experts", "n_routed_experts")
# The Llama-like families (model type -> class-name prefix) whose `*ForCausalLM` forward the lean loss replaces and
# whose MLP and RMSNorm token tiles run (`integration.architectures`); every other causal LM trains with its stock
# forward's [tokens, vocab] logits, which the memory predictions count.
LEAN_LOSS_FAMILIES = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3"}


def language_config(model_config: Any) -> Any:
    """The config of a model's decoder layers (their count, `layer_types`): its text config for a composite model
    (Fuyu: a language model under a multimodal config), else the model's own (None: None)."""
    return model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's decoder layers (transformers' `GradientCheckpointingLayer`s), in order."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def learned_positions(model: torch.nn.Module) -> int | None:
    """The positions `model`'s position table holds, the longest sequence its forward takes: a learned embedding named
    for positions beside the input embedding (GPT-2's `wpe`, OPT's `embed_positions`), less the rows before position
    0 (OPT's and BioGPT's `offset` of 2; RoBERTa's family numbers positions from its `padding_idx` + 1), or a fixed
    table of sines held as a buffer (GPT-J's and CodeGen's rotary `embed_positions`, CTRL's `pos_encoding`); None
    without one (Llama's RoPE computes its positions: no bound)."""
    import torch

    try:
        tokens = model.get_input_embeddings()
    except (AttributeError, NotImplementedError):  # (a module of the caller's own, not a transformers model)
        tokens = None
    sizes = [module.num_embeddings - getattr(module, "offset", 0)
             - (0 if module.padding_idx is None else module.padding_idx + 1) for name, module in model.named_modules()
             if isinstance(module, torch.nn.Embedding) and module is not tokens
             and any(word in name.rsplit(".", 1)[-1] for word in ("pos", "wpe"))]
    sizes += [table.shape[0] for name, table in model.named_buffers()  # (not BERT's integer position_ids [1, S])
              if "pos" in name.rsplit(".", 1)[-1] and table.dim() == 2 and table.is_floating_point()
              and table.shape[0] > 1]
    return min(sizes) if sizes else None
