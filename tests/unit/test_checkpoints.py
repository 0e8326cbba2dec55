"""A checkpoint that does not fit a PEFT run is refused by `check_adapter_fits` before anything loads (the integration
tier trains and resumes the runs): any PEFT model counts as one."""

import pytest
import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from hf_sparse_cp.testing.tiny_models import tiny_config
from hf_sparse_cp.trainer.checkpoints import check_adapter_fits

SAVED = {"target_modules": ["q_proj", "v_proj"], "r": 4}


def _model(lora: dict | None = None, vocab: int | None = None, mixed: bool = False):
    """A tiny Llama (its vocabulary resized to `vocab`), with LoRA adapters of the settings `lora` (a PeftMixedModel
    where `mixed`)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama", num_hidden_layers=1))
    if vocab is not None:
        model.resize_token_embeddings(vocab)
    if lora is None:
        return model
    return get_peft_model(model, LoraConfig(lora_dropout=0.0, task_type="CAUSAL_LM", **lora), mixed=mixed)


def test_a_mixed_peft_model_resuming_the_whole_models_weights_is_refused(tmp_path):
    """A PeftMixedModel (not a PeftModel) counted as a model without an adapter: a checkpoint of the whole model's
    weights passed, and the Trainer failed on the optimizer's parameter groups."""
    save_file({k: v.contiguous() for k, v in _model().state_dict().items() if k != "lm_head.weight"},
              tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="holds the whole model's weights \\(model.safetensors\\) and no PEFT adapter"):
        check_adapter_fits(tmp_path, _model(SAVED, mixed=True))
    check_adapter_fits(tmp_path, _model())  # (the model it was saved by resumes it)
