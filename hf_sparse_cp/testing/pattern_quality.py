"""How much of a model's dense attention a sparse pattern keeps, measured on its real q, k, v.

`capture_attention_inputs` runs one dense forward and records the q, k, v (after RoPE) of every layer
a sparse pattern applies to, as transformers hands them to an attention backend: sliding-window
layers (Gemma 3's local ones) are local already, the plugin keeps them exact, and the capture computes
them exactly over their window without keeping their inputs. `layer_quality` then estimates the layout a
`SparseAttentionConfig` chooses for that layer and compares the attention restricted to it with
dense attention, per query:

* mass recall: the share of the dense softmax mass on the kept keys, 1 when nothing is dropped;
* output error: |out_kept - out_dense| / |out_dense| (relative RMS over the queries of a group);
* kept fraction: computed blocks over the causal blocks (`SparseLayout.kept_fraction`).

Queries are reported in two groups: the last `last_q` (those that estimate the pattern, so they
see it at its best) and all earlier ones (which get a pattern chosen by later queries).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

from ..attention.build import dense_layout
from ..attention.estimate import estimate_layout, estimation_segments, layout_from_scores, pattern_documents, score_rows
from ..attention.layout import SparseLayout
from ..attention.ops import block_sparse_attention
from ..attention.scoring import Sampling
from ..attention.tokens import TokenMeta
from ..config import SparseAttentionConfig
from ..integration import upstream
from ..loss.chunked import chunked_linear_cross_entropy

CAPTURE_BACKEND = "hf_sparse_cp_capture"
FIXED_LAYOUT_BACKEND = "hf_sparse_cp_fixed_layouts"


# block size of the exact windowed attention of sliding-window layers during a capture
_WINDOW_BLOCK = 128


def _windowed(query, key, value, scale: float | None, window: int) -> torch.Tensor:
    """Exact causal attention inside a sliding window ([B, S, Hq, D], transformers' layout): the block
    reference over the dense windowed layout, which computes only the window's blocks."""
    meta = TokenMeta.contiguous(query.shape[0], query.shape[2], query.device)
    out, _ = block_sparse_attention(query, key, value, dense_layout(meta, _WINDOW_BLOCK, window), scale=scale,
                                    q_meta=meta, k_meta=meta, sliding_window=window)
    return out.transpose(1, 2).contiguous()


@contextlib.contextmanager
def _attention_backend(model: torch.nn.Module, name: str, attend) -> Iterator[None]:
    """Run `model` with `attend` registered as its attention backend `name` (unpadded rows: no mask built), and
    its own backend again afterwards."""
    previous = model.config._attn_implementation
    AttentionInterface.register(name, attend)
    AttentionMaskInterface.register(name, flash_attention_mask)
    try:
        model.set_attn_implementation(name)
        yield
    finally:
        model.set_attn_implementation(previous)
        upstream.unregister(AttentionInterface, name)
        upstream.unregister(AttentionMaskInterface, name)


@contextlib.contextmanager
def exact_dense(model: torch.nn.Module, store: dict[int, tuple] | None = None) -> Iterator[None]:
    """Run `model` with exact dense attention: causal SDPA on layers without a sliding window (recording their
    (q, k, v, scale) in `store` when given), and sliding-window layers exactly over their window (the block
    reference on the dense windowed layout, where SDPA with a mask would compute every pair of the sequence)."""

    def capture(module, query, key, value, attention_mask, dropout=0.0, scaling=None, sliding_window=None,
                **kwargs):
        if attention_mask is not None:
            raise ValueError("capturing attention inputs takes unpadded rows only (attention_mask must be None).")
        scale = 1.0 / math.sqrt(query.shape[-1]) if scaling is None else scaling
        if sliding_window is not None and sliding_window < query.shape[2]:
            return _windowed(query, key, value, scale, sliding_window), None
        if sliding_window is None and store is not None:
            store[module.layer_idx] = (query.detach(), key.detach(), value.detach(), scale)
        out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scale, enable_gqa=True)
        return out.transpose(1, 2).contiguous(), None

    with _attention_backend(model, CAPTURE_BACKEND, capture):
        yield


@contextlib.contextmanager
def fixed_layouts(model: torch.nn.Module, layouts: dict[int, SparseLayout]) -> Iterator[None]:
    """Run `model` with each layer's attention restricted to a given layout: layer i computes exact
    attention over `layouts[i]` ([1, Hq or 1, NQB, ...] of the call's length) through
    `block_sparse_attention`, as `sparse_cp` does with an estimated one; a sliding-window layer computes its
    window exactly (as `sparse_cp` does), any other layer without a layout refuses to run."""

    def attend(module, query, key, value, attention_mask, dropout=0.0, scaling=None, sliding_window=None,
               **kwargs):
        if attention_mask is not None or query.shape[0] != 1:
            raise ValueError("fixed layouts take one unpadded row (attention_mask must be None).")
        if sliding_window is not None:
            return _windowed(query, key, value, scaling, sliding_window), None
        layout = layouts.get(module.layer_idx)
        if layout is None:
            raise ValueError(f"no layout given for layer {module.layer_idx}.")
        out, _ = block_sparse_attention(query, key, value, layout, scale=scaling)
        return out.transpose(1, 2).contiguous(), None

    with _attention_backend(model, FIXED_LAYOUT_BACKEND, attend):
        yield


def global_layers(model: torch.nn.Module) -> list[int]:
    """The decoder layers a sparse pattern applies to: those without a sliding window (every layer of most
    models; Gemma 3's 'full_attention' ones)."""
    config = model.config.get_text_config()
    types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    return [i for i, kind in enumerate(types) if kind != "sliding_attention"]


@torch.no_grad()
def capture_attention_inputs(model: torch.nn.Module, input_ids: torch.Tensor) -> tuple[dict[int, tuple], torch.Tensor]:
    """The attention inputs of every layer without a sliding window (`global_layers`) in one dense forward of
    `input_ids` [1, S] (sliding-window layers computed exactly over their window).

    Returns:
        ({layer index: (q [1, Hq, S, D], k, v [1, Hkv, S, D], scale)}, the forward's mean next-token loss on the
        text, the log of its perplexity).
    """
    store: dict[int, tuple] = {}
    with exact_dense(model, store):
        loss = lm_loss(model, input_ids)
    return dict(sorted(store.items())), loss


def _kept(layout: SparseLayout, head: int, p: torch.Tensor, per_block: torch.Tensor, qb0: int):
    """Of dense probabilities p [R, r1] of whole query blocks qb0.. of one head (keys 0:r1, r1 = the
    chunk's end; per_block [NQB, bs, r1 / bs] their sums per key block): the mass on the keys `layout`
    lists per query [R], and the probabilities of those keys [R, r1] (the others zeroed)."""
    bs = layout.block_size
    lh = head if layout.heads > 1 else 0
    nqb, r1 = p.shape[0] // bs, p.shape[1]
    sl = slice(qb0, qb0 + nqb)
    blk, bcnt = layout.block_idx[0, lh, sl].long(), layout.block_cnt[0, lh, sl]
    col, ccnt = layout.col_idx[0, lh, sl].long(), layout.col_cnt[0, lh, sl]
    blk_ok = torch.arange(blk.shape[-1]) < bcnt.unsqueeze(-1)
    col_ok = torch.arange(col.shape[-1]) < ccnt.unsqueeze(-1)
    pq = p.view(nqb, bs, r1)
    mass = (per_block.gather(-1, blk.clamp_min(0).unsqueeze(1).expand(-1, bs, -1)) * blk_ok.unsqueeze(1)).sum(-1)
    mass += (pq.gather(-1, col.clamp_min(0).unsqueeze(1).expand(-1, bs, -1)) * col_ok.unsqueeze(1)).sum(-1)
    nkb = r1 // bs  # the listed key blocks as tokens, then the listed columns
    blocks = torch.zeros(nqb, nkb + 1, dtype=torch.bool).scatter_(-1, torch.where(blk_ok, blk, nkb), True)
    cols = torch.zeros(nqb, r1 + 1, dtype=torch.bool).scatter_(-1, torch.where(col_ok, col, r1), True)
    mask = blocks[:, :nkb].repeat_interleave(bs, dim=-1) | cols[:, :r1]
    return mass.flatten(), (pq * mask.unsqueeze(1)).view_as(p)


def _group_stats(recall: torch.Tensor, err_num: torch.Tensor, err_den: torch.Tensor) -> dict[str, float]:
    """Mean, 10th percentile and minimum of the recall of a group of (head, query) pairs, and the
    relative RMS output error over them."""
    flat = recall.flatten().double()
    return {"recall_mean": float(flat.mean()), "recall_p10": float(torch.quantile(flat, 0.1)),
            "recall_min": float(flat.min()), "output_rel_err": float((err_num.sum() / err_den.sum()).sqrt())}


def _layouts(q, k, scale: float, configs: dict[str, SparseAttentionConfig], meta: TokenMeta) -> dict[str, SparseLayout]:
    """Each config's layout, as `estimate_layout` builds it; the vertical-slash scores, which depend
    only on the estimation segments and the scoring queries (`Sampling`), are computed once for all configs
    that share them."""
    scores: dict[tuple, list] = {}
    out = {}
    for name, cfg in configs.items():
        docs = pattern_documents(cfg, meta, 1, q.shape[2])
        if not any(docs):
            out[name] = estimate_layout(q, k, cfg, meta, scale=scale, docs=docs)
            continue
        segments = estimation_segments(docs, cfg)
        key = (Sampling.of(cfg), str(segments))
        if key not in scores:
            scores[key] = score_rows(q, k, segments, cfg, scale)
        out[name] = layout_from_scores(meta, cfg, docs, scores[key])
    return out


@torch.no_grad()
def layer_quality(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    configs: dict[str, SparseAttentionConfig],
    *,
    rows_per_chunk: int = 128,
    query_chunks: int | None = None,
) -> dict[str, dict]:
    """What the layout each config picks for this layer keeps of the layer's dense attention.

    Dense probabilities are computed by chunks of `rows_per_chunk` query rows per head (a [rows, S]
    fp32 tile at a time, never [S, S]), and every config's kept keys are read from them.

    Args:
        q: [1, Hq, S, D]; k, v: [1, Hkv, S, D] (after RoPE); scale: softmax scale.
        configs: name -> the layer's pattern (`for_layer` applied; `min_seq_len` decides, as in
            training, whether the sequence is sparse). Their block sizes must divide rows_per_chunk and S.
        query_chunks: measure only this many chunks of rows, evenly spaced from the first to the
            last (which holds the estimation queries); None: every query.

    Returns:
        name -> {"kept_fraction", "block_width" (the layout's key-block slots per query block: the most any
        head's query block lists), "estimation": stats, "earlier": stats or None, "all": stats}; stats
        hold recall_mean, recall_p10, recall_min over the measured (head, query) pairs and
        output_rel_err, the relative RMS output error over them.
    """
    _, hq, s, _ = q.shape
    group = hq // k.shape[1]
    for name, cfg in configs.items():
        if rows_per_chunk % cfg.block_size or s % rows_per_chunk:
            raise ValueError(f"S={s} must be a multiple of rows_per_chunk={rows_per_chunk}, and that of {name}'s "
                             f"block_size {cfg.block_size}.")
    meta = TokenMeta.contiguous(1, s, q.device)
    layouts = _layouts(q, k, scale, configs, meta)
    n_chunks = s // rows_per_chunk
    chunks = range(n_chunks) if query_chunks is None else sorted(
        {round(i * (n_chunks - 1) / max(1, query_chunks - 1)) for i in range(query_chunks)})
    measured = torch.zeros(s, dtype=torch.bool)
    recall = {name: torch.zeros(hq, s) for name in configs}
    err_num = {name: torch.zeros(hq, s) for name in configs}
    err_den = torch.zeros(hq, s)
    block_sizes = {cfg.block_size for cfg in configs.values()}
    for c in chunks:
        r0, r1 = c * rows_per_chunk, (c + 1) * rows_per_chunk
        measured[r0:r1] = True
        causal = torch.arange(r1) > torch.arange(r0, r1).unsqueeze(1)
        for h in range(hq):
            kh, vh = k[0, h // group, :r1].float(), v[0, h // group, :r1].float()
            p = torch.softmax(((q[0, h, r0:r1].float() @ kh.T) * scale).masked_fill_(causal, float("-inf")), dim=-1)
            out_d = p @ vh
            err_den[h, r0:r1] = out_d.pow(2).sum(-1)
            per_block = {bs: p.view(-1, bs, r1 // bs, bs).sum(-1) for bs in block_sizes}
            for name, layout in layouts.items():
                bs = layout.block_size
                mass, kept = _kept(layout, h, p, per_block[bs], r0 // bs)
                recall[name][h, r0:r1] = mass
                err_num[name][h, r0:r1] = ((kept @ vh) / mass.unsqueeze(-1) - out_d).pow(2).sum(-1)
    result = {}
    for name, cfg in configs.items():
        est = torch.arange(s) >= s - min(cfg.scoring.last_q, s)
        groups = {"estimation": measured & est, "earlier": measured & ~est, "all": measured}
        result[name] = {"kept_fraction": float(layouts[name].kept_fraction(meta)),
                        "block_width": int(layouts[name].block_idx.shape[-1])}
        for group, rows in groups.items():
            result[name][group] = (_group_stats(recall[name][:, rows], err_num[name][:, rows], err_den[:, rows])
                                   if rows.any() else None)
    return result


@torch.no_grad()
def lm_loss(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """The model's mean next-token loss on `input_ids` [1, S], from the last hidden states through the output
    embedding in chunks (`chunked_linear_cross_entropy`): never the [S, vocab] logits (Gemma's 262,144-token
    vocabulary makes them 34 GB at 32K tokens). Models whose logits are not `lm_head(hidden)` (soft-capped) are
    refused."""
    if getattr(model.config.get_text_config(), "final_logit_softcapping", None) is not None:
        raise ValueError("lm_loss computes logits as lm_head(hidden); this model soft-caps them "
                         "(final_logit_softcapping): use model(input_ids, labels=input_ids).loss instead.")
    head = model.get_output_embeddings()
    hidden = model.get_decoder()(input_ids).last_hidden_state[0]
    return chunked_linear_cross_entropy(hidden[:-1], head.weight, input_ids[0, 1:].to(hidden.device),
                                        bias=getattr(head, "bias", None))


def perplexity(model: torch.nn.Module, input_ids: torch.Tensor) -> float:
    """exp of the model's mean next-token loss on `input_ids` [1, S] (`lm_loss`), with its attention as set."""
    return math.exp(float(lm_loss(model, input_ids)))


def dense_perplexity(model: torch.nn.Module, input_ids: torch.Tensor) -> float:
    """`perplexity` with exact dense attention (`exact_dense`)."""
    with exact_dense(model):
        return perplexity(model, input_ids)
