"""Layers that reuse an earlier layer's keys and values (Gemma 4's last `num_kv_shared_layers`): transformers runs
them on the queries of the kept logits only (`_maybe_slice_kv_shared_inputs`, with an int `logits_to_keep`: 0 in
training), slicing each attention mask as the [B, 1, q, k] mask of sdpa and eager. sparse_cp hands its layers the 2D
padding mask (a padded batch ended in an IndexError, 'too many indices for tensor of dimension 2') and computes the
queries of its keys (logits_to_keep=1 was refused as keys the layer adds of its own). As for flash attention, whose
2D mask transformers does not slice either, those inputs go on whole under sparse_cp: the same logits, the slice being
only a saving."""

from __future__ import annotations

import functools
import inspect

import torch

from ..config import BACKEND_NAME
from . import upstream
from .architectures import KV_SHARED_SLICER, kv_shared_slicers
from .patching import attached_patches, record_on, undo_recorded

_FEATURE = "unsliced_kv_sharing"


def unslice_kv_sharing(model: torch.nn.Module) -> None:
    """Have each model of `kv_shared_slicers()` in `model` hand its KV-shared layers their inputs whole while it uses
    sparse_cp (an instance attribute, recorded on `model`; `slice_kv_sharing` undoes it). Nothing for other models."""
    slicers = [m for m in model.modules()
               if any(f"{c.__module__}.{c.__qualname__}" in kv_shared_slicers() for c in type(m).__mro__)]
    if not slicers or attached_patches(model, _FEATURE) is not None:
        return
    patches = record_on(model, _FEATURE)
    for module in slicers:
        patches.set_attr(module, KV_SHARED_SLICER, functools.partial(_unsliced, module))


def slice_kv_sharing(model: torch.nn.Module) -> None:
    """Undo `unslice_kv_sharing`."""
    undo_recorded(model, _FEATURE)


def _unsliced(module: torch.nn.Module, *args, **kwargs):
    """The model's own `KV_SHARED_SLICER`, or under sparse_cp its sequence inputs unchanged (the arguments before
    `logits_to_keep`), as transformers returns them for flash attention."""
    method = getattr(type(module), KV_SHARED_SLICER)
    if upstream.attn_implementation(module.config) != BACKEND_NAME:
        return method(module, *args, **kwargs)
    bound = inspect.signature(method).bind(module, *args, **kwargs).arguments
    names = list(bound)
    return tuple(bound[name] for name in names[1:names.index("logits_to_keep")])
