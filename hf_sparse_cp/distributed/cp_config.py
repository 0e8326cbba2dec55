"""The context-parallel flags (`ContextParallelConfig`): the CP degree, how the CP group shares attention
(`cp_mode`, a registered `modes.CPMode`, which checks the flags it takes), how the sequence is split
(`cp_sharding`), the ring's shape and the document planner's weights. `mesh.ParallelDims` builds the process
groups from them.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Literal

from ..config.files import KnownKeywords, check_field_types, checks_unread_fields, setting
from ..config.registries import Variants
from .modes import CPMode, cp_mode_named, cp_modes
from .split.document_costs import ATTENTION_RATE_SHARE, PlannerCosts

CP_MODES = tuple(mode.name for mode in cp_modes())  # (the built-in ones: its Literal)
# What `cp_mode` takes (its flag too): any registered mode.
CP_MODE_SETTING = Variants(lambda: [mode.name for mode in cp_modes()], "a mode",
                           "hf_sparse_cp.distributed.register_cp_mode(instance)")


@dataclass
class ContextParallelConfig(KnownKeywords):
    """How the sequence is split over ranks and how K/V travel between them."""

    KIND: ClassVar[str] = "context parallel"
    COMMON_FLAGS: ClassVar[tuple[str, ...]] = ("cp_size", "cp_mode", "cp_sharding")
    # (its Literal lists the built-in modes; any registered mode is valid: `_check_mode`, its flag's `VariantFlag`)
    REGISTERED_FIELDS: ClassVar[tuple[str, ...]] = ("cp_mode",)
    # The document planner's weights: read only under --cp_sharding document (`plans_documents`).
    PLANNER_FIELDS: ClassVar[tuple[str, ...]] = ("cp_planner_linear_per_token", "cp_planner_comm_per_token",
                                                 "cp_planner_max_token_ratio")

    cp_size: int = field(
        default=1,
        metadata={"help": "Context-parallel degree: ranks that share one sequence (data-parallel degree = world size "
                  "/ cp_size). With accelerate's ParallelismConfig(cp_size=...) on GPUs, its cp_size is used."},
    )
    cp_mode: Literal[CP_MODES] = field(
        default="ring",
        metadata={"help": "How the CP group shares the attention: "
                  + "; ".join(f"'{mode.name}' ({mode.help})" for mode in cp_modes()) + ".",
                  **CP_MODE_SETTING.flag()},
    )
    cp_ulysses_size: int | None = field(
        default=None,
        metadata={"help": "For --cp_mode hybrid: ranks per head group (consecutive ranks, within a node; at most the "
                  "query heads); the ring spans cp_size / cp_ulysses_size of them."},
    )
    cp_sharding: Literal["striped", "zigzag", "contiguous", "document"] = field(
        default="striped",
        metadata={"help": "How the sequence is split: 'striped' (block round robin, balances sparse attention), "
                  "'zigzag' (head-tail chunks, balances dense causal attention), 'contiguous', or 'document' "
                  "(packed rows: short documents whole on one rank, their K/V never sent; long ones split; "
                  "planned per batch to balance attention, linear work and traffic)."},
    )
    cp_ring: Literal["flat", "hierarchical"] = field(
        default="flat",
        metadata={"help": "'flat': one ring over the CP group; 'hierarchical': an inner ring within each node and "
                  "an outer ring across nodes whose transfers hide behind the inner ring's compute."},
    )
    cp_node_size: int | None = field(
        default=None,
        metadata={"help": "Ranks per node for the hierarchical ring (default: LOCAL_WORLD_SIZE, set by torchrun and "
                  "accelerate launch)."},
    )
    cp_planner_linear_per_token: float | None = field(
        default=None,
        metadata={"help": "For --cp_sharding document: work of the linear layers per token, in attention token pairs "
                  "(default: counted from the model, 2 x the weights a token meets in a layer, the LM head's spread "
                  "over the layers, / (4 x heads x head_dim), in time: times the attention kernel's FLOP/s over the "
                  f"matrix products', {ATTENTION_RATE_SHARE}; about 4,600 for Qwen2.5-0.5B, 14,100 for Qwen2.5-7B; "
                  f"{PlannerCosts.linear_per_token:g} where the model gives no count)."},
    )
    cp_planner_comm_per_token: float = field(
        default=PlannerCosts.comm_per_token,
        metadata={"help": "For --cp_sharding document: cost of receiving one token's K/V, in attention token pairs "
                  "(about 300 for Qwen2.5-0.5B over NVLink; a few times more across nodes)."},
    )
    cp_planner_max_token_ratio: float = field(
        default=PlannerCosts.max_token_ratio,
        metadata={"help": "For --cp_sharding document: most tokens a rank may hold, in its blocks, as a multiple of "
                  "the mean (plus one block): the bound on its activation memory. A larger one leaves the planner "
                  "more freedom to balance the work."},
    )
    cp_allow_untested_model: bool = field(
        default=False,
        metadata={"help": "Deprecated, no effect: every architecture that passes the model checks (shard reach, "
                  "length-dependent RoPE, token mixing outside attention) trains under context parallelism. "
                  "Accepted so that command lines and recipes of earlier versions run."},
    )

    def __post_init__(self) -> None:
        # (cp_sharding and cp_ring too: their Literal lists the allowed values; cp_mode's lists the built-in modes, and
        # any registered mode is valid here: `_check_mode`)
        check_field_types(self)
        if self.cp_size < 1:
            raise ValueError(f"cp_size={self.cp_size} must be >= 1 (1 disables context parallelism).")
        if self.cp_node_size is not None and self.cp_node_size < 1:
            raise ValueError(f"cp_node_size={self.cp_node_size} must be >= 1, or unset to use LOCAL_WORLD_SIZE.")
        self._check_mode()
        if self.cp_allow_untested_model:
            warnings.warn("--cp_allow_untested_model is no longer needed and has no effect: every architecture that "
                          "passes the model checks trains under context parallelism; drop the flag.", FutureWarning,
                          stacklevel=2)
        for name in (name for name in self.PLANNER_FIELDS if name.endswith("_per_token")):  # (costs in token pairs)
            value = getattr(self, name)
            if value is not None and not 0 <= value < math.inf:  # (NaN passed `< 0`: every rank's load NaN or inf)
                default = ("counted from the model" if name == "cp_planner_linear_per_token" else
                           getattr(PlannerCosts, name.removeprefix("cp_planner_")))
                raise ValueError(f"{name}={value} must be finite and >= 0 (a cost in attention token pairs; default "
                                 f"{default}).")
        if not 1 <= self.cp_planner_max_token_ratio < math.inf:
            raise ValueError(f"cp_planner_max_token_ratio={self.cp_planner_max_token_ratio} must be finite and >= 1 "
                             f"(a multiple of the mean tokens per rank; default {PlannerCosts.max_token_ratio}).")
        if checks_unread_fields():  # (a --cp_schedule's base: its stages may shard by document)
            defaults = {f.name: f.default for f in fields(self)}
            try:
                self.refuse_unread_planner_costs({name: getattr(self, name) for name in self.PLANNER_FIELDS
                                                  if getattr(self, name) != defaults[name]}, [self])
            except ValueError as e:  # (a library caller's base of a schedule: the stages are not known here)
                raise ValueError(f"{str(e).removesuffix('.')} (or, for a --cp_schedule stage that does, build this "
                                 "base config with hf_sparse_cp.schedule_cp_config(cp_schedule, ...)).") from None

    @property
    def mode(self) -> CPMode:
        """The registered mode `cp_mode` names."""
        return cp_mode_named(self.cp_mode)

    def _check_mode(self) -> None:
        """Refuse settings the mode would ignore or cannot run, naming the fix."""
        CP_MODE_SETTING.check("cp_mode", self.cp_mode)
        if self.cp_ulysses_size is not None and self.cp_ulysses_size < 1:
            raise ValueError(f"cp_ulysses_size={self.cp_ulysses_size} must be >= 1.")
        self.mode.check_flags(self)
        self.mode.resolve(self, self.cp_size)  # (its head groups split the CP degree)

    def head_size(self, cp_size: int) -> int:
        """Ranks of one head group for a CP group of `cp_size` ranks (1: no head parallelism)."""
        return self.mode.resolve(self, cp_size)[1]

    def check_model(self, model_config) -> None:
        """Raise ValueError, naming the numbers, unless this layout (`cp_size` ranks in `cp_mode`) runs a model
        with `model_config`: what `ParallelDims.check_model` checks, before the groups are built."""
        mode, heads = self.mode.resolve(self, self.cp_size)
        mode.check_model(model_config, heads)

    @property
    def plans_documents(self) -> bool:
        """Whether the sequence is split by the document planner (`cp_sharding='document'`), which reads
        `PLANNER_FIELDS`."""
        return self.cp_sharding == "document"

    @staticmethod
    def refuse_unread_planner_costs(given: Mapping[str, Any], layouts: Sequence[ContextParallelConfig],
                                    spell: Callable[[str, Any], str] = setting, scope: str = "this config") -> None:
        """Raise ValueError, naming the fix, for planner weights `given` (name -> value; none: nothing to refuse)
        where no layout of `layouts` (a config's, or a run's and its `--cp_schedule` stages') plans documents: they
        would be ignored without a word. `spell(name, value)` writes a setting as the message names it
        (`name=value`, or a flag); `scope` names what the layouts run."""
        if not given or any(layout.plans_documents for layout in layouts):
            return
        them = "them" if len(given) > 1 else "it"
        stages = " (nor does any --cp_schedule stage)" if len(layouts) > 1 else ""
        document = spell("cp_sharding", "document")
        raise ValueError(f"{', '.join(spell(name, value) for name, value in given.items())} would be ignored: the "
                         f"document planner of {document} reads {them}, and {scope} shards with "
                         f"{spell('cp_sharding', layouts[0].cp_sharding)}{stages}: drop {them}, or add {document}.")

    def planner_costs(self, model_linear_per_token: float | None = None) -> PlannerCosts:
        """The document planner's cost model with these flags' weights; an unset linear weight is
        `model_linear_per_token` (the model's, `integration.planner_weights`), else `PlannerCosts`' default."""
        linear = next((w for w in (self.cp_planner_linear_per_token, model_linear_per_token) if w is not None),
                      PlannerCosts.linear_per_token)
        return PlannerCosts(linear_per_token=linear,
                            comm_per_token=self.cp_planner_comm_per_token,
                            max_token_ratio=self.cp_planner_max_token_ratio)

    def group_settings(self) -> list[str]:
        """The settings of how a CP group shares its sequences that this config moves from their defaults (every
        field but the CP degree and the former opt-in flag), as `--name value`: what a run whose CP degree is 1
        would ignore."""
        unread = ("cp_size", "cp_allow_untested_model")
        return [f"--{f.name} {getattr(self, f.name)}" for f in fields(self)
                if f.name not in unread and getattr(self, f.name) != f.default]
