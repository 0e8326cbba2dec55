"""A byte-level tokenizer built in code (no download): 3 special tokens + one token per byte."""

from __future__ import annotations

from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>")


def _byte_to_char() -> dict[int, str]:
    """Map every byte to a printable character (the ByteLevel pre-tokenizer's alphabet)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """Token id = 3 + byte value; ids 0, 1, 2 are <pad>, <bos>, <eos>; rows of up to 2^20 tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for b, ch in sorted(_byte_to_char().items()):
        vocab[ch] = len(SPECIAL_TOKENS) + b
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        model_max_length=1 << 20,
    )
