"""Cross-entropy of a linear layer's output, computed chunk by chunk so the [N, V] logits never exist.

Layers, bottom up:
* `_chunk_step`: loss sum of one token chunk and the gradient of the normalized loss w.r.t. its
  logits (times a factor, in fp16: `_saved_scale`), both in fp32;
* `_ChunkedLinearCrossEntropy`: an autograd Function that runs the chunks in forward, accumulates
  the input, weight and bias gradients there (the loss is a scalar, so they are known up to the
  incoming scalar gradient) and only rescales them in backward;
* `chunked_linear_cross_entropy`: the documented public function with shape checks.

`loss_normalizer`, `gradient_scale` and `normalize` are the divisor handling every backend shares
(`dispatch.py`): a batch without targets gets a zero gradient, never 0 * (1 / 0) = NaN.

Peak extra memory is one chunk of logits (fp32, plus a low-precision copy for bf16/fp16
inputs) and an fp32 (fp64 for fp64 weights) accumulator of the weight gradient, never O(N x V).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Bytes of one chunk's fp32 logits when `chunk_size` is not given: 256 MiB keeps the loss's
# transient memory far below a decoder layer's activations at long context, and the chunk
# (441 tokens for a 151936-token vocabulary) still fills a GPU's matrix units.
DEFAULT_CHUNK_BYTES = 256 * 2**20


def default_chunk_size(num_tokens: int, vocab_size: int) -> int:
    """Tokens per chunk so that one chunk of fp32 logits takes about `DEFAULT_CHUNK_BYTES`."""
    return max(1, min(num_tokens, DEFAULT_CHUNK_BYTES // (4 * vocab_size)))


def loss_normalizer(
    labels: torch.Tensor, num_items_in_batch: torch.Tensor | int | float | None, ignore_index: int
) -> torch.Tensor:
    """The divisor of the loss sum: `num_items_in_batch` when given (transformers' count over the
    accumulated micro-batches; the global count under context parallelism), else the number of targets."""
    if num_items_in_batch is None:
        return (labels != ignore_index).sum()
    return torch.as_tensor(num_items_in_batch)


def gradient_scale(normalizer: torch.Tensor) -> torch.Tensor:
    """fp32 1 / normalizer, the factor of the loss gradient; 0 for a normalizer of 0.

    A step without targets (every label ignored, e.g. prompt-only samples) has a normalizer of 0.
    Its loss sum is 0 and so is the gradient of every token: transformers' stock loss gives a zero
    gradient there, while 0 * (1 / 0) is NaN, which the optimizer would write into every weight.
    """
    norm = normalizer.float()
    return torch.where(norm == 0, 0.0, 1.0 / norm)


class _Normalize(torch.autograd.Function):
    """loss_sum / normalizer (0 / 0 = NaN without targets, as transformers' loss gives), with the
    gradient scaled by `gradient_scale` (zero without targets)."""

    @staticmethod
    def forward(ctx, loss_sum, normalizer):
        norm = normalizer.to(device=loss_sum.device, dtype=torch.float32)
        ctx.save_for_backward(gradient_scale(norm))
        return loss_sum / norm

    @staticmethod
    def backward(ctx, grad_loss):
        (scale,) = ctx.saved_tensors
        return grad_loss * scale, None


def normalize(loss_sum: torch.Tensor, normalizer: torch.Tensor) -> torch.Tensor:
    """The loss from a differentiable loss sum and its `loss_normalizer`: value loss_sum / normalizer,
    gradient finite (zero) when the normalizer is 0."""
    return _Normalize.apply(loss_sum, normalizer)


def _chunk_step(hidden, weight, bias, targets, valid, factor, with_grad):
    """(loss sum, `factor` x d(loss sum)/d(logits) or None) of one chunk; the gradient is fp32 [c, V]."""
    logits = F.linear(hidden, weight, bias).float()
    lse = torch.logsumexp(logits, dim=-1)
    target_logit = logits.gather(1, targets[:, None]).squeeze(1)
    loss_sum = torch.where(valid, lse - target_logit, 0.0).sum()
    if not with_grad:
        return loss_sum, None
    # (softmax - onehot(target)) * valid * factor, built in place over the logits buffer.
    grad = logits.sub_(lse[:, None]).exp_()
    grad.scatter_add_(1, targets[:, None], grad.new_full((grad.shape[0], 1), -1.0))
    grad.mul_((valid.to(grad.dtype) * factor)[:, None])
    return loss_sum, grad


# fp16 spans 2^-24 to 65504 (bf16 and fp32 reach 1e-38 and 3e38). Its gradients are computed and held in forward at a
# power-of-two scale that keeps them below 2^15 (`_saved_scale`, `_held`) and rescaled in backward.
_FP16_CEILING_BITS = 15


def _power_of_two_below_ceiling(bound: torch.Tensor, most: int = _FP16_CEILING_BITS) -> torch.Tensor:
    """The largest power of two s <= 2^most with s x bound < 2^15 (fp32, 0-d; bound >= 0), without a host read."""
    exponent = torch.frexp(bound.float()).exponent  # bound < 2^exponent
    return torch.ldexp(torch.ones((), device=bound.device), (_FP16_CEILING_BITS - exponent).clamp(max=most))


def _abs_max(x: torch.Tensor) -> torch.Tensor:
    """max |x| (fp32, 0-d) without an |x| copy of the tensor (the head's weight, the weight-gradient accumulator)."""
    if not x.numel():  # (no tokens)
        return torch.zeros((), device=x.device)
    low, high = torch.aminmax(x)
    return torch.maximum(-low, high).float()


def _saved_scale(hidden, weight, chunk_size, inv_norm, need_w) -> tuple[torch.Tensor, torch.Tensor]:
    """(the factor of the gradients the forward computes, the factor backward then rescales them by besides the
    incoming gradient): (1 / normalizer, 1), or in fp16 (s, 1 / (normalizer x s)) with s the largest power of two that
    keeps every chunk's gradient (entries in [-1, 1], rows of L1 norm at most 2: input gradients at most 2 max|W|) and
    its products with the inputs (the hidden states' where the weight's gradient is computed) below 2^15. Normalized
    in forward, fp16 gradients (1 / normalizer is 1.5e-5 at 64K tokens) times probabilities flushed to zero below 6e-8,
    before backward scaled them by fp16 training's loss scale, which keeps the stock loss's gradients of its fp32
    logits within fp16's range."""
    if hidden.dtype != torch.float16:
        return inv_norm, torch.ones_like(inv_norm)
    bound = 2 * _abs_max(weight)
    if need_w:
        bound = torch.maximum(bound, min(chunk_size, hidden.shape[0]) * _abs_max(hidden))
    scale = _power_of_two_below_ceiling(bound)
    return scale, inv_norm / scale


def _held(grad: torch.Tensor | None, dtype: torch.dtype | None, device: torch.device
          ) -> tuple[torch.Tensor | None, torch.Tensor]:
    """A summed gradient in `dtype` to hold until backward, and the power of two it was scaled by (fp16: below 2^15,
    so that a sum over many chunks neither overflows nor flushes to zero; else 1)."""
    if grad is None or dtype != torch.float16:
        return (None if grad is None else grad.to(dtype)), torch.ones((), device=device)
    scale = _power_of_two_below_ceiling(_abs_max(grad), most=100)  # (fp32 reaches 2^127)
    return grad.mul_(scale).to(dtype), scale  # (the accumulator is not used again)


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, normalizer, ignore_index, chunk_size, with_grad):
        need_h, need_w, need_b = (with_grad and n for n in ctx.needs_input_grad[:3])
        valid = labels != ignore_index
        targets = torch.where(valid, labels, 0)  # ignored rows gather a dummy logit and are masked out
        norm = normalizer.to(device=hidden.device, dtype=torch.float32)
        inv_norm = gradient_scale(norm)
        grad_h = torch.empty_like(hidden) if need_h else None
        # The weight and bias gradients sum over all chunks: accumulate them in fp32, or in the weight's own dtype
        # where it is wider (fp64: summed in fp32, the chunks' order would change them at fp32's rounding).
        acc = torch.promote_types(weight.dtype, torch.float32)
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        grad_b = torch.zeros(bias.shape, dtype=acc, device=bias.device) if need_b else None
        loss_sum = torch.zeros((), dtype=torch.float32, device=hidden.device)
        factor, rescale = _saved_scale(hidden, weight, chunk_size, inv_norm, need_w)
        for start in range(0, hidden.shape[0], chunk_size):
            rows = slice(start, start + chunk_size)
            h = hidden[rows]
            part, grad = _chunk_step(h, weight, bias, targets[rows], valid[rows], factor, need_h or need_w or need_b)
            loss_sum += part
            if grad is None:
                continue
            if grad_b is not None:
                grad_b += grad.sum(0, dtype=acc)
            grad = grad.to(hidden.dtype)  # same rounding as autograd through `logits.float()`
            if grad_h is not None:
                torch.mm(grad, weight, out=grad_h[rows])
            if grad_w is not None:
                if grad.dtype == acc:
                    grad_w.addmm_(grad.t(), h)
                else:
                    grad_w += grad.t() @ h
        # Hold the summed weight/bias gradients in the parameter dtype until backward (fp16: scaled, `_held`).
        grad_w, w_scale = _held(grad_w, weight.dtype, hidden.device)
        grad_b, b_scale = _held(grad_b, None if bias is None else bias.dtype, hidden.device)
        ctx.save_for_backward(grad_h, grad_w, grad_b, rescale / torch.stack([torch.ones_like(w_scale), w_scale,
                                                                             b_scale]))
        return loss_sum / norm  # NaN without targets, like transformers' loss; the gradients above are 0

    @staticmethod
    def backward(ctx, grad_loss):
        *grads, rescale = ctx.saved_tensors
        factors = grad_loss.float() * rescale  # each held gradient's factor (fp32), 1 for the usual grad_loss of 1
        if torch.compiler.is_compiling():  # (a host read would break the graph: --torch_compile warned at each one)
            return (*(None if g is None else (g.float() * f).to(g.dtype) for g, f in zip(grads, factors)),
                    None, None, None, None, None)
        # One host read per step (as in liger-kernel): scaling by exactly 1, the usual case, is skipped,
        # and any other factor is applied as a Python scalar so bf16 gradients are scaled in fp32.
        grads = tuple(g if g is None or f == 1.0 else g * f for g, f in zip(grads, factors.tolist()))
        return (*grads, None, None, None, None, None)


def compute_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype the loss computes its logits in: autocast's where it is on for `hidden`'s device (the Trainer's
    mixed precision), else the weight's."""
    device_type = hidden.device.type
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else weight.dtype


def chunked_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    num_items_in_batch: torch.Tensor | int | None = None,
    ignore_index: int = -100,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Cross-entropy of `hidden @ weight.T + bias` against `labels`, without materializing the logits.

    Args:
        hidden: [N, H]; weight: [V, H]; bias: [V] or None.
        labels: [N] integer targets (already shifted for causal LM); `ignore_index` marks tokens
            without a target.
        num_items_in_batch: transformers' gradient-accumulation-aware normalizer, or None.
        chunk_size: tokens per chunk (default: `default_chunk_size`).

    Returns:
        The fp32 loss sum divided by `num_items_in_batch` when given, else the mean over
        non-ignored tokens: the value of transformers' `ForCausalLMLoss` on the same logits
        (NaN = 0 / 0 for a batch without targets and a normalizer of 0, as there).
        Gradients w.r.t. hidden, weight and bias are exact (zero, not NaN, without targets); they are
        computed during forward, one chunk at a time, with fp32 logsumexp and fp32 accumulation of the
        weight gradient (fp64 for fp64 weights). Under autocast, inputs are cast to the autocast dtype.
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"hidden must be [N, H] and weight [V, H] with the same H; got hidden {tuple(hidden.shape)}, weight "
            f"{tuple(weight.shape)}. Flatten batch and sequence dimensions first (hidden.reshape(-1, H))."
        )
    if labels.shape != hidden.shape[:1]:
        raise ValueError(
            f"labels must be [N] = [{hidden.shape[0]}] (one target per hidden row); got {tuple(labels.shape)}."
        )
    if bias is not None and bias.shape != weight.shape[:1]:
        raise ValueError(f"bias must be [V] = [{weight.shape[0]}]; got {tuple(bias.shape)}.")
    if labels.dtype.is_floating_point or labels.dtype == torch.bool:
        raise ValueError(f"labels must hold integer class indices; got dtype {labels.dtype}.")
    if chunk_size is None:
        chunk_size = default_chunk_size(hidden.shape[0], weight.shape[0])
    elif chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size} must be >= 1 (or None for the default).")

    dtype = compute_dtype(hidden, weight)
    hidden, weight = hidden.to(dtype), weight.to(dtype)
    bias = None if bias is None else bias.to(dtype)
    labels = labels.to(hidden.device)
    normalizer = loss_normalizer(labels, num_items_in_batch, ignore_index)
    with_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (hidden, weight, bias)
    )
    with torch.autocast(hidden.device.type, enabled=False):
        return _ChunkedLinearCrossEntropy.apply(
            hidden, weight, bias, labels, normalizer, ignore_index, chunk_size, with_grad
        )
