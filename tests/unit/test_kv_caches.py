"""Inference with a KV cache under `sparse_cp`: prefill, chunked prefill and decoding against SDPA, with the caches
transformers offers (a StaticCache holds more key slots than tokens: the unfilled ones must stay unseen)."""

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache, StaticCache

import hf_sparse_cp
from hf_sparse_cp import SparseAttentionConfig
from hf_sparse_cp.testing.tiny_models import tiny_config

from oracle import TOLERANCE, rel_rms

# Every block kept: the sparse path computes exactly what SDPA does.
FULL = SparseAttentionConfig(block_size=32, min_seq_len=0, vertical_topk=10**4, slash_topk=10**4,
                             dense_first_layers=0)


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
        out.append(model(input_ids=ids[:, done:done + n], attention_mask=step_mask, cache=cache,
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


@pytest.mark.parametrize("cache_implementation", ["static", "dynamic"])
def test_greedy_generation_of_a_left_padded_batch_matches_sdpa(cache_implementation):
    ref, ours = _pair()
    prompt = torch.randint(3, 259, (2, 100), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(prompt)
    mask[1, :30] = 0
    kw = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0,
              cache_implementation=cache_implementation)
    assert torch.equal(ours.generate(prompt, **kw), ref.generate(prompt, **kw))


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
