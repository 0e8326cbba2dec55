"""How one packed sequence is split over the ranks of a context-parallel group.

Every split (`BlockSplit`) puts the sequence into a global order of whole blocks (`block_size`
tokens, the layout's block) and gives each block to one rank; each rank's blocks stay in
ascending global order, so a layout's ascending key blocks stay ascending after re-indexing into
a shard. `ShardPlan` keeps the original order, padded so that every rank holds the same number of
blocks, and splits it by one of three layouts:

* ``contiguous``: rank r holds the r-th run of blocks (cheap to reason about, causal work grows
  with r);
* ``zigzag`` (head-tail): the blocks form 2 x CP chunks; rank r holds chunks r and 2CP-1-r, which
  balances dense causal work;
* ``striped``: block b goes to rank b mod CP (MTraining), which balances vertical-slash work over
  ranks *and* ring steps; the default for sparse attention.

`document_plan.DocumentPlan` (``--cp_sharding document``) re-orders the documents of a packed row and
gives ranks different numbers of blocks (see `documents.py`). `NestedSplit` cuts every shard of a split
into contiguous pieces, one per rank of a head-parallel group (`--cp_mode ulysses` / `hybrid`).

Sharding happens once, at data time: every CP rank gets the same batch and keeps its shard of the
inputs, the labels shifted *before* sharding, and the position_ids (RoPE sees true positions).
Padding is masked (document -1), never truncated.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ...attention.tokens import (
    PAD_SEGMENT,
    TokenMeta,
    check_positions_inside_mask,
    packing_positions,
    padding_between_tokens,
    segments_from_position_ids,
    token_meta_from_kwargs,
)
from ...config import check_block_size

SHARDINGS = ("contiguous", "zigzag", "striped")


class BlockSplit:
    """What every split of a sequence over a CP group shares: whole blocks per rank, in a global order.

    A split puts the sequence's tokens, possibly re-ordered and with padding between them, into a
    global order of `num_blocks` blocks of `block_size` tokens and gives every block to one rank.
    Subclasses set `cp_size`, `block_size`, `seq_len` and define `rank_blocks` (per rank, its global
    blocks, int64 ascending; ranks may hold different numbers of blocks) and `source` (int64
    [padded_len]: the original position of the token at each global position, -1 for padding).
    """

    cp_size: int
    block_size: int
    seq_len: int
    rank_blocks: tuple[torch.Tensor, ...]
    source: torch.Tensor

    @property
    def num_blocks(self) -> int:
        return sum(int(b.numel()) for b in self.rank_blocks)

    @property
    def padded_len(self) -> int:
        return self.num_blocks * self.block_size

    def blocks_of(self, rank: int) -> torch.Tensor:
        """Global block indices held by `rank` (int64, ascending)."""
        return self.rank_blocks[rank]

    def local_len_of(self, rank: int) -> int:
        """Tokens (padding included) of `rank`'s shard."""
        return int(self.rank_blocks[rank].numel()) * self.block_size

    @functools.cached_property
    def max_local_blocks(self) -> int:
        return max(int(b.numel()) for b in self.rank_blocks)

    @functools.cached_property
    def padded_rank_blocks(self) -> torch.Tensor:
        """int64 [cp_size, max_local_blocks]: every rank's blocks, short ranks filled with `num_blocks`
        (a block index past the sequence, which nobody reads)."""
        out = torch.full((self.cp_size, self.max_local_blocks), self.num_blocks, dtype=torch.long)
        for rank, blocks in enumerate(self.rank_blocks):
            out[rank, : blocks.numel()] = blocks
        return out

    @functools.cached_property
    def block_owner(self) -> torch.Tensor:
        """int64 [num_blocks]: the rank holding each global block."""
        owner = torch.empty(self.num_blocks, dtype=torch.long)
        for rank, blocks in enumerate(self.rank_blocks):
            owner[blocks] = rank
        return owner

    @functools.cached_property
    def block_local_index(self) -> torch.Tensor:
        """int64 [num_blocks]: each global block's index inside its owner's shard."""
        local = torch.empty(self.num_blocks, dtype=torch.long)
        for blocks in self.rank_blocks:
            local[blocks] = torch.arange(blocks.numel())
        return local

    @functools.cached_property
    def _blocks_before(self) -> torch.Tensor:
        """int64 [num_blocks + 1, cp_size]: how many of each rank's blocks precede each global block."""
        owned = F.one_hot(self.block_owner, self.cp_size)
        return F.pad(owned.cumsum(0), (0, 0, 1, 0))

    def tokens_before(self, positions: torch.Tensor) -> torch.Tensor:
        """int64 [n, cp_size]: how many of each rank's tokens lie before each global position of
        `positions` (int64 [n], 0..padded_len), computed on the host from the split alone."""
        bs, nb = self.block_size, self.num_blocks
        blk = positions // bs
        within = (positions % bs) * (blk < nb)  # tokens of a position's own block before it
        owner = F.one_hot(self.block_owner[blk.clamp(max=nb - 1)], self.cp_size)
        return self._blocks_before[blk] * bs + owner * within[:, None]

    def token_index(self, rank: int) -> torch.Tensor:
        """Global positions of `rank`'s tokens (int64 [local_len_of(rank)], ascending)."""
        bs = self.block_size
        return (self.blocks_of(rank).unsqueeze(1) * bs + torch.arange(bs)).flatten()

    def _from_original(self, x: torch.Tensor, positions: torch.Tensor, dim: int, pad_value: Any) -> torch.Tensor:
        """The entries of `x` (original order along `dim`) at global `positions`, `pad_value` where padding."""
        src = self.source[positions]
        src = torch.where(src >= 0, src, self.seq_len).to(x.device)  # seq_len: the padding slot appended below
        pad = [0, 0] * (x.dim() - 1 - dim % x.dim()) + [0, 1]
        return F.pad(x, pad, value=pad_value).index_select(dim, src)

    def shard(self, x: torch.Tensor, rank: int, *, dim: int = 1, pad_value: Any = 0) -> torch.Tensor:
        """`rank`'s shard of a tensor whose `dim` is the original sequence (or, for a split that keeps
        the original order, the padded one)."""
        n = x.shape[dim]
        if n == self.padded_len and self.keeps_order:
            return x.index_select(dim, self.token_index(rank).to(x.device))
        if n != self.seq_len:
            raise ValueError(
                f"dimension {dim} of a tensor of shape {tuple(x.shape)} has {n} positions; this plan shards "
                f"sequences of {self.seq_len} tokens."
            )
        return self._from_original(x, self.token_index(rank), dim, pad_value)

    def unshard(self, shards: list[torch.Tensor], *, dim: int = 1) -> torch.Tensor:
        """The padded sequence in global order, from every rank's shard (in rank order)."""
        if len(shards) != self.cp_size:
            raise ValueError(f"unshard needs {self.cp_size} shards (one per rank), got {len(shards)}.")
        shape = list(shards[0].shape)
        shape[dim] = self.padded_len
        full = shards[0].new_empty(shape)
        for rank, piece in enumerate(shards):
            full.index_copy_(dim, self.token_index(rank).to(piece.device), piece)
        return full

    @functools.cached_property
    def original_in_shards(self) -> tuple[torch.Tensor, torch.Tensor]:
        """int64 [seq_len] twice: for each original position, the rank holding it and its index in that rank's
        shard (the inverse of `shard`, without the split's padding)."""
        real = self.source >= 0
        position = torch.empty(self.seq_len, dtype=torch.long)
        position[self.source[real]] = real.nonzero().flatten()
        block = position // self.block_size
        return self.block_owner[block], self.block_local_index[block] * self.block_size + position % self.block_size

    @functools.cached_property
    def keeps_order(self) -> bool:
        """Whether the global order is the original one (padding only at the end)."""
        real = self.source[: self.seq_len]
        return bool(torch.equal(real, torch.arange(self.seq_len)))

    def global_meta(self, meta: TokenMeta) -> TokenMeta:
        """The metadata [B, padded_len] of the whole sequence in global order, from the original [B, seq_len]."""
        if self.keeps_order:
            return meta.pad_to(self.padded_len)
        segment = self._from_original(meta.segment, torch.arange(self.padded_len), 1, PAD_SEGMENT)
        # padding sits between documents here: it keeps an ascending index (segment -1 already hides it)
        index = torch.arange(self.padded_len, device=segment.device).expand(segment.shape[0], -1)
        return TokenMeta(index, segment)

    def shard_meta(self, meta: TokenMeta, rank: int) -> TokenMeta:
        """`rank`'s shard of the metadata of the whole sequence in global order (padding appended as needed)."""
        meta = meta.pad_to(self.padded_len)
        idx = self.token_index(rank).to(meta.index.device)
        return TokenMeta(meta.index[:, idx], meta.segment[:, idx])


@dataclass(frozen=True)
class ShardPlan(BlockSplit):
    """Split of `seq_len` tokens, in their order, over `cp_size` ranks in blocks of `block_size` tokens."""

    sharding: str
    cp_size: int
    block_size: int
    seq_len: int
    pieces: int = 1  # every rank's blocks a multiple of this (`NestedSplit` cuts them into as many runs)

    def __post_init__(self) -> None:
        if self.sharding not in SHARDINGS:
            hint = (" ('document' sharding is planned per batch from its documents: see "
                    "hf_sparse_cp.distributed.split.documents)" if self.sharding == "document" else "")
            raise ValueError(f"sharding={self.sharding!r} is unknown; use one of {SHARDINGS}{hint}.")
        check_block_size(self.block_size)
        if self.cp_size < 1 or self.pieces < 1:
            raise ValueError(f"cp_size={self.cp_size} and pieces={self.pieces} must be >= 1.")
        if self.seq_len < 1:
            raise ValueError(f"seq_len={self.seq_len} must be >= 1.")

    @property
    def granularity(self) -> int:
        """Tokens the padded length is a multiple of: whole blocks per rank (two chunks per rank for zigzag),
        times `pieces`."""
        return self.block_size * self.cp_size * self.pieces * (2 if self.sharding == "zigzag" else 1)

    @property
    def padded_len(self) -> int:
        return -(-self.seq_len // self.granularity) * self.granularity

    @property
    def local_len(self) -> int:
        return self.padded_len // self.cp_size

    @property
    def num_blocks(self) -> int:
        return self.padded_len // self.block_size

    @property
    def local_blocks(self) -> int:
        return self.num_blocks // self.cp_size

    @functools.cached_property
    def source(self) -> torch.Tensor:
        pos = torch.arange(self.padded_len)
        return torch.where(pos < self.seq_len, pos, -1)

    @functools.cached_property
    def rank_blocks(self) -> tuple[torch.Tensor, ...]:
        return tuple(self.all_blocks)

    @functools.cached_property
    def all_blocks(self) -> torch.Tensor:
        """int64 [cp_size, local_blocks]: global block indices of every rank's shard, ascending."""
        w, n = self.cp_size, self.local_blocks
        ranks = torch.arange(w).unsqueeze(1)
        if self.sharding == "contiguous":
            return ranks * n + torch.arange(n)
        if self.sharding == "striped":
            return torch.arange(n) * w + ranks
        half = n // 2
        head = ranks * half + torch.arange(half)
        tail = (2 * w - 1 - ranks) * half + torch.arange(half)
        return torch.cat([head, tail], 1)

    @property
    def keeps_order(self) -> bool:
        return True


def head_group_plan(sharding: str, cp_size: int, head_size: int, block_size: int, seq_len: int) -> ShardPlan:
    """The ring's split of `seq_len` tokens under CP of `cp_size` ranks in head groups of `head_size` (1: the ring
    alone), as `distributed.modes` split them: `sharding` over the ring of cp_size / head_size ranks (the whole
    sequence on one, 'contiguous', where one head group holds every rank: Ulysses), each shard in head_size pieces.
    Every rank holds `local_len` / head_size of its tokens, padding to the plan's `granularity` included."""
    ring = cp_size // head_size
    return ShardPlan(sharding if ring > 1 else "contiguous", ring, block_size, seq_len, pieces=head_size)


class NestedSplit(BlockSplit):
    """A split of a split: every rank of `outer` cuts its blocks (ascending) into `pieces` contiguous
    runs of equal length, and CP rank `o * pieces + i` holds run i of outer rank o.

    This is the sequence split of head parallelism: the ranks o * pieces .. (o + 1) * pieces - 1 form
    a head group, whose all-to-all turns their runs back into outer rank o's whole shard (in its order)
    for a share of the heads. `outer` is the ring's split under `--cp_mode hybrid`, and the whole
    sequence on one rank (contiguous) under `--cp_mode ulysses`. The global order is `outer`'s.
    """

    def __init__(self, outer: BlockSplit, pieces: int) -> None:
        if pieces < 1:
            raise ValueError(f"pieces={pieces} must be >= 1.")
        short = [r for r in range(outer.cp_size) if outer.blocks_of(r).numel() % pieces]
        if short:
            raise ValueError(
                f"rank {short[0]} of the outer split holds {outer.blocks_of(short[0]).numel()} blocks, which do not "
                f"cut into {pieces} equal runs: build the outer split with pieces={pieces} (ShardPlan pads for it)."
            )
        self.outer, self.pieces = outer, pieces
        self.cp_size, self.block_size, self.seq_len = outer.cp_size * pieces, outer.block_size, outer.seq_len

    @functools.cached_property
    def rank_blocks(self) -> tuple[torch.Tensor, ...]:
        return tuple(run for r in range(self.outer.cp_size) for run in self.outer.blocks_of(r).view(self.pieces, -1))

    @property
    def source(self) -> torch.Tensor:
        return self.outer.source

    @property
    def keeps_order(self) -> bool:
        return self.outer.keeps_order


def shift_labels(labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Targets per position (position i predicts token i + 1, the last position nothing); shift
    before sharding, so a shard's last token keeps its target on the next rank's first token."""
    return F.pad(labels[..., 1:], (0, 1), value=ignore_index)


def batch_meta(inputs: Mapping[str, Any]) -> TokenMeta:
    """Documents and padding of a full (unsharded) batch, as the attention backend derives them:
    from `cu_seq_lens_k` (flattened packing, one row), restarting `position_ids`, and the 2D
    `attention_mask` (padding anywhere in a row)."""
    ids = inputs.get("input_ids")
    if ids is None:
        ids = inputs.get("inputs_embeds")
    if ids is None:
        raise ValueError("context-parallel inputs need `input_ids` (or `inputs_embeds`) to know the sequence length.")
    b, s = ids.shape[:2]
    return token_meta_from_kwargs(b, s, ids.device, inputs.get("attention_mask"), dict(inputs))


def sequence_meta(inputs: Mapping[str, Any]) -> TokenMeta:
    """`batch_meta` of a batch that context parallelism splits, which refuses padding between a row's tokens and
    position_ids that restart inside a padding mask's run of tokens (`check_positions_inside_mask`)."""
    row = padding_between_tokens(inputs.get("attention_mask"))
    if row is not None and _packs_documents(inputs, row):
        raise ValueError(
            f"attention_mask pads between the tokens of row {row}, whose position_ids restart (packed documents): with "
            "a padding mask, attention (SDPA, flash-attention, sparse_cp) crosses such documents (the mask, not the "
            "position_ids, says what attends: in one process too, so training without context parallelism is no "
            "fix), and context parallelism takes padding at the start or the end of a row only. To keep the "
            "documents apart, leave the attention_mask out and give the padding between them a run of its own: "
            "position_ids that restart and labels -100, as hf_sparse_cp.trainer.packing.BlockAlignedFlattening pads "
            "(DataCollatorWithFlattening's rows need none).")
    if row is not None:
        raise ValueError(
            f"attention_mask pads between the tokens of row {row} (a 0 between two 1s, e.g. left padding after PEFT "
            "prompt tuning's virtual tokens); context parallelism takes padding at the start or the end of a row "
            "only: pad on one side (tokenizer.padding_side), or train without context parallelism (--cp_size 1).")
    check_positions_inside_mask(inputs.get("attention_mask"), inputs)
    return batch_meta(inputs)


def _packs_documents(inputs: Mapping[str, Any], row: int) -> bool:
    """Whether row `row` of a batch without cu_seq_lens_k packs documents by its position_ids (`packing_positions`'),
    which restart. Read on the host, for an error's advice only."""
    if inputs.get("cu_seq_lens_k") is not None:
        return False
    positions = packing_positions(inputs.get("position_ids"))
    if positions is None or positions.dim() == 0:
        return False
    positions = positions.reshape(-1, positions.shape[-1])
    mine = positions[min(row, positions.shape[0] - 1)].cpu()
    return bool(segments_from_position_ids(mine[None])[0, -1] > 0)  # (a second document: the positions restart)


# Keys describing the whole sequence that are folded into the TokenMeta instead of being sharded.
CONSUMED_KEYS = ("attention_mask", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
# Keys `shard_inputs` shards (or reads) by what they are; any other per-token tensor is sharded as the ids are.
_SHARDED_KEYS = ("input_ids", "inputs_embeds", "labels", "shift_labels", "position_ids", "logits_to_keep")


def shard_inputs(
    inputs: Mapping[str, Any], plan: BlockSplit, rank: int, *, pad_token_id: int = 0, ignore_index: int = -100
) -> dict[str, Any]:
    """`rank`'s model inputs for one batch (every CP rank passes the same batch).

    Args:
        inputs: the full batch; plan: how the sequence splits; rank: the CP rank whose shard to take.
        pad_token_id, ignore_index: what fills the padding of ids and targets.

    Returns:
        input_ids / inputs_embeds sharded (padding with `pad_token_id` / zeros); `labels` shifted
        first and returned as `shift_labels` (padding ignored), with `labels` kept as the sharded
        unshifted labels only so that stock forwards still compute a loss; the global position_ids
        (an arange when absent). The attention mask and flattened-packing keys describe the whole
        sequence: they go into the shard's `TokenMeta` (see `sequence_meta`), not the model. A
        `logits_to_keep` mask becomes the shard's part, with the labels of its kept positions
        (`kept_positions_of_shard`). Any other tensor of one entry per token ([B, S, ...] or [1, S, ...]:
        GPT-2's `token_type_ids`, TRL's `seq_idx`) is sharded as the ids are (padding 0 / False): the rank's
        forward holds its shard's tokens, with which a whole-sequence tensor would not line up (GPT-2 added the
        token types of the sequence's first positions to a shard of as many tokens). Other entries pass through
        unchanged.
    """
    ids = inputs.get("input_ids")
    ref = ids if ids is not None else inputs.get("inputs_embeds")
    if ref is None:
        raise ValueError("context-parallel inputs need `input_ids` (or `inputs_embeds`).")
    check_per_token_shapes(inputs)
    b, s = ref.shape[:2]
    if s != plan.seq_len:
        raise ValueError(f"the batch has {s} tokens per row but the shard plan was made for {plan.seq_len}.")
    out = {k: v for k, v in inputs.items() if k not in CONSUMED_KEYS}
    for key, value in out.items():
        if key not in _SHARDED_KEYS and isinstance(value, torch.Tensor) and value.dim() >= 2 \
                and value.shape[0] in (1, b) and value.shape[1] == s:
            out[key] = plan.shard(value, rank, pad_value=False if value.dtype == torch.bool else 0)
    kept = kept_positions_of_shard(inputs, plan, rank, b, s, ignore_index)
    if kept is not None:
        out.update(kept)
    if ids is not None:
        out["input_ids"] = plan.shard(ids, rank, pad_value=pad_token_id)
    if inputs.get("inputs_embeds") is not None:
        out["inputs_embeds"] = plan.shard(inputs["inputs_embeds"], rank, pad_value=0.0)
    labels = inputs.get("labels")
    shifted = inputs.get("shift_labels")
    if shifted is None and labels is not None:
        shifted = shift_labels(labels, ignore_index)
    if shifted is not None and kept is None:
        out["shift_labels"] = plan.shard(shifted, rank, pad_value=ignore_index)
    if labels is not None and kept is None:
        out["labels"] = plan.shard(labels, rank, pad_value=ignore_index)
    position_ids = inputs.get("position_ids")
    if position_ids is None:
        position_ids = torch.arange(s, device=ref.device).expand(b, s)
    position_ids = position_ids.expand(*position_ids.shape[:-2], b, s)  # (multimodal RoPE's [R, B, S]: R rows kept)
    out["position_ids"] = plan.shard(position_ids, rank, dim=position_ids.dim() - 1, pad_value=0)
    return out


def check_per_token_shapes(inputs: Mapping[str, Any]) -> None:
    """Raise ValueError, naming the key and the fix, for a `labels`, `shift_labels`, `position_ids` or `attention_mask`
    of a batch that does not hold one entry per token of its [B, S] input_ids (or inputs_embeds): a shard of it would
    cut other positions than the tokens' (labels one shorter than the ids were refused only as 'a tensor of 299
    positions' the plan could not shard; of a longer attention mask, the last columns were read). With a
    `logits_to_keep` mask the labels are the kept positions' (`kept_positions_of_shard` checks them). The ids
    themselves must be [B, S] (embeddings [B, S, hidden]) of at least one token per row: 1-D ids failed as 'not
    enough values to unpack', and 3-D ids were split as embeddings (along their second dimension)."""
    ref_name = "input_ids" if inputs.get("input_ids") is not None else "inputs_embeds"
    ref, dims = inputs[ref_name], 2 if ref_name == "input_ids" else 3
    if ref.dim() != dims:
        shape = "[batch, sequence]" if dims == 2 else "[batch, sequence, hidden]"
        fix = " (one row: add the batch dimension, x[None])" if ref.dim() == dims - 1 else ""
        raise ValueError(f"context-parallel inputs take {ref_name} of shape {shape}; got {tuple(ref.shape)}{fix}.")
    b, s = ref.shape[:2]
    if s == 0:
        raise ValueError(f"the batch's {ref_name} {tuple(ref.shape)} hold no token: give rows of at least one token.")
    keep = inputs.get("logits_to_keep")
    masked = isinstance(keep, torch.Tensor) or bool(keep)
    every_token = ("position_ids", "attention_mask")
    for key in every_token if masked else ("labels", "shift_labels", *every_token):
        x = inputs.get(key)
        if not isinstance(x, torch.Tensor):
            continue
        # (position_ids may be [S], [1, S] or multimodal RoPE's [R, B, S]: they are broadcast over the batch)
        batch_ok = x.dim() == 1 or x.shape[-2] in (1, b) if key == "position_ids" else x.dim() == 2 and x.shape[0] == b
        if x.shape[-1] != s or not batch_ok:
            raise ValueError(
                f"the batch's {key} has shape {tuple(x.shape)}, but its {ref_name} holds {b} rows of {s} tokens: "
                f"under context parallelism each rank takes the same positions of every per-token tensor, so {key} "
                f"needs one entry per token ([{b}, {s}]; the data collator pads {key} with {ref_name} to the same "
                "length).")


def kept_positions_of_shard(inputs: Mapping[str, Any], plan: BlockSplit, rank: int, b: int, s: int,
                            ignore_index: int) -> dict[str, Any] | None:
    """`rank`'s part of a batch's `logits_to_keep` (None when it keeps every position: absent or 0), with the labels
    of the kept positions of its shard.

    The positions of `logits_to_keep` count in the whole sequence, of which a rank holds a shard. A boolean mask
    [B, S] (transformers' form for packed training) is exact: the rank keeps the mask's part over its shard, whose
    kept positions its forward returns flattened ([N_rank, ...]) as one process returns the batch's ([N, ...]); the
    labels (or shift_labels) of the N kept positions, in the mask's order, are shifted as the model's loss shifts
    them, and the rank keeps those of its own kept positions. Any other form (the last n positions, a 1D tensor of
    positions, per-row positions [B, n]) returns a [B, n, ...] block whose positions lie on several ranks, in no
    shape a rank's part can take: refused, naming the mask."""
    keep = inputs.get("logits_to_keep")
    if keep is None or (isinstance(keep, int) and keep == 0):
        return None
    if not (isinstance(keep, torch.Tensor) and keep.dtype == torch.bool and tuple(keep.shape) == (b, s)):
        form = (f"a {keep.dim()}D {keep.dtype} tensor of shape {tuple(keep.shape)}"
                if isinstance(keep, torch.Tensor) else repr(keep))
        raise ValueError(
            f"logits_to_keep={form} under context parallelism: its positions count in the whole sequence, which each "
            "rank holds only a shard of, and the logits it asks for, one block [B, n], lie on several ranks. Pass "
            f"logits_to_keep as a boolean mask [B, S] ({b}, {s}) of the positions to keep (each rank keeps those of "
            "its shard and returns their logits flattened, with the labels of the kept positions in the mask's order), "
            "or logits_to_keep=0 (every position; labels of -100 leave positions out of the loss).")
    n = int(keep.sum())
    ordinal = torch.full((b, s), -1, dtype=torch.long, device=keep.device)
    ordinal[keep] = torch.arange(n, device=keep.device)  # (the order `hidden[keep]` takes them in)
    mine = plan.shard(keep, rank, pad_value=False)
    out = {"logits_to_keep": mine}
    labels, shifted = inputs.get("labels"), inputs.get("shift_labels")
    if shifted is None and labels is not None:
        shifted = shift_labels(labels, ignore_index)  # (as `ForCausalLMLoss` shifts the kept positions' labels)
    for name, targets in (("labels", labels), ("shift_labels", shifted)):
        if targets is None:
            continue
        if targets.numel() != n:
            raise ValueError(
                f"{name} of shape {tuple(targets.shape)} with a logits_to_keep mask keeping {n} "
                "positions: pass the labels of exactly the kept positions, in the mask's order (labels[mask] of "
                "labels over the whole sequence), as the model's loss reads them without context parallelism.")
        out[name] = targets.reshape(-1)[plan.shard(ordinal, rank, pad_value=-1)[mine].to(targets.device)]
    return out
