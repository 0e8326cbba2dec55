"""The memory model (`hf_sparse_cp.simulator.memory_model`) and `hf-sparse-cp memory`: the tensors a recomputed
decoder layer saves, counted by autograd's own hooks, against the model's inventory; how the peak
moves with length, CP, FSDP and the savers; the "how long fits" answer and the command's errors."""

import contextlib
import dataclasses
import json
import re

import pytest
import torch
from memory_steps import step_config, unchecked_step_peak
from transformers import AutoModelForCausalLM

import hf_sparse_cp
from hf_sparse_cp import SparseAttentionConfig, configure
from hf_sparse_cp.cli import main as cli_main
from hf_sparse_cp.config.model_fields import decoder_layers
from hf_sparse_cp.integration.memory_savers import enable_memory_savers
from hf_sparse_cp.memory import MemorySavers
from hf_sparse_cp.simulator import memory_cli
from hf_sparse_cp.simulator.memory_cli import parse_memory
from hf_sparse_cp.simulator.memory_model.architecture import Architecture
from hf_sparse_cp.simulator.memory_model.layer import recomputed_layer_bytes
from hf_sparse_cp.simulator.memory_model.presets import PRESETS
from hf_sparse_cp.simulator.memory_model.search import longest_fitting_length
from hf_sparse_cp.simulator.memory_model.settings import StepSettings, with_savers
from hf_sparse_cp.simulator.memory_model.step import predict_step_memory
from hf_sparse_cp.simulator.shapes import ModelShape
from hf_sparse_cp.testing.tiny_models import tiny_config

# A small Llama-shaped config.json's fields.
TINY_LLAMA = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=256)
PATTERN = SparseAttentionConfig(block_size=64, min_seq_len=128, dense_first_layers=0, vertical_topk=16, slash_topk=4,
                                sink_tokens=16, local_window=64, last_q=32)


def _weight_copy(module: torch.nn.Module):
    """Whether a saved tensor is autocast's 16-bit copy of one of `module`'s matrices, or its transpose (which the
    model counts as its "autocast weight copies", not as activations): told by its values."""
    matrices = [p.detach() for p in module.parameters() if p.dim() == 2]

    def copied(t: torch.Tensor) -> bool:
        return t.dim() == 2 and t.dtype != torch.float32 and any(
            torch.equal(u, m.to(t.dtype)) for m in matrices for u in (t, t.T) if u.shape == m.shape)

    return copied


def _new_saved(call, *known: torch.Tensor, skip=lambda t: False) -> dict[int, tuple[int, bool]]:
    """Storage -> (bytes, whether int32) of what autograd saves while `call()` runs, besides the storages of `known`
    (inputs and parameters, which existed before) and the tensors `skip` names."""
    before = {t.untyped_storage().data_ptr() for t in known}
    seen: dict[int, tuple[int, bool]] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in before and not skip(t):
            seen[storage.data_ptr()] = storage.nbytes(), t.dtype == torch.int32
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        call()
    return seen


def _saved_bytes(layer, x, position_embeddings) -> tuple[int, int]:
    """Bytes of the distinct storages autograd saves in one forward of `layer` with grad, besides those
    that existed before (the input, the parameters, the rotary tables) and autocast's copies of its matrices:
    (activations, the attention's layout, whose tensors are the only int32 ones saved)."""
    seen = _new_saved(lambda: layer(x, position_embeddings=position_embeddings), x, *position_embeddings,
                      *layer.parameters(), skip=_weight_copy(layer))
    return tuple(sum(n for n, is_layout in seen.values() if is_layout == part) for part in (False, True))


@pytest.mark.parametrize("family, tiled, window, autocast", [
    ("qwen2", False, None, False), ("qwen2", True, None, False), ("qwen2", False, 128, False),
    ("qwen3", False, None, False), ("qwen3", True, None, False), ("qwen2", True, None, True),
    ("qwen3", True, None, True),
], ids=["stock", "tiled", "sliding", "qwen3", "qwen3-tiled", "tiled-autocast", "qwen3-tiled-autocast"])
def test_a_recomputed_layer_saves_what_the_model_counts(family, tiled, window, autocast):
    """The tensors a layer saves, and its layout within the model's bound; a sliding-window layer (issue #50: sized as
    a global one) runs dense over the blocks of its window, unestimated. Token tiles replace the Llama layer's norms
    and MLP only: Qwen3's q/k norms keep their tensors (#50: counted as a Llama layer's, 1808 bytes a token of these
    tiny layers where they save 2984). Under autocast the layer's input is fp32 (see the next test)."""
    hf_sparse_cp.patch()
    sliding = dict(use_sliding_window=True, max_window_layers=0, sliding_window=window) if window else {}
    config = tiny_config(family, vocab_size=300, intermediate_size=352, **sliding)
    torch.manual_seed(0)
    dtype = torch.float32 if autocast else torch.bfloat16
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sparse_cp", dtype=dtype)
    configure(model, PATTERN)
    model.train()
    if tiled:
        enable_memory_savers(model, MemorySavers(tiled=True, tile_tokens=96))
    s = 512
    x = torch.randn(1, s, config.hidden_size, dtype=dtype, requires_grad=True) * 1.0
    positions = torch.arange(s).unsqueeze(0)
    cos_sin = model.model.rotary_emb(x, positions)
    with torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext():
        measured, layout = _saved_bytes(model.model.layers[0], x, cos_sin)

    arch = Architecture.from_config(config)
    predicted = recomputed_layer_bytes(arch, s, StepSettings(device="cpu", pattern=PATTERN, master_weights=autocast,
                                                             savers=MemorySavers(tiled=tiled, tile_tokens=96)))
    assert predicted["mlp"] == (0 if tiled else 4 * s * config.intermediate_size * 2)
    assert measured == sum(v for k, v in predicted.items() if k != "layout")
    assert 0 < layout <= predicted["layout"]  # the model sizes it at the budget's bound
    if window:  # (its window's 3 blocks of 64 on one shared head, not the budget's bound on every head)
        assert arch.shape.windows == (window,) * config.num_hidden_layers
        assert layout == predicted["layout"] < recomputed_layer_bytes(
            dataclasses.replace(arch, shape=dataclasses.replace(arch.shape, windows=())), s,
            StepSettings(device="cpu", pattern=PATTERN))["layout"]


@pytest.mark.parametrize("master_weights", [False, True], ids=["bf16-model", "autocast"])
def test_under_autocast_the_layer_inputs_are_fp32_and_counted_so(master_weights):
    """#50: under autocast (an fp32 model with the Trainer's --bf16) the embedding's output is fp32, and so is every
    decoder layer's input and output (an RMSNorm returns its input's dtype, a residual sum promotes): gradient
    checkpointing keeps each layer's input in fp32, which the model counted in bf16 (Qwen2.5-0.5B at 64K tokens:
    2.8 GB of 5.6). Under FSDP2, whose mixed precision gathers bf16 weights (accelerate's param_dtype), bf16."""
    config = tiny_config("qwen2", vocab_size=300)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32 if master_weights else torch.bfloat16)
    seen: set[torch.dtype] = set()
    for layer in decoder_layers(model):
        layer.register_forward_hook(lambda m, args, out: seen.update(
            {args[0].dtype, (out[0] if isinstance(out, tuple) else out).dtype}))
    with torch.autocast("cpu", dtype=torch.bfloat16) if master_weights else contextlib.nullcontext():
        model(input_ids=torch.randint(0, config.vocab_size, (1, 64)))
    assert seen == {torch.float32 if master_weights else torch.bfloat16}

    arch, n = PRESETS["qwen2.5-0.5b"], 65536
    layer_inputs = arch.shape.layers * n * arch.shape.hidden
    for fsdp, width in ((1, 4 if master_weights else 2), (2, 2)):
        est = predict_step_memory(arch, n, StepSettings(master_weights=master_weights, fsdp=fsdp))
        assert est.terms("forward")["saved layer inputs"] == layer_inputs * width


def test_fsdp2_under_mixed_precision_gathers_bf16_weights_and_autocast_copies_none():
    """#50: accelerate gives FSDP2 a mixed-precision policy of the Trainer's dtype (param_dtype, reduce_dtype: bf16
    under --bf16): each layer's weights are gathered in bf16 and their unsharded gradients are bf16, so autocast has
    no fp32 weight to copy. The model counted fp32 gathered layers and unsharded gradients, and every layer's autocast
    copies, unsharded (Qwen2.5-7B, FSDP 8 and CP 8 at 128K tokens: a forward peak of 29.6 GiB predicted, 16.5 now)."""
    from accelerate.utils import FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
    plugin.set_mixed_precision("bf16")
    assert (plugin.mixed_precision_policy.param_dtype, plugin.mixed_precision_policy.reduce_dtype) == (
        torch.bfloat16, torch.bfloat16)

    arch = PRESETS["qwen2.5-7b"]
    est = predict_step_memory(arch, 131072, StepSettings(master_weights=True, fsdp=8, cp=8))
    assert all("autocast weight copies" not in est.terms(phase) for phase in est.phases)
    assert est.terms("forward")["FSDP gathered layers"] == 2 * arch.layer_params * 2
    one_rank = predict_step_memory(arch, 131072, StepSettings(master_weights=True))
    assert one_rank.terms("forward")["autocast weight copies"] > 0


# Decoders of both MLP forms (gated: gate, up, down; two matrices: fc1, fc2) and several activations, tiny. GPT-NeoX's
# and GPT-2's attention have no key/value heads of their own (the tiny fields' 2 would be refused, unread).
MLP_FORMS = {"qwen2": (True, {}), "gemma": (True, {}), "gpt_neox": (False, {"num_key_value_heads": 4}),
             "phi": (False, {}), "starcoder2": (False, {}), "gpt2": (False, {"num_key_value_heads": 4}),
             "nemotron": (False, {})}


@pytest.mark.parametrize("model_type", sorted(MLP_FORMS))
def test_an_mlp_saves_what_the_model_counts(model_type):
    """Issue #50: every MLP was counted as gated, four [tokens, intermediate] tensors saved for backward; a two-matrix
    MLP saves what its activation keeps and its output (GELU: fc1's output and the activation's; GPT-2's tanh GELU,
    written out in PyTorch ops: five), counted by autograd's own hooks (dropout off: not modelled)."""
    gated, extra = MLP_FORMS[model_type]
    config = tiny_config(model_type, vocab_size=300, **extra)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    mlp = decoder_layers(model)[0].mlp
    s = 512
    x = torch.randn(1, s, config.hidden_size, dtype=torch.bfloat16, requires_grad=True)
    measured = sum(n for n, _ in _new_saved(lambda: mlp(x), x, *mlp.parameters()).values())

    arch = Architecture.from_config(config)
    predicted = recomputed_layer_bytes(arch, s, StepSettings(device="cpu", pattern=PATTERN))
    assert (arch.shape.gated, arch.shape.mlp_matrices) == (gated, 3 if gated else 2)
    assert measured == predicted["mlp"] > 0


def _first_layer_saved(model, ids) -> tuple[int, int]:
    """(activations, layout) bytes of the distinct storages autograd saves while the first decoder layer of `model`
    runs in a forward of `ids`, besides those that existed when it started (its arguments, the parameters) and
    autocast's copies of its matrices."""
    layer, known, seen, running = decoder_layers(model)[0], {p.untyped_storage().data_ptr() for p in model.parameters()
                                                             }, {}, []

    def enter(module, args, kwargs):
        for value in (*args, *kwargs.values()):
            for t in value if isinstance(value, tuple) else (value,):
                if isinstance(t, torch.Tensor):
                    known.add(t.untyped_storage().data_ptr())
        running.append(True)

    weight_copy = _weight_copy(layer)

    def pack(t):
        storage = t.untyped_storage()
        if running and storage.data_ptr() not in known and not weight_copy(t):
            seen[storage.data_ptr()] = storage.nbytes(), t.dtype == torch.int32
        return t

    handles = [layer.register_forward_pre_hook(enter, with_kwargs=True),
               layer.register_forward_hook(lambda *_: running.clear())]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(input_ids=ids, use_cache=False)  # (as training runs: a cache would copy GPT-2's K/V views)
    finally:
        for handle in handles:
            handle.remove()
    return tuple(sum(n for n, is_layout in seen.values() if is_layout == part) for part in (False, True))


# Dense decoders whose layers differ from a Llama one: LayerNorm (GPT-NeoX, Phi, StarCoder2, GPT-2), a fused q/k/v
# projection (GPT-NeoX, GPT-2), partial rotary (GPT-NeoX, Phi), parallel attention and MLP (GPT-NeoX, Phi), Gemma 3's
# four norms and q/k norms; the tiny fields' 2 key/value heads are refused where the attention has none of its own.
# And the mixtures of experts (`shapes.MOE_FAMILIES`: 4 experts, 2 a token), whose block's tensors are measured.
LAYER_FORMS = {"llama": {}, "gpt_neox": {"num_key_value_heads": 4}, "phi": {}, "starcoder2": {},
               "gpt2": {"num_key_value_heads": 4, "resid_pdrop": 0.0, "embd_pdrop": 0.0}, "gemma3_text": {},
               "mixtral": {}, "olmoe": {}, "qwen2_moe": {}, "qwen3_moe": {}}


@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "autocast"])
@pytest.mark.parametrize("model_type", sorted(LAYER_FORMS))
def test_a_recomputed_layer_of_any_architecture_saves_what_the_model_counts(model_type, dtype):
    """Issue #50: a non-Llama layer was sized as a Llama one (these tiny configs at 512 tokens, bf16: predicted 18-47%
    over for GPT-NeoX, Phi, StarCoder2 and GPT-2, 45% under for Gemma 3); its saved tensors are now measured on the
    model (on the meta device, at other lengths), and equal those autograd's hooks count in a real CPU forward with
    the sparse_cp attention, whose core (output, log-sum-exp, layout) the model sizes from its code. An fp32 Llama
    layer's post-attention RMSNorm saves its input, the residual sum (which bf16 copies to fp32): 5.9% under before.
    Under autocast (fp32 weights, the Trainer's --bf16) the residual stream is fp32 (the embedding's output) and each
    matrix product saves its own bf16 copy of its input (#50: counted as a bf16 model's layer, 13% under for Qwen2);
    its copies of the weights are the model's "autocast weight copies", apart. A mixture of experts' layer was refused
    ("one dense MLP per layer is counted"): its block's router probabilities, gathered tokens and experts'
    intermediates are now measured too (`measurements.moe_bytes`; its grouped matmuls' int32 offsets, which the count
    here takes for the layout's, apart)."""
    hf_sparse_cp.patch()
    config = tiny_config(model_type, vocab_size=300, **LAYER_FORMS[model_type])
    torch.manual_seed(0)
    autocast = dtype == "autocast"
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sparse_cp",
                                             dtype=torch.float32 if autocast else getattr(torch, dtype))
    configure(model, PATTERN)
    model.train()
    s = 512
    with torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext():
        measured, layout = _first_layer_saved(model, torch.randint(0, config.vocab_size, (1, s)))

    arch = Architecture.from_config(config)
    settings = StepSettings(dtype="bfloat16" if autocast else dtype, master_weights=autocast, device="cpu",
                            pattern=PATTERN)
    predicted = recomputed_layer_bytes(arch, s, settings)
    if model_type == "llama":  # the Llama layer's inventory, counted on its code (the presets'): the same
        counted = recomputed_layer_bytes(dataclasses.replace(arch, layer_saved=None), s, settings)
        assert measured == sum(v for k, v in counted.items() if k != "layout")
    # (the measurement keeps a LayerNorm's mean and rstd in fp32, as CUDA does; a CPU in the input's dtype)
    norms = sum(isinstance(m, torch.nn.LayerNorm) for m in decoder_layers(model)[0].modules())
    statistics = norms * 2 * s * (4 - model.dtype.itemsize)
    offsets = 4 * arch.shape.experts
    assert measured + statistics + offsets == sum(v for k, v in predicted.items() if k != "layout")
    assert 0 < layout <= predicted["layout"]


@pytest.mark.parametrize("release_rule", [
    lambda attention_mask, key: attention_mask is None,  # transformers 5.17 on CUDA (no environment variable)
    lambda attention_mask, key, value: False,  # an accelerator without grouped SDPA
], ids=["mask-none-only", "never"])
def test_a_layers_saved_tensors_are_measured_whatever_the_releases_rule_for_grouped_sdpa(monkeypatch, release_rule):
    """Issue #50: on the H200 (transformers 5.17) every config of grouped K/V heads was refused ("made 1 SDPA calls (key
    /value heads [14])": its `use_gqa_in_sdpa` reads no TRANSFORMERS_SDPA_FORCE_GQA and repeated the heads), so
    bench_e2e's sparse_cp step at 256K failed before training; the measurement now answers that rule itself."""
    from transformers.integrations import sdpa_attention

    config = tiny_config("llama", vocab_size=300)
    assert config.num_key_value_heads < config.num_attention_heads
    expected = dict(Architecture.from_config(config).layer_saved)  # (every dtype's, measured before the change)
    monkeypatch.setattr(sdpa_attention, "use_gqa_in_sdpa", release_rule)
    assert dict(Architecture.from_config(config).layer_saved) == expected
    assert sdpa_attention.use_gqa_in_sdpa is release_rule  # (restored after the measurement)


def test_a_configs_saved_bytes_are_measured_for_the_dtype_a_prediction_reads():
    """`hf-sparse-cp memory --config` measured what the layers save in all three activation dtypes, and built the
    model twice (5 s of an 8B config's 8): bfloat16's is measured at once (a model the measurement refuses is refused
    there), another dtype's when a prediction first reads it, equal to that dtype's measurement alone."""
    from hf_sparse_cp.simulator.memory_model.measurements import layer_saved
    from hf_sparse_cp.simulator.shapes import meta_model

    config = tiny_config("qwen2", vocab_size=300)
    arch = Architecture.from_config(config)
    plain = (False, False)  # (neither LoRA's frozen layers nor autocast)
    assert list(arch.layer_saved._measured) == [("bfloat16", *plain)]
    predict_step_memory(arch, 1024, StepSettings(dtype="float32", device="cpu"))
    assert sorted(arch.layer_saved._measured) == [("bfloat16", *plain), ("float32", *plain)]
    predict_step_memory(arch, 1024, StepSettings(master_weights=True, device="cpu"))
    assert ("bfloat16", False, True) in arch.layer_saved._measured
    alone = layer_saved(meta_model(config, "qwen2"), torch.float32, config.num_key_value_heads, "qwen2")
    assert arch.layer_saved["float32"] == alone and arch.layer_saved["float32"] != arch.layer_saved["bfloat16"]
    assert len(arch.layer_saved) == 3 and "int8" not in arch.layer_saved


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_model_without_the_lean_loss_holds_its_stock_logits(dtype):
    """Issue #50: every config was predicted with the lean loss, which replaces the forward of the Llama-like causal
    LMs only: GPT-NeoX's stock forward holds the logits in bf16, their fp32 copy and its log-softmax (kept for
    backward), then the NLL's and the log-softmax's fp32 gradients; measured by the allocation recorder (and
    autograd's hooks for what it keeps), equal to the model's (benchmarks/memory_model.py, a 2-layer GPT-NeoX of
    vocabulary 8192 at 16K tokens: measured step peak 1647 MiB, predicted 788 before, 1668 now); fp32 logits are
    their own fp32 copy."""
    from hf_sparse_cp.integration.lean_loss import disable_lean_loss, enable_lean_loss, is_lean_loss_enabled
    from hf_sparse_cp.testing.allocations import AllocationRecorder

    hf_sparse_cp.patch()
    enabled = not is_lean_loss_enabled()
    enable_lean_loss()  # (what training runs: it declines a model of another family)
    try:
        config = tiny_config("gpt_neox", vocab_size=16384, num_key_value_heads=4, num_hidden_layers=1)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sparse_cp", dtype=getattr(torch, dtype))
        configure(model, PATTERN)
        model.train()
        s, vocab = 512, config.vocab_size
        ids = torch.randint(0, vocab, (1, s))
        kept: dict[int, int] = {}

        def pack(t):
            if t.dim() >= 2 and tuple(t.shape[-2:]) == (s, vocab):
                kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        forward, backward = AllocationRecorder(with_sites=False), AllocationRecorder(with_sites=False)
        with forward, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(input_ids=ids, labels=ids).loss
        with backward:
            loss.backward()
    finally:
        if enabled:
            disable_lean_loss()

    def logits(recorder) -> int:  # the [tokens, vocab] tensors alive at the recorder's peak
        return sum(a.nbytes for a in recorder.at_peak if len(a.shape) >= 2 and a.shape[-2:] == (s, vocab))

    arch = Architecture.from_config(config)
    est = predict_step_memory(arch, s, StepSettings(dtype=dtype, device="cpu", pattern=PATTERN))
    assert logits(forward) == est.terms("loss").get("loss: logits", 0) == (
        (2 + 4 + 4) if dtype == "bfloat16" else (4 + 4)) * s * vocab
    assert logits(backward) + sum(kept.values()) == est.terms("backward").get("loss: logits", 0) == 3 * 4 * s * vocab
    assert not arch.lean_loss and len(kept) == 1


def test_the_optimizer_step_holds_every_parameters_gradient_and_its_largest_ones_temporaries():
    """Issue #50: the gradients of the parameters outside the layers and the embedding (GPT-2's learned positions,
    the final norm, Phi's LM head bias) were not counted, and AdamW's per-tensor temporaries were sized at the
    embedding, not at a larger parameter (GPT-2's positions); a 2-layer GPT-2 of 32K positions at 4K tokens: the
    measured optimizer phase 189 MiB, predicted 134). The gradients held at the optimizer step are those a backward
    leaves; the step's temporaries at its peak, two of the largest parameter (the recorder)."""
    from hf_sparse_cp.testing.allocations import AllocationRecorder

    config = tiny_config("gpt2", vocab_size=300, num_key_value_heads=4, max_position_embeddings=4096)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    ids = torch.randint(0, config.vocab_size, (1, 64))
    for _ in range(2):  # (the second step: the state exists, as in training)
        model(input_ids=ids, labels=ids).loss.backward()
        gradients = sum(p.grad.untyped_storage().nbytes() for p in model.parameters() if p.grad is not None)
        recorder = AllocationRecorder(with_sites=False)
        with recorder:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    largest = max(model.parameters(), key=lambda p: p.numel())
    temporaries = sum(a.nbytes for a in recorder.at_peak if a.shape == tuple(largest.shape))

    est = predict_step_memory(Architecture.from_config(config), 64, StepSettings(device="cpu", pattern=PATTERN))
    assert est.terms("optimizer")["gradients"] == gradients
    assert est.terms("optimizer")["optimizer step temporaries"] == temporaries == 2 * largest.numel() * 2


def test_a_stock_loss_that_soft_caps_its_logits_is_refused():
    """The stock loss's soft-capping temporaries are not modelled: such a config (Gemma 2's 30) is refused naming the
    field, not predicted as an uncapped loss."""
    from transformers import AutoConfig

    with pytest.raises(ValueError, match="final_logit_softcapping=30.0"):
        Architecture.from_config(AutoConfig.for_model("gemma2", **TINY_LLAMA))


# Real-sized configs (the fields of their config.json on the Hugging Face Hub), with the published parameter counts.
REAL_SIZED = {
    "pythia-1.4b": (dict(model_type="gpt_neox", num_hidden_layers=24, hidden_size=2048, num_attention_heads=16,
                         intermediate_size=8192, vocab_size=50304, rotary_pct=0.25), False, 1.41e9),
    "phi-2": (dict(model_type="phi", num_hidden_layers=32, hidden_size=2560, num_attention_heads=32,
                   intermediate_size=10240, vocab_size=51200, partial_rotary_factor=0.4), False, 2.78e9),
    "starcoder2-3b": (dict(model_type="starcoder2", num_hidden_layers=30, hidden_size=3072, num_attention_heads=24,
                           num_key_value_heads=2, intermediate_size=12288, vocab_size=49152), False, 3.03e9),
    "gpt2": (dict(model_type="gpt2", n_layer=12, n_embd=768, n_head=12, vocab_size=50257), False, 124.4e6),
    "gemma-2b": (dict(model_type="gemma", num_hidden_layers=18, hidden_size=2048, num_attention_heads=8,
                      num_key_value_heads=1, head_dim=256, intermediate_size=16384, vocab_size=256000), True, 2.51e9),
}


@pytest.mark.parametrize("name", [*sorted(REAL_SIZED), *(f"tiny-{t}" for t in sorted(MLP_FORMS))])
def test_a_configs_parameters_and_linear_work_are_its_models(name):
    """Issue #50: a config's parameters (biases, LayerNorms, tied or untied LM head, GPT-2's position embeddings, Phi's
    LM head bias) are the transformers model's, built on the meta device (Pythia-1.4B's shape read 1.82B parameters,
    GPT-2's config was refused), and simulate's linear FLOPs those of its layers' matrices."""
    from transformers import AutoConfig

    if name.startswith("tiny-"):
        gated, extra = MLP_FORMS[name[5:]]
        config, published = tiny_config(name[5:], vocab_size=300, **extra), None
    else:
        fields, gated, published = REAL_SIZED[name]
        config = AutoConfig.for_model(**fields)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    arch = Architecture.from_config(config)
    assert arch.shape.gated == gated
    assert arch.params == sum(p.numel() for p in model.parameters())
    assert arch.tied_embeddings == (model.get_output_embeddings().weight is model.get_input_embeddings().weight)
    if published:
        assert arch.params == pytest.approx(published, rel=0.005)
    matrices = sum(p.numel() for p in decoder_layers(model)[0].parameters() if p.dim() == 2)
    assert arch.shape.linear_flops(recompute=False)[0] == 6 * matrices


@pytest.mark.parametrize("fields, message", [
    ({**TINY_LLAMA, "model_type": "apertus", "hidden_act": "xielu"}, "hidden_act='xielu'"),
    ({**TINY_LLAMA, "model_type": "gpt_neox"}, "that its fields give (num_key_value_heads"),
], ids=["xielu_with_weights", "unread_kv_heads"])
def test_a_config_whose_mlp_or_layers_the_model_cannot_read_is_refused(fields, message, tmp_path, capsys):
    """An activation with weights of its own (xIELU: not run on the meta device), or a field the model does not read
    (GPT-NeoX has no key/value heads of its own), is refused naming it by both commands, not counted as a gated
    Llama layer."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(fields))
    for command in ("memory", "simulate"):
        with pytest.raises(SystemExit):
            cli_main([command, "--config", str(path), "--quiet"] if command == "memory" else
                     [command, "--config", str(path)])
        assert message in capsys.readouterr().err


def test_sliding_window_layers_are_read_from_the_config_and_other_layer_types_refused():
    """Issue #50: every layer was sized as a global one. Gemma 3 270M's `layer_types`: 15 sliding layers of 512
    tokens, 3 global (5, 11, 17), whose layouts set the peak; Mistral's `sliding_window` is every layer's (its
    attention passes it to every call): no estimation, and layouts of the window's blocks. A layer type the model
    does not know (Llama 4's chunked attention), or sliding layers without a window, are refused naming the field."""
    from transformers import AutoConfig, LlamaConfig, MistralConfig

    gemma = Architecture.from_config(AutoConfig.for_model(
        "gemma3_text", num_hidden_layers=18, hidden_size=640, num_attention_heads=4, num_key_value_heads=1,
        head_dim=256, intermediate_size=2048, vocab_size=262144, sliding_window=512))
    assert [i for i, w in enumerate(gemma.shape.windows) if w is None] == [5, 11, 17]
    assert set(gemma.shape.windows) == {None, 512}
    fields = dict(num_hidden_layers=4, hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=512, vocab_size=1000)
    n, settings = 1 << 17, StepSettings(pattern=PATTERN)
    sliding, unwindowed = (Architecture.from_config(MistralConfig(**fields, sliding_window=w)) for w in (1024, None))
    assert sliding.shape.windows == (1024,) * 4 and unwindowed.shape.windows == ()
    layouts = [recomputed_layer_bytes(arch, n, settings)["layout"] for arch in (sliding, unwindowed)]
    assert layouts[0] < layouts[1]
    peaks = [predict_step_memory(arch, n, settings) for arch in (sliding, unwindowed)]
    assert peaks[0].peak_bytes < peaks[1].peak_bytes and "a sliding window of 1024 tokens" in peaks[0].layout_width
    with pytest.raises(ValueError, match=r"layer_types .* names \['chunked_attention'\]"):
        ModelShape.from_config(LlamaConfig(**fields, layer_types=["full_attention", "chunked_attention"] * 2))
    with pytest.raises(ValueError, match="sliding_window=None for sliding-window layers"):
        ModelShape.from_config(LlamaConfig(**fields, layer_types=["sliding_attention"] * 4))


def test_a_window_field_no_code_of_the_model_reads_is_no_window_in_the_predictions():
    """A Llama config that carries `sliding_window` attends past it (its code never reads the field: SDPA, and
    sparse_cp since `call_refusals.mask_only_window` computes it as SDPA): its layers were predicted as sliding-window
    layers (a window's dense layout, far less work and memory than the run's). Mistral's attention reads it. So does
    OLMoE's attention, which passes the field to the attention function while its mask never holds it: SDPA and
    sparse_cp attend past it, and its layers were predicted as sliding-window layers."""
    from transformers import LlamaConfig, MistralConfig, OlmoeConfig

    fields = dict(num_hidden_layers=4, hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=512, vocab_size=1000)
    assert ModelShape.from_config(LlamaConfig(**fields, sliding_window=1024)).windows == ()
    olmoe = OlmoeConfig(**fields, num_experts=4, num_experts_per_tok=2, sliding_window=1024)
    assert ModelShape.from_config(olmoe).windows == ()
    assert ModelShape.from_config(MistralConfig(**fields, sliding_window=1024)).windows == (1024,) * 4


def test_the_memory_command_reads_two_matrix_and_gpt2_style_configs(tmp_path, capsys):
    """Issue #50: a Pythia-1.4B-shaped config.json is counted as its 1.41B parameters (it read 1.82B) and a GPT-2 one
    (`n_embd`, `n_inner`: null), refused before for naming no intermediate_size, is answered."""
    for name in ("pythia-1.4b", "gpt2"):
        fields = REAL_SIZED[name][0]
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps({**fields, "n_inner": None} if name == "gpt2" else
                                                                fields))
        cli_main(["memory", "--config", str(tmp_path / name), "--gpu-memory", "80GB", "--json",
                  str(tmp_path / f"{name}.json")])
    said = capsys.readouterr().out
    answers = {name: json.loads((tmp_path / f"{name}.json").read_text()) for name in ("pythia-1.4b", "gpt2")}
    assert answers["pythia-1.4b"]["parameters"] == 1_414_647_808 and "(1.41B parameters)" in said
    assert answers["gpt2"]["parameters"] == 124_439_808 and answers["gpt2"]["longest_fitting_tokens"] > 0


@pytest.mark.parametrize("model_type, fields, positions", [
    ("gpt2", dict(n_layer=2, n_embd=64, n_head=4, n_inner=128, n_positions=512, vocab_size=300), 512),
    ("gpt_bigcode", dict(n_layer=2, n_embd=64, n_head=4, n_inner=128, n_positions=512, vocab_size=300), 512),
    ("llama", dict(TINY_LLAMA, max_position_embeddings=512), None),
])
def test_the_memory_command_answers_no_longer_than_a_learned_position_table(tmp_path, capsys, model_type, fields,
                                                                            positions):
    """`memory --config` of a GPT-2 (1,024 learned positions) answered 107,520 tokens on 80 GB, a length its forward
    refuses (IndexError: its position table ends at 1,024); the answer is the table's length where the memory
    allows more, saying so, and a --seq-len beyond it does not fit. Llama's RoPE, computed, bounds nothing."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps({"model_type": model_type, **fields}))
    cli_main(["memory", "--config", str(tmp_path / "model"), "--gpu-memory", "80GB", "--seq-len", "1024",
              "--json", str(tmp_path / "answer.json")])
    said, answer = capsys.readouterr().out, json.loads((tmp_path / "answer.json").read_text())
    assert answer["max_positions"] == positions and answer["memory_allows_tokens"] > 1024
    if positions is None:
        assert answer["longest_fitting_tokens"] == answer["memory_allows_tokens"] and answer["lengths"]["1024"]["fits"]
        return
    assert answer["longest_fitting_tokens"] == answer["longest_fitting_tokens_at_band_top"] == positions
    assert not answer["lengths"]["1024"]["fits"] and "(does not fit: beyond its 512 positions)" in said
    assert "takes at most 512 tokens (its learned position embeddings hold 512 positions" in said
    cli_main(["memory", "--config", str(tmp_path / "model"), "--gpu-memory", "80GB", "--quiet"])
    assert capsys.readouterr().out == "512\n"


def test_a_learned_position_table_counts_its_positions_not_its_offset():
    """OPT's and BioGPT's tables hold 2 rows before position 0 (their `offset`): 514 rows are 512 positions."""
    from transformers import OPTConfig

    from hf_sparse_cp.config.model_fields import learned_positions
    from hf_sparse_cp.simulator.shapes import meta_model

    config = OPTConfig(num_hidden_layers=1, hidden_size=64, num_attention_heads=4, ffn_dim=128,
                       word_embed_proj_dim=64, max_position_embeddings=512, vocab_size=300)
    assert learned_positions(meta_model(config, "opt")) == 512


def test_a_roberta_position_table_counts_the_positions_after_its_padding_index():
    """RoBERTa's family numbers positions from padding_idx + 1: a table of 66 rows with padding_idx 1 takes 64
    tokens, and its forward fails at 65 (it was read as 66)."""
    import torch
    from transformers import AutoModelForCausalLM, RobertaConfig

    from hf_sparse_cp.config.model_fields import learned_positions

    config = RobertaConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2, intermediate_size=64,
                           max_position_embeddings=66, pad_token_id=1, vocab_size=50, is_decoder=True)
    model = AutoModelForCausalLM.from_config(config)
    assert learned_positions(model) == 64
    model(torch.full((1, 64), 5))
    with pytest.raises((IndexError, RuntimeError), match="out of"):  # ('index 66 is out of bounds')
        model(torch.full((1, 65), 5))


@pytest.mark.parametrize("model_type", ["gptj", "codegen", "ctrl"])
def test_a_fixed_table_of_sines_bounds_the_positions(model_type):
    """GPT-J's and CodeGen's rotary tables and CTRL's sinusoidal one are buffers of n_positions rows (not computed as
    Llama's RoPE): their forward fails past them, which memory answered beyond (read as no bound)."""
    import torch
    from transformers import AutoModelForCausalLM

    from hf_sparse_cp.config.model_fields import learned_positions
    from hf_sparse_cp.testing.tiny_models import tiny_config

    model = AutoModelForCausalLM.from_config(tiny_config(model_type, vocab_size=97, max_position_embeddings=64))
    assert learned_positions(model) == 64
    model(torch.full((1, 64), 5))
    with pytest.raises((IndexError, RuntimeError)):
        model(torch.full((1, 65), 5))


def test_the_memory_command_tiles_tokens_only_where_training_does(tmp_path, capsys):
    """Issue #50: `memory` sized every config with token tiles from 32K tokens, where training refuses them for a
    model outside the Llama-like families (a GPT-NeoX's LayerNorms and MLP: `memory_savers.rowwise_modules`); it now
    answers without them, as that model trains, refuses an explicit tiling flag for it, and the model refuses tiled
    settings for it; a Llama config keeps them."""
    answers = {}
    for model_type, extra in (("gpt_neox", {"num_key_value_heads": 4}), ("llama", {})):
        tiny_config(model_type, vocab_size=300, **extra).save_pretrained(tmp_path / model_type)
        cli_main(["memory", "--config", str(tmp_path / model_type), "--gpu-memory", "80GB", "--seq-len", "65536",
                  "--json", str(tmp_path / f"{model_type}.json")])
        answers[model_type] = json.loads((tmp_path / f"{model_type}.json").read_text())["lengths"]["65536"]
    assert "Without token tiles" in capsys.readouterr().out
    assert (answers["gpt_neox"]["token_tiles"], answers["llama"]["token_tiles"]) == (False, True)
    arch = Architecture.from_config(tiny_config("gpt_neox", vocab_size=300, num_key_value_heads=4))
    untiled = predict_step_memory(arch, 65536, StepSettings(master_weights=True))  # (the command's precision)
    assert answers["gpt_neox"]["peak_gib"] * 2**30 == pytest.approx(untiled.peak_bytes, rel=1e-12)
    with pytest.raises(ValueError, match="Llama-like families.*--sparse_token_tiling_min_length 0"):
        predict_step_memory(arch, 65536, with_savers(StepSettings(), tiled=True))
    with pytest.raises(SystemExit):
        cli_main(["memory", "--config", str(tmp_path / "gpt_neox"), "--gpu-memory", "80GB",
                  "--token-tiling-min-length", "16384"])
    assert "refuses them for" in capsys.readouterr().err


def test_token_tiles_and_offload_cut_what_the_model_says():
    arch = PRESETS["qwen2.5-0.5b"]
    stock = predict_step_memory(arch, 1 << 20)
    tiled = predict_step_memory(arch, 1 << 20, with_savers(StepSettings(), tiled=True))
    offloaded = predict_step_memory(arch, 1 << 20, with_savers(StepSettings(), tiled=True, offload_layer_inputs=True))
    assert stock.dominant_term == "MLP intermediate"
    assert tiled.terms().get("MLP intermediate", 0) < 0.01 * stock.terms()["MLP intermediate"]
    assert tiled.dominant_term == "saved layer inputs"
    floor = arch.shape.layers * arch.shape.hidden * 2 * (1 << 20)
    assert tiled.terms()["saved layer inputs"] == pytest.approx(floor, rel=0.05)
    assert offloaded.terms().get("saved layer inputs", 0) < 0.1 * floor
    assert stock.peak_bytes > tiled.peak_bytes > offloaded.peak_bytes


def test_the_peak_grows_with_length_and_cp_and_fsdp_divide_it():
    arch = PRESETS["qwen2.5-3b"]
    peaks = [predict_step_memory(arch, n).peak_bytes for n in (1 << 14, 1 << 16, 1 << 18)]
    assert peaks == sorted(peaks)
    one = predict_step_memory(arch, 1 << 20, with_savers(StepSettings(), tiled=True))
    cp8 = predict_step_memory(arch, 1 << 20, with_savers(StepSettings(cp=8), tiled=True))
    cp8_fsdp = predict_step_memory(arch, 1 << 20, with_savers(StepSettings(cp=8, fsdp=8), tiled=True))
    assert cp8.tokens_per_rank == 1 << 17
    assert cp8.token_scaled_bytes() < one.token_scaled_bytes() / 6
    assert cp8_fsdp.terms()["optimizer state"] == pytest.approx(cp8.terms()["optimizer state"] / 8)
    assert cp8_fsdp.peak_bytes < cp8.peak_bytes


def test_smet_state_is_smaller_than_adamw():
    arch = PRESETS["qwen2.5-1.5b"]
    adamw = predict_step_memory(arch, 4096).terms("optimizer")["optimizer state"]
    smet = predict_step_memory(arch, 4096, StepSettings(optimizer="smet", smet_density=0.25)).terms(
        "optimizer")["optimizer state"]
    assert 0.2 * adamw < smet < 0.6 * adamw


def test_the_longest_fitting_length_fits_and_the_next_does_not():
    arch, settings = PRESETS["qwen2.5-0.5b"], with_savers(StepSettings(), tiled=True)
    budget = 40e9
    n = longest_fitting_length(arch, budget, settings, granularity=8192)
    assert n % 8192 == 0 and n > 0
    assert predict_step_memory(arch, n, settings).peak_bytes <= budget
    assert predict_step_memory(arch, n + 8192, settings).peak_bytes > budget
    assert longest_fitting_length(arch, 1e9, settings) == 0  # the weights and AdamW state alone need more


def test_the_longest_fitting_length_is_not_cut_at_a_power_of_two_below_the_search_limit(capsys, monkeypatch):
    """`hf-sparse-cp memory --model qwen2.5-0.5b --cp 64 --fsdp 64 --gpu-memory 141GB --sparse-config trial` said
    "Longest sequence that fits: 67,108,864 tokens" (a peak of 70.7 GB of 126.9 usable): the search stopped at 2^26
    tokens and answered the last power of two below it. The search now bisects up to its limit, the limit is far
    beyond any GPU, and an answer bounded by it says 'at least'."""
    arch, settings = PRESETS["qwen2.5-0.5b"], with_savers(StepSettings(), tiled=True)
    assert longest_fitting_length(arch, 80e9, settings, granularity=1024, limit=3 * 8192) == 3 * 8192
    argv = ["memory", "--model", "qwen2.5-0.5b", "--cp", "64", "--fsdp", "64", "--gpu-memory", "141GB",
            "--sparse-config", "trial"]
    longest = memory_cli.main(argv[1:])["longest_fitting_tokens"]
    assert longest > 1 << 26
    assert f"Longest sequence that fits: {longest:,} tokens" in capsys.readouterr().out
    monkeypatch.setattr(memory_cli, "SEARCH_LIMIT", 1 << 26)
    memory_cli.main(argv[1:])
    assert "At least 67,108,864 tokens fit (the search stops at 67,108,864)" in capsys.readouterr().out


@pytest.mark.parametrize("bad", [dict(dtype="int8"), dict(cp=0), dict(fsdp=0), dict(smet_density=0.0),
                                 dict(device="tpu"), dict(loss_backend="apex")])
def test_bad_settings_are_refused(bad):
    with pytest.raises(ValueError):
        StepSettings(**bad)


def test_the_memory_command_answers_how_long_fits(capsys, tmp_path):
    out = tmp_path / "fit.json"
    assert cli_main(["memory", "--model", "qwen2.5-0.5b", "--gpu-memory", "80GB", "--cp", "1",
                     "--seq-len", "131072", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "Longest sequence that fits:" in text and "not measurements" in text
    report = json.loads(out.read_text())
    longest = report["longest_fitting_tokens"]
    assert longest > 131072 and report["lengths"][str(longest)]["fits"]
    assert cli_main(["memory", "--model", "qwen2.5-0.5b", "--gpu-memory", "80GB", "--quiet"]) == 0
    assert int(capsys.readouterr().out) == longest


@pytest.mark.parametrize("argv, message", [
    (["--model", "qwen2.5-0.5b", "--gpu-memory", "eighty"], "give a positive size like 80GB"),
    (["--model", "qwen2.5-0.5b", "--cp", "0"], "must be >= 1"),
    (["--model", "qwen2.5-0.5b", "--usable-fraction", "1.5"], "must be in (0, 1]"),
    (["--model", "gpt-9"], "invalid choice"),
    (["--model", "qwen2.5-0.5b", "--seq-len", "0"], "argument --seq-len: 0 must be >= 1"),
    (["--model", "qwen2.5-0.5b", "--seq-len"], "expected at least one argument"),  # (it was ignored)
    # A value starting with a dash reaches the flag's own check (argparse took -5GB for a flag: 'expected one
    # argument'), and a number with a unit or of the wrong kind is refused naming the valid form
    (["--model", "qwen2.5-0.5b", "--gpu-memory", "-5GB"], "--gpu-memory '-5GB': give a positive size like 80GB"),
    (["--model", "qwen2.5-0.5b", "--gpu-memory", "0GB"], "--gpu-memory '0GB': give a positive size like 80GB"),
    (["--model", "qwen2.5-0.5b", "--usable-fraction", "-0.5x"],
     "argument --usable-fraction: '-0.5x' is not a number; give a fraction in (0, 1]"),
    (["--model", "qwen2.5-0.5b", "--usable-fraction", "0"], "argument --usable-fraction: 0.0 must be in (0, 1]"),
    (["--model", "qwen2.5-0.5b", "--fsdp", "-2"], "argument --fsdp: -2 must be >= 1"),
    (["--model", "qwen2.5-0.5b", "--cp", "two"], "argument --cp: 'two' is not a whole number; give one >= 1"),
    (["--model", "qwen2.5-0.5b", "--seq-len", "128k"], "argument --seq-len: '128k' is not a whole number"),
    (["--model", "qwen2.5-0.5b", "--seq-len", "-8k"], "argument --seq-len: '-8k' is not a whole number"),
    (["--model", "qwen2.5-0.5b", "--token-tile-size", "0"], "argument --token-tile-size: 0 must be >= 1"),
    (["--model", "qwen2.5-0.5b", "--token-tiling-min-length", "-1"],
     "argument --token-tiling-min-length: -1 must be >= 0"),
    (["--model", "qwen2.5-0.5b", "--optimizer", "smet", "--smet-density", "1.5"],
     "argument --smet-density: 1.5 must be in (0, 1]"),
    (["--model", "qwen2.5-0.5b", "--gpu-memory", "--quiet"], "argument --gpu-memory: expected one argument"),
    # more head-parallel ranks than the model's 14 query heads: refused naming the fix, not a traceback
    (["--model", "qwen2.5-0.5b", "--cp", "64", "--cp_mode", "ulysses"],
     "at most 14 that divides 64 ([1, 2, 4, 8]; balanced over the heads: [1, 2])"),
    # '' (an unset shell variable) read as no value: the default pattern predicted, no JSON written, without a word
    (["--model", "qwen2.5-0.5b", "--sparse-config", ""], "--sparse-config '' is empty (an unset shell variable?): "
     "give its value, or drop the flag."),
    (["--model", "qwen2.5-0.5b", "--json", ""], "--json '' is empty (an unset shell variable?)"),
    # FSDP2 shards over every rank of a CP group: a degree no launch makes was answered (#50)
    (["--model", "qwen2.5-3b", "--cp", "8", "--fsdp", "3"], "--fsdp 3 with --cp 8: FSDP2 shards the model over every "
     "rank of a CP group (accelerate's dp_shard x cp mesh; without a ParallelismConfig, over all processes), so its "
     "degree is a multiple of --cp: e.g. --fsdp 8 (or 16 with two data-parallel groups), or --fsdp 1 without FSDP."),
    (["--model", "qwen2.5-3b", "--cp", "4", "--fsdp", "2"], "--fsdp 2 with --cp 4: FSDP2 shards"),
])
def test_the_memory_command_names_bad_input(argv, message, capsys):
    with pytest.raises(SystemExit):
        cli_main(["memory", *argv])
    assert message in capsys.readouterr().err


def test_the_memory_commands_json_goes_where_asked_or_is_refused_before_computing(tmp_path, capsys):
    """--json in a folder that does not exist yet creates it (as `simulate` and `plot --out_dir` do); a path that
    cannot be written (under a file, or a folder) is refused as argparse refuses a flag, not with a traceback."""
    out = tmp_path / "missing" / "fit.json"
    assert cli_main(["memory", "--model", "qwen2.5-0.5b", "--json", str(out), "--quiet"]) == 0
    assert json.loads(out.read_text())["longest_fitting_tokens"] == int(capsys.readouterr().out)
    (tmp_path / "a_file").write_text("")
    for path, message in ((tmp_path / "a_file" / "x.json", f"{tmp_path / 'a_file'} is a file, not a folder"),
                          (tmp_path, "is a folder; give the path of a file")):
        with pytest.raises(SystemExit) as refused:
            cli_main(["memory", "--model", "qwen2.5-0.5b", "--json", str(path), "--quiet"])
        out, err = capsys.readouterr()
        assert refused.value.code == 2 and out == "" and f"hf-sparse-cp memory: error: --json {path}" in err
        assert message in err and "Traceback" not in err


def test_memory_sizes_parse_in_their_units():
    assert parse_memory("80GB") == 80 * 10**9
    assert parse_memory("80 GiB") == 80 * 2**30
    assert parse_memory("141") == 141 * 10**9
    assert parse_memory("auto") is None


def test_architecture_from_a_config_counts_its_parameters():
    config = tiny_config("qwen2", vocab_size=300)
    model = AutoModelForCausalLM.from_config(config)
    assert Architecture.from_config(config).params == sum(p.numel() for p in model.parameters())
    untied = dataclasses.replace(Architecture.from_config(config), tied_embeddings=False)
    assert untied.params == Architecture.from_config(config).params + 300 * config.hidden_size


def test_the_gpu_session_starts_at_the_longest_length_bench_e2e_fits():
    from benchmark_loader import load_benchmark

    with load_benchmark("memory_model") as bench:
        n = bench.bench_e2e_start_length("0.5b", 80e9, granularity=8192)
        with pytest.raises(ValueError, match="unknown bench_e2e model"):
            bench.bench_e2e_start_length("9b", 80e9)
    assert n > 0 and n % 8192 == 0


def test_the_memory_command_takes_any_config_and_follows_the_trainers_precision(tmp_path, capsys):
    """Issue #52: `--config` reads a causal LM's config.json (a Llama-3-8B-shaped one); the default precision is the
    Trainer's mixed precision (fp32 master weights), which fits less than a bf16 model; the answer states the
    validation's error band and the length that fits at its top; a mixture of experts (Mixtral-8x7B's shape, refused
    before: "one dense MLP per layer is counted") is predicted with every expert's parameters."""
    config = {"model_type": "llama", "num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
              "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    base = ["memory", "--config", str(path), "--gpu-memory", "80GB", "--cp", "4", "--fsdp", "4", "--json"]
    cli_main([*base, str(tmp_path / "mixed.json")])
    printed = capsys.readouterr().out
    cli_main([*base, str(tmp_path / "bf16.json"), "--no-master-weights"])
    mixed, bf16 = (json.loads((tmp_path / f"{name}.json").read_text()) for name in ("mixed", "bf16"))
    assert mixed["parameters"] == pytest.approx(8.03e9, rel=0.01)  # Llama-3-8B's count
    assert 0 < mixed["longest_fitting_tokens"] < bf16["longest_fitting_tokens"]
    assert mixed["longest_fitting_tokens_at_band_top"] < mixed["longest_fitting_tokens"]
    assert "fp32 weights + bfloat16 autocast" in printed and "6% below to 26% above" in printed
    cli_main(["memory", "--config", str(path), "--gpu-memory", "40GB", "--cp", "4", "--fsdp", "4"])
    refused = capsys.readouterr().out  # fp32 weights, gradients and AdamW state do not fit 40 GB over 4 ranks
    assert "Not even 4,096 tokens (1,024 per rank, the shortest length tried) fit" in refused
    assert "--no-master-weights" in refused and "--fsdp 8" in refused and "largest terms: optimizer state" in refused
    assert "train a model loaded in bfloat16 (--no-master-weights)" in refused
    # (#50: the fix named a model loaded in bf16 whatever --dtype: under float16 autocast it is one in float16)
    cli_main(["memory", "--config", str(path), "--gpu-memory", "40GB", "--cp", "4", "--fsdp", "4", "--dtype",
              "float16"])
    assert "train a model loaded in float16 (--no-master-weights)" in capsys.readouterr().out
    path.write_text(json.dumps({**config, "model_type": "mixtral", "num_local_experts": 8, "vocab_size": 32000}))
    cli_main([*base, str(tmp_path / "moe.json")])
    assert json.loads((tmp_path / "moe.json").read_text())["parameters"] == pytest.approx(46.7e9, rel=0.01)


@pytest.mark.parametrize("config, message", [
    ({"model_type": "bert", "hidden_size": 64}, "model_type 'bert' is an encoder (a masked language model), causal "
                                                "only as a decoder: set \"is_decoder\": true"),
    ({"model_type": "t5"}, "model_type 't5' is not a causal language model"),
    ({"hidden_size": 64}, "no model_type"),
    # BERT's defaults filled in: 12 heads over a hidden size of 64
    ({"model_type": "bert", "hidden_size": 64, "is_decoder": True}, "hidden_size 64 is not divisible by "
                                                                    "num_attention_heads 12"),
    ({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 12}, "The hidden size (64) is not a multiple "
                                                                            "of the number of attention heads (12)"),
    ({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 3},
     "num_attention_heads 4 is not a multiple of num_key_value_heads 3"),
], ids=["bert", "t5", "no_model_type", "bert_decoder_defaults", "llama_heads", "llama_kv_heads"])
def test_the_memory_command_refuses_a_config_that_is_no_causal_lm_or_no_consistent_shape(config, message, tmp_path,
                                                                                          capsys):
    """`--config bert.json` was answered as a causal decoder with BERT's defaults (12 heads over a hidden size of 64):
    a model type that is no causal LM (or an encoder not set as a decoder), and a shape whose heads do not divide, are
    refused naming what is wrong and the fix."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    with pytest.raises(SystemExit) as refused:
        cli_main(["memory", "--config", str(path), "--quiet"])
    out, err = capsys.readouterr()
    assert refused.value.code == 2 and out == "" and "hf-sparse-cp memory: error: " in err, err
    assert message in err and "Traceback" not in err, err


@pytest.mark.parametrize("command", ["memory", "simulate"])
def test_a_peft_adapters_folder_is_refused_naming_its_base_models_config(command, tmp_path, capsys):
    """The output folder of a LoRA run (adapter_config.json, no config.json) was refused as "no such file" and its
    adapter_config.json as having "no model_type": both are named as a PEFT adapter, with its base model's config.json
    to give; a merged model's folder (config.json beside adapter files) is read as the model it is."""
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "base_model_name_or_path": "base"}))
    rest = ["--quiet"] if command == "memory" else ["--seq", "8192", "--cp", "2"]
    for given in (adapter, adapter / "adapter_config.json"):
        with pytest.raises(SystemExit) as refused:
            cli_main([command, "--config", str(given), *rest])
        out, err = capsys.readouterr()
        assert refused.value.code == 2 and out == "" and "Traceback" not in err, err
        assert (f"--config {given}: a PEFT adapter (adapter_config.json), not a model: give its base model's "
                "config.json (`base/config.json`)") in err, err
    (adapter / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
                                                     "num_attention_heads": 4, "num_hidden_layers": 2,
                                                     "vocab_size": 256}))
    cli_main(["memory", "--config", str(adapter), "--quiet"])
    assert capsys.readouterr().out.strip().isdigit()


@pytest.mark.parametrize("cp, mode, sharding, tokens", [
    (3, [], "striped", 384), (3, [], "zigzag", 512), (3, [], "contiguous", 384),
    (6, ["--cp_mode", "hybrid", "--cp_ulysses_size", "2"], "striped", 384),
    (6, ["--cp_mode", "hybrid", "--cp_ulysses_size", "2"], "zigzag", 512),
    (4, ["--cp_mode", "ulysses"], "contiguous", 512)], ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_a_length_off_the_split_grid_is_predicted_padded_as_training_and_simulate_split_it(cp, mode, sharding, tokens,
                                                                                          tmp_path):
    """`memory --seq-len 1000 --cp 3` gave each rank 3 of the 8 blocks under every block sharding; zigzag, whose two
    chunks a rank pad the sequence to 1536 tokens (training's `ShardPlan`, which `simulate` costs), holds 512: it
    was predicted at 384. The share is now the split's (`head_group_plan`, which simulate's head groups read too):
    1000 tokens at CP 3, 1700 at CP 6 in head groups of 2 (zigzag's grid 1536, striped's 768)."""
    from hf_sparse_cp.distributed.split.blocks import head_group_plan

    seq = 1000 if cp == 3 else 1700
    out = tmp_path / "memory.json"
    cli_main(["memory", "--model", "qwen2.5-0.5b", "--seq-len", str(seq), "--cp", str(cp), *mode, "--cp_sharding",
              sharding, "--quiet", "--json", str(out)])
    head_size = 2 if "hybrid" in mode else cp if "ulysses" in mode else 1
    plan = head_group_plan(sharding, cp, head_size, 128, seq)
    assert json.loads(out.read_text())["lengths"][str(seq)]["tokens_per_rank"] == tokens == plan.local_len // head_size


@pytest.mark.parametrize("sharding, cp, head_size", [("striped", 3, 1), ("zigzag", 3, 1), ("zigzag", 6, 2)])
def test_the_ring_builds_its_layout_over_the_sequence_as_its_split_pads_it(sharding, cp, head_size):
    """#50: under the ring every rank builds the global layout over the sequence as its split pads it
    ([heads, plan.num_blocks], `estimate_cp` over the shard's padded `TokenMeta`) beside the kept flags over its
    padded length; the geometry counted the blocks and tokens of the unpadded length. A length off the split's grid
    now builds what its padded length builds (a budget that bounds the layout's width, one set of scores: nothing
    else of the construction depends on the length)."""
    from hf_sparse_cp.distributed.split.blocks import head_group_plan
    from hf_sparse_cp.simulator.memory_model.attention_geometry import attention_geometry
    from hf_sparse_cp.simulator.memory_model.settings import padded_tokens, rank_tokens

    arch, seq = PRESETS["qwen2.5-0.5b"], 10000
    s = StepSettings(cp=cp, head_size=head_size, sharding=sharding, pattern=PATTERN)
    padded = head_group_plan(sharding, cp, head_size, PATTERN.block_size, seq).padded_len
    assert padded_tokens(seq, s) == padded > seq and rank_tokens(padded, s) == rank_tokens(seq, s)
    tokens, heads = rank_tokens(seq, s) * head_size, arch.shape.heads // head_size
    at = {n: attention_geometry(arch, s, n, tokens, heads, ring=True) for n in (seq, padded)}
    assert at[seq].construction == at[padded].construction and at[seq].construction[0] > 0


def test_document_sharding_is_predicted_at_the_planners_token_cap(capsys):
    """Under --cp_sharding document the busiest rank may hold up to the planner's cap (1.25x the mean of the blocks,
    plus one block; the planner keeps it: tests/distributed/test_cp_documents.py), which the prediction sizes the
    step at; the block shardings at their equal shares."""
    from hf_sparse_cp.simulator.memory_model.settings import rank_tokens

    arch, n = PRESETS["qwen2.5-0.5b"], 1 << 20
    striped = predict_step_memory(arch, n, StepSettings(cp=8))
    document = predict_step_memory(arch, n, StepSettings(cp=8, max_token_ratio=1.25))
    assert striped.tokens_per_rank == n // 8 and document.tokens_per_rank == (1024 * 5 // 4 + 1) * 128
    assert document.peak_bytes > striped.peak_bytes
    assert rank_tokens(1000, StepSettings(cp=2, max_token_ratio=4.0)) == 1024  # (at most the whole sequence)
    argv = ["memory", "--model", "qwen2.5-0.5b", "--cp", "8", "--quiet"]
    longest = []
    by_documents = ["--cp_sharding", "document"]
    for extra in ([], by_documents, [*by_documents, "--cp_planner_max_token_ratio", "2"]):
        cli_main([*argv, *extra])
        longest.append(int(capsys.readouterr().out.strip()))
    assert longest[0] > longest[1] > longest[2]
    with pytest.raises(ValueError, match="max_token_ratio=0.9 must be finite and >= 1"):
        StepSettings(cp=8, max_token_ratio=0.9)


def test_the_memory_command_answers_for_the_cp_mode_asked(capsys):
    """`--cp_mode` / `--cp_ulysses_size` as training takes them (#49), resolved by the mode objects: the answer names
    the mode; the step holds a ring's buffers only where a ring runs (the ring, hybrid's across its head groups; not
    ulysses); the ring's prediction is the one without head groups; flags training would refuse are refused naming
    the fix."""
    arch = PRESETS["qwen2.5-0.5b"]
    base = StepSettings(cp=4, fsdp=4, savers=MemorySavers(tiled=True))  # (attention sets the peak at 1M)
    peaks = {h: predict_step_memory(arch, 1 << 20, dataclasses.replace(base, head_size=h)) for h in (1, 2, 4)}
    assert ["CP ring buffers" in peaks[h].terms() for h in (1, 2, 4)] == [True, True, False]
    assert len({peak.peak_bytes for peak in peaks.values()}) == 3
    argv = ["memory", "--model", "qwen2.5-0.5b", "--gpu-memory", "80GB", "--cp", "4", "--fsdp", "4", "--quiet"]
    longest = {}
    for mode in (["ring"], ["ulysses"], ["hybrid", "--cp_ulysses_size", "2"]):
        cli_main([*argv, "--cp_mode", *mode])
        longest[mode[0]] = int(capsys.readouterr().out.strip())
    cli_main(argv)  # (the default mode is the ring)
    assert int(capsys.readouterr().out.strip()) == longest["ring"] and len(set(longest.values())) == 3
    cli_main([*argv[:-1], "--cp_mode", "hybrid", "--cp_ulysses_size", "2"])
    assert "CP 4 (hybrid, heads over 2 ranks), FSDP 4" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli_main([*argv, "--cp_mode", "hybrid", "--cp_ulysses_size", "3"])
    assert "cp_ulysses_size=3 does not divide cp_size=4" in capsys.readouterr().err
    # a sharding training refuses with the mode (document under the hybrid; any but the default under ulysses, which has
    # no ring) was answered for, the planner's token cap included
    for mode, sharding, refused in ((["hybrid", "--cp_ulysses_size", "2"], "document", "is not available under"),
                                    (["ulysses"], "document", "would be ignored under --cp_mode ulysses"),
                                    (["ulysses"], "zigzag", "would be ignored under --cp_mode ulysses")):
        with pytest.raises(SystemExit):
            cli_main([*argv, "--cp_mode", *mode, "--cp_sharding", sharding])
        assert f"error: --cp_sharding {sharding} {refused}" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--smet-density", "0.5"], "--smet-density 0.5 is SMET's active fraction (--optimizer smet); with --optimizer "
                                "adamw it would be ignored: drop it, or use --optimizer smet."),
    (["--optimizer", "none", "--smet-density=0.25"], "with --optimizer none it would be ignored"),  # the default value
    (["--token-tiling-min-length", "0", "--token-tile-size", "999"],
     "--token-tile-size 999 sizes the tiles of --token-tiling-min-length; with --token-tiling-min-length 0 (never "
     "tiled) it would be ignored: drop it, or give the length to tile from."),
    (["--sparse-config", "trial", "--kept-curve", "missing.json"],
     "--kept-curve missing.json would not be read: the budget of --sparse-config trial (topk) bounds the layouts' "
     "width; drop --kept-curve, or give a pattern whose budget bounds no diagonals (budget mode mass)."),
    (["--sparse-config", "trial", "--layout-width", "bound"], "--layout-width bound would not be read: the budget of "
                                                              "--sparse-config trial (topk) bounds the layouts' width"),
    (["--cp", "8", "--cp_planner_max_token_ratio", "1.5"], "--cp_planner_max_token_ratio 1.5 is the document "
     "planner's token cap; with --cp_sharding striped it would be ignored: drop it, or add --cp_sharding document."),
    (["--cp_sharding", "document"], "--cp_sharding document says how a CP group shares its sequences; with --cp 1 "
                                    "(no context parallelism) it would be ignored: drop it, or give --cp N (N > 1)."),
    (["--cp", "1", "--cp_mode", "ulysses"], "--cp_mode ulysses says how a CP group shares its sequences; with --cp 1"),
    (["--cp", "8", "--cp_sharding", "document", "--cp_planner_max_token_ratio", "0.5"],
     "--cp_planner_max_token_ratio 0.5 must be finite and >= 1"),
])
def test_a_flag_that_applies_only_with_another_one_is_refused_without_it(capsys, argv, message):
    """`memory --smet-density 0.5` without `--optimizer smet` answered for AdamW as if the flag were not there: a flag
    the settings given would not read is refused naming both and the fix, as --kept-curve beside --layout-width bound
    and --cp_ulysses_size without --cp_mode hybrid are."""
    with pytest.raises(SystemExit) as refused:
        cli_main(["memory", "--model", "qwen2.5-0.5b", *argv])
    out, err = capsys.readouterr()
    assert refused.value.code == 2 and out == ""
    assert "hf-sparse-cp memory: error: --" in err and message in err, err


def test_a_flag_that_applies_only_with_another_one_is_read_with_it():
    """The flags refused without the flag they apply with (above) are read with it (one prediction, which each of
    the refusals' cases repeated: 1.4 s each)."""
    assert cli_main(["memory", "--model", "qwen2.5-0.5b", "--optimizer", "smet", "--smet-density", "0.5",
                     "--token-tile-size", "999", "--quiet"]) == 0


def test_fsdp_shards_the_gradients_each_unsharded_layer_gradient_is_freed_after_its_reduce_scatter():
    """FSDP2 reduce-scatters each layer's gradient as its backward ends and frees the unsharded one: after the
    backward, every rank holds 1/N of the gradients, and a short sequence's peak falls with N. The README's
    `hf-sparse-cp memory --config Llama-3.1-8B/config.json --gpu-memory 40GB --cp 4 --fsdp 4` answered "Not even
    4,096 tokens fit ... shard them (--fsdp)": every layer's unsharded gradient stayed live to the optimizer."""
    arch = PRESETS["qwen2.5-3b"]
    whole = predict_step_memory(arch, 4096, StepSettings())
    sharded = predict_step_memory(arch, 4096, StepSettings(fsdp=4))
    assert sharded.terms("optimizer")["gradients"] == pytest.approx(whole.terms("optimizer")["gradients"] / 4)
    assert sharded.peak_bytes < whole.peak_bytes / 2


def test_a_config_of_layers_that_mix_tokens_outside_attention_is_refused_and_special_floats_read(tmp_path, capsys):
    """`memory --config` of a config.json transformers wrote for Mamba2 or Falcon-H1 failed on their
    `time_step_limit` (transformers writes inf as {"__float__": "Infinity"}); Zamba2's, Jamba's or RecurrentGemma's
    were predicted as if every layer were attention and an MLP. Special floats now read as transformers reads them,
    and a model with state-space, recurrent or convolution layers is refused, naming them (as training finds them)."""
    from transformers import FalconH1Config, LlamaConfig, Zamba2Config

    from hf_sparse_cp.simulator import arguments

    for name, config in [("falcon_h1", FalconH1Config(num_hidden_layers=2)), ("zamba2", Zamba2Config())]:
        config.save_pretrained(tmp_path / name)
        with pytest.raises(SystemExit):
            memory_cli.main(["--config", str(tmp_path / name)])
        err = capsys.readouterr().err
        assert f"model_type '{name}' mixes tokens outside attention (" in err and "Conv1d of kernel (4,)" in err, err
    llama = LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                        vocab_size=100).to_dict()
    (tmp_path / "llama.json").write_text(json.dumps({**llama, "a_limit": {"__float__": "Infinity"}}))
    assert arguments.read_config(str(tmp_path / "llama.json")).a_limit == float("inf")
    assert memory_cli.main(["--config", str(tmp_path / "llama.json"), "--quiet"])["longest_fitting_tokens"] > 0


def test_nothing_fitting_at_a_high_cp_degree_names_the_sequences_terms_not_the_models_state(capsys):
    """At CP 65536 the shortest length tried is 67M tokens, whose attention layouts need ~388 GB: the command said
    "the constant terms alone exceed 72 GB" and advised --fsdp and --no-master-weights, which shrink 8 GB of it."""
    cli_main(["memory", "--model", "qwen2.5-0.5b", "--cp", "65536"])
    said = capsys.readouterr().out.splitlines()[1]  # (the first line describes the set-up)
    assert "Not even 67,108,864 tokens (1,024 per rank, the shortest length tried) fit" in said
    assert "largest terms: attention layouts" in said and "mostly for the sequence" in said
    assert "fewer CP ranks (--cp 32768)" in said and "--fsdp" not in said and "--no-master-weights" not in said


def test_nothing_fitting_for_the_models_state_names_an_fsdp_degree_the_cp_degree_allows(capsys):
    """The fix named for a model's state too large for one GPU is an FSDP degree that shards over whole CP groups:
    at --cp 4 it said --fsdp 2, which the command refuses (FSDP2 shards over every rank of a CP group)."""
    cli_main(["memory", "--model", "qwen2.5-7b", "--no-master-weights", "--cp", "4"])
    said = capsys.readouterr().out.splitlines()[1]
    assert said.startswith("Not even 4,096 tokens") and "(--fsdp 4, where a length fits)" in said, said
    assert memory_cli.main(["--model", "qwen2.5-7b", "--no-master-weights", "--cp", "4", "--fsdp", "4",
                            "--quiet"])["longest_fitting_tokens"] > 0


def test_nothing_fitting_for_the_models_state_names_the_fsdp_degree_at_which_a_length_fits(capsys):
    """The FSDP degree named for a model's state too large for one GPU was the next one up (twice --fsdp), where
    nothing fits either (Qwen3-235B-A22B at --fsdp 8 named --fsdp 16, where it fits at 64; here Qwen2.5-7B on a
    24 GB GPU named --fsdp 2): it names the smallest degree, doubling, at which a length fits (#50)."""
    flags = ["--model", "qwen2.5-7b", "--no-master-weights", "--gpu-memory", "24GB"]
    cli_main(["memory", *flags])
    said = capsys.readouterr().out.splitlines()[1]
    assert said.startswith("Not even 1,024 tokens") and "(--fsdp 4, where a length fits)" in said, said
    assert memory_cli.main([*flags, "--fsdp", "2", "--quiet"])["longest_fitting_tokens"] == 0
    assert memory_cli.main([*flags, "--fsdp", "4", "--quiet"])["longest_fitting_tokens"] > 0


def test_a_gpu_no_sharding_fits_names_no_sharding_as_the_fix(capsys):
    """Qwen2.5-0.5B on a 1 GB GPU: no --fsdp degree up to the search's limit fits a length (what the sequence itself
    holds, 2.7 GB at --fsdp 4096, outgrows it), yet the command named "shard the model's state over more ranks (--fsdp
    2 or more: it fits at none up to 4096)": it says sharding fits no length, and names a larger GPU."""
    flags = ["--model", "qwen2.5-0.5b", "--gpu-memory", "1GB"]
    cli_main(["memory", *flags])
    said = capsys.readouterr().out.splitlines()[1]
    assert said.startswith("Not even 1,024 tokens") and "shard the model's state over more ranks" not in said, said
    assert said.endswith("sharding the model's state fits no length either (--fsdp up to 4096: what the sequence "
                         "itself holds outgrows the GPU there): use a larger GPU."), said
    assert memory_cli.main([*flags, "--fsdp", "4096", "--quiet"])["longest_fitting_tokens"] == 0


def test_no_length_fitting_within_the_measured_band_says_so_and_names_the_fix(capsys):
    """Qwen2.5-3B in fp32 weights on one 80 GB GPU fits 83,968 tokens, but its state alone (61.7 GB at 1,024 tokens)
    is over the 72 GB usable at the band's top (+26%): the command said "with that margin, 0 tokens"."""
    cli_main(["memory", "--model", "qwen2.5-3b", "--gpu-memory", "80GB"])
    said = capsys.readouterr().out.splitlines()[1]
    assert said.startswith("Longest sequence that fits: 83,968 tokens") and "0 tokens" not in said, said
    assert "with that margin, not even 1,024 tokens, the shortest length tried (its peak, 61.7 GB, is 77.8 GB at " \
           "the band's top, over the 72.0 GB usable; shard the model's state over more ranks (--fsdp 2, where a " \
           "length fits)" in said, said


def test_a_config_without_layers_or_heads_is_refused(tmp_path, capsys):
    """A config.json of num_hidden_layers 0 was predicted (a model of 0.00B parameters fitting 38M tokens)."""
    from transformers import LlamaConfig

    for field in ("num_hidden_layers", "num_attention_heads", "vocab_size"):
        config = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=1000).to_dict()
        (tmp_path / "config.json").write_text(json.dumps({**config, field: 0}))
        with pytest.raises(SystemExit):
            cli_main(["memory", "--config", str(tmp_path / "config.json")])
        assert (f"error: --config {tmp_path / 'config.json'}: {field}=0 in the config; a decoder has at least one of "
                "each") in capsys.readouterr().err  # (it named the config's folder: '{tmp_path.name}: ...')


def test_a_config_is_checked_for_sizes_of_0_once(tmp_path, monkeypatch):
    """The check ran twice on a --config file (on its fields, then on the config transformers built from them); it
    runs once, in ModelShape.from_config, which also refuses a config built in code."""
    from transformers import LlamaConfig

    from hf_sparse_cp.simulator import arguments, shapes
    from hf_sparse_cp.simulator.shapes import ModelShape

    calls, check = [], shapes.check_decoder_sizes
    counted = lambda *a: (calls.append(a), check(*a))[1]  # noqa: E731
    monkeypatch.setattr(shapes, "check_decoder_sizes", counted)
    monkeypatch.setattr(arguments, "check_decoder_sizes", counted)
    config = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=1000)
    (tmp_path / "config.json").write_text(json.dumps(config.to_dict()))
    ModelShape.from_config(arguments.read_config(str(tmp_path / "config.json")))
    assert len(calls) == 1
    with pytest.raises(ValueError, match="num_hidden_layers=0 in the config"):
        ModelShape.from_config(LlamaConfig(num_hidden_layers=0))


def test_the_parameter_count_is_printed_in_its_unit(tmp_path, capsys):
    """A tiny model's count printed as '0.00B parameters'; counts print in billions, millions or thousands."""
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=1000)
    (tmp_path / "config.json").write_text(config.to_json_string())
    cli_main(["memory", "--config", str(tmp_path / "config.json")])
    said = capsys.readouterr().out.splitlines()[0]
    assert re.search(r"\(\d+\.\dM parameters\)", said), said
    cli_main(["memory", "--model", "qwen2.5-7b"])
    assert re.search(r"\(7\.\d\dB parameters\)", capsys.readouterr().out.splitlines()[0])


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_each_preset_counts_the_parameters_of_its_model(name):
    """Every `--model` preset of `hf-sparse-cp memory` (the simulator's too: qwen3-8b was missing from memory's) counts
    the parameters of the transformers model of its shape, built on the meta device. Qwen3-8B is that model's
    measurement (#50: a Llama layer's count, without its q/k RMSNorms' weights and the fp32 tensors they save: 3.8 GB
    under at 128K tokens with token tiles)."""
    from transformers import Qwen2Config, Qwen3Config

    arch = PRESETS[name]
    s = arch.shape
    qwen3 = name.startswith("qwen3")
    config = (Qwen3Config if qwen3 else Qwen2Config)(
        num_hidden_layers=s.layers, hidden_size=s.hidden, num_attention_heads=s.heads, num_key_value_heads=s.kv_heads,
        head_dim=s.head_dim, intermediate_size=s.intermediate, vocab_size=s.vocab,
        tie_word_embeddings=arch.tied_embeddings)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert arch.params == sum(p.numel() for p in model.parameters())
    assert (arch.layer_saved is not None) == qwen3  # (a Qwen2 layer is the Llama layer counted on its code)


@pytest.mark.parametrize("command", ["memory", "simulate"])
def test_a_config_that_is_not_text_is_refused_naming_the_file(command, tmp_path, capsys):
    """`--config model.safetensors` (a weights file for its config.json) was refused as "'utf-8' codec can't decode
    bytes in position ...", naming neither the file nor the fix; it is named as not a config.json, as JSON that does
    not parse is."""
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"\x88\x0b\x00\x00\x00\x00\x00\x00{\"__metadata__\": \xff\xfe}")
    rest = ["--quiet"] if command == "memory" else ["--seq", "8192", "--cp", "2"]
    with pytest.raises(SystemExit) as refused:
        cli_main([command, "--config", str(weights), *rest])
    out, err = capsys.readouterr()
    assert refused.value.code == 2 and out == "" and "Traceback" not in err, err
    assert f"--config {weights}: not JSON text (a binary file); give a model's config.json" in err, err


def test_a_gguf_file_is_read_as_its_config(tmp_path, capsys):
    """`--config model.gguf` (the file training's --model_name_or_path takes) was refused as "not JSON text (a binary
    file)": its config is read from the file's metadata, as transformers loads it, and answers as its config.json."""
    gguf = pytest.importorskip("gguf")
    from transformers import AutoConfig

    writer = gguf.GGUFWriter(str(tmp_path / "tiny.gguf"), "llama")  # metadata alone: no tensor is read
    for add, value in ((writer.add_block_count, 2), (writer.add_context_length, 4096),
                       (writer.add_embedding_length, 64), (writer.add_feed_forward_length, 128),
                       (writer.add_head_count, 4), (writer.add_head_count_kv, 2), (writer.add_vocab_size, 1000),
                       (writer.add_layer_norm_rms_eps, 1e-5), (writer.add_rope_freq_base, 10000.0)):
        add(value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    AutoConfig.from_pretrained(tmp_path, gguf_file="tiny.gguf").save_pretrained(tmp_path / "saved")
    answers = []
    for config in (tmp_path / "tiny.gguf", tmp_path / "saved"):
        cli_main(["memory", "--config", str(config), "--seq-len", "4096"])
        answers.append(capsys.readouterr().out)
    assert answers[0].startswith("tiny (") and answers[1].startswith("saved ("), answers
    assert answers[0].split(" (", 1)[1] == answers[1].split(" (", 1)[1]


@pytest.mark.parametrize("command", ["memory", "simulate"])
@pytest.mark.parametrize(("given", "fix"), [
    ("folder", "is a path, not a preset: give a model's folder, config.json or GGUF file as --config"),
    ("Qwen/Qwen2.5-0.5B", "--model qwen2.5-0.5b is its preset"),
    ("llama", "--config reads any other model's config.json"),
], ids=["local-folder", "hub-id", "other"])
def test_a_model_that_is_no_preset_names_the_flag_that_reads_it(command, given, fix, tmp_path, capsys):
    """`--model ./my-model` (a saved model's folder) or `--model Qwen/Qwen2.5-0.5B` (a Hub id) was refused as argparse's
    "invalid choice" alone: the refusal names --config for a path and the preset a Hub id names."""
    if given == "folder":
        given = str(tmp_path)
    with pytest.raises(SystemExit) as refused:
        cli_main([command, "--model", given])
    out, err = capsys.readouterr()
    assert refused.value.code == 2 and out == "", err
    assert fix in err, err


@pytest.mark.parametrize("command", [["memory", "--seq-len", "4096"], ["simulate", "--seq", "16384"]],
                         ids=["memory", "simulate"])
def test_a_gguf_file_without_the_gguf_package_names_the_install(tmp_path, capsys, monkeypatch, command):
    """Without the `gguf` package (an extra), transformers' GGUF reader raises ImportError: `memory` ended in its
    traceback. Both commands refuse it naming the install, or the model's config.json."""
    import transformers

    def no_gguf(*args, **kwargs):
        raise ImportError("Loading a GGUF checkpoint in PyTorch requires both PyTorch and GGUF>=0.10.0 installed.")

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", no_gguf)
    (tmp_path / "model.gguf").write_bytes(b"GGUF" + bytes(60))
    with pytest.raises(SystemExit):
        cli_main([*command, "--config", str(tmp_path / "model.gguf")])
    assert "needs the gguf package (pip install gguf)" in capsys.readouterr().err


def test_a_folder_without_config_json_is_named_as_such(tmp_path, capsys):
    """`--config FOLDER` without a config.json in it was refused as "no such file" for a folder that is there."""
    with pytest.raises(SystemExit):
        cli_main(["memory", "--config", str(tmp_path), "--quiet"])
    assert f"--config {tmp_path}: a folder without config.json" in capsys.readouterr().err


def test_a_multimodal_config_names_its_text_config_as_the_fix(tmp_path, capsys):
    """A Gemma 3 4B-style config.json (model_type 'gemma3': the language model's fields under text_config) was refused
    as missing num_hidden_layers, hidden_size, ... with "add the missing field(s)", while they are in the file: it is
    named as a multimodal model by memory and simulate alike, with the command that writes its language model's config
    (one command, the same in both refusals: run once), which then answers."""
    from transformers import AutoConfig

    folder = tmp_path / "gemma-3-4b"
    AutoConfig.for_model("gemma3").save_pretrained(folder)
    fixes = set()
    for command, rest in (("memory", ["--quiet"]), ("simulate", ["--seq", "8192", "--cp", "2"])):
        with pytest.raises(SystemExit) as refused:
            cli_main([command, "--config", str(folder), *rest])
        out, err = capsys.readouterr()
        assert refused.value.code == 2 and out == "" and "Traceback" not in err, (command, err)
        assert (f"--config {folder}: model_type 'gemma3' holds its language model's fields under text_config "
                "(model_type 'gemma3_text')") in err, (command, err)
        assert "add the missing field" not in err, command
        fixes.add(re.search(r"`python -c \"(.*?)\"`", err).group(1))
    (fix,) = fixes  # (each command names the same fix)
    exec(fix.replace("DIR", str(folder)).replace("text_config'", str(tmp_path / "text_config") + "'"))
    # (the fix's own command; its answer, the memory command's: simulate's plot starts a process)
    cli_main(["memory", "--config", str(tmp_path / "text_config"), "--quiet"])
    assert capsys.readouterr().out.strip().isdigit()


def test_a_mixture_of_experts_is_refused_naming_the_field_its_config_json_holds(tmp_path, capsys):
    """DeepSeek-V3's config.json (n_routed_experts: 256) was refused as "num_local_experts=256", a field the file does
    not hold (transformers' alias of it): the refusal names the config's own field."""
    from transformers import AutoConfig

    AutoConfig.for_model("deepseek_v3", n_routed_experts=8).save_pretrained(tmp_path)
    with pytest.raises(SystemExit) as refused:
        cli_main(["memory", "--config", str(tmp_path), "--quiet"])
    err = capsys.readouterr().err
    assert refused.value.code == 2 and "Traceback" not in err, err
    assert f"--config {tmp_path}: n_routed_experts=8: a mixture of experts" in err, err


def test_a_step_without_gradient_checkpointing_holds_every_layers_saved_tensors():
    """Issue #50: `StepSettings(gradient_checkpointing=False)` was predicted as a checkpointed step, every layer's
    activations but one left out (training runs without checkpointing below --sparse_gradient_checkpointing_min_length).
    What four more layers add to the peak, measured by the allocation recorder at 1K tokens: 72.0 MiB; predicted
    6.2 before (their weights' gradients), 74.1 now."""
    (measured_1, predicted_1), (measured_5, predicted_5) = (unchecked_step_peak(step_config(n), PATTERN)
                                                            for n in (1, 5))
    assert predicted_5 - predicted_1 == pytest.approx(measured_5 - measured_1, rel=0.1)


def test_the_memory_command_predicts_lengths_below_the_checkpointing_threshold_without_it(capsys):
    """Issue #50: training checkpoints from --sparse_gradient_checkpointing_min_length (16K) on; `memory` predicted
    every length checkpointed: 8K tokens of Qwen2.5-0.5B 'fit' 12 GB at 9.9 GB, where training (no checkpointing)
    holds 21.1 GB. The longest length is still searched past the shorter lengths that do not fit unchecked."""
    argv = ["memory", "--model", "qwen2.5-0.5b", "--gpu-memory", "12GB", "--seq-len", "8192"]
    assert cli_main([*argv, "--json", "/dev/null"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"8,192 tokens: peak 21\.\d GB in \w+ \(does not fit, no gradient checkpointing: the Trainer's "
                     r"--gradient_checkpointing", out)
    assert "Longest sequence that fits: 23,552 tokens" in out
    assert cli_main([*argv, "--sparse_gradient_checkpointing_min_length", "1"]) == 0  # (training's spelling)
    assert re.search(r"8,192 tokens: peak 9\.9 GB in optimizer \(fits\)", capsys.readouterr().out)
    assert cli_main([*argv, "--gradient-checkpointing-min-length", "0", "--quiet"]) == 0
    assert int(capsys.readouterr().out) == 1024
    # (training refuses --sparse_offload_layer_inputs without checkpointing)
    assert cli_main([*argv, "--offload-layer-inputs"]) == 0
    assert "no gradient checkpointing, under which training refuses --sparse_offload_layer_inputs: the Trainer's " \
        "--gradient_checkpointing" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli_main([*argv, "--offload-layer-inputs", "--gradient-checkpointing-min-length", "0"])
    assert "--offload-layer-inputs moves the inputs that gradient checkpointing saves, and training refuses it " \
        "without checkpointing (--gradient-checkpointing-min-length 0)" in capsys.readouterr().err


def test_float32_compute_holds_no_autocast_copies_whatever_master_weights_says(capsys):
    """Issue #50: `memory --dtype float32` (a Trainer without --bf16/--fp16; --master-weights is the default) counted
    autocast's copies of every layer's weights (1.4 GB of Qwen2.5-0.5B in forward) and was described as "fp32 weights
    + float32 autocast (the Trainer's mixed precision)": fp32 compute runs no autocast."""
    arch = PRESETS["qwen2.5-0.5b"]
    master, plain = (predict_step_memory(arch, 65536, StepSettings(dtype="float32", master_weights=m))
                     for m in (True, False))
    assert {p: v["bytes"] for p, v in master.phases.items()} == {p: v["bytes"] for p, v in plain.phases.items()}
    assert "autocast weight copies" not in master.terms("forward")
    assert "autocast weight copies" in predict_step_memory(arch, 65536, StepSettings(master_weights=True)).terms(
        "forward")
    assert cli_main(["memory", "--model", "qwen2.5-0.5b", "--dtype", "float32", "--seq-len", "65536"]) == 0
    assert "all float32 (a model loaded in float32)" in capsys.readouterr().out
