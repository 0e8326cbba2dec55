"""accelerate's FSDP2 auto-wrap policies on CPU processes, which failed in `train()` (after the processes had built
their data and model) with messages that named no fix: SIZE_BASED_WRAP with a `min_num_params` below a module
list's parameters selects the list (`model.layers`), which FSDP2 cannot shard ('fully_shard does not support
containers that do not implement forward: ModuleList(...)'); with one above the layers, the module holding the
embeddings, which accelerate then shards again inside it; a `transformer_layer_cls_to_wrap` naming no class of the
model ('Could not find the transformer layer class NoSuchLayer in the model.'). The plugin refuses them as the Trainer
is built, naming the fix; a `min_num_params` that wraps nothing but the root trains."""

import os
import re
import tempfile

import pytest
import torch
from fsdp2_runs import rows
from padding import pad_collate

LAYERS = r"use TRANSFORMER_BASED_WRAP with transformer_layer_cls_to_wrap \(this model's layers: LlamaDecoderLayer\)\.$"
CASES = {
    "size-list": ({"auto_wrap_policy": "SIZE_BASED_WRAP", "min_num_params": 1000},
                  r"^SIZE_BASED_WRAP's min_num_params \(1000\) wraps the module list model\.layers \(295424 "
                  r"parameters\), which accelerate's FSDP2 cannot shard: " + LAYERS),
    # (accelerate then shards the embeddings inside the sharded model: 'Invariant encountered: value was None')
    "size-embeddings": ({"auto_wrap_policy": "SIZE_BASED_WRAP", "min_num_params": 295424},
                        r"^SIZE_BASED_WRAP's min_num_params \(295424\) wraps the module holding the embeddings or LM "
                        r"head model \(307968 parameters\), which accelerate's FSDP2 cannot shard: " + LAYERS),
    "class": ({"auto_wrap_policy": "TRANSFORMER_BASED_WRAP", "transformer_layer_cls_to_wrap": ["NoSuchLayer"]},
              r"^Could not find the transformer layer class NoSuchLayer in the model: name a class of the model's "
              r"layers in transformer_layer_cls_to_wrap \(this model's layers: LlamaDecoderLayer\)\.$"),
    "size-above-the-model": ({"auto_wrap_policy": "SIZE_BASED_WRAP", "min_num_params": 10**8}, None),
}


def _build(rank: int, world: int, case: str) -> list[str]:
    from transformers import AutoModelForCausalLM

    from hf_sparse_cp import SparseTrainer, SparseTrainingArguments
    from hf_sparse_cp.testing.tiny_models import tiny_config

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama", vocab_size=97))
    with tempfile.TemporaryDirectory() as tmp:
        args = SparseTrainingArguments(output_dir=tmp, report_to="none", use_cpu=True, max_steps=1,
                                       per_device_train_batch_size=1, save_strategy="no", sparse_attention=False,
                                       fsdp="full_shard", fsdp_config={"fsdp_version": 2, **CASES[case][0]})
        try:
            trainer = SparseTrainer(model=model, args=args, train_dataset=rows()[:2], data_collator=pad_collate)
        except ValueError as error:
            return [str(error)]
        trainer.train()  # (min_num_params above the model: the root alone is sharded, the run trains)
    return []


@pytest.mark.parametrize("case", list(CASES))
def test_an_auto_wrap_policy_that_fsdp2_fails_on_is_refused_as_the_trainer_is_built(case):
    from hf_sparse_cp.testing.spawn import run_gloo

    message = CASES[case][1]
    for errors in run_gloo(_build, 2, case, timeout_s=300):
        assert (errors == []) if message is None else (len(errors) == 1 and re.match(message, errors[0])), errors



def _build_as_on_an_accelerator(rank: int, world: int, how: str) -> list[str]:
    """`how`'s Trainer built with the size-list policy, accelerate giving its state the FSDP2 plugin and run type it
    builds from --fsdp_config on a GPU (where the plugin's CPU switch does nothing): the errors raised."""
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    from hf_sparse_cp import SparseCPArguments, SparseTrainer, SparseTrainingArguments, attach_to_trainer
    from hf_sparse_cp.testing.tiny_models import tiny_config

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    build = Trainer.create_accelerator_and_postprocess

    def as_on_an_accelerator(self):
        build(self)
        self.accelerator.state.fsdp_plugin = FullyShardedDataParallelPlugin(**self.args.fsdp_plugin_args)
        self.accelerator.state.distributed_type = DistributedType.FSDP

    Trainer.create_accelerator_and_postprocess = as_on_an_accelerator  # (this process only)
    model = AutoModelForCausalLM.from_config(tiny_config("llama", vocab_size=97))
    with tempfile.TemporaryDirectory() as tmp:
        args = dict(output_dir=tmp, report_to="none", use_cpu=True, max_steps=1, save_strategy="no",
                    fsdp="full_shard", fsdp_config={"fsdp_version": 2, **CASES["size-list"][0]})
        try:
            if how == "SparseTrainer":
                SparseTrainer(model=model, args=SparseTrainingArguments(sparse_attention=False, **args),
                              train_dataset=rows()[:2], data_collator=pad_collate)
            else:
                trainer = Trainer(model=model, args=TrainingArguments(**args), train_dataset=rows()[:2],
                                  data_collator=pad_collate)
                attach_to_trainer(trainer, SparseCPArguments(sparse_attention=False))
        except ValueError as error:
            return [str(error)]
    return []


@pytest.mark.parametrize("how", ["SparseTrainer", "attach_to_trainer"])
def test_accelerates_own_fsdp2_is_checked_as_the_trainer_is_built(how):
    """On accelerators accelerate runs FSDP2 itself, and the plugin checked the model only where it ran FSDP2 on CPU
    processes: a GPU run met the same failures in train(), naming no fix. Its own FSDP2 is checked too."""
    from hf_sparse_cp.testing.spawn import run_gloo

    for errors in run_gloo(_build_as_on_an_accelerator, 2, how, timeout_s=300):
        assert len(errors) == 1 and re.match(CASES["size-list"][1], errors[0]), errors


def _build_from_accelerate_variables(rank: int, world: int, policy: str | None) -> list[str]:
    """A Trainer built and trained one step under what `accelerate launch` passes on from a config with
    fsdp_activation_checkpointing: true and `policy` as fsdp_auto_wrap_policy (None: the key left out)."""
    from transformers import AutoModelForCausalLM

    from hf_sparse_cp import SparseTrainer, SparseTrainingArguments
    from hf_sparse_cp.testing.tiny_models import tiny_config

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      ACCELERATE_USE_FSDP="true", FSDP_VERSION="2", FSDP_ACTIVATION_CHECKPOINTING="true")
    if policy is not None:
        os.environ["FSDP_AUTO_WRAP_POLICY"] = policy
    model = AutoModelForCausalLM.from_config(tiny_config("llama", vocab_size=97))
    with tempfile.TemporaryDirectory() as tmp:
        args = SparseTrainingArguments(output_dir=tmp, report_to="none", use_cpu=True, max_steps=1,
                                       per_device_train_batch_size=1, save_strategy="no", sparse_attention=False)
        try:
            trainer = SparseTrainer(model=model, args=args, train_dataset=rows()[:2], data_collator=pad_collate)
        except ValueError as error:
            return [str(error)]
        trainer.train()
    return []


@pytest.mark.parametrize("policy", [None, "TRANSFORMER_BASED_WRAP"])
def test_fsdp_activation_checkpointing_without_an_auto_wrap_policy_is_refused_naming_one(policy):
    """accelerate's FSDP2 checkpoints the modules its auto-wrap policy wraps: an accelerate config with
    fsdp_activation_checkpointing and no fsdp_auto_wrap_policy failed in train() ("'NoneType' object is not
    callable"). Refused as the Trainer is built, naming the policy; with one it trains."""
    from hf_sparse_cp.testing.spawn import run_gloo

    for errors in run_gloo(_build_from_accelerate_variables, 2, policy, timeout_s=300):
        if policy is None:
            assert len(errors) == 1 and re.match(
                r"^FSDP's own activation checkpointing \(activation_checkpointing\) checkpoints the modules the "
                r"auto-wrap policy wraps, and none is set .*: set fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP in "
                r"the accelerate config \(FSDP_AUTO_WRAP_POLICY\), or \"auto_wrap_policy\": \"TRANSFORMER_BASED_WRAP\" "
                r"in --fsdp_config \(its default; NO_WRAP wraps nothing\); or drop activation_checkpointing and set "
                r"--gradient_checkpointing\.$", errors[0]), errors
        else:
            assert errors == []
