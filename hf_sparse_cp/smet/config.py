"""Typed configuration of SMET (stable dynamic sparse training and sparse fine-tuning with Adam).

`SMETConfig` is a plain dataclass: every field carries help text (so `HfArgumentParser` can turn it
into flags, see `hf_sparse_cp.trainer.arguments.SMETArguments`), `from_file` / `save` round-trip it
through YAML or JSON, and invalid values raise a `ValueError` that says how to fix them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from ..config.files import FileConfig, check_field_types
from ..config.registries import Variants
from .masks import MASK32
from .modes import SMETMode, smet_mode_named, smet_modes

SMET_MODES = tuple(mode.name for mode in smet_modes())  # the built-in modes (registered by `.modes`)
# What `mode` takes (its flag too: `--smet_mode`): any registered mode.
SMET_MODE_SETTING = Variants(lambda: [mode.name for mode in smet_modes()], "a mode",
                             "hf_sparse_cp.smet.register_smet_mode(instance)")
DEFAULT_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def module_names(value: Any) -> Any:
    """`target_modules` as a list: comma-separated text ("q_proj,v_proj") split, also where it is an item of a
    list or tuple (the flag `--smet_target_modules q_proj,v_proj` parses as ['q_proj,v_proj']); any other value
    as given (the type check then names it)."""
    if isinstance(value, str):
        return [name.strip() for name in value.split(",") if name.strip()]
    if isinstance(value, (list, tuple)):
        return [name for item in value for name in (module_names(item) if isinstance(item, str) else [item])]
    return value


@dataclass
class SMETConfig(FileConfig):
    """What SMET makes sparse, how the active set moves, and which cold-start cures are on.

    Every row of a sparse weight matrix (an output neuron) keeps the same number of active blocks of
    `block_size` consecutive input columns (constant fan-in). Pruning and regrowth happen row by row,
    which keeps the topology identical however the rows are sharded (FSDP2 shards rows).
    """

    FILE_SECTION: ClassVar[str] = "smet"
    KIND: ClassVar[str] = "SMET"
    COMMON_FLAGS: ClassVar[tuple[str, ...]] = ("density",)
    # (its Literal lists the built-in modes; any registered mode is valid: `check_values`, its flag's `VariantFlag`)
    REGISTERED_FIELDS: ClassVar[tuple[str, ...]] = ("mode",)

    mode: Literal[SMET_MODES] = field(
        default="sparse_weights",
        metadata={"help": "; ".join(f"'{mode.name}': {mode.help}" for mode in smet_modes()) + ".",
                  **SMET_MODE_SETTING.flag()},
    )
    density: float = field(
        default=0.25,
        metadata={"help": "Fraction of blocks of every sparse matrix row that is active, in (0, 1]. A row keeps a "
                  "whole number of blocks, at least one: set-up warns when that moves a weight's density more than 5 "
                  "percent from this, naming what comes closer."},
    )
    block_size: int = field(
        default=16,
        metadata={"help": "Consecutive input columns that are activated and pruned together; must divide the "
                  "input size of every sparse matrix. Larger blocks cut the index overhead."},
    )
    update_interval: int = field(
        default=100, metadata={"help": "Optimizer steps between topology updates (prune + regrow)."}
    )
    prune_rate: float = field(
        default=0.2, metadata={"help": "Fraction of the active blocks replaced at the first topology update."}
    )
    prune_rate_final: float = field(
        default=0.005,
        metadata={"help": "Prune rate reached at the end of the cosine decay (see prune_decay_steps)."},
    )
    prune_decay_steps: int | None = field(
        default=None,
        metadata={"help": "Steps of the cosine decay from prune_rate to prune_rate_final; default: the Trainer's "
                  "max_steps (no decay when SMET is used without a Trainer and this is unset)."},
    )
    regrowth: Literal["random", "gradient"] | None = field(
        default=None,
        metadata={"help": "How blocks are regrown: 'random' (SET) or 'gradient' (largest gradient magnitude, "
                  "RigL). Default: " + ", ".join(f"'{mode.regrowth}' for {mode.name}" for mode in smet_modes()) + "."},
    )
    target_modules: list[str] = field(
        default_factory=lambda: list(DEFAULT_TARGET_MODULES),
        metadata={"help": "Names (last component) of the linear modules whose weights are sparse, space- or "
                  "comma-separated (q_proj,v_proj); they also reach an MoE's fused experts named so or ending so "
                  "(up_proj: experts.gate_up_proj), each expert sparse; everything else (embeddings, lm_head, norms, "
                  "biases) stays dense."},
    )
    local_bias_correction: bool = field(
        default=True,
        metadata={"help": "Count Adam steps per block and reset the count on regrowth, so bias correction is "
                  "local to the block (off: regrown blocks share the global step, the naive behaviour)."},
    )
    regrow_warmup_steps: int = field(
        default=100,
        metadata={"help": "Ramp the step size of regrown blocks linearly from 1/N to 1 over N steps (0 = off)."},
    )
    density_lr_scaling: bool = field(
        default=True,
        metadata={"help": "Multiply the learning rate of sparse matrices by density**(-lr_density_exponent), at the "
                  "density each trains at (whole blocks per row)."},
    )
    lr_density_exponent: float = field(
        default=0.5,
        metadata={"help": "Exponent of the density-aware learning-rate scaling. SMET's per-density learning rates "
                  "fit 1.0 (lr ~ 1/density); 0.5 is gentler for a base learning rate already tuned high."},
    )
    seed: int = field(
        default=0,
        metadata={"help": "Seed of the random choices (initial active set in sparse_update, random regrowth, tie "
                  "breaks); they are hashed from (seed, parameter, step, block), so no RNG state is kept."},
    )

    def __post_init__(self) -> None:
        self.target_modules = module_names(self.target_modules)
        check_field_types(self)  # (regrowth too: its Literal lists the allowed values)
        check_values(self)

    @property
    def registered_mode(self) -> SMETMode:
        """The registered mode `mode` names (`hf_sparse_cp.smet.modes`), which the optimizer asks what to do."""
        return smet_mode_named(self.mode)

    @property
    def regrowth_rule(self) -> str:
        """The regrowth rule in use ('random' or 'gradient'), with the mode's default filled in."""
        if self.regrowth is not None:
            return self.regrowth
        return self.registered_mode.regrowth

    def lr_scale_at(self, density: float) -> float:
        """Learning-rate multiplier of a sparse matrix whose rows keep `density` of their blocks: the density it
        trains at (whole blocks per row, `rounding.kept_blocks`), which may differ from the one asked."""
        return density ** -self.lr_density_exponent if self.density_lr_scaling else 1.0


def check_values(values: Any, prefix: str = "") -> None:
    """Raise a ValueError that says how to fix it for the first value out of range among `values` (an `SMETConfig`,
    or any object with its fields as attributes), naming a field `prefix + name` (the flags: `--smet_`)."""
    SMET_MODE_SETTING.check(f"{prefix}mode", values.mode)
    if not 0.0 < values.density <= 1.0:
        raise ValueError(f"{prefix}density={values.density} must be in (0, 1]; e.g. 0.5, 0.25 or 0.1.")
    if values.block_size < 1:
        raise ValueError(f"{prefix}block_size={values.block_size} must be >= 1; 16 or 32 are usual.")
    if values.update_interval < 2:
        raise ValueError(
            f"{prefix}update_interval={values.update_interval} must be >= 2 so regrown blocks train before the next "
            "update; the paper uses 100."
        )
    for name in ("prune_rate", "prune_rate_final"):
        rate = getattr(values, name)
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"{prefix}{name}={rate} must be in [0, 1]; SMET uses 0.2 decaying to 0.005.")
    if values.prune_decay_steps is not None and values.prune_decay_steps < 1:
        raise ValueError(f"{prefix}prune_decay_steps={values.prune_decay_steps} must be >= 1 (or unset).")
    if values.regrow_warmup_steps < 0:
        raise ValueError(f"{prefix}regrow_warmup_steps={values.regrow_warmup_steps} must be >= 0 (0 turns it off).")
    if not 0 <= values.lr_density_exponent < math.inf:  # (NaN or inf made every sparse weight NaN or inf)
        raise ValueError(f"{prefix}lr_density_exponent={values.lr_density_exponent} must be finite and >= 0 (0 "
                         "disables scaling).")
    if not 0 <= values.seed <= MASK32:  # (the random choices hash the seed's low 32 bits: -1 drew as 2**32 - 1)
        raise ValueError(f"{prefix}seed={values.seed} must be in [0, {MASK32}]: the random choices hash 32 bits of "
                         f"it, so it would draw as seed={values.seed & MASK32} does; e.g. 0.")
    if not values.target_modules:
        raise ValueError(f"{prefix}target_modules is empty; e.g. {list(DEFAULT_TARGET_MODULES)}.")
