import pytest
import torch
from transformers import AttentionInterface, AutoModelForCausalLM
from transformers.masking_utils import AttentionMaskInterface

import hf_sparse_cp
from hf_sparse_cp.integration import upstream
from hf_sparse_cp.integration.backend import sparse_cp_attention_forward
from hf_sparse_cp.integration.layer_settings import model_config_for
from hf_sparse_cp.testing.tiny_models import tiny_config


def test_patch_unpatch_round_trip():
    assert "sparse_cp" not in AttentionInterface()
    hf_sparse_cp.patch()
    hf_sparse_cp.patch()  # idempotent
    assert AttentionInterface()["sparse_cp"] is sparse_cp_attention_forward
    assert "sparse_cp" in AttentionMaskInterface()
    model = AutoModelForCausalLM.from_config(tiny_config("llama"), attn_implementation="sparse_cp")
    model(torch.randint(3, 259, (1, 20)))
    hf_sparse_cp.unpatch()
    assert "sparse_cp" not in AttentionInterface() and "sparse_cp" not in AttentionMaskInterface()
    assert not hf_sparse_cp.is_patched()
    with pytest.raises((KeyError, ValueError)):
        AutoModelForCausalLM.from_config(tiny_config("llama"), attn_implementation="sparse_cp")
    hf_sparse_cp.unpatch()  # a no-op when not patched


def test_unpatch_restores_a_previous_registration():
    def other(*args, **kwargs):
        raise AssertionError("not called")

    AttentionInterface.register("sparse_cp", other)
    try:
        hf_sparse_cp.patch()
        assert AttentionInterface()["sparse_cp"] is not other
        hf_sparse_cp.unpatch()
        assert AttentionInterface()["sparse_cp"] is other
    finally:
        upstream.unregister(AttentionInterface, "sparse_cp")


def test_configure_stores_config_on_the_model():
    hf_sparse_cp.patch()
    model = AutoModelForCausalLM.from_config(tiny_config("qwen2"))
    cfg = hf_sparse_cp.SparseAttentionConfig(slash_topk=3)
    hf_sparse_cp.configure(model, cfg)
    assert model.config._attn_implementation == "sparse_cp"
    assert model.config.sparse_attention["budget"]["slash_topk"] == 3
    layer = model.model.layers[1].self_attn
    assert model_config_for(layer) == cfg


def test_a_forward_after_unpatch_names_patch_instead_of_a_key_error():
    """Issue #31: transformers' KeyError from inside a layer said nothing of patch()."""
    hf_sparse_cp.patch()
    model = AutoModelForCausalLM.from_config(tiny_config("qwen2"))
    hf_sparse_cp.configure(model)
    ids = torch.randint(3, 259, (1, 20))
    model(ids)
    hf_sparse_cp.unpatch()
    with pytest.raises(RuntimeError, match=r"not registered with transformers in this process.*unpatch\(\) removed it.*"
                                           r"call hf_sparse_cp.patch\(\).*"
                                           r"set_attn_implementation\('sdpa'\)"):
        model(ids)
    hf_sparse_cp.patch()  # registered again: the model runs
    model(ids)
    model.set_attn_implementation("sdpa")
    hf_sparse_cp.unpatch()
    model(ids)  # another implementation: the guard stays out of the way


def test_configure_without_patch_names_patch():
    model = AutoModelForCausalLM.from_config(tiny_config("qwen2"))
    with pytest.raises(ValueError, match=r"not registered with transformers: call hf_sparse_cp.patch\(\) first"):
        hf_sparse_cp.configure(model)
    hf_sparse_cp.configure(model, select=False)  # the settings only
    assert model.config._attn_implementation != "sparse_cp" and model.config.sparse_attention is not None
