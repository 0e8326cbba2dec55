"""Trainer callbacks of the plugin."""

from __future__ import annotations

from transformers import TrainerCallback

from .stats import pop_kept_fractions


class SparsityLoggingCallback(TrainerCallback):
    """Adds the per-layer kept fraction of attention blocks to every Trainer log.

    Keys: `sparse/kept_fraction` (mean over layers) and `sparse/kept_fraction/layer_NN`. The callback
    must run before the reporting callbacks (TensorBoard, W&B) so they see the keys:
    `hf_sparse_cp.integration.attach_to_trainer` puts it first.
    """

    def on_log(self, args, state, control, logs=None, model=None, **kwargs):
        if logs is None or model is None:
            return
        per_layer = pop_kept_fractions(model)
        if not per_layer:
            return
        extra = {f"sparse/kept_fraction/layer_{layer:02d}": round(v, 5) for layer, v in per_layer.items()}
        extra["sparse/kept_fraction"] = round(sum(per_layer.values()) / len(per_layer), 5)
        logs.update(extra)
        if state.log_history:
            state.log_history[-1].update(extra)
