"""The work around attention, fused: `enable_fused_ops(model, choice)` / `disable_fused_ops(model)`.

Once attention is sparse, a long-context step spends much of its time in the elementwise work of the
decoder layers (RMSNorm, RoPE, the gated MLP's activation, casts), which stock PyTorch runs as many small
kernels. Two ways to fuse it, both leaving the `sparse_cp` attention function registered and the causal-LM
loss to the lean loss:

* 'liger': liger-kernel's replacements for the model's type (RMSNorm, RoPE, SwiGLU or GeGLU, ..., whatever
  its `apply_liger_kernel_to_<type>` swaps), applied to the model instance through the function the stock
  Trainer's `--use_liger_kernel` calls, with the settings `liger_settings` gives: liger's loss replacements
  off while the lean loss computes the loss. The lean loss already runs liger-kernel's fused linear
  cross-entropy kernel on CUDA (`hf_sparse_cp.loss`), as a loss sum divided by the Trainer's global token
  count, which is exact under context parallelism, zero-gradient (not NaN) for a batch without targets, and
  takes a bias; liger's own forward divides its sum the same way when given that count but falls back to a
  per-rank mean without it, and replaces `forward` on the instance, which would hide the lean loss.
  CUDA only (Triton kernels that Triton's interpreter does not run). Not what 'auto' picks for a model compiled
  whole (a Trainer's --torch_compile, or accelerate's dynamo backend): inductor fuses that work there, and liger's
  RoPE writes q and k in place, its SwiGLU backward its saved inputs, its RMSNorm backward the incoming gradient,
  all from raw Triton kernels that dynamo puts into the graphs for inductor to functionalize.
* 'compile': every decoder layer's MLP and norms (those around attention, `memory_savers.layer_modules`, and the
  other norms and feed-forward blocks a layer holds) and the final norm run through `torch.compile` (one compiled
  function per class, dynamic shapes: token tiles and sequence lengths vary), on any device inductor supports: the
  classes token tiles take, and another architecture's norms and dense MLPs (`compiled_modules`); a mixture of
  experts or a module with dropout is left to eager PyTorch, with a warning.

Every change is recorded on the model (`patching.record_on`): `disable_fused_ops(model)` restores the
modules, and the process-wide names liger replaced (module functions and classes) while they are still
liger's. Token tiles (`memory_savers`) wrap what this module leaves, so they are applied after it.
"""

from __future__ import annotations

import functools
import importlib.metadata
import logging
import sys
from collections.abc import Mapping
from typing import Any

import torch

from ..backends import is_available
from ..config.model_fields import decoder_layers
from .architectures import tileable_classes
from .memory_savers import ReplacedForward, layer_modules
from .models import attention_modules
from .patching import record_on, undo_recorded

logger = logging.getLogger(__name__)

_FEATURE = "fused_ops"
FUSED_OPS = ("auto", "liger", "compile", "off")
LIGER_EXTRA = "pip install 'hf-sparse-cp[liger]'"
# liger's loss replacements, off while the lean loss computes the loss (see the module docstring)
LIGER_LOSS_OFF = {"cross_entropy": False, "fused_linear_cross_entropy": False}


def is_liger_available() -> bool:
    """True when liger-kernel's model patching imports (checked once)."""
    return is_available("liger_kernel.transformers", "_apply_liger_kernel_to_instance")


def resolve_fused_ops(setting: str, on_cuda: bool, compiled: bool = False) -> str:
    """'liger', 'compile' or 'off' for `setting` (`--sparse_fused_ops`): 'auto' is liger-kernel's kernels when
    training on CUDA with liger-kernel installed, else 'off'; 'off' too for a model compiled whole (`compiled`: a
    Trainer's --torch_compile or accelerate's dynamo backend), whose inductor fuses that work itself, while
    liger-kernel's autograd Functions write into their inputs and saved tensors from raw Triton kernels that inductor
    would have to functionalize.
    An explicit 'liger' stays 'liger'. Raises ValueError, naming the fix, for a setting that cannot run here."""
    if setting not in FUSED_OPS:
        raise ValueError(f"--sparse_fused_ops {setting!r} is unknown; use one of {FUSED_OPS}.")
    if setting == "auto":
        return "liger" if on_cuda and not compiled and is_liger_available() else "off"
    if setting == "liger" and not on_cuda:
        raise ValueError("--sparse_fused_ops liger (or --use_liger_kernel): liger-kernel's Triton kernels need a CUDA "
                         "GPU; on CPU use --sparse_fused_ops compile or off (and drop --use_liger_kernel).")
    if setting == "liger" and not is_liger_available():
        raise ValueError(f"--sparse_fused_ops liger (or --use_liger_kernel) needs liger-kernel: {LIGER_EXTRA}, or "
                         "use --sparse_fused_ops compile.")
    return setting


def liger_settings(given: Mapping[str, Any] | None, lean_loss: bool) -> dict[str, Any]:
    """liger-kernel's keyword arguments for the model: `given` (the Trainer's `--liger_kernel_config`), with its
    loss replacements off unless `given` names them, when `lean_loss` computes the loss."""
    settings = dict(given or {})
    if lean_loss:
        for name, value in LIGER_LOSS_OFF.items():
            settings.setdefault(name, value)
    return settings


def _process_wide_namespaces() -> list[Any]:
    """Where liger-kernel's patching functions replace names for every model of the process: the loaded
    transformers model modules (functions such as `apply_rotary_pos_emb`, the norm and MLP classes) and
    `torch.nn.functional` (its cross-entropy replacement)."""
    return [module for name, module in list(sys.modules.items())
            if module is not None and name.startswith("transformers.models.")] + [torch.nn.functional]


@functools.cache
def _compiled(function):
    return torch.compile(function, dynamic=True)


class _CompiledForward(ReplacedForward):
    """A module's forward through `torch.compile`, one compiled function per class forward (the module an input)."""

    def __call__(self, *args, **kwargs):
        if torch.compiler.is_compiling():
            # (inside a compiled model, --torch_compile: the outer graph compiles this forward with the rest; dynamo
            # would otherwise trace through the cached `_compiled`, ignoring its cache, with a warning of "potential
            # silent incorrectness")
            return self.replaced(*args, **kwargs)
        if self._function is not None:
            return _compiled(self._function)(self.module, *args, **kwargs)
        return _compiled(self._replaced)(*args, **kwargs)


def _pure(module: torch.nn.Module) -> bool:
    """Whether `module`'s forward is a function of its input and parameters alone, which torch.compile computes as
    eager PyTorch does (to rounding): a module without submodules (a norm: Gemma's (1 + weight) RMSNorm, Cohere's
    LayerNorm) or one whose submodules are linear layers and activations (a dense MLP: Gemma's GeGLU, Phi-3's fused
    gate_up); not one holding dropout (inductor draws other random numbers) or routers and experts (a mixture of
    experts: data-dependent routing, and the causal LM's hooks record its routers' logits)."""
    from transformers import activations

    kinds = (activations.__name__, torch.nn.modules.activation.__name__)
    return all(isinstance(m, torch.nn.Linear) or type(m).__module__ in kinds for m in list(module.modules())[1:])


def _layer_children(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(name, module) of `memory_savers.layer_modules`, then of every other module with parameters a decoder layer
    holds directly that holds no attention (`models.attention_modules`): the norms and feed-forward blocks an
    architecture keeps under other names (Gemma's and OLMo 2's post-feedforward norms, GLM-4's post-MLP norm, Llama 4's
    feed_forward). Only `layer_modules` where the probe finds no attention module (none would be told apart)."""
    found = layer_modules(model)
    attention = {id(m) for _, m, _ in attention_modules(model)}
    if not attention:
        return found
    names, taken = {m: n for n, m in model.named_modules()}, {id(m) for _, m in found}
    others = [child for layer in decoder_layers(model) for child in layer.children()
              if id(child) not in taken and any(True for _ in child.parameters())
              and not any(id(m) in attention for m in child.modules())]
    return found + [(names.get(m, "?"), m) for m in others]


def compiled_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(name, module) of the modules 'compile' runs through torch.compile: those of `_layer_children` (the decoder
    layers' norms and feed-forward blocks, and the final norm) of a class token tiles take
    (`architectures.tileable_classes`) or `_pure`. The others (a mixture of experts, a module with dropout, a Mamba
    mixer) are left to eager PyTorch, with a warning naming their classes; with none left, nothing is compiled."""
    known, found = tileable_classes(), _layer_children(model)
    kept = [(name, m) for name, m in found if type(m).__name__ in known or _pure(m)]
    left = sorted({type(m).__name__ for _, m in found} - {type(m).__name__ for _, m in kept})
    if left:
        logger.warning("--sparse_fused_ops compile: %s of %s left to eager PyTorch: not a function of its input alone "
                       "(routed experts, dropout, or submodules other than linear layers and activations).",
                       ", ".join(left), type(model).__name__)
    return kept


def enable_fused_ops(model: torch.nn.Module, choice: str, liger_config: Mapping[str, Any] | None = None) -> None:
    """Fuse the non-attention work of `model`'s decoder layers; `disable_fused_ops(model)` undoes it.

    Args:
        model: a transformers causal LM (its attention implementation is left as it is).
        choice: 'liger', 'compile' or 'off' (`resolve_fused_ops`).
        liger_config: for 'liger', liger-kernel's keyword arguments (`liger_settings`).

    Raises ValueError when fused ops are already enabled on `model`. For 'compile', a module of the decoder layers
    that is not known to compile exactly (`compiled_modules`) is left as it is, with a warning naming its class.
    """
    if choice not in FUSED_OPS[1:]:
        raise ValueError(f"choice={choice!r}: use one of {FUSED_OPS[1:]} (resolve 'auto' with resolve_fused_ops).")
    if choice == "off":
        return
    modules = compiled_modules(model) if choice == "compile" else []
    patches = record_on(model, _FEATURE)
    if choice == "compile":
        for _, module in modules:
            patches.set_attr(module, "forward", _CompiledForward(module))
        return
    from liger_kernel.transformers import _apply_liger_kernel_to_instance

    settings = dict(liger_config or {})
    apply = functools.partial(_apply_liger_kernel_to_instance, model=model, **settings)
    # process-wide names first (outside the model), then the model's own modules, each change recorded once
    patches.record_changes(_process_wide_namespaces(), lambda: patches.record_changes(list(model.modules()), apply),
                           outside=True)


def disable_fused_ops(model: torch.nn.Module) -> bool:
    """Undo `enable_fused_ops(model, ...)`; False when they were not enabled."""
    return undo_recorded(model, _FEATURE)


def _compiled_forward(module: torch.nn.Module) -> bool:
    """Whether `module`'s forward runs through torch.compile here, under other replaced forwards (token tiles)."""
    forward = module.__dict__.get("forward")
    while isinstance(forward, ReplacedForward):
        if isinstance(forward, _CompiledForward):
            return True
        forward = forward.inner
    return False


def fused_modules(model: torch.nn.Module) -> dict[str, int]:
    """What runs fused in `model`, by kind: the classes liger-kernel swapped in (by the name they report, e.g.
    'LigerRMSNorm'), 'liger RoPE' (1 when the model's modeling module applies liger's rotary embedding) and
    'compiled' (modules whose forward runs through torch.compile here); empty when nothing is fused."""
    found: dict[str, int] = {}
    for module in model.modules():
        name = module._get_name()
        kind = "compiled" if _compiled_forward(module) else (name if name.startswith("Liger") else None)
        if kind is not None:
            found[kind] = found.get(kind, 0) + 1
    rope = getattr(sys.modules.get(type(model).__module__), "apply_rotary_pos_emb", None)
    if getattr(rope, "__module__", "").startswith("liger_kernel"):
        found["liger RoPE"] = 1
    return found


def describe_fused_ops(model: torch.nn.Module, compiled: bool = False) -> str:
    """One line for the start-up message: what runs fused around attention, or that nothing does (`compiled`: the
    model is compiled whole, so its backend, inductor by default, fuses what nothing else does)."""
    found = fused_modules(model)
    if not found and compiled:
        return ("fused ops: left to torch.compile in the model compiled whole (--torch_compile or accelerate's dynamo "
                "backend; liger-kernel's kernels left out)")
    if not found:
        return "fused ops: off (stock PyTorch around attention)"
    if "compiled" in found:
        return f"fused ops: torch.compile on {found['compiled']} MLP / RMSNorm modules"
    version = importlib.metadata.version("liger-kernel")
    kinds = ", ".join(f"{kind} x{count}" if count > 1 else kind for kind, count in found.items())
    return f"fused ops: liger-kernel {version} ({kinds})"
