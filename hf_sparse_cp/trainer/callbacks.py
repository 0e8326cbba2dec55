"""Trainer callbacks of the plugin: sparsity logging, and SMET's attach-and-log callback."""

from __future__ import annotations

from transformers import TrainerCallback

from ..integration.stats import LOG_KEY, layer_log_key, pop_kept_fractions
from ..smet import unwrap_smet


def add_to_log(state, logs: dict, extra: dict) -> None:
    """Add `extra` to the log being written and to its entry in the Trainer's history."""
    logs.update(extra)
    if state.log_history:
        state.log_history[-1].update(extra)


class SparsityLoggingCallback(TrainerCallback):
    """Adds the per-layer kept fraction of attention blocks to every Trainer log: the blocks computed over the
    blocks dense attention computes on the same batches (1.0 for a layer that runs dense, whatever the packing).

    Keys: `sparse/kept_fraction` (mean over layers) and `sparse/kept_fraction/layer_NN`. The callback
    must run before the reporting callbacks (TensorBoard, W&B) so they see the keys:
    `attach_to_trainer` puts it first.
    """

    def on_log(self, args, state, control, logs=None, model=None, **kwargs):
        if logs is None or model is None:
            return
        per_layer = pop_kept_fractions(model)
        if not per_layer:
            return
        extra = {layer_log_key(layer): round(v, 5) for layer, v in per_layer.items()}
        extra[LOG_KEY] = round(sum(per_layer.values()) / len(per_layer), 5)
        add_to_log(state, logs, extra)


class SMETCallback(TrainerCallback):
    """Attaches SMET when training begins (after accelerate has prepared the model and a checkpoint was
    loaded), sets the prune-rate decay horizon from `max_steps`, and logs `smet/density`,
    `smet/topology_updates` and `smet/replaced_fraction` (share of active blocks replaced at the last
    topology update)."""

    def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
        smet = unwrap_smet(optimizer)
        if smet is None:
            raise RuntimeError("SMETCallback found no SMET optimizer; install it with "
                               "hf_sparse_cp.install_smet(trainer, config).")
        if smet.config.prune_decay_steps is None:
            smet.schedule_horizon = state.max_steps
        smet.attach()

    def on_log(self, args, state, control, logs=None, optimizer=None, **kwargs):
        smet = unwrap_smet(optimizer)
        if logs is None or smet is None:
            return
        add_to_log(state, logs, {
            "smet/density": round(smet.density(), 5),
            "smet/topology_updates": smet.topology_updates,
            "smet/replaced_fraction": round(smet.last_replaced_fraction, 5),
        })
