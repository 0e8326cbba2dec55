"""Needle rows and prompts (`hf_sparse_cp.testing.retrieval`): exact lengths, where the needles go, the
answer check, and the Wilson interval against published values."""

import random

import pytest
import torch

from hf_sparse_cp.examples.tokenizer import byte_tokenizer
from hf_sparse_cp.testing import retrieval

TEXT = "And it came to pass in those days. The people went out! Who shall go up? They rested there. " * 40


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


def _ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("needles", [1, 3])
def test_training_row_has_the_length_and_every_question_with_its_key(tok, needles):
    row = retrieval.training_row(tok, _ids(tok, TEXT), 1024, random.Random(needles), needles)
    text = tok.decode(row)
    assert len(row) == 1024
    keys = {}
    for name in retrieval.NAMES:
        if f"The pass key of {name} is " in text:
            keys[name] = text.split(f"The pass key of {name} is ")[1][:5]
    assert len(keys) == needles
    for name, key in keys.items():  # the needle, and the answer after its question
        assert f"What is the pass key of {name}? The pass key of {name} is {key}." in text
        assert text.index(f"The pass key of {name} is {key}.") < text.index("What is the pass key")


@pytest.mark.parametrize("depth", [0.0, 0.3, 0.9, 1.0])
def test_retrieval_prompt_puts_the_asked_needle_at_its_depth(tok, depth):
    prompt = retrieval.retrieval_prompt(tok, _ids(tok, TEXT), 2048, depth, random.Random(7), distractors=2)
    assert prompt.seq_len == 2048 and prompt.depth == depth
    text = tok.decode(prompt.input_ids)
    question = text[text.index(" What is the pass key of "):]
    name = question.split("pass key of ")[1].split("?")[0]
    key = tok.decode(prompt.input_ids[-prompt.answer_len:]).strip()
    assert len(key) == 5 and key.isdigit() and text.count("The pass key of ") == 4  # 3 needles + question
    where = text.index(f"The pass key of {name} is {key}.")
    body = len(text) - len(question)
    assert abs(where / body - depth) < 0.1  # at the nearest sentence end (sentences here are ~30 bytes)


def test_retrieval_prompt_refuses_a_length_too_short_for_its_needles(tok):
    with pytest.raises(ValueError, match="cannot hold 4 needles"):
        retrieval.retrieval_prompt(tok, _ids(tok, TEXT), 150, 0.5, random.Random(0), distractors=3)
    with pytest.raises(ValueError, match="depth"):
        retrieval.retrieval_prompt(tok, _ids(tok, TEXT), 2048, 1.5, random.Random(0), distractors=1)


class _Oracle(torch.nn.Module):
    """Next-token logits that put the top score on `answer[i]` at the answer's positions, off by `wrong` (and
    noise after the last token); it keeps the length of what it read."""

    def __init__(self, answer: list[int], wrong: int = 0):
        super().__init__()
        self.answer, self.wrong = answer, wrong
        self.w = torch.nn.Parameter(torch.zeros(1))

    def forward(self, ids, logits_to_keep):
        assert logits_to_keep == len(self.answer) + 1
        self.read = ids.shape[1]
        logits = torch.randn(1, logits_to_keep, 300)
        for i, t in enumerate(self.answer):
            logits[0, i, (t + self.wrong * (i == 1)) % 300] = 100.0
        return type("Out", (), {"logits": logits})


def test_answer_matches_needs_every_answer_token(tok):
    prompt = retrieval.retrieval_prompt(tok, _ids(tok, TEXT), 1024, 0.5, random.Random(1), distractors=1)
    answer = prompt.input_ids[-prompt.answer_len:]
    oracle = _Oracle(answer)
    assert retrieval.answer_matches(oracle, prompt)
    assert not retrieval.answer_matches(_Oracle(answer, wrong=1), prompt)  # one digit off
    # the whole prompt is read: a pattern whose min_seq_len is the prompt's length runs on it
    assert oracle.read == len(prompt.input_ids) == 1024


@pytest.mark.parametrize("k,n,lo,hi", [(0, 10, 0.0, 0.2775), (5, 10, 0.2366, 0.7634), (81, 263, 0.2553, 0.3662),
                                       (10, 10, 0.7225, 1.0)])
def test_wilson_interval_matches_published_values(k, n, lo, hi):
    # (81, 263): Wilson's example as worked in Newcombe (1998), Statistics in Medicine 17:857, method 3
    got = retrieval.wilson_interval(k, n)
    assert got == pytest.approx((lo, hi), abs=5e-4)


def test_wilson_interval_refuses_more_successes_than_trials():
    with pytest.raises(ValueError, match="successes"):
        retrieval.wilson_interval(11, 10)


def test_needle_row_asks_every_depth_once_with_its_key(tok):
    depths = [0.1, 0.5, 0.9]
    row = retrieval.needle_row(tok, _ids(tok, TEXT), 2048, depths, random.Random(3), distractors=2, prefix=[7, 7])
    assert row.seq_len == 2048 and row.input_ids[:2] == [7, 7] and row.depths == tuple(depths)
    text = tok.decode(row.input_ids)
    assert text.count("The pass key of ") == 2 * 3 + 2  # 3 asked needles, their 3 questions' echoes, 2 others
    for (start, end), depth, distance in zip(row.answers, depths, row.distances):
        key = tok.decode(row.input_ids[start:end]).strip()
        question = tok.decode(row.input_ids[:start])
        name = question.rsplit("What is the pass key of ", 1)[1].split("?")[0]
        assert len(key) == 5 and key.isdigit() and f"The pass key of {name} is {key}." in text
        where = len(tok.decode(row.input_ids[:start - distance]))  # the needle sits `distance` tokens back
        assert text[where:].startswith(f" The pass key of {name} is {key}.")
        body = len(tok.decode(row.input_ids[:min(a for a, _ in row.answers)]))
        assert abs(where / body - depth) < 0.1
        assert row.labels[start:end] == row.input_ids[start:end]
    assert sum(label != -100 for label in row.labels) == sum(end - start for start, end in row.answers)
    with pytest.raises(ValueError, match="depths"):
        retrieval.needle_row(tok, _ids(tok, TEXT), 2048, [1.5], random.Random(0), distractors=1)


class _NextToken(torch.nn.Module):
    """A 'model' whose hidden state at each position is the one-hot of the next token of `ids` (with `wrong`
    positions shifted): its argmax head predicts `ids` exactly except there."""

    def __init__(self, ids: list[int], wrong: tuple[int, ...] = (), vocab: int = 300):
        super().__init__()
        self.ids, self.wrong, self.vocab = ids, wrong, vocab
        self.head = torch.nn.Linear(vocab, vocab, bias=False)
        torch.nn.init.eye_(self.head.weight)

    def get_decoder(self):
        def decoder(input_ids):
            self.read = input_ids.shape[1]
            nxt = torch.tensor(self.ids[1:self.read + 1] + [0] * (self.read + 1 - len(self.ids)))
            nxt[list(self.wrong)] = (nxt[list(self.wrong)] + 1) % self.vocab
            return type("Out", (), {"last_hidden_state": torch.nn.functional.one_hot(nxt, self.vocab).float()[None]})
        return decoder

    def get_output_embeddings(self):
        return self.head


def test_answer_hits_scores_each_answer_by_all_its_tokens(tok):
    row = retrieval.needle_row(tok, _ids(tok, TEXT), 1024, [0.2, 0.8], random.Random(1), distractors=1)
    model = _NextToken(row.input_ids)
    assert retrieval.answer_hits(model, row) == [True, True]
    assert model.read == len(row.input_ids) == 1024  # the whole row, as in training (min_seq_len at its length)
    (s0, _), (s1, e1) = row.answers
    # one wrong token in the second answer (predicted at the position before it) fails that answer alone
    assert retrieval.answer_hits(_NextToken(row.input_ids, wrong=(e1 - 2,)), row) == [True, False]
    assert retrieval.answer_hits(_NextToken(row.input_ids, wrong=(s0 - 2,)), row) == [True, True]  # not an answer


def test_scores_count_per_length_and_depth():
    got = retrieval.scores([(512, 0.1, True), (512, 0.9, False), (1024, 0.1, True), (1024, 0.1, True)])
    assert (got["correct"], got["prompts"]) == (3, 4)
    assert got["per_length"]["1024"]["accuracy"] == 1.0 and got["per_cell"]["512@0.9"]["correct"] == 0
    assert got["per_length"]["512"]["wilson95"] == pytest.approx(list(retrieval.wilson_interval(1, 2)))


@pytest.mark.parametrize("counts,lo,hi", [((36, 2, 12, 0), 0.0569, 0.3404), ((263, 3, 15, 21), 0.0117, 0.0707),
                                          ((2, 1, 1, 14), -0.2075, 0.2075)])
def test_paired_difference_interval_matches_newcombes_examples(counts, lo, hi):
    # Newcombe (1998), Statistics in Medicine 17:2635, method 10, its three examples (both, first only, second only,
    # neither): the second accuracy minus the first
    assert retrieval.paired_difference_interval(*counts) == pytest.approx((lo, hi), abs=5e-4)


def test_paired_difference_interval_is_antisymmetric_and_holds_the_difference():
    for counts in ((6, 1, 0, 3), (4, 3, 0, 3), (0, 5, 2, 3), (10, 0, 0, 0), (0, 0, 0, 7), (3, 0, 9, 1)):
        a, b, c, d = counts
        lo, hi = retrieval.paired_difference_interval(*counts)
        assert lo <= (c - b) / sum(counts) <= hi and -1 <= lo and hi <= 1
        assert retrieval.paired_difference_interval(a, c, b, d) == pytest.approx((-hi, -lo))
    assert retrieval.paired_difference_interval(0, 0, 0, 0) == (-1.0, 1.0)
    with pytest.raises(ValueError, match=">= 0"):
        retrieval.paired_difference_interval(1, -1, 0, 0)


def _hits(both: int, reference_only: int, candidate_only: int, neither: int) -> tuple[list[bool], list[bool]]:
    pairs = [(True, True)] * both + [(True, False)] * reference_only + [(False, True)] * candidate_only \
        + [(False, False)] * neither
    return [r for r, _ in pairs], [c for _, c in pairs]


@pytest.mark.parametrize("counts,verdict", [
    ((6, 1, 0, 3), "inconclusive"),  # the 4K report: defaults 6/10 against dense 7/10
    ((4, 3, 0, 3), "inconclusive"),  # the tight budget 4/10: it was a 'pass' (4/10 inside dense's Wilson interval)
    ((7, 0, 0, 3), "inconclusive"),  # the same answers as dense, 10 needles: too few to tell
    ((28, 0, 0, 12), "pass"),  # the same answers, 40 needles
    ((52, 2, 2, 24), "pass"),  # as many lost as gained, 80 needles
    ((20, 4, 12, 4), "pass"),  # better than dense
    ((40, 40, 0, 20), "fail"),  # loses 40 of 100
    ((14, 14, 0, 12), "fail"),  # loses 14 of 40
    ((20, 6, 0, 14), "inconclusive"),  # loses 6 of 40 (0.15): the interval straddles the margin
])
def test_the_paired_verdict_decides_only_where_the_needles_tell(counts, verdict):
    got = retrieval.paired_verdict(*_hits(*counts), margin=0.1)
    assert got["verdict"] == verdict, got
    assert [got[k] for k in ("both", "reference_only", "candidate_only", "neither")] == list(counts)
    assert got["difference"] == pytest.approx((counts[2] - counts[1]) / sum(counts))
    assert got["interval95"] == pytest.approx(list(retrieval.paired_difference_interval(*counts)))


def test_the_paired_verdict_refuses_unpaired_hits_and_a_margin_outside_0_1():
    with pytest.raises(ValueError, match="same questions"):
        retrieval.paired_verdict([True], [True, False], 0.1)
    with pytest.raises(ValueError, match="margin"):
        retrieval.paired_verdict([True], [True], 0.0)
