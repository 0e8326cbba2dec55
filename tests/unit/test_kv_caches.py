"""Inference with a KV cache under `sparse_cp`: prefill, chunked prefill and decoding against SDPA, with the caches
transformers offers (a StaticCache holds more key slots than tokens: the unfilled ones must stay unseen)."""

import inspect

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM, DynamicCache, LlamaForCausalLM, StaticCache, masking_utils
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaAttention, apply_rotary_pos_emb

import hf_sparse_cp
from hf_sparse_cp import SparseAttentionConfig
from hf_sparse_cp.integration import upstream
from hf_sparse_cp.testing.tiny_models import tiny_config

from oracle import TOLERANCE, rel_rms

# Every block kept: the sparse path computes exactly what SDPA does.
FULL = SparseAttentionConfig(block_size=32, min_seq_len=0, vertical_topk=10**4, slash_topk=10**4,
                             dense_first_layers=0)
# The forward's cache argument: `cache` from transformers 5.24, `past_key_values` before (where `cache=` would go
# unread into **kwargs, and every chunk would be computed without the earlier ones).
CACHE = upstream.cache_field()


pytestmark = pytest.mark.usefixtures("patched")


def _pair(model_type="qwen2", **overrides):
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(tiny_config(model_type, **overrides), attn_implementation="sdpa").eval()
    ours = AutoModelForCausalLM.from_config(tiny_config(model_type, **overrides)).eval()
    ours.load_state_dict(ref.state_dict())
    hf_sparse_cp.configure(ours, FULL)
    return ref, ours


def _cached_logits(model, ids, mask, cache, chunks):
    """Logits of `ids` fed in `chunks` (lengths) through `cache`, the 2D mask growing with them (None: none)."""
    out, done = [], 0
    for n in chunks:
        step_mask = None if mask is None else mask[:, :done + n]
        out.append(model(input_ids=ids[:, done:done + n], attention_mask=step_mask, **{CACHE: cache},
                         use_cache=True).logits)
        done += n
    return torch.cat(out, 1)


@pytest.mark.parametrize("model_type, overrides", [("qwen2", {}), ("mistral", {"sliding_window": 48})],
                         ids=["qwen2", "mistral_window48"])
@pytest.mark.parametrize("padded", [False, True], ids=["no_mask", "left_padded"])
@pytest.mark.parametrize("cache", ["static", "dynamic"])
def test_prefill_chunks_and_decoding_through_a_cache_match_sdpa(cache, padded, model_type, overrides):
    """A StaticCache of 128 slots holding 100 tokens: the backend attended to its unfilled slots as if they were
    tokens (rel. error 0.23 without a mask), or failed on the mask's length with a left-padded batch."""
    ref, ours = _pair(model_type, **overrides)
    ids = torch.randint(3, 259, (2, 104), generator=torch.Generator().manual_seed(3))
    mask = None
    if padded:
        mask = torch.ones_like(ids)
        mask[1, :30] = 0
    chunks = (90, 10, 1, 1, 1, 1)
    logits = []
    for model in (ours, ref):
        kv = StaticCache(config=model.config, max_cache_len=128) if cache == "static" else DynamicCache(
            config=model.config)
        logits.append(_cached_logits(model, ids, mask, kv, chunks))
    real = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.bool()
    assert rel_rms(logits[0][real], logits[1][real]) <= TOLERANCE[torch.float32]


@pytest.mark.parametrize("mask_columns", [100, 104], ids=["prompt_mask", "mask_longer_than_the_prompt"])
@pytest.mark.parametrize("cache_implementation", ["static", "dynamic"])
def test_greedy_generation_of_a_left_padded_batch_matches_sdpa(cache_implementation, mask_columns):
    """A mask 4 columns longer than the prompt (its last ones 0 in row 0) is read by its first columns, as SDPA
    reads it: by its last, row 0's last prompt tokens were padding, and the logits of every step 0.06 (StaticCache)
    to 0.5 (DynamicCache) from SDPA's, though the tiny model's greedy tokens stayed SDPA's."""
    ref, ours = _pair()
    prompt = torch.randint(3, 259, (2, 100), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(2, mask_columns, dtype=torch.int64)
    mask[0, 100:] = 0
    mask[1, :30] = 0
    kw = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0,
              cache_implementation=cache_implementation, output_logits=True, return_dict_in_generate=True)
    got, want = ours.generate(prompt, **kw), ref.generate(prompt, **kw)
    assert torch.equal(got.sequences, want.sequences)
    assert rel_rms(torch.stack(got.logits), torch.stack(want.logits)) <= TOLERANCE[torch.float32]


def test_attention_weights_are_refused_naming_eager_and_eager_gives_them_after_the_switch():
    """output_attentions=True returned an empty tuple of weights, silently."""
    ref, ours = _pair()
    ids = torch.randint(3, 259, (1, 40))
    with pytest.raises(ValueError, match=r"output_attentions=True.*set_attn_implementation\('eager'\)"):
        ours(ids, output_attentions=True)
    ours.set_attn_implementation("eager")
    weights = ours(ids, output_attentions=True).attentions
    assert len(weights) == 2 and weights[0].shape == (1, 4, 40, 40)
    ours.set_attn_implementation("sparse_cp")
    assert rel_rms(ours(ids).logits, ref(ids).logits) <= TOLERANCE[torch.float32]


class _MemoryKeyAttention(LlamaAttention):
    """Llama attention with 4 learned keys and values in front of the tokens' (memory tokens), made by the layer
    itself, not held in a KV cache."""

    def __init__(self, config, layer_idx):
        super().__init__(config, layer_idx)
        shape = (1, config.num_key_value_heads, 4, self.head_dim)
        self.memory_keys, self.memory_values = (torch.nn.Parameter(torch.randn(shape)) for _ in range(2))

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, cache=None, **kwargs):
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        q, k, v = (proj(hidden_states).view(shape).transpose(1, 2) for proj in (self.q_proj, self.k_proj, self.v_proj))
        q, k = apply_rotary_pos_emb(q, k, *position_embeddings)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx, kwargs=kwargs)
        batch = q.shape[0]
        k = torch.cat([self.memory_keys.expand(batch, -1, -1, -1), k], 2)
        v = torch.cat([self.memory_values.expand(batch, -1, -1, -1), v], 2)
        attention = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, None)
        out, weights = attention(self, q, k, v, attention_mask, dropout=0.0, scaling=self.scaling, **kwargs)
        return self.o_proj(out.reshape(*hidden_states.shape[:-1], -1)), weights


class _MemoryKeyLlama(LlamaForCausalLM):
    def __init__(self, config):
        super().__init__(config)
        for i, layer in enumerate(self.model.layers):
            layer.self_attn = _MemoryKeyAttention(config, i)


@pytest.mark.parametrize("use_cache", [False, True], ids=["no_cache", "dynamic_cache"])
def test_a_layer_that_appends_its_own_keys_is_refused_naming_sdpa(use_cache):
    """A layer that puts 4 keys of its own in front of the tokens' (no Cache holds them) was read as a KV cache call:
    configure passed and the logits were 0.54 (rel. RMS) from sdpa's, computed with an alignment guessed for it.
    Refused by the set-up probe when the model builds such layers, and at the first call when they are put in after."""
    expected = r"\d+ keys for \d+ queries.*adds keys of its own.*attn_implementation='sdpa'"
    torch.manual_seed(0)
    model = _MemoryKeyLlama(tiny_config("llama")).eval()
    with pytest.raises(ValueError, match=expected):
        hf_sparse_cp.configure(model, FULL)
    ref, ours = _pair("llama")
    for i, layer in enumerate(ours.model.layers):
        layer.self_attn = _MemoryKeyAttention(ours.config, i)
    with pytest.raises(ValueError, match="68 keys for 64 queries.*adds keys of its own"):
        ours(input_ids=torch.randint(3, 259, (2, 64)), use_cache=use_cache)


def test_prefix_keys_given_as_a_cache_are_computed_as_sdpa_computes_them():
    """Keys of earlier tokens that come in a Cache (what PEFT's prefix tuning passes) are placed before the queries
    and computed exactly; only keys no cache explains are refused."""
    ref, ours = _pair("llama")
    ids = torch.randint(3, 259, (2, 72), generator=torch.Generator().manual_seed(5))
    logits = []
    for model in (ours, ref):
        cache = DynamicCache(config=model.config)
        model(input_ids=ids[:, :8], use_cache=True, **{CACHE: cache})
        logits.append(model(input_ids=ids[:, 8:], use_cache=True, **{CACHE: cache}).logits)
    assert rel_rms(logits[0], logits[1]) <= TOLERANCE[torch.float32]


def _mask_of(columns: int) -> torch.Tensor:
    """A 2D mask of 2 rows and `columns` columns over 40 tokens seen: row 0 padded at its start (3 columns of a shorter
    mask, 4 of a longer one), row 1 in a longer mask's last 4 columns, past the tokens (by its last columns, row 1's
    last 4 tokens are padding and row 0's first ones are not)."""
    mask = torch.ones(2, columns)
    mask[0, :columns - 40 if columns > 40 else 3] = 0
    mask[1, 40:] = 0
    return mask


@pytest.mark.parametrize("columns", [44, 34], ids=["longer", "shorter"])
@pytest.mark.parametrize("cache", ["none", "dynamic", "dynamic, 8 held", "static", "static, 8 held"])
def test_a_padding_mask_of_another_length_than_the_tokens_seen_is_read_as_sdpa_reads_it(cache, columns):
    """A 2D mask longer or shorter than the 40 tokens it covers (those a cache holds, then the input's). Without a
    cache, transformers' SDPA and eager attention fail on its length and flash-attention reads its last columns:
    refused, naming the input's length. Through a cache SDPA reads column i as the token at position i: a longer mask
    by its first columns, a shorter one padded with zeros. The backend read a longer mask by its last columns (rows
    0.6 apart from SDPA's logits), placed the queries of a StaticCache call at the mask's end (past the filled slots:
    0.36 apart), and the queries of a call through a cache holding tokens after a shorter mask's end (0.32 apart, and
    'q_meta must hold ... (2, 0)' through an empty StaticCache). Compared on the tokens SDPA reads as real: the
    padding queries of a call without earlier tokens output 0 (docs/usage.md)."""
    ref, ours = _pair("llama")
    ids = torch.randint(3, 259, (2, 40), generator=torch.Generator().manual_seed(5))
    held = 8 if "8 held" in cache else 0
    mask = _mask_of(columns)

    def logits(model) -> torch.Tensor:  # (a cache of its own per call, holding the first `held` tokens)
        kv = None if cache == "none" else DynamicCache(config=model.config) if cache.startswith("dynamic") else \
            StaticCache(config=model.config, max_cache_len=64)
        if held:
            model(input_ids=ids[:, :held], use_cache=True, **{CACHE: kv})
        return model(input_ids=ids[:, held:], attention_mask=mask, use_cache=kv is not None, **{CACHE: kv}).logits

    if cache == "none":
        with pytest.raises(ValueError, match=rf"^attention_mask has shape \(2, {columns}\) for a batch of 2 rows of 40 "
                                             r"tokens: .*pass a mask of the input's length \(\[2, 40\]\)\.$"):
            logits(ours)
        return
    real = torch.nn.functional.pad(mask, (0, max(0, 40 - columns)))[:, held:40].bool()
    assert rel_rms(logits(ours)[real], logits(ref)[real]) <= TOLERANCE[torch.float32]


@pytest.mark.parametrize("layer_types", [["sliding_attention", "full_attention"], ["sliding_attention"] * 2],
                         ids=["mixed", "sliding"])
def test_static_cache_generation_of_a_left_padded_batch_past_the_window_matches_sdpa(layer_types):
    """A StaticCache's sliding layer holds the window's slots: once the tokens pass it with padding still inside it,
    its mask is a column slice, which `generate` copies to make it contiguous; the copy was not the mask recorded for
    the cache call and the step was refused as a layer adding keys of its own ('24 keys for 1 queries')."""
    ref, ours = _pair("gemma3_text", sliding_window=24, layer_types=layer_types)
    prompt = torch.randint(3, 259, (2, 20), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(prompt)
    mask[1, :7] = 0
    kw = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0, cache_implementation="static")
    assert torch.equal(ours.generate(prompt, **kw), ref.generate(prompt, **kw))


def _chunked_static_cache_generates() -> bool:
    """Whether this transformers' `generate` can fill a StaticCache of chunked-attention layers: 5.16 to 5.19 pass
    `block_sequence_ids` to every layer type's mask function but `create_chunked_causal_mask` takes it only from
    5.20 (a TypeError for sdpa too)."""
    def takes(fn):
        return "block_sequence_ids" in inspect.signature(fn).parameters

    return takes(masking_utils.create_chunked_causal_mask) or not takes(masking_utils.create_causal_mask)


@pytest.mark.parametrize("cache_implementation", [
    pytest.param("static", marks=pytest.mark.skipif(
        not _chunked_static_cache_generates(), reason=f"transformers {transformers.__version__}'s generate cannot "
        "fill a StaticCache of chunked-attention layers (fixed in 5.20)")),
    "dynamic"])
def test_decoding_past_an_attention_chunk_is_refused_and_within_it_matches_sdpa(cache_implementation):
    """Llama 4's chunked layers keep fewer keys than a chunk in their cache, but from a chunk the queries' no longer
    sees: decoding 30 tokens from a 20-token prompt attended to them past the 32-token chunk, silently (17 of the 60
    tokens unlike sdpa's, the logits 0.68 off from the first step past it). Refused there, as transformers refuses
    flash-attention."""
    ref, ours = _pair("llama4_text", attention_chunk_size=32)
    prompt = torch.randint(3, 259, (2, 20), generator=torch.Generator().manual_seed(3))
    kw = dict(do_sample=False, pad_token_id=0, cache_implementation=cache_implementation)
    assert torch.equal(ours.generate(prompt, max_new_tokens=13, **kw), ref.generate(prompt, max_new_tokens=13, **kw))
    with pytest.raises(ValueError, match=r"chunked attention.*spans 33 tokens \(through a KV cache\).*at most 32"):
        ours.generate(prompt, max_new_tokens=14, **kw)


@pytest.mark.parametrize("mode", ["beam_search", "prompt_lookup", "assisted", "sampling"])
def test_decoding_strategies_through_the_cache_give_sdpas_tokens(mode):
    """Beam search reorders the cache, prompt-lookup and assisted decoding verify several candidate tokens per call (a
    query chunk against the cache) and crop it back; seeded sampling draws from the same logits."""
    ref, ours = _pair("mistral", sliding_window=48)
    prompt = torch.randint(3, 259, (1, 40), generator=torch.Generator().manual_seed(3))
    prompt = torch.cat([prompt, prompt], 1)  # (repeats, for the prompt lookup to find)
    kw = dict(max_new_tokens=16, do_sample=False, pad_token_id=0)
    if mode == "beam_search":
        kw.update(num_beams=3, num_return_sequences=2)
    elif mode == "prompt_lookup":
        kw.update(prompt_lookup_num_tokens=4)
    elif mode == "sampling":
        kw.update(do_sample=True, top_k=0)
    tokens = []
    for model in (ours, ref):
        if mode == "assisted":
            torch.manual_seed(1)
            kw["assistant_model"] = AutoModelForCausalLM.from_config(
                tiny_config("mistral", sliding_window=48, num_hidden_layers=1), attn_implementation="sdpa").eval()
        torch.manual_seed(5)
        tokens.append(model.generate(prompt, **kw))
    assert torch.equal(*tokens)


def test_a_left_padded_batch_under_inference_mode_matches_sdpa():
    """`torch.inference_mode()` (as `torch.no_grad()`, eval's other context) makes inference tensors, which count no
    in-place writes: reading their `_version` (what the per-forward token metadata and a layout's derived values
    are kept by) raised "Inference tensors do not track version counter" at the first layer."""
    ref, ours = _pair()
    prompt = torch.randint(3, 259, (2, 100), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(prompt)
    mask[1, :30] = 0
    kw = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0, output_logits=True,
              return_dict_in_generate=True)
    with torch.inference_mode():
        logits = [model(input_ids=prompt, attention_mask=mask).logits for model in (ours, ref)]
        got, want = ours.generate(prompt, **kw), ref.generate(prompt, **kw)
    assert rel_rms(logits[0][mask.bool()], logits[1][mask.bool()]) <= TOLERANCE[torch.float32]
    assert torch.equal(got.sequences, want.sequences)
    assert rel_rms(torch.stack(got.logits), torch.stack(want.logits)) <= TOLERANCE[torch.float32]


@pytest.mark.parametrize("padded", [False, True], ids=["no_mask", "left_padded"])
def test_static_cache_generation_past_the_window_of_a_model_without_layer_types_matches_sdpa(padded):
    """Mistral's config has no `layer_types`: for a StaticCache `generate` builds one mask through the backend's mask
    function and hands it to the forward, which builds its mask again from it. Read again as a padding mask of the
    sequence's first columns, a sliding layer's [B, window] mask past the window lost its last slots (5 of 8 seen,
    then 4 of 8, in the first decoding steps): the tokens stayed SDPA's, the logits were 0.36-0.51 from them."""
    ref, ours = _pair("mistral", sliding_window=8)
    prompt = torch.randint(3, 259, (2, 10), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(prompt)
    if padded:
        mask[1, :3] = 0
    kw = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0, cache_implementation="static",
              output_logits=True, return_dict_in_generate=True)
    got, want = ours.generate(prompt, **kw), ref.generate(prompt, **kw)
    assert rel_rms(torch.stack(got.logits), torch.stack(want.logits)) <= TOLERANCE[torch.float32]


MASK_ONLY = "into the attention mask only, without passing it to the attention function"


@pytest.mark.parametrize(("model_type", "says"), [
    ("llama", "which its own forward attends past"), ("olmoe", "which its own forward attends past"),
    ("qwen2_moe", MASK_ONLY)])
def test_a_window_refused_under_compile_is_described_as_the_models_code_uses_it(model_type, says):
    """Under torch.compile a config's window that only a mask could hold is refused for longer documents: a Llama's or
    OLMoE's was described as Qwen2-MoE's, "into the attention mask only, without passing it to the attention
    function", though OLMoE passes it and neither's forward applies it."""
    from hf_sparse_cp.integration.call_refusals import locality_refusal

    model = AutoModelForCausalLM.from_config(tiny_config(model_type, sliding_window=8))
    attention = next(m for m in model.modules() if type(m).__name__.endswith("Attention"))
    message = str(locality_refusal(attention, ("window", 8), "this call has a document of 9 tokens",
                                   "train documents of at most 8 tokens"))
    assert says in message and "config.sliding_window=8" in message, message
    assert ("without torch.compile" in message) == (says != MASK_ONLY), message


@pytest.mark.parametrize("model_type", ["llama", "gpt2", "olmoe"])
def test_a_window_field_the_models_own_code_never_reads_is_computed_as_sdpa_computes_it(model_type):
    """A Llama or GPT-2 config that carries `sliding_window` (their modeling code never reads it: their forward
    attends past it, in SDPA and eager) was refused for documents longer than it, as if their mask held the window,
    at set-up too. transformers' `generate` does read it: for a StaticCache it builds the window into the masks
    (`create_masks_for_generate`; GPT-2's forward takes a view of that mask), and a DynamicCache's sliding layers
    hold the window's keys alone. Each is now computed as SDPA computes it: the forward past the window, generation
    within it. OLMoE's attention passes the field to the attention function while its mask never holds it (only
    flash-attention applies it): sparse_cp applied it, its logits 27% from SDPA's (architecture_sweep)."""
    from hf_sparse_cp import SparseCPArguments
    from hf_sparse_cp.trainer.attach import enable_sparse_attention

    ref, ours = _pair(model_type, sliding_window=8)
    prompt = torch.randint(3, 259, (2, 30), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(prompt)
    mask[1, :11] = 0
    with torch.no_grad():
        logits = [model(input_ids=prompt, attention_mask=mask).logits for model in (ours, ref)]
    assert rel_rms(logits[0][mask.bool()], logits[1][mask.bool()]) <= TOLERANCE[torch.float32]
    for cache_implementation in ("static", "dynamic"):
        kw = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0, output_logits=True,
                  return_dict_in_generate=True, cache_implementation=cache_implementation)
        got, want = ours.generate(prompt, **kw), ref.generate(prompt, **kw)
        assert rel_rms(torch.stack(got.logits), torch.stack(want.logits)) <= TOLERANCE[torch.float32]
    model = AutoModelForCausalLM.from_config(tiny_config(model_type, sliding_window=8))
    enable_sparse_attention(model, SparseCPArguments(), FULL, max_length=64)  # (refused: "at most 8 tokens")
