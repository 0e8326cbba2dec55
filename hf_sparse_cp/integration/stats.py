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
# The Trainer log keys of the kept fraction: the mean over layers, and each layer's.
LOG_KEY = "sparse/kept_fraction"
LAYER_LOG_KEY = re.compile(rf"^{LOG_KEY}/layer_(-?\d+)$")
# The log keys of the step's speed and memory (`trainer.callbacks.StepMetricsCallback`), read by the model card.
TOKENS_PER_SECOND = "tokens_per_second"
PEAK_MEMORY = "peak_memory_gib"


def layer_log_key(layer: int) -> str:
    """The log key of one layer's kept fraction (matches `LAYER_LOG_KEY`)."""
    return f"{LOG_KEY}/layer_{layer:02d}"


def record_kept_fraction(module: torch.nn.Module, value: torch.Tensor) -> None:
    """Add one call's kept fraction (`SparseLayout.kept_fraction`: of the blocks a dense run of the same batch
    computes) to the module's running sum of its mode (training or evaluation)."""
    attr = _ATTR if module.training else _EVAL_ATTR
    total, count = getattr(module, attr, (None, 0))
    value = value.detach().double()
    module.__dict__[attr] = (value if total is None else total + value, count + 1)


def pop_kept_fractions(model: torch.nn.Module, training: bool | None = None) -> dict[int, float]:
    """Mean kept fraction per layer index since the last call, of the calls in training mode (`training` True), in
    evaluation mode (False) or both (None); resets those running sums."""
    attrs = {True: (_ATTR,), False: (_EVAL_ATTR,), None: (_ATTR, _EVAL_ATTR)}[training]
    per_layer: dict[int, list[float]] = {}
    for module in model.modules():
        total, count = None, 0
        for attr in attrs:
            part, n = module.__dict__.pop(attr, (None, 0))
            if part is not None:
                total, count = part if total is None else total + part, count + n
        if total is None or not count:
            continue
        layer = getattr(module, "layer_idx", None)
        per_layer.setdefault(-1 if layer is None else int(layer), []).append(float(total) / count)
    return {layer: sum(v) / len(v) for layer, v in sorted(per_layer.items())}
