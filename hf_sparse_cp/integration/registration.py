"""`configure()`: the sparse attention settings stored on a model and the backend selected (registered with
transformers by `interfaces.patch()`)."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator

import torch
from torch.utils.hooks import RemovableHandle

from ..config import BACKEND_NAME, MODEL_CONFIG_ATTRIBUTE, SparseAttentionConfig, language_config, pattern_holders
from . import upstream
from .backend import is_registered
from .composite import backend_selection, implementations, switched_to
from .forward_positions import pass_positions_on
from .given import require_model
from .heads import PADDING_READING_HEADS, mark_padding_read, model_head, pass_padding_rows_on, unmark_padding_read
from .interfaces import registered_for_a_check
from .kernel_routing import route_kernel_funcs, unroute_kernel_funcs
from .kv_sharing import slice_kv_sharing, unslice_kv_sharing
from .layer_settings import parse_layer_configs
from .models import (
    ProbeFailed,
    check_attention_routed,
    check_model_supports_context_parallel,
    check_model_supports_sparse_attention,
)
from .patching import PatchSet
from .positions import hook_length_counted_tables, unhook

_GUARD = "_hf_sparse_cp_registration_guard"


def configure(model: torch.nn.Module, config: SparseAttentionConfig | None = None, *, select: bool = True) -> None:
    """Store the sparse attention settings on a model and select the backend.

    Args:
        model: a transformers model; `config` is saved with it (`model.config.sparse_attention`).
        config: the pattern settings (default: `SparseAttentionConfig()`).
        select: also switch the model to `attn_implementation="sparse_cp"` (needs `patch()` first; a
            forward after `unpatch()` then raises an error that says so, `guard_registration`). An
            architecture whose attention does not run through the backend once switched is refused
            (`select_backend`), the model left as it was, and so is one whose config or layers ask for what the
            backend does not implement (`models.check_model_supports_sparse_attention`; attention dropout is
            refused at a training call).
    """
    require_model(model, "configure(model, ...)")
    if not isinstance(select, bool):  # ('no' is true: the model was switched)
        raise TypeError(f"configure(model, ..., select=...): select must be True or False, not "
                        f"{type(select).__name__} {select!r}.")
    if select and not is_registered():
        raise ValueError("configure(model) switches the model to attn_implementation='sparse_cp', which is not "
                         "registered with transformers: call hf_sparse_cp.patch() first (or configure(model, "
                         "select=False) to store the settings only).")
    config = SparseAttentionConfig() if config is None else config
    if not isinstance(config, SparseAttentionConfig):
        raise TypeError(f"configure(model, config): config must be a SparseAttentionConfig, not "
                        f"{type(config).__name__}: build it with SparseAttentionConfig(**fields), "
                        "SparseAttentionConfig.from_dict(mapping) or SparseAttentionConfig.from_file(path).")
    if select:  # (what the backend refuses in the model's config and layers, before its settings are read)
        check_model_supports_sparse_attention(model, training=False)
    config.check_layers(language_config(model.config).num_hidden_layers)
    if select:
        select_backend(model)
    store_pattern(model, config.to_dict())
    if select:
        guard_registration(model)


def store_pattern(model: torch.nn.Module, value: dict | None, patches: PatchSet | None = None) -> None:
    """Put the pattern's settings `value` (`SparseAttentionConfig.to_dict()`, or None) on every config the model's
    attention layers read (`pattern_holders`), each change recorded in `patches` when given; the layers' configs are
    parsed now, outside any trace (`layer_settings.parse_layer_configs`: a compiled model traces them without a graph
    break)."""
    for holder in pattern_holders(model.config):
        if patches is None:
            setattr(holder, MODEL_CONFIG_ATTRIBUTE, value)
        else:
            patches.set_attr(holder, MODEL_CONFIG_ATTRIBUTE, value)
    if value is not None:
        parse_layer_configs(model)


def select_backend(model: torch.nn.Module, context_parallel: bool = False) -> str | dict | None:
    """Switch `model` to `attn_implementation="sparse_cp"` and check that its attention now runs through it
    (`models.check_attention_routed`: transformers keeps another implementation for an architecture outside its
    AttentionInterface). A composite model switches its language model only, its towers keeping their attention
    (`composite.backend_selection`). Raises ValueError, naming the architecture and the fix, with the model's
    implementations left as they were (with `context_parallel`, a switch for CP training, a fix that needs dense
    attention drops CP too). Returns the implementations the model had (`composite.implementations`: the name alone
    for a model without sub-configs)."""
    previous = implementations(model.config)
    model.set_attn_implementation(backend_selection(model.config, BACKEND_NAME))
    try:
        check_attention_routed(model, context_parallel)
    except ValueError:
        if previous is not None and implementations(model.config) != previous:
            model.set_attn_implementation(previous)
        raise
    return previous


def check_switchable(model: torch.nn.Module, context_parallel: bool = False) -> None:
    """Raise ValueError, naming the cause and the fix, when training would refuse `model` switched to the backend
    (with `context_parallel`, for CP training), before anything else is built for it: what its config and layers ask
    for (`check_model_supports_sparse_attention`), then the model switched as `configure` switches it
    (`select_backend`, `guard_registration`) and under CP checked as CP checks it
    (`check_model_supports_context_parallel`), its implementations and hooks restored after. The backend is
    registered for the check where it is not. A model on the meta device (the example's tiny model, refused at its
    flags' parse, before the processes make their data) whose probe forward does not run there (`ProbeFailed`: a
    layer reads a value) passes what the probe checks: the Trainer probes it with its weights."""
    check_model_supports_sparse_attention(model, context_parallel=context_parallel)
    with registered_for_a_check(), switched_to(model, BACKEND_NAME):
        unguard = guard_registration(model)
        try:
            with _unless_meta_probe_fails(model):
                check_attention_routed(model, context_parallel)
            if context_parallel:
                with _unless_meta_probe_fails(model):
                    check_model_supports_context_parallel(model)
        finally:
            if unguard is not None:
                unguard()


@contextlib.contextmanager
def _unless_meta_probe_fails(model: torch.nn.Module) -> Iterator[None]:
    """Let a `ProbeFailed` of `model` pass where its parameters are on the meta device: its forward failed there,
    which says nothing of the model with its weights."""
    try:
        yield
    except ProbeFailed:
        if next(model.parameters()).device.type != "meta":
            raise


def guard_registration(model: torch.nn.Module) -> Callable[[], None] | None:
    """Make a forward of `model` while it selects `sparse_cp` and the backend is not registered (after
    `unpatch()`) raise an error that names the fix, instead of transformers' KeyError from inside a
    layer: a forward pre-hook, added once per model, that does nothing while the backend is registered
    or the model uses another implementation. With it, a pre-hook on its decoder passes the decoder's `position_ids`
    on to the attention calls (`forward_positions.pass_positions_on`), and one on each position table fed positions
    counted from the input's length gives it the row's positions under CP (`positions.hook_length_counted_tables`), one
    on the decoder of a question-answering or sequence-classification model hands the attention calls the rows whose
    padding its head reads, which then attend as SDPA's (`heads.pass_padding_rows_on`; every row's where a layer does
    not hand them on, and for a head of an architecture's own: `heads.mark_padding_read`), and
    a model that slices its KV-shared layers' inputs as 4D-masked ones hands them on whole (`kv_sharing`), and a module
    routing functions through the Hub's `kernels` package skips it while none is kernelized, which a compiled
    checkpointed layer could not trace (`kernel_routing`). The hooks are
    module-level functions, so they go with copies of the model (pickle, `copy.deepcopy`). Returns the call that removes
    them, or None when the model already has them."""
    if model.__dict__.get(_GUARD):
        return None
    handles = [model.register_forward_pre_hook(_check_registration, with_kwargs=True)]
    decoder = positions_owner(model)
    if decoder is not None:
        handles.append(decoder.register_forward_pre_hook(pass_positions_on, with_kwargs=True))
        head = model_head(model)
        if head in PADDING_READING_HEADS:
            handles.append(decoder.register_forward_pre_hook(functools.partial(pass_padding_rows_on, head),
                                                             with_kwargs=True))
        if head in PADDING_READING_HEADS or head is None:
            mark_padding_read(decoder, head)
    handles += hook_length_counted_tables(model)
    unslice_kv_sharing(model)
    unroute_kernel_funcs(model)
    model.__dict__[_GUARD] = True
    return functools.partial(_remove_guard, model, handles)


def positions_owner(model: torch.nn.Module) -> torch.nn.Module | None:
    """The module of `model` whose forward runs its decoder layers, which `pass_positions_on` hooks: the decoder
    (`get_decoder()`), or, where that is a model with a head (Llama4ForCausalLM's, whose `base_model_prefix` names no
    submodule, is the causal LM itself), the one transformers model inside it. The hook's keyword goes on through the
    decoder layers' keyword arguments to the attention calls; a head's forward would also hand it to its loss function
    (a model's own `loss_function` may take no **kwargs). None where no such module is found (no hook then). The hook
    sits on the decoder, not the model, as PEFT's wrappers reach it through the causal LM's forward called directly,
    without the causal LM's hooks."""
    from transformers import PreTrainedModel

    decoder = model.get_decoder() if callable(getattr(model, "get_decoder", None)) else model
    while _has_head(decoder):
        inner = [m for m in decoder.children() if isinstance(m, PreTrainedModel)]
        if len(inner) != 1:
            return None
        decoder = inner[0]
    return decoder


def _has_head(module: torch.nn.Module) -> bool:
    get_head = getattr(module, "get_output_embeddings", None)
    return callable(get_head) and get_head() is not None


def _check_registration(module: torch.nn.Module, args, kwargs) -> None:
    if upstream.attn_implementation(module.config) == BACKEND_NAME and not is_registered():
        raise RuntimeError(
            f"{type(module).__name__} uses attn_implementation='sparse_cp', which is not registered with "
            "transformers in this process (hf_sparse_cp.unpatch() removed it, or hf_sparse_cp.patch() was not called "
            "here, e.g. for a model unpickled in a new process): call hf_sparse_cp.patch(), or switch the model to "
            "another implementation, e.g. model.set_attn_implementation('sdpa')."
        )


def _remove_guard(model: torch.nn.Module, handles: list[RemovableHandle]) -> None:
    for handle in handles:
        handle.remove()
    unhook(model)
    unmark_padding_read(model)
    slice_kv_sharing(model)
    route_kernel_funcs(model)
    model.__dict__.pop(_GUARD, None)
