"""Heads that read the padding after a row's tokens (#50), which sparse_cp gives no attention (output 0, as
flash_attention_2 does) where SDPA attends it to the row's tokens. transformers' question-answering loss takes a
softmax of the start and end logits over every position of the row, padding included: a right-padded batch's loss
differed from SDPA's (tiny Llama, fp64, every block kept: 4.3380 against 4.3491) without a word, while the docs said no
loss reads those positions; a sequence-classification head whose config's pad_token_id is not the token padding the
batch pools a padding position (its logits 0.16 from SDPA's). Now the first such forward says so, naming the fix (left
padding, which gives SDPA's logits and loss, tested below; the config's pad_token_id)."""

import copy
import logging
import re

import pytest
import torch
import transformers

import hf_sparse_cp
from hf_sparse_cp import SparseAttentionConfig
from hf_sparse_cp.testing.tiny_models import tiny_config

pytestmark = pytest.mark.usefixtures("patched")

KEEP_ALL = SparseAttentionConfig(block_size=16, min_seq_len=0, sink_tokens=0, dense_first_layers=0,
                                 vertical_topk=10**4, slash_topk=10**4)  # (SDPA's attention, sparse path)
NOTE = r"A head on sparse_cp reads padding otherwise than SDPA: a question-answering head .* pad on the left"
SAID = "reads padding otherwise than SDPA"


def _models(auto: str = "AutoModelForQuestionAnswering", pad_token_id: int = 0):
    config = tiny_config("llama", num_labels=3, classifier_dropout=0.0, pad_token_id=pad_token_id)
    torch.manual_seed(0)
    reference = getattr(transformers, auto).from_config(config, attn_implementation="sdpa").double()
    model = copy.deepcopy(reference)
    hf_sparse_cp.configure(model, KEEP_ALL)
    return reference, model


def _batch(side: str) -> dict:
    """2 rows of 80 tokens, the second padded from 60 tokens on `side` ('none': unpadded; 'gap': padding between
    tokens), with answers inside the rows' tokens."""
    ids = torch.randint(3, 250, (2, 80), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    pads = {"right": slice(60, None), "left": slice(None, 20), "gap": slice(30, 50), "none": slice(0, 0)}[side]
    mask[1, pads] = 0
    ids[mask == 0] = 0
    return {"input_ids": ids, "attention_mask": mask, "start_positions": torch.tensor([3, 55]),
            "end_positions": torch.tensor([5, 58])}


def _loss_and_grads(model, batch):
    out = model(**batch)
    return out.loss.detach(), torch.autograd.grad(out.loss, list(model.parameters()))


def test_a_right_padded_answer_batch_is_noted_once_as_scored_otherwise_than_sdpa(caplog):
    reference, model = _models()
    with caplog.at_level(logging.WARNING, logger="hf_sparse_cp"):
        loss, _ = _loss_and_grads(model, _batch("right"))
        _loss_and_grads(model, _batch("right"))
    notes = [r.getMessage() for r in caplog.records if SAID in r.getMessage()]
    assert len(notes) == 1 and re.search(NOTE, notes[0])
    assert abs(loss - reference(**_batch("right")).loss.detach()) > 1e-3  # (what it notes)


@pytest.mark.parametrize("side", ["left", "none", "gap"])
def test_an_answer_batch_not_ending_rows_in_padding_trains_as_sdpa_without_a_note(caplog, side):
    """Left padding (the fix the note names), no padding, and padding between a row's tokens (a call that attends every
    key, its padding queries as SDPA's): the loss and gradients equal SDPA's in fp64."""
    reference, model = _models()
    with caplog.at_level(logging.WARNING, logger="hf_sparse_cp"):
        (loss, grads), (want, want_grads) = (_loss_and_grads(m, _batch(side)) for m in (model, reference))
    assert not [r for r in caplog.records if SAID in r.getMessage()]
    torch.testing.assert_close(loss, want, rtol=1e-12, atol=1e-12)
    for got, expected in zip(grads, want_grads):
        torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("auto", ["AutoModelForSequenceClassification", "AutoModelForTokenClassification"])
def test_a_head_whose_loss_reads_no_padding_gets_no_note(caplog, auto):
    """A token-classification head (-100 on padding) and a sequence-classification head pooling the last real token
    (its pad_token_id the batch's): the logits equal SDPA's, unnoted."""
    reference, model = _models(auto)
    batch = {k: v for k, v in _batch("right").items() if not k.endswith("_positions")}
    with caplog.at_level(logging.WARNING, logger="hf_sparse_cp"):
        got = model(**batch).logits
    assert not [r for r in caplog.records if SAID in r.getMessage()]
    real = batch["attention_mask"].bool() if got.dim() == 3 else slice(None)
    torch.testing.assert_close(got[real], reference(**batch).logits[real], rtol=1e-12, atol=1e-12)


def test_a_sequence_classification_head_pooling_padding_is_noted_naming_its_pad_token_id(caplog):
    """Its config's pad_token_id (5) is not the token padding the batch (0): transformers pools the row's last
    position, padding, whose logits sparse_cp computes otherwise than SDPA."""
    reference, model = _models("AutoModelForSequenceClassification", pad_token_id=5)
    batch = {k: v for k, v in _batch("right").items() if not k.endswith("_positions")}
    batch["input_ids"] = batch["input_ids"].masked_fill(batch["input_ids"] == 5, 6)
    with caplog.at_level(logging.WARNING, logger="hf_sparse_cp"):
        got = model(**batch).logits
    notes = [r.getMessage() for r in caplog.records if SAID in r.getMessage()]
    assert len(notes) == 1 and re.search(r"pad_token_id \(5\), which in row 1 .* set model.config.pad_token_id",
                                         notes[0])
    assert (got[1] - reference(**batch).logits[1]).abs().max() > 1e-3  # (what it notes)
