"""The document planner's linear weight counted from the model it plans for (`integration/planner_weights.py`): the
count against the simulator's shape formula, routed experts by their top-k share, multi-head latent attention's
wider pairs, which settings take it, and that the simulator plans with it (training's layouts:
tests/distributed/test_cp_documents.py)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from hf_sparse_cp.distributed import ContextParallelConfig
from hf_sparse_cp.distributed.split.document_costs import ATTENTION_RATE_SHARE, PlannerCosts, linear_weight
from hf_sparse_cp.integration.planner_weights import linear_flop_pairs, planned_linear_weight
from hf_sparse_cp.simulator.shapes import MODELS, ModelShape
from hf_sparse_cp.testing.tiny_models import tiny_config


def _meta_model(config):
    with torch.device("meta"):  # (shapes only)
        return AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("tied", [False, True])
def test_the_count_is_the_layers_matrix_products_and_a_share_of_the_lm_head(tied):
    """A Qwen2 model's count equals the shape formula the simulator uses (attention projections, the gated MLP, the
    LM head over the layers), tied embeddings or not (the head's product runs either way); the biases and norms are
    not matrix products."""
    config = tiny_config("qwen2", num_hidden_layers=3, tie_word_embeddings=tied)
    shape = ModelShape.from_config(config)
    assert linear_flop_pairs(_meta_model(config)) == pytest.approx(shape.linear_flop_pairs, rel=1e-12)
    # the preset's figure as the flag's help gives it (Qwen2.5-7B: 35,227 pairs by FLOPs, in time x 0.4)
    assert round(linear_weight(MODELS["qwen2.5-7b"].linear_flop_pairs)) == 14091


@pytest.mark.parametrize("model_type", ["gemma3", "llava"])
def test_a_vision_language_model_counts_its_language_model_alone(model_type):
    """The vision tower's layers (image patches) are not counted: the count is its language model's as a causal LM."""
    from transformers import AutoModelForImageTextToText

    from hf_sparse_cp.testing.tiny_vlms import tiny_vlm_config

    config = tiny_vlm_config(model_type)
    with torch.device("meta"):
        vlm = AutoModelForImageTextToText.from_config(config)
    text = _meta_model(config.get_text_config())
    assert linear_flop_pairs(vlm) == pytest.approx(linear_flop_pairs(text), rel=1e-12)


def test_routed_experts_count_by_the_share_of_tokens_they_see():
    """Twice the experts at the same top-k: a token meets as many expert weights, and only the router grows."""
    small, large = (tiny_config("mixtral", num_hidden_layers=2, num_local_experts=e, num_experts_per_tok=2)
                    for e in (4, 8))
    router = 4 * small.hidden_size  # the 4 more experts' rows of the router, per layer
    pair = 4 * small.num_attention_heads * small.head_dim
    grown = linear_flop_pairs(_meta_model(large)) - linear_flop_pairs(_meta_model(small))
    assert grown == pytest.approx(2 * router / pair, rel=1e-9)


def test_latent_attention_pairs_count_the_wider_queries_and_keys():
    """DeepSeek's queries and keys are qk_nope + qk_rope wide and its values v_head_dim, not head_dim: a pair costs
    2 x heads x (qk + v) FLOPs."""
    config = tiny_config("deepseek_v3", num_hidden_layers=2)
    model = _meta_model(config)
    qk, v = config.qk_nope_head_dim + config.qk_rope_head_dim, config.v_head_dim
    assert qk != config.head_dim
    weights = sum(p.numel() * (config.num_experts_per_tok / config.n_routed_experts if ".experts." in f".{n}" else 1)
                  for layer in model.model.layers for n, p in layer.named_parameters() if p.dim() >= 2)
    expected = 2 * (weights / 2 + model.lm_head.weight.numel() / 2) / (2 * config.num_attention_heads * (qk + v))
    assert linear_flop_pairs(model) == pytest.approx(expected, rel=1e-12)


def test_the_models_weight_serves_only_where_documents_are_planned_and_no_weight_is_given():
    model = _meta_model(tiny_config("qwen2", num_hidden_layers=2))
    counted = ATTENTION_RATE_SHARE * linear_flop_pairs(model)
    assert planned_linear_weight(model, ContextParallelConfig(cp_sharding="document")) == pytest.approx(counted)
    assert planned_linear_weight(model, ContextParallelConfig()) is None  # (striped: no planner)
    given = ContextParallelConfig(cp_sharding="document", cp_planner_linear_per_token=123.0)
    assert planned_linear_weight(model, given) is None
    # the flag's weight wins, then the model's, then the planner's default
    assert given.planner_costs(counted).linear_per_token == 123.0
    assert ContextParallelConfig(cp_sharding="document").planner_costs(counted).linear_per_token == counted
    assert ContextParallelConfig(cp_sharding="document").planner_costs() == PlannerCosts()
    with pytest.raises(ValueError, match=r"cp_planner_linear_per_token=-1.0 must be finite and >= 0 \(a cost in "
                                         r"attention token pairs; default counted from the model\)"):
        ContextParallelConfig(cp_sharding="document", cp_planner_linear_per_token=-1.0)


def test_a_model_without_decoder_layers_or_sizes_leaves_the_default():
    """No transformers config, or one without head sizes, or no decoder layers: no count, the planner's default."""
    document = ContextParallelConfig(cp_sharding="document")
    headless = torch.nn.Module()
    headless.config = type("Sizes", (), {"num_attention_heads": 4, "get_text_config": lambda self: self})()
    for model in (torch.nn.Linear(2, 2), headless):
        assert linear_flop_pairs(model) is None and planned_linear_weight(model, document) is None
    assert document.planner_costs(None) == PlannerCosts()


def test_the_simulator_plans_with_the_simulated_models_weight():
    from hf_sparse_cp.simulator.simulate_cli import parse_args, workload_for

    args = parse_args(["--model", "qwen2.5-7b", "--mix", "long-tail", "--seq", "65536", "--cp", "8"])
    for name in ("qwen2.5-0.5b", "qwen2.5-7b"):
        workload = workload_for(args, 65536, MODELS[name])
        assert workload.planner_costs.linear_per_token == linear_weight(MODELS[name].linear_flop_pairs)
