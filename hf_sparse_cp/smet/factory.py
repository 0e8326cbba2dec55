"""Turn a stock optimizer class (AdamW, Adam) and a model into a SMET optimizer."""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable, Collection
from typing import Any

import torch
from torch import nn

from ..config.model_fields import language_config
from .config import DEFAULT_TARGET_MODULES, SMETConfig
from .dtensor import local
from .masks import BlockGrid
from .optimizer import SMETAdam
from .rounding import warn_if_rounded

logger = logging.getLogger(__name__)

# Stock classes SMET can stand in for, with the weight decay each applies (decoupled or L2).
SUPPORTED_OPTIMIZERS: dict[type[torch.optim.Optimizer], bool] = {torch.optim.AdamW: True, torch.optim.Adam: False}
_HYPERPARAMETERS = ("lr", "betas", "eps", "weight_decay")
# Implementation switches of the stock classes that do not change the maths: accepted and ignored.
_IGNORED = ("fused", "foreach", "capturable", "differentiable")


def _adapter_prefixes(model: nn.Module) -> tuple[str, ...]:
    """Name prefixes of the PEFT adapter weights in `model`: peft's tuner layers and wrappers list their
    adapter containers in `adapter_layer_names` (LoRA: `lora_A`, `lora_B`, ...; `modules_to_save`)."""
    return tuple(
        f"{name}.{container}."
        for name, module in model.named_modules()
        for container in getattr(module, "adapter_layer_names", None) or ()
    )


def smet_param_groups(model: nn.Module, config: SMETConfig, weight_decay: float,
                      decay_names: Callable[[nn.Module], Collection[str]] | None = None) -> list[dict[str, Any]]:
    """Parameter groups of `model`: the trainable weights of `config.target_modules` linears and the fused expert
    stacks those names reach (`_expert_stacks`) (sparse, `smet=True`), then the other trainable parameters, each
    split into those with weight decay and those without: the names `decay_names(model)` lists decay (the Trainer
    passes its `get_decay_parameter_names`, so SMET decays what the stock optimizer it stands in for decays), by
    default those of 2+ dims (not biases, norms). A density that whole blocks per row move far is said here
    (`rounding.warn_if_rounded`). A PEFT adapter's weights (LoRA's A and B) are never made sparse: targeting them is
    an error, and so is a target list that reaches only frozen weights (LoRA freezes the base model), a list of one's
    own with a name that reaches nothing (`_unmatched`), and a target weight a module not targeted holds too
    (`_check_not_shared`)."""
    targets = set(config.target_modules)
    names = {id(p): n for n, p in model.named_parameters()}
    adapters = _adapter_prefixes(model)
    sparse: dict[int, tuple[str, torch.Tensor, str]] = {}  # (name, parameter, the module it was reached through)
    transposed: dict[int, bool] = {}  # a sparse expert stack's: stored [experts, in, out]
    frozen: dict[str, None] = {}  # parameter names in model order, each once
    adapter: dict[str, str] = {}  # parameter name -> the target name that reached it
    unknown: dict[str, str] = {}  # an expert stack's name -> why its layout is not known
    sizes = _model_sizes(model)
    holders: set[int] = set()  # the modules a sparse weight was reached through (a PEFT layer's: and its base)
    for module_name, module in model.named_modules():
        target = module_name.rsplit(".", 1)[-1]
        weight = getattr(module, "weight", None)  # (a PEFT layer's is its base layer's)
        found = [] if target not in targets or not isinstance(weight, nn.Parameter) else [
            (target, weight, _stack_layout(module, "weight", weight, sizes) if weight.dim() == 3 else None)]
        for leaf, stack, layout in found + _expert_stacks(module, targets, sizes):
            name = names[id(stack)]
            if name.startswith(adapters):
                adapter[name] = leaf
            elif not stack.requires_grad:
                frozen[name] = None
            elif isinstance(layout, str):
                unknown[name] = layout
            else:
                if layout is None:
                    _check_linear(module, module_name)
                else:
                    transposed[id(stack)] = layout
                sparse[id(stack)] = (name, stack, module_name)
                holders.update((id(module), id(getattr(module, "base_layer", module))))  # (a PEFT layer's base)
    if adapter:
        raise ValueError(
            f"target_modules={config.target_modules} reaches PEFT adapter weights ({next(iter(adapter))}, "
            f"{len(adapter)} in all): SMET makes the model's own weights sparse, never an adapter's. Remove "
            f"{sorted(set(adapter.values()))} from target_modules."
        )
    if not sparse and frozen:
        raise ValueError(
            f"target_modules={config.target_modules} matches only frozen weights ({next(iter(frozen))}, "
            f"{len(frozen)} in all), so SMET has nothing to train: it sparsifies the target_modules' weights, "
            "which LoRA (peft's get_peft_model) freezes. Train either with SMET (full fine-tuning with sparse "
            "updates, without get_peft_model) or with LoRA (without --smet / install_smet), or unfreeze the "
            "weights SMET should train (requires_grad_(True))."
        )
    uncut = _named_but_dense(model, targets, sparse, adapters, unknown)
    if not sparse:
        raise ValueError(
            f"No module of the model matches target_modules={config.target_modules}; linear modules and expert "
            f"stacks here are named {_target_examples(model, adapters)}." + (
                f" It names {uncut[0][0]} ({len(uncut)} in all), which SMET cannot cut into blocks: {uncut[0][2]}."
                if uncut else ""))
    missing = _unmatched(model, config.target_modules)
    if missing and config.target_modules != list(DEFAULT_TARGET_MODULES):  # (the defaults: what the model has)
        raise ValueError(
            f"target_modules names {missing}, which no module of the model has, so it would stay dense without a "
            "word: a target names a module by its own name, the last part (q_proj, not self_attn.q_proj), or an "
            "expert stack named so or ending so (up_proj: gate_up_proj). Linear modules and expert stacks here are "
            f"named {_target_examples(model, adapters)}; correct or remove {missing} (--smet_target_modules).")
    _check_not_shared(model, sparse, holders)
    # (a weight SMET cannot cut into blocks is refused here, at set-up, not at the first step)
    grids = [BlockGrid.of(param, config.density, config.block_size, name, transposed.get(id(param), False))
             for name, param, _ in sparse.values()]
    warn_if_rounded(config.density, config.block_size, tuple((g.global_rows, g.blocks_per_row) for g in grids))
    if uncut:
        _warn_dense(uncut, sum(p.numel() for p in model.parameters() if p.requires_grad), tuple(sorted(targets)))
    decayed = None if decay_names is None else set(decay_names(model))
    groups = {(smet, decay): [] for smet in (True, False) for decay in (True, False)}
    dense = [(n, p) for n, p in model.named_parameters() if p.requires_grad and id(p) not in sparse]
    for name, param in [*((n, p) for n, p, _ in sparse.values()), *dense]:
        decay = param.dim() >= 2 if decayed is None else name in decayed
        groups[id(param) in sparse, decay].append((name, param))
    return [_group(named, smet=smet, weight_decay=weight_decay if decay else 0.0, transposed=transposed)
            for (smet, decay), named in groups.items() if named]


def _target_examples(model: nn.Module, adapters: tuple[str, ...]) -> list[str]:
    """Up to 12 names a target could give here: the model's nn.Linear modules' and its 3-D stacks' (a JetMoE
    expert module's, for its `weight`)."""
    return sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                   if isinstance(m, nn.Linear) and not f"{n}.".startswith(adapters)} |
                  {n.removesuffix(".weight").rsplit(".", 1)[-1] for n, p in model.named_parameters()
                   if p.dim() == 3})[:12]


def _unmatched(model: nn.Module, targets: list[str]) -> list[str]:
    """The targets that name no module (its own name) and no parameter (its name or a fused one ending in it)."""
    modules = {n.rsplit(".", 1)[-1] for n, _ in model.named_modules()}
    params = {n.rsplit(".", 1)[-1] for n, _ in model.named_parameters()}
    return [t for t in targets if t not in modules and not any(_names_a_target(leaf, {t}) for leaf in params)]


def _expert_stacks(module: nn.Module, targets: set[str], sizes: _Sizes) -> list[tuple[str, nn.Parameter, Any]]:
    """(name, parameter, layout) of the 3-D parameters of `module` whose own name a target names (`gate_up_proj`,
    `down_proj`: transformers 5's fused experts); layout: True when stored [experts, in, out], False for [experts,
    out, in], or why it is not known (`_stack_layout`)."""
    return [(leaf, param, _stack_layout(module, leaf, param, sizes))
            for leaf, param in module.named_parameters(recurse=False)
            if param.dim() == 3 and _names_a_target(leaf, targets)]


# A stack's own name -> whether its matrices read (True) or write (False) the hidden states (transformers' naming).
_READS_HIDDEN = {"gate_up_proj": True, "up_proj": True, "gate_proj": True, "down_proj": False}


def _stack_layout(module: nn.Module, leaf: str, stack: nn.Parameter, sizes: _Sizes) -> bool | str:
    """Whether the expert matrices of `stack` (`module`'s parameter `leaf`, [experts, a, b]) are stored [in, out]
    (True) or [out, in] (False), from what the module says: its `is_transposed` (transformers' experts), else its
    `input_size` / `output_size` (JetMoE's parallel experts), else, for a stack named as transformers names an MLP's
    projections, from its hidden and intermediate sizes (the module's, else the model's config's, `_sizes`): Llama 4's
    `gate_up_proj` [experts, hidden, 2 x intermediate] reads the hidden states, its `down_proj` [experts,
    intermediate, hidden] writes them. A shape that fits both layouts (a square matrix: hidden = 2 x intermediate for
    a gate_up_proj) or neither leaves it unknown: then the reason, in words."""
    said = getattr(module, "is_transposed", None)
    if isinstance(said, bool):
        return said
    a, b = stack.shape[1:]
    ins, outs = getattr(module, "input_size", None), getattr(module, "output_size", None)
    if isinstance(ins, int) and isinstance(outs, int):
        fits, source = {True: (a, b) == (ins, outs), False: (a, b) == (outs, ins)}, (
            f"its module's input_size={ins} and output_size={outs}")
    else:
        hidden, inner = _sizes(module, *sizes)
        reads = next((reads for suffix, reads in _READS_HIDDEN.items() if leaf.endswith(suffix)), None)
        if reads is None or hidden is None or not inner:
            return ("a stack of expert matrices whose module does not say how they are stored (transformers' "
                    "`is_transposed`), nor its name and sizes which side is the hidden size")
        # (an up/gate projection reads the hidden states into the intermediate size, or two of them, fused)
        ins_fit = {hidden} if reads else set(inner)
        outs_fit = {n * k for n in inner for k in (1, 2)} if reads else {hidden}
        fits = {True: a in ins_fit and b in outs_fit, False: a in outs_fit and b in ins_fit}
        source = (f"the hidden size {hidden} that it {'reads' if reads else 'writes'} and the intermediate size "
                  f"{'/'.join(map(str, inner))}")
    if fits[True] != fits[False]:
        return fits[True]
    return (f"a stack of expert matrices {tuple(stack.shape)} whose module does not say how they are stored "
            f"(transformers' `is_transposed`), and {source} fit{' both' if fits[True] else ' neither'} "
            "[experts, out, in] and [experts, in, out]")


_Sizes = tuple[int | None, tuple[int, ...]]
_HIDDEN = ("hidden_size", "hidden_dim")
_INTERMEDIATE = ("intermediate_size", "expert_dim", "intermediate_dim", "moe_intermediate_size")


def _sizes(holder: Any, hidden: int | None = None, inner: tuple[int, ...] = ()) -> _Sizes:
    """The hidden size and the intermediate sizes `holder` (an experts module, a config) gives, where it gives
    them, else `hidden` / `inner` (the model's)."""
    own = [getattr(holder, n) for n in _HIDDEN if isinstance(getattr(holder, n, None), int)]
    sizes = tuple(sorted({getattr(holder, n) for n in _INTERMEDIATE if isinstance(getattr(holder, n, None), int)}))
    return (own[0] if own else hidden), (sizes or inner)


def _model_sizes(model: nn.Module) -> _Sizes:
    """The model's hidden and intermediate sizes, its text model's for a multimodal one (`_sizes`)."""
    config = getattr(model, "config", None)
    return _sizes(language_config(config))


_NOT_BLOCKS = "not an nn.Linear weight, nor a 3-D stack of expert matrices"


def _named_but_dense(model: nn.Module, targets: set[str], sparse: Collection[int], adapters: tuple[str, ...],
                     unknown: dict[str, str]) -> tuple[tuple[str, int, str], ...]:
    """(name, size, why) of the trainable matrices that `target_modules` names but that stay dense (set-up warns,
    `_warn_dense`): expert stacks whose layout is not known (`unknown`: name -> why) and other parameters of their
    own, not an nn.Linear module's weight, whose name is a target or ends in one."""
    return tuple((name, param.numel(), unknown.get(name, _NOT_BLOCKS)) for name, param in model.named_parameters()
                 if param.requires_grad and param.dim() >= 2 and id(param) not in sparse
                 and not name.startswith(adapters)
                 and (name in unknown or _names_a_target(name.rsplit(".", 1)[-1], targets)))


def _names_a_target(leaf: str, targets: set[str]) -> bool:
    """Whether a parameter's own name is a target's or a fused one ending in it (`gate_up_proj`: `up_proj`)."""
    return any(leaf == target or leaf.endswith(f"_{target}") for target in targets)


@functools.cache  # (once per set-up: a Trainer builds the parameter groups twice)
def _warn_dense(named: tuple[tuple[str, int, str], ...], trainable: int, targets: tuple[str, ...]) -> None:
    # (a target that reaches one of them by its own name or, for JetMoE's `weight`, its module's)
    kept = [t for t in targets if not any(_names_a_target(part, {t}) for name, _, _ in named
                                          for part in name.split(".")[-2:])]
    logger.warning(
        "SMET trains %d matrices that target_modules names dense, with AdamW's whole optimizer state (%s, ...: %.0f%% "
        "of the trainable parameters): SMET cuts into blocks of input columns nn.Linear weights and 3-D stacks of "
        "expert matrices whose layout, [experts, out, in] or [experts, in, out], it knows, and %s is %s; "
        "smet/density counts the sparse weights only. To train them dense knowingly, leave their names out: "
        "--smet_target_modules %s.", len(named), named[0][0], 100 * sum(n for _, n, _ in named) / trainable,
        named[0][0], named[0][2], ",".join(kept) or "NAMES")


def _check_not_shared(model: nn.Module, sparse: dict[int, tuple[str, torch.Tensor, str]], holders: set[int]) -> None:
    """Refuse a sparse weight that a module `target_modules` does not reach holds too (tied word embeddings: a
    targeted lm_head's weight is the input embedding): SMET would make it sparse there as well, silently, where the
    documented pattern (blocks of an output's inputs) means something else. Weights shared by targeted modules (one
    projection reused by several layers) are one sparse weight, as they are one parameter."""
    for holder_name, holder in model.named_modules(remove_duplicate=False):
        if id(holder) in holders:
            continue
        for leaf, param in holder.named_parameters(recurse=False):
            if id(param) in sparse:
                reached = sparse[id(param)][2]
                target = reached.rsplit(".", 1)[-1]
                raise ValueError(
                    f"the weight of target module {reached} is also {holder_name}.{leaf} ({type(holder).__name__}), "
                    "which target_modules does not name (tied weights: tie_word_embeddings ties lm_head to the input "
                    f"embedding): SMET would make it sparse there as well. Leave {target} out of "
                    f"target_modules (--smet_target_modules), or untie the weights (tie_word_embeddings=False).")


def _check_linear(module: nn.Module, name: str) -> None:
    """Refuse a target module whose weight is not an `nn.Linear`'s [out, in]: SMET keeps whole blocks of each
    output's input columns, and a weight laid out otherwise (GPT-2's Conv1D stores [in, out]; an embedding's rows are
    tokens) would train a pattern other than the one documented, silently."""
    layer = module.get_base_layer() if hasattr(module, "get_base_layer") else module  # (a PEFT layer's base)
    if not isinstance(layer, nn.Linear):
        raise ValueError(
            f"target module {name} ({type(layer).__name__}) is not an nn.Linear: SMET keeps whole blocks of each "
            "output's input columns of a weight laid out [out, in] as nn.Linear's is, which "
            f"{type(layer).__name__}'s weight {tuple(layer.weight.shape)} is not (GPT-2's Conv1D stores [in, out]). "
            "Target the model's nn.Linear modules (--smet_target_modules), or train this model without --smet.")


def _group(named: list[tuple[str, torch.Tensor]], smet: bool, weight_decay: float,
           transposed: dict[int, bool]) -> dict[str, Any]:
    group = {"params": [p for _, p in named], "param_names": [n for n, _ in named], "smet": smet,
             "weight_decay": weight_decay}
    if smet:  # (how each stack is stored, see `SMETAdam`; False for a 2-D weight)
        group["transposed"] = [transposed.get(id(p), False) for _, p in named]
    return group


def create_smet_optimizer(
    model: nn.Module,
    optimizer_cls: type[torch.optim.Optimizer] = torch.optim.AdamW,
    config: SMETConfig | None = None,
    *,
    attach: bool = True,
    decay_names: Callable[[nn.Module], Collection[str]] | None = None,
    **optimizer_kwargs: Any,
) -> SMETAdam:
    """A SMET optimizer for `model` that behaves like `optimizer_cls(**optimizer_kwargs)` on the dense
    parameters and trains the `config.target_modules` weights block-sparsely.

    Args:
        model: the model as it will be trained (e.g. after `fully_shard`).
        optimizer_cls: the stock class SMET stands in for (`torch.optim.AdamW` or `torch.optim.Adam`).
        config: the SMET settings (default: `SMETConfig()`).
        attach: create and apply the masks right away; the Trainer integration passes False and
            attaches once accelerate has swapped in the sharded parameters.
        decay_names: the names of the parameters weight decay applies to, given the model (`smet_param_groups`;
            the Trainer integration passes the Trainer's `get_decay_parameter_names`); default: those of 2+ dims.
        optimizer_kwargs: the stock class's (`lr`, `betas`, `eps`, `weight_decay`; `fused` /
            `foreach` are accepted and ignored); unset ones take the stock class's defaults.

    Returns:
        A `SMETAdam` (a `torch.optim.Optimizer`), so schedulers and checkpointing keep working.
    """
    if optimizer_cls not in SUPPORTED_OPTIMIZERS:
        raise ValueError(
            f"SMET supports {[c.__name__ for c in SUPPORTED_OPTIMIZERS]}, got "
            f"{getattr(optimizer_cls, '__name__', optimizer_cls)}; use --optim adamw_torch (or adamw_torch_fused) "
            "with the Trainer."
        )
    if not isinstance(model, nn.Module):
        raise TypeError(f"create_smet_optimizer(model, ...): model must be the torch.nn.Module to train (SMET finds "
                        f"its target_modules by name), not {type(model).__name__}.")
    config = config if config is not None else SMETConfig()
    if not isinstance(config, SMETConfig):
        raise TypeError(f"create_smet_optimizer(..., config=...): config must be an SMETConfig, not "
                        f"{type(config).__name__}: build it with SMETConfig(**fields) or "
                        "SMETConfig.from_dict(mapping).")
    kwargs = dict(optimizer_kwargs)
    decoupled = kwargs.pop("decoupled_weight_decay", SUPPORTED_OPTIMIZERS[optimizer_cls])
    for name in ("amsgrad", "maximize"):
        if kwargs.pop(name, False):
            raise ValueError(f"SMET does not implement {name}=True; drop it from the optimizer arguments.")
    for name in _IGNORED:
        kwargs.pop(name, None)
    unknown = set(kwargs) - set(_HYPERPARAMETERS)
    if unknown:
        raise ValueError(f"Unknown optimizer arguments {sorted(unknown)}; SMET takes {list(_HYPERPARAMETERS)}.")
    defaults = inspect.signature(optimizer_cls.__init__).parameters
    hyper = {name: kwargs.get(name, defaults[name].default) for name in _HYPERPARAMETERS}
    groups = smet_param_groups(model, config, float(hyper.pop("weight_decay")), decay_names)
    optimizer = SMETAdam(
        groups,
        lr=float(hyper["lr"]),
        betas=hyper["betas"],
        eps=float(hyper["eps"]),
        config=config,
        decoupled_weight_decay=decoupled,
    )
    return optimizer.attach() if attach else optimizer


class SMETOptimizerFactory:
    """Optimizer factory in the form `Trainer(optimizer_cls_and_kwargs=(SMETOptimizerFactory, kwargs))`
    expects: instantiated without arguments, then called with the model and the kwargs."""

    def __call__(self, model: nn.Module, **kwargs: Any) -> SMETAdam:
        return create_smet_optimizer(model, attach=False, **kwargs)


def state_nbytes(optimizer: torch.optim.Optimizer, params: list[torch.Tensor] | None = None) -> int:
    """Bytes of optimizer state held on this process (local shards), over `params` (default: all),
    index and step-counter metadata included."""
    wanted = None if params is None else {id(p) for p in params}
    total = 0
    for param, state in optimizer.state.items():
        if wanted is not None and id(param) not in wanted:
            continue
        for value in state.values():
            if isinstance(value, torch.Tensor):
                total += local(value).numel() * value.element_size()
    return total
