"""One architecture table (`integration/architectures.py`) that the lean loss, the token tiles, the record of
changes (`compat.PATCHES`) and the CP checks read; and layers that mix tokens outside attention found by what
they do, not by their class name."""

import contextlib
import re

import pytest
import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM

import hf_sparse_cp
from hf_sparse_cp.integration import compat, upstream
from hf_sparse_cp.integration.architectures import (
    ARCHITECTURES,
    ROUTER_LOSS_PARAMETERS,
    cp_tested_model_types,
    gathered_router_loss,
    lean_loss_classes,
    lean_loss_model_types,
    model_router_loss_modules,
    router_loss_modules,
    rowwise_classes,
)
from hf_sparse_cp.integration.lean_loss import disable_lean_loss, enable_lean_loss
from hf_sparse_cp.integration.memory_savers import rowwise_modules
from hf_sparse_cp.integration.models import check_model_supports_context_parallel, token_mixers
from hf_sparse_cp.testing.tiny_models import released_model_types, tiny_config

from oracle import rel_rms


def test_the_table_is_what_the_lean_loss_the_tiles_and_compat_read():
    stock = {name: getattr(transformers, name).forward for name in lean_loss_classes()}
    enable_lean_loss()
    try:
        assert all(getattr(transformers, name).forward is not forward for name, forward in stock.items())
        assert transformers.GPT2LMHeadModel.forward is transformers.GPT2LMHeadModel.__dict__["forward"]
    finally:
        disable_lean_loss()
    assert all(getattr(transformers, name).forward is forward for name, forward in stock.items())
    listed = {p.qualified for p in compat.PATCHES}
    assert {f"{module}.{name}.forward" for name, (module, _) in rowwise_classes().items()} <= listed
    for model_type in lean_loss_model_types():  # every family's tiles are its own MLP and RMSNorms
        model = AutoModelForCausalLM.from_config(tiny_config(model_type))
        assert {type(m).__name__ for _, m in rowwise_modules(model)} == set(ARCHITECTURES[model_type].rowwise)
    assert set(lean_loss_model_types()) <= set(cp_tested_model_types())
    assert {"gemma", "cohere", "gpt_neox", "starcoder2", "phi", "mixtral", "gpt2"} <= set(cp_tested_model_types())
    assert "olmo" not in ARCHITECTURES


def _gpt2() -> torch.nn.Module:
    config = AutoConfig.for_model("gpt2", n_layer=2, n_embd=64, n_head=4, vocab_size=259, n_positions=1024,
                                  bos_token_id=1, eos_token_id=2, attn_pdrop=0.0)  # (attention dropout is refused)
    model = AutoModelForCausalLM.from_config(config)
    hf_sparse_cp.configure(model)
    return model


@pytest.mark.parametrize("kernel, mixes", [(1, False), (4, True)])
def test_a_convolution_mixes_tokens_when_its_kernel_spans_positions(kernel, mixes):
    """GPT-2's `Conv1D` is a linear layer (each token on its own): no token mixer, so GPT-2 passes the CP
    checks; a convolution of kernel 1 is per token too, one of kernel 4 mixes
    the positions it spans, whatever its class is named."""
    hf_sparse_cp.patch()
    model = _gpt2()
    assert token_mixers(model) == []
    check_model_supports_context_parallel(model)
    model.transformer.h[0].add_module("short_conv", torch.nn.Conv1d(64, 64, kernel_size=kernel, groups=64))
    found = token_mixers(model)
    assert bool(found) == mixes and (not found or "transformer.h.0.short_conv" in found[0])
    if mixes:
        with pytest.raises(ValueError, match="mixes tokens outside attention \\(Conv1d of kernel \\(4,\\)"):
            check_model_supports_context_parallel(model)


def test_the_plugin_knows_when_every_parameter_gets_a_gradient():
    """`ddp_find_unused_parameters` is set to False where this holds (issue #52: DDP warned at every CP run)."""
    from hf_sparse_cp.integration.architectures import uses_every_parameter

    assert uses_every_parameter(tiny_config("llama")) and uses_every_parameter(tiny_config("qwen2"))
    assert not uses_every_parameter(tiny_config("mixtral"))  # an expert may get no token
    assert not uses_every_parameter(AutoConfig.for_model("bert"))  # not a tested causal LM
    assert not uses_every_parameter(tiny_config("bart"))  # its decoder's cross-attention gets no gradient


@pytest.mark.parametrize("model_type", ["bloom", "xglm", "mpt"])
def test_an_architecture_outside_attention_interface_is_refused_naming_it_and_left_as_it_was(model_type):
    """transformers keeps eager attention for an architecture that does not follow its AttentionInterface: the
    switch is checked, and refused naming the model type and the fixes, the model left as it was; the CP check
    names the same cause (not `configure`, which cannot help it), and so does the Trainer glue, which undoes what
    it did. (MPT's attn_config, a sub-config without an implementation: undoing the switch raised transformers'
    'Specified `attn_implementation="None"` is not supported for attn_config' in place of the refusal.)"""
    from hf_sparse_cp.trainer.arguments import SparseCPArguments
    from hf_sparse_cp.trainer.attach import enable_sparse_attention

    hf_sparse_cp.patch()
    try:
        model = AutoModelForCausalLM.from_config(tiny_config(model_type))
        before = upstream.attn_implementation(model.config)
        cause = f"model type '{model_type}'\\) does not route its attention through transformers' AttentionInterface"
        with pytest.raises(ValueError, match=cause + r".*--sparse_attention false.*or train a model whose"):
            hf_sparse_cp.configure(model)
        assert upstream.attn_implementation(model.config) == before and not hasattr(model.config, "sparse_attention")
        with pytest.raises(ValueError, match=cause + r".*--cp_size 1") as refused:
            check_model_supports_context_parallel(model)
        assert "configure(model)" not in str(refused.value)
    finally:
        hf_sparse_cp.unpatch()
    with pytest.raises(ValueError, match=cause):
        enable_sparse_attention(model, SparseCPArguments())
    assert not hf_sparse_cp.is_patched() and not hasattr(model.config, "sparse_attention")


@pytest.mark.parametrize("model_type", ["bloom", "mpt", "xglm", "gpt_neox_japanese"])
def test_an_architecture_outside_attention_interface_loaded_on_the_backend_is_refused_at_its_mask(model_type):
    """transformers 5.25 selects sparse_cp for a model loaded with attn_implementation='sparse_cp' whose attention is
    its own code: that code read the 2D padding mask of the backend's mask function (None without padding) as its
    causal mask, so tokens saw later ones, silently (bloom: logits 5% off eager's; gpt_neox_japanese: 89%; NaN with
    a padded batch). Its mask is refused, naming the fix; a model that routes attention through AttentionInterface
    is not, and `configure` still names the cause of an unrouted one."""
    hf_sparse_cp.patch()
    try:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(tiny_config(model_type), attn_implementation="sparse_cp")
        assert upstream.attn_implementation(model.config) == "sparse_cp"
        with pytest.raises(ValueError, match=rf"Model type '{model_type}' computes attention in its own code, not "
                                             r"through transformers' AttentionInterface.*attn_implementation='eager' "
                                             r"or 'sdpa' \(--sparse_attention false\)"):
            model(input_ids=torch.randint(3, 259, (1, 24)))
        with pytest.raises(ValueError, match=f"model type '{model_type}'\\) does not route its attention"):
            hf_sparse_cp.configure(model)
        routed = AutoModelForCausalLM.from_config(tiny_config("llama"), attn_implementation="sparse_cp")
        assert routed(input_ids=torch.randint(3, 259, (1, 24))).logits.shape == (1, 24, 259)
    finally:
        hf_sparse_cp.unpatch()



def test_falcon_with_alibi_loaded_on_the_backend_is_refused_at_its_mask_naming_the_fix():
    """Falcon with alibi=True adds its ALiBi bias to a mask it reads as a tensor: loaded with
    attn_implementation='sparse_cp', its forward failed inside Falcon's code ("'NoneType' object has no attribute
    'dtype'", naming no fix) without padding. Its mask is refused naming the fix, and `configure` refuses it too."""
    hf_sparse_cp.patch()
    try:
        model = AutoModelForCausalLM.from_config(tiny_config("falcon", alibi=True), attn_implementation="sparse_cp")
        cause = r"Model type 'falcon' with alibi=True adds its ALiBi position bias to the attention mask"
        for mask in (None, torch.tensor([[0, 1, 1, 1]])):
            with pytest.raises(ValueError, match=cause + r".*attn_implementation='sdpa' or 'eager'"):
                model(input_ids=torch.randint(3, 259, (1, 4)), attention_mask=mask)
        with pytest.raises(ValueError, match=cause):
            hf_sparse_cp.configure(model)
    finally:
        hf_sparse_cp.unpatch()

@pytest.mark.parametrize("model_type, overrides, cause", [
    ("falcon", {"alibi": True}, r"Model type 'falcon' with alibi=True adds its ALiBi position bias"),
    ("deepseek_v32", {}, r"Model type 'deepseek_v32' selects the keys each query attends to"),
    ("doge", {}, r"Model type 'doge' builds its own 4D attention mask"),
], ids=["falcon-alibi", "deepseek_v32", "doge"])
def test_the_cp_check_of_a_model_not_switched_names_what_its_mask_refuses_not_the_switch(model_type, overrides, cause):
    """The CP check of a model still on sdpa whose mask sparse_cp refuses (ALiBi added to it, a DSA indexer reading
    it, a dynamic mask built from it) told the user to switch it ('train with --sparse_attention true ... or call
    hf_sparse_cp.configure(model)'), which configure then refused: it names the cause, dense attention and no CP."""
    hf_sparse_cp.patch()
    try:
        model = AutoModelForCausalLM.from_config(tiny_config(model_type, **overrides))
        with pytest.raises(ValueError, match=cause + r".*--sparse_attention false.*drop --cp_size") as refused:
            check_model_supports_context_parallel(model)
        assert "configure(model)" not in str(refused.value)
    finally:
        hf_sparse_cp.unpatch()


def test_an_architecture_routed_from_a_later_transformers_is_refused_before_it_naming_the_upgrade(monkeypatch):
    """CodeGen routes its attention through AttentionInterface from transformers 5.24; 5.17's (the GPU image's) kept
    eager, and test_cp_models' group holding it failed at configure. Before 5.24 it is refused naming the upgrade (the
    real refusal there, the message as it would be here from 5.24 on) and it is out of the CP-tested types."""
    from hf_sparse_cp.integration import architectures, models

    hf_sparse_cp.patch()
    try:
        model = AutoModelForCausalLM.from_config(tiny_config("codegen", rotary_dim=16))
        routed = architectures.transformers_release() >= (5, 24)
        installed = (5, 17, 0) if routed else architectures.transformers_release()
        upgrade = (r"Upgrade transformers to 5\.24 or later, whose CodeGenForCausalLM routes it \(installed: "
                   rf"{re.escape('.'.join(map(str, installed)))};.*--sparse_attention false")
        if routed:
            hf_sparse_cp.configure(model)
            models.check_attention_routed(model)
            assert "codegen" in cp_tested_model_types()
            for module in (architectures, models):
                monkeypatch.setattr(module, "transformers_release", lambda: installed)
            with pytest.raises(ValueError, match=upgrade):
                models._refuse_unrouted(model, "eager", models._DENSE_FIX)
        else:
            with pytest.raises(ValueError, match=upgrade):
                hf_sparse_cp.configure(model)
        assert "codegen" not in cp_tested_model_types()
    finally:
        hf_sparse_cp.unpatch()


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "gpt2", "mistral"])
def test_architectures_that_route_attention_through_the_interface_pass_the_check(model_type):
    from hf_sparse_cp.integration.models import check_attention_routed

    hf_sparse_cp.patch()
    try:
        model = AutoModelForCausalLM.from_config(tiny_config(model_type))
        hf_sparse_cp.configure(model)
        check_attention_routed(model)
        assert upstream.attn_implementation(model.config) == "sparse_cp"
    finally:
        hf_sparse_cp.unpatch()


@pytest.mark.parametrize("model_type, refused", [("qwen2", None), ("gpt2", None), ("bloom", "does not route"),
                                                  ("falcon_mamba", "has no attention layer")])
def test_a_model_is_checked_as_training_switches_it_and_left_as_it_was(model_type, refused):
    """`check_switchable` refuses, before the data are made, what the Trainer refused once it had switched the model
    (the example's --tiny_model_type mamba/bloom after its data), on the meta device too (GPT-2's forward reads a
    value there: its probe is left to the Trainer), and leaves the model, the registration and its hooks as they
    were."""
    from hf_sparse_cp.integration.registration import check_switchable

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(tiny_config(model_type))
    before = upstream.attn_implementation(model.config)
    with pytest.raises(ValueError, match=refused) if refused else contextlib.nullcontext():
        check_switchable(model, context_parallel=True)
    assert upstream.attn_implementation(model.config) == before and not hf_sparse_cp.is_patched()
    assert not any(m._forward_pre_hooks for m in model.modules())


@pytest.mark.parametrize("model_type, overrides, hybrid", [
    ("mamba", {}, False), ("bamba", {"mamba_n_heads": 4, "mamba_d_head": 64, "attn_layer_indices": []}, True),
    ("granitemoehybrid", {"mamba_n_heads": 4, "mamba_d_head": 64, "layer_types": ["mamba", "mamba"]}, True)])
def test_a_model_without_an_attention_layer_is_refused_as_such(model_type, overrides, hybrid):
    """A model of Mamba layers only, or a hybrid whose config places no attention layer (Bamba without
    attn_layer_indices), was refused as an architecture that 'does not route its attention
    through transformers' AttentionInterface' (Bamba's attention layers do), or whose forward 'failed outside
    attention' (Granite-MoE-Hybrid's cache); it is refused as having no attention layer, naming the fix."""
    hf_sparse_cp.patch()
    try:
        model = AutoModelForCausalLM.from_config(tiny_config(model_type, **overrides))
        cause = rf"\(model type '{model_type}'\) has no attention layer \(its layer_types: linear_attention\)"
        with pytest.raises(ValueError, match=cause + r".*--sparse_attention false") as refused:
            hf_sparse_cp.configure(model)
        assert ("places attention layers among them trains with it" in str(refused.value)) == hybrid
        assert "does not route" not in str(refused.value)
        assert upstream.attn_implementation(model.config) != "sparse_cp"
    finally:
        hf_sparse_cp.unpatch()


def test_a_layer_type_outside_the_known_attention_kinds_is_probed_not_taken_for_no_attention():
    """Inkling's layers are of type 'hybrid_sliding' (attention with a relative position bias): no attention kind the
    table names, yet attention; it is refused for what its layers pass to attention, not as having none."""
    hf_sparse_cp.patch()
    try:
        model = AutoModelForCausalLM.from_config(tiny_config("inkling_text", sliding_window=24))
        with pytest.raises(ValueError, match=r"does not implement an additive bias on the attention logits "
                                             r"\(position_bias, model type 'inkling_text'\)"):
            hf_sparse_cp.configure(model)
    finally:
        hf_sparse_cp.unpatch()


def test_a_forward_that_fails_without_sparse_cp_too_is_not_blamed_on_it():
    """A float64 mixture of experts whose experts run torch's grouped matmul (float32/bf16/fp16 only) fails its
    forward under any attention: configure refused it as a model that 'does not run with sparse_cp ... e.g. a layer
    that reads the attention mask as the 4D mask', advising dense attention, which fails the same. The refusal says
    the failure is the model's own; with eager experts it is configured."""
    hf_sparse_cp.patch()
    try:
        model = AutoModelForCausalLM.from_config(tiny_config("mixtral")).double()
        cause = r"MixtralForCausalLM \(model type 'mixtral'\) fails its forward with eager attention too \("
        with pytest.raises(ValueError, match=cause + r".*the failure is the model's own") as refused:
            hf_sparse_cp.configure(model)
        assert "--sparse_attention false" not in str(refused.value)
        assert upstream.attn_implementation(model.config) != "sparse_cp"
        model = AutoModelForCausalLM.from_config(tiny_config("mixtral"), experts_implementation="eager").double()
        hf_sparse_cp.configure(model)
    finally:
        hf_sparse_cp.unpatch()


def test_a_model_that_builds_its_own_attention_mask_is_refused_at_the_check_and_at_its_mask():
    """Doge hands attention a 4D mask of its own (its dynamic mask), which sparse_cp cannot take: found when the model
    is switched, and by the CP check, naming the architecture and the cause, not at the first forward with a fix the
    user already followed. Loaded with attn_implementation='sparse_cp' (no switch to check), a padded batch failed
    inside Doge's own mask code ('IndexError: too many indices for tensor of dimension 2', naming no fix): its mask
    is refused, naming the fix, with padding or without."""
    hf_sparse_cp.patch()
    try:
        model = AutoModelForCausalLM.from_config(tiny_config("doge"))
        cause = r"Model type 'doge' builds its own 4D attention mask in its attention layers"
        with pytest.raises(ValueError, match=cause + r".*--sparse_attention false"):
            hf_sparse_cp.configure(model)
        assert upstream.attn_implementation(model.config) != "sparse_cp"
        with pytest.raises(ValueError, match=cause + r".*--sparse_attention false.*drop --cp_size"):
            check_model_supports_context_parallel(model)
        model = AutoModelForCausalLM.from_config(tiny_config("doge"), attn_implementation="sparse_cp")
        for mask in (None, torch.tensor([[0] + [1] * 15])):
            with pytest.raises(ValueError, match=cause + r".*attn_implementation='sdpa' or 'eager'"):
                model(input_ids=torch.randint(3, 200, (1, 16)), attention_mask=mask)
    finally:
        hf_sparse_cp.unpatch()


def test_the_tiny_model_builder_leaves_derived_fields_to_the_architecture_and_names_what_it_cannot_build(
        tmp_path, capsys):
    """Falcon computes head_dim from hidden_size / num_attention_heads (a property without a setter): the tiny
    builder leaves it to it instead of crashing on the assignment; an override it would derive otherwise, an
    unknown model type and a config transformers refuses are ValueErrors naming the model type, which the demo
    prints as one error line."""
    from hf_sparse_cp.examples.train_long_context import main

    config = tiny_config("falcon")
    assert config.head_dim == 32 and AutoModelForCausalLM.from_config(config).config.model_type == "falcon"
    with pytest.raises(ValueError, match=r"falcon: head_dim=64 cannot be set, FalconConfig derives it from its other "
                                         r"fields \(head_dim=32 here\)"):
        tiny_config("falcon", head_dim=64)
    assert tiny_config("falcon", head_dim=32).head_dim == 32
    with pytest.raises(ValueError, match="tiny model type 'gpt_neo': transformers does not build its config from the "
                                         "tiny model's fields .*another --tiny_model_type"):
        tiny_config("gpt_neo")
    with pytest.raises(SystemExit) as ended:  # (as a bad flag ends: status 2)
        main(["--tiny_model_type", "no_such_type", "--output_dir", str(tmp_path)])
    assert ended.value.code == 2
    assert "error: tiny model type 'no_such_type' is not a transformers model type" in capsys.readouterr().err


def test_an_override_transformers_refuses_is_named_with_its_complaint():
    """An override of the wrong type (Gemma 3's query_pre_attn_scalar takes an int) was refused as a type that cannot
    be built tiny, advising another --tiny_model_type: the fix is the override's value. A type whose tiny fields alone
    fail keeps that advice, whatever the overrides."""
    with pytest.raises(ValueError) as refused:
        tiny_config("gemma3_text", query_pre_attn_scalar=7.0)
    message = str(refused.value)
    assert message.startswith("tiny model type 'gemma3_text': transformers refuses query_pre_attn_scalar=7.0 (")
    assert "expected int, got float" in message and "give query_pre_attn_scalar a value its config takes" in message
    assert "another --tiny_model_type" not in message
    assert tiny_config("gemma3_text", query_pre_attn_scalar=7).query_pre_attn_scalar == 7
    with pytest.raises(ValueError, match="tiny model type 'gpt_neo': transformers does not build its config from the "
                                         "tiny model's fields .*another --tiny_model_type"):
        tiny_config("gpt_neo", num_hidden_layers=2)


@pytest.mark.parametrize("model_type, positions", [("gpt2", 1 << 16), ("gpt_bigcode", 1 << 12), ("openai-gpt", 1 << 10),
                                                   ("qwen2", 1 << 20)])
def test_a_tiny_model_whose_tensors_are_sized_by_its_positions_stays_tiny(model_type, positions):
    """Every tiny config took max_position_embeddings=2**20: GPT-2's learned position table of 2**20 x 128 floats
    (512 MiB) for a 'tiny' model, GPT-BigCode's and OpenAI GPT's causal buffers of [n, n] (1 and 8 TiB: the build
    failed or hung). Lowered to the largest power of two whose position-sized tensors stay within 32 MiB (counted on
    the meta device), unless given (GPT-2's own n_positions was overridden by the tiny field's standard name); a
    rotary model, sized by none, keeps 2**20 for the long-context demo."""
    config = tiny_config(model_type)
    assert config.max_position_embeddings == positions
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()]) <= 48 << 20
    alias = type(config).attribute_map.get("max_position_embeddings", "max_position_embeddings")
    assert tiny_config(model_type, **{alias: 512}).max_position_embeddings == 512


def test_a_tiny_model_that_would_not_be_tiny_is_refused_naming_the_fields_that_size_it():
    """BLT's hash embeddings built a 'tiny' model of 17 GiB (out of memory): refused, naming the field to override."""
    with pytest.raises(ValueError, match=r"tiny model type 'blt' builds a model of .* GiB .*more than a tiny model's "
                                         r"256 MiB: its largest tensors are .*Its fields encoder_hash_byte_group_vocab="
                                         r"500002 size them"):
        tiny_config("blt")


@pytest.mark.parametrize("model_type", ["longcat_flash", "axk1"])
def test_tiny_experts_reach_the_fields_a_config_names_through_its_attribute_map(model_type):
    """LongCat-Flash and A.X K1 name their experts only through attribute_map aliases (num_local_experts:
    n_routed_experts, moe_intermediate_size: expert_ffn_hidden_size), which the tiny expert sizes missed:
    LongCat-Flash's 512 experts of 2048 were refused as a 2 GiB 'tiny' model. Their few experts route in one group
    (A.X K1's 8 groups would hold none each)."""
    config = tiny_config(model_type)
    assert (config.num_local_experts, config.num_experts_per_tok) == (4, 2)
    model = AutoModelForCausalLM.from_config(config)
    assert sum(t.numel() * t.element_size() for t in model.parameters()) <= 48 << 20
    assert model(torch.arange(3, 19)[None]).logits.isfinite().all()


@pytest.mark.parametrize("model_type, text_type", [("gemma3", "gemma3_text"), ("llama4", "llama4_text"),
                                                   ("qwen3_5", "qwen3_5_text")])
def test_the_tiny_model_of_a_composite_type_names_its_language_models_type(model_type, text_type, tmp_path, capsys):
    """A vision-language type keeps its language model in text_config, which the tiny fields did not reach: the
    'tiny' model was the family's default (counted on the meta device: Gemma 3 2.7B parameters, Qwen 3.5 9.0B,
    Llama 4 108B), which the demo's --tiny_model_type took. It is a ValueError naming the language model's type, which
    the demo prints as one error line; that type builds tiny."""
    from hf_sparse_cp.examples.train_long_context import main

    with pytest.raises(ValueError, match=rf"tiny model type '{model_type}' keeps its language model in a sub-config "
                                         rf"\(model type '{text_type}'\).*--tiny_model_type {text_type}"):
        tiny_config(model_type)
    assert tiny_config(text_type).hidden_size == 128
    with pytest.raises(SystemExit) as ended:
        main(["--tiny_model_type", model_type, "--output_dir", str(tmp_path)])
    assert ended.value.code == 2 and f"--tiny_model_type {text_type}" in capsys.readouterr().err


@pytest.mark.parametrize("model_type, overrides, cause, cp_cause", [
    ("deepseek_v4", {"sliding_window": 48}, r"DeepseekV4DecoderLayer: sparse_cp does not implement learned attention "
                                            r"sinks in a layer of type 'heavily_compressed_attention' \(it computes "
                                            r"them in full_attention, sliding_attention, chunked_attention layers\) "
                                            r"\(s_aux, model type 'deepseek_v4'\)",
     r"mixes tokens outside attention \(layer type 'compressed_sparse_attention', layer type "
     r"'heavily_compressed_attention'"),
], ids=["deepseek_v4-compressed-sinks"])
def test_an_attention_feature_the_backend_lacks_is_refused_at_the_switch_and_the_cp_check(model_type, overrides, cause,
                                                                                          cp_cause):
    """DeepSeek-V4 passes learned sinks (`s_aux`) to the attention function in layers that append compressed keys of
    their own making (the backend would take them for a KV cache; GPT-OSS's sinks in plain attention layers are
    computed: tests/unit/test_sinks.py): configure() took the model and its first forward failed. The probe forward
    finds what the backend refuses, so the switch and the CP check refuse it (`cp_cause`: what the CP check finds
    first), naming the architecture and --sparse_attention false."""
    hf_sparse_cp.patch()
    try:
        model = AutoModelForCausalLM.from_config(tiny_config(model_type, **overrides))
        with pytest.raises(ValueError, match=cause + r".*--sparse_attention false"):
            hf_sparse_cp.configure(model)
        assert upstream.attn_implementation(model.config) != "sparse_cp"
        model = AutoModelForCausalLM.from_config(tiny_config(model_type, **overrides), attn_implementation="sparse_cp")
        with pytest.raises(ValueError, match=cp_cause or cause + r".*--sparse_attention false"):
            check_model_supports_context_parallel(model)
    finally:
        hf_sparse_cp.unpatch()


def test_a_model_whose_forward_fails_with_the_backend_is_refused_at_the_switch():
    """DeepSeek-V3.2's sparse-attention indexer reads the attention mask as eager's 4D mask: with sparse_cp (the 2D
    padding mask, or None) its forward fails before attention. configure() took the model with a warning and the
    first forward failed in the indexer (TypeError: 'NoneType' object is not subscriptable); now the switch is
    refused, naming the architecture and the fix, the model left as it was."""
    hf_sparse_cp.patch()
    try:
        model = AutoModelForCausalLM.from_config(tiny_config("deepseek_v32", **_DSA))
        before = upstream.attn_implementation(model.config)
        with pytest.raises(ValueError, match=_INDEXED.format("deepseek_v32") + r".*--sparse_attention false"):
            hf_sparse_cp.configure(model)
        assert upstream.attn_implementation(model.config) == before and not hasattr(model.config, "sparse_attention")
        model.set_attn_implementation("sparse_cp")
        with pytest.raises(ValueError, match="DeepseekV32ForCausalLM mixes tokens outside attention"):
            check_model_supports_context_parallel(model)
    finally:
        hf_sparse_cp.unpatch()


_DSA = dict(num_key_value_heads=4, qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=48, kv_lora_rank=32,
            q_lora_rank=32, index_topk=64, index_head_dim=32, index_n_heads=2)
_INDEXED = r"Model type '{}' selects the keys each query attends to with a sparse-attention indexer of its own"


@pytest.mark.parametrize("model_type", ["deepseek_v32", "glm_moe_dsa", "axk2", "hy_v4",
                                        *released_model_types("kolibri1_1")])
def test_a_model_with_indexed_attention_loaded_on_the_backend_is_refused_at_its_mask(model_type):
    """Models whose layers are of type 'indexed_attention' (DSA: an indexer selects each query's keys from the 4D
    mask eager and sdpa get), loaded with attn_implementation='sparse_cp' without configure(): their forward failed in
    the indexer with transformers' "TypeError: 'NoneType' object is not subscriptable" (an IndexError with a padded
    batch), naming no fix. Their mask is refused naming the fix; DeepSeek-V4, whose layers have an indexer of other
    types that reads no mask, still runs where its layers are plain attention. Kolibri 1.1, indexed every fifth layer
    and sliding between: its tiny model's two layers were both sliding, and ran (what no Kolibri 1.1 model does under
    sparse_cp); its last layer is indexed now (test_a_tiny_model_holds_each_layer_kind_of_its_family)."""
    hf_sparse_cp.patch()
    try:
        model = AutoModelForCausalLM.from_config(tiny_config(model_type), attn_implementation="sparse_cp")
        for mask in (None, torch.tensor([[0, 1, 1, 1, 1, 1, 1, 1]])):
            with pytest.raises(ValueError, match=_INDEXED.format(model_type) + r".*attn_implementation='eager' \(or "
                                                                               r"'sdpa'.*--sparse_attention false\)"):
                model(input_ids=torch.randint(3, 50, (1, 8)), attention_mask=mask)
        plain = tiny_config("deepseek_v4", layer_types=["sliding_attention"] * 2)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(plain, attn_implementation="sparse_cp")
        ids = torch.randint(3, 50, (1, 16))
        logits = model(input_ids=ids).logits
        model.set_attn_implementation("eager")
        torch.testing.assert_close(logits, model(input_ids=ids).logits)
    finally:
        hf_sparse_cp.unpatch()


def test_a_multimodal_model_with_a_bidirectional_tower_switches_its_language_model_only():
    """Gemma 3 with its vision tower (in transformers' causal-LM mapping): configure() failed with AttributeError
    ('Gemma3Config' object has no attribute 'num_hidden_layers') before any check, then refused the tower's
    bidirectional attention. The tower keeps its own attention now (`integration.composite`): configure switches the
    language model, and still refuses a bidirectional language model (use_bidirectional_attention), the model left
    as it was."""
    from transformers import Gemma3Config

    text = tiny_config("gemma3_text", vocab_size=300).to_dict()
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=32,
                  patch_size=8)
    hf_sparse_cp.patch()
    try:
        for bidirectional in (False, True):
            config = Gemma3Config(text_config=dict(text, use_bidirectional_attention=bidirectional),
                                  vision_config=vision, mm_tokens_per_image=4, image_token_index=299,
                                  boi_token_index=297, eoi_token_index=298)
            model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
            if bidirectional:
                with pytest.raises(ValueError, match=r"Gemma3ForConditionalGeneration has bidirectional attention "
                                                     r"layers \(model.language_model.layers.0.self_attn"):
                    hf_sparse_cp.configure(model)
                assert upstream.attn_implementation(model.config) == "sdpa"
                assert not hasattr(model.config, "sparse_attention")
                continue
            hf_sparse_cp.configure(model)
            assert upstream.attn_implementation(model.config.text_config) == "sparse_cp"
            assert upstream.attn_implementation(model.config.vision_config) == "sdpa"
    finally:
        hf_sparse_cp.unpatch()


def test_a_language_model_under_a_multimodal_config_takes_the_pattern_configured_on_the_model():
    """Fuyu (a Persimmon language model under a multimodal config, no vision tower): configure() failed with
    AttributeError ('FuyuConfig' object has no attribute 'num_hidden_layers'), and the settings it stored on the
    model's config would not have reached the layers, which read the text config. Now both configs hold them: the
    dense pattern gives sdpa's logits, and a narrower local window keeps fewer blocks in every layer."""
    from hf_sparse_cp import SparseAttentionConfig
    from hf_sparse_cp.integration.stats import pop_kept_fractions

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("fuyu", vocab_size=97), attn_implementation="sdpa").eval()
    assert model.config.get_text_config() is not model.config
    ids = torch.randint(3, 97, (1, 256), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        sdpa = model(input_ids=ids).logits
    pattern = dict(block_size=16, min_seq_len=0, vertical_topk=2, slash_topk=2, sink_tokens=0, dense_first_layers=0)
    hf_sparse_cp.patch()
    try:
        hf_sparse_cp.configure(model, SparseAttentionConfig(**{**pattern, "vertical_topk": 10**4, "slash_topk": 10**4}))
        with torch.no_grad():
            assert torch.allclose(model(input_ids=ids).logits, sdpa, rtol=1e-4, atol=1e-5)
        kept = {}
        for window in (16, 128):
            hf_sparse_cp.configure(model, SparseAttentionConfig(**pattern, local_window=window))
            assert model.config.get_text_config().sparse_attention == model.config.sparse_attention
            pop_kept_fractions(model)
            with torch.no_grad():
                model(input_ids=ids)
            kept[window] = pop_kept_fractions(model)
        assert sorted(kept[16]) == sorted(kept[128]) == [0, 1]
        assert all(kept[16][layer] < 0.6 * kept[128][layer] for layer in (0, 1)), kept
    finally:
        hf_sparse_cp.unpatch()
    # the Trainer's path (SparseTrainer, `hf_sparse_cp.run`): the same, and undone on both configs
    from hf_sparse_cp import SparseCPArguments
    from hf_sparse_cp.trainer.attach import disable_sparse_attention, enable_sparse_attention

    del model.config.sparse_attention, model.config.get_text_config().sparse_attention
    model.set_attn_implementation("sdpa")
    enable_sparse_attention(model, SparseCPArguments(sparse_attention=True),
                            SparseAttentionConfig(**pattern, local_window=16), max_length=256)
    try:
        pop_kept_fractions(model)
        with torch.no_grad():
            model(input_ids=ids)
        assert pop_kept_fractions(model) == kept[16]
    finally:
        disable_sparse_attention(model)
    assert not any(hasattr(c, "sparse_attention") for c in (model.config, model.config.get_text_config()))


@pytest.mark.parametrize("model_type", released_model_types("gemma3_text", "cohere2", "gemma2", "olmo3", "dory",
                                                             "gemma4_text", "ministral"))
def test_a_tiny_model_of_a_sliding_window_family_has_no_window_and_runs(model_type):
    """Families whose layer_types default to sliding layers (Gemma 2/3, Cohere 2, OLMo 3): without a window the
    tiny model's layers are all full attention, and its forward runs (`--tiny_model_type gemma3_text` crashed at
    its first step in transformers' mask: 'Could not find a `sliding_window` argument in the config'; so did
    Ministral's, whose config makes its layers full when given no window, though its model builds that mask); with a
    window given, its layer_types stay the architecture's. The config is built with those layer types, so what it
    derives per layer type follows them (Dory's RoPE parameters: KeyError 'full_attention' at the model's build;
    Gemma 4's per-layer settings: 'not homogeneous across layers')."""
    config = tiny_config(model_type)
    assert set(config.layer_types) == {"full_attention"}
    model = AutoModelForCausalLM.from_config(config)
    assert not any(getattr(m, "sliding_window", None) for m in model.modules() if m is not model.config)
    ids = torch.randint(3, 200, (1, 40), generator=torch.Generator().manual_seed(0))
    assert model(input_ids=ids).logits.isfinite().all()
    assert "sliding_attention" in tiny_config(model_type, sliding_window=16).layer_types


_KINDS = {"llama4_text": dict(layer_types=["chunked_attention", "full_attention"], no_rope_layers=[1, 0]),
          "deepseek_v4": dict(layer_types=["heavily_compressed_attention", "compressed_sparse_attention"],
                              mlp_layer_types=["hash_moe", "moe"]),
          "inkling_text": dict(layer_types=["hybrid_sliding", "hybrid"]),
          "inkling2_loop_text": dict(layer_types=["hybrid_sliding", "hybrid"]),
          "kolibri1_1": dict(layer_types=["sliding_attention", "indexed_attention"], kv_source_layers=[0, 1]),
          "gemma3_text": dict(layer_types=["sliding_attention", "full_attention"])}


@pytest.mark.parametrize("model_type", released_model_types(*_KINDS))
def test_a_tiny_model_holds_each_layer_kind_of_its_family(model_type):
    """A family whose models interleave layer kinds with a period beyond two (Llama 4: a full NoPE layer every fourth
    between chunked ones; DeepSeek-V4: two heavily compressed layers, then compressions interleaved; Inkling: global
    attention every sixth; Kolibri 1.1: indexed every fifth; Gemma 3 with a window: full every sixth) had a tiny
    model of two layers of one kind, which the sweep met as no such model is. Its two layers are now the family's
    at the first indices that hold each kind, every per-layer field taken there (Llama 4's full layer without RoPE,
    Kolibri 1.1's key/value sources renumbered); an override of the layer count keeps the family's own first
    layers."""
    window = {"sliding_window": 16} if model_type == "gemma3_text" else {}
    config = tiny_config(model_type, **window)
    assert config.num_hidden_layers == 2
    assert {name: getattr(config, name) for name in _KINDS[model_type]} == _KINDS[model_type]
    assert len(set(tiny_config(model_type, num_hidden_layers=2, **window).layer_types)) == 1
    AutoModelForCausalLM.from_config(config)(input_ids=torch.randint(3, 50, (1, 8)))


@pytest.mark.parametrize("model_type", released_model_types("exaone_moe", "laguna", "exaone4", "kolibri1"))
def test_a_tiny_model_of_a_family_that_takes_no_window_of_none_has_one_no_layer_reaches(model_type):
    """EXAONE-MoE's and Laguna's configs take an int window only: their tiny config was refused ("Field
    'sliding_window' expected int, got NoneType"); so were EXAONE 4's and Kolibri's, whose default sliding layers
    need one (ZeroDivisionError; "Sliding-attention layers need a positive `sliding_window`"). Each now has
    full-attention layers and a window longer than any sequence, and its forward runs."""
    config = tiny_config(model_type)
    assert set(config.layer_types) == {"full_attention"} and config.sliding_window >= config.max_position_embeddings
    ids = torch.randint(3, 200, (1, 40), generator=torch.Generator().manual_seed(0))
    assert AutoModelForCausalLM.from_config(config)(input_ids=ids).logits.isfinite().all()


def _assert_every_block_kept_gives(model, ids, logits) -> None:
    """`model` (sdpa) switched to sparse_cp with every block kept gives `logits` on `ids`."""
    from hf_sparse_cp import SparseAttentionConfig

    hf_sparse_cp.patch()
    try:
        hf_sparse_cp.configure(model, SparseAttentionConfig(block_size=16, min_seq_len=0, vertical_topk=10**4,
                                                            slash_topk=10**4, dense_first_layers=0))
        with torch.no_grad():
            assert torch.allclose(model(input_ids=ids).logits, logits, rtol=1e-4, atol=1e-5)
    finally:
        hf_sparse_cp.unpatch()


@pytest.mark.parametrize("model_type", released_model_types("deepseek_v3", "deepseek_v2", "minicpm3", "qwen3_next",
                                                             "qwen3_5_text", "lfm3"))
def test_a_tiny_model_of_a_latent_attention_or_hybrid_family_runs_and_sparse_cp_computes_its_attention(model_type):
    """Multi-head latent attention: the tiny config's head_dim 32 against the family's rotary width of 64 made a
    model that failed its first forward under any attention ('The size of tensor a (32) must match the size of
    tensor b (16)'); `TINY_MLA` makes one that runs (queries and keys of 48, values of 32). Hybrids place attention
    every few layers, none among the tiny model's two ('get_seq_length can only be called on Attention layers'):
    the last layer attends. sparse_cp with every block kept gives sdpa's logits."""
    config = tiny_config(model_type, vocab_size=97)
    if hasattr(config, "kv_lora_rank"):
        assert config.head_dim == config.qk_rope_head_dim and config.qk_nope_head_dim + config.qk_rope_head_dim == 48
    else:
        assert config.layer_types[0] != config.layer_types[1] == "full_attention"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    ids = torch.randint(3, 97, (2, 96), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        sdpa = model(input_ids=ids).logits
    _assert_every_block_kept_gives(model, ids, sdpa)


# (their Mamba layers' 128 heads of 64 took seconds a forward)
_FEW_MAMBA_HEADS = {t: {"mamba_n_heads": 4, "mamba_d_head": 64} for t in ("bamba", "granitemoehybrid")}


@pytest.mark.parametrize("model_type", released_model_types("bamba", "jamba", "granitemoehybrid", "recurrent_gemma",
                                                             "zamba", "zamba2"))
def test_a_tiny_model_of_a_hybrid_whose_fields_place_its_attention_has_an_attention_layer(model_type):
    """Bamba (attn_layer_indices, None by default), Jamba (attn_layer_period and offset: layer 4 of 8),
    Granite-MoE-Hybrid (layer_types all Mamba by default) and RecurrentGemma (block_types, recurrent twice, then
    attention) made tiny models of two recurrent layers, whose attention no test reached (and RecurrentGemma's forward
    failed: 'Could not find a `sliding_window` argument'); Zamba's and Zamba 2's layer kinds, sized for 76 and 54
    layers, were refused ('`num_hidden_layers` (2) must be equal to the number of `layer_types`'). The field that
    places attention now places it last (Zamba's shared attention in both layers: it ties its later layers to the
    first), a recurrent layer before it, and sparse_cp with every block kept gives sdpa's logits."""
    from hf_sparse_cp.testing.tiny_models import _attends

    config = tiny_config(model_type, vocab_size=97, **_FEW_MAMBA_HEADS.get(model_type, {}))
    assert _attends(config.layer_types[-1:]) and _attends(config.layer_types[:1]) == (model_type == "zamba")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    ids = torch.randint(3, 97, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        sdpa = model(input_ids=ids).logits
    _assert_every_block_kept_gives(model, ids, sdpa)


@pytest.mark.parametrize("model_type", released_model_types("dbrx", "kolibri1_1"))
def test_a_tiny_model_of_a_family_whose_sizes_the_tiny_fields_missed_runs_and_sparse_cp_computes_it(model_type):
    """DBRX takes no tied embeddings and keeps its heads and experts in sub-configs of its own (attn_config's
    kv_n_heads, ffn_config's ffn_hidden_size, moe_num_experts, moe_top_k); its attention reads attn_config.rope_theta,
    which that sub-config does not declare (its checkpoints keep it there), and clamps by clip_qkv, None by default,
    which torch refuses. Kolibri 1.1's indexer scores keys with 12 query heads of key head 0 by default, and its
    layers are sliding or indexed, never full. Both tiny configs were refused ('tie_word_embeddings is not
    supported', '`index_num_heads` must be between 1 and ...'): each now builds a small model (DBRX untied, 2 key
    heads, 4 experts; Kolibri's sliding layers with a window no row reaches), and sparse_cp with every block kept
    gives sdpa's logits (Kolibri's sliding layers alone: sparse_cp refuses its indexed ones, which its tiny model holds
    by default, test_a_model_with_indexed_attention_loaded_on_the_backend_is_refused_at_its_mask)."""
    sliding = {"layer_types": ["sliding_attention"] * 2} if model_type == "kolibri1_1" else {}
    config = tiny_config(model_type, vocab_size=97, **sliding)
    if model_type == "dbrx":
        assert not config.tie_word_embeddings and config.attn_config.kv_n_heads == 2
        assert (config.ffn_config.moe_num_experts, config.ffn_config.moe_top_k) == (4, 2)
    else:
        assert set(config.layer_types) == {"sliding_attention"} and config.sliding_window >= 1 << 20
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    assert sum(p.numel() for p in model.parameters()) < 5_000_000
    ids = torch.randint(3, 97, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        sdpa = model(input_ids=ids).logits
    _assert_every_block_kept_gives(model, ids, sdpa)


@pytest.mark.parametrize("model_type", released_model_types("mamba2"))
def test_a_tiny_state_space_model_builds_and_sparse_cp_refuses_it_naming_the_fix(model_type):
    """Mamba-2's state-space heads (`num_heads` of head_dim, 128 of 64 by default) must split hidden_size * expand:
    its tiny config was refused ('hidden_size * expand (256) must equal num_heads * head_dim (4096)'). It builds now
    (8 heads of 32), runs, and sparse_cp, which has no attention to compute in it, refuses it naming the fix."""
    config = tiny_config(model_type, vocab_size=97)
    assert config.num_heads * config.head_dim == config.hidden_size * config.expand
    model = AutoModelForCausalLM.from_config(config)
    assert model(input_ids=torch.arange(3, 35)[None]).logits.isfinite().all()
    hf_sparse_cp.patch()
    try:
        with pytest.raises(ValueError, match=r"has no attention layer.*--sparse_attention false"):
            hf_sparse_cp.configure(model)
    finally:
        hf_sparse_cp.unpatch()


@pytest.mark.parametrize("model_type", released_model_types("dots3_note", "gemma4_assistant"))
def test_a_composite_type_transformers_builds_from_no_tiny_fields_names_its_language_models_type(model_type):
    """Dots 3 Note (vision and audio towers at their full sizes, which its config checks against the text model's)
    and Gemma 4's assistant (a draft model whose text config must share every layer's keys and values with the
    target's) build no config from the tiny fields: the refusal advised qwen2 or llama; it names the language
    model's type, which builds tiny."""
    text_type = {"dots3_note": "dots3_note_text", "gemma4_assistant": "gemma4_text"}[model_type]
    with pytest.raises(ValueError, match=rf"tiny model type '{model_type}': transformers does not build .*its language "
                                         rf"model's type, --tiny_model_type {text_type} "):
        tiny_config(model_type)
    assert tiny_config(text_type).hidden_size == 128


@pytest.mark.parametrize("model_type", ["qwen2", "llama", "gemma3_text", "mixtral"])
def test_a_tiny_config_that_needs_no_repair_builds_no_model_to_check(model_type, monkeypatch):
    """`tiny_config` builds a model on the meta device only where a repair of the family's defaults applies (Dots1's
    shared experts, LFM2-MoE's layer types, Cohere Compass's RoPE per layer type): before (#50 review) it built one
    for every call, 50 ms each where the config takes 10, on every tiny model of the suite."""
    from hf_sparse_cp.testing import tiny_models

    built = []
    monkeypatch.setattr(tiny_models, "_model_error", lambda config: built.append(config.model_type))
    assert tiny_config(model_type, vocab_size=97).model_type == model_type
    assert built == []


@pytest.mark.parametrize("model_type", released_model_types("dots1", "lfm2_moe", "cohere_compass_text"))
def test_a_tiny_model_of_a_family_whose_defaults_build_no_model_gets_the_field_it_lacks(model_type):
    """Dots1's shared-expert count (None by default, which its model multiplies by), LFM2-MoE's layer types (None,
    which its model reads) and Cohere Compass's RoPE parameters (per layer type, none given: KeyError
    'full_attention') made configs transformers builds no model from; each gets the field (one shared expert, full
    attention, the default RoPE per layer type), a field given stays as given, and the model builds."""
    config = tiny_config(model_type, vocab_size=97)
    assert AutoModelForCausalLM.from_config(config).config.model_type == model_type
    if model_type == "dots1":
        assert config.n_shared_experts == 1 and tiny_config(model_type, n_shared_experts=2).n_shared_experts == 2


@pytest.mark.parametrize("model_type", released_model_types("gemma3n_text"))
def test_a_tiny_model_whose_family_shares_more_layers_than_it_has_shares_half_and_sparse_cp_computes_it(model_type):
    """Gemma 3n's last 15 layers reuse earlier layers' keys and values: of the tiny model's 2 all did, and
    transformers failed to build it ('The set of layer types producing a cache is different than the set of layer
    types using them'; `--tiny_model_type gemma3n_text` crashed at the model's build). Half its layers share now (a
    given num_kv_shared_layers stays as given), and sparse_cp with every block kept gives sdpa's logits."""
    config = tiny_config(model_type, vocab_size=97)
    assert config.num_kv_shared_layers == 1
    assert tiny_config(model_type, num_kv_shared_layers=0).num_kv_shared_layers == 0
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    assert [layer.self_attn.is_kv_shared_layer for layer in model.model.layers] == [False, True]
    ids = torch.randint(3, 97, (2, 96), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        sdpa = model(input_ids=ids).logits
    _assert_every_block_kept_gives(model, ids, sdpa)


@pytest.mark.parametrize("family", ["bert", "bart"])
def test_a_bidirectional_or_encoder_decoder_model_is_refused_naming_the_fix(family):
    """A run_mlm.py-shaped script (BERT) or a seq2seq one (BART) under hf_sparse_cp.run was refused naming the cause
    only; the refusal now names the way to train it: its stock attention."""
    from transformers import AutoModelForMaskedLM, AutoModelForSeq2SeqLM, BartConfig, BertConfig

    from hf_sparse_cp.integration.models import check_model_supports_sparse_attention

    sizes = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    if family == "bert":
        model = AutoModelForMaskedLM.from_config(BertConfig(**sizes, attention_probs_dropout_prob=0.0))
    else:
        model = AutoModelForSeq2SeqLM.from_config(BartConfig(vocab_size=64, d_model=32, encoder_layers=1,
                                                             decoder_layers=1, encoder_attention_heads=2,
                                                             decoder_attention_heads=2, encoder_ffn_dim=64,
                                                             decoder_ffn_dim=64, attention_dropout=0.0))
    with pytest.raises(ValueError, match=r"(bidirectional|encoder-decoder).*causal.*only.*--sparse_attention false"):
        check_model_supports_sparse_attention(model)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_queries_moved_to_their_row_positions_scales_are_as_precise_as_one_processs(dtype):
    """Llama 4's temperature-tuned queries under CP: a rank's shard (striped, rank 1 of 2, 64K tokens) scaled by its
    tensor's positions, moved to the tokens' row positions, carry about one process's rounding in each query's scale
    (the ratio taken in the query's dtype gave 3.3x in bf16 and 7.6x in fp16)."""
    from types import SimpleNamespace

    from hf_sparse_cp.integration.architectures import length_counted_query_scales, moved_query_scales

    scales = length_counted_query_scales(SimpleNamespace(floor_scale=8192, attn_scale=0.1,
                                                         attn_temperature_tuning=True, use_rope=False))
    row = (torch.arange(1, 512, 2)[:, None] * 128 + torch.arange(128)).flatten()
    query = torch.randn(1, 1, row.numel(), 256, generator=torch.Generator().manual_seed(0))
    exact = query.double() * scales(row).double()[:, None]

    def scale_error(q: torch.Tensor) -> float:
        return float((q.double().norm(dim=-1) / exact.norm(dim=-1) - 1).abs().max())

    q = query.to(dtype)
    one_process = (q * scales(row)[:, None]).to(dtype)
    shard = (q * scales(torch.arange(row.numel()))[:, None]).to(dtype)
    moved = moved_query_scales(shard, scales, row)
    assert moved.dtype == dtype
    assert scale_error(moved) <= 1.5 * scale_error(one_process)


# Architectures outside the table that a sweep of transformers' causal LMs found sparse_cp computes as sdpa does, one
# of each kind (their tiny configs: where the family's defaults build no model that runs): learned or sinusoidal
# positions, multi-query attention, partial rotary with QK layer norms, differential attention (two softmaxes a layer),
# cross-layer KV sharing (Gemma 3n's and Gemma 4's last layers attend over an earlier layer's keys and values), mixtures
# of experts, hybrids whose attention layers sit between Mamba or linear-attention ones (RecurrentGemma's: local
# attention after a recurrent block), queries and keys convolved before attention (ZAYA's), RoPE parameters per layer
# type (Cohere Compass), and sliding-window layers beside global ones (windows of 24 tokens in rows of 48: OLMo 3's and
# EXAONE 4's, Cohere Compass's, Gemma 3n's and Gemma 4's in their KV-shared layers; the tiny configs' windows are none,
# or were of 512 tokens, which no row reached). With them, the decoders of encoder-decoder families trained
# decoder-only (in the table: their cross-attention, never called, was refused as a bidirectional layer), with learned
# (offset 2 or none) or sinusoidal positions, scaled embeddings, post-norm layers.
_MAMBA = dict(mamba_n_heads=4, mamba_d_head=64, mamba_d_state=16, mamba_chunk_size=16)  # (128 heads of 256 states)
_KV_SHARING = dict(sliding_window=24, num_hidden_layers=4, num_kv_shared_layers=2,
                   layer_types=["sliding_attention", "full_attention"] * 2)
_WINDOWED = dict(sliding_window=24, layer_types=["sliding_attention", "full_attention"])
SWEPT = {
    "gpt_bigcode": {"max_position_embeddings": 512}, "ctrl": {"max_position_embeddings": 512, "dff": 256},
    "biogpt": {"max_position_embeddings": 512},
    "codegen": {"rotary_dim": 16}, "persimmon": {}, "diffllama": {}, "gemma3n_text": _KV_SHARING,
    "gemma4_text": _KV_SHARING, "jetmoe": {},
    "phimoe": {}, "exaone_moe": {}, "bamba": _MAMBA, "granitemoehybrid": _MAMBA, "minimax": {},
    "recurrent_gemma": {}, "zaya": {}, "cohere_compass_text": _WINDOWED,
    "olmo3": _WINDOWED, "exaone4": _WINDOWED, "ministral": {},
    **{t: {"max_position_embeddings": 512} for t in ("bart", "mbart", "plbart", "blenderbot", "blenderbot-small",
                                                     "marian", "pegasus", "whisper")},
}


# Models whose mask is built without the position_ids (their sdpa attends across restarts; sparse_cp packs by them, as
# it does for every model that hands its layers none: `forward_positions.with_forward_positions`), among them the BART
# family's decoders, which take position_ids through their keyword arguments only.
UNPACKED_BY_THE_MASK = ("biogpt", "granitemoehybrid", "bart", "mbart", "plbart", "blenderbot", "blenderbot-small",
                        "marian", "pegasus")


@pytest.mark.parametrize("model_type", list(SWEPT))
def test_an_architecture_of_the_sweep_trains_with_sparse_cp_as_with_sdpa(model_type):
    """Every block kept, the sparse path gives sdpa's logits and gradients (float64: to its rounding), on one row and
    on a right-padded batch of two (Gemma 4's KV-shared layers sliced the 2D padding mask as sdpa's 4D one: IndexError
    'too many indices'); with documents packed by restarting position_ids, the logits of sdpa on the same packed row
    where the model's own mask packs by them (a hybrid's recurrent layers run across the documents in both)."""
    from hf_sparse_cp import SparseAttentionConfig
    from hf_sparse_cp.integration.stats import pop_kept_fractions

    config = tiny_config(model_type, vocab_size=97, **SWEPT[model_type])
    model_class = AutoModelForCausalLM._model_mapping[type(config)]
    if not model_class._supports_sdpa:  # (CodeGen before transformers 5.24: its own eager attention only)
        pytest.skip(f"transformers {transformers.__version__}'s {model_class.__name__} has no sdpa to compare with")
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", experts_implementation="eager")
    ref = ref.double().eval()  # (eager experts: torch's grouped matmul takes no float64)
    ours = AutoModelForCausalLM.from_config(tiny_config(model_type, vocab_size=97, **SWEPT[model_type]),
                                            experts_implementation="eager").double()
    ours.load_state_dict(ref.state_dict())
    ids = torch.randint(3, 97, (2, 48), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, 35:] = 0
    batches = ({"input_ids": ids[:1], "labels": ids[:1]},
               {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)})
    pos = torch.cat([torch.arange(20), torch.arange(28)])[None]
    hf_sparse_cp.patch()
    try:
        hf_sparse_cp.configure(ours.eval(), SparseAttentionConfig(block_size=16, min_seq_len=0, vertical_topk=10**4,
                                                                  slash_topk=10**4, dense_first_layers=0))
        results = []
        for model in (ref, ours):
            found = []
            for batch in batches:
                model.zero_grad(set_to_none=True)
                out = model(**batch, use_cache=False)
                out.loss.backward()
                found.append((out.logits.detach(), {n: p.grad for n, p in model.named_parameters()}))
            with torch.no_grad():
                packed = model(input_ids=ids[:1], position_ids=pos, use_cache=False).logits
            results.append((found, packed))
        assert pop_kept_fractions(ours)  # (the sparse path ran)
    finally:
        hf_sparse_cp.unpatch()
    (ref_found, ref_packed), (found, packed) = results
    for (ref_logits, ref_grads), (logits, grads), batch in zip(ref_found, found, batches):
        real = batch.get("attention_mask", torch.ones_like(batch["input_ids"])).bool()  # (padding's logits: any)
        assert rel_rms(logits[real], ref_logits[real]) <= 1e-10
        # (each gradient to its own size, or to a millionth of the whole where it is zero but for rounding: a key
        # bias's)
        floor = 1e-6 * torch.stack([g.norm() for g in ref_grads.values() if g is not None]).norm()
        for name, grad in grads.items():
            assert (grad is None) == (ref_grads[name] is None), name
            assert grad is None or (grad - ref_grads[name]).norm() <= 1e-9 * torch.maximum(ref_grads[name].norm(),
                                                                                           floor)
    if model_type not in UNPACKED_BY_THE_MASK:
        assert rel_rms(packed, ref_packed) <= 1e-10


@pytest.mark.parametrize("model_type", ["gemma4_text", "gemma4_unified_text"])
def test_kv_shared_layers_take_their_inputs_whole_and_give_sdpas_kept_positions(model_type):
    """Gemma 4 runs its KV-shared layers on the queries of the kept logits only, slicing the masks as sdpa's 4D ones:
    with logits_to_keep=1 sparse_cp refused them ('handed sparse_cp 48 keys for 1 queries ... adds keys of its own'),
    with a padded batch the slice of its 2D mask ended in an IndexError. Under sparse_cp the layers get their inputs
    whole, as under flash attention: the kept positions are sdpa's; switched to another implementation, the model slices
    them itself again."""
    from transformers import AutoModel

    from hf_sparse_cp import SparseAttentionConfig
    from hf_sparse_cp.integration.architectures import KV_SHARED_SLICER

    config = tiny_config(model_type, vocab_size=97, **_KV_SHARING)
    torch.manual_seed(0)
    ref = AutoModel.from_config(config, attn_implementation="sdpa").double().eval()
    ours = AutoModel.from_config(tiny_config(model_type, vocab_size=97, **_KV_SHARING)).double().eval()
    ours.load_state_dict(ref.state_dict())
    ids = torch.randint(3, 97, (2, 48), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, 35:] = 0
    hf_sparse_cp.patch()
    try:
        hf_sparse_cp.configure(ours, SparseAttentionConfig(block_size=16, min_seq_len=0, vertical_topk=10**4,
                                                           slash_topk=10**4, dense_first_layers=0))
        with torch.no_grad():
            kept = [m(input_ids=ids, logits_to_keep=1, use_cache=False).last_hidden_state for m in (ref, ours)]
            padded = [m(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state for m in (ref, ours)]
        assert rel_rms(kept[1][:, -1:], kept[0]) <= 1e-10  # (all positions come back, as under flash attention)
        assert rel_rms(padded[1][mask.bool()], padded[0][mask.bool()]) <= 1e-10
        assert KV_SHARED_SLICER in vars(ours)
        ours.set_attn_implementation("sdpa")  # (another implementation: the model's own slicing)
        with torch.no_grad():
            assert ours(input_ids=ids, logits_to_keep=1, use_cache=False).last_hidden_state.shape[1] == 1
    finally:
        hf_sparse_cp.unpatch()


def test_the_router_losses_cp_gathers_are_every_installed_one_of_that_form():
    """`router_loss_modules` (read from the sources, unimported) is every installed modeling module whose imported
    `load_balancing_loss_func` takes `ROUTER_LOSS_PARAMETERS`, and none of another form (Doge's `num_keys`,
    SwitchTransformers' `router_probs, expert_indices`); compat.PATCHES lists each with that signature; a model's
    own are those of its classes' modules."""
    import importlib
    import pathlib

    models = pathlib.Path(transformers.models.__path__[0])
    imported = {}
    for path in models.glob("*/modeling_*.py"):
        if "load_balancing_loss_func" in path.read_text(encoding="utf-8"):
            module = importlib.import_module(f"transformers.models.{path.parent.name}.{path.stem}")
            if hasattr(module, "load_balancing_loss_func"):
                imported[module.__name__] = module.load_balancing_loss_func
    gathered = {name for name, function in imported.items() if gathered_router_loss(function)}
    assert set(router_loss_modules()) == gathered
    others = set(imported) - gathered
    assert {"transformers.models.doge.modeling_doge",
            "transformers.models.switch_transformers.modeling_switch_transformers"} <= others
    for model_type in ("mixtral", "phimoe", "jetmoe", "granitemoe", "jamba", "qwen3_next", "minimax", "flex_olmo"):
        assert f"transformers.models.{model_type}.modeling_{model_type}" in gathered, model_type
    listed = {p.qualified: p.parameters for p in compat.PATCHES}
    assert all(listed[f"{name}.load_balancing_loss_func"] == ROUTER_LOSS_PARAMETERS for name in gathered)
    assert not any(f"{name}.load_balancing_loss_func" in listed for name in others)
    phimoe = AutoModelForCausalLM.from_config(tiny_config("phimoe"))
    assert model_router_loss_modules(phimoe) == ("transformers.models.phimoe.modeling_phimoe",)
    assert model_router_loss_modules(AutoModelForCausalLM.from_config(tiny_config("doge", is_moe=True))) == ()


@pytest.mark.parametrize("layer_types, mixer", [(["full_attention", "mlp"], None), (["moe", "full_attention"], None),
                                                (["linear_attention", "full_attention"], "linear_attention")])
def test_mlp_and_expert_layer_types_do_not_mix_tokens(layer_types, mixer):
    """Nemotron-H names its MLP and mixture-of-experts layers in `config.layer_types` ('mlp', 'moe'): the CP check
    took them for token mixers and refused a model of attention and MLP layers ('mixes tokens outside attention
    (layer type 'mlp')'), which the sweep measured equal to one process under CP 2 (logits to the bit); a Mamba
    layer is still refused, naming it alone."""
    hf_sparse_cp.patch()
    model = AutoModelForCausalLM.from_config(tiny_config("nemotron_h", vocab_size=97, layer_types=layer_types))
    hf_sparse_cp.configure(model)
    if mixer is None:
        assert token_mixers(model) == []
        check_model_supports_context_parallel(model)
    else:
        with pytest.raises(ValueError, match=rf"mixes tokens outside attention \(layer type '{mixer}', Conv1d"):
            check_model_supports_context_parallel(model)


@pytest.mark.parametrize("model_type, counted", [("roberta", True), ("xlm-roberta-xl", True), ("roc_bert", False)])
def test_a_model_that_counts_positions_from_its_input_tokens_is_refused_under_cp(model_type, counted):
    """RoBERTa-style decoders (a position table with a padding index) count positions from padding_idx + 1 over the
    input tokens when given no position_ids; under CP 2 they passed the checks and their logits were 0.6 to 0.8
    (rel. RMS) from one process's (the sweep: roberta, roberta-prelayernorm, xlm-roberta, xlm-roberta-xl). Refused,
    naming the table and the fix; RoCBert's table, without a padding index, equal under CP 2, passes."""
    hf_sparse_cp.patch()
    config = tiny_config(model_type, vocab_size=97, is_decoder=True, max_position_embeddings=512)
    model = AutoModelForCausalLM.from_config(config)
    hf_sparse_cp.configure(model)
    if not counted:
        check_model_supports_context_parallel(model)
        return
    with pytest.raises(ValueError, match=rf"\(model type '{model_type}'\) counts its positions from the input tokens "
                                         r"\(.*embeddings.position_embeddings has a padding index.*--cp_size 1"):
        check_model_supports_context_parallel(model)


def _tiny_decoder(model_type: str = "bart", **overrides) -> torch.nn.Module:
    config = tiny_config(model_type, vocab_size=97, max_position_embeddings=256, **overrides)
    assert (config.decoder_layers, config.decoder_attention_heads, config.decoder_ffn_dim) == (2, 4, 256)
    return AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize("model_type", ["bart", "marian"])
def test_a_decoder_with_cross_attention_trains_decoder_only_and_a_call_with_encoder_states_is_refused(model_type):
    """The BART family's causal LMs were refused at the switch and the CP check ('bidirectional attention layers
    (model.decoder.layers.0.encoder_attn, ...)'), though a decoder-only forward never calls their cross-attention. They
    pass both; a forward given encoder_hidden_states is refused at its cross-attention call, naming the fix."""
    hf_sparse_cp.patch()
    model = _tiny_decoder(model_type)
    hf_sparse_cp.configure(model)
    check_model_supports_context_parallel(model)
    ids = torch.randint(3, 97, (1, 40), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids)
    with pytest.raises(ValueError, match=r"\(\w+Attention\) of model type '\w+' is cross-attention.*an encoder's output"
                                         r".*--sparse_attention false.*encoder_hidden_states"):
        model(input_ids=ids, encoder_hidden_states=torch.randn(1, 12, model.config.hidden_size))


def test_a_decoder_self_attention_built_non_causal_is_refused_as_what_it_is_not_as_cross_attention():
    """BigBird-Pegasus's causal LM builds its decoder's self-attention with is_causal=False (causal only by the mask its
    eager attention, the one it supports, reads): configure() and a forward of the model loaded on the backend refused
    it as cross-attention ('its queries attend to the keys of another sequence ... encoder_hidden_states'), which its
    decoder-only forward never calls. The refusal names the layer as what it is and eager as the fix; the CP check,
    which told the model loaded on the backend to switch by configure(model) (for its position table counted from the
    input's length) where configure refuses it, names that cause first."""
    hf_sparse_cp.patch()
    model = _tiny_decoder("bigbird_pegasus")
    cause = (r"\(BigBirdPegasusDecoderAttention\) of model type 'bigbird_pegasus' is a decoder's self-attention built "
             r"with is_causal=False.*attn_implementation='eager' \(--sparse_attention false\)")
    with pytest.raises(ValueError, match=cause) as refused:
        hf_sparse_cp.configure(model)
    assert upstream.attn_implementation(model.config) == "eager"
    model.set_attn_implementation("sparse_cp")
    with pytest.raises(ValueError, match=cause) as called:
        model(input_ids=torch.randint(3, 97, (1, 40), generator=torch.Generator().manual_seed(0)))
    assert not any("cross-attention" in str(e.value) for e in (refused, called))
    with pytest.raises(ValueError, match=cause) as checked:
        check_model_supports_context_parallel(model)
    assert "configure(model)" not in str(checked.value)


def test_a_decoder_that_counts_positions_from_its_input_needs_the_switch_and_no_layerdrop_under_cp():
    """BART's decoder counts the positions of its table from the length of its input (a rank's shard under CP):
    `configure` hooks the table to the row's positions (tests/distributed/test_cp_models.py), and a model switched
    by its attn_implementation alone, without the hook, is refused under CP, naming the fix. LayerDrop, which each
    rank would draw for itself (the ranks then running different layers), is refused too."""
    hf_sparse_cp.patch()
    model = _tiny_decoder()
    model.set_attn_implementation("sparse_cp")
    with pytest.raises(ValueError, match=r"position table \(model.decoder.embed_positions\) from the length of its "
                                         r"input.*hf_sparse_cp.configure\(model\)"):
        check_model_supports_context_parallel(model)
    model = _tiny_decoder(decoder_layerdrop=0.1)
    hf_sparse_cp.configure(model)
    with pytest.raises(ValueError, match=r"decoder_layerdrop=0.1: in training its forward skips layers at random.*"
                                         r"Set it to 0"):
        check_model_supports_context_parallel(model)
