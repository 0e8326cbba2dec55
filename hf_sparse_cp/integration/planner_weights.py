"""The document planner's weight of a token's linear work, counted from the model it plans for.

The planner (`distributed/split/documents.py`) balances each rank's attention work plus `linear_per_token`
times its tokens, both in attention token pairs (one query against one key: 4 x heads x head_dim FLOPs
forward), the linear work in time (`document_costs.linear_weight`). It grows with the model's width: about 4,600
pairs for Qwen2.5-0.5B, 14,100 for Qwen2.5-7B. One fixed weight misplaces tokens for other sizes (the former 9,000:
on long-tail 256K rows at CP 8-32, the busiest rank 1.052x the mean for Qwen2.5-7B and 1.060x for 0.5B, against
1.017x and 1.032x with their own weights), so it is counted from the model unless `--cp_planner_linear_per_token`
sets it.
"""

from __future__ import annotations

import logging

import torch

from ..config.model_fields import EXPERT_COUNTS, decoder_layers, language_config
from ..distributed.split.document_costs import linear_weight

logger = logging.getLogger(__name__)


def _active_share(config, name: str) -> float:
    """The share of tokens a weight called `name` sees: top-k of the experts for a routed expert's, else 1."""
    if "experts" not in name.split("."):
        return 1.0
    experts = next((getattr(config, field) for field in EXPERT_COUNTS if getattr(config, field, None)), None)
    top_k = getattr(config, "num_experts_per_tok", None)
    return top_k / experts if experts and top_k else 1.0


def _pair_flops(config) -> int | None:
    """Forward FLOPs of one attention token pair: 2 x query heads x (query-key width + value width); 4 x heads x
    head_dim, or with multi-head latent attention's wider queries and keys (DeepSeek: qk_head_dim, v_head_dim)."""
    heads = getattr(config, "num_attention_heads", None)
    head_dim = getattr(config, "head_dim", None) or (getattr(config, "hidden_size", None) or 0) // (heads or 1)
    if not heads or not head_dim:
        return None
    nope, rope = getattr(config, "qk_nope_head_dim", None), getattr(config, "qk_rope_head_dim", None)
    qk = getattr(config, "qk_head_dim", None) or (nope + rope if nope and rope else head_dim)
    return 2 * heads * (qk + (getattr(config, "v_head_dim", None) or head_dim))


def linear_flop_pairs(model: torch.nn.Module) -> float | None:
    """2 x the weights a token meets in one decoder layer's matrix products (a routed expert's by its top-k share;
    the LM head's spread over the layers), the mean over the layers, in attention token pairs (`_pair_flops`).
    None where the model has no decoder layers or no head count to measure against."""
    config = language_config(getattr(model, "config", None))
    # (the language model's layers: a vision tower's see image patches, not the text tokens the planner places)
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    layers = decoder_layers(decoder if isinstance(decoder, torch.nn.Module) else model)
    pair = _pair_flops(config) if layers else None
    if pair is None:
        return None
    weights = sum(p.numel() * _active_share(config, name)
                  for layer in layers for name, p in layer.named_parameters() if p.dim() >= 2)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    head_weights = head.weight.numel() if isinstance(getattr(head, "weight", None), torch.Tensor) else 0
    return 2 * (weights + head_weights) / len(layers) / pair


def planned_linear_weight(model: torch.nn.Module, config) -> float | None:
    """The planner's linear weight counted from `model` where `config` (a `ContextParallelConfig`) plans documents
    and sets none of its own (logged), else None: what `ParallelDims.from_config(model_linear_per_token=...)` takes."""
    if not config.plans_documents or config.cp_planner_linear_per_token is not None:
        return None
    pairs = linear_flop_pairs(model)
    if pairs is None:
        logger.info("document planner: no decoder layers or head count to weigh the linear layers by; it takes "
                    "--cp_planner_linear_per_token's default.")
        return None
    weight = linear_weight(pairs)
    logger.info("document planner: the model's linear layers weigh %.0f attention token pairs per token "
                "(--cp_planner_linear_per_token sets another weight).", weight)
    return weight
