"""The Adam update `SMETAdam` applies: a dense parameter's as torch's Adam / AdamW, and a sparse weight's kept
blocks' with the cure for cold starts (see `optimizer.py`): a step counter per block (local bias correction), the
regrown blocks' step size ramped up, the learning rate scaled with the density."""

from __future__ import annotations

import math
from typing import Any

import torch

from .config import SMETConfig
from .dtensor import local
from .masks import BlockGrid

# A dense parameter's state besides its step: Adam's moments, shaped like its local shard.
DENSE_STATE = ("exp_avg", "exp_avg_sq")


def dense_step(param: torch.Tensor, group: dict[str, Any], state: dict[str, torch.Tensor],
               decoupled_weight_decay: bool) -> None:
    """One Adam (`decoupled_weight_decay=False`) or AdamW update of a dense parameter, as torch's."""
    lr, (beta1, beta2), eps, decay = group["lr"], group["betas"], group["eps"], group["weight_decay"]
    weights, grad = local(param), local(param.grad)
    if decay and not decoupled_weight_decay:
        grad = grad.add(weights, alpha=decay)
    if decay and decoupled_weight_decay:
        weights.mul_(1 - lr * decay)
    exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    step = state["step"].item()
    bias_correction1 = 1 - beta1**step
    denom = (exp_avg_sq.sqrt() / math.sqrt(1 - beta2**step)).add_(eps)
    weights.addcdiv_(exp_avg, denom, value=-lr / bias_correction1)


def sparse_step(param: torch.Tensor, group: dict[str, Any], state: dict[str, torch.Tensor], grid: BlockGrid,
                cfg: SMETConfig, decoupled_weight_decay: bool) -> None:
    """One Adam or AdamW update of a sparse weight's kept blocks (`state`: its compact moments and per-block step
    counters, see `SMETAdam`), with the cold-start cure `cfg` asks for: each block's own bias correction, the regrown
    blocks' step size ramped up over `regrow_warmup_steps`, the learning rate scaled with the density."""
    lr, (beta1, beta2), eps, decay = group["lr"], group["betas"], group["eps"], group["weight_decay"]
    lr = lr * cfg.lr_scale_at(grid.density)  # (the density this weight trains at: whole blocks per row)
    weights, index = local(param), state["block_index"]
    compute = torch.promote_types(param.dtype, torch.float32)
    old = grid.gather(weights, index).to(compute)
    grad = grid.gather(local(param.grad), index).to(compute)
    if decay and not decoupled_weight_decay:
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
    new = old * (1 - step_size * decay) if decay and decoupled_weight_decay else old
    new = new - step_size * update
    cfg.registered_mode.record_update(state, old, new)
    grid.scatter_(weights, index, new.to(weights.dtype))


def _bias_correction(beta: float, steps: torch.Tensor) -> torch.Tensor:
    """`1 - beta**steps` to the precision of `steps`' dtype: as `-expm1(steps * ln beta)`, since in float32
    `1 - beta**t` cancels away the digits that matter (beta2=0.999: the step size 7e-6 off Adam's, 0.99999: 7e-4)."""
    if beta == 0:
        return torch.ones_like(steps)
    return -torch.expm1(steps * math.log(beta))
