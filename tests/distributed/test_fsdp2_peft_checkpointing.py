"""A PEFT model under FSDP2 with FSDP's own activation checkpointing on CPU processes: it trained as one process does
(the same losses), then saved an adapter_model.safetensors without a tensor, which loads with a warning of missing
keys and leaves the adapter untrained. PEFT picks the adapter's weights by the names of the model's LoRA modules,
which the checkpoint wrapper renames (`layers.0._checkpoint_wrapped_module.self_attn...`), while the gathered state
dict keeps the plain names. The plugin refuses the pair as it builds the Trainer, naming --gradient_checkpointing (the
Trainer's checkpointing, whose adapters save whole: --activation_checkpointing in newer transformers)."""

import os
import re
import tempfile

import pytest
import torch
from fsdp2_runs import rows
from padding import pad_collate

REFUSAL = (r"^A PEFT model under FSDP's own activation checkpointing \(activation_checkpointing in the FSDP config\) "
           r"saves an adapter without weights .*: drop activation_checkpointing from the FSDP config and set the "
           r"Trainer's --gradient_checkpointing instead \(--activation_checkpointing where transformers has it\)\.$")


def _build(rank: int, world: int, source: str, kind: str) -> list[str]:
    from peft import LoraConfig, get_peft_model, inject_adapter_in_model
    from transformers import AutoModelForCausalLM

    from hf_sparse_cp import SparseTrainer, SparseTrainingArguments
    from hf_sparse_cp.testing.tiny_models import tiny_config

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    torch.manual_seed(0)
    model, lora = AutoModelForCausalLM.from_config(tiny_config("llama", vocab_size=97)), LoraConfig(
        r=4, target_modules=["q_proj"])
    if kind == "add_adapter":  # (transformers' PEFT integration: the model's own class, with PEFT's tuner layers)
        model.add_adapter(lora)
    elif kind == "injected":
        model = inject_adapter_in_model(lora, model)
    else:
        model = get_peft_model(model, lora, mixed=kind == "mixed")
    if source == "flags":
        fsdp = {"fsdp": "full_shard", "fsdp_config": {"fsdp_version": 2, "activation_checkpointing": True,
                                                      "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}}
    else:  # what `accelerate launch` passes on from a config's fsdp_activation_checkpointing: true
        fsdp = {}
        os.environ.update(ACCELERATE_USE_FSDP="true", FSDP_VERSION="2", FSDP_ACTIVATION_CHECKPOINTING="true")
    with tempfile.TemporaryDirectory() as tmp:
        args = SparseTrainingArguments(output_dir=tmp, report_to="none", use_cpu=True, max_steps=1,
                                       per_device_train_batch_size=1, save_strategy="no", sparse_attention=False,
                                       **fsdp)
        try:
            SparseTrainer(model=model, args=args, train_dataset=rows()[:2], data_collator=pad_collate)
        except ValueError as error:
            return [str(error)]
    return []


@pytest.mark.parametrize("source, kind", [("flags", "peft_model"), ("accelerate_config", "peft_model"),
                                          ("flags", "mixed"), ("flags", "add_adapter"), ("flags", "injected")])
def test_a_peft_model_under_fsdp_activation_checkpointing_is_refused_naming_gradient_checkpointing(source, kind):
    """A model whose adapter was added otherwise than as a `PeftModel` (a PeftMixedModel, transformers' `add_adapter`,
    PEFT's `inject_adapter_in_model`) is one too, as the checkpoint checks count it (`has_adapter`): it passed."""
    from hf_sparse_cp.testing.spawn import run_gloo

    for errors in run_gloo(_build, 2, source, kind, timeout_s=300):
        assert len(errors) == 1
        assert re.match(REFUSAL, errors[0]), errors[0]
