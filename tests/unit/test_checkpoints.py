"""A LoRA checkpoint resumed with other adapter settings is refused by `check_adapter_fits` before anything loads,
whichever form the checkpoint keeps the adapter in (the integration tier trains and resumes the runs): FSDP2 with a
sharded state dict type saves no adapter file, only the plugin's sharded state (or, where the plugin keeps
accelerate's save, its distributed checkpoint); and any PEFT model counts as one."""

import pytest
import torch
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from hf_sparse_cp.resharding.checkpoint import save_sharded_state
from hf_sparse_cp.resharding.resume import SHARDED_STATE, training_state
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


def _save_sharded_state(model, folder) -> None:
    """The plugin's sharded state of `model`, as an FSDP2 run saves it under a sharded state dict type (no weights
    file)."""
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    save_sharded_state(training_state(model, optimizer), folder / SHARDED_STATE)


def _save_distributed_checkpoint(model, folder) -> None:
    """Accelerate's save of `model`'s adapter under FSDP with a sharded state dict type (`save_fsdp_model` with the
    Trainer's adapter_only): a distributed checkpoint of {"model": PEFT's state dict}."""
    import torch.distributed.checkpoint as dist_cp

    dist_cp.save({"model": get_peft_model_state_dict(model)}, storage_writer=dist_cp.FileSystemWriter(
        str(folder / "pytorch_model_fsdp_0")), no_dist=True)


SAVES = {"sharded_state": _save_sharded_state, "distributed_checkpoint": _save_distributed_checkpoint}


@pytest.mark.parametrize("save", SAVES)
@pytest.mark.parametrize("resumed, differs", [
    ({"target_modules": ["q_proj", "k_proj"]}, "its .*v_proj.lora_A.* is not in this run's adapter"),
    ({"r": 8}, "its .*q_proj.lora_A.* is \\[4, 128\\], this run's \\[8, 128\\]"),
], ids=["other_targets", "other_rank"])
def test_an_fsdp_sharded_lora_checkpoint_resumed_with_other_adapter_settings_is_refused(tmp_path, save, resumed,
                                                                                           differs):
    """FSDP2 with a sharded state dict type saves no adapter_model.safetensors: a resume with other target modules or
    rank failed on every rank (the sharded state's KeyError or size mismatch, the distributed checkpoint's missing
    keys). Refused as the adapter file is, with the settings its tensors show (it has no adapter_config.json), counting
    the adapter's tensors alone (4 of one layer's LoRA on two modules): the sharded state's count took in the base
    weights PEFT renames where the targets change (k_proj.weight, k_proj.base_layer.weight), "8 differ"."""
    SAVES[save](_model(SAVED), tmp_path)
    with pytest.raises(ValueError, match=f"holds a PEFT adapter with other tensors than this run's \\(4 differ; "
                                         f"e.g. {differs}\\).*Resume with the adapter settings it was saved with \\("
                                         "as its (hf_sparse_cp_sharded_state|pytorch_model_fsdp_0)/ shows; TRL: "
                                         "--lora_target_modules q_proj v_proj --lora_r 4\\)"):
        check_adapter_fits(tmp_path, _model({**SAVED, **resumed}))


@pytest.mark.parametrize("save", SAVES)
@pytest.mark.parametrize("lora, vocab", [
    (SAVED, None),
    ({**SAVED, "modules_to_save": ["lm_head"]}, None),
    ({"target_modules": ["q_proj", "v_proj", "embed_tokens"], "r": 4}, None),
    (SAVED, 320),
], ids=["same", "modules_to_save", "targeted_embeddings", "resized_embeddings"])
def test_an_fsdp_sharded_lora_checkpoint_resumed_with_its_settings_is_not_refused(tmp_path, save, lora, vocab):
    SAVES[save](_model(lora, vocab), tmp_path)
    check_adapter_fits(tmp_path, _model(lora, vocab))


def test_a_sharded_state_saved_with_other_modules_to_save_is_refused_naming_them(tmp_path):
    _save_sharded_state(_model({**SAVED, "modules_to_save": ["lm_head"]}), tmp_path)
    with pytest.raises(ValueError, match="e.g. its .*lm_head.modules_to_save.default.weight is not in this run's "
                                         "adapter.*--lora_r 4 --lora_modules_to_save lm_head\\)"):
        check_adapter_fits(tmp_path, _model(SAVED))


def test_a_mixed_peft_model_resuming_the_whole_models_weights_is_refused(tmp_path):
    """A PeftMixedModel (not a PeftModel) counted as a model without an adapter: a checkpoint of the whole model's
    weights passed, and the Trainer failed on the optimizer's parameter groups."""
    save_file({k: v.contiguous() for k, v in _model().state_dict().items() if k != "lm_head.weight"},
              tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="holds the whole model's weights \\(model.safetensors\\) and no PEFT adapter"):
        check_adapter_fits(tmp_path, _model(SAVED, mixed=True))
    check_adapter_fits(tmp_path, _model())  # (the model it was saved by resumes it)
