"""What a SMET mode is (`SMETMode`): what differs between ways of training a weight sparsely, answered by the mode
so that the optimizer never branches on its name; and the registry of modes by name (`SMETConfig.mode`).

A mode answers, for every sparse weight:
* whether its inactive weights are exactly zero (`zeroes_inactive_weights`: zeroed when the optimizer attaches and
  when a block is pruned), or keep their values and are only not updated;
* which blocks start active (`initial_scores`: the largest per row, or random ones);
* which active blocks are pruned (`prune_scores`: the smallest per row), from what state (`slot_state`, kept per
  active block, updated after every step by `record_update`);
* the regrowth rule it takes when `SMETConfig.regrowth` is unset (`regrowth`).

Every mode masks the gradients of inactive blocks and keeps Adam's moments for active blocks only; the cold-start
cures (`SMETConfig.local_bias_correction`, ...) apply whatever the mode. A mode's scores are computed from a row's
weights and updates, which every rank holding a copy of the row holds alike (DDP replicas; FSDP2 shards by rows), so
every copy takes the same decisions as one process: a score from anything else (a rank's own gradient, its batch)
would let the copies drift apart.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import TYPE_CHECKING, ClassVar

import torch

from ...config.registries import NamedInstances

if TYPE_CHECKING:
    from ..masks import BlockGrid

REGROWTH_RULES = ("random", "gradient")  # (SMETConfig.regrowth's values: SET's and RigL's)


class SMETMode(ABC):
    """One way of training sparse weights (see the module docstring). Subclasses set `name`, `help` (the
    `--smet_mode` flag's text for this mode) and `regrowth`; `modes/__init__.py` registers an instance
    (`register_smet_mode`), and so does a user for a mode of their own."""

    name: ClassVar[str]
    help: ClassVar[str]
    regrowth: ClassVar[str]  # the rule when SMETConfig.regrowth is unset: 'random' (SET) or 'gradient' (RigL)
    # Inactive weights are exactly zero: the optimizer zeroes them when it attaches and when it prunes a block.
    zeroes_inactive_weights: ClassVar[bool] = False
    # State the mode keeps per active block ([rows, k] of this dtype) besides Adam's: the optimizer creates it zero,
    # zeroes a pruned block's, saves it and refuses a checkpoint without it.
    slot_state: ClassVar[Mapping[str, torch.dtype]] = {}

    def __repr__(self) -> str:
        return f"<SMET mode {self.name!r}>"

    @abstractmethod
    def initial_scores(self, grid: BlockGrid, weights: torch.Tensor) -> torch.Tensor | None:
        """Scores `[rows, blocks_per_row]` of the blocks of `weights` (a weight's local shard, laid out as `grid`
        says) of which every row starts with its `grid.k` largest (ties broken by a hash of the seed), or None for
        `grid.k` blocks hashed at random from the seed."""

    @abstractmethod
    def prune_scores(self, grid: BlockGrid, weights: torch.Tensor, state: dict[str, torch.Tensor]) -> torch.Tensor:
        """Scores `[rows, k]` of the active blocks of `weights` (their index: `state['block_index']`; `state` holds
        this mode's `slot_state` too), of which a topology update prunes the smallest in every row."""

    def record_update(self, state: dict[str, torch.Tensor], old: torch.Tensor, new: torch.Tensor) -> None:
        """After an optimizer step of a weight's active blocks from `old` to `new` (`[rows, k, block_size]`, in the
        step's compute dtype): update this mode's `slot_state` in `state` (by default there is none)."""
        return None


def checked_scores(mode: SMETMode, method: str, scores: object, shape: tuple[int, int]) -> torch.Tensor:
    """`scores`, what `mode.method` returned, where it is a real-valued tensor of `shape` ([rows, blocks_per_row] from
    `initial_scores`, [rows, k] from `prune_scores`); else TypeError naming the mode, the method and what it must
    return (a plug-in's mistake otherwise ended deep in the optimizer: an IndexError, 'list' has no attribute
    'shape')."""
    if isinstance(scores, torch.Tensor) and tuple(scores.shape) == tuple(shape) and not scores.is_complex():
        return scores
    got = (f"a {scores.dtype} tensor of shape {list(scores.shape)}" if isinstance(scores, torch.Tensor)
           else type(scores).__name__)
    raise TypeError(f"SMET mode {mode.name!r} ({type(mode).__qualname__}.{method}) returned {got}: it must return a "
                    f"real tensor of shape {list(shape)} (one score per row and "
                    f"{'block' if method == 'initial_scores' else 'active block'}: the grid's rows x "
                    f"{'blocks_per_row' if method == 'initial_scores' else 'k'})"
                    f"{', or None for random blocks' if method == 'initial_scores' else ''}.")


def _check_mode(mode: SMETMode) -> None:
    """What a SMET mode holds besides its name: a regrowth rule, torch dtypes for its per-block state."""
    if getattr(mode, "regrowth", None) not in REGROWTH_RULES:
        rules = ", ".join(map(repr, REGROWTH_RULES))
        raise ValueError(f"SMET mode {mode.name!r} has regrowth={getattr(mode, 'regrowth', None)!r} (the rule it "
                         f"takes when SMETConfig.regrowth is unset): set it to one of {rules}.")
    wrong = {key: dtype for key, dtype in dict(mode.slot_state).items() if not isinstance(dtype, torch.dtype)}
    if wrong:
        raise TypeError(f"SMET mode {mode.name!r} has slot_state {wrong!r}: it maps each state's name to a "
                        "torch.dtype (e.g. {'moved': torch.float32}).")


_MODES = NamedInstances(SMETMode, "hf_sparse_cp.smet.SMETMode", "SMET mode", "the SMETConfig.mode value",
                        "hf_sparse_cp.smet.register_smet_mode",
                        "`help` and `regrowth`, implement initial_scores and prune_scores", check=_check_mode)


def register_smet_mode(mode: SMETMode) -> SMETMode:
    """Make `mode` (an instance of a `SMETMode` subclass) selectable as `SMETConfig(mode=mode.name)`. A name
    registered to a mode of another class is refused: the built-in modes, and a plug-in's, cannot be replaced by
    accident (a class redefined under its name, a notebook's cell run again, replaces its earlier instance)."""
    return _MODES.register(mode)


def smet_mode_named(name: str) -> SMETMode:
    """The registered mode called `name`; ValueError naming the modes otherwise."""
    return _MODES.named(name)


def smet_modes() -> tuple[SMETMode, ...]:
    """Every registered mode, in registration order."""
    return _MODES.entries()
