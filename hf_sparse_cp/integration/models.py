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
* positions a model counts from its input tokens (RoBERTa's position table with a padding index): each rank
  would count them over its own shard;
* layers that mix tokens outside attention: they would see only their shard. Found by what they do:
  `config.layer_types` other than attention (recurrent, state-space, linear attention, short
  convolutions), and convolutions whose kernel spans more than one position (a kernel of width 1, or
  transformers' `Conv1D` of GPT-2, a linear layer, maps every token on its own).

Before any of these, and whenever a model is switched to the backend (`configure`, the Trainer glue), the
switch is checked (`check_attention_routed`): an architecture whose attention does not go through transformers'
AttentionInterface (bloom, mpt, xglm: their attention is their own code, which a forward without the switch
refuses at its mask, `call_tokens.UnroutedMask`) or that builds an attention mask of its own (doge) would otherwise
train without the sparse pattern, or fail at its first forward.

An architecture is refused only for one of these named causes (or those of the sparse backend:
soft-capping, learned sinks, attention dropout, bidirectional attention; the probe forward finds what a layer
passes to attention, so those are refused before training too). The architecture table
(`architectures.ARCHITECTURES`) says which model types were tested exact under CP against one process
(tests/distributed/test_cp_models.py checks each); another architecture that passes the checks trains,
and the log says it is outside the table.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import logging
from typing import TYPE_CHECKING, Any

import torch

from ..config import BACKEND_NAME, language_config
from ..distributed.shard import CP_SHARD_KWARG
from . import upstream
from .architectures import (
    ATTENTION_LAYER_TYPES,
    CP_TESTED_VISION_LANGUAGE_TYPES,
    PER_TOKEN_LAYER_TYPES,
    RECURRENT_LAYER_TYPES,
    cp_tested_model_types,
    later_routing_release,
    transformers_release,
)
from .backend import is_registered
from .call_context import AttentionProbe, ProbedCall, probing
from .call_refusals import (
    MODULE_DROPOUTS,
    config_dropout,
    dropout_fix,
    dropout_probability,
    is_cross_attention,
    locality_refusal,
    mask_only_window,
    masked_locality,
)
from .call_tokens import NonCausalMask, RefusedAtMask, UnroutedMask, computes_own_attention
from .composite import backend_selection, in_tower, switched_to, tower_names
from .given import require_model
from .heads import base_model
from .interfaces import registered_for_a_check
from .positions import unhooked_length_counted_tables

if TYPE_CHECKING:
    from ..distributed.mesh import ParallelDims

logger = logging.getLogger(__name__)

# Config fields of LayerDrop (a decoder layer skipped at random in training: BART's family, Whisper, MusicGen).
LAYERDROPS = ("decoder_layerdrop", "layerdrop")

# RoPE types whose frequencies depend on the positions of the call (the longest one seen).
LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


def _rope_types(config) -> set[str]:
    """Every rope_type the config uses (rope_parameters may be per layer type)."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    per_layer = params.values() if params and all(isinstance(v, dict) for v in params.values()) else [params]
    return {p.get("rope_type") or p.get("type") or "default" for p in per_layer}


def token_mixers(model: torch.nn.Module) -> list[str]:
    """Layer types and modules of `model`'s language model that mix tokens outside attention: layer types other than
    attention, and convolutions over more than one position. A composite model's towers (a vision tower's patch
    convolution) are not part of it: they run on the whole batch's images, not on a shard of the tokens."""
    text = language_config(model.config)
    found = [f"layer type '{t}'" for t in sorted(set(getattr(text, "layer_types", None) or ()))
             if t not in ATTENTION_LAYER_TYPES + PER_TOKEN_LAYER_TYPES]
    convolution = upstream.convolution_class()
    towers = tower_names(model)
    return found + [f"{type(module).__name__} of kernel {tuple(module.kernel_size)} ({name})"
                    for name, module in model.named_modules()
                    if isinstance(module, convolution) and any(k > 1 for k in module.kernel_size)
                    and not in_tower(name, towers)]


def input_counted_positions(model: torch.nn.Module) -> list[str]:
    """The learned position tables of `model` with a padding index (RoBERTa's and XLM-RoBERTa's embeddings): such a
    model counts its positions from the input tokens (from padding_idx + 1, skipping padding) when it gets no
    position_ids, where context parallelism hands every rank its shard's positions counted from 0."""
    return [f"{name}.position_embeddings" for name, module in model.named_modules()
            if isinstance(table := getattr(module, "position_embeddings", None), torch.nn.Embedding)
            and table.padding_idx is not None]


def _probe(target: torch.nn.Module, device: torch.device | str, with_shard: bool) -> list[tuple[str, ProbedCall]]:
    """(decoder layer class, the call) for every attention call of one forward of `target`, with a probe in
    place of the CP shard when `with_shard`."""
    probe = AttentionProbe()
    kwargs = {CP_SHARD_KWARG: probe} if with_shard else {}
    if "use_cache" in inspect.signature(target.forward).parameters:
        kwargs["use_cache"] = False  # a training forward builds no cache (transformers 5.25's Nemotron-H fails to
        # start one whose first layer is not attention or Mamba, whatever the backend)
    with probing(probe), torch.no_grad(), contextlib.suppress(UnroutedMask):  # (no call reached the backend)
        target(input_ids=torch.zeros(1, 8, dtype=torch.long, device=device), **kwargs)
    modules = dict(target.named_modules())
    parents = {id(m): type(modules[n.rpartition(".")[0]]).__name__ for n, m in modules.items() if n}
    return [(parents[id(call.module)], call) for call in probe.calls]


def _architecture(model: torch.nn.Module) -> torch.nn.Module:
    """`model`'s architecture (a PEFT model's base) built from a copy of its config on the meta device (no
    memory, no compute), switched to the backend."""
    base = base_model(model)
    with torch.device("meta"):
        shadow = type(base)(copy.deepcopy(base.config))
    shadow.set_attn_implementation(backend_selection(shadow.config, BACKEND_NAME))
    return shadow


class ProbeFailed(ValueError):
    """The probe forward of a model ran neither on the meta device nor on the model itself."""


def _peft_config(model: torch.nn.Module) -> Any:
    """The active adapter's config of a PEFT model, else None."""
    return getattr(model, "active_peft_config", None)


def _attention_calls(model: torch.nn.Module, with_shard: bool = False, context_parallel: bool | None = None
                     ) -> list[tuple[str, ProbedCall]]:
    """`_probe` of the model's architecture on the meta device, or of the model itself where the architecture
    does not build or run there, and for a PEFT model, whose adapter may run attention layers of its own that its
    base architecture lacks (SHADOW's network). Raises `ProbeFailed` when neither runs, and the refusal of a model
    whose mask lets tokens see later ones (`non_causal_refusal`) where its mask function refused it, or one its mask
    function refused otherwise (`RefusedAtMask`); under CP (`context_parallel`, by default `with_shard`) its fix drops
    CP too."""
    context_parallel = with_shard if context_parallel is None else context_parallel
    if _peft_config(model) is None:
        try:
            return _probe(_architecture(model), "meta", with_shard)
        except (NonCausalMask, RefusedAtMask) as e:
            raise _mask_refusal(model, e, context_parallel) from None
        except Exception as e:  # any failure on meta: fall back to the real model, whose failure is reported
            logger.info("Probing %s itself: its architecture does not run on the meta device (%s).",
                        type(model).__name__, e)
    try:
        return _probe(model, next(model.parameters()).device, with_shard)
    except (NonCausalMask, RefusedAtMask) as e:
        raise _mask_refusal(model, e, context_parallel) from None
    except Exception as e:
        model_type = getattr(model.config, "model_type", type(model).__name__)
        if _fails_without_backend(model):
            raise ProbeFailed(
                f"{type(model).__name__} (model type {model_type!r}) fails its forward with eager attention too "
                f"({type(e).__name__}: {e}): the failure is the model's own, not one attn_implementation="
                f"'{BACKEND_NAME}' causes (e.g. a dtype its layers do not take: torch's grouped matmul of experts "
                "takes no float64, experts_implementation='eager' does); fix it as without the plugin."
            ) from e
        raise ProbeFailed(
            f"{type(model).__name__} (model type {model_type!r}) does not run with attn_implementation="
            f"'{BACKEND_NAME}': a forward of it with the backend failed outside attention ({type(e).__name__}: {e}), "
            "e.g. a layer that reads the attention mask as the 4D mask eager and sdpa get, where sparse_cp hands over "
            "the 2D padding mask. Train it with dense attention (--sparse_attention false; context parallelism needs "
            "sparse_cp)."
        ) from e


def _fails_without_backend(model: torch.nn.Module) -> bool:
    """Whether the probe's forward of `model` (on its device) fails with eager attention too, its implementations
    restored after: its failure with the backend is then the model's own."""
    kwargs = {"use_cache": False} if "use_cache" in inspect.signature(model.forward).parameters else {}
    try:
        ids = torch.zeros(1, 8, dtype=torch.long, device=next(model.parameters()).device)
        with switched_to(model, "eager"):
            try:
                with torch.no_grad():
                    model(input_ids=ids, **kwargs)
            except Exception:
                return True
    except Exception:  # (no parameters, or a model that cannot switch: nothing learned)
        return False
    return False


def _mask_refusal(model: torch.nn.Module, refused: NonCausalMask | RefusedAtMask, context_parallel: bool
                  ) -> ValueError:
    """The refusal of `model` whose mask function refused its mask: `non_causal_refusal` of a mask that lets tokens
    see later ones, else `refused` as it is, or under CP with the fix that drops CP too (its ring needs sparse_cp)."""
    if isinstance(refused, NonCausalMask):
        return non_causal_refusal(model, refused, context_parallel)
    if not context_parallel:
        return refused
    return ValueError(f"{refused} Context parallelism needs sparse_cp: train it without (drop --cp_size).")


def non_causal_refusal(model: torch.nn.Module, refused: NonCausalMask, context_parallel: bool) -> ValueError:
    """The refusal of `model`, whose forward on the backend built a mask that lets tokens see later ones (`refused`,
    raised by the mask function): its attention layers may not say so (Splinter's and ALIGN's text encoders have no
    `is_causal`), so only the mask shows it. The fix: dense attention, without CP under `context_parallel`."""
    fix = "" if refused.refusal.endswith(".") else f": {own_attention_fix(context_parallel)}"
    return ValueError(f"{type(model).__name__} cannot train with sparse_cp. {refused.refusal}{fix}")


def own_attention_fix(context_parallel: bool) -> str:
    """How to train a model whose attention sparse_cp cannot compute (bidirectional, encoder-decoder): with its own
    attention, and without CP (whose ring needs sparse_cp) under `context_parallel`."""
    cp = "without context parallelism (drop --cp_size) and " if context_parallel else ""
    return (f"train it {cp}with its own attention: --sparse_attention false (sparse_attention=False in the training "
            "arguments; in code, without hf_sparse_cp.configure(model)), or run the script without hf_sparse_cp.run.")


def _check_architecture(model: torch.nn.Module, fix: str) -> None:
    """`check_attention_routed` on `model`'s architecture switched to the backend, for a model not switched yet:
    on the meta device, or where the architecture does not build or run there (Splinter's padding check reads a
    value) the model itself, switched for one probe forward (`_probe_switched`); the backend is registered for the
    probe if it was not (without it a bidirectional encoder that only its mask shows was told to switch to
    sparse_cp). Nothing to check where neither runs: the switch itself (configure, enable_sparse_attention) checks
    the model then."""
    with registered_for_a_check():
        try:
            try:
                shadow = _architecture(model)
                impl, calls = upstream.attn_implementation(shadow.config), _probe(shadow, "meta", with_shard=False)
            except (NonCausalMask, RefusedAtMask):
                raise
            except Exception:
                impl, calls = _probe_switched(model)
        except (NonCausalMask, RefusedAtMask) as e:  # (a mask refused: the refusal names the fix, which the switch
            # the caller would otherwise advise cannot be)
            raise _mask_refusal(model, e, context_parallel=fix is _NO_CP_FIX) from None
        except Exception:
            return
    _check_calls(model, impl, calls, fix)


def _probe_switched(model: torch.nn.Module) -> tuple[str | None, list[tuple[str, ProbedCall]]]:
    """(the implementation it switched to, `_probe`) of `model` itself switched to the backend for one forward on
    its device, its implementations restored after."""
    with switched_to(model, BACKEND_NAME):
        return upstream.attn_implementation(model.config), _probe(model, next(model.parameters()).device, False)


def _refuse_without_attention(model: torch.nn.Module, impl: str | None, fix: str) -> None:
    """Raise ValueError, naming the model and `fix`, where `model` switched to the backend has no attention layer
    (`config.layer_types` of `RECURRENT_LAYER_TYPES` and `PER_TOKEN_LAYER_TYPES` only): a model of Mamba, RWKV or
    linear-attention layers only, or a hybrid whose config places none (Bamba without attn_layer_indices), which was
    told it "does not route its attention", or that its forward "failed outside attention" (Granite-MoE-Hybrid's
    cache)."""
    name, model_type = type(model).__name__, getattr(model.config, "model_type", type(model).__name__)
    layer_types = getattr(language_config(model.config), "layer_types", None) or ()
    if impl == BACKEND_NAME and layer_types and set(layer_types) <= {*RECURRENT_LAYER_TYPES, *PER_TOKEN_LAYER_TYPES}:
        raise ValueError(
            f"{name} (model type {model_type!r}) has no attention layer (its layer_types: "
            f"{', '.join(dict.fromkeys(layer_types))}), so attn_implementation='{BACKEND_NAME}' has no attention to "
            f"compute. {fix}" + ("." if computes_own_attention(language_config(model.config)) else
                                 "; a model of this type whose config places attention layers among them trains with "
                                 "it."))


def _refuse_unrouted(model: torch.nn.Module, impl: str | None, fix: str) -> None:
    """Raise ValueError: `model`'s attention does not run through the backend (transformers kept `impl`)."""
    name, model_type = type(model).__name__, getattr(model.config, "model_type", type(model).__name__)
    _refuse_without_attention(model, impl, fix)
    kept = f"transformers kept attn_implementation={impl!r}" if impl != BACKEND_NAME else \
        "its attention layers never call the selected implementation"
    tested = ", ".join(cp_tested_model_types()[:6])
    later = later_routing_release(model_type)
    if later is not None:  # (routed by a later release: upgrading is the fix that keeps sparse attention)
        since = _release_name(later)
        fix = (f"Upgrade transformers to {since} or later, whose {name} routes it (installed: "
               f"{_release_name(transformers_release())}; pip install 'transformers>={since}'), or "
               f"{fix[0].lower()}{fix[1:]}")
    raise ValueError(
        f"{name} (model type {model_type!r}) does not route its attention through transformers' AttentionInterface, "
        f"so attn_implementation='{BACKEND_NAME}' cannot take effect ({kept}). {fix}, or train a model whose "
        f"architecture routes attention through AttentionInterface (e.g. {tested}; docs/context-parallelism.md "
        "lists the tested ones)."
    )


def _release_name(release: tuple[int, ...]) -> str:
    return ".".join(map(str, release))


# The fixes of `_refuse_unrouted` when sparse attention is asked for, and when context parallelism is.
_DENSE_FIX = ("Train it with dense attention (--sparse_attention false; in code, without "
              "hf_sparse_cp.configure(model))")
_NO_CP_FIX = "Train it without context parallelism (--cp_size 1; it needs the sparse_cp backend, which runs the ring)"
# (under CP, dense attention alone is no fix: CP with --sparse_attention false is refused, the ring needing the backend)
_DENSE_NO_CP_FIX = ("Train it without context parallelism (drop --cp_size: its ring needs the sparse_cp backend) and "
                    "with dense attention (--sparse_attention false; in code, without hf_sparse_cp.configure(model))")


def _check_calls(model: torch.nn.Module, impl: str | None, calls: list[tuple[str, ProbedCall]] | None,
                 fix: str) -> None:
    """Raise ValueError, naming the architecture, the cause and `fix`, when the model switched to the backend runs
    `impl` instead, no attention call of its probe forward (`calls`; None: not probed) reached the backend, a call
    asked for what the backend does not implement (soft-capping, attention sinks, a bidirectional layer: the
    backend's own refusal, which names the dense fix) or a layer got an attention mask the model built itself."""
    if impl != BACKEND_NAME or calls == []:
        _refuse_unrouted(model, impl, fix)
    unsupported = next((f"{layer}: {call.unsupported}" for layer, call in calls or () if call.unsupported), None)
    if unsupported:
        raise ValueError(f"{type(model).__name__} cannot train with sparse_cp. {unsupported}")
    own = sorted({(layer, call.mask_dims) for layer, call in calls or () if call.mask_dims not in (None, 2)})
    if own:
        model_type = getattr(model.config, "model_type", type(model).__name__)
        layer, dims = own[0]
        raise ValueError(
            f"{type(model).__name__} (model type {model_type!r}) builds its own {dims}D attention mask and hands it to "
            f"attention ({layer}); sparse_cp takes the 2D padding mask of its registered mask function and applies "
            "causality and document boundaries itself, so it cannot compute this model's attention (its mask carries "
            f"more than causality and padding). {fix}, or train another model."
        )


def check_attention_routed(model: torch.nn.Module, context_parallel: bool = False) -> None:
    """Raise ValueError, naming the architecture, the cause and the fix, unless `model`, switched to the
    `sparse_cp` backend, computes its attention through it: transformers keeps another implementation for an
    architecture that does not follow its AttentionInterface (e.g. bloom), and a probe forward of the
    architecture (on the meta device, or of the model itself) must run, and reach the backend from its attention
    layers with no mask of its own (e.g. doge's 4D mask). Called after `configure` and `enable_sparse_attention`
    switch the model; with `context_parallel` (a switch for CP training) a fix that needs dense attention drops CP
    too."""
    impl = upstream.attn_implementation(model.config)
    _refuse_without_attention(model, impl, _DENSE_NO_CP_FIX if context_parallel else _DENSE_FIX)
    # (a probe forward that fails is refused: training would fail the same way at its first forward)
    calls = _attention_calls(model, context_parallel=context_parallel) if impl == BACKEND_NAME else None
    _check_calls(model, impl, calls, _DENSE_NO_CP_FIX if context_parallel else _DENSE_FIX)


def sliding_window_layers(config) -> list[int]:
    """The indices of the layers whose `layer_types` entry is sliding-window attention (`config`: a model's)."""
    types = getattr(language_config(config), "layer_types", None) or ()
    return [i for i, t in enumerate(types) if t == "sliding_attention"]


def attention_layers(config) -> list[int]:
    """The layers that run the sparse pattern unless it says dense: all but the sliding-window ones."""
    sliding = set(sliding_window_layers(config))
    return [i for i in range(language_config(config).num_hidden_layers) if i not in sliding]


def attention_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module, ProbedCall]]:
    """(name, module of `model`, its probed call) for every module that calls the attention function in a probe
    forward of `model`'s architecture on the meta device, or of the model itself where that does not run and the
    model uses the backend (the layers whose attributes are what they pass as `dropout`, `sliding_window`); [] where
    neither runs or the backend is not registered (the backend checks every call then)."""
    if not is_registered():
        return []
    base = base_model(model)
    try:
        shadow = _architecture(model)
        calls = _probe(shadow, "meta", with_shard=False)
    except Exception:  # (e.g. grouped expert matmuls do not run on meta) the model itself, where it uses the backend
        if upstream.attn_implementation(model.config) != BACKEND_NAME:
            return []
        try:
            shadow, calls = base, _probe(base, next(base.parameters()).device, with_shard=False)
        except Exception:
            return []
    names, own = {id(m): n for n, m in shadow.named_modules()}, dict(base.named_modules())
    found = {}
    for _, call in calls:
        name = names.get(id(call.module))
        if name in own and name not in found:
            found[name] = (name, own[name], call)
    return list(found.values())


def check_mask_only_locality(model: torch.nn.Module, max_length: int, packed_documents: bool = False) -> None:
    """Raise ValueError, naming the fix, when training sequences of `max_length` tokens are longer than a sliding
    window or attention chunk that `model` puts into its attention mask only (`call_refusals.masked_locality`: PhiMoE's
    window, Llama 4's chunked layers), which the backend would refuse at the first step. With `packed_documents`
    (rows that pack several documents) the documents may each fit, and the backend checks every call."""
    config = model.config
    if getattr(config, "sliding_window", None) is None and getattr(config, "attention_chunk_size", None) is None:
        return
    for _, module, call in attention_modules(model):
        locality = masked_locality(module, mask_only_window(module, call.sliding_window)[1])
        if locality is None or max_length <= locality[1]:
            continue
        if packed_documents:
            logger.warning("%s: documents longer than %d tokens in the packed rows of %d tokens are refused at their "
                           "call (a %s that only the attention mask carries).", type(model).__name__, locality[1],
                           max_length, locality[0])
            return
        size = locality[1]
        raise locality_refusal(
            module, locality, f"training sequences of {max_length} tokens", f"train sequences of at most {size} "
            f"tokens (--sparse_max_length / max_length {size}), or pack documents of at most {size} tokens each "
            "into the rows (DataCollatorWithFlattening, TRL's padding_free)")


def _attention_layer_dropout(model: torch.nn.Module) -> str | None:
    """'name.attr=p' for an attention layer (`attention_modules`) that holds a dropout probability above 0 under
    another name than the ones every module is read for (OPT's attention keeps it as `self.dropout`), else None.
    Other modules' `dropout` (a decoder layer's residual dropout) is not attention dropout."""
    names = [n for n in MODULE_DROPOUTS if n not in ("attention_dropout", "attn_dropout")]
    if not any(dropout_probability(m, n) for m in model.modules() for n in names):
        return None  # (no probe needed)
    return next((f"{name}.{attr}={p}" for name, module, _ in attention_modules(model) for attr in names
                 if (p := dropout_probability(module, attr))), None)


def check_model_supports_sparse_attention(model: torch.nn.Module, *, training: bool = True,
                                         context_parallel: bool = False) -> None:
    """Raise ValueError, naming the cause and the fix, when the `sparse_cp` backend would refuse `model`'s
    attention at its first call (see `call_refusals.refuse_unsupported`): checked from the model before
    training, not after everything is built. Attention dropout is refused only with `training` (a model in eval
    mode passes dropout 0). What no setting of the model fixes (encoder-decoder, bidirectional attention) is refused
    first; with `context_parallel` (the CP check) the fixes drop CP too, whose ring needs the sparse backend."""
    config = getattr(model, "config", None)
    name = type(model).__name__
    if config is None:
        raise ValueError(f"{name} has no transformers config; the sparse_cp backend trains transformers models.")
    model_type = getattr(config, "model_type", name)
    stock = own_attention_fix(context_parallel)
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(f"{name} is an encoder-decoder model; sparse_cp computes causal decoder self-attention only: "
                         f"{stock}")
    towers = tower_names(model)  # (they keep their own attention: `composite`)
    # (a decoder's cross-attention runs only on encoder states, which a decoder-only forward has none of: the backend
    # refuses its call, `call_refusals.unsupported_feature`)
    bidirectional = [n for n, m in model.named_modules()
                     if getattr(m, "is_causal", True) is False and not in_tower(n, towers)
                     and not is_cross_attention(m, n)]
    if bidirectional:
        raise ValueError(
            f"{name} has bidirectional attention layers ({bidirectional[0]}, ...); sparse_cp computes causal "
            f"self-attention only: {stock}"
        )
    softcap = getattr(config, "attn_logit_softcapping", None)
    if softcap is not None:
        without_cp = ", without --cp_size" if context_parallel else ""
        raise ValueError(f"{name} (model type {model_type!r}) soft-caps attention logits (attn_logit_softcapping="
                         f"{softcap}), which the sparse kernels do not implement: train it with attn_implementation="
                         f"'eager', which computes it (--sparse_attention false{without_cp}; "
                         "SDPA does not soft-cap).")
    if training:
        dropout = config_dropout(config)
        held = next((f"{n}.{attr}={p}" for n, m in model.named_modules()
                     for attr in ("attention_dropout", "attn_dropout") if (p := dropout_probability(m, attr))),
                    None) or _attention_layer_dropout(model)
        if dropout or held:
            where = f"{dropout[0]}={dropout[1]}" if dropout else f"attention layers built with dropout ({held})"
            raise ValueError(f"{name} (model type {model_type!r}) has {where}, attention dropout, which sparse_cp "
                             f"does not implement: {dropout_fix(config, context_parallel)}")


def _refuse_virtual_tokens(model: torch.nn.Module) -> None:
    """Refuse a PEFT prompt-learning model (prompt tuning, p-tuning, prefix tuning): its forward adds virtual tokens
    (embeddings before the inputs, or keys and values before every layer's) to the tokens it is given, which under
    context parallelism are each rank's shard: every rank would add them to its own part of the sequence."""
    peft_config = _peft_config(model)
    if getattr(peft_config, "is_prompt_learning", False):
        kind = getattr(peft_config.peft_type, "value", peft_config.peft_type)
        raise ValueError(
            f"{type(model).__name__} is a PEFT {kind} model: it adds {peft_config.num_virtual_tokens} virtual tokens "
            "to the tokens it is given, which under context parallelism are each rank's shard of the sequence, so "
            "the ranks would not share one sequence. Train it without context parallelism (--cp_size 1), or train an "
            "adapter that adds no tokens (LoRA, DoRA, IA3) with it.")


def _refuse_adapter_attention(model: torch.nn.Module, missed: list[torch.nn.Module]) -> None:
    """Refuse a PEFT model whose adapter runs attention layers of its own (SHADOW's network, outside the base model)
    among the `missed` ones that the CP shard does not reach: each rank would run them on its own shard."""
    names = {id(module): name for name, module in model.named_modules()}
    base = {id(module) for module in model.get_base_model().modules()}
    own = sorted(names[id(module)] for module in missed if id(module) not in base and id(module) in names)
    if own:
        config = _peft_config(model)
        kind = getattr(config.peft_type, "value", config.peft_type)
        raise ValueError(
            f"{type(model).__name__} is a PEFT {kind} model whose adapter runs attention layers of its own ({own[0]}"
            f"{', ...' if len(own) > 1 else ''}) that the context-parallel shard does not reach: under context "
            "parallelism each rank would run them on its own shard of the sequence only. Train it without context "
            "parallelism (--cp_size 1), or train an adapter that adds no attention layers (LoRA, DoRA, IA3) with it.")


def check_model_supports_context_parallel(
    model: torch.nn.Module, backend: str | None = BACKEND_NAME, *, parallel: ParallelDims | None = None
) -> None:
    """Raise ValueError, naming the cause and the fix, unless sparse context parallelism computes
    `model` exactly (see the module docstring). Call it before training (the Trainer integration
    does); it runs one probe forward of the architecture on the meta device.

    Args:
        model: a transformers causal LM that uses the `sparse_cp` backend.
        backend: the attention implementation every layer must use: 'sparse_cp' (None: the same), whose ring is
            the only one context parallelism runs; another is refused, naming it.
        parallel: the layout it will train in, whose mode checks the model too (its heads split over the
            head groups: at least one query head per rank).
    """
    require_model(model, "check_model_supports_context_parallel(model, ...)")
    config = getattr(model, "config", None)
    name = type(model).__name__
    if config is None:
        raise ValueError(f"{name} has no transformers config; context parallelism needs a transformers model.")
    impl = upstream.attn_implementation(config)
    if backend is None:
        backend = BACKEND_NAME
    if backend != BACKEND_NAME:  # (it said "must go through 'None'"; 'sdpa' on an sdpa model was called unrouted)
        raise ValueError(
            f"check_model_supports_context_parallel(model, backend={backend!r}): context parallelism runs its ring in "
            f"the '{BACKEND_NAME}' backend only, so every attention layer must use it ({name} uses "
            f"attn_implementation={impl!r}): leave backend out (or pass backend='{BACKEND_NAME}').")
    check_model_supports_sparse_attention(model, context_parallel=True)
    _refuse_virtual_tokens(model)
    if impl != backend:
        _check_architecture(model, _NO_CP_FIX)  # (what it cannot run is refused first: no fix below would work)
        raise ValueError(
            f"{name} uses attn_implementation={impl!r}; under context parallelism every attention layer must go "
            f"through '{backend}', which runs the ring: train with --sparse_attention true (SparseTrainer, "
            "hf-sparse-cp train, hf_sparse_cp.run), or in code call hf_sparse_cp.patch() and then "
            "hf_sparse_cp.configure(model)."
        )
    if parallel is not None:
        parallel.check_model(config)
    rope = sorted(_rope_types(config) & set(LENGTH_DEPENDENT_ROPE))
    if rope:
        raise ValueError(
            f"{name} uses RoPE type {rope[0]!r}, whose frequencies depend on the longest position of each call: "
            "under context parallelism every rank would choose them from its own shard. Train with a static "
            "RoPE type ('default', 'linear', 'yarn', 'llama3') or without context parallelism."
        )
    mixers = token_mixers(model)
    if mixers:
        raise ValueError(
            f"{name} mixes tokens outside attention ({', '.join(mixers[:3])}{', ...' if len(mixers) > 3 else ''}): "
            "under context parallelism such layers would see only this rank's shard. Train it without context "
            "parallelism."
        )
    counted = input_counted_positions(model)
    if counted:
        raise ValueError(
            f"{name} (model type {getattr(config, 'model_type', name)!r}) counts its positions from the input tokens "
            f"({counted[0]} has a padding index: positions start after it and skip padding), while context "
            "parallelism gives every rank the positions of its shard counted from 0, so its position embeddings "
            "would not be one process's. Train it without context parallelism (--cp_size 1).")
    # (the calls first: a model whose attention the backend refuses is refused for that, not told to run configure)
    calls = _attention_calls(model, with_shard=True)
    _check_calls(model, impl, calls, _NO_CP_FIX)
    unhooked = unhooked_length_counted_tables(model)
    if unhooked:
        raise ValueError(
            f"{name}: its decoder counts the positions of its position table ({unhooked[0]}) from the length of its "
            "input, a rank's shard under context parallelism, and the table has not the hook that gives it the row's "
            "positions: switch the model with hf_sparse_cp.configure(model) (the Trainer integration does), not by "
            "setting attn_implementation='sparse_cp' alone.")
    layerdrop = next(((n, p) for n in LAYERDROPS if (p := getattr(config, n, 0) or 0) > 0), None)
    if layerdrop:
        raise ValueError(
            f"{name} (model type {getattr(config, 'model_type', name)!r}) has {layerdrop[0]}={layerdrop[1]}: in "
            "training its forward skips layers at random, each rank of a context-parallel group drawing for itself, "
            "so the ranks would not run the same layers (their ring exchanges would not match). Set it to 0 in the "
            "model config to train under context parallelism, or train without it (--cp_size 1).")
    missed = sorted({layer for layer, call in calls if not call.reached})
    if missed and _peft_config(model) is not None:
        _refuse_adapter_attention(model, [call.module for _, call in calls if not call.reached])
    if missed:
        where = ", ".join(missed)
        raise ValueError(
            f"{name}: the context-parallel shard does not reach {where}: its decoder layer calls attention without "
            "passing the attention keyword arguments on, so each rank would attend within its own shard only. "
            "Train this model without context parallelism."
        )
    model_type = getattr(config, "model_type", None)
    if model_type not in cp_tested_model_types() + CP_TESTED_VISION_LANGUAGE_TYPES:
        logger.warning("Model type %r is outside the architectures tested exact under context parallelism; it "
                       "passed the checks for shard reach, RoPE and token mixing.", model_type)
