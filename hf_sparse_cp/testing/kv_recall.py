"""Key-value recall: a long-range skill to learn (#53), its rows and its score.

A row states many key-value records ("Miriam's code word is falcon.", a name and a word) at sentence ends
of a window of real text, then asks for some of them at its end in another form ("Q: Miriam? A: falcon"):
answering takes finding the one record of the asked name among all the others, stated up to thousands of
tokens earlier, and copying its value. Every name appears in one record of its row and is asked at most
once, values repeat (names and values the tokenizer reads as one token where it has enough: `one_token`, so
that an answer is one token and its lookup the whole skill); the asked records are
drawn from the first `ask_within` share of the records (so they lie far before the questions). The pieces
are tokenized apart and joined as token ids, so a row has exactly the length asked for and the answers'
tokens are known: `labels` hold them and -100 elsewhere (a loss on the recall alone).

`retrieval.answer_hits` scores a row in one forward: an answer is right when every one of its tokens is the
argmax after the tokens before it (teacher forcing: the earlier questions come with their right answers, as in
training, which also shows the format in context).
"""

from __future__ import annotations

import random

from .retrieval import AnswerRow, sentence_ends, text_ids

# First names, the keys.
NAMES = tuple("""Aaron Abigail Adam Adrian Agnes Alan Albert Alice Allen Amanda Amber Amos Amy Andrea Andrew Angela
Anna Anne Anthony Arthur Barbara Barry Beatrice Benjamin Bernard Betty Beverly Bill Bob Bonnie Brenda Brian Bruce
Caleb Carl Carlos Carmen Carol Caroline Catherine Cecil Charles Charlotte Chester Chris Christina Claire Clara
Claude Colin Craig Cynthia Daisy Dan Daniel Daphne David Dean Deborah Dennis Diana Diane Donald Donna Doris Dorothy
Douglas Earl Edgar Edith Edward Edwin Eileen Elaine Eleanor Eli Elijah Elizabeth Ellen Elsie Emily Emma Eric Ernest
Esther Ethel Eugene Eva Evelyn Ezra Felix Florence Frances Frank Fred Gabriel Gary George Gerald Gideon Gilbert
Gladys Gloria Gordon Grace Gregory Hannah Harold Harriet Harry Harvey Hazel Heather Helen Henry Herbert Howard Hugh
Ian Irene Isaac Ivan Jack Jacob James Jane Janet Jason Jean Jeffrey Jennifer Jeremy Jerome Jesse Jill Joan Joel
John Jonah Jonathan Joseph Joshua Joyce Judith Julia Julian Justin Karen Kate Keith Kenneth Kevin Laura Lawrence
Leah Leonard Leslie Lillian Linda Lisa Louis Louise Lucy Luke Lydia Mabel Margaret Maria Marion Mark Martha Martin
Mary Matthew Maurice Megan Melvin Michael Miriam Molly Monica Nancy Naomi Nathan Neil Nelson Nicholas Norman Oliver
Oscar Pamela Patricia Paul Pauline Peter Philip Phyllis Rachel Ralph Raymond Rebecca Richard Robert Roger Ronald
Rose Ruby Russell Ruth Samuel Sandra Sarah Scott Sharon Shirley Simon Sophie Stanley Stella Stephen Steven Susan
Sylvia Teresa Thelma Theodore Thomas Timothy Tobias Todd Victor Victoria Vincent Violet Virginia Walter Wayne Wendy
William Yvonne Zachary""".split())
# The values: words.
VALUES = tuple("""apple river candle garden window pencil rabbit mirror basket anchor bottle bridge butter castle cherry
copper cotton desert dragon engine feather forest island jacket kettle ladder lemon marble meadow needle orange
parrot pepper pillow planet pocket rocket saddle silver spider summer tiger tomato tunnel turtle valley velvet
violin wagon walnut whale winter yellow zebra falcon harbor hammer helmet honey lantern lizard magnet monkey ocean
oyster panda peanut pirate puzzle quartz rose salmon shadow shovel sugar thunder ticket vessel wolf crystal dolphin
eagle glacier horse insect jungle lion maple nickel olive pearl quilt sparrow umbrella willow zinc amber blossom
cactus fossil granite hazel iris kiwi lotus mango nectar plum""".split())
STATEMENT = " {name}'s code word is {value}."
QUESTION = " Q: {name}? A:"
ANSWER = " {value}"


def one_token(tokenizer, words: tuple[str, ...], needed: int) -> list[str]:
    """Those of `words` that `tokenizer` reads as one token after a space when there are `needed` of them, else
    all of them (a byte-level tokenizer reads none as one token)."""
    one = [w for w in words if len(text_ids(tokenizer, f" {w}")) == 1]
    return one if len(one) >= needed else list(words)


def recall_row(tokenizer, haystack: list[int], seq_len: int, rng: random.Random, records: int, questions: int,
               ask_within: float = 0.75, prefix: list[int] | tuple[int, ...] = ()) -> AnswerRow:
    """A row of `seq_len` tokens: `prefix`, then the start of `haystack` with `records` records (distinct names,
    values drawn from VALUES) at random sentence ends, then `questions` of them asked in random order (drawn from
    the first `ask_within` share of the records by position), each with its answer."""
    names, values = one_token(tokenizer, NAMES, records), one_token(tokenizer, VALUES, 2)
    if not 1 <= questions <= records <= len(names):
        raise ValueError(f"questions={questions} and records={records} must satisfy 1 <= questions <= records <= "
                         f"{len(names)} (the names of kv_recall.NAMES).")
    if not 0.0 < ask_within <= 1.0:
        raise ValueError(f"ask_within={ask_within} must be in (0, 1].")
    keys = {name: rng.choice(values) for name in rng.sample(names, records)}  # in the order they will stand
    asked = rng.sample(list(keys)[: max(questions, round(ask_within * records))], questions)
    stated = {n: text_ids(tokenizer, STATEMENT.format(name=n, value=v)) for n, v in keys.items()}
    asks = [(text_ids(tokenizer, QUESTION.format(name=n)), text_ids(tokenizer, ANSWER.format(value=keys[n])))
            for n in asked]
    body = seq_len - len(prefix) - sum(map(len, stated.values())) - sum(len(q) + len(a) for q, a in asks)
    if body < 8 or len(haystack) < body:
        raise ValueError(f"a row of {seq_len} tokens cannot hold {records} records and {questions} questions in a "
                         f"haystack of {len(haystack)} tokens; raise seq_len or lower records.")
    text = haystack[:body]
    ends = [e for e in sentence_ends(tokenizer, text) if e < body] or [body]
    at = sorted(rng.choice(ends) for _ in keys)  # the records in the order of `keys`, at sorted positions
    ids, prev, where = list(prefix), 0, {}
    for name, pos in zip(keys, at):
        ids += text[prev:pos]
        where[name] = len(ids)
        ids += stated[name]
        prev = pos
    ids += text[prev:]
    labels = [-100] * len(ids)
    answers, distances = [], []
    for name, (question, answer) in zip(asked, asks):
        distances.append(len(ids) + len(question) - where[name])
        ids += question
        answers.append((len(ids), len(ids) + len(answer)))
        ids += answer
        labels += [-100] * len(question) + answer
    return AnswerRow(ids, labels, answers, distances)
