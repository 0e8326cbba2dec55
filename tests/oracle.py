"""Naive dense oracles for tests: full [S, S] score matrices in fp64 (small sizes only); tolerances;
and the Triton kernels called through the dispatching primitives (contract checks, layout unpacking)."""

import functools

import torch

from hf_sparse_cp import SparseAttentionConfig
from hf_sparse_cp.attention.estimate import EstimationSegment, row_entries, select_into
from hf_sparse_cp.attention.layout import SparseLayout, compact_sorted
from hf_sparse_cp.attention.ops import attention_backward, attention_forward
from hf_sparse_cp.attention.tokens import TokenMeta

kernel_forward = functools.partial(attention_forward, implementation="triton")
kernel_backward = functools.partial(attention_backward, implementation="triton")

TOLERANCE = {torch.float64: 1e-10, torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}


def visible(q_meta: TokenMeta, k_meta: TokenMeta, window=None) -> torch.Tensor:
    """[B, 1, Sq, Sk] visibility from token metadata."""
    qi, ki = q_meta.index[:, :, None], k_meta.index[:, None, :]
    qs, ks = q_meta.segment[:, :, None], k_meta.segment[:, None, :]
    vis = (ki <= qi) & (qs == ks) & (qs >= 0)
    if window is not None:
        vis &= qi - ki < window
    return vis[:, None]


def dense_attention(q, k, v, mask, scale=None):
    """fp64 (out, lse) of attention under a boolean [B, 1|H, Sq, Sk] mask; GQA by repetition."""
    g = q.shape[1] // k.shape[1]
    q, k, v = q.double(), k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = torch.einsum("bhqd,bhkd->bhqk", q, k) * scale
    s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.where(mask, torch.exp(s - lse[..., None].clamp_min(-1e300)), 0.0)
    return torch.einsum("bhqk,bhkd->bhqd", p, v), lse


def rel_rms(a, b, where=None):
    a, b = a.detach().double(), b.detach().double()
    if where is not None:
        a, b = a[where], b[where]
    return float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-30))


def key_range(layout: SparseLayout, lo: int, hi: int) -> SparseLayout:
    """The part of a layout inside keys [lo, hi) (lo a multiple of the block size; hi need not be,
    its partial last block is kept), re-indexed to those keys: what one ring step computes."""
    bs = layout.block_size
    kb = layout.block_idx.long()
    listed = torch.arange(kb.shape[-1], device=kb.device) < layout.block_cnt.unsqueeze(-1)
    block_idx, block_cnt = compact_sorted(kb - lo // bs, listed & (kb >= lo // bs) & (kb < -(-hi // bs)))
    col = layout.col_idx.long()
    listed = torch.arange(col.shape[-1], device=col.device) < layout.col_cnt.unsqueeze(-1)
    col_idx, col_cnt = compact_sorted(col - lo, listed & (col >= lo) & (col < hi))
    return SparseLayout(block_idx, block_cnt, col_idx, col_cnt, bs)


def data_parallel_grad_error(model, loss, ref_grads, world_size: int, *, fsdp2: bool) -> float:
    """The worst relative RMS error of a distributed step's gradients against one process's `ref_grads`:
    FSDP2's own reduction (`loss.backward()`, gradients gathered from the shards), or DDP's averaging
    (every rank's gradient of `loss` summed and divided by the world size). Collective."""
    import torch.distributed as dist

    worst = 0.0
    if fsdp2:
        loss.backward()
        for param, ref_grad in zip(model.parameters(), ref_grads):
            worst = max(worst, rel_rms(param.grad.full_tensor(), ref_grad))
        return worst
    for grad, ref_grad in zip(torch.autograd.grad(loss, list(model.parameters())), ref_grads):
        grad = grad.clone()
        dist.all_reduce(grad)
        worst = max(worst, rel_rms(grad / world_size, ref_grad))
    return worst



def column_rows_to_send(layout: SparseLayout, block_owner: torch.Tensor, rank: int) -> tuple[int, int]:
    """The fewest key-column rows a CP rank can send, counted one column slot at a time from the global layout
    (`block_owner`: the rank of every block): (forward: rows it holds, once to each other rank whose queries list
    them; backward: rows it lists and another rank holds, their dK/dV once to the holder)."""
    bs = layout.block_size
    pairs = set()  # (reader, token) with the token held elsewhere
    for b, h, qb, c in layout.valid_cols().nonzero().tolist():
        token = int(layout.col_idx[b, h, qb, c])
        if int(block_owner[qb]) != int(block_owner[token // bs]):
            pairs.add((int(block_owner[qb]), token))
    forward = sum(int(block_owner[token // bs]) == rank for _, token in pairs)
    return forward, sum(reader == rank for reader, _ in pairs)


def trained_under(trainer, cp_config) -> dict:
    """Train `trainer` with the plugin attached (sparse attention, `cp_config`), then detach it: the losses it
    logged and the update of the weights (flattened in parameter order)."""
    from hf_sparse_cp import SparseCPArguments, attach_to_trainer, detach_from_trainer

    initial = torch.cat([p.detach().flatten() for p in trainer.model.parameters()])
    attach_to_trainer(trainer, SparseCPArguments(sparse_attention=True), cp_config)
    trainer.train()
    result = {"logged": [log["loss"] for log in trainer.state.log_history if "loss" in log],
              "update": torch.cat([p.detach().flatten() for p in trainer.model.parameters()]) - initial}
    detach_from_trainer(trainer)
    return result


def select_vertical_slash(
    vertical: torch.Tensor, slash: torch.Tensor, docs: list[list[tuple[int, ...]]], cfg: SparseAttentionConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """Kept key columns and diagonal offsets ([B, H, S] bool each) from a batch's scores; docs: per row, its
    scored documents as (start, end), or (start, end, scored_end) when only the queries before scored_end
    scored it (a causal chunk); each is selected on its own, by the budget stage `estimate` runs (`select_into`)."""
    keep_v, keep_s = (torch.zeros_like(x, dtype=torch.bool) for x in (vertical, slash))
    for row, row_docs in enumerate(docs):
        for start, end, *scored_end in row_docs:
            select_into(keep_v[row], keep_s[row], cfg, *row_entries(cfg, vertical[row], slash[row], start, end),
                        EstimationSegment(start, (scored_end or [end])[0], start, end, 0))
    return keep_v, keep_s
