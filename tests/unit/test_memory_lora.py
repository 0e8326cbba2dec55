"""LoRA fine-tuning in the memory model (`StepSettings.lora`, `hf-sparse-cp memory --lora-rank`): what a layer with
PEFT's adapters saves for backward, counted by autograd's hooks against the model's count; a step's activations, its
gradients and optimizer state against a measured CPU step; the trainable parameters against PEFT's own count; the
command's output and its refusals. Before (#50), `memory` had no LoRA option and answered a LoRA fine-tune with full
fine-tuning's prediction (every weight's gradient and AdamW state, every frozen matrix's saved input)."""

import contextlib
import json

import pytest
import torch
from memory_steps import STEP_TOKENS, recorded_step_peak, step_config
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

import hf_sparse_cp
from hf_sparse_cp import SparseAttentionConfig, configure
from hf_sparse_cp.cli import main as cli_main
from hf_sparse_cp.config.model_fields import LEAN_LOSS_FAMILIES
from hf_sparse_cp.integration.memory_savers import enable_memory_savers
from hf_sparse_cp.memory import MemorySavers
from hf_sparse_cp.simulator.lora import DEFAULT_TARGETS, LORA_FAMILIES, MODULE_INPUTS, LoraSettings
from hf_sparse_cp.simulator.memory_model.architecture import Architecture
from hf_sparse_cp.simulator.memory_model.layer import recomputed_layer_bytes
from hf_sparse_cp.simulator.memory_model.presets import PRESETS
from hf_sparse_cp.simulator.memory_model.settings import StepSettings
from hf_sparse_cp.simulator.memory_model.step import predict_step_memory
from hf_sparse_cp.testing.tiny_models import tiny_config

PATTERN = SparseAttentionConfig(block_size=64, min_seq_len=128, dense_first_layers=0, vertical_topk=16, slash_topk=4,
                                sink_tokens=16, local_window=64, last_q=32)
ALL = tuple(MODULE_INPUTS)


def _lora_model(config, dtype: torch.dtype, lora: LoraSettings):
    """A tiny `sparse_cp` model of `config` in `dtype` with PEFT's LoRA adapters (`lora`), in training mode."""
    hf_sparse_cp.patch()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sparse_cp", dtype=dtype)
    configure(model, PATTERN)
    model = get_peft_model(model, LoraConfig(r=lora.rank, target_modules=list(lora.targets),
                                             lora_dropout=lora.dropout))
    return model.train()


# (weights' dtype, autocast to bf16, adapters, token tiles): a bf16 model (PEFT's fp32 adapters cast their inputs),
# an fp32 model (the adapters save the input itself, once per input), the Trainer's mixed precision (autocast's
# copies), with dropout (a mask and a dropped copy per adapter), every layer matrix, token tiles (the MLP's adapters
# run inside the tiles)
CASES = {
    "bf16": (torch.bfloat16, False, LoraSettings(8), False),
    "bf16-all-dropout": (torch.bfloat16, False, LoraSettings(8, ALL, 0.1), False),
    "bf16-all-tiled": (torch.bfloat16, False, LoraSettings(8, ALL), True),
    "bf16-dropout-tiled": (torch.bfloat16, False, LoraSettings(8, dropout=0.05), True),
    "fp32-all": (torch.float32, False, LoraSettings(16, ALL), False),
    "fp32-all-dropout": (torch.float32, False, LoraSettings(16, ALL, 0.1), False),
    "autocast": (torch.float32, True, LoraSettings(8), False),
    "autocast-all-dropout": (torch.float32, True, LoraSettings(8, ALL, 0.1), False),
    "autocast-all-tiled": (torch.float32, True, LoraSettings(8, ALL), True),
    "qwen3-bf16": (torch.bfloat16, False, LoraSettings(8), False),
    "qwen3-bf16-all-tiled": (torch.bfloat16, False, LoraSettings(8, ALL), True),
    "qwen3-fp32-all": (torch.float32, False, LoraSettings(16, ALL), False),
    "qwen3-autocast-all-dropout": (torch.float32, True, LoraSettings(8, ALL, 0.1), False),
    "gemma3_text-bf16": (torch.bfloat16, False, LoraSettings(8), False),
    "gemma3_text-fp32-all": (torch.float32, False, LoraSettings(16, ALL), False),
    "gemma3_text-autocast-all-dropout": (torch.float32, True, LoraSettings(8, ALL, 0.1), False),
    "gemma-fp32-all": (torch.float32, False, LoraSettings(16, ALL), False),
    "granite-autocast-all-dropout": (torch.float32, True, LoraSettings(8, ALL, 0.1), False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_lora_layer_saves_what_the_model_counts(case):
    """The activations a decoder layer with LoRA adapters saves for backward (autograd's hooks, distinct storages,
    the layout and autocast's weight copies apart: their own terms), equal to the model's count. Measured at 512
    tokens (bytes per token): bf16 q/v adapters 5016 (full fine-tuning 5912: the frozen matrices keep no input, the
    adapters an fp32 copy each), fp32 every matrix 9688, autocast q/v 3960 (the layer input fp32, the residual stream
    under autocast; #50: counted with a bf16 input before, 4472), bf16 tiled every matrix 3472 (full 1808).
    Qwen3's q/k norms keep their fp32 inputs and rsqrt besides (bf16 q/v: 5808; the Llama layer's count, which a LoRA
    prediction gave it before, 5016): measured on its model with the layers' weights frozen. Gemma 3's layer (four
    RMSNorms, q/k norms, each saving its fp32 input and its 1 + weight; LoRA refused there before #50 as no Llama-like
    family's) likewise: bf16 q/v 6840 per token, and 2304 bytes of its norms' 1 + weight; Gemma's and Granite's."""
    dtype, autocast, lora, tiled = CASES[case]
    family = case.split("-")[0] if case.split("-")[0] in LORA_FAMILIES else "qwen2"
    config = tiny_config(family, vocab_size=300, intermediate_size=352)
    model = _lora_model(config, dtype, lora)
    base = model.base_model.model
    if tiled:
        enable_memory_savers(base, MemorySavers(tiled=True, tile_tokens=96))
    layer, s = base.model.layers[0], 512
    x = torch.randn(1, s, config.hidden_size, dtype=dtype, requires_grad=True)  # (autocast: the fp32 residual)
    # (Gemma 3's rotary embedding is the layer type's)
    layer_type = (config.layer_types[0],) if family == "gemma3_text" else ()
    cos_sin = base.model.rotary_emb(x, torch.arange(s).unsqueeze(0), *layer_type)
    known = {t.untyped_storage().data_ptr() for t in (x, *cos_sin, *layer.parameters())}
    seen: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        # (activations: a token dimension, and what a norm makes of its weight, Gemma's 1 + weight; not the layout's
        # int32 tensors, nor autocast's weight copies: their own term)
        if storage.data_ptr() not in known and t.dtype != torch.int32 and (s in t.shape or t.dim() == 1):
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with (torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext(),
          torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)):
        layer(x, position_embeddings=cos_sin)

    settings = StepSettings(dtype="float32" if dtype == torch.float32 and not autocast else "bfloat16",
                            master_weights=dtype == torch.float32, device="cpu", pattern=PATTERN, lora=lora,
                            savers=MemorySavers(tiled=tiled, tile_tokens=96))
    predicted = recomputed_layer_bytes(Architecture.from_config(config), s, settings)
    assert sum(seen.values()) == sum(v for k, v in predicted.items() if k != "layout")


def _unchecked_step(layers: int, lora: LoraSettings | None) -> tuple[int, float, float]:
    """(measured, predicted, full fine-tuning's prediction) bytes at the peak of a step (forward, lean loss, backward)
    of a bf16 Qwen2 of `layers` layers with `lora`'s adapters, without gradient checkpointing, the weights apart (as
    test_memory_model's step without checkpointing)."""
    config = step_config(layers)
    measured = recorded_step_peak(lambda: _lora_model(config, torch.bfloat16, lora))
    arch = Architecture.from_config(config)

    def predicted(tuned: LoraSettings | None) -> float:
        est = predict_step_memory(arch, STEP_TOKENS, StepSettings(device="cpu", pattern=PATTERN,
                                                                  gradient_checkpointing=False, optimizer="none",
                                                                  lora=tuned))
        return max(est.phases[p]["bytes"] for p in ("forward", "loss", "backward")) - est.terms("optimizer")["weights"]

    return measured, predicted(lora), predicted(None)


def test_a_lora_step_holds_what_the_model_predicts():
    """What four more layers with q/v adapters add to a step's peak (every layer's saved tensors kept to its backward,
    and its gradients): measured 55.2 MiB at 1K tokens, predicted 57.8 MiB; full fine-tuning's prediction, what
    `memory` answered a LoRA fine-tune with before, 74.1 MiB (the frozen layers' inputs and weight gradients)."""
    (measured_1, predicted_1, full_1), (measured_5, predicted_5, full_5) = (
        _unchecked_step(n, LoraSettings(8)) for n in (1, 5))
    assert predicted_5 - predicted_1 == pytest.approx(measured_5 - measured_1, rel=0.1)
    assert full_5 - full_1 > 1.25 * (measured_5 - measured_1)


@pytest.mark.parametrize("family", ["qwen2", "gemma3_text"])
def test_the_trained_parameters_gradients_and_optimizer_state_are_the_adapters(family):
    """The trainable parameters are PEFT's own count (`get_nb_trainable_parameters`) for its default targets and for
    every matrix; after a step, the gradients held and AdamW's state are the fp32 adapters' alone (PEFT upcasts a
    bf16 model's adapters), as the model predicts at the optimizer step; Gemma 3's through its stock loss."""
    config = tiny_config(family, vocab_size=300, intermediate_size=352)
    arch = Architecture.from_config(config)
    for lora in (LoraSettings(8), LoraSettings(16, ALL, 0.05)):
        model = _lora_model(config, torch.bfloat16, lora)
        trainable, total = model.get_nb_trainable_parameters()
        assert lora.params(arch.shape) == trainable and total == arch.params + trainable
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    ids = torch.randint(0, config.vocab_size, (1, 128))
    model(input_ids=ids, labels=ids).loss.backward()
    gradients = sum(p.grad.untyped_storage().nbytes() for p in model.parameters() if p.grad is not None)
    optimizer.step()
    state = sum(t.untyped_storage().nbytes() for s in optimizer.state.values() for t in s.values() if t.dim())
    est = predict_step_memory(arch, 128, StepSettings(device="cpu", pattern=PATTERN, lora=lora))
    assert est.terms("optimizer")["gradients"] == gradients == 4 * trainable
    assert est.terms("optimizer")["optimizer state"] == state == 2 * 4 * trainable
    full = predict_step_memory(arch, 128, StepSettings(device="cpu", pattern=PATTERN))
    assert full.terms("optimizer")["gradients"] == 2 * arch.params  # (what the model answered before)


def test_the_default_targets_are_pefts_for_the_llama_like_families():
    """`--lora-targets`' default is PEFT's `target_modules` default for the families it names."""
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as DEFAULTS

    for family in (*LEAN_LOSS_FAMILIES, "gemma", "gemma3_text"):
        assert tuple(DEFAULTS[family]) == DEFAULT_TARGETS


def test_the_memory_command_predicts_a_lora_fine_tune_and_says_so(capsys, tmp_path):
    """`memory --lora-rank 16` (TRL's --lora_r taken too) on Qwen2.5-7B, 80 GB, bf16 weights: the frozen 7.6B
    parameters' gradients and AdamW state (bf16: 45.7 GB) are gone, and 196,608 tokens fit where full fine-tuning fits
    none; the header, the JSON and the lengths say LoRA was assumed."""
    argv = ["memory", "--model", "qwen2.5-7b", "--gpu-memory", "80GB", "--no-master-weights", "--seq-len", "65536"]
    out_json = tmp_path / "lora.json"
    assert cli_main([*argv, "--lora_r", "16", "--json", str(out_json)]) == 0
    lora_out = capsys.readouterr().out
    assert "LoRA rank 16 on q_proj, v_proj (base weights frozen): 5.0M trained parameters" in lora_out, lora_out
    report = json.loads(out_json.read_text())
    assert report["lora"] == {"rank": 16, "targets": ["q_proj", "v_proj"], "dropout": 0.0,
                              "trainable_parameters": 5_046_272}
    assert cli_main([*argv, "--json", str(tmp_path / "full.json")]) == 0
    assert "full fine-tuning" in capsys.readouterr().out
    full = json.loads((tmp_path / "full.json").read_text())
    assert full["lora"] is None
    assert report["longest_fitting_tokens"] > 0 == full["longest_fitting_tokens"]
    lora_terms, full_terms = report["lengths"]["65536"]["terms_bytes"], full["lengths"]["65536"]["terms_bytes"]
    assert lora_terms["optimizer state"] == 2 * 4 * 5_046_272  # (the adapters' fp32 moments)
    assert full_terms["optimizer state"] == 2 * 2 * PRESETS["qwen2.5-7b"].params
    assert lora_terms["gradients"] < 1e6 < 14e9 < full_terms["gradients"]  # (at the peak, in backward)
    assert lora_terms["weights"] == pytest.approx(full_terms["weights"], rel=0.01)


@pytest.mark.parametrize("argv, message", [
    (["--lora-targets", "q_proj"], "--lora-targets describes a LoRA fine-tune's adapters; without --lora-rank"),
    (["--lora_dropout", "0.05"], "--lora-dropout describes a LoRA fine-tune's adapters; without --lora-rank"),
    (["--lora-rank", "16", "--lora-targets", "c_attn"], "--lora-targets: LoRA targets ['c_attn']: give distinct "
     "matrices of a Llama-like decoder layer, among q_proj"),
    (["--lora-rank", "16", "--lora-targets", "all-linear", "q_proj"], "'all-linear' adapts every layer matrix; give "
     "it alone"),
    (["--lora-rank", "16", "--lora-dropout", "1"], "--lora-dropout: LoRA dropout=1.0 must be in [0, 1)"),
    (["--lora-rank", "0"], "argument --lora-rank: 0 must be >= 1"),
    (["--lora-rank", "16", "--optimizer", "smet"], "--optimizer smet with --lora-rank: SMET's compact state is for "
     "full fine-tuning's layer matrices"),
])
def test_the_memory_command_refuses_lora_settings_that_describe_no_fine_tune(argv, message, capsys):
    with pytest.raises(SystemExit) as refused:
        cli_main(["memory", "--model", "qwen2.5-0.5b", *argv])
    err = capsys.readouterr().err
    assert refused.value.code == 2 and "Traceback" not in err and message in err, err


def test_lora_on_a_model_whose_layers_it_does_not_count_is_refused_and_an_adapters_folder_names_its_flags(
        tmp_path, capsys):
    """LoRA is counted on the layers of `lora.LORA_FAMILIES`: another architecture's config (a fused q/k/v, fc1/fc2;
    a mixture's experts; OLMo2's q/k/v reading the layer's input, not a norm's output, where the count was 5% over)
    is refused naming the flag, Gemma 3's answered (refused before #50, as no Llama-like family's); a LoRA adapter's
    folder, refused as no model, names the flags that predict its training."""
    for family, fields in (("gpt_neox", {"num_key_value_heads": 4}), ("mixtral", {}), ("olmo2", {})):
        config = tmp_path / family
        config.mkdir()
        (config / "config.json").write_text(json.dumps(dict(tiny_config(family, **fields).to_dict())))
        with pytest.raises(SystemExit):
            cli_main(["memory", "--config", str(config), "--lora-rank", "8", "--quiet"])
        err = capsys.readouterr().err
        assert ("--lora-rank: LoRA is modelled on the decoder layers of Llama, Mistral, Qwen2, Qwen3, Gemma, Gemma 3, "
                "Granite (a Llama layer's matrices, q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, "
                "each reading a norm's output or the attention's), whose saved tensors it counts, not") in err, err
    gemma = tmp_path / "gemma3"
    tiny_config("gemma3_text", vocab_size=300).save_pretrained(gemma)
    assert cli_main(["memory", "--config", str(gemma), "--lora-rank", "8", "--seq-len", "4096"]) == 0
    assert "LoRA rank 8 on q_proj, v_proj (base weights frozen)" in capsys.readouterr().out
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "base_model_name_or_path": "base", "r": 32, "target_modules": ["v_proj", "q_proj"],
        "lora_dropout": 0.05}))
    with pytest.raises(SystemExit):
        cli_main(["memory", "--config", str(adapter), "--quiet"])
    err = capsys.readouterr().err
    assert ("`hf-sparse-cp memory` predicts the adapter's training with --lora-rank 32 --lora-targets q_proj v_proj "
            "--lora-dropout 0.05.") in err, err
    # (flags `memory` would refuse, or that describe another adapter, are not offered: before (#50 review) an
    # adapter on lm_head was told --lora-targets lm_head q_proj, a DoRA one plain LoRA's flags)
    for other in ({"target_modules": ["q_proj", "lm_head"]}, {"target_modules": ".*proj"}, {"use_dora": True}):
        (adapter / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "base_model_name_or_path": "base", "r": 32, "target_modules": ["q_proj"], **other}))
        with pytest.raises(SystemExit):
            cli_main(["memory", "--config", str(adapter), "--quiet"])
        err = capsys.readouterr().err
        assert "a PEFT adapter" in err and "predicts the adapter's training" not in err, err


def test_lora_settings_refuse_nonsense():
    for bad in (dict(rank=0), dict(rank=8, dropout=-0.1), dict(rank=8, targets=()),
                dict(rank=8, targets=("q_proj",) * 2), dict(rank=True)):
        with pytest.raises(ValueError):
            LoraSettings(**bad)


def test_a_rank_above_a_matrix_side_is_predicted_as_peft_trains_it(capsys, tmp_path):
    """PEFT trains a rank above a targeted matrix's smaller side (r=256 on Qwen2.5-0.5B's v_proj, 896 -> 128): its
    adapters, rank x (in + out), are counted as any other. Before (#50 review) `memory` refused it, and an adapter
    folder's refusal named flags that `memory` then refused."""
    out_json = tmp_path / "r256.json"
    assert cli_main(["memory", "--model", "qwen2.5-0.5b", "--lora-rank", "256", "--quiet", "--json",
                     str(out_json)]) == 0
    assert int(capsys.readouterr().out.strip()) > 0
    assert json.loads(out_json.read_text())["lora"]["trainable_parameters"] == 24 * 256 * (896 + 896 + 896 + 128)
