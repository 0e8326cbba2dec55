"""The Trainer glue: the one switch and everything it sets up on a Trainer instance.

* `sparse_trainer.py`: `SparseTrainingArguments` and `SparseTrainer`, the one switch for a Trainer script;
* `arguments.py`: `SparseCPArguments`, `SMETArguments`, `explicit_fields` (flags for `HfArgumentParser`);
* `plugin_arguments.py`: every plugin flag as a field, and `PluginArguments` (those alone), without the Trainer;
* `attach.py`: `enable_sparse_attention`, `attach_to_trainer` and their undo calls (the functional API);
* `context_parallel.py`: `enable_trainer_context_parallel` (the Trainer's CP input preparation), from the pieces
  `cp_batches.py` (the DP-only data loader, a rank's share of a batch), `cp_steps.py` (the steps and counts),
  `cp_token_loss.py` (label smoothing), `cp_neftune.py` and `cp_metrics.py` (the evaluation's gathers);
* `token_ids.py`: the CP data loader's check of token ids against the model's vocabulary, on the host;
  `stream_rows.py`: the rows of an iterable dataset's last batch that are the stream's, over the DP ranks;
* `cp_checks.py`: what of a run CP refuses, naming the fix, or computes near one process only (logged at its start);
* the losses CP reproduces beyond the token loss: `whole_rows.py` (TRL's DPO, KTO and Reward trainers, from whole
  rows gathered over the CP group), `generated_rows.py` (TRL's GRPO and RLOO, rows generated in the step),
  `router_loss.py` (a MoE router's load-balancing loss), `adapter_loss.py` (AdaLoRA's regularizer) and
  `reference.py` (the reference model a TRL trainer keeps attends as the trained one does), `precomputed.py` (the
  reference log-probs TRL's DPO and KTO precompute: their cache keyed by the pattern too, a dataset the processes
  cannot share that cache of refused);
* `trl.py`: the one switch for TRL's trainers (`SparseSFTTrainer`, ...);
* `curriculum.py`: `--cp_schedule`, a context-length curriculum switched online (`enable_curriculum`), whose
  stages `schedule.py` reads, `stage_plan.py` checks for the run (`build_schedule`) and `stage_data.py` feeds
  (the cropped samples, the run-long batch sampler);
* `checkpoints.py`: checks a resume against the run, and FSDP2's sharded checkpoints (the marker that says a
  checkpoint is complete is read without torch by `hf_sparse_cp.checkpoint_marker`, below the layers);
* `cpu_fsdp.py`: `--fsdp` as FSDP2 on CPU processes; `smet.py`: `install_smet` / `uninstall_smet`;
* `callbacks.py`: kept-fraction and SMET logging; `packing.py`: the block-aligned packing collator;
  `tied_weights.py`: tied weights aliased again in a state dict gathered from FSDP2's shards;
* `flag_reference.py`: docs/flags.md, generated from the argument classes' help text.
"""
