"""`SMETAdam`: Adam/AdamW with compact state for block-sparse matrices and a cure for cold starts.

Parameter groups flagged `smet=True` hold 2-D weights (and 3-D stacks of them, an MoE's fused experts, whose
`transposed` list in the group says which are stored `[experts, in, out]`) that are block-sparse row by row (see
`masks.py`); the other groups are plain dense Adam/AdamW. For a sparse weight the optimizer keeps,
per local row, the index of its `k` active blocks, their Adam moments `[rows, k, block_size]` and a
step counter per block. Every `update_interval` steps it prunes and regrows blocks (`topology.py`).

Regrown blocks would otherwise start "cold": zero moments under a global step t make the first
update (1 - b1) / sqrt(1 - b2) ~ 3.16 times a normal one. SMET resets a per-block step counter on
regrowth (local bias correction), ramps the regrown blocks' step size up over
`regrow_warmup_steps`, and scales the sparse matrices' learning rate with the density (the update itself:
`adam.py`; the state as a checkpoint holds it, and the checks loading one makes: `checkpoint.py`).

Every rank holding a copy of a sparse row must take the same topology decisions, or the copies drift
apart, and every parallel layout must take the decisions one process takes on the whole batch. Pruning
reads weights or update magnitudes, which are equal on every rank; gradient regrowth scores the
reduced gradient, as one process would see it (`_regrowth_scores`).
"""

from __future__ import annotations

import logging
import weakref
from collections import defaultdict
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from .adam import DENSE_STATE, dense_step, sparse_step
from .checkpoint import (
    REPLACED_KEY,
    STATE_FIELDS,
    as_saved,
    check_names,
    check_saved_groups,
    check_settings,
    loaded_state,
)
from .config import SMETConfig
from .dtensor import local
from .masks import BlockGrid
from .modes.base import checked_scores
from .topology import initial_blocks, prune_rate, prune_slots, regrow

logger = logging.getLogger(__name__)


class SMETAdam(torch.optim.Optimizer):
    """Adam (`decoupled_weight_decay=False`) or AdamW with SMET block-sparse groups. `weight_decay` left unset is
    the stock class's default: 1e-2 for AdamW, 0 for Adam (the factory passes its own in every group).

    Build it with `hf_sparse_cp.smet.create_smet_optimizer`, which finds the sparse matrices of a
    model. Call `attach()` before the first forward (the factory and the Trainer callback do): it
    chooses the first active blocks, zeroes inactive weights (where the mode says so: `sparse_weights`) and installs
    the hooks that zero the gradients of inactive blocks as soon as they are accumulated, so
    gradient clipping sees the sparse gradient.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float | None = None,
        *,
        config: SMETConfig | None = None,
        decoupled_weight_decay: bool = True,
    ) -> None:
        # (written so that NaN fails them too, as torch's AdamW refuses it)
        if not lr >= 0:
            raise ValueError(f"lr={lr} must be >= 0.")
        try:  # (a pair of numbers: a third beta was ignored, a single one ended in a TypeError)
            pair = tuple(float(b) for b in betas)
        except (TypeError, ValueError):
            pair = ()
        if not (len(pair) == 2 and 0.0 <= pair[0] < 1.0 and 0.0 <= pair[1] < 1.0):
            raise ValueError(f"betas={betas} must be two numbers, both in [0, 1), e.g. (0.9, 0.999).")
        betas = pair
        if not eps > 0:
            raise ValueError(f"eps={eps} must be > 0, e.g. 1e-8.")
        if weight_decay is None:
            weight_decay = 1e-2 if decoupled_weight_decay else 0.0
        if not weight_decay >= 0:
            raise ValueError(f"weight_decay={weight_decay} must be >= 0.")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, smet=False)
        super().__init__(params, defaults)
        self.config = config if config is not None else SMETConfig()
        self.decoupled_weight_decay = decoupled_weight_decay
        # Steps of the prune-rate cosine decay; the Trainer callback fills it in from max_steps.
        self.schedule_horizon = self.config.prune_decay_steps
        self.last_replaced_fraction = 0.0
        self._grids: dict[int, tuple[torch.Tensor, BlockGrid]] = {}
        self._hooks: dict[int, tuple[torch.Tensor, Any]] = {}
        # Per sparse weight, before a gradient-regrowth update: its whole gradient as its hook saw it (mask_gradient).
        self._kept_grads: dict[int, torch.Tensor] = {}

    # ---- set-up ----

    def _named_params(self) -> Iterator[tuple[int, dict[str, Any], torch.Tensor, str]]:
        """(key, group, param, name) over all parameters; `key` is the position in the groups."""
        key = 0
        for group in self.param_groups:
            names = group.get("param_names") or [None] * len(group["params"])
            for param, name in zip(group["params"], names):
                yield key, group, param, name or f"parameter {key}"
                key += 1

    def _grid(self, param: torch.Tensor) -> BlockGrid:
        cached = self._grids.get(id(param))
        if cached is None or cached[0] is not param:
            cached = (param, self._new_grid(param))
            self._grids[id(param)] = cached
        return cached[1]

    def _new_grid(self, param: torch.Tensor) -> BlockGrid:
        """The grid of a sparse parameter; its group's `transposed` list (parallel to `params`, optional for 2-D
        weights) says how a 3-D one's slices are stored."""
        for group in self.param_groups:
            for position, candidate in enumerate(group["params"]):
                if candidate is param:
                    names, layouts = group.get("param_names"), group.get("transposed")
                    # (a stack's layout unsaid: None, which BlockGrid.of refuses naming the fix)
                    transposed = layouts[position] if layouts else None if param.dim() == 3 else False
                    return BlockGrid.of(param, self.config.density, self.config.block_size,
                                        names[position] if names else "parameter", transposed)
        raise KeyError("SMET: a parameter of no parameter group.")

    def _unattached(self) -> list[tuple[str, torch.Tensor, bool]]:
        """(name, parameter, sparse) of the parameters without state, and the sparse ones without their gradient
        hook."""
        return [(name, param, group["smet"]) for _, group, param, name in self._named_params()
                if not self.state.get(param)
                or group["smet"] and param.requires_grad and self._hooks.get(id(param), (None,))[0] is not param]

    @torch.no_grad()
    def attach(self) -> SMETAdam:
        """Create masks and compact states for the current parameters (keeping loaded ones), zero the
        inactive weights where the mode says so (`sparse_weights`), and hook gradient masking. Idempotent.

        Call it again if the parameters in `param_groups` are replaced (accelerate swaps them for
        FSDP2 shards after the optimizer is built; the Trainer callback attaches after that)."""
        current = set()
        for key, group, param, _ in self._named_params():
            current.add(id(param))
            state = self.state[param]
            if not group["smet"]:
                if not state:
                    state.update(self._new_dense_state(param))
                continue
            grid = self._grid(param)
            if not state:
                state.update(self._new_sparse_state(param, grid, key))
            if self.config.registered_mode.zeroes_inactive_weights:
                grid.blocks(local(param)).masked_fill_(grid.inactive(state["block_index"]), 0)
            if param.requires_grad and self._hooks.get(id(param), (None,))[0] is not param:
                self._hooks[id(param)] = (param, param.register_post_accumulate_grad_hook(_grad_hook(self)))
        for pid in [pid for pid in self._hooks if pid not in current]:
            self._hooks.pop(pid)[1].remove()
        stale = [p for p in self.state if id(p) not in current]
        for param in stale:
            del self.state[param]
        return self

    def detach(self) -> None:
        """Remove the gradient-masking hooks (the optimizer state stays)."""
        for _, handle in self._hooks.values():
            handle.remove()
        self._hooks.clear()

    def _new_dense_state(self, param: torch.Tensor) -> dict[str, torch.Tensor]:
        state = {"step": torch.tensor(0.0)}
        for name in DENSE_STATE:
            state[name] = torch.zeros_like(local(param), memory_format=torch.contiguous_format)
        return state

    def _new_sparse_state(self, param: torch.Tensor, grid: BlockGrid, key: int) -> dict[str, torch.Tensor]:
        weights = local(param)
        mode = self.config.registered_mode
        scores = mode.initial_scores(grid, weights)
        if scores is not None:
            scores = checked_scores(mode, "initial_scores", scores, (grid.rows, grid.blocks_per_row))
        index = initial_blocks(grid.global_block_ids(weights.device), grid.k, self.config.seed, key, scores)
        shape = (grid.rows, grid.k, grid.block_size)
        state = {
            "step": torch.tensor(0.0),
            "exp_avg": torch.zeros(shape, dtype=param.dtype, device=weights.device),
            "exp_avg_sq": torch.zeros(shape, dtype=param.dtype, device=weights.device),
            "block_index": index.to(grid.index_dtype),
            "block_step": torch.zeros(shape[:2], dtype=torch.int32, device=weights.device),
        }
        for name, dtype in mode.slot_state.items():
            state[name] = torch.zeros(shape[:2], dtype=dtype, device=weights.device)
        return state

    # ---- gradient masking (runs in backward, before any clipping) ----

    def _regrowth_scores_needed(self, step: int, grid: BlockGrid) -> bool:
        """Whether the topology update after optimizer step `step` regrows by gradient."""
        return (
            self.config.regrowth_rule == "gradient"
            and step % self.config.update_interval == 0
            and grid.k < grid.blocks_per_row
        )

    @torch.no_grad()
    def mask_gradient(self, param: torch.Tensor) -> None:
        """Zero the gradient of `param`'s inactive blocks; before a topology update that regrows by
        gradient, first keep a copy of the whole gradient as it stands (its inactive blocks summed over
        micro-batches: after the first, they hold only the new micro-batch's gradient; its active blocks
        as `param.grad` accumulates them), so that `step` scores all of it as it was before clipping or a
        loss scaler's unscaling scale what is left in `param.grad`."""
        state = self.state.get(param)
        if not state or "block_index" not in state or param.grad is None:
            return
        grid = self._grid(param)
        grad = grid.blocks(local(param.grad))
        inactive = grid.inactive(state["block_index"])
        if self._regrowth_scores_needed(int(state["step"].item()) + 1, grid):
            previous = self._kept_grads.get(id(param))
            # (a contiguous copy: it may be all-reduced; the active blocks' earlier micro-batches are in `grad`)
            self._kept_grads[id(param)] = (grad.clone(memory_format=torch.contiguous_format) if previous is None
                                             else previous.masked_fill_(~inactive, 0).add_(grad))
        grad.masked_fill_(inactive, 0)

    def discard_masked_gradients(self) -> None:
        """Forget the gradients the hooks kept since the last step: call it when a step was skipped (a
        GradScaler step that found inf or NaN), whose gradient must not reach the next update's regrowth scores."""
        self._kept_grads.clear()

    # ---- the update ----

    @torch.no_grad()
    def step(self, closure=None):
        """One Adam update of the dense parameters and the sparse weights' kept blocks (and, on the topology
        schedule's steps, the drop and regrowth of blocks); `closure` as for any `torch.optim.Optimizer`."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        unattached = self._unattached()
        if unattached:
            # Sparse weights a backward reached unmasked: a warning, as what ran is done, other than in an attached
            # run. (Dense parameters only lack the state stock Adam creates at their first step too; the zero
            # gradients torch.distributed.checkpoint steps with to create an optimizer's state reached nothing.)
            sparse = [name for name, param, is_sparse in unattached
                      if is_sparse and param.grad is not None and bool(local(param.grad).any())]
            if sparse:
                logger.warning(
                    "SMET attached at a step: %d sparse weights (%s, ...) had no SMET state or gradient-masking hook "
                    "yet (SMETAdam built without attach(), or parameters swapped or added since), so the forward and "
                    "backward before this step ran with their inactive blocks (sparse_weights: not zeroed yet) and "
                    "clipping saw their unmasked gradient. Call optimizer.attach() after building it or changing its "
                    "parameters, before the forward (create_smet_optimizer and install_smet do).",
                    len(sparse), sparse[0])
            self.attach()
        scores = self._regrowth_scores()
        replaced = active = 0
        for key, group, param, _ in self._named_params():
            if param.grad is None:
                continue
            state = self.state[param]
            state["step"] += 1
            if not group["smet"]:
                dense_step(param, group, state, self.decoupled_weight_decay)
                continue
            grid = self._grid(param)
            step = int(state["step"].item())
            sparse_step(param, group, state, grid, self.config, self.decoupled_weight_decay)
            if step % self.config.update_interval == 0 and grid.k < grid.blocks_per_row:
                replaced += self._update_topology(param, key, state, grid, step, scores.get(id(param)))
                active += grid.rows * grid.k
        if active:
            self.last_replaced_fraction = replaced / active
        return loss

    def _regrowth_scores(self) -> dict[int, torch.Tensor]:
        """The gradient regrowth scores of the sparse weights whose topology is updated at this step
        (keyed by `id(param)`): the L1 norm of every block of the step's whole gradient, as one process
        computes it on the whole batch, so every rank and every parallel layout decides alike.

        That gradient is the one the hooks kept (`mask_gradient`), not `param.grad`: clipping and a loss
        scaler's unscaling scale `param.grad` after the hooks, uniformly, which leaves the blocks' ranking
        alone only where it scales every block; scoring the blocks just pruned (active in this backward, so
        in `param.grad`) by their scaled gradient against the others' unscaled one did not (clipped to a
        hundredth of the norm, none of them came back). FSDP2 runs the hooks on the reduce-scattered
        (under HSDP also all-reduced) gradient shard, so a DTensor parameter's kept gradient is already
        reduced. DDP (and so the Trainer's context parallelism on CPU, which is DDP over the CP ranks)
        averages gradients after the hooks have run, so each rank kept its own micro-batches' or sequence
        shard's gradient: for plain parameters, replicated on every rank, it is averaged over all ranks
        here as DDP averages it (one all-reduce per matrix, at topology-update steps only).
        A norm of summed gradients is not the sum of their norms, so the reduction comes before the norm.
        """
        masked, replicated = {}, []
        for _, group, param, _ in self._named_params():
            if not group["smet"] or param.grad is None:
                continue
            grid = self._grid(param)
            held = self._kept_grads.pop(id(param), None)
            if not self._regrowth_scores_needed(int(self.state[param]["step"].item()) + 1, grid):
                continue
            if not isinstance(param, DTensor) and _ranks() > 1:
                # every rank averages the same list: a rank whose batch never reached this weight (an MoE expert of
                # its own module, a branch of its own) ran no hook and kept nothing, which is zeros (its gradient), not
                # a missing entry (a fused experts stack's hook runs once any expert is reached; an expert no token was
                # routed to holds zeros in its slice of the gradient, as a stock AdamW sees it)
                grad = local(param.grad)
                held = grad.new_zeros(grid.blocks(grad).shape) if held is None else held
                replicated.append(held)
            masked[id(param)] = (param, held)
        _mean_over_ranks(replicated)
        scores = {}
        for key, (param, held) in masked.items():
            # (no hook saw this gradient when attach() came after the backward: it is still unmasked, whole)
            grid = self._grid(param)
            scores[key] = grid.block_l1(grid.blocks(local(param.grad)) if held is None else held)
        return scores


    @torch.no_grad()
    def _update_topology(
        self,
        param: torch.Tensor,
        key: int,
        state: dict[str, torch.Tensor],
        grid: BlockGrid,
        step: int,
        gradient_score: torch.Tensor | None,
    ) -> int:
        """Prune and regrow the blocks of one sparse weight; returns the number of replaced blocks."""
        cfg, mode = self.config, self.config.registered_mode
        rate = prune_rate(cfg, step, self.schedule_horizon)
        if rate <= 0 or grid.rows == 0:
            return 0
        index = state["block_index"]
        weights = local(param)
        scores = checked_scores(mode, "prune_scores", mode.prune_scores(grid, weights, state), tuple(index.shape))
        device = weights.device
        pruned = prune_slots(scores, rate, grid.global_row_ids(device), cfg.seed, key, step)
        if mode.zeroes_inactive_weights:
            grid.scatter_(weights, index, grid.gather(weights, index).masked_fill_(pruned.unsqueeze(-1), 0))
        if cfg.regrowth_rule == "random":
            gradient_score = None
        elif gradient_score is None:
            raise RuntimeError("Gradient regrowth needs the gradient of this step; none was recorded.")
        index.copy_(
            regrow(index, pruned, grid.blocks_per_row, grid.global_block_ids(device), cfg.seed, key, step,
                   gradient_score)
        )
        for name in ("exp_avg", "exp_avg_sq"):
            state[name].masked_fill_(pruned.unsqueeze(-1), 0)
        state["block_step"].masked_fill_(pruned, 0)
        for name in mode.slot_state:
            state[name].masked_fill_(pruned, 0)
        return int(pruned.sum())

    # ---- checkpointing ----

    def state_dict(self) -> dict[str, Any]:
        """Like `torch.optim.Optimizer.state_dict`, with SMET's masks, compact moments and block step
        counters per parameter. For FSDP2 parameters every state tensor is a DTensor sharded by rows like
        its parameter, so `torch.distributed.checkpoint` saves each row once and can reshard."""
        positions: dict[int, int] = {}
        groups = []
        for group in self.param_groups:
            packed = {k: v for k, v in group.items() if k != "params"}
            if group["smet"]:
                packed.update(self._settings(), **{REPLACED_KEY: self.last_replaced_fraction})
            packed["params"] = [positions.setdefault(id(p), len(positions)) for p in group["params"]]
            groups.append(packed)
        state = {}
        for _, group, param, _ in self._named_params():
            saved = self.state.get(param)
            if saved:
                grid = self._grid(param) if group["smet"] else None
                state[positions[id(param)]] = {name: as_saved(param, value, grid) for name, value in saved.items()}
        return {"state": state, "param_groups": groups}

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a `state_dict()` (also one whose tensors are DTensors, full tensors of a sharded
        parameter, or keyed by parameter names as `torch.distributed.checkpoint.state_dict` gives)."""
        saved_groups = state_dict["param_groups"]
        check_saved_groups(saved_groups, self.param_groups)
        settings = self._settings()
        for saved, group in zip(saved_groups, self.param_groups):
            if group["smet"]:
                check_settings(saved, settings)
        check_names(saved_groups, self.param_groups)
        by_saved_id = {}
        for saved, group in zip(saved_groups, self.param_groups):
            by_saved_id.update(zip(saved["params"], group["params"]))
            group.update({k: v for k, v in saved.items() if k != "params" and k not in settings and k != REPLACED_KEY})
            if REPLACED_KEY in saved:
                self.last_replaced_fraction = float(saved[REPLACED_KEY])
        new_state: defaultdict[torch.Tensor, dict[str, torch.Tensor]] = defaultdict(dict)
        sparse = {id(p) for _, g, p, _ in self._named_params() if g["smet"]}
        for saved_id, saved in state_dict["state"].items():
            param = by_saved_id[saved_id]
            grid = self._grid(param) if id(param) in sparse else None
            slots = self.config.registered_mode.slot_state if grid is not None else {}
            new_state[param] = loaded_state(param, saved, grid, slots)
        self.state = new_state

    def _settings(self) -> dict[str, Any]:
        return {f"smet_{name}": getattr(self.config, name) for name in STATE_FIELDS}

    # ---- reporting ----

    @property
    def topology_updates(self) -> int:
        """Topology updates done so far (counted from the step, so also right after a resume)."""
        steps = [int(self.state[p]["step"]) for _, g, p, _ in self._named_params() if g["smet"] and self.state.get(p)]
        return max(steps, default=0) // self.config.update_interval

    def trained_density(self) -> float:
        """Active fraction of the whole sparse weights (all ranks' shards; 1.0 when there are none): the density asked,
        moved by whole blocks per row (`rounding.kept_blocks`). No communication."""
        active = total = 0
        for _, group, param, _ in self._named_params():
            if group["smet"]:
                grid = self._grid(param)
                active += grid.global_rows * grid.k * grid.block_size
                total += param.numel()  # (a DTensor's: the whole weight's)
        return active / total if total else 1.0


def _ranks() -> int:
    """Processes of the default process group (1 without one). (smet sits below `distributed` in the layers, whose
    `comm.rank_and_world` says the same.)"""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _mean_over_ranks(tensors: list[torch.Tensor]) -> None:
    """Average every tensor in place over all ranks of the default process group, as DDP averages
    gradients (a no-op in one process); the collectives run concurrently, in the same order on every rank."""
    if not tensors or _ranks() == 1:
        return
    for work in [dist.all_reduce(t, op=dist.ReduceOp.SUM, async_op=True) for t in tensors]:
        work.wait()
    for t in tensors:
        t.div_(dist.get_world_size())


def _grad_hook(optimizer: SMETAdam):
    ref = weakref.ref(optimizer)

    def hook(param: torch.Tensor) -> None:
        opt = ref()
        if opt is not None:
            opt.mask_gradient(param)

    return hook


def unwrap_smet(optimizer: Any) -> SMETAdam | None:
    """The `SMETAdam` inside `optimizer` (accelerate wraps it), or None."""
    for candidate in (optimizer, getattr(optimizer, "optimizer", None)):
        if isinstance(candidate, SMETAdam):
            return candidate
    return None
