"""Token ids outside the model's vocabulary, and a composite model's image or audio inputs, refused on the host before
a context-parallel step.

Under CP a rank embeds its shard of the tokens only: an id at or past the input embedding's rows (or negative) fails
in one rank's embedding while the others wait for it in the ring until the launcher ends them (on CUDA a device-side
assert, reported only at a later host read). Reading the ids back from the device every step to check them would cost
a sync per step, so the data loader checks each batch where it is built, on the host (`CheckedCollate`): every rank of
a CP group builds the same batches, so all of them refuse the same one, before its step, with one error.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, MutableMapping
from typing import Any

import torch
from transformers import PretrainedConfig

from ..distributed.inputs import TOKEN_TYPE_KEYS, check_text_only


def vocabulary_of(model: torch.nn.Module) -> tuple[int, frozenset[int]] | None:
    """(rows of `model`'s input embedding, the ids outside them that the model replaces before the lookup), or None
    where the input embedding is not an `nn.Embedding` (nothing to check against). The ids replaced are the special
    token ids its config names (`*_token_id`, `*_token_index`, sub-configs too) outside the rows: PaliGemma and
    Gemma 3 swap an image token id at or past the vocabulary for a valid one before embedding."""
    try:
        embedding = model.get_input_embeddings()
    except (AttributeError, NotImplementedError):  # (transformers raises the latter for a model without one)
        return None
    if not isinstance(embedding, torch.nn.Embedding):
        return None
    rows = embedding.num_embeddings
    special = set()
    configs = [getattr(model, "config", None)]
    while configs:
        config = configs.pop()
        for name, value in (vars(config) if config is not None else {}).items():
            if isinstance(value, PretrainedConfig):
                configs.append(value)
            elif name.endswith(("_token_id", "_token_index")):
                special.update(v for v in (value if isinstance(value, (list, tuple)) else [value])
                               if isinstance(v, int) and not 0 <= v < rows)
    return rows, frozenset(special)


def check_token_ids(batch: Any, rows: int, replaced: frozenset[int] = frozenset()) -> None:
    """Raise ValueError, naming the id, where it is, the vocabulary and the fix, if a tensor of token ids of `batch`
    (a mapping: every integer tensor under a key ending in 'input_ids') holds an id outside [0, rows) other than
    `replaced` (`vocabulary_of`)."""
    if not isinstance(batch, Mapping):
        return
    for key, ids in batch.items():
        if not (isinstance(key, str) and key.endswith("input_ids") and isinstance(ids, torch.Tensor)) \
                or ids.is_floating_point() or ids.dtype == torch.bool or not ids.numel():
            continue
        bad = (ids < 0) | (ids >= rows)
        if replaced:
            bad &= ~torch.isin(ids, torch.tensor(sorted(replaced), dtype=ids.dtype, device=ids.device))
        if bool(bad.any()):
            where = tuple(bad.nonzero()[0].tolist())
            raise ValueError(
                f"token id {int(ids[where])} at {key}{list(where)} is outside the model's vocabulary: its input "
                f"embedding has {rows} rows (ids 0 to {rows - 1}). Under context parallelism the rank whose shard "
                "holds it would fail in the embedding while the others wait for it in the ring, so every rank "
                "refuses the batch here. Tokenize with the model's own tokenizer, or grow the embedding to the "
                "tokenizer's vocabulary (model.resize_token_embeddings(len(tokenizer))); check the pad token id too.")


class CheckedCollate:
    """A data loader's `collate_fn` whose batches pass `check_token_ids` against `vocabulary` (`vocabulary_of`; None:
    nothing to check) and, for a composite model (`towers`), `check_text_only` with their token types, which, all
    zero then, are dropped (a class, not a closure: the loader's worker processes may pickle it)."""

    def __init__(self, collate_fn: Callable, vocabulary: tuple[int, frozenset[int]] | None, towers: bool = False
                 ) -> None:
        self.collate_fn, self.vocabulary, self.towers = collate_fn, vocabulary, towers

    def __call__(self, samples):
        batch = self.collate_fn(samples)
        check_text_only(batch, token_types=self.towers)
        if self.towers and isinstance(batch, MutableMapping):
            # all-zero token types (a processor's, for text) mark no image tokens, but Gemma 3 overlays its image
            # mask whenever they are given, which the backend refuses: without them its attention is the same
            for key in [k for k in TOKEN_TYPE_KEYS if isinstance(batch.get(k), torch.Tensor)]:
                del batch[key]
        if self.vocabulary is not None:
            check_token_ids(batch, *self.vocabulary)
        return batch
