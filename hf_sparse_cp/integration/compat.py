"""Every way the plugin touches someone else's code, in one table: `PATCHES`.

Most of the integration goes through public APIs (`AttentionInterface.register`, `TrainerCallback`,
forward hooks). What remains is listed here, one `Patch` each: a private member read or called, or a
replacement (a method on one Trainer or Accelerator instance, a class attribute, process-wide
state, an inserted callback), with why, the releases it was tested with (`TESTED_VERSIONS`) and how it is undone:

* `PatchSet.set_attr` / `insert` / `set_item` (`patching.py`) refuse a replacement that has no
  entry here (`compat_checks.replacement_for`);
* `compat_checks.check_patches` verifies that every member still exists with the parameters we rely on
  (`tests/unit/test_compat.py` runs it, so an upgrade that breaks one fails with the member's name),
  and `compat_checks.require` does the same at the moment a feature needs one, naming the member, the versions
  and the fix;
* each replacement has an apply / check / undo test (`tests/unit/test_patch_registry.py`,
  `tests/distributed/test_patch_registry_cp.py`).

Beside it: `compat_checks.py`, the table read against what is installed (the checks above, and which entry allows a
change); `upstream.py`, the calls through a member that differs between releases or is checked when a feature needs it
(`compat_checks.require`); other members are used where their feature lives (a why names the plugin's code by its
module under hf_sparse_cp: `trainer.generated_rows`, `distributed.comm.group_timeout`); `trainer_losses.py`, the
trainers' losses CP reproduces; `fsdp_class_names.py`, class-name checks past FSDP2.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from .architectures import (
    KV_SHARED_SLICER,
    ROUTER_LOSS_PARAMETERS,
    kv_shared_slicers,
    router_loss_modules,
    rowwise_classes,
)
from .trainer_losses import GENERATING, WHOLE_ROW_EXPERIMENTAL

# The releases the suite ran on (inclusive): the whole suite on the CPU machine's newest, the unit tier, most of the
# distributed tier and a part of the integration tier on the GPU image's (transformers 5.17, torch 2.11, Triton 3.6,
# whose kernels' sm_90 builds were checked too; its limits there are refused naming the release), the core unit
# tests (registration, models, loss, patches) on the oldest setup.cfg allows (transformers 5.15, torch 2.6, accelerate
# 1.10; transformers 5.0-5.3 call the mask function without q_length, 5.4-5.14's LabelSmoother takes no
# num_items_in_batch).
TESTED_VERSIONS = {"transformers": ("5.15", "5.25"), "accelerate": ("1.10", "1.16"), "torch": ("2.6", "2.13"),
                   "triton": ("3.6", "3.9"), "trl": ("1.16", "1.16"), "datasets": ("5.2", "5.2"),
                   "liger_kernel": ("0.8.5", "0.8.5"),
                   "peft": ("0.21", "0.21"), "kernels": ("0.19", "0.19")}

# Names of the private methods the plugin replaces or calls on a Trainer / Accelerator instance.
TRAINER_CP_INPUTS = "_prepare_context_parallel_inputs"
TRAINER_TRACK_TOKENS = "_track_num_input_tokens"
TRAINER_COUNT_ITEMS = "_get_num_items_in_batch"
ACCELERATOR_PREPARE_CP = "_prepare_cp"
TRAINER_COLLATOR_WITHOUT_UNUSED = "_get_collator_with_removed_columns"
TRAINER_LOAD_MODEL = "_load_from_checkpoint"
TRAINER_LOAD_OPTIMIZER = "_load_optimizer_and_scheduler"
TRAINER_SAVE_OPTIMIZER = "_save_optimizer_and_scheduler"
TRAINER_SAVE_CHECKPOINT = "_save_checkpoint"
TRAINER_LOAD_RNG = "_load_rng_state"

# What an entry does to its member.
Action = Literal["reads", "calls", "replaces", "sets", "inserts into"]
_CHANGES = ("replaces", "sets", "inserts into")


@dataclass(frozen=True)
class Patch:
    """One member of someone else's code the plugin uses or changes.

    owner: the module or class that has it (dotted); name: the member (`alternatives`: names it has in
    other releases); action: what the plugin does with it; parameters: the signature relied on, for a
    function (None: not checked); why: the reason; undo: how a change is undone (the call that undoes it). Both
    name the plugin's code by its module under hf_sparse_cp (`integration.upstream.seed_workers_by`), an undo's call
    by its public name (`detach_from_trainer`) where hf_sparse_cp exports it (`tests/unit/test_compat.py` imports each);
    on_instances: the member exists only on instances (set in `__init__`); added: an attribute the plugin
    adds (nothing of theirs to check); since: the package's release that brought the member (before it, an
    older way the plugin does not need this for: nothing to check).
    """

    owner: str
    name: str
    action: Action
    why: str
    undo: str = ""
    parameters: tuple[str, ...] | None = None
    on_instances: bool = False
    alternatives: tuple[str, ...] = ()
    added: bool = False
    since: tuple[int, ...] = ()

    @property
    def qualified(self) -> str:
        return f"{self.owner}.{self.name}"

    @property
    def package(self) -> str:
        return self.owner.split(".")[0]

    @property
    def changes(self) -> bool:
        return self.action in _CHANGES


# The torch release from which ops that return nothing are registered as ordered effects
# (`integration.upstream.register_ordered_effect`; the compiled path's ops come with it,
# `integration.compiled.OPS_MIN_TORCH`; torch 2.6 has neither the registry nor its module).
ORDERED_EFFECTS_SINCE = (2, 11)

_TRAINER = "transformers.Trainer"
_ACCELERATOR = "accelerate.Accelerator"
# The argument parsers a script may build: transformers' own, and the copy of it that TRL's `TrlParser` derives from
# (TRL >= 1.16; earlier TRL releases derive from transformers' own).
PARSERS = ("transformers.HfArgumentParser", "trl.scripts._hf_argparser.HfArgumentParser")
_CP_UNDO = "disable_trainer_context_parallel(trainer) / disable_curriculum(trainer) (detach_from_trainer)"
_LAUNCH_UNDO = "the end of the launched script (`launch.launched.launched`)"

PATCHES = (
    # -- the Trainer instance: context parallelism and the curriculum --
    Patch(_TRAINER, TRAINER_CP_INPUTS, "replaces", "the Trainer's CP input preparation accepts SDPA only; ours "
          "shards each batch for the sparse ring", _CP_UNDO, ("self", "model", "inputs")),
    Patch(_TRAINER, TRAINER_TRACK_TOKENS, "replaces", "under CP every rank of a group counts the same batch: the "
          "wrapper counts it once", _CP_UNDO, ("self", "inputs")),
    Patch(_TRAINER, TRAINER_COUNT_ITEMS, "replaces", "the loss's token count, under CP, takes the form of "
          "--average_tokens_across_devices' (without the flag: the CP group's count times the DP degree, not a "
          "fractional count that TRL clamps to 1); before transformers 5.19 it divides by the CP degree only when "
          "accelerate's ParallelismConfig sets one: the wrapper divides by ours", _CP_UNDO,
          ("self", "batch_samples", "device")),
    Patch(_TRAINER, "get_batch_samples", "replaces", "under CP every rank of a group must build the same batch: a "
          "collator drawing random numbers did not once a draw on one rank alone (a callback on the main process) put "
          "the ranks' generators apart; the wrapper starts each step's batches from the group's first rank's "
          "(`trainer.cp_batches.follow_first_ranks_generators`)",
          _CP_UNDO, ("self", "epoch_iterator", "num_batches", "device")),
    Patch(_TRAINER, "evaluation_loop", "replaces", "as get_batch_samples, for the batches of an evaluation or a "
          "prediction: the wrapper starts them from the CP group's first rank's generators; Seq2SeqTrainer's "
          "evaluate() and predict() set its gather to accelerate's `gather`, which kept each row of a CP group's "
          "batch cp_size times: the wrapper gathers them once per CP group", _CP_UNDO,
          ("self", "dataloader", "description", "prediction_loss_only", "ignore_keys", "metric_key_prefix")),
    Patch(_TRAINER, "get_cp_size", "replaces", "the Trainer reads the CP degree (batch size, token count) from "
          "accelerate's ParallelismConfig only; ours comes from --cp_size or the curriculum's stage", _CP_UNDO,
          ("self",)),
    Patch(_TRAINER, "floating_point_ops", "replaces", "every rank of a CP group reports the flops of the whole "
          "batch: the wrapper divides by the CP degree", _CP_UNDO, ("self", "inputs")),
    Patch(_TRAINER, "training_step", "replaces", "a CP rank's loss is its shard's share: the wrapper returns the CP "
          "group's mean, which the Trainer keeps for train_loss after the last log", _CP_UNDO,
          ("self", "model", "inputs", "num_items_in_batch")),
    Patch(_TRAINER, "prediction_step", "replaces", "a CP rank's loss is its shard's share: the wrapper returns the "
          "CP group's mean, of which gather_for_metrics may keep rank 0's alone for eval_loss; a rank's logits cover "
          "its shard only: the wrapper gathers them over the CP group into the whole sequence, in the batch's order",
          _CP_UNDO,
          ("self", "model", "inputs", "prediction_loss_only", "ignore_keys")),
    Patch(_TRAINER, "compute_loss", "replaces", "a prediction_step of a trainer's own (TRL SFTTrainer's) hands "
          "compute_loss the whole batch, without the Trainer's CP input preparation: the wrapper shards it there, "
          "with the batch's label count, as the stock step does", _CP_UNDO,
          ("self", "model", "inputs", "return_outputs", "num_items_in_batch")),
    Patch(_TRAINER, "label_smoother", "sets", "label smoothing under CP: the Trainer's smoother shifts the labels it "
          "gets and counts a rank's targets; the wrapper hands it the shard's shifted targets unshifted and the CP "
          "group's count. Under FSDP2 (without CP too: `trainer.attach.shift_smoothed_labels_under_fsdp`) the Trainer "
          "tells it not to shift a causal LM's labels, its check of the class name missing FSDP2's renamed class "
          "(`integration.fsdp_class_names.smoother_shifts_labels`): the wrappers shift them",
          f"{_CP_UNDO}; detach_from_trainer(trainer)",
          on_instances=True),
    Patch("transformers.trainer_utils", "seed_worker", "reads", "the Trainer seeds its training loader's workers by "
          "the process index (`partial(seed_worker, rank=process_index)`), so under CP the ranks of a group, which "
          "take the same samples, drew different random numbers in their workers (a dataset's random crops): the CP "
          "data loader (under accelerate's own CP group too) seeds them by the data-parallel rank "
          "(`integration.upstream.seed_workers_by`)",
          parameters=("worker_id", "num_workers", "rank")),
    Patch("transformers.modelcard", "TASK_MAPPING", "reads", "the Trainer's model card infers its task from the model "
          "class's name, which FSDP2 renames (FSDPLlamaForCausalLM): the plugin's card writer gives the stock one the "
          "task of the class FSDP2 derived from (`integration.fsdp_class_names.card_tasks`), found in this table as "
          "the stock card does"),
    Patch("transformers.trainer_pt_utils.LabelSmoother", "__call__", "calls", "the CP label smoothing wrapper calls "
          "the stock smoother on a rank's shard", parameters=("self", "model_output", "labels", "shift_labels",
                                                               "num_items_in_batch")),
    Patch(_TRAINER, "neftune_noise_alpha", "sets", "NEFTune under CP: the Trainer's hook "
          "(transformers.integrations.neftune's neftune_post_forward_hook, added by train() while this is set) draws "
          "its noise in the shape of the embedded tensor, a rank's shard, so neither its scale nor its draws were one "
          "process's; unset on the trainer, the hook is never added, and the plugin's draws the whole sequence's noise "
          "and adds the rank's shard of it", _CP_UNDO, on_instances=True),
    Patch(_TRAINER, "gather_function", "sets", "the evaluation loop gathers with the gather_for_metrics it bound at "
          "set-up: the CP wrapper's, which keeps each CP group's values once", _CP_UNDO, on_instances=True),
    Patch(_TRAINER, "get_train_dataloader", "replaces", "a cp_schedule's batches follow the stage of each step "
          "(one sampler over the whole run)", "disable_curriculum(trainer)", ("self",)),
    Patch(_TRAINER, TRAINER_COLLATOR_WITHOUT_UNUSED, "calls", "a cp_schedule's data loader drops the columns the "
          "model does not take, as the Trainer's does", parameters=("self", "data_collator", "description")),
    # -- the Trainer instance: checkpoints, resume, SMET, FSDP2 on CPU --
    Patch(_TRAINER, "train", "replaces", "a checkpoint is checked against the run before a resume, and a resume "
          "with other DP / CP degrees loads through the sharded state", "detach_from_trainer(trainer)",
          ("self", "resume_from_checkpoint", "trial", "ignore_keys_for_eval")),
    Patch(_TRAINER, TRAINER_SAVE_OPTIMIZER, "replaces", "under FSDP2 the sharded state is saved instead of "
          "accelerate's gathered copies", "detach_from_trainer(trainer)", ("self", "output_dir")),
    Patch(_TRAINER, TRAINER_SAVE_CHECKPOINT, "replaces", "the checkpoints past --save_total_limit are deleted once "
          "the new one is complete on every rank (`trainer.checkpoints.defer_rotation`), where the Trainer deleted "
          "them as its first process had saved, before the other ranks had", "detach_from_trainer(trainer)",
          ("self", "model", "trial")),
    Patch("transformers.TrainingArguments", "save_total_limit", "sets", "the Trainer's own deletion of old "
          "checkpoints, inside its save, reads no limit during that call (`trainer.checkpoints.defer_rotation`)",
          "the end of the call (`integration.patching.temporarily`)"),
    Patch("transformers.trainer_utils", "rotate_checkpoints", "calls", "the checkpoints past --save_total_limit are "
          "deleted once the new one is marked complete (`trainer.checkpoints.CheckpointMarkerCallback`)",
          parameters=("output_dir", "save_total_limit", "best_model_checkpoint", "use_mtime", "checkpoint_prefix")),
    Patch(_TRAINER, TRAINER_LOAD_MODEL, "replaces", "while a resume loads the sharded state, the model comes from "
          "it (no public hook: callbacks run after loading)", "the end of `resharding.resume.resharded_loading`",
          ("self", "resume_from_checkpoint", "model")),
    Patch(_TRAINER, TRAINER_LOAD_OPTIMIZER, "replaces", "while a resume loads the sharded state, the optimizer "
          "comes from it", "the end of `resharding.resume.resharded_loading`", ("self", "checkpoint")),
    Patch(_TRAINER, TRAINER_LOAD_RNG, "replaces", "a resume at another CP or DP degree found no random state saved "
          "under its process's name (rng_state.pth of one process, rng_state_<rank>.pth of several) and went on "
          "unseeded: it loads the saved first rank's",
          "the end of `trainer.checkpoints.first_rank_rng_loading`", ("self", "checkpoint")),
    Patch(_TRAINER, "training_step", "replaces", "each training batch's real tokens are counted for the logged "
          "tokens_per_second (`trainer.callbacks.StepMetricsCallback`), and its row length checked against the memory "
          "savers set up (`trainer.attach.row_length_watch`), before the Trainer's own step trains on it",
          "detach_from_trainer(trainer)", ("self", "model", "inputs", "num_items_in_batch")),
    Patch(_TRAINER, "evaluation_loop", "replaces", "an evaluation's logged kept fraction counts its own forwards: the "
          "wrapper drops the evaluation-mode sums left before it (a user's check of the model, a generation); no "
          "callback event fires before the loop's first forward (`trainer.attach.log_sparsity`)",
          "detach_from_trainer(trainer)",
          ("self", "dataloader", "description", "prediction_loss_only", "ignore_keys", "metric_key_prefix")),
    Patch(_TRAINER, "optimizer_cls_and_kwargs", "sets", "SMET wraps the optimizer the Trainer would build "
          "(TrainingArguments' optim and its settings)", "uninstall_smet(trainer)", on_instances=True),
    Patch(_TRAINER, "is_fsdp_enabled", "sets", "--fsdp on CPU processes runs FSDP2, which the Trainer enables "
          "only where accelerate detected it", "disable_cpu_fsdp2(trainer)", on_instances=True),
    Patch("transformers.trainer_jit_checkpoint.CheckpointManager", "_enable_checkpoint", "replaces", "the JIT "
          "checkpoint's SIGTERM timer requests the save on each rank at its own moment, which deadlocks several "
          "processes: the request is noted, and the ranks agree at a step end "
          "(`trainer.checkpoints.AgreedJitCheckpoint`)",
          "detach_from_trainer(trainer)", ("self",)),
    Patch("transformers.trainer_callback.CallbackHandler", "callbacks", "inserts into", "the kept-fraction "
          "logging, the step metrics (tokens/s, peak memory) and the checkpoint marker are callbacks the Trainer "
          "did not get from the user",
          "detach_from_trainer(trainer)", on_instances=True),
    # -- a stock script run by `hf_sparse_cp.run` (`launch.launched`) --
    Patch(_TRAINER, "__init__", "replaces", "a Trainer that a launched script builds (the stock one, TRL's, the "
          "script's own subclass) trains with the plugin: it becomes sparse_trainer_class(its class) and the "
          "Trainer's __init__ runs with the plugin around it", _LAUNCH_UNDO,
          ("self", "model", "args", "data_collator", "train_dataset", "eval_dataset", "processing_class",
           "model_init", "compute_loss_func", "compute_metrics", "callbacks", "optimizers",
           "optimizer_cls_and_kwargs", "preprocess_logits_for_metrics")),
    Patch(_TRAINER, "__class__", "sets", "the Trainer a launched script builds is an instance of "
          "sparse_trainer_class(its class): the script's class and its methods, with the plugin's (train, "
          "create_model_card, the accelerator's set-up)", "detach_from_trainer(trainer)", on_instances=True),
    *(entry for parser in PARSERS for entry in (
        Patch(parser, "__init__", "replaces", "a launched script's parser takes the plugin's flags beside its own: "
              "its TrainingArguments class becomes sparse_arguments_class(that class)", _LAUNCH_UNDO,
              ("self", "dataclass_types", "**kwargs")),
        Patch(parser, "parse_args_into_dataclasses", "replaces", "which plugin flags a launched script's command "
              "line gave (they beat --sparse_config whatever their value)", _LAUNCH_UNDO,
              ("self", "args", "return_remaining_strings", "look_for_args_file", "args_filename",
               "args_file_flag")),
        Patch(parser, "parse_dict", "replaces", "a key that no field takes in the file of arguments a launched "
              "script reads (run_clm's JSON file) ends the run as a mistyped flag does, naming the close field, not "
              "in a traceback from every rank", _LAUNCH_UNDO, ("self", "args", "allow_extra_keys")),
        Patch(parser, "error", "replaces", "argparse's error for a launched script's parser prints a short usage (its "
              "prog and --help), not every flag, the plugin's ~60 among them, unless the script wrote its own usage",
              _LAUNCH_UNDO, ("self", "message")),
        Patch(parser, "_parse_dataclass_field", "reads", "a flag that selects a registered variant (--cp_mode, "
              "--sparse_budget_mode, --sparse_attention_engine, --smet_mode) takes the action its field's metadata "
              "names, which this hands add_argument (`config.registries.VariantFlag`: the registry read as the flags "
              "parse, a variant the script registered taken), in place of its Literal's fixed choices",
              parameters=("parser", "field")))),
    Patch("torch.optim.optimizer", "_global_optimizer_pre_hooks", "inserts into", "a launched script's first "
          "optimizer step outside a Trainer (a training loop of its own, which the plugin never reaches) is refused "
          "when the script was given plugin flags, else warned about (torch's public "
          "register_optimizer_step_pre_hook; the hook removes itself at its first call)", _LAUNCH_UNDO),
    Patch("transformers.Trainer", "compute_loss", "reads", "under CP, a Trainer whose loss is not the Trainer's or TRL "
          "SFTTrainer's (which the plugin shards exactly) is refused at start "
          "(`integration.trainer_losses.cp_exact_losses`)",
          parameters=("self", "model", "inputs", "return_outputs", "num_items_in_batch")),
    Patch("trl.DPOTrainer", "compute_loss", "reads", "under CP, TRL's DPOTrainer gets its batches whole, each forward "
          "of its model and reference sharded and its per-token outputs gathered back into whole rows "
          "(`integration.trainer_losses.cp_whole_row_losses`, `trainer.whole_rows`)",
          parameters=("self", "model", "inputs", "return_outputs", "num_items_in_batch")),
    *(Patch(f"trl.{name}Trainer", "_precompute_ref_logps", "calls", f"TRL {name}'s --precompute_ref_log_probs "
            "pass, run in its __init__ before train, runs the reference with the trained model's pattern "
            "(`trainer.reference.attend_like_trained_model`), a model TRL loads from its Hub id set up before it; "
            "the dataset it is handed carries the pattern in its fingerprint, the key of TRL's cache "
            "(`trainer.precomputed.keyed_by_pattern`), and one whose cache file the processes cannot share is refused "
            "(`trainer.precomputed.refuse_unshared_cache`: TRL failed on the other ranks)",
            parameters=("self", "dataset", "name", "batch_size")) for name in ("DPO", "KTO")),
    Patch("datasets.Dataset", "_fingerprint", "reads", "TRL's DPO and KTO key the reference log-probs they precompute "
          "and cache by it and the reference's weights: the dataset handed to their pass gets a fingerprint of it "
          "and the trained model's pattern, through the public select_columns(new_fingerprint=...) "
          "(`trainer.precomputed.keyed_by_pattern`)", on_instances=True),
    Patch("trl.KTOTrainer", "compute_loss", "reads", "under CP, TRL's KTOTrainer trains as its DPOTrainer does, "
          "its forwards (the completions' and the mismatched pairs' for the KL estimate) on whole rows",
          parameters=("self", "model", "inputs", "return_outputs", "num_items_in_batch")),
    *(Patch(f"{module}.{name}", "compute_loss", "reads", f"under CP, TRL's experimental {name} gets its batches "
            "whole, each forward of its model sharded (its input_ids passed positionally, named by the forward's "
            "signature) and its logits gathered back into whole rows", parameters=("self", "model", "inputs",
                                                                                    "return_outputs",
                                                                                    "num_items_in_batch"))
      for module, name in WHOLE_ROW_EXPERIMENTAL),
    *(entry for trainer in GENERATING for entry in (
        Patch(f"trl.{trainer}Trainer", "compute_loss", "reads", f"under CP, TRL's {trainer}Trainer trains on whole "
              "rows as DPO does (`integration.trainer_losses.cp_generated_row_losses`, `trainer.generated_rows`)",
              parameters=("self", "model", "inputs", "return_outputs", "num_items_in_batch")),
        Patch(f"trl.{trainer}Trainer", "_prepare_inputs", "replaces", "under CP, each CP group's first rank generates, "
              "scores and computes the reference and old log-probabilities of the step's rows (the trainer's own code, "
              "seen data-parallel), and broadcasts them to its group (`trainer.generated_rows`)",
              _CP_UNDO, ("self", "generation_batch")),
        Patch(f"trl.{trainer}Trainer", "_metrics", "reads", f"under CP, the metrics {trainer} logs, which each CP "
              "group's first rank computes as it generates (`_prepare_inputs`), go to the other ranks of its group "
              "with the step's rows (their values copied into the others' dict of the step's metrics)",
              on_instances=True),
        Patch(f"trl.{trainer}Trainer", "_compute_loss", "replaces", f"under CP, {trainer}'s loss and metrics run in "
              "the data-parallel view (its normalization by num_processes, its gathers of metrics over the DP group; "
              "`trainer.generated_rows`)",
              _CP_UNDO, ("self", "model", "inputs")),
        *(Patch(f"trl.trainer.{trainer.lower()}_trainer", name, "replaces", f"while {trainer}'s own code runs under "
                f"CP, the {name} it imports from accelerate is the data-parallel view's (over the DP group: its "
                "rewards' groups span DP ranks, not the CP ranks holding the same rows)",
                "the end of the call (`integration.patching.temporarily`)")
          for name in ("gather", "gather_object")),
        Patch(f"trl.{trainer}Config", "generation_batch_size", "sets", f"under CP, {trainer}'s generation batch "
              "counts the data-parallel ranks' prompts (per_device_train_batch_size x DP x steps_per_generation; its "
              "config counted every process)", _CP_UNDO),
        Patch(f"trl.{trainer}Trainer", "_logs", "replaces", f"under CP, the completions {trainer} logs "
              "(--log_completions) are kept in queues of the data-parallel generation batch's length (its __init__ "
              "sized them by every process's; `trainer.generated_rows`)", _CP_UNDO, on_instances=True))),
    Patch(_TRAINER, "accelerator", "replaces", "while the own code of a trainer that generates its rows (GRPO, RLOO) "
          "runs under CP, its accelerator is the data-parallel view (`trainer.generated_rows.DataParallelView`): "
          "num_processes, process_index and collectives over the DP group",
          "the end of the call (`integration.patching.temporarily`)",
          on_instances=True),
    Patch("trl.RewardTrainer", "compute_loss", "reads", "under CP, TRL's RewardTrainer gets its batches whole, each "
          "forward of its model sharded and its sequence-classification head's score of each row's last token taken "
          "on the rank holding it and summed over the CP group (`integration.heads.pool_over_cp_group`)",
          parameters=("self", "model", "inputs", "return_outputs", "num_items_in_batch")),
    Patch("trl.trainer.utils", "FusedCausalLMOutput", "reads", "under CP, the whole-row hooks gather the per-token "
          "fields of TRL's fused LM head's output, drop the last position of a head given `labels` (it shifts them) "
          "and recompute its loss (the sum of -log_probs over the label tokens' count) from the whole rows"),
    Patch("trl", "SFTTrainer", "reads", "TRL's SFTTrainer logs num_tokens, counted on the inputs it trains on (under "
          "CP, each rank's padded shard): the plugin logs what one process counts instead"),
    *(Patch("trl.SFTConfig", name, "sets", "TRL's SFTTrainer refuses packing under accelerate's CP group (its "
            "attention drops the mask that keeps packed documents apart; the sparse ring keeps them apart): in its "
            "__init__, after its datasets are packed, its check sees packing off", "the end of the Trainer's __init__")
      for name in ("packing", "eval_packing")),
    # -- the Accelerator and accelerate's process-wide state --
    Patch(_ACCELERATOR, ACCELERATOR_PREPARE_CP, "replaces", "accelerate's CP model hooks drop the attention mask "
          "for SDPA; the sparse ring reads the CP shard instead", _CP_UNDO, ("self", "*args")),
    Patch(_ACCELERATOR, "prepare_data_loader", "replaces", "CP ranks of one group take the same batch: the data loader "
          "shards over the data-parallel ranks only (accelerate's settings are read from the accelerator, see "
          "`integration.upstream.dp_data_loader_options`), under accelerate's own CP group too, whose loader "
          "dispatches an iterable dataset's batches over all processes; its collate_fn checks the token ids on the "
          "host (`trainer.token_ids`: an id past the vocabulary failed on one CP rank while the others waited), its "
          "shard of an iterable dataset counts the rows it reads (`trainer.stream_rows.count_stream`), and a 🤗 "
          "datasets stream of as many files as DP ranks, which it would split file by file, is read whole by each rank "
          "(`trainer.stream_rows.read_whole_stream`)",
          _CP_UNDO,
          ("self", "data_loader", "device_placement", "slice_fn_for_dispatch")),
    Patch(_ACCELERATOR, "prepare_model", "replaces", "a model the Trainer prepared for evaluation only (evaluate() "
          "before train(): accelerate marks it prepared, unwrapped) is prepared again for training, so that DDP wraps "
          "it (before: no DDP, each process stepped with its own gradients, a CP rank with its shard's)",
          "detach_from_trainer(trainer)", ("self", "model", "device_placement", "evaluation_mode")),
    Patch(_ACCELERATOR, "_models", "reads", "a model prepared for evaluation only, then again for training, is listed "
          "once among the accelerator's models (its earlier entry dropped), as in a run that trains first "
          "(`trainer.attach`)",
          on_instances=True),
    Patch(_ACCELERATOR, "gather_for_metrics", "replaces", "every rank of a CP group evaluates the same batch: the "
          "gather keeps each CP group's values once, before truncating a short last batch", _CP_UNDO,
          ("self", "input_data", "use_gather_object")),
    Patch(_ACCELERATOR, "_dataloaders", "reads", "a data loader prepared over the DP ranks only is registered "
          "for checkpointing", on_instances=True),
    Patch("accelerate.utils.DistributedDataParallelKwargs", "find_unused_parameters", "sets", "a model built after "
          "the Trainer's accelerator (model_init's first, a model TRL loads from its name) whose architecture uses "
          "every parameter: DDP skips its search for unused ones after every backward, as with --ddp_find_unused_"
          "parameters false, which the accelerator's DDP settings were built from before the model existed",
          "detach_from_trainer(trainer)"),
    Patch("transformers.TrainingArguments", "ddp_find_unused_parameters", "sets", "an architecture that uses every "
          "parameter, with the flag unset: DDP skips its search for unused ones after every backward (the Trainer's "
          "default without gradient checkpointing searches, and DDP warns at every run that it found none)",
          "detach_from_trainer(trainer)"),
    Patch("accelerate.data_loader.IterableDatasetShard", "dataset", "reads", "the shard of an iterable dataset in a "
          "DP-only data loader (built by the plugin) completes its last global batch with copies of its first rows, "
          "and the loader has no length: the shard is given its dataset through a counter "
          "(`trainer.stream_rows.count_stream`), so that the evaluation loop's last step drops the copies (its "
          "batch_size, num_processes, process_index, split_batches and drop_last are read too)", on_instances=True),
    Patch("accelerate.PartialState", "distributed_type", "sets", "--fsdp on CPU processes: accelerate's FSDP "
          "run type (process-wide, as accelerate's own set-up does)", "disable_cpu_fsdp2(trainer)", on_instances=True),
    Patch("accelerate.state.AcceleratorState", "distributed_type", "sets", "--fsdp on CPU processes: the "
          "accelerator's run type", "disable_cpu_fsdp2(trainer)", on_instances=True),
    Patch("accelerate.state.AcceleratorState", "fsdp_plugin", "sets", "--fsdp on CPU processes: the FSDP2 "
          "plugin built from the Trainer's arguments (accelerate sets it only where it runs FSDP itself)",
          "disable_cpu_fsdp2(trainer)", added=True),
    # -- models, configs, arguments, process-wide transformers state --
    Patch("transformers.PreTrainedModel", "forward", "replaces", "the lean loss: supported *ForCausalLM classes "
          "train without materializing [tokens, vocab] logits (process-wide, per class)", "disable_lean_loss()"),
    *(Patch(f"{module}.{name}", "forward", "replaces", "token tiles: a decoder layer's MLP and RMSNorms run a tile of "
            "tokens at a time (`integration.memory_savers`, --sparse_token_tiling_min_length), or through "
            "torch.compile (`integration.fused_ops`, --sparse_fused_ops compile), on the model's own instances",
            "integration.memory_savers.disable_memory_savers(model) "
            "/ integration.fused_ops.disable_fused_ops(model) / disable_sparse_attention(model)", ("self", argument))
      for name, (module, argument) in rowwise_classes().items()),
    Patch("torch.nn.Module", "forward", "replaces", "fused ops: a decoder layer's norms and dense MLP of an "
          "architecture outside the token tiles' classes (a norm without submodules, an MLP of linear layers and "
          "activations: `integration.fused_ops.compiled_modules`) run through torch.compile (--sparse_fused_ops "
          "compile), on the model's own instances; and a module routing functions through the Hub's kernels package "
          "(`kernels.use_kernelized_func`) skips the routing while none of them is kernelized, which an "
          "activation-checkpointed layer's trace refuses as a side effect (`integration.kernel_routing`)",
          "integration.fused_ops.disable_fused_ops(model) / integration.kernel_routing.route_kernel_funcs(model) / "
          "disable_sparse_attention(model)"),
    Patch("kernels", "use_kernelized_func", "reads", "a module whose class it decorated keeps its functions' private "
          "copies in `_kernel_funcs` (kernelized: a forward of their own) and its class's forward as the routing "
          "wrapper's `__wrapped__` (`integration.kernel_routing`)"),
    *(Patch(module, "load_balancing_loss_func", "replaces", "a MoE router's load-balancing loss is not a sum over "
            "tokens: under CP the wrapper computes it from the router logits gathered over the CP group, as one "
            "process (`trainer.router_loss`; process-wide, while CP is on; every installed modeling module whose "
            "function has this form, found in their source)", _CP_UNDO, ROUTER_LOSS_PARAMETERS)
      for module in router_loss_modules()),
    Patch("transformers.modeling_layers.GradientCheckpointingLayer", "forward", "replaces", "host offload: a decoder "
          "layer runs inside hooks that move what its checkpoint saves (its inputs) to host memory "
          "(--sparse_offload_layer_inputs), on the model's own instances",
          "integration.memory_savers.disable_memory_savers(model) / "
          "disable_sparse_attention(model)"),
    Patch("liger_kernel.transformers", "_apply_liger_kernel_to_instance", "calls", "--sparse_fused_ops liger (or "
          "--use_liger_kernel): liger-kernel's replacements for the model type, applied to the instance as the stock "
          "Trainer applies them; every name it changes, on the model and process-wide, is recorded and restored "
          "(`integration.fused_ops`)",
          "integration.fused_ops.disable_fused_ops(model) / disable_sparse_attention(model)", ("model", "**kwargs")),
    Patch("transformers.TrainingArguments", "use_liger_kernel", "sets", "the plugin applies liger-kernel itself, "
          "before the token tiles, which the Trainer's own application in train() would replace",
          "disable_sparse_attention(model)"),
    Patch("transformers.PretrainedConfig", "sparse_attention", "sets", "a model's sparse-attention settings are "
          "stored on its config (saved with it)", "disable_sparse_attention(model) / disable_curriculum(trainer)",
          added=True),
    Patch("transformers.TrainingArguments", "average_tokens_across_devices", "sets", "under CP the loss's token "
          "count takes the flag's form (without the flag: the CP group's count times the DP degree, never a fraction "
          "that TRL clamps to 1), which compute_loss multiplies by the processes only with the flag: it reads the flag "
          "on during that call", "the end of the call (`integration.patching.temporarily`)"),
    Patch(_TRAINER, "current_gradient_accumulation_steps", "sets", "TRL SFTTrainer, handed a label count where the "
          "Trainer gave none (a model whose forward takes no loss keywords, under CP), divides its MoE aux term by the "
          "accumulation steps as for a counted loss: it reads 1 during that call, as without a count (the training "
          "loop sets the attribute; an instance outside it has none to check)",
          "the end of the call (`integration.patching.temporarily`)", added=True),
    Patch("peft.AdaLoraConfig", "orth_reg_weight", "sets", "AdaLoRA's model adds orth_reg_weight x its orthogonal "
          "regularizer to the loss on every CP rank, which the Trainer's compute_loss multiplies by the processes: "
          "during that call under CP the weight is the rank's share, so the CP group counts the regularizer once "
          "(`trainer.adapter_loss`)", "the end of the call (`integration.patching.temporarily`)"),
    Patch("transformers.TrainingArguments", "gradient_checkpointing", "sets", "long sequences turn gradient "
          "checkpointing on (--sparse_gradient_checkpointing_min_length)", "disable_sparse_attention(model)",
          alternatives=("activation_checkpointing",)),
    Patch("transformers.integrations.sdpa_attention", "use_gqa_in_sdpa", "sets", "the memory predictions measure "
          "what a decoder layer saves with SDPA's stand-in taking grouped K/V heads as our attention does: during the "
          "measurement it answers yes (`simulator.memory_model.measurements.layer_saved`; its conditions and "
          "signature differ between releases, TRANSFORMERS_SDPA_FORCE_GQA exists only in some; a layer whose call "
          "gets repeated heads is refused)", "the end of the measurement (restored in a finally)"),
    Patch("transformers.AttentionInterface", "_global_mapping", "reads", "unpatch(): there is no public "
          "unregister"),
    Patch("transformers.masking_utils.AttentionMaskInterface", "_global_mapping", "reads", "unpatch(): there is "
          "no public unregister"),
    Patch("transformers.masking_utils", "and_masks", "reads", "the mask function knows an and-mask with the causal "
          "function among its parts (closure `mask_functions`) never lets a query see a later key, without "
          "evaluating it (`integration.call_tokens._causal_composition`; another closure is evaluated)",
          parameters=("*mask_functions",)),
    Patch("transformers.masking_utils", "sliding_window_overlay", "reads", "a window generate builds into a "
          "StaticCache's masks from config.sliding_window for a model whose own forward builds none (Llama, GPT-2) "
          "is read from the overlay's closure `sliding_window` and computed "
          "(`integration.call_tokens._function_window`)",
          parameters=("sliding_window",)),
    Patch("transformers.masking_utils", "create_sliding_window_causal_mask", "reads", "a family whose modeling module "
          "never imports it builds no sliding-window mask in its forward, whatever config.sliding_window says "
          "(`integration.call_tokens.builds_sliding_window_mask`)"),
    Patch("transformers.masking_utils", "remap_positions_for_packed_sequence", "reads", "the causal function on a "
          "packed batch's positions (closure `mask_function`), and-ed with the documents' mask, is known causal "
          "(`integration.call_tokens._causal_composition`)", parameters=("mask_function", "position_ids"),
          since=(5, 23)),
    Patch("transformers.modeling_layers.GenericForSequenceClassification", "forward", "reads", "under CP a "
          "sequence-classification head with this forward (Llama, Qwen2, Mistral, ...) trains: it pools one position "
          "of each row of its score layer's output, which a forward hook makes the row's pooled logits at every "
          "position, taken over the CP group, and computes its loss from them (`integration.heads`); a class with "
          "a forward of its own is refused"),
    Patch("transformers.modeling_layers.GenericForTokenClassification", "forward", "reads", "under CP a "
          "token-classification head with this forward trains: it scores every token on its own and its loss (a "
          "mean over its shard's labels, the loss keywords dropped) is replaced by the CP group's "
          "(`trainer.cp_token_loss.smooth_labels_over_cp_group`); a class with a forward of its own is refused"),
    Patch("transformers.modeling_layers.GenericForQuestionAnswering", "forward", "reads", "under CP a "
          "question-answering head with this forward trains: a forward hook makes its qa_outputs layer's output the "
          "whole row's, gathered over the CP group, from which it computes its start and end logits and loss "
          "(`integration.heads`); a class with a forward of its own is refused"),
    Patch("transformers.loss.loss_utils", "LOSS_MAPPING", "reads", "the lean loss applies only where a model uses "
          "the stock causal-LM loss"),
    Patch("transformers.utils.generic", "can_return_tuple", "calls", "the lean-loss forward honours "
          "return_dict=False like the stock forwards", parameters=("func",)),
    Patch("transformers.modeling_outputs.CausalLMOutputWithPast", "cache", "reads", "the lean-loss forward "
          "returns the KV cache under this release's field name (5.24 renamed it)",
          alternatives=("past_key_values",)),
    *(Patch(owner, KV_SHARED_SLICER, "replaces", "a model of KV-shared layers runs them on the kept logits' queries "
            "only, slicing each mask as sdpa's 4D one: sparse_cp's is the 2D padding mask (a padded batch: IndexError) "
            "and its queries are its keys' (logits_to_keep > 0 was refused); under sparse_cp they get their inputs "
            "whole, as transformers leaves them for flash attention (`integration.kv_sharing`), on the model's "
            "instances",
            "configure's guard removal (`integration.registration._remove_guard`)", parameters, since=(5, 23))
      for owner, parameters in kv_shared_slicers().items()),
    Patch("transformers.PretrainedConfig", "_attn_implementation", "reads", "the attention implementation a "
          "model uses (model checks under CP), and each sub-config's, which a composite model's towers keep and the "
          "undo restores (`integration.composite`)"),
    # -- torch and Triton --
    Patch("torch.Tensor", "_version", "reads", "a layout's derived tensors and a forward's token metadata are reused "
          "only while nothing wrote their tensors in place (autograd's own saved-tensor check); an inference tensor "
          "has none, and is never reused (`attention.layout.write_version`)"),
    Patch("torch.Tensor", "_base", "reads", "a mask the backend's mask function built is known in the view a model "
          "takes of it (GPT-2's forward: `attention_mask.view(batch, -1)`; `integration.call_tokens._recorded`)"),
    Patch("torch.distributed.ProcessGroup", "_get_backend", "calls", "the context-parallel groups take the default "
          "group's timeout (--ddp_timeout; torch gives a new group its backend's default, 30 min for gloo, and has no "
          "public getter: `distributed.comm.group_timeout`)"),
    Patch("torch._C._distributed_c10d.Backend.Options", "_timeout", "reads", "the timeout of a process group "
          "(`distributed.comm.group_timeout`)"),
    Patch("torch.distributed.distributed_c10d", "_set_pg_timeout", "calls", "the Trainer's --ddp_timeout becomes the "
          "default group's timeout on CPU processes too, where transformers does not pass it to accelerate (a stopped "
          "rank then stops the job within it, not gloo's 30 min)", "detach_from_trainer (the previous timeout)",
          parameters=("timeout", "group")),
    Patch("torch.distributed.distributed_c10d", "_get_default_store", "calls", "a refusal is printed once by the "
          "first rank to refuse (a counter in the store, which waits on no other rank: `launch.refusals`)"),
    Patch("torch.nn.modules.conv", "_ConvNd", "reads", "convolutions mix tokens outside attention: such models "
          "are refused under CP"),
    Patch("torch._library.fake_impl", "allocate_size", "calls", "the fake implementation of the plan op gives "
          "the layout's data-dependent widths as unbacked sizes in any trace (torch's `new_dynamic_size` refuses them "
          "unless torch._dynamo.config.capture_dynamic_output_shape_ops is set: a graph break at each call; "
          "`integration.compiled`)", parameters=("shape_env", "min_val", "max_val")),
    Patch("torch.library", "_register_effectful_op", "calls", "the op that refuses a non-causal mask inside a "
          "compiled forward (`integration.call_tokens`) returns nothing: registered as ordered-effectful, the graphs "
          "keep it (a pure op whose output no one reads is dead code) in the mask build, where it needs no Python "
          "side effect (which an activation-checkpointed layer's trace refuses)", parameters=("op", "effect", "lib"),
          since=ORDERED_EFFECTS_SINCE),
    Patch("torch._library.effects", "EffectType", "reads", "the effect `_register_effectful_op` registers "
          "(ORDERED)", since=ORDERED_EFFECTS_SINCE),
    Patch("torch._library.fake_impl.FakeImplCtx", "_shape_env", "reads", "the shape environment `allocate_size` "
          "creates the unbacked sizes in (`integration.compiled`)", on_instances=True),
    Patch("triton.runtime.jit", "JITFunction", "reads", "whether the kernels were decorated for Triton's "
          "interpreter (CPU tensors) or compiled (`kernels.ops`)"),
    Patch("triton._C.libtriton", "native_specialize_impl", "calls", "sm_90 builds without a GPU specialize "
          "recorded launch arguments as the JIT does (`testing.sm90`; never on the training path)"),
    # -- our own module, replaced while pictures are drawn --
    Patch("hf_sparse_cp.attention.sequence", "sequence_layout", "replaces", "`hf-sparse-cp plot` records the "
          "layouts a forward builds", "the end of `reporting.plots.capturing_layouts`"),
    Patch("os.environ", "HF_SPARSE_CP_DENSE_BACKEND", "sets", "`hf-sparse-cp plot` keeps dense calls on the "
          "block-sparse kernels so that they build a layout to draw",
          "the end of `reporting.plots.capturing_layouts`", added=True),
)
