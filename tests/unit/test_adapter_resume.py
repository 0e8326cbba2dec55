"""A LoRA checkpoint resumed with other adapter settings is refused by `check_adapter_fits` before anything loads,
whichever form the checkpoint keeps the adapter in (the integration tier trains and resumes the runs): FSDP2 with a
sharded state dict type saves no adapter file, only the plugin's sharded state (or, where the plugin keeps
accelerate's save, its distributed checkpoint); and any PEFT model counts as one."""

import functools

import pytest
import torch
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from hf_sparse_cp.resharding.checkpoint import save_sharded_state
from hf_sparse_cp.resharding.resume import SHARDED_STATE, training_state
from hf_sparse_cp.testing.tiny_models import tiny_config
from hf_sparse_cp.trainer.checkpoints import check_adapter_fits, check_weights_fit

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


def _save_distributed_checkpoint(model, folder, optimizer_state: bool = True) -> None:
    """Accelerate's save of `model` under FSDP with a sharded state dict type (`save_fsdp_model` with the Trainer's
    adapter_only, `save_fsdp_optimizer`): distributed checkpoints of {"model": PEFT's state dict, or the whole model's}
    and, with `optimizer_state`, of {"optimizer": AdamW's state by the parameters' names}."""
    import torch.distributed.checkpoint as dist_cp

    weights = get_peft_model_state_dict(model) if hasattr(model, "peft_config") else model.state_dict()
    dist_cp.save({"model": weights}, storage_writer=dist_cp.FileSystemWriter(str(folder / "pytorch_model_fsdp_0")),
                 no_dist=True)
    if optimizer_state:
        state = {name: {"step": torch.tensor(1.0), "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
                 for name, p in model.named_parameters() if p.requires_grad}
        dist_cp.save({"optimizer": {"state": state}}, storage_writer=dist_cp.FileSystemWriter(
            str(folder / "optimizer_0")), no_dist=True)


SAVES = {"sharded_state": _save_sharded_state, "distributed_checkpoint": _save_distributed_checkpoint,
         "distributed_checkpoint_without_optimizer_state": functools.partial(_save_distributed_checkpoint,
                                                                             optimizer_state=False)}


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
                                         "as its (hf_sparse_cp_sharded_state|optimizer_0|pytorch_model_fsdp_0)/ "
                                         "shows; TRL: --lora_target_modules q_proj v_proj --lora_r 4\\)"):
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


@pytest.mark.parametrize("save", ["sharded_state", "distributed_checkpoint"])
def test_a_sharded_state_saved_with_other_modules_to_save_is_refused_naming_them(tmp_path, save):
    """Accelerate's distributed checkpoint names a module to save's copy as the base's module (PEFT's names), as a
    resized vocabulary's embedding weights: a resume without it passed, then trained the untrained lm_head. Its
    optimizer state names the copy."""
    SAVES[save](_model({**SAVED, "modules_to_save": ["lm_head"]}), tmp_path)
    with pytest.raises(ValueError, match="e.g. its .*lm_head.modules_to_save.default.weight is not in this run's "
                                         "adapter.*--lora_r 4 --lora_modules_to_save lm_head\\)"):
        check_adapter_fits(tmp_path, _model(SAVED))


def test_a_distributed_checkpoint_without_optimizer_state_names_what_its_weights_cannot_tell(tmp_path):
    """Without Adam's state (another optimizer), the saved weights alone name a module to save as the base's module: a
    dropped one is refused where it is no embedding, and a saved embedding (a module to save, or a resized
    vocabulary's) is named beside the settings the refusal gives, which left out --lora_modules_to_save."""
    _save_distributed_checkpoint(_model({**SAVED, "modules_to_save": ["o_proj"]}), tmp_path, optimizer_state=False)
    with pytest.raises(ValueError, match="1 differ; e.g. its base_model.model.model.layers.0.self_attn.o_proj.weight "
                                         "is not in this run's adapter.*--lora_modules_to_save o_proj\\)"):
        check_adapter_fits(tmp_path, _model(SAVED))
    _save_distributed_checkpoint(_model({**SAVED, "modules_to_save": ["lm_head"]}), tmp_path, optimizer_state=False)
    with pytest.raises(ValueError, match="--lora_target_modules q_proj v_proj --lora_r 4; its "
                                         "base_model.model.lm_head.weight too: --lora_modules_to_save lm_head where "
                                         "it was a module to save\\)"):
        check_adapter_fits(tmp_path, _model({**SAVED, "r": 8}))


def test_peft_switched_on_or_off_since_a_distributed_checkpoint_is_refused(tmp_path):
    """Accelerate's distributed checkpoint (FSDP with a sharded state dict type, without the plugin's sharded state): a
    full fine-tune's resumed with LoRA was described as an adapter of other settings, one of an adapter resumed without
    PEFT failed in accelerate's load (a missing key, on every rank)."""
    whole, adapter = tmp_path / "whole", tmp_path / "adapter"
    _save_distributed_checkpoint(_model(), whole)
    _save_distributed_checkpoint(_model(SAVED), adapter)
    with pytest.raises(ValueError, match="holds the whole model's weights \\(its parameters in "
                                         "pytorch_model_fsdp_0/\\) and no PEFT adapter"):
        check_adapter_fits(whole, _model(SAVED))
    check_adapter_fits(whole, _model(SAVED), marked=False)  # (not the plugin's: left to the Trainer, not misnamed)
    with pytest.raises(ValueError, match="holds a PEFT adapter \\(its parameters in pytorch_model_fsdp_0/\\) and not "
                                         "the whole model's weights.*TRL: --use_peft --lora_target_modules q_proj "
                                         "v_proj --lora_r 4\\)"):
        check_adapter_fits(adapter, _model())
    check_adapter_fits(whole, _model()), check_adapter_fits(adapter, _model(SAVED))


def test_a_mixed_peft_model_resuming_the_whole_models_weights_is_refused(tmp_path):
    """A PeftMixedModel (not a PeftModel) counted as a model without an adapter: a checkpoint of the whole model's
    weights passed, and the Trainer failed on the optimizer's parameter groups."""
    save_file({k: v.contiguous() for k, v in _model().state_dict().items() if k != "lm_head.weight"},
              tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="holds the whole model's weights \\(model.safetensors\\) and no PEFT adapter"):
        check_adapter_fits(tmp_path, _model(SAVED, mixed=True))
    check_adapter_fits(tmp_path, _model())  # (the model it was saved by resumes it)


def test_a_sharded_state_of_another_base_model_is_refused_as_another_models(tmp_path):
    """A LoRA run's sharded state whose base model differs (its vocabulary resized otherwise) was refused as an adapter
    of other settings, naming the run's own LoRA flags as the fix; then, its adapter's tensors alone compared, passed
    to the Trainer's traceback. It is another model's, as a model.safetensors of other shapes is."""
    _save_sharded_state(_model(SAVED, vocab=320), tmp_path)
    with pytest.raises(ValueError, match="was saved by another model: its base_model.model.model.embed_tokens.weight "
                                         "is \\[320, 128\\], this model's \\[\\d+, 128\\]"):
        check_weights_fit(tmp_path, _model(SAVED))
    check_weights_fit(tmp_path, _model(SAVED, vocab=320))
    check_weights_fit(tmp_path, _model({**SAVED, "r": 8}, vocab=320))  # (the adapter's: `check_adapter_fits`'s)
