"""Which transformers models sparse context parallelism computes exactly, checked before training starts.

Under CP every rank holds a shard of the sequence; only the `sparse_cp` attention sees the whole of
it (through the ring). A model is exact under CP when nothing else mixes tokens and nothing depends
on the length a rank sees:

* every attention call receives the CP shard: decoder layers that do not pass the attention
  keyword arguments on (StableLM, Nemotron) would attend within the local shard only. A probe
  forward of the model's architecture (on the meta device: no memory, no compute) checks that the
  shard reaches every attention call, and names the layers it does not reach;
* RoPE whose frequencies depend on the sequence length (`dynamic`, `longrope`): each rank would
  pick them from its own shard's positions;
* layers that mix tokens outside attention: they would see only their shard. Found by what they do:
  `config.layer_types` other than attention (recurrent, state-space, linear attention, short
  convolutions), and convolutions whose kernel spans more than one position (a kernel of width 1, or
  transformers' `Conv1D` of GPT-2, a linear layer, maps every token on its own).

An architecture is refused only for one of these named causes (or those of the sparse backend:
soft-capping, attention dropout, bidirectional attention). The architecture table
(`architectures.ARCHITECTURES`) says which model types were tested exact under CP against one process
(tests/distributed/test_cp_models.py checks each); another architecture that passes the checks trains,
and the log says it is outside the table.
"""

from __future__ import annotations

import copy
import logging

import torch

from ..config import BACKEND_NAME
from ..distributed.heads.split import HeadSplit
from ..distributed.shard import CP_SHARD_KWARG
from . import compat
from .architectures import cp_tested_model_types
from .backend import ShardProbe, probing

logger = logging.getLogger(__name__)

# RoPE types whose frequencies depend on the positions of the call (the longest one seen).
LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")
# Values of `config.layer_types` that are attention layers (anything else mixes tokens otherwise).
ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")


def _rope_types(config) -> set[str]:
    """Every rope_type the config uses (rope_parameters may be per layer type)."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    per_layer = params.values() if params and all(isinstance(v, dict) for v in params.values()) else [params]
    return {p.get("rope_type") or p.get("type") or "default" for p in per_layer}


def _token_mixers(model: torch.nn.Module) -> list[str]:
    """Layer types and modules of `model` that mix tokens outside attention: layer types other than attention,
    and convolutions over more than one position."""
    found = [f"layer type '{t}'" for t in sorted(set(getattr(model.config, "layer_types", None) or ()))
             if t not in ATTENTION_LAYER_TYPES]
    convolution = compat.convolution_class()
    return found + [f"{type(module).__name__} of kernel {tuple(module.kernel_size)} ({name})"
                    for name, module in model.named_modules()
                    if isinstance(module, convolution) and any(k > 1 for k in module.kernel_size)]


def _probe(target: torch.nn.Module, device: torch.device | str) -> list[tuple[str, bool]]:
    """(decoder layer class, whether the marker arrived) for every attention call of one forward of
    `target` with a probe in place of the CP shard."""
    probe = ShardProbe()
    with probing(probe), torch.no_grad():
        target(input_ids=torch.zeros(1, 8, dtype=torch.long, device=device), **{CP_SHARD_KWARG: probe})
    modules = dict(target.named_modules())
    parents = {id(m): type(modules[n.rpartition(".")[0]]).__name__ for n, m in modules.items() if n}
    return [(parents[id(module)], reached) for module, reached in probe.calls]


def _shard_reach(model: torch.nn.Module) -> list[tuple[str, bool]]:
    """`_probe` of the model's architecture built on the meta device (no memory, no compute), or of
    the model itself where the architecture does not build or run there."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # a PEFT model's architecture
    try:
        with torch.device("meta"):
            shadow = type(base)(copy.deepcopy(base.config))
        return _probe(shadow, "meta")
    except Exception as e:  # any failure on meta: fall back to the real model, whose failure is reported
        logger.info("Probing %s itself: its architecture does not run on the meta device (%s).", type(model).__name__,
                    e)
    try:
        return _probe(model, next(model.parameters()).device)
    except Exception as e:
        raise ValueError(f"could not check that every attention layer of {type(model).__name__} receives the "
                         f"context-parallel shard: its probe forward failed ({e}).") from e


def sliding_window_layers(config) -> list[int]:
    """The indices of the layers whose `config.layer_types` entry is sliding-window attention."""
    return [i for i, t in enumerate(getattr(config, "layer_types", None) or ()) if t == "sliding_attention"]


def attention_layers(config) -> list[int]:
    """The layers that run the sparse pattern unless it says dense: all but the sliding-window ones."""
    sliding = set(sliding_window_layers(config))
    return [i for i in range(config.num_hidden_layers) if i not in sliding]


def check_model_supports_sparse_attention(model: torch.nn.Module) -> None:
    """Raise ValueError, naming the cause and the fix, when the `sparse_cp` backend would refuse `model`'s
    attention at its first call (see `backend._refuse_unsupported`): checked from the model before
    training, not after everything is built."""
    config = getattr(model, "config", None)
    name = type(model).__name__
    if config is None:
        raise ValueError(f"{name} has no transformers config; the sparse_cp backend trains transformers models.")
    model_type = getattr(config, "model_type", name)
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(f"{name} is an encoder-decoder model; sparse_cp computes causal decoder self-attention only.")
    softcap = getattr(config, "attn_logit_softcapping", None)
    if softcap is not None:
        raise ValueError(f"{name} (model type {model_type!r}) soft-caps attention logits (attn_logit_softcapping="
                         f"{softcap}), which the sparse kernels do not implement: train it with attn_implementation="
                         "'eager' or 'sdpa' (--sparse_attention false).")
    dropout = getattr(config, "attention_dropout", 0.0) or 0.0
    if dropout > 0:
        raise ValueError(f"{name} (model type {model_type!r}) has attention_dropout={dropout}, which sparse_cp does "
                         "not implement: set model.config.attention_dropout = 0.0 before training.")
    bidirectional = [n for n, m in model.named_modules() if getattr(m, "is_causal", True) is False]
    if bidirectional:
        raise ValueError(
            f"{name} has bidirectional attention layers ({bidirectional[0]}, ...); sparse_cp computes causal "
            "self-attention only."
        )


def check_model_supports_context_parallel(
    model: torch.nn.Module, backend: str = BACKEND_NAME, *, head_size: int = 1
) -> None:
    """Raise ValueError, naming the cause and the fix, unless sparse context parallelism computes
    `model` exactly (see the module docstring). Call it before training (the Trainer integration
    does); it runs one probe forward of the architecture on the meta device.

    Args:
        model: a transformers causal LM that uses the `sparse_cp` backend.
        backend: the attention implementation every layer must use.
        head_size: ranks of a head group (--cp_mode ulysses or hybrid): the model's heads must split
            over them (`HeadSplit`: at least one query head per rank).
    """
    config = getattr(model, "config", None)
    name = type(model).__name__
    if config is None:
        raise ValueError(f"{name} has no transformers config; context parallelism needs a transformers model.")
    check_model_supports_sparse_attention(model)
    sub = [k for k in ("vision_config", "audio_config", "encoder_config") if getattr(config, k, None) is not None]
    if sub:
        raise ValueError(
            f"{name} has non-text towers ({', '.join(sub)}) whose attention is not sharded; sparse context "
            "parallelism supports text-only causal language models."
        )
    impl = compat.attn_implementation(config)
    if impl != backend:
        raise ValueError(
            f"{name} uses attn_implementation={impl!r}; under context parallelism every attention layer must go "
            f"through '{backend}', which runs the ring (call hf_sparse_cp.patch() and hf_sparse_cp.configure(model))."
        )
    if head_size > 1:
        heads = config.num_attention_heads
        HeadSplit(heads, getattr(config, "num_key_value_heads", None) or heads, head_size)
    rope = sorted(_rope_types(config) & set(LENGTH_DEPENDENT_ROPE))
    if rope:
        raise ValueError(
            f"{name} uses RoPE type {rope[0]!r}, whose frequencies depend on the longest position of each call: "
            "under context parallelism every rank would choose them from its own shard. Train with a static "
            "RoPE type ('default', 'linear', 'yarn', 'llama3') or without context parallelism."
        )
    mixers = _token_mixers(model)
    if mixers:
        raise ValueError(
            f"{name} mixes tokens outside attention ({', '.join(mixers[:3])}{', ...' if len(mixers) > 3 else ''}): "
            "under context parallelism such layers would see only this rank's shard. Train it without context "
            "parallelism."
        )
    calls = _shard_reach(model)
    missed = sorted({layer for layer, reached in calls if not reached})
    if missed or not calls:
        where = ", ".join(missed) if missed else "any attention layer"
        raise ValueError(
            f"{name}: the context-parallel shard does not reach {where}: its decoder layer calls attention without "
            "passing the attention keyword arguments on, so each rank would attend within its own shard only. "
            "Train this model without context parallelism."
        )
    model_type = getattr(config, "model_type", None)
    if model_type not in cp_tested_model_types():
        logger.warning("Model type %r is outside the architectures tested exact under context parallelism; it "
                       "passed the checks for shard reach, RoPE and token mixing.", model_type)
