"""Synthetic long-context data: passkey retrieval (a number hidden in filler, asked for at the end)."""

from __future__ import annotations

import os
import random
from pathlib import Path

from datasets import Dataset
from datasets import config as datasets_config
from datasets.fingerprint import Hasher
from transformers import PreTrainedTokenizerBase

FILLER = (
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
)
QUESTION = "What is the pass key? The pass key is "


def _needle(key: str) -> str:
    return f"The pass key is {key}. Remember it. {key} is the pass key. "


def _filler(seq_len_chars: int, key: str) -> str:
    """Whole filler sentences, at least the characters an example of `seq_len_chars` leaves for them."""
    body_len = max(0, seq_len_chars - len(_needle(key)) - len(QUESTION) - len(key) - 1)
    return FILLER * (body_len // len(FILLER) + 1)


def _draw(seq_len_chars: int, rng: random.Random, margin: int) -> tuple[str, int]:
    """The random choices of one example, drawn from `rng` in a fixed order: (key, needle position
    before it moves to a sentence boundary). Drawn apart from the text so that a dataset can draw every
    example's choices in sequence, cheaply, and build the texts in `Dataset.map`."""
    key = str(rng.randint(10000, 99999))
    filler_len = len(_filler(seq_len_chars, key))
    return key, rng.randint(min(margin, filler_len), filler_len)


def _compose(seq_len_chars: int, key: str, cut: int) -> str:
    filler = _filler(seq_len_chars, key)
    cut = filler.rfind(". ", 0, cut) + 2 if ". " in filler[:cut] else 0  # insert at a sentence boundary
    return filler[:cut] + _needle(key) + filler[cut:] + QUESTION + key + "."


def passkey_text(seq_len_chars: int, rng: random.Random) -> tuple[str, str]:
    """One example of at least `seq_len_chars` characters: (text ending with the answer, the answer)."""
    key, cut = _draw(seq_len_chars, rng, 0)
    return _compose(seq_len_chars, key, cut), key


def _tokenize(batch: dict[str, list], tokenizer: PreTrainedTokenizerBase, seq_len: int,
              text_len: int) -> dict[str, list]:
    """`Dataset.map` function: drawn choices (key, cut) -> tokenized examples of `seq_len` tokens."""
    texts = [_compose(text_len, key, cut) for key, cut in zip(batch["key"], batch["cut"])]
    answers = tokenizer([key + "." for key in batch["key"]], add_special_tokens=False)["input_ids"]
    rows = {"input_ids": [], "labels": [], "answer_start": []}
    for ids, answer in zip(tokenizer(texts, add_special_tokens=False)["input_ids"], answers):
        ids = ids[-seq_len:]  # trim filler from the front; the needle sits anywhere but the question stays
        if len(ids) < seq_len:
            raise ValueError(f"generated {len(ids)} tokens, fewer than seq_len={seq_len}; raise the text length.")
        rows["input_ids"].append(ids)
        rows["labels"].append(list(ids))
        rows["answer_start"].append(seq_len - len(answer))
    return rows


# Memory the build of one sequence takes per token (its text, the tokenizer's output, the arrow batch): measured
# 216-239 bytes as peak growth at 1M-4M tokens with the example's byte tokenizer; the bound below uses 200.
BUILD_BYTES_PER_TOKEN = 200


def check_buildable(seq_len: int, flag: str = "--sparse_max_length",
                    other_fix: str = "raise --pack_documents (documents of max_length / N tokens each)") -> None:
    """Raise ValueError, naming the fix (lower `flag`, or `other_fix`), when building one `seq_len`-token sequence
    would take more memory than the machine has (it ended in a MemoryError traceback after every process started)."""
    try:
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):  # (a platform without them: nothing to check against)
        return
    need = seq_len * BUILD_BYTES_PER_TOKEN
    if need > total:
        raise ValueError(f"a passkey sequence of {seq_len} tokens takes at least {need / 2**30:.0f} GiB of memory to "
                         f"build ({BUILD_BYTES_PER_TOKEN} bytes per token), more than this machine's "
                         f"{total / 2**30:.0f} GiB: lower {flag} (at most {total // BUILD_BYTES_PER_TOKEN} here), or "
                         f"{other_fix}.")


def passkey_dataset(
    tokenizer: PreTrainedTokenizerBase, num_samples: int, seq_len: int, seed: int = 0,
    cache_dir: str | Path | None = None,
) -> Dataset:
    """Tokenized passkey examples of exactly `seq_len` tokens, with causal-LM labels on every token.

    `answer_start` holds the index of the first answer token (for retrieval accuracy).

    Built with `Dataset.map` (a progress bar) into a cache file under `cache_dir` (default: the
    `datasets` cache, `HF_DATASETS_CACHE`) named by everything the data depends on: this file's code,
    the tokenizer, `num_samples`, `seq_len` and `seed`. A later call with the same inputs loads that
    file instead of building it again; in a distributed run, call it inside
    `TrainingArguments.main_process_first()` so that one process per node builds the data and the
    others load it. The same seed gives the same data as the loop this replaced (one `random.Random(seed)`
    drawing each example's key and needle position in turn).
    """
    rng = random.Random(seed)
    probe = tokenizer(FILLER * 8, add_special_tokens=False)["input_ids"]
    if not probe:  # (no text could give seq_len tokens)
        raise ValueError(
            f"the tokenizer {tokenizer.name_or_path!r} turns text into no tokens ({len(tokenizer)} entries in its "
            "vocabulary): a model folder without the tokenizer's files loads an empty one. Save the model's tokenizer "
            "into that folder (tokenizer.save_pretrained(folder), as trainer.save_model() does with a "
            "processing_class), or load one that has them.")
    chars_per_token = len(FILLER * 8) / len(probe)
    text_len = int(seq_len * chars_per_token) + 64
    draws = [_draw(text_len, rng, margin=len(FILLER) + 64) for _ in range(num_samples)]
    fingerprint = Hasher.hash((Path(__file__).read_bytes(), Hasher.hash(tokenizer), num_samples, seq_len, seed))
    cache = Path(cache_dir or datasets_config.HF_DATASETS_CACHE) / "hf_sparse_cp_passkey" / f"{fingerprint}.arrow"
    cache.parent.mkdir(parents=True, exist_ok=True)
    rows = max(1, (1 << 22) // seq_len)  # examples per batch: about 4M tokens per column in memory at a time
    source = Dataset.from_dict({"key": [key for key, _ in draws], "cut": [cut for _, cut in draws]})
    return source.map(
        _tokenize, batched=True, batch_size=rows, writer_batch_size=rows, remove_columns=["key", "cut"],
        fn_kwargs={"tokenizer": tokenizer, "seq_len": seq_len, "text_len": text_len},
        # the name holds every input, so an existing file is this data (even with datasets' caching disabled)
        cache_file_name=str(cache), load_from_cache_file=True, new_fingerprint=fingerprint,
        desc=f"Passkey data ({num_samples} x {seq_len} tokens)",
    )
