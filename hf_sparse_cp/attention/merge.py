"""Merging partial attention results computed over disjoint key sets.

Each ring step gives, for the local queries, the attention output over the keys it saw and the
log-sum-exp (LSE) of their scores. Two parts combine exactly as

    lse = log(exp(lse_a) + exp(lse_b)),  out = (exp(lse_a) out_a + exp(lse_b) out_b) / exp(lse)

evaluated relative to max(lse_a, lse_b) so that nothing overflows; a part that saw no key
(lse = -inf, out = 0) leaves the other unchanged. A NaN lse (non-finite inputs) is not "no key":
it makes the merged out and lse NaN. The merge is differentiable (the Flex engine's parts are merged
under autograd), with finite gradients for queries that saw nothing.
"""

from __future__ import annotations

import torch

from .precision import compute_dtype


def merge_attention(
    out: torch.Tensor, lse: torch.Tensor, out_part: torch.Tensor, lse_part: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine two partial attention results over disjoint key sets.

    Args:
        out, lse: one part, [..., S, D] and [..., S]; out_part, lse_part: the other part.
            A part whose queries saw no key (lse = -inf, out = 0) leaves the other unchanged; a
            NaN lse in either part gives NaN out and lse for that query.

    Returns:
        (out [..., S, D], lse [..., S]) of the union of the key sets, in the compute dtype (fp32 at
        least; fp64 when either part is fp64).
    """
    # (shapes that broadcast, e.g. a part of 1 head merged into 2, gave a result of the wrong queries silently)
    if out.shape != out_part.shape or lse.shape != lse_part.shape or out.shape[:-1] != lse.shape:
        raise ValueError(f"merge_attention takes two parts of the same queries: out and out_part [..., S, D], lse and "
                         f"lse_part [..., S]; got out {tuple(out.shape)}, lse {tuple(lse.shape)}, out_part "
                         f"{tuple(out_part.shape)}, lse_part {tuple(lse_part.shape)}.")
    dtype = compute_dtype(out.dtype, out_part.dtype)
    out, out_part = out.to(dtype), out_part.to(dtype)
    lse, lse_part = lse.to(dtype), lse_part.to(dtype)
    top = torch.maximum(lse, lse_part)  # NaN if either is NaN
    # Only -inf means that neither part saw a key. A NaN or +inf lse comes from non-finite inputs and
    # must stay non-finite: it flows through the arithmetic below (as NaN), never into the zero branch.
    empty = top == float("-inf")
    # Where neither part saw a key, subtract 0 instead of -inf (keeps -inf - -inf out of the way).
    ref = torch.where(empty, torch.zeros_like(top), top)
    w_a = torch.exp(lse - ref)
    w_b = torch.exp(lse_part - ref)
    # Where neither saw a key, divide by 1 instead of 0: unused there, and it keeps the gradient finite
    # (autograd differentiates both branches of a where).
    total = torch.where(empty, torch.ones_like(top), w_a + w_b)
    merged_lse = torch.where(empty, top, ref + torch.log(total))
    inv = torch.where(empty, torch.zeros_like(total), 1.0 / total)
    merged_out = (out * (w_a * inv).unsqueeze(-1)) + (out_part * (w_b * inv).unsqueeze(-1))
    return merged_out, merged_lse
