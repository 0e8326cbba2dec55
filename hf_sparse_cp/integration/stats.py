"""Per-layer sparsity statistics, kept on the attention modules themselves (no global state).

The attention function adds the kept fraction of every call to its module; a logging callback
reads and resets them at each log step. Values stay on the device until read, so recording
costs no synchronization.
"""

from __future__ import annotations

import re

import torch

_ATTR = "_hf_sparse_cp_kept"
# The running sums of calls in evaluation mode (`module.training` False): an evaluation's log shows them, not the
# training steps before it, and a training log its own steps.
_EVAL_ATTR = "_hf_sparse_cp_kept_eval"
# The running sums of calls in training mode with gradients off: not a training step's forward (a trainer's
# generation, e.g. TRL GRPO's, which generates in training mode; a reference model's log-probabilities), so a
# training log drops them.
_NO_GRAD_ATTR = "_hf_sparse_cp_kept_no_grad"
# The Trainer log keys of the kept fraction: the mean over layers, and each layer's.
LOG_KEY = "sparse/kept_fraction"
LAYER_LOG_KEY = re.compile(rf"^{LOG_KEY}/layer_(-?\d+)$")
# The log keys of the step's speed and memory (`trainer.callbacks.StepMetricsCallback`), read by the model card.
TOKENS_PER_SECOND = "tokens_per_second"
PEAK_MEMORY = "peak_memory_gib"


def layer_log_key(layer: int) -> str:
    """The log key of one layer's kept fraction (matches `LAYER_LOG_KEY`)."""
    return f"{LOG_KEY}/layer_{layer:02d}"


def record_kept_fraction(module: torch.nn.Module, value: torch.Tensor, grad_enabled: bool | None = None) -> None:
    """Add one call's kept fraction (`SparseLayout.kept_fraction`: of the blocks a dense run of the same batch
    computes) to the module's running sum of its mode (training, with gradients or without, or evaluation).
    `grad_enabled`: whether the call's forward records gradients, where that is not this thread's grad mode (the
    plan op inside a compiled forward: `compiled.sequence_plan`); default `torch.is_grad_enabled()`."""
    grad_enabled = torch.is_grad_enabled() if grad_enabled is None else grad_enabled
    attr = (_ATTR if grad_enabled else _NO_GRAD_ATTR) if module.training else _EVAL_ATTR
    total, count = getattr(module, attr, (None, 0))
    value = value.detach().double()
    module.__dict__[attr] = (value if total is None else total + value, count + 1)


def pop_kept_fractions(model: torch.nn.Module, training: bool | None = None, without_grad: bool = True
                       ) -> dict[int, float]:
    """Mean kept fraction per layer index since the last call, of the calls in training mode (`training` True), in
    evaluation mode (False) or both (None); resets those running sums. The calls in training mode with gradients off
    count only with `without_grad` (the sparsity log passes False: a step's generation is no part of its training
    forward); reset with the training calls either way."""
    attrs = {True: (_ATTR, _NO_GRAD_ATTR), False: (_EVAL_ATTR,), None: (_ATTR, _NO_GRAD_ATTR, _EVAL_ATTR)}[training]
    per_layer: dict[int, list[float]] = {}
    for module in model.modules():
        total, count = None, 0
        for attr in attrs:
            part, n = module.__dict__.pop(attr, (None, 0))
            if part is not None and (without_grad or attr != _NO_GRAD_ATTR):
                total, count = part if total is None else total + part, count + n
        if total is None or not count:
            continue
        layer = getattr(module, "layer_idx", None)
        per_layer.setdefault(-1 if layer is None else int(layer), []).append(float(total) / count)
    return {layer: sum(v) / len(v) for layer, v in sorted(per_layer.items())}
