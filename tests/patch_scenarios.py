"""One scenario per change that `compat.PATCHES` lists: build what the change applies to, make the change
through the feature that makes it, and undo it through that feature's undo call.

A scenario is a generator: it yields the (owner, member) pairs it changes, then yields once more with the
change applied, then undoes it. `round_trip` runs one and reports, per pair, whether the change took and
whether undoing restored exactly what was there (the same object, or its absence). One-process scenarios
run in tests/unit/test_patch_registry.py, the others on 2 gloo processes in
tests/distributed/test_patch_registry_cp.py; that every changing entry has a scenario is tested too.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import tempfile
from collections.abc import Callable, Iterator, Mapping

import pytest
import torch
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

import hf_sparse_cp
from hf_sparse_cp.integration.architectures import (
    KV_SHARED_SLICER,
    kv_shared_slicers,
    lean_loss_model_types,
    router_loss_modules,
    rowwise_classes,
)
from hf_sparse_cp.integration.trainer_losses import GENERATING
from hf_sparse_cp.testing.tiny_models import tiny_config

_MISSING = object()


def _value(owner, name: str):
    """What `owner` holds under `name` itself (not inherited): a mapping's item, an object's own attribute;
    a list as a tuple, so that a later change to it shows; a dict as its identity and items (one replaced by an
    equal one shows too)."""
    if name == "__class__":
        return type(owner)
    value = owner.get(name, _MISSING) if isinstance(owner, Mapping) else vars(owner).get(name, _MISSING)
    if isinstance(value, dict):
        return id(value), *value.items()
    return tuple(value) if isinstance(value, list) else value


def _same(a, b) -> bool:
    return a == b if isinstance(a, tuple) else a is b


def round_trip(scenario: Callable[[], Iterator]) -> list[tuple[str, bool, bool]]:
    """(owner.member, changed when applied, restored when undone) for each pair the scenario changes."""
    steps = scenario()
    targets = next(steps)
    before = [_value(o, n) for o, n in targets]
    next(steps)
    during = [_value(o, n) for o, n in targets]
    next(steps, None)
    after = [_value(o, n) for o, n in targets]
    return [(f"{type(o).__name__}.{n}", not _same(b, d), _same(b, a))
            for (o, n), b, d, a in zip(targets, before, during, after)]


def _args(tmp: str, **kw) -> TrainingArguments:
    return TrainingArguments(output_dir=tmp, report_to="none", save_strategy="no", use_cpu=True, **kw)


def _sparse_trainer(tmp: str, **kw) -> Trainer:
    hf_sparse_cp.patch()
    model = AutoModelForCausalLM.from_config(tiny_config("llama"))
    hf_sparse_cp.configure(model)
    return Trainer(model=model, args=_args(tmp, **kw))


# ---- one process ----

def attach() -> Iterator:
    from hf_sparse_cp import SparseCPArguments, attach_to_trainer, detach_from_trainer

    with tempfile.TemporaryDirectory() as tmp:
        trainer = _sparse_trainer(tmp)
        yield [(trainer, "train"), (trainer, "_save_optimizer_and_scheduler"), (trainer, "_save_checkpoint"),
               (trainer, "training_step"),
               (trainer, "evaluation_loop"), (trainer.callback_handler, "callbacks"),
               (trainer.accelerator, "prepare_model")]
        attach_to_trainer(trainer, SparseCPArguments(sparse_attention=True))
        yield
        detach_from_trainer(trainer)


def jit_checkpoint() -> Iterator:
    import signal

    from hf_sparse_cp import SparseCPArguments, attach_to_trainer, detach_from_trainer

    with tempfile.TemporaryDirectory() as tmp:
        trainer = _sparse_trainer(tmp, enable_jit_checkpoint=True)
        manager = next(c.jit_manager for c in trainer.callback_handler.callbacks if getattr(c, "jit_manager", None))
        yield [(manager, "_enable_checkpoint")]
        attach_to_trainer(trainer, SparseCPArguments(sparse_attention=True))
        yield
        detach_from_trainer(trainer)
        signal.signal(signal.SIGTERM, manager._original_sigterm_handler)  # (the Trainer's, until its train() ends)


def resharded_loading() -> Iterator:
    from hf_sparse_cp.resharding.resume import resharded_loading as loading

    with tempfile.TemporaryDirectory() as tmp:
        trainer = _sparse_trainer(tmp)
        yield [(trainer, "_load_from_checkpoint"), (trainer, "_load_optimizer_and_scheduler")]
        with loading(trainer):
            yield


def first_rank_rng_loading() -> Iterator:
    from hf_sparse_cp.trainer.checkpoints import first_rank_rng_loading as loading

    with tempfile.TemporaryDirectory() as tmp:
        trainer = _sparse_trainer(tmp)
        yield [(trainer, "_load_rng_state")]
        with loading(trainer):
            yield


def smet() -> Iterator:
    from hf_sparse_cp import install_smet, uninstall_smet
    from hf_sparse_cp.smet import SMETConfig

    with tempfile.TemporaryDirectory() as tmp:
        trainer = _sparse_trainer(tmp)
        yield [(trainer, "optimizer_cls_and_kwargs"), (trainer.callback_handler, "callbacks")]
        install_smet(trainer, SMETConfig(density=0.5))
        yield
        uninstall_smet(trainer)


def lean_loss() -> Iterator:
    import transformers

    from hf_sparse_cp import disable_lean_loss, enable_lean_loss
    from hf_sparse_cp.integration.architectures import lean_loss_classes

    yield [(getattr(transformers, name), "forward") for name in lean_loss_classes()]
    enable_lean_loss()
    yield
    disable_lean_loss()


def memory_savers() -> Iterator:
    from hf_sparse_cp.integration.memory_savers import disable_memory_savers, enable_memory_savers
    from hf_sparse_cp.memory import MemorySavers

    models = [AutoModelForCausalLM.from_config(tiny_config(kind)) for kind in lean_loss_model_types()]
    yield [(m, "forward") for model in models
           for m in (model.model.layers[0], model.model.layers[0].mlp, model.model.layers[0].input_layernorm)]
    for model in models:
        enable_memory_savers(model, MemorySavers(tiled=True, offload_layer_inputs=True))
    yield
    for model in models:
        disable_memory_savers(model)


def compiled_norms_and_mlps() -> Iterator:
    from hf_sparse_cp.integration.fused_ops import disable_fused_ops, enable_fused_ops

    model = AutoModelForCausalLM.from_config(tiny_config("gemma3_text"))
    layer = model.model.layers[0]
    yield [(m, "forward") for m in (layer.mlp, layer.input_layernorm, model.model.norm)]
    enable_fused_ops(model, "compile")
    yield
    disable_fused_ops(model)


def sparse_attention() -> Iterator:
    from hf_sparse_cp import SparseAttentionConfig, SparseCPArguments, disable_sparse_attention, enable_sparse_attention

    with tempfile.TemporaryDirectory() as tmp:
        model = AutoModelForCausalLM.from_config(tiny_config("llama"), attn_implementation="sdpa")
        training = _args(tmp)
        names = [n for n in ("gradient_checkpointing", "activation_checkpointing") if n in vars(training)]
        yield [(model.config, "sparse_attention"), *((training, n) for n in names)]
        sparse = SparseCPArguments(sparse_attention=True, sparse_gradient_checkpointing_min_length=1024)
        enable_sparse_attention(model, sparse, SparseAttentionConfig(), training, max_length=4096)
        yield
        disable_sparse_attention(model)


def settings_during_a_call() -> Iterator:
    """What the plugin has the Trainer read during one call (`patching.temporarily`): in CP's compute_loss wrapper the
    token count's form (--average_tokens_across_devices on) and TRL's accumulation steps for its MoE aux term (1); in
    a checkpoint's save no --save_total_limit (`checkpoints.defer_rotation`)."""
    from hf_sparse_cp.integration.patching import temporarily

    with tempfile.TemporaryDirectory() as tmp:
        trainer = Trainer(model=torch.nn.Linear(2, 2),
                          args=_args(tmp, average_tokens_across_devices=False, save_total_limit=2))
        yield [(trainer.args, "average_tokens_across_devices"), (trainer, "current_gradient_accumulation_steps"),
               (trainer.args, "save_total_limit")]
        with temporarily(trainer.args, "average_tokens_across_devices", True), \
                temporarily(trainer, "current_gradient_accumulation_steps", 1), \
                temporarily(trainer.args, "save_total_limit", None):
            yield


def seen_data_parallel() -> Iterator:
    """What GRPO's and RLOO's own code reads under CP during one call (`generated_rows.seen_as`): its accelerator and
    the collectives its module imports, the data-parallel view's."""
    from hf_sparse_cp.distributed import ParallelDims
    from hf_sparse_cp.trainer.generated_rows import DataParallelView, seen_as

    modules = [importlib.import_module(f"trl.trainer.{name.lower()}_trainer") for name in GENERATING]
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as calls:
        trainer = Trainer(model=torch.nn.Linear(2, 2), args=_args(tmp))
        yield [(trainer, "accelerator"),
               *((module, name) for module in modules for name in ("gather", "gather_object"))]
        view = DataParallelView(trainer.accelerator, ParallelDims.single(), None)
        for module in modules:
            calls.enter_context(seen_as(trainer, view, module))
        yield


def adapter_regularizer() -> Iterator:
    """AdaLoRA's regularizer weight during one compute_loss under CP: the rank's share of it (`adapter_loss.py`)."""
    peft = pytest.importorskip("peft")
    from hf_sparse_cp.trainer.adapter_loss import regularizer_share

    base = AutoModelForCausalLM.from_config(tiny_config("llama"))
    config = peft.AdaLoraConfig(task_type="CAUSAL_LM", total_step=4, target_modules=["q_proj"])
    model = peft.get_peft_model(base, config)
    yield [(model.peft_config["default"], "orth_reg_weight")]
    with regularizer_share(model, 0.5):
        yield


def grouped_sdpa_measurement() -> Iterator:
    """The memory model's measurement of a layer's saved tensors: transformers' SDPA keeps grouped K/V heads."""
    from transformers.integrations import sdpa_attention

    from hf_sparse_cp.simulator.memory_model.measurements import _sdpa_keeps_key_value_heads

    yield [(sdpa_attention, "use_gqa_in_sdpa")]
    with _sdpa_keeps_key_value_heads():
        yield


def liger_kernel_flag() -> Iterator:
    """--use_liger_kernel with sparse attention on a (pretended) CUDA machine: the plugin applies liger-kernel
    itself (only its module replacement runs here) and turns the Trainer's own application off."""
    from hf_sparse_cp import SparseAttentionConfig, SparseCPArguments, disable_sparse_attention, enable_sparse_attention

    pytest.importorskip("liger_kernel.transformers")  # (liger-kernel needs Triton: `make test-no-triton` hides it)
    with tempfile.TemporaryDirectory() as tmp:
        model = AutoModelForCausalLM.from_config(tiny_config("llama"), attn_implementation="sdpa")
        training = TrainingArguments(output_dir=tmp, report_to="none", save_strategy="no", use_liger_kernel=True)
        yield [(training, "use_liger_kernel")]
        available, torch.cuda.is_available = torch.cuda.is_available, lambda: True
        try:
            enable_sparse_attention(model, SparseCPArguments(sparse_attention=True), SparseAttentionConfig(), training)
        finally:
            torch.cuda.is_available = available
        yield
        disable_sparse_attention(model)


def unused_parameters() -> Iterator:
    """An architecture that uses every parameter, built after the Trainer's accelerator (as `model_init`'s first):
    the flag and the DDP settings the accelerator was built with skip DDP's search for unused parameters."""
    from hf_sparse_cp import detach_from_trainer
    from hf_sparse_cp.trainer.attach import skip_unused_parameter_search

    with tempfile.TemporaryDirectory() as tmp:
        trainer = Trainer(model=AutoModelForCausalLM.from_config(tiny_config("llama")), args=_args(tmp))
        handler = trainer.accelerator.ddp_handler
        yield [(trainer.args, "ddp_find_unused_parameters"), (handler, "find_unused_parameters")]
        skip_unused_parameter_search(trainer, trainer.model, trainer.args)
        yield
        detach_from_trainer(trainer)


def capturing_layouts() -> Iterator:
    from hf_sparse_cp.attention import sequence
    from hf_sparse_cp.attention.dense import DENSE_BACKEND_ENV
    from hf_sparse_cp.reporting.plots import capturing_layouts as capturing

    hf_sparse_cp.patch()
    model = AutoModelForCausalLM.from_config(tiny_config("llama"))
    hf_sparse_cp.configure(model)
    yield [(sequence, "sequence_layout"), (os.environ, DENSE_BACKEND_ENV)]
    with capturing(model):
        yield


def launch() -> Iterator:
    from hf_sparse_cp.integration.compat_checks import argument_parser_classes
    from hf_sparse_cp.launch.launched import launched
    from hf_sparse_cp.trainer.plugin_arguments import PluginArguments

    parsers = argument_parser_classes()
    yield [*((parser, name) for parser in parsers
             for name in ("__init__", "parse_args_into_dataclasses", "error", "parse_dict")),
           (Trainer, "__init__"),
           (importlib.import_module("torch.optim.optimizer"), "_global_optimizer_pre_hooks")]
    with launched(PluginArguments()):
        yield


def launched_trainer() -> Iterator:
    from hf_sparse_cp import detach_from_trainer
    from hf_sparse_cp.launch.launched import launched
    from hf_sparse_cp.trainer.plugin_arguments import PluginArguments

    with tempfile.TemporaryDirectory() as tmp:
        trainer = object.__new__(Trainer)  # (what `Trainer(...)` creates before its __init__ runs)
        yield [(trainer, "__class__")]
        model = AutoModelForCausalLM.from_config(tiny_config("llama"))
        with launched(PluginArguments()):
            Trainer.__init__(trainer, model=model, args=_args(tmp))
        yield
        detach_from_trainer(trainer)


def router_loss() -> Iterator:
    import sys

    from hf_sparse_cp.integration.patching import PatchSet
    from hf_sparse_cp.trainer.router_loss import router_loss_over_cp_group

    # (a module of each modeling module's: the discovery takes the model's classes' modules)
    for name in router_loss_modules():
        importlib.import_module(name)
    model = torch.nn.ModuleList(type("Routed", (torch.nn.Module,), {"__module__": name})()
                                for name in router_loss_modules())
    yield [(sys.modules[name], "load_balancing_loss_func") for name in router_loss_modules()]
    patches = PatchSet()
    assert router_loss_over_cp_group(model, patches) == router_loss_modules()
    yield
    patches.undo()


def kv_sharing() -> Iterator:
    """Gemma 4's text models (and Gemma 4 Unified's) hand their KV-shared layers their inputs whole under sparse_cp."""
    from transformers import AutoModel

    from hf_sparse_cp import SparseAttentionConfig, SparseCPArguments, disable_sparse_attention, enable_sparse_attention
    from hf_sparse_cp.integration.architectures import KV_SHARED_SLICER

    shared = dict(sliding_window=512, num_hidden_layers=4, num_kv_shared_layers=2,
                  layer_types=["sliding_attention", "full_attention"] * 2)
    models = [AutoModel.from_config(tiny_config(kind, **shared), attn_implementation="sdpa")
              for kind in (f"{owner.split('.')[2]}_text" for owner in kv_shared_slicers())]
    yield [(model, KV_SHARED_SLICER) for model in models]
    for model in models:
        enable_sparse_attention(model, SparseCPArguments(sparse_attention=True), SparseAttentionConfig())
    yield
    for model in models:
        disable_sparse_attention(model)


ONE_PROCESS = {
    ("transformers.Trainer.train", "transformers.Trainer._save_optimizer_and_scheduler",
     "transformers.Trainer._save_checkpoint", "transformers.Trainer.training_step",
     "transformers.Trainer.evaluation_loop", "transformers.trainer_callback.CallbackHandler.callbacks",
     "accelerate.Accelerator.prepare_model"): attach,
    ("transformers.trainer_jit_checkpoint.CheckpointManager._enable_checkpoint",): jit_checkpoint,
    ("transformers.Trainer._load_from_checkpoint", "transformers.Trainer._load_optimizer_and_scheduler"):
        resharded_loading,
    ("transformers.Trainer._load_rng_state",): first_rank_rng_loading,
    ("transformers.Trainer.optimizer_cls_and_kwargs",): smet,
    ("transformers.PreTrainedModel.forward",): lean_loss,
    (*(f"{module}.{name}.forward" for name, (module, _) in rowwise_classes().items()),
     "transformers.modeling_layers.GradientCheckpointingLayer.forward"): memory_savers,
    ("torch.nn.Module.forward",): compiled_norms_and_mlps,
    ("transformers.PretrainedConfig.sparse_attention", "transformers.TrainingArguments.gradient_checkpointing"):
        sparse_attention,
    ("transformers.TrainingArguments.use_liger_kernel",): liger_kernel_flag,
    ("transformers.TrainingArguments.ddp_find_unused_parameters",
     "accelerate.utils.DistributedDataParallelKwargs.find_unused_parameters"): unused_parameters,
    ("transformers.TrainingArguments.average_tokens_across_devices",
     "transformers.Trainer.current_gradient_accumulation_steps", "transformers.TrainingArguments.save_total_limit"):
        settings_during_a_call,
    ("transformers.Trainer.accelerator", *(f"trl.trainer.{trainer.lower()}_trainer.{name}" for trainer in GENERATING
                                           for name in ("gather", "gather_object"))): seen_data_parallel,
    ("peft.AdaLoraConfig.orth_reg_weight",): adapter_regularizer,
    ("transformers.integrations.sdpa_attention.use_gqa_in_sdpa",): grouped_sdpa_measurement,
    ("hf_sparse_cp.attention.sequence.sequence_layout", "os.environ.HF_SPARSE_CP_DENSE_BACKEND"):
        capturing_layouts,
    (*(f"{parser}.{name}" for parser in ("transformers.HfArgumentParser", "trl.scripts._hf_argparser.HfArgumentParser")
       for name in ("__init__", "parse_args_into_dataclasses", "error", "parse_dict")), "transformers.Trainer.__init__",
     "torch.optim.optimizer._global_optimizer_pre_hooks"): launch,
    ("transformers.Trainer.__class__",): launched_trainer,
    tuple(f"{module}.load_balancing_loss_func" for module in router_loss_modules()): router_loss,
    tuple(f"{owner}.{KV_SHARED_SLICER}" for owner in kv_shared_slicers()): kv_sharing,
}
# (the KV-shared models came with transformers 5.x releases: before them that scenario changes nothing)
ONE_PROCESS = {names: scenario for names, scenario in ONE_PROCESS.items() if names}


# ---- two gloo processes (the rank's environment as torchrun sets it) ----

def _launched(rank: int, world: int) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))


def context_parallel() -> Iterator:
    from hf_sparse_cp import ContextParallelConfig, disable_trainer_context_parallel, enable_trainer_context_parallel
    from hf_sparse_cp.integration import upstream

    with tempfile.TemporaryDirectory() as tmp:
        trainer = _sparse_trainer(tmp, label_smoothing_factor=0.1, neftune_noise_alpha=5.0)
        names = ("_prepare_context_parallel_inputs", "_track_num_input_tokens", "_get_num_items_in_batch",
                 "get_batch_samples", "evaluation_loop", "get_cp_size", "floating_point_ops", "training_step",
                 "prediction_step", "gather_function", "label_smoother", "neftune_noise_alpha")
        yield [*((trainer, n) for n in names), (trainer.accelerator, "prepare_data_loader"),
               (trainer.accelerator, "gather_for_metrics")]
        divides = upstream.token_count_divides_by_get_cp_size
        upstream.token_count_divides_by_get_cp_size = lambda: False  # the wrapper of releases before 5.19
        try:
            enable_trainer_context_parallel(trainer, ContextParallelConfig(cp_size=2))
        finally:
            upstream.token_count_divides_by_get_cp_size = divides
        yield
        disable_trainer_context_parallel(trainer)


def accelerate_owns_cp() -> Iterator:
    from hf_sparse_cp import ContextParallelConfig, disable_trainer_context_parallel, enable_trainer_context_parallel
    from hf_sparse_cp.testing.accelerate_cp import give_accelerate_cp, take_accelerate_cp

    with tempfile.TemporaryDirectory() as tmp:
        trainer = _sparse_trainer(tmp)
        give_accelerate_cp(trainer, cp_size=2)
        yield [(trainer.accelerator, "_prepare_cp")]
        enable_trainer_context_parallel(trainer, ContextParallelConfig(cp_size=1))
        yield
        disable_trainer_context_parallel(trainer)
        take_accelerate_cp(trainer)


def curriculum() -> Iterator:
    from hf_sparse_cp import disable_curriculum, enable_curriculum, parse_schedule

    with tempfile.TemporaryDirectory() as tmp:
        trainer = _sparse_trainer(tmp, max_steps=4)
        trainer.train_dataset = [{"input_ids": torch.arange(3, 259)}] * 8
        yield [(trainer, "get_train_dataloader"), (trainer.model.config, "sparse_attention")]
        # (the parsed stages: enable_curriculum resolves them for the trainer)
        curriculum = enable_curriculum(trainer, parse_schedule("0:128:1,2:256:2:mass_threshold=0.01"))
        curriculum.training = True  # (as train() begins it: outside training the model keeps its own pattern)
        curriculum.stage()
        trainer.state.global_step = 2
        curriculum.stage()  # the second stage's pattern goes onto the model
        assert trainer.model.config.sparse_attention["budget"]["mass_threshold"] == 0.01
        yield
        disable_curriculum(trainer)


def cpu_fsdp2() -> Iterator:
    from accelerate import PartialState

    from hf_sparse_cp import disable_cpu_fsdp2, enable_cpu_fsdp2

    with tempfile.TemporaryDirectory() as tmp:
        trainer = Trainer(model=AutoModelForCausalLM.from_config(tiny_config("llama")),
                          args=_args(tmp, fsdp=True, fsdp_config={"fsdp_version": 2}))
        state = trainer.accelerator.state
        yield [(trainer, "is_fsdp_enabled"), (PartialState(), "distributed_type"), (state, "distributed_type"),
               (state, "fsdp_plugin")]
        enable_cpu_fsdp2(trainer)
        yield
        disable_cpu_fsdp2(trainer)


def generating_under_cp(name: str) -> Iterator:
    """TRL's `<name>Trainer` (GRPO, RLOO) under CP 2: its step's inputs shared by each CP group's first rank, its loss
    in the data-parallel view, its generation batch (and its log of completions) sized by the DP degree."""
    import datasets
    import trl

    from hf_sparse_cp import ContextParallelConfig, disable_trainer_context_parallel, enable_trainer_context_parallel
    from hf_sparse_cp.examples.tokenizer import byte_tokenizer

    hf_sparse_cp.patch()
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = byte_tokenizer()
        model = AutoModelForCausalLM.from_config(tiny_config("llama", vocab_size=len(tokenizer)))
        hf_sparse_cp.configure(model)
        args = getattr(trl, f"{name}Config")(output_dir=tmp, report_to="none", save_strategy="no", use_cpu=True,
                                             per_device_train_batch_size=2, num_generations=2,
                                             beta=0.0)  # (RLOO's default beta loads a reference model)
        prompts = datasets.Dataset.from_dict({"prompt": ["sparse ring"] * 4})
        trainer = getattr(trl, f"{name}Trainer")(model=model, args=args, processing_class=tokenizer,
                                                 reward_funcs=lambda completions, **kwargs: [0.0] * len(completions),
                                                 train_dataset=prompts)
        yield [(trainer, "_prepare_inputs"), (trainer, "_compute_loss"), (args, "generation_batch_size"),
               (trainer, "_logs")]
        enable_trainer_context_parallel(trainer, ContextParallelConfig(cp_size=2))
        yield
        disable_trainer_context_parallel(trainer)


def trl_packing_under_accelerates_cp() -> Iterator:
    """TRL's SFTTrainer built with packing under accelerate's CP group; its arguments hide packing while an
    accelerator is built inside the window the Trainer's `__init__` holds open, which the scenario opens."""
    import datasets
    from accelerate.parallelism_config import ParallelismConfig

    from hf_sparse_cp import SparseSFTConfig, SparseSFTTrainer
    from hf_sparse_cp.examples.tokenizer import byte_tokenizer
    from hf_sparse_cp.testing.accelerate_cp import allow_parallelism_config_on_cpu, take_accelerate_cp

    allow_parallelism_config_on_cpu()
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = byte_tokenizer()
        model = AutoModelForCausalLM.from_config(tiny_config("llama", vocab_size=len(tokenizer)))
        args = SparseSFTConfig(output_dir=tmp, report_to="none", save_strategy="no", use_cpu=True, packing=True,
                               max_length=64, dataset_num_proc=None, parallelism_config=ParallelismConfig(cp_size=2))
        trainer = SparseSFTTrainer(model=model, args=args, processing_class=tokenizer,
                                   train_dataset=datasets.Dataset.from_dict({"text": ["sparse ring"] * 4}))
        yield [(args, "packing"), (args, "eval_packing")]
        with trainer._packing_kept_under_accelerates_cp(args):
            trainer.create_accelerator_and_postprocess()
            yield
        take_accelerate_cp(trainer)


TWO_PROCESSES = {
    ("transformers.Trainer._prepare_context_parallel_inputs", "transformers.Trainer._track_num_input_tokens",
     "transformers.Trainer._get_num_items_in_batch", "transformers.Trainer.get_batch_samples",
     "transformers.Trainer.evaluation_loop", "transformers.Trainer.get_cp_size",
     "transformers.Trainer.floating_point_ops", "transformers.Trainer.training_step",
     "transformers.Trainer.prediction_step", "transformers.Trainer.compute_loss",
     "transformers.Trainer.gather_function", "transformers.Trainer.label_smoother",
     "transformers.Trainer.neftune_noise_alpha", "accelerate.Accelerator.prepare_data_loader",
     "accelerate.Accelerator.gather_for_metrics"): context_parallel,
    ("accelerate.Accelerator._prepare_cp",): accelerate_owns_cp,
    ("transformers.Trainer.get_train_dataloader",): curriculum,
    ("transformers.Trainer.is_fsdp_enabled", "accelerate.PartialState.distributed_type",
     "accelerate.state.AcceleratorState.distributed_type", "accelerate.state.AcceleratorState.fsdp_plugin"):
        cpu_fsdp2,
    **{(f"trl.{name}Trainer._prepare_inputs", f"trl.{name}Trainer._compute_loss",
        f"trl.{name}Config.generation_batch_size", f"trl.{name}Trainer._logs"):
       functools.partial(generating_under_cp, name)
       for name in GENERATING},
    ("trl.SFTConfig.packing", "trl.SFTConfig.eval_packing"): trl_packing_under_accelerates_cp,  # (last: see above)
}


def run_two_process_scenarios(rank: int, world: int) -> dict:
    """Every two-process scenario in this gloo process (for `run_gloo`)."""
    _launched(rank, world)
    return {names: round_trip(scenario) for names, scenario in TWO_PROCESSES.items()}
