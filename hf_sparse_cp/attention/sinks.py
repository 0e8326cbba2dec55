"""Learned attention sinks (GPT-OSS, DeepSeek-V4, GraniteSWA, ...: the `s_aux` their layers pass): one extra logit
`sinks[h]` per query head in the softmax's denominator, with no value. With Z = sum_j exp(s_ij) over the keys a query
sees and lse = log Z, its output is

    out_sink = sum_j exp(s_ij) v_j / (Z + exp(sinks[h])) = out * sigmoid(lse - sinks[h]),

applied once to the final out and lse of a call (after a ring's merge: the sink joins the denominator once per
query, not once per key set). Differentiable in out, lse (so q, k, v through the op's lse gradient) and the sinks;
it does not change which keys a query sees, so the pattern is estimated without it."""

from __future__ import annotations

import torch


def sink_shape_error(sinks: torch.Tensor, heads: int) -> str | None:
    """What `sinks` is if not one logit per query head of a call with `heads` query heads (the words of a refusal),
    or None."""
    if sinks.dim() == 1 and sinks.shape[0] == heads:
        return None
    return (f"learned attention sinks of shape {list(sinks.shape)} (it computes one sink logit per query head, shape "
            f"[{heads}], as GPT-OSS and DeepSeek-V4 pass them)")


def with_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """out [B, H, S, D] of a call whose queries' log-sum-exp is lse [B, H, S] (compute dtype), normalised with the
    per-head sink logits `sinks` [H] in the denominator, in out's dtype (computed in lse's); out itself without
    sinks. Queries that see no key (lse = -inf, out = 0) stay 0, with zero gradients."""
    if sinks is None:
        return out
    # sigmoid as exp(logsigmoid): sigmoid's backward, y * (1 - y), loses 1 - y to rounding where the sink's share
    # exp(sink - lse) is small (in fp32: 6% off at lse - sink = 16, 0 from 17.3 on); logsigmoid's backward computes
    # that share itself, exact to its last bits, as a softmax over the keys and the sink logit does
    kept = torch.exp(torch.nn.functional.logsigmoid(lse - sinks.to(lse.dtype)[:, None]))
    return (out.to(lse.dtype) * kept[..., None]).to(out.dtype)
