"""The document planner's cost model: the kinds of a row's runs, the weights of its work per rank (`PlannerCosts`),
and every block's estimated attention work and tokens (`_Blocks`), in attention token pairs (one query against one
key: 4 x heads x head_dim FLOPs forward), so that they do not depend on the block size."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np

from ...config import SparseAttentionConfig

PAD, DENSE, SPARSE = "pad", "dense", "sparse"

# The attention kernel's FLOP/s on the pairs it computes over the matrix products': a token pair costs more time
# than its FLOPs' share of the linear layers. About 0.4: our kernels' 284 TFLOP/s on the computed pairs (H100,
# 128K, 5% kept; 299 on an H200) over the 753 TFLOP/s the cluster simulator's H100 calibration gives the linear
# layers and LM head (liger-kernel steps of Qwen2.5-0.5B/1.5B). benchmarks/bench_attention.py measures both rates on
# one GPU (its `rate_shares`: ours over an MLP product's, forward + backward): on an H200 (2026-12-04, 128K, head_dim
# 128) 0.43 on a 5%-kept layout, 0.52 on an estimated one (20% kept), 0.56 dense, over the product's 685 TFLOP/s; one
# GPU's figures, within 0.4 to 0.56, so the constant stays until more GPUs are measured.
ATTENTION_RATE_SHARE = 0.4


def linear_weight(flop_pairs: float) -> float:
    """The planner's `linear_per_token` for linear work per token of `flop_pairs` attention token pairs in FLOPs
    (2 x weights / (4 x heads x head_dim)): in time, at `ATTENTION_RATE_SHARE`."""
    return ATTENTION_RATE_SHARE * flop_pairs


@dataclass(frozen=True)
class PlannerCosts:
    """Weights of the planner's cost model, in attention token pairs (one query against one key:
    4 x heads x head_dim FLOPs forward), so that they do not depend on the block size."""

    linear_per_token: float = field(
        default=9000.0,
        metadata={"help": "Work of the linear layers (projections, MLP, a layer's share of the LM head) per token, "
                  "in attention token pairs: 2 x (weights per layer) / (4 x heads x head_dim) in FLOPs, in time "
                  "(`linear_weight`): about 4,600 for Qwen2.5-0.5B and 14,100 for Qwen2.5-7B. Training counts it "
                  "from the model (`integration.planner_weights`); this default serves where none is counted."},
    )
    comm_per_token: float = field(
        default=300.0,
        metadata={"help": "Cost of receiving one token's K/V, in attention token pairs: its bytes over the link's "
                  "bandwidth, in the time the GPU computes that many pairs (about 300 for Qwen2.5-0.5B over "
                  "NVLink, a few times more across nodes)."},
    )
    balance_slack: float = field(
        default=0.02,
        metadata={"help": "Imbalance accepted to save traffic or ring time: a cut between ranks within this "
                  "fraction of a rank's work of a document's start moves to it, keeping the document whole; of the "
                  "plans whose busiest rank is within it of the best, the one with the quickest ring wins."},
    )
    max_token_ratio: float = field(
        default=1.25,
        metadata={"help": "Most tokens a rank may hold in its blocks (a document's last block counted whole), as a "
                  "multiple of the mean, plus one block (activation memory)."},
    )
    extra_splits: int = field(
        default=8,
        metadata={"help": "Numbers of documents cut tried one by one beyond those that must be cut; past them the "
                  "sweep grows by a quarter per try, up to every document, and stops once the ranks are balanced."},
    )
    ring_share: float = field(
        default=0.5,
        metadata={"help": "A document with at least this share of the row's work is split over the whole ring "
                  "(striped, or head-tail if dense), so that every ring step gets an equal share of it; smaller "
                  "ones are split, if at all, over a few consecutive ranks."},
    )


def kept_blocks_per_row(cfg: SparseAttentionConfig) -> int | None:
    """An upper estimate of the key blocks a query block row of a sparse document lists: the local
    window, the block diagonals its kept diagonals cross and the columns (the budget's most and the
    sinks); None where the budget bounds no diagonals or no columns (every causal block may be kept)."""
    bs, budget = cfg.block_size, cfg.budget
    diagonals, columns = budget.most_diagonal_blocks(bs), budget.most_kept("columns")
    if diagonals is None or columns is None:
        return None
    return 1 + -(-cfg.local_window // bs) + diagonals + -(-(columns + cfg.sink_tokens) // bs)


def _block_costs(lengths: np.ndarray, kinds: list[str], kept_per_row: int | None, bs: int
                 ) -> tuple[np.ndarray, np.ndarray]:
    """(attention work, tokens) of every block of the documents `lengths`, in order: a query block row's
    attention is its causal key blocks, capped at `kept_per_row` for a sparse document, of bs^2 token pairs
    each (0 for padding)."""
    nb = -(-lengths // bs)
    first = np.repeat(np.cumsum(nb) - nb, nb)
    row = np.arange(int(nb.sum())) - first
    cap = np.array([kept_per_row if k == SPARSE and kept_per_row else np.iinfo(np.int64).max for k in kinds])
    tokens = np.full(row.size, float(bs))
    tokens[np.cumsum(nb) - 1] = lengths - (nb - 1) * bs
    attention = np.minimum(row + 1, np.repeat(cap, nb)) * float(bs * bs)
    attention[np.repeat(np.array([k == PAD for k in kinds]), nb)] = 0.0
    return attention, tokens


@dataclass
class _Blocks:
    """Every document's blocks in row order: their `work` (attention + `linear_per_token` per token),
    `attention` and `tokens` (`_block_costs`), document i holding blocks first[i]:first[i + 1] (flat arrays:
    the planner runs every step, and a thousand per-document arrays cost more than the plan)."""

    work: np.ndarray
    attention: np.ndarray
    tokens: np.ndarray
    first: np.ndarray

    @classmethod
    def of_row(cls, lengths, kinds, kept_per_row: int | None, bs: int, costs: PlannerCosts) -> _Blocks:
        n = np.array(lengths)
        attention, tokens = _block_costs(n, kinds, kept_per_row, bs)
        return cls(attention + costs.linear_per_token * tokens, attention, tokens,
                   np.concatenate([[0], np.cumsum(-(-n // bs))]))

    @functools.cached_property
    def document_attention(self) -> np.ndarray:
        """Estimated attention work of each document (token pairs)."""
        return np.add.reduceat(self.attention, self.first[:-1])

    def document_work(self) -> list[float]:
        """Estimated work of each document (attention + linear, token pairs)."""
        return np.add.reduceat(self.work, self.first[:-1]).tolist()

    def rotation(self, w: int) -> np.ndarray:
        """The rank each document's stripe starts on: where the blocks before it leave the rotation."""
        return self.first[:-1] % w

    def of(self, docs: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """(work, tokens) of the blocks of `docs`, laid out in that order."""
        picks = [slice(self.first[i], self.first[i + 1]) for i in docs]
        return np.concatenate([self.work[p] for p in picks]), np.concatenate([self.tokens[p] for p in picks])


__all__ = ["ATTENTION_RATE_SHARE", "DENSE", "PAD", "PlannerCosts", "SPARSE", "kept_blocks_per_row", "linear_weight"]
