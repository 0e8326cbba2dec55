"""One architecture table (`integration/architectures.py`) that the lean loss, the token tiles, the record of
changes (`compat.PATCHES`) and the CP checks read; and layers that mix tokens outside attention found by what
they do, not by their class name."""

import pytest
import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM

import hf_sparse_cp
from hf_sparse_cp.integration import compat
from hf_sparse_cp.integration.architectures import (
    ARCHITECTURES,
    cp_tested_model_types,
    lean_loss_classes,
    lean_loss_model_types,
    rowwise_classes,
)
from hf_sparse_cp.integration.lean_loss import disable_lean_loss, enable_lean_loss
from hf_sparse_cp.integration.memory_savers import rowwise_modules
from hf_sparse_cp.integration.models import _token_mixers, check_model_supports_context_parallel
from hf_sparse_cp.testing.tiny_models import tiny_config


def test_the_table_is_what_the_lean_loss_the_tiles_and_compat_read():
    stock = {name: getattr(transformers, name).forward for name in lean_loss_classes()}
    enable_lean_loss()
    try:
        assert all(getattr(transformers, name).forward is not forward for name, forward in stock.items())
        assert transformers.GPT2LMHeadModel.forward is transformers.GPT2LMHeadModel.__dict__["forward"]
    finally:
        disable_lean_loss()
    assert all(getattr(transformers, name).forward is forward for name, forward in stock.items())
    listed = {p.qualified for p in compat.PATCHES}
    assert {f"{module}.{name}.forward" for name, (module, _) in rowwise_classes().items()} <= listed
    for model_type in lean_loss_model_types():  # every family's tiles are its own MLP and RMSNorms
        model = AutoModelForCausalLM.from_config(tiny_config(model_type))
        assert {type(m).__name__ for _, m in rowwise_modules(model)} == set(ARCHITECTURES[model_type].rowwise)
    assert set(lean_loss_model_types()) <= set(cp_tested_model_types())
    assert {"gemma", "cohere", "gpt_neox", "starcoder2", "phi", "mixtral", "gpt2"} <= set(cp_tested_model_types())
    assert "olmo" not in ARCHITECTURES


def _gpt2() -> torch.nn.Module:
    config = AutoConfig.for_model("gpt2", n_layer=2, n_embd=64, n_head=4, vocab_size=259, n_positions=1024,
                                  bos_token_id=1, eos_token_id=2)
    model = AutoModelForCausalLM.from_config(config)
    hf_sparse_cp.configure(model)
    return model


@pytest.mark.parametrize("kernel, mixes", [(1, False), (4, True)])
def test_a_convolution_mixes_tokens_when_its_kernel_spans_positions(kernel, mixes):
    """GPT-2's `Conv1D` is a linear layer (each token on its own): no token mixer, so GPT-2 passes the CP
    checks; a convolution of kernel 1 is per token too, one of kernel 4 mixes
    the positions it spans, whatever its class is named."""
    hf_sparse_cp.patch()
    model = _gpt2()
    assert _token_mixers(model) == []
    check_model_supports_context_parallel(model)
    model.transformer.h[0].add_module("short_conv", torch.nn.Conv1d(64, 64, kernel_size=kernel, groups=64))
    found = _token_mixers(model)
    assert bool(found) == mixes and (not found or "transformer.h.0.short_conv" in found[0])
    if mixes:
        with pytest.raises(ValueError, match="mixes tokens outside attention \\(Conv1d of kernel \\(4,\\)"):
            check_model_supports_context_parallel(model)


def test_the_plugin_knows_when_every_parameter_gets_a_gradient():
    """`ddp_find_unused_parameters` is set to False where this holds (issue #52: DDP warned at every CP run)."""
    from hf_sparse_cp.integration.architectures import uses_every_parameter

    assert uses_every_parameter(tiny_config("llama")) and uses_every_parameter(tiny_config("qwen2"))
    assert not uses_every_parameter(tiny_config("mixtral"))  # an expert may get no token
    assert not uses_every_parameter(AutoConfig.for_model("bert"))  # not a tested causal LM
