"""A `--cp_schedule` checked for one run: `Schedule`, the stages with their patterns and start steps (epoch starts
resolved from the data), built by `build_schedule`; `check_schedule_flags` refuses what the flags alone decide, before
a launch starts its processes. The stages as written are `schedule.py`'s; the curriculum that runs them is
`curriculum.py`'s."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

from ..config import SparseAttentionConfig
from ..distributed import ContextParallelConfig, ShardPlan, check_sizes
from ..smet import SMETConfig
from .schedule import Stage, parse_schedule


@dataclass(frozen=True)
class Schedule:
    """Validated stages with their start steps (epochs resolved), for one run."""

    stages: tuple[Stage, ...]
    starts: tuple[int, ...]
    configs: tuple[SparseAttentionConfig, ...]

    @property
    def text(self) -> str:
        return ",".join(s.text for s in self.stages)

    def index_at(self, step: int) -> int:
        """The stage of the optimizer step that follows `step` completed steps."""
        return max(i for i, start in enumerate(self.starts) if start <= step)


def _seq_len_fix(seq_len: int, unit: int) -> str:
    lower, upper = max(unit, seq_len // unit * unit), -(-seq_len // unit) * unit
    return f"seq_len={lower}" + (f" or {upper}" if upper != lower else "")


def build_schedule(
    stages: Sequence[Stage],
    *,
    world_size: int,
    sparse_config: SparseAttentionConfig,
    max_steps: int,
    samples_per_step: Sequence[int] | None = None,
    num_samples: int | None = None,
    layers: Sequence[int] | None = None,
    n_layers: int | None = None,
) -> Schedule:
    """Validate `stages` for a run and resolve epoch starts into steps.

    Args:
        stages: `parse_schedule`'s stages, in order.
        world_size: the processes of the run (constant over the stages).
        sparse_config: the run's sparse pattern; a stage's `sparse` fields go on top.
        max_steps: the run's optimizer steps (`--max_steps`).
        samples_per_step: distinct samples one step consumes in each stage (per-device batch x gradient
            accumulation x DP degree); needed for epoch starts.
        num_samples: samples in the dataset; needed for epoch starts.
        layers: the model's layers that run the pattern (`models.attention_layers`), for the check that
            each stage's pattern stays sparse at its length (default: the stage's config itself).
        n_layers: the model's decoder layers, which a stage's `layer_overrides` keys must stay within.

    Returns:
        The `Schedule`. Raises ValueError, naming the fix, when a CP degree does not divide the world
        size, a sequence length does not split into whole blocks per CP rank, a sparse field is unknown or
        invalid or runs every layer dense at the stage's length (`SparseAttentionConfig.check_sparse_at`), the
        first stage does not start at 0 or the starts do not increase within max_steps.
    """
    if max_steps <= 0:
        raise ValueError("a cp_schedule needs the run's length in optimizer steps, whether its stages start at steps "
                         "or epochs (an epoch start is resolved into a step within it): set --max_steps.")
    configs = []
    for i, stage in enumerate(stages):
        with stage.refusals(i):
            check_sizes(world_size, stage.cp_size)
        config = _stage_config(i, stage, sparse_config)
        with stage.refusals(i):
            config.check_sparse_at(stage.seq_len, layers)
            if n_layers is not None:
                config.check_layers(n_layers)
        configs.append(config)
    return Schedule(tuple(stages), _starts(stages, max_steps, samples_per_step, num_samples), tuple(configs))


def check_schedule_flags(text: str, sparse_config: SparseAttentionConfig | None, max_steps: int,
                         cp_config: ContextParallelConfig | None = None) -> None:
    """Raise `build_schedule`'s ValueError for what the flags alone decide, as they parse (before a launch starts
    processes that would each refuse them): with the run's pattern `sparse_config` (None: not known yet) each
    stage's fields and whole blocks per CP rank, with the run's CP flags `cp_config` (None: the defaults) each
    stage's CP layout (`enable_curriculum` builds the same), and with --max_steps the starts (with an epoch start,
    resolved from the data, what the starts given alone decide: `_check_given_starts`). The world size, the model and
    the data are checked once the run has them."""
    stages = parse_schedule(text)
    for i, stage in enumerate(stages):
        with stage.refusals(i):
            stage_cp = stage.cp_config(cp_config or ContextParallelConfig())
        if sparse_config is not None:
            config = _stage_config(i, stage, sparse_config)
            with stage.refusals(i):
                check_zigzag_length(stage, config, stage_cp)
    if max_steps > 0 and all(stage.from_step is not None for stage in stages[1:]):
        _starts(stages, max_steps)
    elif max_steps > 0:
        _check_given_starts(stages, max_steps)


def check_zigzag_length(stage: Stage, sparse_config: SparseAttentionConfig, cp_config: ContextParallelConfig) -> None:
    """Raise ValueError, naming the fix, when `stage` shards its sequences zigzag (`cp_config`: the stage's) at a
    length that is not whole head and tail chunks of blocks on every rank: each sequence would be padded to the next
    multiple of 2 x blocks x CP (#50: `0:256:4:cp_sharding=zigzag` with 64-token blocks passed the whole-blocks check
    and trained every rank on 128 tokens, 64 of them padding)."""
    if stage.cp_size == 1 or cp_config.cp_sharding != "zigzag":
        return
    block = sparse_config.block_size
    plan = ShardPlan("zigzag", stage.cp_size, block, stage.seq_len)  # (the split the stage's batches get)
    if plan.padded_len != stage.seq_len:
        unit, padded = plan.granularity, plan.padded_len
        raise ValueError(
            f"seq_len={stage.seq_len} does not split into zigzag's head and tail chunks of whole {block}-token blocks "
            f"on each of {stage.cp_size} CP ranks (a multiple of {unit} does): every sequence would be "
            f"padded to {padded} tokens. Use {_seq_len_fix(stage.seq_len, unit)}, cp_sharding=striped (whole blocks "
            "per rank suffice), or another block_size.")


def _check_given_starts(stages: Sequence[Stage], max_steps: int) -> None:
    """Raise `_starts`' ValueError for what a schedule with epoch starts decides before the data resolve them: the
    first stage at 0, the step starts and the epoch starts each increasing (the stages follow one another, and an
    epoch is reached at a later step than an earlier one), no step start at or after max_steps."""
    if stages[0].from_step or stages[0].from_epoch:
        raise ValueError(_FIRST_START.format(stages[0].text))
    for unit, kind in (("step", "from_step"), ("epoch", "from_epoch")):
        # (the first stage, at 0, is at step 0 and at epoch 0)
        given = [(0, 0)] + [(i, getattr(stage, kind)) for i, stage in enumerate(stages[1:], 1)
                            if getattr(stage, kind) is not None]
        for (j, earlier), (i, start) in zip(given, given[1:]):
            if start <= earlier:
                raise ValueError(_ORDER.format(i=i, text=stages[i].text, unit=unit, start=f"{start:g}", j=j,
                                               earlier=f"{earlier:g}"))
    last = max((stage.from_step for stage in stages if stage.from_step is not None), default=0)
    if last >= max_steps:
        raise ValueError(_LAST_START.format(last, max_steps))


def _stage_config(i: int, stage: Stage, sparse_config: SparseAttentionConfig) -> SparseAttentionConfig:
    """Stage `i`'s pattern: `sparse_config` with its fields. Raises ValueError, naming the stage, for a field that
    is unknown or invalid, or a length that does not split into whole blocks per CP rank."""
    with stage.refusals(i):
        unknown = set(stage.sparse) - set(SparseAttentionConfig.keys())
        smet = sorted(k for k in unknown if k.removeprefix("smet_") in _SMET_FIELDS and k != "mode")
        if smet:  # (`mode` alone may be meant as the pattern's budget.mode)
            flags = " ".join(f"--smet_{k.removeprefix('smet_')} {stage.sparse[k]}" for k in smet)
            raise ValueError(f"{smet} are SMET settings, which hold for the whole run (a stage changes the sequence "
                             "length, the CP layout and the sparse-attention pattern only): drop them from the stage "
                             f"and set them for the run ({flags}).")
        if any(key.startswith("layer_overrides") for key in unknown):
            raise ValueError("a stage cannot set layer_overrides: give them in the run's --sparse_config file, where "
                             "they hold for every stage (a stage's fields reach the layers whose overrides do not set "
                             "them).")
        if unknown:
            hint = "; use e.g. mass_threshold=0.005 or cp_mode=ulysses."
            if "mode" in unknown:
                mode = stage.sparse["mode"]
                hint = (f": the budget's mode is budget_mode={mode} (or budget.mode={mode}); SMET's, --smet_mode, "
                        "holds for the whole run.")
            raise ValueError(f"{sorted(unknown)} are not sparse-pattern fields (SparseAttentionConfig) or CP fields "
                             f"(ContextParallelConfig){hint}")
        config = stage.sparse_config(sparse_config)
        unit = config.block_size * stage.cp_size
        if stage.seq_len % unit:
            raise ValueError(
                f"seq_len={stage.seq_len} does not split into whole blocks of {config.block_size} tokens over "
                f"{stage.cp_size} CP ranks (a multiple of {unit} does): use {_seq_len_fix(stage.seq_len, unit)}, or "
                "another block_size.")
    return config


def _starts(stages: Sequence[Stage], max_steps: int, samples_per_step: Sequence[int] | None = None,
            num_samples: int | None = None) -> tuple[int, ...]:
    """The stages' start steps (`build_schedule`'s arguments), each after the one before and within max_steps."""
    starts, consumed = [], 0  # consumed: samples taken before the latest stage's start
    resolved: dict[int, str] = {}  # the epoch starts the data resolved, for a refusal that names their step
    for i, stage in enumerate(stages):
        if stage.from_step is not None or i == 0:
            start = stage.from_step if stage.from_step is not None else int(stage.from_epoch > 0)
        elif samples_per_step is None or not num_samples:
            raise ValueError(f"cp_schedule stage {i} ({stage.text}) starts at an epoch, which needs a dataset with a "
                             "length: start it at a step instead.")
        else:  # the first step boundary at which `from_epoch` passes over the dataset are consumed
            need = stage.from_epoch * num_samples - consumed
            start = starts[-1] + max(0, math.ceil(need / samples_per_step[i - 1]))
            resolved[i] = (f" Stage {i} ({stage.text}) starts at step {start}, the first by which {stage.from_epoch:g} "
                           f"passes over the {num_samples} samples are taken.")
        if i and start <= starts[-1]:
            raise ValueError(_ORDER.format(i=i, text=stage.text, unit="step", start=start, j=i - 1, earlier=starts[-1])
                             + resolved.get(i - 1, "") + resolved.get(i, ""))
        if i and samples_per_step is not None:
            consumed += (start - starts[-1]) * samples_per_step[i - 1]
        starts.append(start)
    if starts[0] != 0:
        raise ValueError(_FIRST_START.format(stages[0].text))
    if starts[-1] >= max_steps:
        raise ValueError(_LAST_START.format(starts[-1], max_steps) + resolved.get(len(stages) - 1, ""))
    return tuple(starts)


_SMET_FIELDS = frozenset(f.name for f in dataclasses.fields(SMETConfig))
_ORDER = ("cp_schedule stage {i} ({text}) starts at {unit} {start}, not after stage {j} ({unit} {earlier}): order the "
          "stages by their start.")
_FIRST_START = "cp_schedule's first stage ({}) must start at 0 (or 0ep)."
_LAST_START = ("cp_schedule's last stage starts at step {0}, at or after --max_steps {1}: raise --max_steps above {0} "
               "or start the stage earlier.")
