"""Synthetic long-context data: passkey retrieval (a number hidden in filler, asked for at the end)."""

from __future__ import annotations

import random

from datasets import Dataset
from transformers import PreTrainedTokenizerBase

FILLER = (
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
)
QUESTION = "What is the pass key? The pass key is "


def passkey_text(seq_len_chars: int, rng: random.Random, margin: int = 0) -> tuple[str, str]:
    """One example of at least `seq_len_chars` characters: (text ending with the answer, the answer).

    The needle is never placed in the first `margin` characters (which a caller may trim).
    """
    key = str(rng.randint(10000, 99999))
    needle = f"The pass key is {key}. Remember it. {key} is the pass key. "
    body_len = max(0, seq_len_chars - len(needle) - len(QUESTION) - len(key) - 1)
    filler = FILLER * (body_len // len(FILLER) + 1)  # whole sentences, at least body_len characters
    cut = rng.randint(min(margin, len(filler)), len(filler))
    cut = filler.rfind(". ", 0, cut) + 2 if ". " in filler[:cut] else 0  # insert at a sentence boundary
    return filler[:cut] + needle + filler[cut:] + QUESTION + key + ".", key


def passkey_dataset(
    tokenizer: PreTrainedTokenizerBase, num_samples: int, seq_len: int, seed: int = 0
) -> Dataset:
    """Tokenized passkey examples of exactly `seq_len` tokens, with causal-LM labels on every token.

    `answer_start` holds the index of the first answer token (for retrieval accuracy).
    """
    rng = random.Random(seed)
    rows = {"input_ids": [], "labels": [], "answer_start": []}
    probe = tokenizer(FILLER * 8, add_special_tokens=False)["input_ids"]
    chars_per_token = len(FILLER * 8) / max(1, len(probe))
    for _ in range(num_samples):
        text, key = passkey_text(int(seq_len * chars_per_token) + 64, rng, margin=len(FILLER) + 64)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        answer_len = len(tokenizer(key + ".", add_special_tokens=False)["input_ids"])
        ids = ids[-seq_len:]  # trim filler from the front; the needle sits anywhere but the question stays
        if len(ids) < seq_len:
            raise ValueError(f"generated {len(ids)} tokens, fewer than seq_len={seq_len}; raise the text length.")
        rows["input_ids"].append(ids)
        rows["labels"].append(list(ids))
        rows["answer_start"].append(seq_len - answer_len)
    return Dataset.from_dict(rows)
