"""Per-token metadata that decides which (query, key) pairs may interact.

A pair is visible when the key is not after the query in the global sequence (causal), both
tokens belong to the same document, and the token is not padding. Sequence parallel shards
carry their tokens' global indices, so the same rule holds on every rank.

`token_meta_from_kwargs` derives the metadata of a batch from what transformers passes to an
attention function (packing by `cu_seq_lens_k` or restarting `position_ids`, the 2D padding mask).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy
import torch

PAD_SEGMENT = -1


@dataclass(frozen=True)
class TokenMeta:
    """Global order and document of each token of a [B, S] batch.

    index:   int64 [B, S], the token's position in the full (unsharded) packed sequence.
    segment: int32 [B, S], the document the token belongs to; `PAD_SEGMENT` (-1) marks padding.
    """

    index: torch.Tensor
    segment: torch.Tensor

    @cached_property
    def documents(self) -> list[list[tuple[int, int]]]:
        """`document_table(segment)`, read from the device once per metadata object: every layer of a forward
        shares the batch's metadata (the backend's `batch_token_meta`, a context-parallel shard's `meta`), so the
        batch's documents cost one host read per forward, not one per layer."""
        return document_table(self.segment)

    @classmethod
    def contiguous(cls, batch: int, seq_len: int, device: torch.device | str | None = None) -> TokenMeta:
        """One document per row, no padding."""
        index = torch.arange(seq_len, device=device).expand(batch, seq_len)
        return cls(index, torch.zeros(batch, seq_len, dtype=torch.int32, device=device))

    @classmethod
    def from_segments(cls, segment: torch.Tensor) -> TokenMeta:
        """Tokens in order, in the documents `segment` ([B, S] integers: a document id per token, `PAD_SEGMENT` for
        padding) gives."""
        # (fractions were truncated to other documents; [S] passed here and was refused later by its shape; whole
        # numbers in a floating tensor are taken, read on the host)
        if not isinstance(segment, torch.Tensor) or segment.dim() != 2 or segment.is_complex() or (
                segment.is_floating_point() and not bool((segment == segment.round()).all())):
            what = (f"a {tuple(segment.shape)} {segment.dtype} tensor" if isinstance(segment, torch.Tensor) else
                    type(segment).__name__)
            raise (ValueError if isinstance(segment, torch.Tensor) else TypeError)(
                f"TokenMeta.from_segments takes the document id of every token as an integer tensor [batch, seq] "
                f"({PAD_SEGMENT} for padding; one row: segment[None]); got {what}.")
        index = torch.arange(segment.shape[-1], device=segment.device).expand_as(segment)
        return cls(index, segment.to(torch.int32))

    def pad_to(self, length: int) -> TokenMeta:
        """Extend to `length` tokens with padding that no query can see and that sees nothing."""
        extra = length - self.index.shape[-1]
        if extra <= 0:
            return self
        big = torch.iinfo(torch.int64).max // 2
        b = self.index.shape[0]
        # int64 whatever index dtype came in: the padding's index does not fit an int32 one
        index = torch.cat(
            [self.index.long(), torch.full((b, extra), big, dtype=torch.int64, device=self.index.device)], 1
        )
        seg = torch.cat(
            [self.segment, torch.full((b, extra), PAD_SEGMENT, dtype=self.segment.dtype, device=self.segment.device)],
            1,
        )
        return TokenMeta(index, seg)

    def to(self, device: torch.device | str) -> TokenMeta:
        """This metadata with its tensors on `device`."""
        return TokenMeta(self.index.to(device), self.segment.to(device))


def segments_from_position_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """Document ids from position_ids that restart for every packed document ([B, S] -> int32 [B, S])."""
    new_doc = torch.ones_like(position_ids, dtype=torch.bool)
    new_doc[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    return new_doc.cumsum(dim=1).to(torch.int32) - 1


def packing_positions(position_ids: torch.Tensor | None) -> torch.Tensor | None:
    """The `position_ids` by which transformers' masks pack documents ([B, S], [1, S] or [S]): those given, or of
    multimodal RoPE's [R, B, S] (Qwen2-VL, Qwen3-VL, Qwen3.5: one row per rotary axis) the text row of [4, B, S] ones
    (row 0, which those models hand their mask and layers) and None for [3, B, S] ones (they pack none by them)."""
    if position_ids is None or position_ids.dim() <= 2:
        return position_ids
    return position_ids[0] if position_ids.dim() == 3 and position_ids.shape[0] == 4 else None


def check_position_shape(position_ids: torch.Tensor | None, batch: int, seq_len: int) -> None:
    """Raise ValueError unless `position_ids` (`packing_positions`'s) hold one position per token of a [batch, seq_len]
    call: one row per row of the batch, or one row for every row. Other rows ended in a torch broadcasting error from
    deep inside the call; another length was read as one document (documents are found where positions restart)."""
    if position_ids is None or position_ids.dim() > 2:
        return
    if position_ids.dim() == 0 or position_ids.shape[-1] != seq_len or (
            position_ids.dim() == 2 and position_ids.shape[0] not in (1, batch)):
        raise ValueError(f"position_ids has shape {tuple(position_ids.shape)} for a batch of {batch} rows of {seq_len} "
                         f"tokens: give one position per token, one row per row of the batch ([{batch}, {seq_len}]), "
                         f"or one row for all of them ([1, {seq_len}] or [{seq_len}]).")


def check_padding_mask(attention_mask: torch.Tensor | None, batch: int, seq_len: int) -> None:
    """Raise ValueError unless the 2D padding mask `attention_mask` has one entry per token of a [batch, seq_len] call.
    Of a longer mask, flash-attention's convention reads the last columns, transformers' SDPA and eager the first (or
    fail): no column choice matches them all, so none is made."""
    if attention_mask is not None and tuple(attention_mask.shape) != (batch, seq_len):
        raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)} for a batch of {batch} rows of "
                         f"{seq_len} tokens: where no KV cache holds earlier tokens, the 2D padding mask has one "
                         f"entry per token of the input; pass a mask of the input's length ([{batch}, {seq_len}]).")


def segments_from_cu_seqlens(cu_seqlens: torch.Tensor, batch: int, seq_len: int) -> torch.Tensor:
    """Document ids from cumulative sequence lengths (DataCollatorWithFlattening's `cu_seq_lens_k`).

    The flattened batch is one row of `seq_len` tokens; tokens past the last boundary are padding.
    """
    if batch != 1:
        raise ValueError(
            f"cu_seq_lens describe one flattened row, but the batch has {batch} rows; use "
            "DataCollatorWithFlattening, which packs the batch into a single row."
        )
    # (fractions were truncated; [1, N] ended in "only one element tensors can be converted to Python scalars")
    if cu_seqlens.dim() != 1 or cu_seqlens.is_complex() or (
            cu_seqlens.is_floating_point() and not bool((cu_seqlens == cu_seqlens.round()).all())):
        raise ValueError(f"cu_seq_lens must be a 1-D tensor of whole token offsets [0, ..., total] (as "
                         f"DataCollatorWithFlattening gives them); got a {tuple(cu_seqlens.shape)} {cu_seqlens.dtype} "
                         f"tensor {cu_seqlens.tolist()}.")
    cu = cu_seqlens.to(torch.int64)
    if cu.numel() < 2 or int(cu[0]) != 0 or bool((cu[1:] < cu[:-1]).any()) or int(cu[-1]) > seq_len:
        raise ValueError(f"cu_seq_lens must rise from 0 to at most the sequence length {seq_len}; got {cu.tolist()}.")
    pos = torch.arange(seq_len, device=cu.device)
    seg = torch.searchsorted(cu[1:], pos, right=True).to(torch.int32)
    seg[pos >= cu[-1]] = PAD_SEGMENT
    return seg.unsqueeze(0)


def apply_padding_mask(segment: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Mark the tokens where a 2D attention mask (of `segment`'s shape, `check_padding_mask`) is 0 as padding."""
    check_padding_mask(attention_mask, *segment.shape)
    return torch.where(attention_mask.bool(), segment, torch.full_like(segment, PAD_SEGMENT))


def padding_between_tokens(attention_mask: torch.Tensor | None) -> int | None:
    """The first row of a 2D padding mask [B, S] that pads between two of its tokens (a 0 after a 1 and before
    another 1: left padding after PEFT prompt tuning's virtual tokens), or None. Documents are runs of tokens
    (`run_starts`), so such padding would cut its document in two."""
    if attention_mask is None:
        return None
    real = attention_mask.bool()
    runs = (real[:, 1:] & ~real[:, :-1]).sum(-1) + real[:, 0]
    rows = (runs > 1).nonzero()
    return int(rows[0, 0]) if rows.numel() else None


def check_positions_inside_mask(attention_mask: torch.Tensor | None, inputs: Mapping[str, Any]) -> None:
    """Raise ValueError where a batch's `position_ids` restart between two neighbouring tokens of its 2D padding mask
    and no `cu_seq_lens_k` packs the row (`check_positions_within_documents`, one host read): packed documents that a
    padding mask makes one sequence, as SDPA and flash-attention read them, where without the mask (or with one of
    ones) they stay apart. For the batches context parallelism splits (`sequence_meta`); a forward's attention calls
    read such a row as SDPA does (through a cache, generate counts positions from a mask that SDPA reads otherwise).
    Positions of another shape are left to `check_position_shape`."""
    positions = packing_positions(inputs.get("position_ids"))
    if attention_mask is None or positions is None or inputs.get("cu_seq_lens_k") is not None:
        return
    batch, seq_len = attention_mask.shape
    if positions.dim() == 0 or positions.shape[-1] != seq_len or (
            positions.dim() == 2 and positions.shape[0] not in (1, batch)):
        return
    real = attention_mask.bool()
    segment = torch.where(real, 0, PAD_SEGMENT)
    check_positions_within_documents(segment, positions.to(real.device).expand(batch, seq_len), None)


def padding_queries_see_prior_tokens(meta: TokenMeta, rows: torch.Tensor | None = None) -> TokenMeta:
    """`meta` with every padding token after a real one in the document of the last real token before it, for use as
    the queries of a call: SDPA and eager mask padding keys only, so such a padding query attends to the real tokens
    before it, and the stock loss reads its logits where padding sits between a row's tokens (the last padding
    position predicts the first token after the gap), a question-answering head's wherever it sits (`heads.py`). Its
    key twin stays padding; padding before a row's first real token sees nothing (output 0, which no loss reads; eager
    spreads such a row over every key instead). `rows` (bool [B], optional): only those rows' padding, the others'
    stays padding."""
    segment = meta.segment
    position = torch.arange(segment.shape[-1], device=segment.device).expand_as(segment)
    last_real = torch.where(segment != PAD_SEGMENT, position, -1).cummax(dim=1).values
    seen = segment.gather(1, last_real.clamp_min(0)).masked_fill(last_real < 0, PAD_SEGMENT)
    if rows is not None:
        seen = torch.where(rows.to(segment.device)[:, None], seen, segment)
    return TokenMeta(meta.index, seen)


def rows_pad_after_tokens(meta: TokenMeta, rows: torch.Tensor) -> bool:
    """Whether one of `rows` (bool [B]) of `meta` has padding after its last real token, by its documents
    (`TokenMeta.documents`, read back once per metadata object) and one read of `rows`."""
    s = meta.segment.shape[-1]
    padded = [bool(docs) and docs[-1][1] < s for docs in meta.documents]
    return any(read and pad for read, pad in zip(rows.tolist(), padded))


def document_table(segment: torch.Tensor) -> list[list[tuple[int, int]]]:
    """(start, end) of the non-padding documents (runs of one segment id) of every row of [B, S] segment ids, read
    with one device-to-host copy of the segment ids (B x S int32) and found on the host."""
    b, s = segment.shape
    rows = [[] for _ in range(b)]
    if s == 0:
        return rows
    host = segment.cpu().numpy()
    starts = numpy.flatnonzero(numpy.concatenate([numpy.ones((b, 1), bool), host[:, 1:] != host[:, :-1]], 1))
    ids = host.reshape(-1)[starts]
    starts, ids = starts.tolist(), ids.tolist()
    for i, (pos, doc) in enumerate(zip(starts, ids)):
        row, start = divmod(pos, s)
        nxt = starts[i + 1] if i + 1 < len(starts) else b * s
        if doc != PAD_SEGMENT:
            rows[row].append((start, min(nxt - row * s, s)))
    return rows


def run_starts(segment: torch.Tensor) -> torch.Tensor:
    """bool [B, S]: the tokens that begin a run of one segment id in their row (documents and padding
    runs alike; every row's first token)."""
    first = torch.ones_like(segment, dtype=torch.bool)
    first[:, 1:] = segment[:, 1:] != segment[:, :-1]
    return first


def document_starts(meta: TokenMeta) -> torch.Tensor:
    """For every token, the global index of the first token of its document (int64 [B, S]).

    Assumes the tokens of a row are in global order with documents contiguous, as in a packed
    sequence or a contiguous shard of one.
    """
    start = torch.where(run_starts(meta.segment), meta.index, torch.zeros_like(meta.index))
    return torch.cummax(start, dim=1).values


def token_meta_from_kwargs(
    batch: int, seq_len: int, device: torch.device, attention_mask: torch.Tensor | None, kwargs: dict
) -> TokenMeta:
    """Documents and padding of a [batch, seq_len] batch from what transformers passes to attention.

    Args:
        batch, seq_len: the batch's shape; device: where the metadata is built.
        attention_mask: the 2D padding mask [B, seq_len] (`check_padding_mask`) or None.
        kwargs: the attention call's keyword arguments; `cu_seq_lens_k` (flattened packing, one row)
            or `position_ids` restarting per document mark the documents.

    Returns:
        `TokenMeta` [batch, seq_len] with local indices (0..seq_len-1) and padding marked.
    """
    cu = kwargs.get("cu_seq_lens_k")
    position_ids = packing_positions(kwargs.get("position_ids"))
    check_position_shape(position_ids, batch, seq_len)
    check_padding_mask(attention_mask, batch, seq_len)
    if cu is not None:
        cu_q = kwargs.get("cu_seq_lens_q")
        # (queries and keys are the same tokens: other query documents would be ignored, as the keys' pack them)
        if cu_q is not None and cu_q is not cu and not torch.equal(cu_q.to(cu.device, cu.dtype), cu):
            raise ValueError(f"cu_seq_lens_q {cu_q.tolist()} and cu_seq_lens_k {cu.tolist()} differ, but the queries "
                             "and keys of this call are the same tokens, packed into one set of documents: pass the "
                             "same boundaries in both (as DataCollatorWithFlattening does).")
        segment = segments_from_cu_seqlens(cu.to(device), batch, seq_len)
    elif attention_mask is None and position_ids is not None:
        segment = segments_from_position_ids(position_ids.to(device).expand(batch, seq_len))
    else:
        segment = torch.zeros(batch, seq_len, dtype=torch.int32, device=device)
    if attention_mask is not None:
        segment = apply_padding_mask(segment, attention_mask.to(device))
    if position_ids is not None and cu is not None:  # (with a mask alone: `check_positions_inside_mask`)
        check_positions_within_documents(segment, position_ids.to(device).expand(batch, seq_len), cu)
    return TokenMeta.from_segments(segment)


def check_positions_within_documents(segment: torch.Tensor, positions: torch.Tensor, cu: torch.Tensor | None) -> None:
    """Raise ValueError where `positions` ([B, S]) restart between two tokens of one document of `segment` (its
    documents from `cu_seq_lens_k`, given as `cu`, or, `cu` None, one per run of a padding mask's real tokens): the
    two describe other documents (one host read). flash-attention packs by cu_seq_lens, and attends across restarts
    inside a padding mask's run, as SDPA does, which packs by restarting positions only without a mask; packed
    positions with no mask (or an all-ones one) keep their documents apart here, so no choice matches them all."""
    positions = positions.to(segment.device)
    restart = positions[:, 1:] != positions[:, :-1] + 1
    inside = (segment[:, 1:] == segment[:, :-1]) & (segment[:, 1:] != PAD_SEGMENT)
    bad = restart & inside
    if not bool(bad.any()):
        return
    row, col = (int(i) for i in bad.nonzero()[0])
    col += 1
    where = (f"position_ids restart at token {col} of row {row} (position {int(positions[row, col])} after "
             f"{int(positions[row, col - 1])})")
    if cu is not None:
        cu = [int(offset) for offset in cu.tolist()]
        end = next(e for e in cu[1:] if e > col)
        start = max(s for s in cu if s < col)
        raise ValueError(
            f"{where}, inside the document [{start}, {end}) of cu_seq_lens_k: the two give other documents "
            "(flash-attention packs by cu_seq_lens, SDPA by the position_ids). Pass the boundaries of one packing in "
            "both (DataCollatorWithFlattening(return_flash_attn_kwargs=True) gives both), or leave cu_seq_lens_q/k "
            "out to pack by the position_ids.")
    raise ValueError(
        f"{where}, inside a run of tokens that the attention_mask keeps as one sequence: with a padding mask, SDPA "
        "and flash-attention attend across such packed documents, while without one they keep them apart, so this "
        "batch has no one meaning. To keep the documents apart, pass cu_seq_lens_q/k with the mask "
        "(DataCollatorWithFlattening(return_flash_attn_kwargs=True)), or no attention_mask (padding as a run of "
        "its own restarting position_ids, as DataCollatorWithFlattening and TRL's padding_free give it); for one "
        "sequence, give position_ids that count on through it.")


def mask_positions(
    batch: int, seq_len: int, device: torch.device | str, attention_mask: torch.Tensor | None, kwargs: dict
) -> torch.Tensor:
    """The positions that transformers' masks compare for a sliding window or an attention chunk (int64 [B, S]):
    `position_ids` where the batch packs documents by them without an attention mask (transformers then remaps the
    mask's indices to them, `remap_positions_for_packed_sequence`), else each token's index in its row less the
    row's left padding (`create_chunked_causal_mask` starts the chunks there; a window compares differences only);
    with `cu_seq_lens_k` and no `position_ids` (a layer that does not pass them on), each token's index in its
    document, as flattened packing numbers them. Multimodal RoPE's [R, B, S] position_ids: `packing_positions`."""
    position_ids = packing_positions(kwargs.get("position_ids"))
    check_position_shape(position_ids, batch, seq_len)
    check_padding_mask(attention_mask, batch, seq_len)
    if attention_mask is None and position_ids is not None:
        positions = position_ids.to(device=device, dtype=torch.int64).expand(batch, seq_len)
        if bool((segments_from_position_ids(positions)[:, -1] > 0).any()):  # (transformers' packed detection)
            return positions
    index = torch.arange(seq_len, device=device).expand(batch, seq_len)
    cu = kwargs.get("cu_seq_lens_k")
    if cu is not None and position_ids is None:  # (flattened packing: each document's positions from 0)
        return index - document_starts(TokenMeta.from_segments(segments_from_cu_seqlens(cu.to(device), batch,
                                                                                        seq_len)))
    if attention_mask is None:
        return index
    left = (attention_mask.to(device).bool().cumsum(-1) == 0).sum(-1, keepdim=True)
    return index - left


def document_extents(meta: TokenMeta, positions: torch.Tensor) -> torch.Tensor:
    """int64 [N, 2] on the CPU: the least and the greatest of `positions` ([B, S], as `meta`) over each document of
    `meta` (padding excluded), in no particular order."""
    segment = meta.segment.to(torch.int64)
    real = segment >= 0
    rows = torch.arange(segment.shape[0], device=segment.device)[:, None].expand_as(segment)
    keys = (rows * (segment.shape[-1] + 1) + segment)[real]
    if keys.numel() == 0:
        return torch.zeros(0, 2, dtype=torch.int64)
    values = positions.to(device=segment.device, dtype=torch.int64).expand_as(segment)[real]
    _, inverse = torch.unique(keys, return_inverse=True)
    n = int(inverse.max()) + 1
    low = values.new_zeros(n).scatter_reduce(0, inverse, values, "amin", include_self=False)
    high = values.new_zeros(n).scatter_reduce(0, inverse, values, "amax", include_self=False)
    return torch.stack([low, high], 1).cpu()


class BatchDocumentExtents:
    """`document_extents` of a whole batch over the positions transformers' masks compare (`mask_positions`),
    computed once, when first called: only a layer whose window or chunk the mask alone carries reads them, and
    finding the positions of packed `position_ids` reads a tensor back to the host. A context-parallel shard
    carries it, so every rank decides alike from the whole batch."""

    def __init__(self, meta: TokenMeta, attention_mask: torch.Tensor | None, kwargs: dict) -> None:
        self.meta, self._attention_mask = meta, attention_mask
        self._kwargs = {k: kwargs[k] for k in ("position_ids", "cu_seq_lens_k") if k in kwargs}
        self._extents: torch.Tensor | None = None

    def __call__(self) -> torch.Tensor:
        if self._extents is None:
            b, s = self.meta.segment.shape
            positions = mask_positions(b, s, self.meta.segment.device, self._attention_mask, self._kwargs)
            self._extents = document_extents(self.meta, positions)
            self._attention_mask = self._kwargs = None  # (the batch's tensors are not kept past their use)
        return self._extents
