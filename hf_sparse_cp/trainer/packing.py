"""Packing that starts every document on a block boundary (`BlockAlignedFlattening`).

A document's sparse pattern is chosen per document at the token level (its own last queries, its
own budget), so *which tokens* it keeps never depends on what else is packed in the row. The
blocks that carry those tokens do: a document that starts `r` tokens into a block is cut into
blocks differently from one that starts on a boundary, and the extra tokens a kept block covers
beyond the kept ones differ, so its output moves by up to the attention mass on those extra
tokens. Packing every document at a block boundary removes that: a document then gets
bit-identical results whatever it is packed with (and at any offset).
"""

from __future__ import annotations

from transformers import DataCollatorWithFlattening

from ..config import check_block_size


class BlockAlignedFlattening(DataCollatorWithFlattening):
    """`DataCollatorWithFlattening` that pads after every document up to the next multiple of
    `block_size` (the attention layout's block, `SparseAttentionConfig.block_size`).

    The padding is a run of its own (its position_ids restart, so no document attends to it) with
    targets -100 (never trained on): with a `separator_id`, the document before the padding predicts it, and
    the padding's last token does not (the next document's first target is -100). Every other behaviour (one
    row, `cu_seq_lens_*` with `return_flash_attn_kwargs`, separator targets) is the parent's.
    """

    def __init__(self, block_size: int, *args, pad_token_id: int = 0, **kwargs) -> None:
        check_block_size(block_size)
        super().__init__(*args, **kwargs)
        self.block_size = block_size
        self.pad_token_id = pad_token_id

    def __call__(self, features, return_tensors=None, separator_id=None):
        aligned, offset, after_padding, padded = [], 0, [], False
        for sample in features:
            ids = sample["input_ids"]
            ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
            labels = sample.get("labels", ids)  # the parent trains on input_ids when no labels are given
            labels = labels.tolist() if hasattr(labels, "tolist") else list(labels)
            if not ids:  # (the parent drops an empty document)
                continue
            if padded:  # its first target, the separator, is what the padding's last token would predict
                after_padding.append(offset)
            aligned.append({"input_ids": ids, "labels": labels})
            gap = -len(ids) % self.block_size
            if gap:
                aligned.append({"input_ids": [self.pad_token_id] * gap, "labels": [-100] * gap})
            offset, padded = offset + len(ids) + gap, gap > 0
        batch = super().__call__(aligned, return_tensors=return_tensors, separator_id=separator_id)
        for start in after_padding:
            batch["labels"][0, start] = -100
        return batch
