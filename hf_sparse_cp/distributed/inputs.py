"""How a batch becomes what a model forward under context parallelism takes.

Input preparation (once per batch, on every CP rank, with the same batch):
`prepare_context_parallel_inputs(inputs, parallel, block_size=...)` returns this rank's model
inputs (sharded input_ids, shift_labels, global position_ids) plus a `CPShard` under the key
`cp_shard`. transformers passes unknown keyword arguments of `model(**inputs)` down to the
attention function, so the `sparse_cp` backend receives the `CPShard` with q/k/v of its part of the
sequence and calls `modes.context_parallel_attention`, which runs the layer as the layout's mode shares it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ..attention.tokens import BatchDocumentExtents, TokenMeta
from ..config import SparseAttentionConfig
from .comm import all_reduce
from .modes import RING
from .shard import CP_SHARD_KWARG, CPShard
from .split.blocks import check_per_token_shapes, sequence_meta, shard_inputs, shift_labels
from .split.document_costs import PlannerCosts
from .split.document_runs import idle_documents_as_padding

if TYPE_CHECKING:
    from .mesh import ParallelDims


# Target keys whose agreement `check_same_batch` checks beside the tokens: the loss reads them, the document planner
# too (a padding document is one without targets), so ranks whose targets differ would mix losses or plan apart.
CHECKED_TARGET_KEYS = ("labels", "shift_labels")


def check_same_batch(inputs: Mapping[str, Any], parallel: ParallelDims) -> None:
    """Raise ValueError, naming the fix, unless every rank of the CP group holds the same batch (the same
    rows of tokens and the same targets, `CHECKED_TARGET_KEYS`; two tiny all-reduces)."""
    if parallel.cp_size == 1:
        return
    x = inputs.get("input_ids")
    parts = [batch_fingerprint(inputs["inputs_embeds"] if x is None else x)]
    for key in CHECKED_TARGET_KEYS:  # (a fixed size whatever keys a rank holds: the all-reduces must match)
        targets = inputs.get(key)
        present = isinstance(targets, torch.Tensor) and targets.dim() > 0 and targets.numel() > 0
        parts.append(batch_fingerprint(targets.reshape(targets.shape[0], -1)) if present
                     else torch.full_like(parts[0], -1.0))  # (a shape of -1: none holds it)
    fingerprint = torch.cat(parts)
    lo, hi = fingerprint.clone(), fingerprint.clone()
    all_reduce(lo, parallel.cp_group, "the check that the CP ranks hold the same batch", op=dist.ReduceOp.MIN)
    all_reduce(hi, parallel.cp_group, "the check that the CP ranks hold the same batch", op=dist.ReduceOp.MAX)
    if not torch.equal(lo, hi):
        raise ValueError(
            f"the ranks {list(parallel.cp_ranks)} of a context-parallel group hold different rows of tokens (or of "
            f"targets: {', '.join(CHECKED_TARGET_KEYS)}), and "
            "they must hold the same batch to split one sequence between them. Most likely each process built "
            "different training or evaluation data: build it identically on every process (seed it, e.g. "
            "torch.randint(..., generator=torch.Generator().manual_seed(0)), or load it from files), as the "
            "Trainer's data loader then hands every CP rank the same rows. Outside the Trainer, also shard the data "
            "over the data-parallel ranks only (num_replicas=dp_size, rank=dp_rank)."
        )


# Batch keys (by prefix) that feed a composite model's vision or audio towers: pixel_values(_videos),
# pixel_attention_mask, image_grid_thw, image_sizes, video_grid_thw, aspect_ratio_ids/_mask (Mllama),
# cross_attention_mask, input_features (audio), feature_attention_mask, second_per_grid_ts, spatial_shapes, ...
TOWER_INPUT_PREFIXES = ("pixel_", "image_", "video_", "audio_", "aspect_ratio_", "cross_attention_mask",
                        "input_features", "feature_attention_mask", "second_per_grid_ts", "spatial_shapes")
# Token types that mark the image or audio tokens of a sequence (non-zero there): Gemma 3's token_type_ids,
# Qwen-VL's mm_token_type_ids.
TOKEN_TYPE_KEYS = ("token_type_ids", "mm_token_type_ids")


def check_text_only(inputs: Mapping[str, Any], *, token_types: bool = False) -> None:
    """Raise ValueError, naming the key and the fix, for a batch that carries a vision or audio tower's inputs
    (`TOWER_INPUT_PREFIXES`), or with `token_types` (a composite model's batch, read on the host) token types marking
    image or audio tokens (a non-zero `TOKEN_TYPE_KEYS` entry). Under context parallelism each rank holds a shard of
    the tokens, while the towers' inputs and the places of their outputs in the sequence are the whole batch's: every
    rank of the group, holding the same batch, refuses it here, before any collective."""
    if not isinstance(inputs, Mapping):
        return
    keys = [k for k, v in inputs.items() if v is not None and isinstance(k, str) and k.startswith(TOWER_INPUT_PREFIXES)]
    if token_types:
        keys += [k for k in TOKEN_TYPE_KEYS if isinstance(v := inputs.get(k), torch.Tensor) and bool(v.any())]
    if keys:
        raise ValueError(
            f"the batch carries {', '.join(keys)}: inputs of the model's vision or audio towers (or token types "
            "marking their tokens), which context parallelism does not split: each rank holds a shard of the "
            "tokens, while the towers' inputs and the places of their outputs in the sequence are the whole batch's. "
            "Under context parallelism a vision-language model trains on text-only batches (drop the images from the "
            "data, or tokenize with the tokenizer rather than the processor); train on images without context "
            "parallelism (--cp_size 1; sparse attention then runs in its language model, the towers keep their own "
            "attention).")


# Elements of `x` one step of `batch_fingerprint` widens to float64 (bounds its transient memory).
FINGERPRINT_ELEMENTS = 1 << 22


def batch_fingerprint(x: torch.Tensor) -> torch.Tensor:
    """float64 [4] on x's device: the shape of a batch's input_ids [B, S] or inputs_embeds [B, S, ...] and the sum of
    its tokens (an embedding: the sum of its elements) each times a seeded random weight, the same on every rank:
    weights by position alone (the same in every row) summed rows swapped, or a position's tokens swapped between
    rows, to the same value. Embeddings are widened a slice of tokens at a time: B x S x hidden float64 numbers at
    once would be four times a bf16 inputs_embeds (a [1, 1M, 4096] batch: 32 GiB). Finite however non-finite the
    embeddings: a NaN (or inf - inf) sum would be unequal to itself, and the same batch refused as another."""
    rows = x.reshape(x.shape[0] * x.shape[1], -1)
    step = max(1, FINGERPRINT_ELEMENTS // max(1, rows.shape[1]))
    flat = torch.cat([rows[i:i + step].double().sum(-1) for i in range(0, rows.shape[0], step)])
    flat = flat.nan_to_num(nan=-0.5, posinf=1e300, neginf=-1e300)  # (a token's: finite, its sign kept)
    weights = torch.rand(flat.numel(), generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    shape = [float(n) for n in (*x.shape[:2], x.numel())]
    total = (flat * weights.to(x.device)).sum().nan_to_num(nan=0.5).view(1)  # (on the device: no host read)
    return torch.cat([torch.tensor(shape, device=x.device, dtype=torch.float64), total])


def planned_meta(inputs: Mapping[str, Any], meta: TokenMeta, sharding: str, pad_token_id: int, ignore_index: int
                 ) -> TokenMeta:
    """The documents the split is planned from: for the document planner, the batch's `meta` with its documents of
    padding tokens without targets marked idle, padding to the planner (`document_runs.idle_documents_as_padding`,
    on the host), where the batch has the input_ids and the labels of every position to tell; else `meta`."""
    if sharding != "document":
        return meta
    ids, labels, shifted = inputs.get("input_ids"), inputs.get("labels"), inputs.get("shift_labels")
    if shifted is None and labels is not None:
        shifted = shift_labels(labels, ignore_index)
    if ids is None or shifted is None or shifted.shape != ids.shape:
        return meta  # (labels of a logits_to_keep mask's positions only: [N])
    return idle_documents_as_padding(meta, ids, shifted, pad_token_id, ignore_index)


def without_padless_mask(inputs: Mapping[str, Any], ref: torch.Tensor) -> Mapping[str, Any]:
    """`inputs` without an attention_mask of one entry per token of `ref` (the [B, S] ids, or the embeddings) that pads
    none (one host read), as one process's attention calls get it: the mask function the backend registers
    (transformers' flash-attention one) hands them None for such a mask, so that restarting position_ids mark the
    documents. Kept, a mask of ones made the shards' documents the whole row, attended across the restarts that one
    process keeps apart. A mask of another shape is left to `sequence_meta`'s check."""
    mask = inputs.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.shape == ref.shape[:2] and bool(mask.all()):
        return {k: v for k, v in inputs.items() if k != "attention_mask"}
    return inputs


def prepare_context_parallel_inputs(
    inputs: Mapping[str, Any],
    parallel: ParallelDims,
    *,
    block_size: int,
    sharding: str | None = None,
    pad_token_id: int = 0,
    ignore_index: int = -100,
    verify_same_batch: bool = True,
    sparse_config: SparseAttentionConfig | None = None,
    planner_costs: PlannerCosts | None = None,
) -> dict[str, Any]:
    """This rank's model inputs for a batch that every rank of the CP group received.

    Args:
        inputs: the full batch (input_ids or inputs_embeds [B, S, ...], labels, position_ids,
            attention_mask, cu_seq_lens_* of flattened packing), the same on every CP rank.
        parallel: the parallel dimensions (CP group, rank, sharding).
        block_size: the attention layout's block size (`SparseAttentionConfig.block_size`).
        sharding: 'striped', 'zigzag', 'contiguous' or 'document' (default: `parallel.sharding`), as the
            layout's mode takes it (`CPMode.split`): the ring's split of the sequence ('document' plans it from the
            batch's documents, `documents.plan_row`), cut into contiguous pieces for head groups (`NestedSplit`).
        pad_token_id, ignore_index: what fills the padding of ids and targets.
        verify_same_batch: check (two tiny all-reduces) that every CP rank holds the same batch.
        sparse_config: the model's pattern settings, which tell the 'document' planner which documents
            are sparse (default: `SparseAttentionConfig(block_size=block_size)`).
        planner_costs: the 'document' planner's weights (default: `parallel.planner_costs`, from
            the --cp_planner_* flags, else `PlannerCosts()`).

    Returns:
        The model inputs of this rank: input_ids (or inputs_embeds), `shift_labels` (labels shifted
        before sharding) and sharded `labels` (so stock forwards compute a loss), global
        position_ids, each [B, plan.local_len] (multimodal RoPE's position_ids [R, B, plan.local_len], their documents
        by `tokens.packing_positions`); the attention mask and packing keys go into the
        `CPShard` under `cp_shard`. The sequence is padded to whole blocks per rank, never truncated.
        A stock forward's loss on them is this rank's mean over its own targets (NaN on a shard without
        any); the batch's loss is `rank_loss(model(**inputs, num_items_in_batch=1).loss,
        global_num_items(inputs["shift_labels"]), ranks averaging gradients)` (`distributed.loss`).
    """
    check_text_only(inputs)  # (keys only: no host read of the device's tensors)
    ref = inputs.get("input_ids")
    ref = inputs.get("inputs_embeds") if ref is None else ref
    if ref is None:
        raise ValueError("context-parallel inputs need `input_ids` (or `inputs_embeds`).")
    check_per_token_shapes(inputs)  # (shapes only, before the collectives: every rank of one batch refuses it alike)
    if verify_same_batch:
        check_same_batch(inputs, parallel)
    if sparse_config is None:
        sparse_config = SparseAttentionConfig(block_size=block_size)
    elif sparse_config.block_size != block_size:
        raise ValueError(
            f"sparse_config.block_size={sparse_config.block_size} differs from block_size={block_size}: the "
            "sequence is sharded in the layout's blocks, so pass the model's config and its block_size."
        )
    inputs = without_padless_mask(inputs, ref)
    meta = sequence_meta(inputs)
    mode = parallel.mode or RING  # one process (`ParallelDims.single`): a ring of one rank
    sharding = sharding or parallel.sharding
    planned = planned_meta(inputs, meta, sharding, pad_token_id, ignore_index)
    plan = mode.split(parallel, sharding, block_size, planned, sparse_config=sparse_config,
                      planner_costs=planner_costs or parallel.planner_costs or PlannerCosts())
    out = shard_inputs(inputs, plan, parallel.cp_rank, pad_token_id=pad_token_id, ignore_index=ignore_index)
    documents = BatchDocumentExtents(meta, inputs.get("attention_mask"), dict(inputs))
    positions = inputs.get("position_ids")
    by_positions = (inputs.get("cu_seq_lens_k") is None and inputs.get("attention_mask") is None
                    and positions is not None and positions.dim() <= 2 and any(len(row) > 1 for row in meta.documents))
    out[CP_SHARD_KWARG] = CPShard(parallel, plan, plan.global_meta(meta), documents, inputs.get("attention_mask"),
                                  by_positions, inputs.get("input_ids"))
    return out
