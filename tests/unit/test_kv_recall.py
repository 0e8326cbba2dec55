"""Key-value recall rows (`hf_sparse_cp.testing.kv_recall`, #53): exact length, one record per name, the asked
records far before their questions, labels on the answers alone."""

import random

import pytest

from hf_sparse_cp.examples.tokenizer import byte_tokenizer
from hf_sparse_cp.testing import kv_recall

TEXT = "And it came to pass in those days. The people went out! Who shall go up? They rested there. " * 200


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


def test_a_row_states_each_record_once_and_asks_the_early_ones(tok):
    ids = tok(TEXT, add_special_tokens=False)["input_ids"]
    row = kv_recall.recall_row(tok, ids, 4096, random.Random(0), records=20, questions=5, ask_within=0.5,
                               prefix=[1])
    assert row.seq_len == 4096 and row.input_ids[0] == 1 and len(row.answers) == 5
    text = tok.decode(row.input_ids)
    records = [part.split("'s code word is ") for part in text.split(". ") if "'s code word is " in part]
    stated = {r[0].rsplit(" ", 1)[-1]: r[1] for r in records}
    assert len(stated) == 20  # twenty distinct names, one record each
    order = sorted(stated, key=lambda n: text.index(f" {n}'s code word is "))
    for (start, end), distance in zip(row.answers, row.distances):
        answer = tok.decode(row.input_ids[start:end]).strip()
        name = tok.decode(row.input_ids[:start]).rsplit(" Q: ", 1)[1].split("?")[0]
        assert stated[name] == answer and answer in kv_recall.VALUES
        assert order.index(name) < 10  # among the first half of the records by position
        record = len(tok.decode(row.input_ids[:start - distance]))  # the record sits `distance` tokens back
        assert text[record:].startswith(f" {name}'s code word is {answer}.")
    labelled = [i for i, label in enumerate(row.labels) if label != -100]
    assert labelled == [i for start, end in row.answers for i in range(start, end)]


def test_one_token_keys_and_values_where_the_tokenizer_has_enough(tok):
    class Words:  # a tokenizer reading every word as one token
        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [hash(w) % 1000 for w in text.split()]}

    assert kv_recall.one_token(Words(), kv_recall.NAMES, 150) == list(kv_recall.NAMES)
    assert kv_recall.one_token(tok, kv_recall.NAMES, 1) == list(kv_recall.NAMES)  # bytes: none is one token


def test_rows_that_cannot_fit_are_refused(tok):
    ids = tok(TEXT, add_special_tokens=False)["input_ids"]
    with pytest.raises(ValueError, match="cannot hold 30 records"):
        kv_recall.recall_row(tok, ids, 512, random.Random(0), records=30, questions=2)
    with pytest.raises(ValueError, match="questions=5 and records=3"):
        kv_recall.recall_row(tok, ids, 4096, random.Random(0), records=3, questions=5)
