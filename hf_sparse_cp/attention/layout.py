"""`SparseLayout`: the contract between pattern estimation, the attention kernels and the ring.

A layout says, for every (batch row, head, query block), which keys are computed:

* whole key *blocks* of `block_size` tokens (slashes become blocks along their diagonals, dense
  regions become runs of blocks), and
* extra vertical key *columns*, single token indices gathered one by one.

Indices refer to the key tensor the kernel receives (blocks of `block_size` tokens, tokens by
position). Which pairs inside a listed block are visible (causal order, same document, sliding
window) is decided per token from `TokenMeta`, so a layout never has to encode the diagonal.

Storage (all int32, padded with -1 past the count):

    block_idx [B, Hl, NQB, max_blocks]  ascending key block indices
    block_cnt [B, Hl, NQB]
    col_idx   [B, Hl, NQB, max_cols]    ascending key token indices, none inside a listed block
    col_cnt   [B, Hl, NQB]

`Hl` is either the number of query heads or 1 (one layout shared by all heads, e.g. dense).
Query head h of a GQA model reads key/value head h // (Hq // Hkv).

The input contract of block-sparse attention (`check_tensors`, `check_attention_inputs`) lives
here too: shapes, dtypes and devices of q, k, v, the layout and the token metadata, checked
without reading device memory.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..config import check_block_size
from .tokens import PAD_SEGMENT, TokenMeta, document_starts


def valid_slots(idx: torch.Tensor, cnt: torch.Tensor) -> torch.Tensor:
    """bool [..., N]: which of the N slots of an index tensor [..., N] with counts [...] are in use."""
    return torch.arange(idx.shape[-1], device=idx.device) < cnt.unsqueeze(-1)


def write_version(tensor: torch.Tensor) -> int | object:
    """How many in-place writes `tensor` has had (`Tensor._version`, which autograd's own check of saved tensors
    relies on), for what is kept while its inputs are unchanged. An inference tensor (made under
    `torch.inference_mode`) counts none and refuses the read: it gets a new object, equal to no other version, so
    what is kept for it is computed again rather than trusted past a write nobody counted."""
    return object() if tensor.is_inference() else tensor._version


@dataclass(frozen=True)
class SparseLayout:
    block_idx: torch.Tensor
    block_cnt: torch.Tensor
    col_idx: torch.Tensor
    col_cnt: torch.Tensor
    block_size: int
    # what `derived` keeps: name -> (key, tensors it was computed from, their versions, value)
    _derived: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def derived(self, name: str, inputs: tuple[torch.Tensor, ...], key: Hashable, compute: Callable[[], Any]) -> Any:
        """`compute()`, kept on this layout under `name` and reused while it would give the same result:
        same `key`, the same `inputs` tensors (by identity) and this layout's own tensors, none of them
        written in place since. A layout built again is a new object with nothing kept; one entry per
        name (the latest). Computed without autograd. Under torch.compile nothing is read or kept: the
        traced graph computes the value itself (a tensor's `_version` is a data-dependent symbol there, so
        a lookup would break a `fullgraph` trace).

        The kernels' full/partial split (`hf_sparse_cp.attention.ops`) lives here, so that a layer's
        forward and backward, and every ring step reusing a layout, compute it once.
        """
        if torch.compiler.is_compiling():
            with torch.no_grad():
                return compute()
        tensors = (*self.tensors(), *inputs)
        versions = tuple(map(write_version, tensors))
        entry = self._derived.get(name)
        if (entry is not None and entry[0] == key and len(entry[1]) == len(tensors)
                and all(a is b for a, b in zip(entry[1], tensors)) and entry[2] == versions):
            return entry[3]
        with torch.no_grad():
            value = compute()
        self._keep(name, inputs, key, value)
        return value

    def _keep(self, name: str, inputs: tuple[torch.Tensor, ...], key: Hashable, value: Any,
              input_versions: tuple[int, ...] | None = None) -> None:
        """Keeps `value` for this layout's tensors as they are and `inputs` at `input_versions` (default: now)."""
        tensors = (*self.tensors(), *inputs)
        versions = tuple(map(write_version, tensors))
        if input_versions is not None:
            versions = versions[:4] + input_versions
        self._derived[name] = (key, tensors, versions, value)

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.block_idx, self.block_cnt, self.col_idx, self.col_cnt

    def take_apart(self) -> tuple[tuple[torch.Tensor, ...], LayoutSkeleton]:
        """(its tensors and those of what `derived` keeps, what puts them back together): for an autograd
        Function to save the layout through `ctx.save_for_backward` rather than keep the object. Under gradient
        checkpointing saved tensors are dropped after the forward and recomputed for the backward, while an
        object kept on `ctx` lives until the layer's backward: with a budget that grows with S (col_idx is
        [B, H, NQB, columns]) every layer's layout held at once grew the step's memory as S^2. Only derived
        values that are tuples of tensors and still hold travel (with their inputs' versions: one written in
        place before the backward is computed again there); others are computed again when asked for. Under
        torch.compile none travel (`derived` reads and keeps nothing there)."""
        tensors, entries = list(self.tensors()), []
        for name, (key, used, versions, value) in () if torch.compiler.is_compiling() else self._derived.items():
            if (isinstance(value, tuple) and all(isinstance(t, torch.Tensor) for t in value)
                    and versions == tuple(map(write_version, used))):
                entries.append((name, key, used[4:], versions[4:], type(value), len(value)))
                tensors.extend(value)
        return tuple(tensors), LayoutSkeleton(self.block_size, tuple(entries))

    @property
    def batch(self) -> int:
        return self.block_idx.shape[0]

    @property
    def heads(self) -> int:
        return self.block_idx.shape[1]

    @property
    def num_q_blocks(self) -> int:
        return self.block_idx.shape[2]

    @classmethod
    def from_blocks(cls, block_idx: torch.Tensor, block_cnt: torch.Tensor, block_size: int) -> SparseLayout:
        """A layout that lists key blocks only (no columns)."""
        empty = torch.empty(*block_cnt.shape, 0, dtype=torch.int32, device=block_cnt.device)
        return cls(block_idx, block_cnt, empty, torch.zeros_like(block_cnt), block_size)

    @classmethod
    def from_columns(cls, col_idx: torch.Tensor, col_cnt: torch.Tensor, block_size: int) -> SparseLayout:
        """A layout that lists key columns only (no blocks)."""
        empty = torch.empty(*col_cnt.shape, 0, dtype=torch.int32, device=col_cnt.device)
        return cls(empty, torch.zeros_like(col_cnt), col_idx, col_cnt, block_size)

    def valid_blocks(self) -> torch.Tensor:
        """bool [B, H, NQB, max_blocks]: the slots of `block_idx` in use."""
        return valid_slots(self.block_idx, self.block_cnt)

    def valid_cols(self) -> torch.Tensor:
        """bool [B, H, NQB, max_cols]: the slots of `col_idx` in use."""
        return valid_slots(self.col_idx, self.col_cnt)

    def select(self, query_blocks: torch.Tensor) -> SparseLayout:
        """The layout of the query blocks `query_blocks` (int64 indices, e.g. one rank's shard), in that order."""
        q = query_blocks.to(self.block_idx.device)
        return SparseLayout(self.block_idx[:, :, q], self.block_cnt[:, :, q], self.col_idx[:, :, q],
                            self.col_cnt[:, :, q], self.block_size)

    def blocks_into(self, key_map: torch.Tensor) -> SparseLayout:
        """The listed key blocks renumbered through `key_map` (int64 [key blocks]: the new index, or -1 to
        drop the block), ascending, without the columns: e.g. the blocks one shard holds, indexed into the
        buffer that receives them."""
        blk = self.block_idx.long()
        mapped = key_map.to(blk.device)[blk.clamp_min(0)]
        block_idx, block_cnt = compact_sorted(mapped, self.valid_blocks() & (mapped >= 0))
        return SparseLayout.from_blocks(block_idx, block_cnt, self.block_size)

    def columns_into(self, tokens: torch.Tensor) -> SparseLayout:
        """The listed key columns as positions in `tokens` (ascending key tokens holding every listed column),
        without the blocks: e.g. the columns in a buffer gathered from several ranks."""
        positions = torch.searchsorted(tokens.to(self.col_idx.device), self.col_idx.long())
        col_idx = torch.where(self.valid_cols(), positions, -1).to(torch.int32)
        width = int(self.col_cnt.max()) if self.col_cnt.numel() else 0
        return SparseLayout.from_columns(col_idx[..., :width].contiguous(), self.col_cnt, self.block_size)

    def listed_columns(self, num_tokens: int) -> torch.Tensor:
        """bool [num_tokens] on the layout's device: the key tokens some (row, head, query block) lists as a
        column. Marks a flag per token instead of sorting the listed columns: linear in the layout's size."""
        listed = torch.zeros(num_tokens + 1, dtype=torch.bool, device=self.col_idx.device)
        listed[torch.where(self.valid_cols(), self.col_idx.long(), num_tokens).flatten()] = True  # spare flag: unused
        return listed[:num_tokens]

    def head_index(self, num_q_heads: int) -> torch.Tensor:
        """Layout head used by each query head (all zeros for a shared layout)."""
        if self.heads == 1:
            return torch.zeros(num_q_heads, dtype=torch.long)
        return torch.arange(num_q_heads)

    def check_fits(self, num_q_heads: int, q_len: int, batch: int | None = None) -> None:
        """Raise ValueError unless the layout's shapes fit these queries: block size, dtypes, tensors
        agreeing on [batch, heads, query blocks]. Reads no tensor contents (no device sync), so
        it is cheap enough for every kernel call."""
        bs = self.block_size
        check_block_size(bs, "layout block_size")
        for name in ("block_idx", "block_cnt", "col_idx", "col_cnt"):
            t = getattr(self, name)
            if t.dtype != torch.int32:
                raise ValueError(f"layout.{name} must be int32, got {t.dtype}.")
        b, h, n = self.block_cnt.shape
        if not self.block_idx.shape[:3] == self.col_idx.shape[:3] == self.col_cnt.shape == (b, h, n):
            raise ValueError(
                "layout tensors disagree on [batch, heads, query blocks]: "
                f"block_idx {tuple(self.block_idx.shape)}, block_cnt {tuple(self.block_cnt.shape)}, "
                f"col_idx {tuple(self.col_idx.shape)}, col_cnt {tuple(self.col_cnt.shape)}."
            )
        if batch is not None and b != batch:
            raise ValueError(f"layout has batch {b} but the inputs have batch {batch}.")
        nqb = -(-q_len // bs)
        if n != nqb:
            raise ValueError(f"layout has {n} query blocks but {q_len} queries need {nqb} blocks of {bs}.")
        if h not in (1, num_q_heads):
            raise ValueError(f"layout has {h} heads; expected 1 (shared) or {num_q_heads} (one per query head).")

    def validate(self, num_q_heads: int, q_len: int, k_len: int, strict: bool = False) -> None:
        """Raise ValueError when the layout cannot drive attention over these sizes.

        The checks of sizes, counts, index ranges (a layout built for more keys than k holds) and that each
        query block lists a key once always run; `strict` also checks the order of the indices.
        """
        self.check_fits(num_q_heads, q_len)
        bs = self.block_size
        nkb = -(-k_len // bs)
        if bool((self.block_cnt < 0).any() or (self.block_cnt > self.block_idx.shape[3]).any()):
            raise ValueError("layout.block_cnt is outside [0, block_idx.shape[-1]].")
        if bool((self.col_cnt < 0).any() or (self.col_cnt > self.col_idx.shape[3]).any()):
            raise ValueError("layout.col_cnt is outside [0, col_idx.shape[-1]].")
        blk_valid, col_valid = self.valid_blocks(), self.valid_cols()
        blk, col = self.block_idx.long(), self.col_idx.long()
        if bool(((blk < 0) | (blk >= nkb))[blk_valid].any()):
            raise ValueError(f"layout.block_idx holds key blocks outside [0, {nkb}) (the {k_len} keys given in blocks "
                             f"of {bs}): a layout built for other keys.")
        if bool(((col < 0) | (col >= k_len))[col_valid].any()):
            raise ValueError(f"layout.col_idx holds key tokens outside [0, {k_len}): a layout built for other keys.")
        twice = _listed_twice(blk, blk_valid, col, col_valid, bs)
        if twice:
            # (the kernels and the reference counted such a key twice in its query's softmax, the masked engine
            # once, Flex a repeated block once and a repeated column twice: one layout, other numbers per engine)
            raise ValueError(f"a query block of the layout lists {twice[0]}: list each key once (a key block once, a "
                             f"column once and outside the key blocks its query block lists; {twice[1]}).")
        if strict and (not _strictly_ascending(blk, blk_valid) or not _strictly_ascending(col, col_valid)):
            raise ValueError("layout indices must be strictly ascending within each query block.")

    def to(self, device: torch.device | str) -> SparseLayout:
        """This layout with its index tensors on `device`."""
        return SparseLayout(self.block_idx.to(device), self.block_cnt.to(device), self.col_idx.to(device),
                            self.col_cnt.to(device), self.block_size)

    def num_computed_blocks(self) -> torch.Tensor:
        """Computed work per (batch, head) in block units: listed blocks plus columns / block_size."""
        return self.block_cnt.sum(-1).double() + self.col_cnt.sum(-1).double() / self.block_size

    def kept_fraction(self, meta: TokenMeta | None = None, sliding_window: int | None = None) -> torch.Tensor:
        """Computed blocks over the blocks a dense computation of the same tokens visits, averaged over batch
        and heads: 1.0 for a dense layout, whatever the documents, padding or window.

        With `meta` (the tokens the layout was built for), the dense blocks are those holding a visible pair
        (causal, within a document, inside `sliding_window`; `dense_blocks`): packed documents count their
        own triangles only, and padding (right padding, or the blocks a context-parallel split adds) nothing,
        so a batch gets the same value in one process and under any CP split; a row of padding only (an empty
        text padded to the batch's length) has no such block and is left out of the mean (1.0 when every row
        is). Without it, the causal triangle of every query block. A 0-d float64 tensor on the layout's device
        (reading it with float() synchronizes).
        """
        if meta is None:
            n = self.num_q_blocks
            return self.num_computed_blocks().mean() / (n * (n + 1) / 2)
        dense = dense_blocks(meta, self.block_size, sliding_window)
        rows = dense > 0
        kept = (self.num_computed_blocks().mean(1) / dense.clamp_min(1) * rows).sum()
        return torch.where(rows.any(), kept / rows.sum().clamp_min(1), 1.0)

    def to_mask(self, num_q_heads: int, q_len: int, k_len: int) -> torch.Tensor:
        """Dense boolean [B, Hq, q_len, k_len] mask of the listed keys (for tests and baselines)."""
        bs = self.block_size
        b, _, nqb = self.block_cnt.shape
        nkb = -(-k_len // bs)
        dev = self.block_idx.device
        blk_valid = self.valid_blocks()
        blocks = torch.zeros(b, self.heads, nqb, nkb + 1, dtype=torch.bool, device=dev)
        blocks.scatter_(-1, torch.where(blk_valid, self.block_idx.long(), nkb), True)
        tok = blocks[..., :nkb].repeat_interleave(bs, dim=-1)[..., :k_len]
        col_valid = self.valid_cols()
        cols = torch.zeros(b, self.heads, nqb, k_len + 1, dtype=torch.bool, device=dev)
        cols.scatter_(-1, torch.where(col_valid, self.col_idx.long(), k_len), True)
        tok = tok | cols[..., :k_len]
        mask = tok.repeat_interleave(bs, dim=2)[:, :, :q_len]
        return mask[:, self.head_index(num_q_heads).to(dev)]


@dataclass(frozen=True)
class LayoutSkeleton:
    """What `SparseLayout.take_apart` keeps besides the tensors: the block size and, per derived value, its
    name, key, the input tensors it was computed from and their versions then, its type and number of tensors."""

    block_size: int
    entries: tuple

    def restore(self, tensors: tuple[torch.Tensor, ...]) -> SparseLayout:
        """The layout from the tensors `take_apart` gave (or their saved copies), its derived values kept."""
        layout = SparseLayout(*tensors[:4], self.block_size)
        at = 4
        for name, key, inputs, input_versions, kind, n in self.entries:
            value = tensors[at : at + n]
            layout._keep(name, inputs, key, value if kind is tuple else kind(*value), input_versions)
            at += n
        return layout


# "No such block / token" in the integer arithmetic of layouts.
FAR = torch.iinfo(torch.int64).max // 4


def first_visible_keys(meta: TokenMeta, block_size: int, sliding_window: int | None):
    """Per query block of [B, S] tokens: (valid queries bool [B, NQB, bs], their document starts
    [B, NQB, bs], the first key token any of them sees [B, NQB], the first key block that holds a
    visible key [B, NQB]; qb + 1 for a block of padding only)."""
    bs = block_size
    b, s = meta.segment.shape
    nqb = -(-s // bs)
    s_pad = nqb * bs
    qb = torch.arange(nqb, device=meta.segment.device)
    valid_q = (meta.pad_to(s_pad).segment != PAD_SEGMENT).view(b, nqb, bs)
    start = torch.nn.functional.pad(document_starts(meta), (0, s_pad - s), value=FAR).view(b, nqb, bs)
    lo_tok = torch.where(valid_q, start, FAR).amin(-1)
    lo = torch.where(lo_tok < FAR, lo_tok // bs, qb + 1)
    if sliding_window is not None:
        win_lo = torch.div(qb * bs - sliding_window - bs + 1, bs, rounding_mode="floor") + 1
        lo = torch.maximum(lo, win_lo.clamp_min(0))
    return valid_q, start, lo_tok, lo


def dense_blocks(meta: TokenMeta, block_size: int, sliding_window: int | None = None) -> torch.Tensor:
    """float64 [B]: the blocks a dense computation of each row visits, those holding a visible pair (causal,
    same document, inside the window): what `dense_layout` lists (0 for a row of padding only)."""
    lo = first_visible_keys(meta, block_size, sliding_window)[3]
    listed = (torch.arange(lo.shape[-1], device=lo.device) - lo + 1).clamp_min(0)
    return listed.double().sum(-1)


def check_tensor_types(q: Any, k: Any, v: Any) -> None:
    """Raise TypeError unless q, k and v are tensors (before anything reads their attributes)."""
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
        raise TypeError(f"q, k, v must be torch.Tensors [batch, heads, seq, head_dim]; got {type(q).__name__}, "
                        f"{type(k).__name__}, {type(v).__name__} (convert them with torch.as_tensor).")


def check_window(sliding_window: Any) -> None:
    """Raise ValueError unless `sliding_window` is None (no window) or a whole number of at least 1: below 1, no
    query would see any key, not even itself (every output 0); a fraction or True was taken for another window
    (2.5 as 3, True as 1), and text ended in a comparison's TypeError."""
    whole = isinstance(sliding_window, (numbers.Integral, torch.SymInt)) and not isinstance(sliding_window, bool)
    if sliding_window is not None and (not whole or sliding_window < 1):
        raise ValueError(f"sliding_window={sliding_window!r} must be a whole number >= 1 (keys sliding_window or more "
                         "tokens before a query are invisible, transformers' convention; below 1 no query sees any "
                         "key), or None for no window.")


def check_scale(scale: Any) -> None:
    """Raise TypeError unless the softmax `scale` is None (1 / sqrt(head_dim)) or a real number, as SDPA takes it
    (text ended in a TypeError deep inside an engine), and ValueError for NaN or infinity."""
    if scale is not None and (not isinstance(scale, (numbers.Real, torch.SymFloat)) or isinstance(scale, bool)):
        raise TypeError(f"scale={scale!r} ({type(scale).__name__}) must be a float (the softmax scale, e.g. "
                        "1 / math.sqrt(head_dim)) or None for 1 / sqrt(head_dim).")
    if isinstance(scale, numbers.Real) and not math.isfinite(scale):  # (every output NaN, without a word)
        raise ValueError(f"scale={scale!r} must be finite (the softmax scale, e.g. 1 / math.sqrt(head_dim)), or None "
                         "for 1 / sqrt(head_dim).")


def check_meta(name: str, meta: Any, optional: bool = True) -> None:
    """Raise TypeError unless `meta` is a `TokenMeta`, or None (the default) where `optional` (before anything reads
    its tensors)."""
    if not isinstance(meta, TokenMeta) and not (optional and meta is None):
        raise TypeError(f"{name} must be a TokenMeta (TokenMeta.contiguous(batch, seq_len), TokenMeta.from_segments("
                        f"segment ids [B, S])){' or None (one causal document per row)' if optional else ''}; got "
                        f"{type(meta).__name__}.")


def check_dims(q: Any, k: Any, v: Any) -> None:
    """Raise TypeError / ValueError unless q, k and v are 4-D tensors (what `check_tensors` checks first; the attention
    backend checks it before reading their shapes, and the rest after autocast casts them)."""
    check_tensor_types(q, k, v)
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be 4-D [batch, heads, seq, head_dim]; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)} (transformers' layout: transpose [B, S, H, D] "
                         "with .transpose(1, 2)).")
    if min(q.shape[3], k.shape[3], v.shape[3]) < 1:  # (the backend's default scale 1 / sqrt(0) divided by zero)
        dims = ", ".join(map(str, dict.fromkeys((q.shape[3], k.shape[3], v.shape[3]))))
        raise ValueError(f"q, k, v have head_dim {dims}: attention needs at least 1 (the last dimension of [B, H, S, "
                         "D]).")


def check_tensors(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Raise ValueError, naming the fix, unless q is [B, Hq, Sq, D] and k, v [B, Hkv, Sk, D] in one
    floating dtype on one device, with Hq a multiple of Hkv (D at least 1: `check_dims`)."""
    check_dims(q, k, v)
    b, hq, sq, d = q.shape
    if k.shape != v.shape or k.shape[0] != b or k.shape[3] != d:
        raise ValueError(f"k and v must be [B, Hkv, Sk, {d}] with q's batch {b}; got k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}.")
    if k.shape[1] == 0:  # (Hq % 0: a ZeroDivisionError)
        raise ValueError(f"k and v have 0 key/value heads ({tuple(k.shape)}): attention needs at least 1.")
    if hq % k.shape[1]:
        raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({k.shape[1]}).")
    if not q.is_floating_point() or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v must share one floating dtype; got {q.dtype}, {k.dtype}, {v.dtype} (cast k and v "
                         "with .to(q.dtype)).")
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"q, k, v must be on one device; got {q.device}, {k.device}, {v.device}.")


def check_attention_inputs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: SparseLayout, q_meta: TokenMeta, k_meta: TokenMeta
) -> None:
    """`check_tensors`, and the layout and the token metadata fit them (same shapes, same device)."""
    check_tensors(q, k, v)
    b, hq, sq, _ = q.shape
    layout.check_fits(hq, sq, batch=b)
    for name, meta, length in (("q_meta", q_meta, sq), ("k_meta", k_meta, k.shape[2])):
        if meta.index.shape != (b, length) or meta.segment.shape != (b, length):
            raise ValueError(f"{name} must hold index and segment of shape [B, S] = {(b, length)}; got "
                             f"{tuple(meta.index.shape)} and {tuple(meta.segment.shape)}.")
    stray = {name: t.device for name, t in (("layout", layout.block_idx), ("q_meta", q_meta.index),
                                            ("k_meta", k_meta.index)) if t.device != q.device}
    if stray:
        raise ValueError(f"{', '.join(stray)} must be on q's device {q.device}; got {stray} (move them with .to()).")


def _repeats(idx: torch.Tensor, valid: torch.Tensor) -> bool:
    """Whether a row of int64 indices [..., N] lists one of its valid entries twice (in any order)."""
    if idx.shape[-1] < 2:
        return False
    x = torch.where(valid, idx, FAR + torch.arange(idx.shape[-1], device=idx.device)).sort(-1).values
    return bool((x[..., 1:] == x[..., :-1]).any())


def _listed_twice(blk: torch.Tensor, blk_valid: torch.Tensor, col: torch.Tensor, col_valid: torch.Tensor,
                  block_size: int) -> tuple[str, str] | None:
    """What a layout's (int64) key blocks and columns list twice in one query block and how to list it once, in
    words, or None: a key block, a column, or a column inside a listed key block. Sorts and searches, linear in the
    layout's size (up to a log)."""
    drop_repeats = "hf_sparse_cp.attention.layout.compact_sorted(indices, valid) sorts each query block's valid " \
        "indices, drops repeats and counts them"
    if _repeats(blk, blk_valid):
        return "a key block twice", drop_repeats
    if _repeats(col, col_valid):
        return "a key column twice", drop_repeats
    if blk.shape[-1] == 0 or col.shape[-1] == 0:
        return None
    blocks = torch.where(blk_valid, blk, FAR).sort(-1).values.contiguous()
    col_blk = torch.where(col_valid, col // block_size, -1).contiguous()
    at = torch.searchsorted(blocks, col_blk).clamp_max(blocks.shape[-1] - 1)
    if bool((col_valid & (blocks.gather(-1, at) == col_blk)).any()):
        return "a key column inside one of its listed key blocks", "drop the columns whose block (col_idx // " \
            "block_size) the query block lists in block_idx: the block computes them"
    return None


def _strictly_ascending(idx: torch.Tensor, valid: torch.Tensor) -> bool:
    if idx.shape[-1] < 2:
        return True
    both = valid[..., 1:] & valid[..., :-1]
    return bool((idx[..., 1:] > idx[..., :-1])[both].all())


def compact_sorted(candidates: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort each row's valid candidates ascending, drop duplicates, pad with -1.

    candidates, valid: [..., N]. Returns (int32 [..., M], int32 counts [...]) with M the largest count.
    """
    big = torch.iinfo(torch.int64).max
    x = torch.where(valid, candidates.long(), big)
    x, _ = torch.sort(x, dim=-1)
    dup = torch.zeros_like(x, dtype=torch.bool)
    dup[..., 1:] = x[..., 1:] == x[..., :-1]
    x = torch.where(dup, big, x)
    x, _ = torch.sort(x, dim=-1)
    keep = x != big
    cnt = keep.sum(-1)
    width = int(cnt.max()) if cnt.numel() else 0
    x = x[..., :width]
    out = torch.where(keep[..., :width], x, -1).to(torch.int32)
    return out, cnt.to(torch.int32)
