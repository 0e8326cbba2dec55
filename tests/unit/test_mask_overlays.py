"""The mask function registered with `sparse_cp`: transformers' causal mask, windows and packed positions pass on to
the backend; a model's own overlay on the causal mask (an or/and mask function, a block overlay of bidirectional
image tokens) and transformers' bidirectional mask, which the backend cannot compute, are refused naming the fix."""

import pytest
import torch
from transformers.masking_utils import (
    create_bidirectional_mask,
    create_causal_mask,
    create_chunked_causal_mask,
    create_sliding_window_causal_mask,
    sliding_window_bidirectional_mask_function,
    sliding_window_causal_mask_function,
)

from hf_sparse_cp.integration import upstream
from hf_sparse_cp.integration.call_tokens import NonCausalMask, sparse_cp_mask
from hf_sparse_cp.integration.compiled import OPS_MIN_TORCH, TORCH_TRACES_THE_OPS
from hf_sparse_cp.testing.tiny_models import tiny_config

pytestmark = pytest.mark.usefixtures("patched")


# (torch before OPS_MIN_TORCH: its dynamo cannot trace the mask build in one graph, its aot_eager starts a compile
# worker process, which unit tests may not; the compiled path is tested from there)
compiles_the_mask_build = pytest.mark.skipif(not TORCH_TRACES_THE_OPS, reason=f"torch < {OPS_MIN_TORCH}")


def _config(model_type="llama", **overrides):
    config = tiny_config(model_type, **overrides)
    config._attn_implementation = "sparse_cp"
    return config


def _mask(make=create_causal_mask, config=None, attention_mask=None, position_ids=None, **kwargs):
    embeds = torch.zeros(2, 40, 8)
    position_ids = torch.arange(40)[None].expand(2, 40) if position_ids is None else position_ids
    return make(config=config or _config(), inputs_embeds=embeds, attention_mask=attention_mask,
                position_ids=position_ids, **{upstream.cache_field(): None}, **kwargs)


def test_causal_windows_and_padding_pass_on_as_the_2d_padding_mask():
    assert _mask() is None
    assert _mask(create_sliding_window_causal_mask, config=_config("mistral", sliding_window=16)) is None
    padding = torch.ones(2, 40, dtype=torch.long)
    padding[1, :5] = 0
    assert torch.equal(_mask(attention_mask=padding).long(), padding)


@pytest.mark.parametrize("overlay", [
    {"or_mask_function": lambda b, h, q, k: k < 4},  # e.g. a prefix every token sees
    {"and_mask_function": lambda b, h, q, k: q - k < 8},
    {"block_sequence_ids": torch.tensor([[-1] * 10 + [0] * 10 + [-1] * 20] * 2)},  # bidirectional image tokens
], ids=["or", "and", "block"])
def test_a_models_own_overlay_on_the_causal_mask_is_refused_naming_sdpa(overlay):
    with pytest.raises(ValueError, match=r"overlays its own mask on the causal one .*attn_implementation='sdpa' or "
                                         r"'eager' \(--sparse_attention false\)"):
        _mask(**overlay)


def test_a_block_overlay_of_a_packed_batch_is_refused_and_its_documents_pass_on():
    """Under packing (restarting position_ids, no attention mask) transformers puts a block overlay (HRM's bidirectional
    prefix-LM prefix, block_sequence_ids) inside the and-mask of the documents, which the or-mask check did not see: a
    tiny hrm_text with a prefix gave sdpa's logits to 0.009 and gradients to 0.85 (rel.), its prefix attended causally.
    The packed documents alone still pass on."""
    packed = torch.cat([torch.arange(25), torch.arange(15)])[None].expand(2, 40)
    with pytest.raises(ValueError, match=r"overlays its own mask on the causal one .*attn_implementation='sdpa'"):
        _mask(position_ids=packed, block_sequence_ids=torch.tensor([[0] * 10 + [-1] * 30] * 2))
    assert _mask(position_ids=packed) is None
    window = _config("mistral", sliding_window=16)
    assert _mask(create_sliding_window_causal_mask, config=window, position_ids=packed) is None


def test_a_bidirectional_mask_is_refused_as_such():
    """transformers' bidirectional mask (`create_bidirectional_mask`: an encoder's, cross-attention's over encoder
    states, a decoder's built with config.is_causal=False) passed on as the 2D padding mask, so that a layer that does
    not say `is_causal=False` (Splinter's, ALIGN's and CLAP's text encoders) attended causally
    (tests/unit/test_bidirectional_models.py); a bidirectional window (an and-mask) is found by evaluating it."""
    from transformers import AutoModelForCausalLM

    from hf_sparse_cp.integration.backend import sparse_cp_attention_forward
    from hf_sparse_cp.integration.call_tokens import is_bidirectional_mask

    embeds = torch.zeros(2, 40, 8)
    layer = AutoModelForCausalLM.from_config(_config()).model.layers[0].self_attn
    q = torch.zeros(2, 4, 40, 8)
    padding = torch.ones(2, 40, dtype=torch.long)
    for given in (None, padding):
        mask = create_bidirectional_mask(config=_config(), inputs_embeds=embeds, attention_mask=given)
        # (the call handed it refuses it, not the mask function: a decoder-only BART forward builds its
        # cross-attention's mask and never uses it; never the caller's tensor, which a causal call may get too)
        assert is_bidirectional_mask(mask) and mask.shape == (2, 40) and mask is not given
        with pytest.raises(NonCausalMask, match=r"type 'llama'\) builds a bidirectional attention mask .*create_bidi"
                                                r"rectional_mask.*attn_implementation='sdpa' or 'eager'"):
            sparse_cp_attention_forward(layer, q, q, q, mask)
    cross = create_bidirectional_mask(config=_config(), inputs_embeds=embeds, attention_mask=None,
                                      encoder_hidden_states=torch.zeros(2, 10, 8))  # (40 queries, 10 keys)
    assert is_bidirectional_mask(cross) and cross.shape == (2, 10)
    assert not is_bidirectional_mask(cross.clone()) and not is_bidirectional_mask(None)
    with pytest.raises(NonCausalMask, match="lets tokens see later ones"):
        sparse_cp_mask(2, 40, 40, mask_function=sliding_window_bidirectional_mask_function(4), device="meta")


@pytest.mark.parametrize("q_offset", [24, torch.tensor(24)], ids=["int", "tensor"])
def test_causal_masks_through_a_cache_pass_on_and_bidirectional_ones_are_refused(q_offset):
    """Through a KV cache (16 queries after 24 tokens: a chunk of prefill; a StaticCache gives its offset as a tensor)
    the keys after each query are the cache's later tokens: a causal window passes on, a bidirectional one does not."""
    mask = sparse_cp_mask(2, 16, 40, q_offset, 0, mask_function=sliding_window_causal_mask_function(8), device="cpu")
    assert mask.shape == (2, 40) and bool(mask.all())
    with pytest.raises(NonCausalMask, match="lets tokens see later ones"):
        sparse_cp_mask(2, 16, 40, q_offset, 0, mask_function=sliding_window_bidirectional_mask_function(8),
                       device="cpu")
    # (the last query sees the last key: no key after it, which a bidirectional window would see)
    assert sparse_cp_mask(2, 1, 40, 39, 0, mask_function=sliding_window_bidirectional_mask_function(8),
                          device="cpu").shape == (2, 40)


def _packed(length=40):
    return torch.cat([torch.arange(25), torch.arange(length - 25)])[None].expand(2, length)


@pytest.mark.parametrize("make, model_type, extra", [
    (create_causal_mask, "llama", {}),
    (create_sliding_window_causal_mask, "mistral", {"sliding_window": 16}),
    (create_chunked_causal_mask, "llama4_text", {"attention_chunk_size": 16}),
], ids=["causal", "window", "chunked"])
@pytest.mark.parametrize("packed", [False, True], ids=["one_document", "packed"])
def test_transformers_own_compositions_pass_on_without_reading_the_device(make, model_type, extra, packed):
    """transformers' window, chunk and packed-documents masks are and-masks with the causal function in them, which
    never see a later key: known from their structure (`_causal_composition`), they are not evaluated, so no value is
    read back (a stall per forward on a GPU; a graph break under torch.compile). Before: one read per mask."""
    from host_reads import count_host_reads

    config = _config(model_type, **extra)
    if make is create_chunked_causal_mask:  # (transformers builds the chunked mask when the config asks for one)
        config.layer_types = ["chunked_attention"] * config.num_hidden_layers
    with count_host_reads() as reads:
        mask = _mask(make, config=config, position_ids=_packed() if packed else None)
    assert mask is None and reads.total == 0, reads.table()


@compiles_the_mask_build
def test_on_a_torch_without_ordered_effects_a_compiled_mask_build_still_refuses(monkeypatch):
    """torch 2.6 (setup.cfg's oldest) has no registry of ordered effects: registering `refuse_next_key` as one failed
    the plugin's import there, and unregistered the op would be dropped from the graph (its refusal lost). Without it,
    the registration is skipped and the compiled build runs the refusal outside the graph (a graph break), as before."""
    from hf_sparse_cp.integration import call_tokens, upstream

    monkeypatch.setattr(upstream, "release", lambda package: (2, 6, 0))
    assert upstream.register_ordered_effect("hf_sparse_cp::refuse_next_key") is False
    monkeypatch.setattr(call_tokens, "_REFUSED_IN_GRAPHS", False)

    def build(function, positions):
        return sparse_cp_mask(2, 40, 40, mask_function=function(positions), device="cpu"), positions + 1

    torch._dynamo.reset()
    try:
        compiled = torch.compile(build, backend="aot_eager")
        with pytest.raises(NonCausalMask, match=r"lets tokens see later ones.*attn_implementation='sdpa'"):
            compiled(sliding_window_bidirectional_mask_function, torch.tensor(8))
        assert compiled(sliding_window_causal_mask_function, torch.tensor(8))[0] is None
    finally:
        torch._dynamo.reset()


@compiles_the_mask_build
def test_a_compiled_forwards_mask_is_refused_in_the_graph():
    """Under torch.compile the mask function's closure is not read (torch 2.11's dynamo cannot), so the evaluation
    stays in the graph (no graph break: fullgraph), and so does its refusal (`refuse_next_key`, an op the graph keeps
    though it returns nothing; backend aot_eager drops ops whose output no one reads): a bidirectional window is
    refused by the compiled build itself, naming the fix, and a causal one passes. Before, its answer was left on a
    list for the forward's first attention call to read, a Python side effect that an activation-checkpointed
    layer's trace refuses (tests/unit/test_torch_compile.py: that layer ran outside the graph)."""
    def build(function, positions):
        return sparse_cp_mask(2, 40, 40, mask_function=function(positions), device="cpu"), positions + 1

    torch._dynamo.reset()
    try:
        for function, refused in ((sliding_window_causal_mask_function, False),
                                  (sliding_window_bidirectional_mask_function, True)):
            compiled = torch.compile(build, backend="aot_eager", fullgraph=True)
            if refused:
                with pytest.raises(NonCausalMask, match=r"lets tokens see later ones.*attn_implementation='sdpa'"):
                    compiled(function, torch.tensor(8))
            else:
                assert compiled(function, torch.tensor(8))[0] is None
    finally:
        torch._dynamo.reset()
