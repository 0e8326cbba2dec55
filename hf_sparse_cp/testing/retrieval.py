"""Needle retrieval in a long text: training rows and held-out prompts, scored by exact match.

A needle is a sentence "The pass key of <name> is <5 digits>." put at a sentence boundary of a window
of real text (the public-domain text of `pretrained`, or any token ids); the question at the end asks
for one name's key. Distractor needles of other names make the answer a lookup, not the only number
in the window. The pieces are tokenized apart and joined as token ids, so a row has exactly the
length asked for and the answer's tokens are known.

* `training_row`: a window with `needles` needles and, at its end, every question with its answer
  (continued training on the text with retrieval mixed in; causal-LM labels on every token).
* `retrieval_prompt`: a held-out window with the asked needle at a given depth, distractors
  elsewhere, one question; `answer_matches` says whether greedy decoding would give the key (every
  answer token is the argmax after the tokens before it: one forward, no generation loop).
* `needle_row`: a window asking for several needles (one per depth), an `AnswerRow` (any row with
  answer spans, as `kv_recall` builds too); `answer_hits` scores each of its answers the same way in
  one forward (several questions per long forward: what makes retrieval at 32K affordable on a CPU).
* `wilson_interval`, `accuracy`, `scores`: 95% confidence intervals of accuracies; `paired_difference_interval`,
  `paired_verdict`: two settings compared on the same questions.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch

NAMES = ("Ruth", "Jonah", "Miriam", "Gideon", "Esther", "Samson", "Deborah", "Elijah", "Hannah", "Caleb",
         "Tamar", "Boaz", "Naomi", "Josiah", "Abigail", "Ezra")


@dataclass(frozen=True)
class RetrievalPrompt:
    """One held-out prompt: `input_ids` end with the answer's tokens (the last `answer_len`)."""

    input_ids: list[int]
    answer_len: int
    depth: float  # where the asked needle sits, as a share of the window before the question

    @property
    def seq_len(self) -> int:
        return len(self.input_ids)


@dataclass(frozen=True)
class AnswerRow:
    """A row with several questions: `input_ids`, its `labels` (the answers' tokens, -100 elsewhere) and, per
    question, the span [start, end) of its answer tokens and how far (in tokens) its fact lies before the
    answer (the fact starts at start - distance); `depths`: where each asked fact sits, as a share of the text
    before the questions (needle rows)."""

    input_ids: list[int]
    labels: list[int]
    answers: list[tuple[int, int]]
    distances: list[int]
    depths: tuple[float, ...] = ()

    @property
    def seq_len(self) -> int:
        return len(self.input_ids)


def text_ids(tokenizer, text: str) -> list[int]:
    """The token ids of `text` alone (no special tokens), as a prompt's pieces are joined."""
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def sentence_ends(tokenizer, haystack: list[int]) -> list[int]:
    """Positions after which a needle may go: after every token whose text ends a sentence."""
    ends = {i for i, t in enumerate(tokenizer.convert_ids_to_tokens(haystack)) if t.rstrip().endswith((".", "!", "?"))}
    return sorted(i + 1 for i in ends)


def _insert(haystack: list[int], pieces: list[tuple[int, list[int]]]) -> list[int]:
    """`haystack` with each (position, tokens) piece inserted at its position (positions of the haystack)."""
    out, prev = [], 0
    for pos, piece in sorted(pieces, key=lambda p: p[0]):
        out += haystack[prev:pos] + piece
        prev = pos
    return out + haystack[prev:]


def _nearest_end(ends: list[int], target: int) -> int:
    return min(ends, key=lambda e: (abs(e - target), e)) if ends else target


def _keys(rng: random.Random, count: int) -> dict[str, str]:
    names = rng.sample(NAMES, count)
    return {name: str(rng.randint(10000, 99999)) for name in names}


def _needle(tokenizer, name: str, key: str) -> list[int]:
    return text_ids(tokenizer, f" The pass key of {name} is {key}.")


def _question(tokenizer, name: str) -> list[int]:
    return text_ids(tokenizer, f" What is the pass key of {name}? The pass key of {name} is")


def _answer(tokenizer, key: str) -> list[int]:
    return text_ids(tokenizer, f" {key}")


def training_row(tokenizer, haystack: list[int], seq_len: int, rng: random.Random, needles: int) -> list[int]:
    """`seq_len` token ids: the start of `haystack` with `needles` needles at random sentence ends, then
    every needle's question followed by its answer and a full stop, in random order."""
    if needles < 1 or needles > len(NAMES):
        raise ValueError(f"needles={needles} must be in [1, {len(NAMES)}].")
    keys = _keys(rng, needles)
    tail = []
    for name in rng.sample(list(keys), len(keys)):
        tail += _question(tokenizer, name) + text_ids(tokenizer, f" {keys[name]}.")
    inserted = [_needle(tokenizer, name, key) for name, key in keys.items()]
    body = seq_len - len(tail) - sum(map(len, inserted))
    if body < 8 or len(haystack) < body:
        raise ValueError(f"a row of {seq_len} tokens cannot hold {needles} needles and their questions "
                         f"({len(tail) + sum(map(len, inserted))} tokens) in a haystack of {len(haystack)}; "
                         "raise seq_len or lower needles.")
    text = haystack[:body]
    ends = [e for e in sentence_ends(tokenizer, text) if e < body] or [body]
    pieces = [(rng.choice(ends), piece) for piece in inserted]
    return _insert(text, pieces) + tail


def retrieval_prompt(tokenizer, haystack: list[int], seq_len: int, depth: float, rng: random.Random,
                     distractors: int, prefix: list[int] | tuple[int, ...] = ()) -> RetrievalPrompt:
    """A prompt of `seq_len` tokens: `prefix` (the tokens the model's tokenizer puts before a text, e.g.
    Gemma's `<bos>`), then the window with the asked needle at `depth` (0: start, 1: just before the question),
    `distractors` needles of other names at random sentence ends, the question and the key."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth={depth} must be in [0, 1].")
    keys = _keys(rng, distractors + 1)
    asked, others = next(iter(keys)), list(keys)[1:]
    answer = _answer(tokenizer, keys[asked])
    question = _question(tokenizer, asked)
    inserted = {name: _needle(tokenizer, name, key) for name, key in keys.items()}
    body = seq_len - len(prefix) - len(question) - len(answer) - sum(map(len, inserted.values()))
    if body < 8 or len(haystack) < body:
        raise ValueError(f"a prompt of {seq_len} tokens cannot hold {distractors + 1} needles, the question and "
                         f"the answer in a haystack of {len(haystack)} tokens; raise seq_len or lower distractors.")
    text = haystack[:body]
    ends = [e for e in sentence_ends(tokenizer, text) if e <= body] or [body]
    pieces = [(_nearest_end(ends, round(depth * body)), inserted[asked])]
    pieces += [(rng.choice(ends), inserted[name]) for name in others]
    ids = list(prefix) + _insert(text, pieces) + question + answer
    return RetrievalPrompt(ids, len(answer), depth)


def needle_row(tokenizer, haystack: list[int], seq_len: int, depths: list[float], rng: random.Random,
               distractors: int, prefix: list[int] | tuple[int, ...] = ()) -> AnswerRow:
    """A row of `seq_len` tokens asking for several needles: `prefix`, then the window with one asked needle
    at each of `depths` (shares of the window before the questions), `distractors` needles of other names at
    random sentence ends, then each asked needle's question and key, in random order (teacher-forced scoring
    gives a later question the earlier answers)."""
    if any(not 0.0 <= d <= 1.0 for d in depths) or not depths:
        raise ValueError(f"depths={depths} must be one or more shares in [0, 1].")
    keys = _keys(rng, len(depths) + distractors)
    names = list(keys)
    asked = names[: len(depths)]
    inserted = {name: _needle(tokenizer, name, key) for name, key in keys.items()}
    tail = {name: (_question(tokenizer, name), _answer(tokenizer, keys[name])) for name in asked}
    body = seq_len - len(prefix) - sum(map(len, inserted.values())) - sum(len(q) + len(a) for q, a in tail.values())
    if body < 8 or len(haystack) < body:
        raise ValueError(f"a row of {seq_len} tokens cannot hold {len(keys)} needles and {len(depths)} questions in "
                         f"a haystack of {len(haystack)} tokens; raise seq_len or lower distractors.")
    text = haystack[:body]
    ends = [e for e in sentence_ends(tokenizer, text) if e <= body] or [body]
    at = {name: _nearest_end(ends, round(d * body)) for name, d in zip(asked, depths)}
    at |= {name: rng.choice(ends) for name in names[len(depths):]}
    ids, where = list(prefix), {}
    prev = 0
    for name in sorted(names, key=lambda n: (at[n], names.index(n))):
        ids += text[prev:at[name]]
        where[name] = len(ids)
        ids += inserted[name]
        prev = at[name]
    ids += text[prev:]
    labels = [-100] * len(ids)
    order = rng.sample(range(len(asked)), len(asked))
    answers, distances = [None] * len(asked), [0] * len(asked)
    for i in order:  # the spans and distances stay in the order of `depths`
        question, answer = tail[asked[i]]
        distances[i] = len(ids) + len(question) - where[asked[i]]
        ids += question
        answers[i] = (len(ids), len(ids) + len(answer))
        ids += answer
        labels += [-100] * len(question) + answer
    return AnswerRow(ids, labels, answers, distances, tuple(depths))


@torch.no_grad()
def answer_hits(model: torch.nn.Module, row: AnswerRow) -> list[bool]:
    """Per question of `row`, whether greedy decoding gives its answer: every answer token is the argmax of the
    model's next-token logits after the tokens before it (one forward, teacher-forced; the logits only at the
    answers). The forward reads the whole row, as training does: a pattern that starts at the row's length
    (`min_seq_len`) runs; the row without its last token would be one token short of it and served dense."""
    device = next(model.parameters()).device
    hidden = model.get_decoder()(torch.tensor([row.input_ids], device=device)).last_hidden_state[0]
    head = model.get_output_embeddings()
    hits = []
    for start, end in row.answers:
        predicted = head(hidden[start - 1:end - 1]).argmax(-1)
        hits.append(bool((predicted == torch.tensor(row.input_ids[start:end], device=device)).all()))
    return hits


def prompt_set(tokenizer, haystack: list[int], lengths: list[int], depths: list[float], per_cell: int,
               distractors: int, seed: int, prefix: list[int] | tuple[int, ...] = ()) -> list[RetrievalPrompt]:
    """`per_cell` prompts per (length, depth), cells in turn: prompt i's text is the i-th window of the longest
    length of `haystack`, wrapping round to its start when it holds fewer (each prompt's needles, keys and depth
    are its own), drawn from one generator seeded with `seed`."""
    longest = max(lengths)
    if len(haystack) < longest:
        raise ValueError(f"the haystack holds {len(haystack)} tokens, fewer than the longest prompt ({longest}); "
                         "give more text or shorter lengths.")
    cells = [(s, d) for s in lengths for d in depths]
    rng = random.Random(seed)
    prompts = []
    for i in range(per_cell * len(cells)):
        s, d = cells[i % len(cells)]
        start = i * longest % (len(haystack) - longest + 1)
        prompts.append(retrieval_prompt(tokenizer, haystack[start:start + longest], s, d, rng, distractors, prefix))
    return prompts


def accuracy(hits: list[bool]) -> dict:
    """{correct, prompts, accuracy, wilson95} of exact-match results."""
    k, n = sum(hits), len(hits)
    return {"correct": k, "prompts": n, "accuracy": k / n if n else None, "wilson95": list(wilson_interval(k, n))}


def scores(results: list[tuple[int, float, bool]]) -> dict:
    """Exact-match accuracy overall, per length and per (length, depth) ('<length>@<depth>') of (length, depth,
    hit) results, with Wilson 95% intervals."""
    per_length: dict[str, list[bool]] = {}
    per_cell: dict[str, list[bool]] = {}
    for seq_len, depth, hit in results:
        per_length.setdefault(str(seq_len), []).append(hit)
        per_cell.setdefault(f"{seq_len}@{depth:g}", []).append(hit)
    return {**accuracy([hit for _, _, hit in results]), "per_length": {k: accuracy(v) for k, v in per_length.items()},
            "per_cell": {k: accuracy(v) for k, v in per_cell.items()}}


@torch.no_grad()
def answer_matches(model: torch.nn.Module, prompt: RetrievalPrompt) -> bool:
    """Whether greedy decoding after the question gives the key exactly: every answer token is the
    argmax of the model's next-token logits after the tokens before it (teacher forcing, which
    decides the same as generating while every earlier answer token was right)."""
    device = next(model.parameters()).device
    ids = torch.tensor([prompt.input_ids], device=device)  # the whole prompt, as `answer_hits` says why
    logits = model(ids, logits_to_keep=prompt.answer_len + 1).logits[0, :-1]
    answer = torch.tensor(prompt.input_ids[-prompt.answer_len:], device=device)
    return bool((logits.argmax(-1) == answer).all())


def wilson_interval(successes: int, trials: int, z: float = 1.959964) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion (95% for the default z); (0, 1) for no trials."""
    if trials == 0:
        return 0.0, 1.0
    if not 0 <= successes <= trials:
        raise ValueError(f"successes={successes} must be in [0, trials={trials}].")
    p = successes / trials
    centre = (p + z * z / (2 * trials)) / (1 + z * z / trials)
    half = z / (1 + z * z / trials) * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials))
    return max(0.0, centre - half), min(1.0, centre + half)


def paired_difference_interval(both: int, first_only: int, second_only: int, neither: int,
                               z: float = 1.959964) -> tuple[float, float]:
    """95% interval (the default z) of p_second - p_first, two accuracies measured on the same questions, from the
    counts of questions both answer, the first only, the second only and neither: Newcombe's (1998, Statistics in
    Medicine 17:2635, method 10) score interval for paired proportions, the Wilson intervals of the two joined with
    the pairs' correlation; (-1, 1) for no questions."""
    counts = (both, first_only, second_only, neither)
    if min(counts) < 0:
        raise ValueError(f"paired counts {counts} must be >= 0.")
    n = sum(counts)
    if n == 0:
        return -1.0, 1.0
    a, b, c, d = counts
    p1, p2 = (a + b) / n, (a + c) / n
    (l1, u1), (l2, u2) = wilson_interval(a + b, n, z), wilson_interval(a + c, n, z)
    margins = (a + b) * (c + d) * (a + c) * (b + d)
    cross = a * d - b * c
    phi = 0.0 if margins == 0 else (max(cross - n / 2, 0.0) if cross > 0 else cross) / math.sqrt(margins)
    below = math.sqrt(max((u1 - p1) ** 2 - 2 * phi * (u1 - p1) * (p2 - l2) + (p2 - l2) ** 2, 0.0))
    above = math.sqrt(max((p1 - l1) ** 2 - 2 * phi * (p1 - l1) * (u2 - p2) + (u2 - p2) ** 2, 0.0))
    return max(-1.0, p2 - p1 - below), min(1.0, p2 - p1 + above)


def paired_verdict(reference: list[bool], candidate: list[bool], margin: float) -> dict:
    """Whether `candidate` keeps `reference`'s accuracy on the same questions (hits in the same order), to within
    `margin` (a fraction of the questions), from the 95% interval of candidate - reference accuracy
    (`paired_difference_interval`): 'pass' where it lies above -margin (the candidate loses less than the margin),
    'fail' where it lies below (it loses more), else 'inconclusive' (too few questions, or a loss near the margin,
    to tell). Returns the counts (both right, the reference's alone, the candidate's alone, neither), the
    difference, the interval and the verdict."""
    if len(reference) != len(candidate):
        raise ValueError(f"paired hits must be of the same questions: {len(reference)} and {len(candidate)}.")
    if not 0 < margin < 1:
        raise ValueError(f"margin={margin} must lie in (0, 1).")
    pairs = list(zip(reference, candidate))
    counts = [pairs.count(p) for p in ((True, True), (True, False), (False, True), (False, False))]
    lo, hi = paired_difference_interval(*counts)
    n = len(pairs)
    verdict = "pass" if lo > -margin else "fail" if hi < -margin else "inconclusive"
    return {"both": counts[0], "reference_only": counts[1], "candidate_only": counts[2], "neither": counts[3],
            "difference": (counts[2] - counts[1]) / n if n else None, "interval95": [lo, hi], "verdict": verdict}
