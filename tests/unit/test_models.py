"""Tiny random models of every supported family: `sparse_cp` against `sdpa`."""

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, DataCollatorWithFlattening

import hf_sparse_cp
from hf_sparse_cp import SparseAttentionConfig
from hf_sparse_cp.attention.tokens import mask_positions as _mask_positions
from hf_sparse_cp.attention.tokens import padding_between_tokens as tokens_gap
from hf_sparse_cp.backends import is_triton_available
from hf_sparse_cp.integration import upstream
from hf_sparse_cp.integration.architectures import lean_loss_model_types
from hf_sparse_cp.integration.backend import sparse_cp_attention_forward
from hf_sparse_cp.integration.stats import pop_kept_fractions
from hf_sparse_cp.testing.tiny_models import tiny_config

from oracle import TOLERANCE, rel_rms

S = 150
DENSE = SparseAttentionConfig(pattern="dense", block_size=32)


pytestmark = pytest.mark.usefixtures("patched")


def _pair(model_type, dtype=torch.float32, config=DENSE, **overrides):
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(tiny_config(model_type, **overrides), attn_implementation="sdpa",
                                           dtype=dtype)
    ours = AutoModelForCausalLM.from_config(tiny_config(model_type, **overrides), dtype=dtype)
    ours.load_state_dict(ref.state_dict())
    hf_sparse_cp.configure(ours, config)
    assert ref.config._attn_implementation == "sdpa" and ours.config._attn_implementation == "sparse_cp"
    return ref, ours


def _loss_and_grads(model, **inputs):
    model.zero_grad()
    out = model(**inputs)
    loss = out.logits.float().logsumexp(-1).mean()  # touches every logit
    loss.backward()
    return out.logits.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("model_type", lean_loss_model_types())
def test_dense_pattern_matches_sdpa(model_type, dtype):
    ref, ours = _pair(model_type, dtype)
    ids = torch.randint(3, 259, (2, S), generator=torch.Generator().manual_seed(1))
    ref_logits, ref_grads = _loss_and_grads(ref, input_ids=ids)
    logits, grads = _loss_and_grads(ours, input_ids=ids)
    tol = TOLERANCE[dtype]
    assert rel_rms(logits, ref_logits) <= tol
    for name, g in grads.items():
        assert rel_rms(g, ref_grads[name]) <= 4 * tol, name


def test_cpu_tensors_take_the_reference_never_the_kernels(monkeypatch):
    """On CPU the backend computes with the PyTorch reference: the Triton kernels (compiled for CUDA)
    are never called, forward or backward (without Triton installed, they cannot even be imported)."""
    if is_triton_available():
        from hf_sparse_cp.kernels import ops as kops

        def refuse(*args, **kwargs):
            raise AssertionError("CPU tensors reached the Triton kernels")

        monkeypatch.setattr(kops, "triton_forward", refuse)
        monkeypatch.setattr(kops, "triton_backward", refuse)
    from hf_sparse_cp.kernels.limits import unsupported

    assert "cpu tensors" in unsupported(torch.zeros(1, 1, 1, 8))
    cfg = SparseAttentionConfig(block_size=16, min_seq_len=64, vertical_topk=2, slash_topk=2, local_window=16,
                                dense_first_layers=0)
    ref, ours = _pair("qwen2", config=cfg)
    ids = torch.randint(3, 259, (1, 128))
    logits, grads = _loss_and_grads(ours, input_ids=ids)
    assert bool(torch.isfinite(logits).all()) and all(bool(torch.isfinite(g).all()) for g in grads.values())
    assert sorted(pop_kept_fractions(ours)) == [0, 1]  # the sparse path did run


@pytest.mark.parametrize("engine", ["flex", "triton"])
def test_an_engine_set_on_a_model_that_cannot_train_on_cpu_names_the_models_setting(engine):
    """A CPU model configured with an engine that does not train there (Flex has no CPU backward; the kernels run on
    CUDA) is refused at its training call naming the model's setting (`attention_engine`), not only the public op's
    `implementation` argument, which the model's user never typed."""
    if engine == "triton" and not is_triton_available():
        pytest.skip("needs Triton: without it the engine is refused as missing")
    _, ours = _pair("llama", config=SparseAttentionConfig(attention_engine=engine, block_size=16, min_seq_len=0,
                                                          dense_first_layers=0))
    with pytest.raises(ValueError, match=r"reference engine.*SparseAttentionConfig\(attention_engine='auto'\)"):
        _loss_and_grads(ours, input_ids=torch.randint(3, 259, (1, 64)))


def test_short_sequences_stay_dense_under_the_sparse_pattern():
    ref, ours = _pair("qwen2", config=SparseAttentionConfig(block_size=32, min_seq_len=S + 1, slash_topk=4))
    ids = torch.randint(3, 259, (1, S))
    assert rel_rms(ours(ids).logits, ref(ids).logits) <= TOLERANCE[torch.float32]


def test_sparse_pattern_changes_attention_and_records_kept_fraction():
    cfg = SparseAttentionConfig(block_size=16, min_seq_len=64, vertical_topk=2, slash_topk=2, local_window=16,
                                sink_tokens=2, dense_first_layers=0)
    ref, ours = _pair("llama", config=cfg)
    ids = torch.randint(3, 259, (1, 256))
    assert rel_rms(ours(ids).logits, ref(ids).logits) > 1e-3
    kept = pop_kept_fractions(ours)
    assert sorted(kept) == [0, 1] and all(0 < v < 0.6 for v in kept.values())
    assert pop_kept_fractions(ours) == {}


def _docs(lengths, seed=2):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 259, (n,), generator=g) for n in lengths]


# Llama 4's decoder layer keeps `position_ids` from its attention call (only its mask packs by them): the backend
# takes them from the model's forward (`forward_positions.with_forward_positions`); before, it attended across the
# documents.
@pytest.mark.parametrize("model_type", ["qwen2", "llama", "llama4_text"])
def test_packed_documents_by_position_ids(model_type):
    ref, ours = _pair(model_type)
    docs = _docs([40, 71, 39])
    ids = torch.cat(docs)[None]
    pos = torch.cat([torch.arange(len(d)) for d in docs])[None]
    packed = ours(input_ids=ids, position_ids=pos).logits[0]
    alone = torch.cat([ref(input_ids=d[None]).logits[0] for d in docs])
    assert rel_rms(packed, alone) <= TOLERANCE[torch.float32]


def test_packed_documents_of_a_layer_that_keeps_position_ids_train_like_sdpa_under_gradient_checkpointing():
    """The decoder layer's position_ids reach its attention calls in the checkpoint's recomputation too (the layer's
    hooks run inside it): the gradients are SDPA's on the packed batch, whose mask packs by them."""
    ref, ours = _pair("llama4_text")
    docs = _docs([40, 71, 39])
    ids = torch.cat(docs)[None]
    pos = torch.cat([torch.arange(len(d)) for d in docs])[None]
    grads = []
    for model in (ref, ours):
        model.gradient_checkpointing_enable()
        model.train()
        grads.append(_loss_and_grads(model, input_ids=ids, position_ids=pos, use_cache=False)[1])
    for name, g in grads[1].items():
        assert rel_rms(g, grads[0][name]) <= 4 * TOLERANCE[torch.float32], name


@pytest.mark.parametrize("model_type", ["llama", "llama4_text"])
def test_the_forward_positions_reach_attention_only_not_a_loss_function_without_kwargs(model_type):
    """The model's position_ids go on to the attention calls from a pre-hook on the module that runs the decoder
    layers: never the causal LM's forward, which hands its keyword arguments to its loss function too. Llama 4's causal
    LM is its own `get_decoder()` (its base_model_prefix names no submodule): a `loss_function` without **kwargs got
    `sparse_cp_position_ids` (TypeError) in a packed forward."""
    ref, ours = _pair(model_type)
    docs = _docs([40, 71, 39])
    ids = torch.cat(docs)[None]
    pos = torch.cat([torch.arange(len(d)) for d in docs])[None]
    seen = []

    def loss_function(logits, labels, vocab_size):  # (a model's own loss, taking no **kwargs)
        seen.append(logits)
        return F.cross_entropy(logits[0, :-1].float(), labels[0, 1:])

    ours.loss_function = loss_function
    out = ours(input_ids=ids, position_ids=pos, labels=ids)
    alone = torch.cat([ref(input_ids=d[None]).logits[0] for d in docs])
    assert len(seen) == 1 and rel_rms(out.logits[0], alone) <= TOLERANCE[torch.float32]  # (documents still apart)


@pytest.mark.parametrize("rows", [None, 3, 4], ids=["2D", "3D", "4D"])
@pytest.mark.parametrize("model_type", ["qwen2_vl_text", "glm4v_moe_text"])
def test_multimodal_rope_text_models_pack_documents_as_transformers_does(model_type, rows):
    """Multimodal RoPE text models pack documents by the text row of [4, B, S] position_ids only (row 0, handed to
    their mask). Qwen2-VL expands 2D ones to its three RoPE rows and hands neither its mask nor its layers any
    (position_ids=None): every transformers attention attends across their restarts, but sparse_cp took the 2D ones
    from the decoder's forward (`pass_positions_on`) and packed by them (0.67 from sdpa, rel. RMS of the hidden
    states). GLM-4V-MoE hands its layers the three rows after the text row, which sparse_cp failed to read as [B, S]
    (an expand error; read as rotary rows, 0.52 from sdpa). Now the documents are those of the mask."""
    ref, ours = _text_model_pair(model_type)
    ids = torch.randint(3, 259, (1, 96), generator=torch.Generator().manual_seed(1))
    pos = _packed_rope_rows(rows)
    hidden = [m(input_ids=ids, position_ids=pos, use_cache=False).last_hidden_state for m in (ref, ours)]
    assert rel_rms(hidden[1], hidden[0]) <= TOLERANCE[torch.float32]


def test_the_documents_of_multimodal_rope_rows_are_read_back_once_per_forward(monkeypatch):
    """GLM-4V's layers get the RoPE rows; their documents come from the forward's text row, one tensor per forward (a
    new view of it per layer was read back to the host in every layer)."""
    from hf_sparse_cp.attention import tokens

    reads = []
    monkeypatch.setattr(tokens, "document_table", lambda segment: reads.append(1) or [[(0, 40), (40, 96)]])
    keep_all = SparseAttentionConfig(block_size=32, min_seq_len=0, vertical_topk=10**4, slash_topk=10**4,
                                     dense_first_layers=0)
    _, ours = _text_model_pair("glm4v_moe_text", keep_all)  # (the sparse pattern reads the documents)
    assert ours.config.num_hidden_layers > 1
    ours(input_ids=torch.randint(3, 259, (1, 96)), position_ids=_packed_rope_rows(4), use_cache=False)
    assert len(reads) == 1


def _text_model_pair(model_type: str, config: SparseAttentionConfig = DENSE):
    """(sdpa, sparse_cp) text models of a multimodal RoPE architecture, equal weights."""
    from transformers import AutoModel

    # (sections of the 16 rotary frequencies of head_dim 32; GLM-4V rotates half of each head by default)
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6], "partial_rotary_factor": 1.0}
    torch.manual_seed(0)
    ref = AutoModel.from_config(tiny_config(model_type, rope_parameters=dict(rope)), attn_implementation="sdpa")
    ours = AutoModel.from_config(tiny_config(model_type, rope_parameters=dict(rope)))
    ours.load_state_dict(ref.state_dict())
    hf_sparse_cp.configure(ours, config)
    return ref, ours


def _packed_rope_rows(rows: int | None) -> torch.Tensor:
    """Two documents (40 + 56 tokens) as [1, 96] position_ids (rows None), or [rows, 1, 96]: 4 rows are the text row
    and three RoPE rows that restart elsewhere."""
    text = torch.cat([torch.arange(40), torch.arange(56)])[None]
    rope_rows = text[None].expand(3, 1, 96)
    return {None: text, 3: rope_rows, 4: torch.cat([text[None], rope_rows + 7])}[rows]


def test_packed_documents_by_flattening_collator():
    ref, ours = _pair("qwen3")
    docs = _docs([33, 90, 27])
    batch = DataCollatorWithFlattening(return_flash_attn_kwargs=True)([{"input_ids": d.tolist()} for d in docs])
    assert "cu_seq_lens_k" in batch
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    packed = ours(**inputs).logits[0]
    alone = torch.cat([ref(input_ids=d[None]).logits[0] for d in docs])
    assert rel_rms(packed, alone) <= TOLERANCE[torch.float32]


@pytest.mark.parametrize("side", ["left", "right", "between"])
def test_padding_mask_is_honoured(side):
    """'between': padding inside a row (left padding after PEFT prompt tuning's virtual tokens) cut its document in
    two, the tokens after it blind to those before (rel. error 0.37); such a call now attends densely, exactly."""
    ref, ours = _pair("mistral")
    ids = torch.randint(3, 259, (2, S))
    mask = torch.ones(2, S, dtype=torch.long)
    pad = {"left": slice(0, 20), "right": slice(S - 20, S), "between": slice(50, 90)}[side]
    mask[1, pad] = 0
    real = mask.bool()
    a, b = ours(input_ids=ids, attention_mask=mask).logits, ref(input_ids=ids, attention_mask=mask).logits
    assert rel_rms(a[real], b[real]) <= TOLERANCE[torch.float32]
    assert torch.isfinite(a).all()


@pytest.mark.parametrize("model_type, overrides", [("llama", {}), ("mistral", {"sliding_window": 24})],
                         ids=["llama", "mistral_window24"])
def test_padding_between_tokens_trains_the_stock_loss_of_sdpa(model_type, overrides):
    """Padding inside a row (PEFT prompt tuning's virtual tokens before a left-padded prompt): SDPA and eager mask
    padding keys only, so a padding query after real tokens attends to them, and the stock loss reads the last one's
    logits (it predicts the first token after the gap). sparse_cp left those queries blind: the loss of a prompt-tuned
    tiny llama was 5.6295 against SDPA's 5.6337, its prompt's gradient 16% off."""
    ref, ours = _pair(model_type, **overrides)
    ids = torch.randint(3, 259, (2, S), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(2, S, dtype=torch.long)
    mask[1, 5:60] = 0  # (longer than the window: some padding queries see no key at all, as in SDPA)
    mask[0, :9] = 0  # (left padding, before any real token: those queries see nothing in SDPA either)
    labels = ids.masked_fill(mask == 0, -100)
    results = []
    for model in (ours, ref):
        model.zero_grad()
        out = model(input_ids=ids, attention_mask=mask, labels=labels)
        out.loss.backward()
        results.append((out.loss.detach(), out.logits.detach(), [p.grad.clone() for p in model.parameters()]))
    (loss, logits, grads), (ref_loss, ref_logits, ref_grads) = results
    assert abs(float(loss - ref_loss)) <= TOLERANCE[torch.float32] * float(ref_loss)
    assert rel_rms(logits[1], ref_logits[1]) <= TOLERANCE[torch.float32]  # the padding queries too
    for g, ref_g in zip(grads, ref_grads):
        assert rel_rms(g, ref_g) <= 4 * TOLERANCE[torch.float32]


def test_a_padded_batch_reads_its_mask_back_once_per_forward(monkeypatch):
    """Whether a mask pads between a row's tokens is read back to the host once per forward (every layer gets the
    same mask tensor), not once per layer; every forward's mask is read (each forward hands its layers a new one)."""
    from hf_sparse_cp.integration import call_tokens

    reads = []
    monkeypatch.setattr(call_tokens, "padding_between_tokens", lambda mask: reads.append(1) or tokens_gap(mask))
    _, ours = _pair("llama")
    assert ours.config.num_hidden_layers > 1
    ids = torch.randint(3, 259, (2, S))
    mask = torch.ones(2, S, dtype=torch.long)
    mask[0, :7] = 0
    ours(input_ids=ids, attention_mask=mask)
    assert len(reads) == 1
    ours(input_ids=ids, attention_mask=mask.clone())
    assert len(reads) == 2
    mask[1, 50:60] = 0  # now padding between tokens
    ours(input_ids=ids, attention_mask=mask)
    assert len(reads) == 3
    ref, _ = _pair("llama")
    real = mask.bool()
    assert rel_rms(ours(input_ids=ids, attention_mask=mask).logits[real],
                   ref(input_ids=ids, attention_mask=mask).logits[real]) <= TOLERANCE[torch.float32]
    one = torch.ones(1, 8, dtype=torch.long)  # a mask changed in place between two calls is read again
    assert call_tokens.padding_between_tokens_once(one) is None
    one[0, 3] = 0
    assert call_tokens.padding_between_tokens_once(one) == 0


@pytest.mark.parametrize("model_type", ["mistral", "qwen3", "qwen2_moe"])
def test_sliding_window_models(model_type):
    """qwen2_moe puts its window into the attention mask only (its layers pass no sliding_window): the layers
    config.layer_types declares sliding get config.sliding_window, as its mask holds it."""
    extra = {}
    if model_type == "qwen3":
        extra = {"layer_types": ["sliding_attention", "full_attention"], "use_sliding_window": True}
    if model_type == "qwen2_moe":
        extra = {"use_sliding_window": True, "max_window_layers": 2}
    ref, ours = _pair(model_type, sliding_window=24, **extra)
    ids = torch.randint(3, 259, (1, S))
    assert rel_rms(ours(ids).logits, ref(ids).logits) <= TOLERANCE[torch.float32]
    no_window, _ = _pair(model_type)  # control: same weights without the window differ
    assert rel_rms(ours(ids).logits, no_window(ids).logits) > 1e-3


@pytest.mark.parametrize("model_type, overrides, limit, cause", [
    ("phimoe", {"sliding_window": 24}, 24, r"puts its sliding window \(config.sliding_window=24\) into the attention "
                                           r"mask only"),
    ("llama4_text", {"attention_chunk_size": 32}, 32, r"does not implement chunked attention \(layer 0 of model "
                                                      r"type 'llama4_text' attends within chunks of "
                                                      r"attention_chunk_size=32"),
])
def test_a_window_or_chunk_that_only_the_mask_carries_is_refused_beyond_it(model_type, overrides, limit, cause):
    """PhiMoE's window (no layer types say which layers use it) and Llama 4's chunked layers reach attention only
    through the mask, which sparse_cp does not use: a call longer than them is refused naming the fix (not computed
    as plain causal attention), one within them is exact."""
    ref, ours = (m.eval() for m in _pair(model_type, **overrides))  # (PhiMoE's router jitters while training)
    ids = torch.randint(3, 259, (1, S), generator=torch.Generator().manual_seed(3))
    with pytest.raises(ValueError, match=cause + rf".*at most {limit} tokens.*attn_implementation='sdpa' or 'eager'"):
        ours(ids)
    assert rel_rms(ours(ids[:, :limit]).logits, ref(ids[:, :limit]).logits) <= TOLERANCE[torch.float32]


_MASK_ONLY = [("phimoe", {"sliding_window": 24}, 24, r"puts its sliding window \(config.sliding_window=24\) into "
                                                      r"the attention mask only"),
              ("llama4_text", {"attention_chunk_size": 32}, 32, r"does not implement chunked attention \(layer 0 of "
                                                                r"model type 'llama4_text' attends within chunks of "
                                                                r"attention_chunk_size=32")]


@pytest.mark.parametrize("model_type, overrides, limit, cause", _MASK_ONLY)
def test_a_window_or_chunk_that_only_the_mask_carries_is_refused_at_set_up_beyond_the_training_length(
        model_type, overrides, limit, cause):
    """The training length is known at set-up: a longer one is refused there, naming the fix (not at the first step),
    and the model is left as it was; within it, or with rows that pack documents (each may still fit), it switches."""
    from hf_sparse_cp import SparseCPArguments
    from hf_sparse_cp.trainer.attach import enable_sparse_attention

    model = AutoModelForCausalLM.from_config(tiny_config(model_type, **overrides))
    fix = rf"at most {limit} tokens \(--sparse_max_length / max_length {limit}\).*attn_implementation='sdpa' or 'eager'"
    with pytest.raises(ValueError, match=cause + rf".*training sequences of {limit + 1} tokens.*" + fix):
        enable_sparse_attention(model, SparseCPArguments(), DENSE, max_length=limit + 1)
    assert model.config._attn_implementation != "sparse_cp"
    enable_sparse_attention(model, SparseCPArguments(), DENSE, max_length=limit)
    assert model.config._attn_implementation == "sparse_cp"
    other = AutoModelForCausalLM.from_config(tiny_config(model_type, **overrides))
    enable_sparse_attention(other, SparseCPArguments(), DENSE, max_length=4 * limit, packed_documents=True)


@pytest.mark.parametrize("model_type, overrides, limit, cause", _MASK_ONLY)
def test_a_window_or_chunk_that_only_the_mask_carries_is_checked_per_document(model_type, overrides, limit, cause):
    """Packed rows (position_ids restarting per document): transformers applies the window / chunk within each
    document, so a row longer than it computes exactly as long as every document fits; a document longer than it is
    refused, and so is one whose positions cross a chunk boundary (chunks follow the positions)."""
    ref, ours = (m.eval() for m in _pair(model_type, **overrides))
    ids = torch.randint(3, 259, (1, 3 * limit), generator=torch.Generator().manual_seed(5))

    def packed(positions):  # as DataCollatorWithFlattening packs (Llama 4's layers pass on cu_seq_lens only)
        starts = torch.cat([(positions[0, 1:] != positions[0, :-1] + 1).nonzero()[:, 0] + 1, torch.tensor([3 * limit])])
        cu = torch.cat([torch.zeros(1, dtype=torch.int32), starts.to(torch.int32)])
        return {"position_ids": positions, "cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "use_cache": False}

    fits = packed(torch.arange(limit).repeat(3)[None])
    assert rel_rms(ours(ids, **fits).logits, ref(ids, **fits).logits) <= TOLERANCE[torch.float32]
    longer = torch.cat([torch.arange(limit + 1), torch.arange(limit - 1), torch.arange(limit)])[None]
    with pytest.raises(ValueError, match=cause + rf".*a document of {limit + 1} tokens"):
        ours(ids, **packed(longer))
    if "chunk" in cause:  # the second document fits a chunk, but its positions run from limit / 2 across one
        half = limit // 2
        crossing = torch.cat([torch.arange(half // 2), torch.arange(half, half + limit), torch.arange(limit),
                              torch.arange(limit - half // 2)])[None]
        assert crossing.shape[-1] == 3 * limit
        with pytest.raises(ValueError, match=cause):
            ours(ids, position_ids=crossing, use_cache=False)


@pytest.mark.parametrize("model_type, overrides, limit, cause", [
    _MASK_ONLY[0], ("llama4_text", {"attention_chunk_size": 40}, 40, r"does not implement chunked attention")])
def test_under_cp_a_window_or_chunk_is_checked_on_the_documents_not_the_padded_length(model_type, overrides, limit,
                                                                                      cause):
    """Under context parallelism the call's length is the sequence padded to whole blocks per rank: a sequence as
    long as the window or chunk computes exactly (one process: a ring of one rank), a longer one is refused."""
    from hf_sparse_cp.distributed import ParallelDims, prepare_context_parallel_inputs
    from hf_sparse_cp.distributed.modes import RING

    single = ParallelDims.single(mode=RING)
    ref, ours = (m.eval() for m in _pair(model_type, **overrides))
    ids = torch.randint(3, 259, (1, 3 * limit), generator=torch.Generator().manual_seed(6))
    for length in (limit, limit - 1):  # padded to whole blocks of 32: past the window / chunk
        inputs = prepare_context_parallel_inputs({"input_ids": ids[:, :length]}, single, block_size=32)
        assert inputs["cp_shard"].meta.index.shape[-1] > limit
        got = ours(**inputs).logits[:, :length]
        assert rel_rms(got, ref(ids[:, :length]).logits) <= TOLERANCE[torch.float32]
    packed = {"input_ids": ids, "position_ids": torch.arange(limit).repeat(3)[None], "use_cache": False}
    inputs = prepare_context_parallel_inputs(packed, single, block_size=32)
    got = ours(**inputs).logits[:, :3 * limit]
    assert rel_rms(got, ref(**packed).logits) <= TOLERANCE[torch.float32]
    inputs = prepare_context_parallel_inputs({"input_ids": ids[:, :limit + 1]}, single, block_size=32)
    with pytest.raises(ValueError, match=cause + rf".*a document of {limit + 1} tokens"):
        ours(**inputs)


@pytest.mark.parametrize("model_type, overrides, reads", [("llama", {}, 0), (_MASK_ONLY[0][0], _MASK_ONLY[0][1], 1)])
def test_under_cp_the_batchs_mask_positions_are_found_only_for_a_window_the_mask_alone_carries(
        monkeypatch, model_type, overrides, reads):
    """Finding the positions of packed `position_ids` reads a tensor back to the host: a CP batch finds them once,
    when a layer whose window only the mask carries asks, and never for a model whose layers all say their window."""
    from hf_sparse_cp.attention import tokens
    from hf_sparse_cp.distributed import ParallelDims, prepare_context_parallel_inputs
    from hf_sparse_cp.distributed.modes import RING

    calls = []
    monkeypatch.setattr(tokens, "mask_positions", lambda *a: calls.append(a) or _mask_positions(*a))
    _, ours = (m.eval() for m in _pair(model_type, **overrides))
    ids = torch.randint(3, 259, (1, 60), generator=torch.Generator().manual_seed(7))
    packed = {"input_ids": ids, "position_ids": torch.arange(20).repeat(3)[None],
              "use_cache": False}
    inputs = prepare_context_parallel_inputs(packed, ParallelDims.single(mode=RING), block_size=32)
    assert not calls
    ours(**inputs)
    assert len(calls) == reads
    assert inputs["cp_shard"].documents().tolist() == [[0, 19]] * 3
    assert len(calls) == 1


def test_attention_dropout_held_as_the_attention_layers_dropout_is_refused_at_set_up():
    """OPT's attention layers keep their attention dropout as `self.dropout` (a float they pass as dropout= while
    training): a model built with it and its config changed afterwards is refused at set-up, naming the layer; the
    decoder layers' `dropout` (residual dropout) is not attention dropout and does not refuse a model."""
    from hf_sparse_cp import SparseCPArguments
    from hf_sparse_cp.trainer.attach import enable_sparse_attention

    opt = AutoModelForCausalLM.from_config(tiny_config("opt", attention_dropout=0.1))
    opt.config.attention_dropout = 0.0  # does not reach the layers
    with pytest.raises(ValueError, match=r"attention layers built with dropout \(model.decoder.layers.0.self_attn."
                                         r"dropout=0.1\).*build the model with attention_dropout=0.0"):
        enable_sparse_attention(opt, SparseCPArguments())
    residual = AutoModelForCausalLM.from_config(tiny_config("opt", dropout=0.1))
    assert residual.model.decoder.layers[0].dropout == 0.1
    enable_sparse_attention(residual, SparseCPArguments(), DENSE)
    ids = torch.randint(3, 259, (1, 32))
    residual.train()(input_ids=ids, labels=ids).loss.backward()


def test_attention_dropout_is_refused_naming_the_field_the_layers_were_built_from():
    """GPT-2's attention dropout is attn_pdrop (0.1 in its checkpoints), copied into its layers when they are built:
    refused before training and at a call, naming attn_pdrop; a Llama whose config is changed after it was built
    still drops out, so the check reads its layers too, and a model built without dropout trains."""
    from hf_sparse_cp import SparseCPArguments
    from hf_sparse_cp.trainer.attach import enable_sparse_attention

    fix = r"build the model with attn_pdrop=0.0 \(e.g. from_pretrained\(..., attn_pdrop=0.0\)"
    gpt2 = AutoModelForCausalLM.from_config(tiny_config("gpt2", attn_pdrop=0.1))
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel \(model type 'gpt2'\) has attn_pdrop=0.1.*" + fix):
        enable_sparse_attention(gpt2, SparseCPArguments())
    hf_sparse_cp.configure(gpt2, DENSE)
    with pytest.raises(ValueError, match=r"dropout=0.1 from GPT2Attention.attn_dropout .*" + fix):
        gpt2.train()(torch.randint(3, 259, (1, 32)))
    llama = AutoModelForCausalLM.from_config(tiny_config("llama", attention_dropout=0.1))
    llama.config.attention_dropout = 0.0  # does not reach the layers
    with pytest.raises(ValueError, match=r"attention layers built with dropout \(model.layers.0.self_attn."
                                         r"attention_dropout=0.1\).*build the model with attention_dropout=0.0"):
        enable_sparse_attention(llama, SparseCPArguments())
    _, ours = _pair("llama")
    ours.train()(input_ids=torch.randint(3, 259, (1, 32)), labels=torch.randint(3, 259, (1, 32))).loss.backward()


def test_values_narrower_than_queries_and_keys_compute_like_sdpa():
    """DeepSeek-V3's multi-head latent attention: q and k of 64 dims (32 without RoPE + 32 with it), v of 48. The
    engines take one head dimension, and the call failed in a shape check; now exact, gradients included."""
    mla = dict(qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=48, kv_lora_rank=32, q_lora_rank=None,
               num_key_value_heads=4, first_k_dense_replace=2)
    ref, ours = _pair("deepseek_v3", **mla)
    ids = torch.randint(3, 259, (1, S), generator=torch.Generator().manual_seed(4))
    ref_logits, ref_grads = _loss_and_grads(ref, input_ids=ids)
    logits, grads = _loss_and_grads(ours, input_ids=ids)
    assert rel_rms(logits, ref_logits) <= TOLERANCE[torch.float32]
    for name, g in grads.items():
        if float(ref_grads[name].norm()) > 1e-6:  # (a key bias gets a zero gradient but for rounding)
            assert rel_rms(g, ref_grads[name]) <= 4 * TOLERANCE[torch.float32], name


def test_greedy_generation_matches_sdpa():
    ref, ours = _pair("qwen2")
    prompt = torch.randint(3, 259, (1, 40))
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(ours.generate(prompt, **kw), ref.generate(prompt, **kw))


def test_a_training_log_shows_its_steps_forward_not_the_generation_in_training_mode():
    """TRL's GRPO generates with the model in training mode: the prompt prefills were averaged into the step's
    logged kept fraction. Calls in training mode without gradients are now left out of a training log (the step's
    forward and backward, gradient checkpointing's recomputation included, are what it shows); an evaluation's
    forwards, without gradients in evaluation mode, still make the evaluation's log."""
    from transformers import TrainerState

    from hf_sparse_cp.trainer.callbacks import SparsityLoggingCallback

    cfg = SparseAttentionConfig(block_size=16, min_seq_len=64, vertical_topk=2, slash_topk=2, local_window=16,
                                sink_tokens=2, dense_first_layers=0)
    _, ours = _pair("llama", config=cfg)
    ids, prompt = torch.randint(3, 259, (1, 256)), torch.randint(3, 259, (1, 64))
    ours.train()
    ours(ids).logits.sum().backward()
    step = pop_kept_fractions(ours)
    with torch.no_grad():
        ours(prompt)
    prefill = pop_kept_fractions(ours)
    assert step.keys() == prefill.keys() == {0, 1} and all(abs(step[i] - prefill[i]) > 0.05 for i in step)

    def logged(logs: dict) -> dict:
        SparsityLoggingCallback().on_log(None, TrainerState(), None, logs=logs, model=ours)
        return {key: value for key, value in logs.items() if key.startswith("sparse/kept_fraction/")}

    # (reentrant checkpointing: the forward runs without gradients, its recomputation with)
    getattr(ours, upstream.checkpointing_method())({"use_reentrant": True})
    ours(ids).logits.sum().backward()
    ours.generate(prompt, max_new_tokens=3, do_sample=False, pad_token_id=0)  # (in training mode, as TRL does)
    assert logged({"loss": 1.0}) == {f"sparse/kept_fraction/layer_0{i}": round(step[i], 5) for i in step}
    ours.eval()
    with torch.no_grad():
        ours(prompt)
    assert logged({"eval_loss": 1.0}) == {f"sparse/kept_fraction/layer_0{i}": round(prefill[i], 5) for i in step}
    assert pop_kept_fractions(ours) == {}


def test_unsupported_features_are_refused_with_the_fix():
    _, ours = _pair("llama", attention_dropout=0.1)
    ours.train()
    with pytest.raises(ValueError, match=r"from LlamaAttention.attention_dropout .*build the model with "
                                         r"attention_dropout=0.0 \(e.g. from_pretrained\(..., attention_dropout=0.0\)"):
        ours(torch.randint(3, 259, (1, 32)))
    layer = ours.model.layers[0].self_attn
    x = torch.randn(1, 4, 32, 32)
    kv = torch.randn(1, 2, 32, 32)
    fn = sparse_cp_attention_forward
    with pytest.raises(ValueError, match="soft-capping.*'llama'"):
        fn(layer, x, kv, kv, None, softcap=30.0)
    # Learned sinks (`s_aux`) are computed as one logit per query head (tests/unit/test_sinks.py); another shape is not
    with pytest.raises(ValueError, match=r"learned attention sinks of shape \[2, 4\] \(it computes one sink logit per "
                                         r"query head, shape \[4\].*\(s_aux, model type 'llama'\)"):
        fn(layer, x, kv, kv, None, s_aux=torch.zeros(2, 4))
    # What Inkling 2, Inkling and DeepSeek-V3.2 pass besides: computed without them before, silently
    for name, value, cause in [("sinks", torch.zeros(1, 4, 32, 1), "learned attention sinks per token"),
                               ("position_bias", torch.zeros(1, 4, 32, 32), "an additive bias on the attention logits"),
                               ("indices", torch.zeros(1, 32, 8, dtype=torch.long), "a selection of key indices")]:
        with pytest.raises(ValueError, match=rf"does not implement {cause}.*\({name}, model type 'llama'\).*"
                                             r"attn_implementation='eager' \(--sparse_attention false\)"):
            fn(layer, x, kv, kv, None, **{name: value})
    with pytest.raises(ValueError, match="4D attention mask"):
        fn(layer, x, kv, kv, torch.ones(1, 1, 32, 32, dtype=torch.bool))
    # A call that asks for bidirectional attention (a vision tower's is_causal=False) was computed causally
    with pytest.raises(ValueError, match=r"only computes causal.*LlamaAttention.*'llama' is bidirectional"):
        fn(layer, x, kv, kv, None, is_causal=False)


def test_a_block_diagonal_4d_mask_of_packed_documents_is_refused_naming_position_ids_which_pack_them():
    """Packing by a custom 4D block-diagonal mask (what SDPA takes) is refused naming the form sparse_cp packs by:
    the refusal's 'pass the 2D padding mask' alone, followed, let the documents attend to each other. Packed by
    their restarting position_ids instead, the row computes what SDPA computes under the 4D mask."""
    ref, ours = _pair("llama")
    ids = torch.randint(3, 259, (1, 96), generator=torch.Generator().manual_seed(3))
    document = torch.arange(96) >= 40
    mask = torch.tril(torch.ones(96, 96, dtype=torch.bool)) & (document[:, None] == document[None, :])
    with pytest.raises(ValueError, match=r"4D attention mask.*position_ids restarting at 0 at each document's first "
                                         r"token, as DataCollatorWithFlattening gives them"):
        ours(input_ids=ids, attention_mask=mask[None, None])
    positions = torch.cat([torch.arange(40), torch.arange(56)])[None]
    with torch.no_grad():
        want = ref(input_ids=ids, attention_mask=mask[None, None], position_ids=positions).logits
        got = ours(input_ids=ids, position_ids=positions).logits
    assert rel_rms(got, want) <= TOLERANCE[torch.float32]


def test_under_autocast_mixed_input_dtypes_compute_like_sdpa():
    """Under bf16 autocast RoPE leaves q and k in fp32 and v in bf16 (what the Trainer's --bf16 gives): the
    backend takes them in the autocast dtype, as SDPA does, and trains."""
    ref, ours = _pair("llama")
    ids = torch.randint(3, 259, (1, S), generator=torch.Generator().manual_seed(2))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref_logits = ref(input_ids=ids).logits
        out = ours(input_ids=ids, labels=ids)
    out.loss.backward()
    assert rel_rms(out.logits, ref_logits) <= 2 * TOLERANCE[torch.bfloat16]
    assert all(p.grad is not None and bool(torch.isfinite(p.grad).all()) for p in ours.parameters())


@pytest.mark.parametrize("model_type", ["codegen", "gptj"])
def test_tiny_models_of_partial_rotary_families_run(model_type):
    """CodeGen's and GPT-J's `rotary_dim` (64 by default) was wider than the tiny model's heads (32): their own forward
    failed (with any attention), and the backend's probe refused them for it. Half of a head is rotary."""
    config = tiny_config(model_type)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    assert config.rotary_dim == 16
    assert model(input_ids=torch.randint(3, 259, (1, 20))).logits.shape == (1, 20, 259)
