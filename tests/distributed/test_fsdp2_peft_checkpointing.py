"""A PEFT model under FSDP2 with FSDP's own activation checkpointing on CPU processes. With PEFT 0.21 it trained as
one process does (the same losses), then saved an adapter_model.safetensors without a tensor, which loads with a
warning of missing keys and leaves the adapter untrained: PEFT picked the adapter's weights by the names of the
model's LoRA modules, which the checkpoint wrapper renames (`layers.0._checkpoint_wrapped_module.self_attn...`), while
the gathered state dict keeps the plain names. PEFT 0.22 saves them (measured: 0.21.2 no tensor, 0.22.0 the four
trained ones). The plugin refuses the pair under an older PEFT as it builds the Trainer, naming the upgrade and
--gradient_checkpointing (the Trainer's checkpointing, whose adapters save whole: --activation_checkpointing in newer
transformers)."""

import os
import re
import tempfile

import pytest
import torch
from fsdp2_runs import rows
from padding import pad_collate

REFUSAL = (r"^A PEFT model under FSDP's own activation checkpointing \(activation_checkpointing in the FSDP config\) "
           r"saves an adapter without weights with PEFT 0\.21\.2 .*: upgrade PEFT to 0\.22 or newer, or drop "
           r"activation_checkpointing from the FSDP config and set the Trainer's --gradient_checkpointing instead "
           r"\(--activation_checkpointing where transformers has it\)\.$")


def _trainer(rank: int, world: int, source: str, kind: str, output_dir: str):
    from peft import LoraConfig, get_peft_model, inject_adapter_in_model
    from transformers import AutoModelForCausalLM

    from hf_sparse_cp import SparseTrainer, SparseTrainingArguments
    from hf_sparse_cp.testing.tiny_models import tiny_config

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    torch.manual_seed(0)
    model, lora = AutoModelForCausalLM.from_config(tiny_config("llama", vocab_size=97)), LoraConfig(
        r=4, target_modules=["q_proj"])
    if kind == "injected":  # (tuner layers in the model's own class: the model saves whole)
        model = inject_adapter_in_model(lora, model)
    else:
        model = get_peft_model(model, lora, mixed=kind == "mixed")
    if source == "flags":
        fsdp = {"fsdp": "full_shard", "fsdp_config": {"fsdp_version": 2, "activation_checkpointing": True,
                                                      "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}}
    else:  # what `accelerate launch` passes on from a config's fsdp_activation_checkpointing: true
        fsdp = {}
        os.environ.update(ACCELERATE_USE_FSDP="true", FSDP_VERSION="2", FSDP_ACTIVATION_CHECKPOINTING="true")
    args = SparseTrainingArguments(output_dir=output_dir, report_to="none", use_cpu=True, max_steps=1,
                                   learning_rate=1e-2, per_device_train_batch_size=1, save_strategy="no",
                                   sparse_attention=False, **fsdp)
    return SparseTrainer(model=model, args=args, train_dataset=rows()[:2], data_collator=pad_collate)


def _build_under_old_peft(rank: int, world: int, source: str, kind: str) -> list[str]:
    import peft

    peft.__version__ = "0.21.2"  # (this process's only: the release that saved no weights)
    with tempfile.TemporaryDirectory() as tmp:
        try:
            _trainer(rank, world, source, kind, tmp)
        except ValueError as error:
            return [str(error)]
    return []


@pytest.mark.parametrize("source, kind", [("flags", "peft_model"), ("accelerate_config", "peft_model"),
                                          ("flags", "mixed"), ("flags", "injected")])
def test_a_peft_model_under_fsdp_activation_checkpointing_and_old_peft_is_refused_naming_the_fixes(source, kind):
    """PEFT 0.21's save of a PeftModel / PeftMixedModel kept no weight; a model with injected tuner layers saves whole
    (its LoRA weights kept under 0.21.2 too) and is left to train."""
    from hf_sparse_cp.testing.spawn import run_gloo

    for errors in run_gloo(_build_under_old_peft, 2, source, kind, timeout_s=300):
        if kind == "injected":
            assert errors == []
        else:
            assert len(errors) == 1
            assert re.match(REFUSAL, errors[0]), errors[0]


def _train_and_save(rank: int, world: int) -> dict | None:
    from safetensors.torch import load_file

    with tempfile.TemporaryDirectory() as tmp:
        trainer = _trainer(rank, world, "flags", "peft_model", tmp)
        trainer.train()
        trainer.save_model(f"{tmp}/out")
        trained = {name: p.full_tensor() if hasattr(p, "full_tensor") else p.detach().clone()
                   for name, p in trainer.model.named_parameters() if "lora_" in name}
        if rank:
            return None
        return {"saved": load_file(f"{tmp}/out/adapter_model.safetensors"), "trained": trained}


def test_a_peft_model_under_fsdp_activation_checkpointing_saves_its_trained_adapter_under_current_peft():
    """Where the installed PEFT is 0.22 or newer the pair trains and saves every LoRA weight as trained (PEFT 0.21.2
    saved none: the refusal above)."""
    from hf_sparse_cp.integration.compat_checks import release
    from hf_sparse_cp.testing.spawn import run_gloo
    from hf_sparse_cp.trainer.cpu_fsdp import PEFT_SAVES_WRAPPED_ADAPTERS

    if release("peft") < PEFT_SAVES_WRAPPED_ADAPTERS:
        pytest.skip(f"PEFT {'.'.join(map(str, release('peft')))} is refused (the test above)")
    out = run_gloo(_train_and_save, 2, timeout_s=300)[0]
    saved, trained = out["saved"], out["trained"]
    assert len(saved) == len(trained) == 4  # (A and B of q_proj in the tiny model's 2 layers)
    for name, weight in trained.items():
        key = re.sub(r"\._checkpoint_wrapped_module|\.default", "", name)
        assert key in saved, (key, sorted(saved))
        torch.testing.assert_close(saved[key], weight.to(saved[key].dtype), rtol=0, atol=0)
    assert any(weight.abs().max() > 0 for name, weight in trained.items() if "lora_B" in name)  # (trained: B starts 0)
