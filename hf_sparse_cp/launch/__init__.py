"""Launching a training script with the plugin, beside `hf_sparse_cp.run` (the entry point every launch runs):

* `launched`: what `hf_sparse_cp.run` changes in transformers while a stock script runs (its parser takes the
  plugin's flags, its Trainer trains with the plugin), undone when the script ends;
* `processes`: the one path that starts the processes: `hf_sparse_cp.run` in this process, or under torchrun
  (`--nproc N`) or accelerate launch (`--config_file`), with the signals of this process passed on to them.
  `hf-sparse-cp launch` (any script) and `hf-sparse-cp train` (the long-context example) both take it;
* `accelerate_config`: what an accelerate config (`--config_file`) asks of this machine, refused before any process
  starts where it cannot run there (too few accelerators, gpu_ids, FSDP1 or DeepSpeed where they cannot run);
* `refusals`: a setup the plugin refuses ends a launched run with its message once, exit status 2, no traceback;
* `interrupts`: Ctrl-C ends a launched run with one line (the processes stopped, the last checkpoint), exit status
  130, no traceback; `worker`: what each launched process runs (`hf_sparse_cp.run`, quiet on a Ctrl-C during its
  imports);
* `command`: the grammar of a launch command (plugin flags, the script, its arguments) and its checks;
* `known_scripts`: what a script's source says it builds (TRL's trainers), refused before any process starts
  where CP or this machine cannot run it.

This file imports nothing, so that the command line's light commands stay light.
"""
