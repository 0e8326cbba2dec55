"""`SMETAdam`: Adam/AdamW with compact state for block-sparse matrices and a cure for cold starts.

Parameter groups flagged `smet=True` hold 2-D weights (and 3-D stacks of them, an MoE's fused experts, whose
`transposed` list in the group says which are stored `[experts, in, out]`) that are block-sparse row by row (see
`masks.py`); the other groups are plain dense Adam/AdamW. For a sparse weight the optimizer keeps,
per local row, the index of its `k` active blocks, their Adam moments `[rows, k, block_size]` and a
step counter per block. Every `update_interval` steps it prunes and regrows blocks (`topology.py`).

Regrown blocks would otherwise start "cold": zero moments under a global step t make the first
update (1 - b1) / sqrt(1 - b2) ~ 3.16 times a normal one. SMET resets a per-block step counter on
regrowth (local bias correction), ramps the regrown blocks' step size up over
`regrow_warmup_steps`, and scales the sparse matrices' learning rate with the density.

Every rank holding a copy of a sparse row must take the same topology decisions, or the copies drift
apart, and every parallel layout must take the decisions one process takes on the whole batch. Pruning
reads weights or update magnitudes, which are equal on every rank; gradient regrowth scores the
reduced gradient, as one process would see it (`_regrowth_scores`).
"""

from __future__ import annotations

import logging
import math
import weakref
from collections import defaultdict
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from .config import SMETConfig
from .dtensor import like_param, local, local_rows_of
from .masks import BlockGrid
from .modes.base import checked_scores
from .topology import initial_blocks, prune_rate, prune_slots, regrow

logger = logging.getLogger(__name__)

DENSE_STATE = ("exp_avg", "exp_avg_sq")
# The SMETConfig fields that fix the shape and meaning of the sparse state: `state_dict` records them
# in its SMET parameter groups as `smet_<field>`, and loading refuses a checkpoint where they differ.
STATE_FIELDS = ("mode", "density", "block_size")
# Where `state_dict` keeps `last_replaced_fraction` (in its SMET groups), so that a resumed run logs what the
# uninterrupted one logs until its next topology update.
REPLACED_KEY = "smet_last_replaced_fraction"


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
                self._dense_step(param, group, state)
                continue
            grid = self._grid(param)
            step = int(state["step"].item())
            self._sparse_step(param, group, state, grid)
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

    def _dense_step(self, param: torch.Tensor, group: dict[str, Any], state: dict[str, torch.Tensor]) -> None:
        lr, (beta1, beta2), eps, decay = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        weights, grad = local(param), local(param.grad)
        if decay and not self.decoupled_weight_decay:
            grad = grad.add(weights, alpha=decay)
        if decay and self.decoupled_weight_decay:
            weights.mul_(1 - lr * decay)
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        step = state["step"].item()
        bias_correction1 = 1 - beta1**step
        denom = (exp_avg_sq.sqrt() / math.sqrt(1 - beta2**step)).add_(eps)
        weights.addcdiv_(exp_avg, denom, value=-lr / bias_correction1)

    def _sparse_step(
        self, param: torch.Tensor, group: dict[str, Any], state: dict[str, torch.Tensor], grid: BlockGrid
    ) -> None:
        cfg = self.config
        lr, (beta1, beta2), eps, decay = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        lr = lr * cfg.lr_scale_at(grid.density)  # (the density this weight trains at: whole blocks per row)
        weights, index = local(param), state["block_index"]
        compute = torch.promote_types(param.dtype, torch.float32)
        old = grid.gather(weights, index).to(compute)
        grad = grid.gather(local(param.grad), index).to(compute)
        if decay and not self.decoupled_weight_decay:
            grad = grad.add(old, alpha=decay)

        block_step = state["block_step"]
        block_step.add_(1)
        step = state["step"].item()
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        exp_avg.lerp_(grad.to(exp_avg.dtype), 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad.to(exp_avg_sq.dtype), grad.to(exp_avg_sq.dtype), value=1 - beta2)

        local_step = block_step.to(compute).unsqueeze(-1)
        if cfg.local_bias_correction:
            bias_correction1 = _bias_correction(beta1, local_step)
            bias_correction2 = _bias_correction(beta2, local_step)
        else:
            bias_correction1 = 1 - beta1**step
            bias_correction2 = 1 - beta2**step
        update = (exp_avg.to(compute) / bias_correction1) / (
            (exp_avg_sq.to(compute) / bias_correction2).sqrt_().add_(eps)
        )
        step_size: torch.Tensor | float = lr
        if cfg.regrow_warmup_steps:
            # Blocks active since the start share the global step; regrown ones lag behind it.
            regrown = (block_step < step).unsqueeze(-1)
            ramp = (local_step / cfg.regrow_warmup_steps).clamp_(max=1.0)
            step_size = lr * torch.where(regrown, ramp, torch.ones_like(ramp))
        new = old * (1 - step_size * decay) if decay and self.decoupled_weight_decay else old
        new = new - step_size * update
        cfg.registered_mode.record_update(state, old, new)
        grid.scatter_(weights, index, new.to(weights.dtype))

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
                state[positions[id(param)]] = {name: _export(param, value, grid) for name, value in saved.items()}
        return {"state": state, "param_groups": groups}

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a `state_dict()` (also one whose tensors are DTensors, full tensors of a sharded
        parameter, or keyed by parameter names as `torch.distributed.checkpoint.state_dict` gives)."""
        saved_groups = state_dict["param_groups"]
        if not any("smet" in saved for saved in saved_groups):
            # (a stock optimizer's state: its groups would be refused below as grouped otherwise, naming a wrong fix)
            raise ValueError(
                "The checkpoint's optimizer state was not saved by SMET (its parameter groups carry no 'smet' flag: "
                "another optimizer saved it, e.g. torch's AdamW in a run without --smet), so it has no SMET masks "
                "or compact moments: resume that checkpoint without --smet, or start SMET from its weights without "
                "its optimizer state (load the model from the checkpoint folder, not resume_from_checkpoint)."
            )
        if len(saved_groups) != len(self.param_groups) or any(
            len(s["params"]) != len(g["params"]) for s, g in zip(saved_groups, self.param_groups)
        ):
            targets = _saved_targets(saved_groups)
            differ = targets and targets != _saved_targets(self.param_groups)  # (else: the same targets, another model)
            raise ValueError(
                "The saved optimizer has a different parameter grouping "
                f"({[len(s['params']) for s in saved_groups]} vs "
                f"{[len(g['params']) for g in self.param_groups]} parameters per group); build the optimizer "
                "the same way (same model, same target_modules" + (
                    f": the checkpoint's sparse weights are {targets}, e.g. --smet_target_modules {','.join(targets)}"
                    if differ else "") + ") before loading."
            )
        settings = self._settings()
        for saved, group in zip(saved_groups, self.param_groups):
            if group["smet"]:
                self._check_settings(saved, settings)
        _check_names(saved_groups, self.param_groups)
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
            new_state[param] = self._import_state(param, saved, id(param) in sparse)
        self.state = new_state

    def _settings(self) -> dict[str, Any]:
        return {f"smet_{name}": getattr(self.config, name) for name in STATE_FIELDS}

    def _check_settings(self, saved_group: dict[str, Any], settings: dict[str, Any]) -> None:
        """Refuse a saved SMET group whose recorded mode, density or block size differ from ours: its
        masks and compact moments would not fit (or, broadcast into our shapes, silently be wrong)."""
        differ = [
            f"{key.removeprefix('smet_')}={saved_group[key]!r} (this run: {value!r})"
            for key, value in settings.items()
            if key in saved_group and saved_group[key] != value
        ]
        if differ:
            raise ValueError(
                f"The checkpoint's SMET optimizer state was saved with {', '.join(differ)}; resume with the same "
                "SMET settings (e.g. the same --smet_density and --smet_block_size), or start a new run from the "
                "saved model without its optimizer state."
            )

    def _import_state(self, param: torch.Tensor, saved: dict[str, Any], sparse: bool) -> dict[str, torch.Tensor]:
        shard = local(param)
        if sparse:
            grid = self._grid(param)
            # (as saved: a stack's per-row states `[slices, rows per slice, ...]`, see `_export`)
            rows = (grid.slices, grid.slice_rows) if grid.stacked else (grid.rows,)
            block_shape = (*rows, grid.k, grid.block_size)
            expected = {
                "exp_avg": (block_shape, param.dtype),
                "exp_avg_sq": (block_shape, param.dtype),
                "block_index": (block_shape[:-1], grid.index_dtype),
                "block_step": (block_shape[:-1], torch.int32),
            }
            expected.update({name: (block_shape[:-1], dtype)
                             for name, dtype in self.config.registered_mode.slot_state.items()})
        else:
            expected = {name: (tuple(shard.shape), param.dtype) for name in DENSE_STATE}
        missing = set(expected) - set(saved)
        if missing:
            raise ValueError(
                f"Saved optimizer state lacks {sorted(missing)} for a {'sparse' if sparse else 'dense'} parameter; "
                "it was saved with another optimizer or SMET mode."
            )
        state = {"step": torch.as_tensor(float(saved["step"]), dtype=torch.float32)}
        for name, (shape, dtype) in expected.items():
            value = local_rows_of(param, saved[name])
            if tuple(value.shape) != tuple(shape):
                raise ValueError(
                    f"Saved SMET state {name!r} has local shape {tuple(value.shape)}, expected {tuple(shape)}: the "
                    "checkpoint was written for weights of other shapes, or with another density or block_size; "
                    "resume with the same model and SMET config."
                )
            state[name] = value.to(device=shard.device, dtype=dtype)
            if sparse and grid.stacked:
                state[name] = state[name].reshape(grid.rows, *shape[2:])
        if sparse and state["block_index"].numel():
            index = state["block_index"]
            if int(index.min()) < 0 or int(index.max()) >= grid.blocks_per_row:
                raise ValueError("Saved SMET block index is out of range for this parameter; wrong checkpoint?")
        return state

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


# Module names that wrappers insert in parameter names (torch.compile, FSDP1, activation checkpointing): a
# checkpoint saved with one of them names the same weights.
_WRAPPER_NAMES = {"_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module"}


def _same_weight(saved: str, current: str) -> bool:
    """Whether two parameter names name the same weight of a model, one perhaps wrapped (`_WRAPPER_NAMES`, a
    leading `module.` of DDP, a prefix such as PEFT's `base_model.model.`)."""
    def plain(name: str) -> str:
        parts = [part for part in name.split(".") if part not in _WRAPPER_NAMES]
        return ".".join(parts[1:] if parts[:1] == ["module"] else parts)

    a, b = plain(saved), plain(current)
    return a == b or a.endswith(f".{b}") or b.endswith(f".{a}")


def _check_names(saved_groups: list[dict[str, Any]], groups: list[dict[str, Any]]) -> None:
    """Refuse a saved state whose groups list other weights than ours where both record their names: weights of
    one shape (q_proj and o_proj of multi-head attention) would take each other's masks and moments unnoticed
    (a checkpoint saved with other target_modules)."""
    for saved, group in zip(saved_groups, groups):
        if not saved.get("param_names") or not group.get("param_names"):
            continue
        for old, new in zip(saved["param_names"], group["param_names"]):
            if not _same_weight(old, new):
                targets = _saved_targets(saved_groups)
                raise ValueError(
                    f"The checkpoint's optimizer state was saved for {old} where this run has {new} "
                    f"({'sparse' if group['smet'] else 'dense'} parameters): resume with the same target_modules "
                    f"(the checkpoint's sparse weights: {targets}), e.g. --smet_target_modules {','.join(targets)}, "
                    "or start a new run from the saved model without its optimizer state."
                )


def _saved_targets(groups: list[dict[str, Any]]) -> list[str]:
    """The target names of the sparse weights that SMET `groups` (a saved state's, an optimizer's) list by name (empty
    where unnamed): a module's name for its `.weight`, a fused experts stack's own (`gate_up_proj`)."""
    return sorted({parts[-2] if parts[-1] == "weight" else parts[-1] for g in groups if g.get("smet")
                   for parts in [n.split(".") for n in g.get("param_names") or ()] if len(parts) > 1})


def _export(param: torch.Tensor, value: torch.Tensor, grid: BlockGrid | None) -> torch.Tensor:
    """A state tensor as saved: laid out like `param` (`like_param`); a sparse stack's (`grid.stacked`) per-row
    states `[slices, rows per slice, ...]`, so that they shard as the stack does, by whole slices."""
    if value.dim() == 0:
        return value
    if value.dtype == torch.int16:
        # Collectives (gloo, NCCL) have no int16: checkpoints carry the block index as int32.
        value = value.to(torch.int32)
    if grid is not None and grid.stacked:
        value = grid.per_slice(value)
    return like_param(param, value)


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


def _bias_correction(beta: float, steps: torch.Tensor) -> torch.Tensor:
    """`1 - beta**steps` to the precision of `steps`' dtype: as `-expm1(steps * ln beta)`, since in float32
    `1 - beta**t` cancels away the digits that matter (beta2=0.999: the step size 7e-6 off Adam's, 0.99999: 7e-4)."""
    if beta == 0:
        return torch.ones_like(steps)
    return -torch.expm1(steps * math.log(beta))


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
