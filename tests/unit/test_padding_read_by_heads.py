"""Heads that read the padding after a row's tokens (#50). transformers' question-answering loss takes a softmax of the
start and end logits over every position of the row, padding included, and a sequence-classification head whose
config's pad_token_id is not the token padding the batch (or given inputs_embeds) pools a padding position. sparse_cp
gave those padding queries no attention (output 0, as flash_attention_2 does) where SDPA attends them to the row's
tokens: a right-padded batch's QA loss was 4.3380 against SDPA's 4.3491 (tiny Llama, fp64, every block kept), the
pooled logits 0.16 from SDPA's, and a warning said so. Now the decoder of such a model hands its attention calls the
rows whose padding its head reads (`heads.pass_padding_rows_on`), whose padding queries attend as SDPA's: logits at
every position, loss and gradients are SDPA's in fp64, in eager and compiled forwards. A language model's and a
token-classification head's padding queries (no loss reads them) still cost nothing. Under CP 2:
tests/distributed/test_cp_classification_heads.py."""

import copy
import logging

import pytest
import torch
import transformers

import hf_sparse_cp
from hf_sparse_cp import SparseAttentionConfig
from hf_sparse_cp.attention import sequence as sequence_module
from hf_sparse_cp.attention.build import with_padding_query_blocks
from hf_sparse_cp.attention.layout import SparseLayout
from hf_sparse_cp.attention.sequence import sequence_attention
from hf_sparse_cp.attention.tokens import PAD_SEGMENT, TokenMeta, padding_queries_see_prior_tokens
from hf_sparse_cp.integration import call_tokens as call_tokens_module
from hf_sparse_cp.testing.tiny_models import tiny_config

pytestmark = pytest.mark.usefixtures("patched")

KEEP_ALL = SparseAttentionConfig(block_size=16, min_seq_len=0, sink_tokens=0, dense_first_layers=0,
                                 vertical_topk=10**4, slash_topk=10**4)  # (SDPA's attention, sparse path)
SPARSE = SparseAttentionConfig(block_size=16, min_seq_len=0, sink_tokens=2, dense_first_layers=0, vertical_topk=4,
                               slash_topk=4, local_window=16, last_q=8)
QA, SEQ, TOKEN, LM = ("AutoModelForQuestionAnswering", "AutoModelForSequenceClassification",
                      "AutoModelForTokenClassification", "AutoModelForCausalLM")


def _models(auto: str = QA, pad_token_id: int = 0, family: str = "llama"):
    config = tiny_config(family, num_labels=3, classifier_dropout=0.0, pad_token_id=pad_token_id)
    torch.manual_seed(0)
    reference = getattr(transformers, auto).from_config(config, attn_implementation="sdpa").double()
    model = copy.deepcopy(reference)
    hf_sparse_cp.configure(model, KEEP_ALL)
    return reference, model


def _batch(side: str, auto: str = QA) -> dict:
    """2 rows of 80 tokens, the second padded from 60 tokens on `side` ('none': unpadded; 'gap': padding between
    tokens; 'right': after them), with answers inside the rows' tokens, or labels for `auto`'s head."""
    ids = torch.randint(6, 250, (2, 80), generator=torch.Generator().manual_seed(1))  # (never 5: a pad_token_id)
    mask = torch.ones_like(ids)
    pads = {"right": slice(60, None), "left": slice(None, 20), "gap": slice(30, 50), "none": slice(0, 0)}[side]
    mask[1, pads] = 0
    ids[mask == 0] = 0
    labels = {QA: {"start_positions": torch.tensor([3, 55]), "end_positions": torch.tensor([5, 58])},
              SEQ: {"labels": torch.tensor([0, 2])}, TOKEN: {"labels": (ids % 3).masked_fill(mask == 0, -100)},
              LM: {"labels": ids.masked_fill(mask == 0, -100)}}[auto]
    return {"input_ids": ids, "attention_mask": mask, **labels}


def _outputs(model, batch):
    out = model(**batch)
    logits = out.logits if getattr(out, "logits", None) is not None else torch.stack([out.start_logits,
                                                                                       out.end_logits], -1)
    return logits.detach(), out.loss.detach(), torch.autograd.grad(out.loss, list(model.parameters()),
                                                                           materialize_grads=True)


def _assert_sdpas(got, want):
    (logits, loss, grads), (want_logits, want_loss, want_grads) = got, want
    torch.testing.assert_close(logits, want_logits, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(loss, want_loss, rtol=1e-12, atol=1e-12)
    for g, w in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-12)


def _said(caplog) -> list[str]:
    """The plugin's warnings about padding (transformers' own, e.g. a head that cannot find padding in inputs_embeds,
    logged once per process, are not the plugin's)."""
    return [r.getMessage() for r in caplog.records if "padding" in r.getMessage() and r.levelno >= logging.WARNING
            and r.name.startswith("hf_sparse_cp")]


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_a_right_padded_answer_batch_trains_as_sdpa_at_every_position(caplog, family):
    """The start and end logits at every position, padding included, the loss and the gradients equal SDPA's (before:
    the logits after the row's tokens were those of a zero attention output, loss 4.3380 against 4.3491), unsaid."""
    reference, model = _models(family=family)
    with caplog.at_level(logging.WARNING, logger="hf_sparse_cp"):
        got = _outputs(model, _batch("right"))
    _assert_sdpas(got, _outputs(reference, _batch("right")))
    assert not _said(caplog)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("inputs", ["input_ids", "inputs_embeds"])
def test_a_sequence_classification_head_pooling_padding_gives_sdpas_logits(caplog, family, inputs):
    """Its config's pad_token_id (5) is not the token padding the batch (0), or the batch comes as inputs_embeds:
    transformers pools the row's last position, padding, whose logits, loss and gradients are now SDPA's (before:
    0.16 from them, with a warning)."""
    reference, model = _models(SEQ, pad_token_id=5, family=family)
    batch = _batch("right", SEQ)
    if inputs == "inputs_embeds":
        embed = reference.get_input_embeddings()
        batch["inputs_embeds"] = embed(batch.pop("input_ids")).detach()
    with caplog.at_level(logging.WARNING, logger="hf_sparse_cp"):
        got = _outputs(model, batch)
    _assert_sdpas(got, _outputs(reference, batch))
    assert not _said(caplog)


@pytest.mark.parametrize(("family", "auto"), [("gpt2", QA), ("opt", SEQ), ("gpt_neox", QA), ("stablelm", SEQ)])
def test_heads_of_an_architectures_own_and_layers_not_handing_the_rows_on_give_sdpas_outputs(family, auto):
    """GPT-2's, OPT's and GPT-NeoX's question-answering and sequence-classification heads are their architecture's own
    (no pre-hook gives their decoder the rows), and StableLM's decoder layers do not hand keyword arguments on to
    attention: every row's padding queries attend (`heads.with_padding_rows`), so the logits at every position, the
    loss and the gradients are SDPA's (before: the logits after the row's tokens 0.02-0.15 from SDPA's, unsaid)."""
    reference, model = (m.eval() for m in _models(auto, pad_token_id=5, family=family))  # (GPT-2's, OPT's dropouts)
    batch = _batch("right", auto)
    _assert_sdpas(_outputs(model, batch), _outputs(reference, batch))


def test_a_marked_models_layers_read_the_rows_padding_back_once_per_forward():
    """The every-row tensor `with_padding_rows` hands a marked model's calls is one per forward, so what they read of
    it back to the host is read once, not once per layer (before: a new tensor per call, a host read per layer)."""
    _, model = (m.eval() for m in _models(QA, pad_token_id=5, family="gpt2"))
    assert model.config.num_hidden_layers > 1
    reads = []
    real = call_tokens_module.rows_pad_after_tokens
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(call_tokens_module, "rows_pad_after_tokens", lambda *a: reads.append(1) or real(*a))
        for _ in range(2):
            model(**_batch("right", QA))
    assert len(reads) == 2


def test_a_bare_decoder_gives_sdpas_hidden_states_at_every_position():
    """A model without a head (AutoModel: its hidden states are the output, the caller's to pool) reads padding as
    the caller does: every position's hidden state is SDPA's."""
    reference, model = _models("AutoModel")
    batch = _batch("right", LM)
    del batch["labels"]
    torch.testing.assert_close(model(**batch).last_hidden_state, reference(**batch).last_hidden_state, rtol=1e-12,
                               atol=1e-12)


def test_the_hooks_remover_takes_the_marks_off():
    """`guard_registration` marks the decoder of a head of an architecture's own, and what it returns (the Trainer
    integration's undo) takes the marks off with the hooks."""
    from hf_sparse_cp.integration.registration import guard_registration

    reference, _ = _models(QA, family="gpt2")
    marked = lambda: [m for m in reference.modules() if "_hf_sparse_cp_head_reads_padding" in m.__dict__]  # noqa: E731
    remove = guard_registration(reference)
    assert marked()
    remove()
    assert not marked()


@pytest.mark.parametrize("side", ["left", "none", "gap"])
def test_an_answer_batch_not_ending_rows_in_padding_trains_as_sdpa(side):
    """Left padding, no padding, and padding between a row's tokens (a call that attends every key, its padding
    queries as SDPA's): the loss and gradients equal SDPA's in fp64, as before."""
    reference, model = _models()
    batch = _batch(side)
    # (left padding sees no token under either, and SDPA's output there is no one's: its logits are compared where
    # the row has tokens; every other position is)
    seen = batch["attention_mask"].bool() if side == "left" else slice(None)
    got, want = ((logits[seen], *rest) for logits, *rest in (_outputs(m, batch) for m in (model, reference)))
    _assert_sdpas(got, want)


def _padding_queries_seen(model, batch) -> list[bool]:
    """Whether each sparse call of a forward of `model` on `batch` let a padding query after a row's tokens see keys."""
    seen = []
    real = sequence_module.block_sparse_attention

    def spy(*args, q_meta, k_meta, **kwargs):
        seen.append(bool(((q_meta.segment != PAD_SEGMENT) & (k_meta.segment == PAD_SEGMENT)).any()))
        return real(*args, q_meta=q_meta, k_meta=k_meta, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sequence_module, "block_sparse_attention", spy)
        model(**batch)
    return seen


@pytest.mark.parametrize("auto", [LM, TOKEN, SEQ])
def test_heads_that_read_no_padding_give_padding_queries_no_work(auto):
    """A causal LM and a token-classification head (-100 on padding), and a sequence-classification head pooling the
    last real token (its pad_token_id the batch's): their padding queries still see nothing (no work, output 0, as
    flash_attention_2), and their real tokens' logits are SDPA's."""
    reference, model = _models(auto)
    batch = _batch("right", auto)
    seen = _padding_queries_seen(model, batch)
    assert seen and not any(seen)
    got, want = model(**batch).logits, reference(**batch).logits
    real = batch["attention_mask"].bool() if got.dim() == 3 else slice(None)
    torch.testing.assert_close(got[real], want[real], rtol=1e-12, atol=1e-12)


def test_an_answer_model_gives_its_padding_queries_work():
    """(what the test above checks is not the case for a head that reads padding)"""
    _, model = _models()
    assert all(_padding_queries_seen(model, _batch("right")))


def test_padding_query_blocks_take_the_keys_of_their_rows_last_block_of_tokens():
    """`with_padding_query_blocks`: a query block of padding only that sees tokens takes the key blocks and columns of
    its row's last block holding a token (or of the block of the token `anchors` names); the others keep theirs, and a
    row whose padding stays padding keeps its."""
    segment = torch.zeros(2, 64, dtype=torch.int32)
    segment[0, 20:] = PAD_SEGMENT  # (row 0: tokens in blocks 0-1 of 16, padding from 20)
    segment[1, 40:] = PAD_SEGMENT
    meta = TokenMeta.from_segments(segment)
    q_meta = padding_queries_see_prior_tokens(meta, torch.tensor([True, False]))
    g = torch.Generator().manual_seed(0)
    block_idx = torch.randint(0, 4, (2, 3, 4, 5), generator=g, dtype=torch.int32)
    block_cnt = torch.randint(0, 6, (2, 3, 4), generator=g, dtype=torch.int32)
    col_idx = torch.randint(0, 64, (2, 3, 4, 7), generator=g, dtype=torch.int32)
    col_cnt = torch.randint(0, 8, (2, 3, 4), generator=g, dtype=torch.int32)
    layout = SparseLayout(block_idx, block_cnt, col_idx, col_cnt, 16)
    got = with_padding_query_blocks(layout, meta, q_meta)
    for name in ("block_idx", "block_cnt", "col_idx", "col_cnt"):
        want, have = getattr(layout, name), getattr(got, name)
        assert torch.equal(have[1], want[1]) and torch.equal(have[0, :, :2], want[0, :, :2])
        assert torch.equal(have[0, :, 2], want[0, :, 1]) and torch.equal(have[0, :, 3], want[0, :, 1])
    # (a split that reorders the row, `CPShard.padding_queries`: the block of the token each padding query follows)
    anchors = torch.full((2, 64), -1).index_fill(1, torch.arange(20, 64), 5)
    moved = with_padding_query_blocks(layout, meta, q_meta, anchors)
    assert torch.equal(moved.block_idx[0, :, 2:], layout.block_idx[0, :, :1].expand(-1, 2, -1))
    assert torch.equal(moved.col_idx[1], layout.col_idx[1])


def test_a_sparse_pattern_keeps_its_tokens_outputs_and_attends_the_padding_after_them():
    """Under a sparse pattern (not every block kept) the real queries' outputs are those without the padding rows,
    the padding queries after a row's tokens get an attention output (before: 0), and those of a row not named stay
    0, in fp64."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 200, 16, generator=g, dtype=torch.float64) for h in (4, 2, 2))
    segment = torch.zeros(2, 200, dtype=torch.int32)
    segment[:, 150:] = PAD_SEGMENT
    meta = TokenMeta.from_segments(segment)
    plain, kept = sequence_attention(q, k, v, meta, SPARSE)
    got, got_kept = sequence_attention(q, k, v, meta, SPARSE, padding_rows=torch.tensor([True, False]))
    assert float(kept) < 1 and torch.equal(kept, got_kept)
    torch.testing.assert_close(got[:, :, :150], plain[:, :, :150], rtol=1e-12, atol=1e-12)
    assert not plain[:, :, 150:].any() and not got[1, :, 150:].any()
    assert bool((got[0, :, 150:].abs().sum(-1) > 0).all())


@pytest.mark.skipif(not hasattr(torch, "compile"), reason="no torch.compile")
def test_a_compiled_answer_model_gives_sdpas_outputs(single_thread):
    """Compiled whole (aot_eager: the plan op takes the rows), the right-padded batch's logits, loss and gradients
    are SDPA's, as uncompiled."""
    reference, model = _models()
    torch._dynamo.reset()
    try:
        got = _outputs(torch.compile(model, backend="aot_eager"), _batch("right"))
    finally:
        torch._dynamo.reset()
    _assert_sdpas(got, _outputs(reference, _batch("right")))


def test_the_plan_op_takes_the_rows_and_passes_opcheck():
    """torch.library.opcheck of the compiled path's plan op given the rows (schema, fake implementation, dynamic
    shapes); its query metadata lets row 0's padding queries see its tokens, not row 1's."""
    from hf_sparse_cp.integration.compiled import sequence_plan, settings_key

    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, h, 100, 8, generator=g, dtype=torch.float64) for h in (4, 2))
    mask = torch.ones(2, 100, dtype=torch.long)
    mask[:, 70:] = 0
    args = (q, k, mask, None, None, None, settings_key(SPARSE), 0.3, None, "", True, torch.tensor([True, False]))
    torch.library.opcheck(sequence_plan, args)
    q_segment = sequence_plan(*args)[5]
    assert bool((q_segment[0, 70:] == 0).all()) and bool((q_segment[1, 70:] == PAD_SEGMENT).all())
