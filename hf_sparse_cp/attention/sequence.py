"""Sparse attention of whole sequences in one process: what the backend runs without context
parallelism, and what every rank runs on the whole sequence of its heads under head parallelism."""

from __future__ import annotations

import math

import torch

from ..config import SparseAttentionConfig
from .build import dense_layout, with_padding_query_blocks
from .dense import dense_backend, flash_dense_attention, sdpa_dense_attention
from .estimate import estimate_layout, pattern_documents
from .layout import SparseLayout
from .ops import block_sparse_attention
from .sinks import with_sinks
from .tokens import TokenMeta, padding_queries_see_prior_tokens


def sequence_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    meta: TokenMeta,
    cfg: SparseAttentionConfig,
    *,
    scale: float | None = None,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
    padding_rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's pattern estimated on the call's sequences, then exact attention over it (a dense
    call goes to flash-attn where it is installed, or to SDPA for plain causal rows: `dense`).

    Args:
        query: [B, Hq, S, D]; key, value: [B, Hkv, S, D] (after RoPE), Hq a multiple of Hkv.
        meta: the tokens' documents and padding [B, S]; cfg: the layer's pattern settings.
        scale: softmax scale (default 1 / sqrt(D)); sliding_window: the layer's window, or None.
        sinks: the layer's learned sink logits [Hq] (`sinks.with_sinks`), or None. A dense call with sinks runs
            the kernels over the dense layout: the dense libraries do not return the log-sum-exp the sinks need.
        padding_rows: bool [B], or None: the rows whose padding queries after their tokens attend to the tokens
            before them, as SDPA's do (`tokens.padding_queries_see_prior_tokens`), over the key blocks the row's last
            block of tokens attends to (`build.with_padding_query_blocks`): for a head whose loss reads them
            (`integration.heads`). The other padding queries get no attention (output 0, as flash-attn's), and the
            call then runs on the kernels (the dense libraries give padding queries nothing).

    Returns:
        (out [B, Hq, S, D], the kept fraction of attention blocks, of those a dense run of the batch computes:
        a 0-d float64 tensor, 1.0 for a dense call).
    """
    b, _, s, d = query.shape
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    docs = pattern_documents(cfg, meta, b, s, sliding_window)
    library = ("kernels" if any(docs) or sinks is not None or padding_rows is not None
               else dense_backend(query, key, meta, sliding_window))
    if library != "kernels":  # a dense call that a library kernel computes
        if library == "sdpa":
            out = sdpa_dense_attention(query, key, value, scale=scale)
        else:
            out = flash_dense_attention(query, key, value, meta, scale=scale, sliding_window=sliding_window)
        # (dense: every block a dense run of the batch computes)
        return out.transpose(1, 2), torch.ones((), dtype=torch.float64, device=query.device)
    layout = sequence_layout(query, key, meta, cfg, docs, scale=scale, sliding_window=sliding_window)
    q_meta, computed = meta, layout
    if padding_rows is not None:  # (the kept fraction counts the tokens' blocks, as without them)
        q_meta = padding_queries_see_prior_tokens(meta, padding_rows)
        computed = with_padding_query_blocks(layout, meta, q_meta)
    out, lse = block_sparse_attention(query, key, value, computed, scale=scale, q_meta=q_meta, k_meta=meta,
                                      sliding_window=sliding_window, check_layout=False,
                                      implementation=cfg.attention_engine)
    return with_sinks(out, lse, sinks), layout.kept_fraction(meta, sliding_window)


def sequence_layout(query: torch.Tensor, key: torch.Tensor, meta: TokenMeta, cfg: SparseAttentionConfig,
                    docs: list[list[tuple[int, int]]], *, scale: float, sliding_window: int | None = None
                    ) -> SparseLayout:
    """The layout of a call whose documents with a sparse pattern are `docs` (`estimate.pattern_documents`):
    estimated (without autograd) where there are any, else the batch's dense layout."""
    if any(docs):
        with torch.no_grad():
            return estimate_layout(query, key, cfg, meta, scale=scale, sliding_window=sliding_window, docs=docs)
    return dense_layout(meta, cfg.block_size, sliding_window)
