"""Token ids outside the model's vocabulary, labels outside its head's classes, and a composite model's image or audio
inputs, refused on the host before a context-parallel step.

Under CP a rank embeds its shard of the tokens only: an id at or past the input embedding's rows (or negative) fails
in one rank's embedding while the others wait for it in the ring until the launcher ends them (on CUDA a device-side
assert, reported only at a later host read). A rank scores its shard's targets only, too: a label at or past the
head's classes (or negative, other than -100) fails in one rank's loss while the others wait for it. Reading the ids
back from the device every step to check them would cost a sync per step, so the data loader checks each batch where
it is built, on the host (`CheckedCollate`): every rank of a CP group builds the same batches, so all of them refuse
the same one, before its step, with one error.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, MutableMapping
from typing import Any

import torch
from transformers import PretrainedConfig

from ..distributed.inputs import TOKEN_TYPE_KEYS, check_text_only
from ..integration.heads import LANGUAGE_MODEL, TOKEN_CLASSIFICATION, base_model, model_head

IGNORE_INDEX = -100  # (the target the Trainer's losses skip)
LABEL_KEYS = ("labels", "shift_labels")  # (per-token targets a collator may give)


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
        if (where := _first_true(bad)) is not None:
            raise ValueError(
                f"token id {int(ids[where])} at {key}{list(where)} is outside the model's vocabulary: its input "
                f"embedding has {rows} rows (ids 0 to {rows - 1}). Under context parallelism the rank whose shard "
                "holds it would fail in the embedding while the others wait for it in the ring, so every rank "
                "refuses the batch here. Tokenize with the model's own tokenizer, or grow the embedding to the "
                "tokenizer's vocabulary (model.resize_token_embeddings(len(tokenizer))); check the pad token id too.")


def label_classes_of(model: torch.nn.Module) -> int | None:
    """The classes a per-token label of `model` indexes: its language-model head's outputs (`get_output_embeddings`)
    or its token-classification head's labels; None for another head (a sequence-classification head's labels are
    per row, scored on every rank of the group)."""
    head = model_head(model)
    base = base_model(model)
    if head == LANGUAGE_MODEL:
        weight = getattr(base.get_output_embeddings(), "weight", None)
        return int(weight.shape[0]) if isinstance(weight, torch.Tensor) else None
    if head == TOKEN_CLASSIFICATION:
        return int(base.num_labels)
    return None


def check_label_ids(batch: Any, classes: int) -> None:
    """Raise ValueError, naming the label, where it is, the classes and the fix, if an integer tensor of `batch`'s
    `LABEL_KEYS` holds a label outside [0, classes) other than -100 (`IGNORE_INDEX`)."""
    if not isinstance(batch, Mapping):
        return
    for key in LABEL_KEYS:
        labels = batch.get(key)
        if not isinstance(labels, torch.Tensor) or labels.is_floating_point() or labels.dtype == torch.bool:
            continue
        bad = (labels != IGNORE_INDEX) & ((labels < 0) | (labels >= classes))
        if (where := _first_true(bad)) is not None:
            raise ValueError(
                f"label {int(labels[where])} at {key}{list(where)} is outside the model's {classes} classes (its head "
                f"scores 0 to {classes - 1}; {IGNORE_INDEX} marks a token without a target). One process fails in the "
                "loss; under context parallelism the rank whose shard holds it would fail while the others wait for "
                f"it, so every rank refuses the batch here. Mark the tokens without a target with {IGNORE_INDEX} (as "
                "DataCollatorForLanguageModeling does), and tokenize with the model's own tokenizer or grow the "
                "model to its vocabulary (model.resize_token_embeddings(len(tokenizer))).")


class CheckedCollate:
    """A data loader's `collate_fn` whose batches pass `check_token_ids` against `vocabulary` (`vocabulary_of`; None:
    nothing to check), `check_label_ids` against `classes` (`label_classes_of`; None: nothing to check) and, for a
    composite model (`towers`), `check_text_only` with their token types, which, all zero then, are dropped (a class,
    not a closure: the loader's worker processes may pickle it)."""

    def __init__(self, collate_fn: Callable, vocabulary: tuple[int, frozenset[int]] | None, towers: bool = False,
                 classes: int | None = None) -> None:
        self.collate_fn, self.vocabulary, self.towers, self.classes = collate_fn, vocabulary, towers, classes

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
        if self.classes is not None:
            check_label_ids(batch, self.classes)
        return batch


def _first_true(bad: torch.Tensor) -> tuple[int, ...] | None:
    """The index of `bad`'s first True entry (the one an error names); None where it has none."""
    return tuple(bad.nonzero()[0].tolist()) if bool(bad.any()) else None
