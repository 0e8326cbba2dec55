"""The work around attention, fused (`integration/fused_ops.py`): which setting runs where, liger-kernel's module
replacement applied to a model instance with the sparse_cp attention and the lean loss kept (its kernels are CUDA
Triton, so only the replacement is checked here), the Trainer's --use_liger_kernel taken over so that the token tiles
wrap liger's modules, and every change undone. The compiled path's losses and gradients:
tests/integration/test_fused_ops_compile.py (one process), tests/distributed/test_fused_ops_cp.py (CP 2)."""

import copy

import pytest
import torch
from transformers import AttentionInterface, AutoModelForCausalLM, TrainingArguments

import hf_sparse_cp
from hf_sparse_cp import SparseAttentionConfig, SparseCPArguments, configure
from hf_sparse_cp.config import BACKEND_NAME
from hf_sparse_cp.integration import fused_ops
from hf_sparse_cp.integration.fused_ops import (
    describe_fused_ops,
    disable_fused_ops,
    enable_fused_ops,
    fused_modules,
    liger_settings,
    resolve_fused_ops,
)
from hf_sparse_cp.integration.memory_savers import ReplacedForward
from hf_sparse_cp.testing.tiny_models import tiny_config
from hf_sparse_cp.trainer.arguments import is_flag_error
from hf_sparse_cp.trainer.attach import disable_sparse_attention, enable_sparse_attention, training_fused_ops

PATTERN = SparseAttentionConfig(block_size=16, min_seq_len=64, dense_first_layers=0, vertical_topk=8, slash_topk=4,
                                sink_tokens=4, local_window=16, last_q=8)
LAYERS = 2
ROWWISE = {"LigerRMSNorm": 2 * LAYERS + 1, "LigerSwiGLUMLP": LAYERS}  # two norms per layer, the final norm, MLPs


def _model():
    hf_sparse_cp.patch()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("qwen2", vocab_size=97, num_hidden_layers=LAYERS))
    configure(model, PATTERN)
    return model


@pytest.fixture
def liger():
    pytest.importorskip("liger_kernel.transformers")
    from transformers.models.qwen2 import modeling_qwen2

    stock = dict(vars(modeling_qwen2))
    yield modeling_qwen2
    # liger-kernel's process-wide names are restored by the undo tested here; a failing test must not leave them
    for name in ("apply_rotary_pos_emb", "Qwen2RMSNorm", "Qwen2MLP"):
        setattr(modeling_qwen2, name, stock[name])


def test_auto_is_liger_on_cuda_with_liger_kernel_and_off_otherwise(monkeypatch):
    monkeypatch.setattr(fused_ops, "is_liger_available", lambda: True)
    assert resolve_fused_ops("auto", on_cuda=True) == "liger"
    assert resolve_fused_ops("auto", on_cuda=False) == "off"
    assert resolve_fused_ops("compile", on_cuda=False) == "compile"
    monkeypatch.setattr(fused_ops, "is_liger_available", lambda: False)
    assert resolve_fused_ops("auto", on_cuda=True) == "off"
    with pytest.raises(ValueError, match=r"needs liger-kernel: pip install 'hf-sparse-cp\[liger\]'"):
        resolve_fused_ops("liger", on_cuda=True)


def test_auto_leaves_a_model_compiled_whole_to_inductor_and_keeps_an_explicit_liger(monkeypatch, tmp_path):
    """Under a Trainer's --torch_compile (the model compiled whole) 'auto' is 'off': inductor fuses that work, and
    liger-kernel's in-place Triton kernels stay out of the graphs (the compiled H200 step with them faulted); an
    explicit 'liger' or --use_liger_kernel is still liger-kernel's. CUDA pretended: only the choice runs."""
    eager, compiled, liger = (TrainingArguments(output_dir=str(tmp_path), report_to=[], **flags) for flags in (
        {}, {"torch_compile": True}, {"torch_compile": True, "use_liger_kernel": True}))
    monkeypatch.setattr(fused_ops, "is_liger_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_fused_ops("auto", on_cuda=True, compiled=True) == "off"
    assert resolve_fused_ops("liger", on_cuda=True, compiled=True) == "liger"
    assert resolve_fused_ops("compile", on_cuda=True, compiled=True) == "compile"
    assert [training_fused_ops("auto", args) for args in (eager, compiled, liger)] == ["liger", "off", "liger"]
    # accelerate's dynamo backend (`accelerate launch --dynamo_backend inductor`) compiles the model whole without
    # --torch_compile: the Trainer's TorchDynamoPlugin reads it from the environment
    monkeypatch.setenv("ACCELERATE_DYNAMO_BACKEND", "INDUCTOR")
    assert [training_fused_ops("auto", args) for args in (eager, liger)] == ["off", "liger"]
    monkeypatch.setenv("ACCELERATE_DYNAMO_BACKEND", "NO")
    assert training_fused_ops("auto", eager) == "liger"
    model = _model()
    assert describe_fused_ops(model, compiled=True).startswith("fused ops: left to torch.compile")
    assert describe_fused_ops(model) == "fused ops: off (stock PyTorch around attention)"


@pytest.mark.parametrize("setting, message", [("liger", "need a CUDA GPU; on CPU use --sparse_fused_ops compile"),
                                              ("fast", "--sparse_fused_ops 'fast' is unknown")])
def test_settings_that_cannot_run_are_refused_naming_the_fix(setting, message):
    with pytest.raises(ValueError, match=message):
        resolve_fused_ops(setting, on_cuda=False)


def test_liger_loss_replacements_stay_off_unless_asked_while_the_lean_loss_computes_the_loss():
    assert liger_settings(None, lean_loss=True) == {"cross_entropy": False, "fused_linear_cross_entropy": False}
    assert liger_settings({"rope": False, "fused_linear_cross_entropy": True}, lean_loss=True) == {
        "rope": False, "fused_linear_cross_entropy": True, "cross_entropy": False}
    assert liger_settings({"swiglu": False}, lean_loss=False) == {"swiglu": False}


def test_liger_replaces_norms_mlps_and_rope_keeps_our_attention_and_loss_and_undoes(liger):
    hf_sparse_cp.enable_lean_loss()
    model = _model()
    stock_rope, stock_norm = liger.apply_rotary_pos_emb, liger.Qwen2RMSNorm
    forwards = {name: m.forward for name, m in model.named_modules()}
    enable_fused_ops(model, "liger", liger_settings(None, lean_loss=True))
    assert fused_modules(model) == {**ROWWISE, "liger RoPE": 1}
    assert describe_fused_ops(model).startswith("fused ops: liger-kernel ")
    # our attention is the model's and the registered one; the lean loss's class forward is not hidden by an
    # instance forward (liger's fused linear cross-entropy forward, off here)
    assert model.config._attn_implementation == BACKEND_NAME
    assert AttentionInterface._global_mapping[BACKEND_NAME].__module__.startswith("hf_sparse_cp.")
    assert "forward" not in model.__dict__ and hf_sparse_cp.is_lean_loss_enabled()
    copied = copy.deepcopy(model)  # a copy carries the replaced modules and undoes them on itself
    disable_fused_ops(copied)
    assert fused_modules(copied) == {"liger RoPE": 1} and fused_modules(model) == {**ROWWISE, "liger RoPE": 1}
    assert disable_fused_ops(model) and not disable_fused_ops(model)
    assert fused_modules(model) == {}
    assert liger.apply_rotary_pos_emb is stock_rope and liger.Qwen2RMSNorm is stock_norm
    assert all(m.forward == forwards[name] for name, m in model.named_modules())


def test_liger_loss_when_asked_replaces_the_instance_forward_and_its_undo_removes_it(liger):
    model = _model()
    enable_fused_ops(model, "liger", liger_settings({"fused_linear_cross_entropy": True}, lean_loss=True))
    assert model.__dict__["forward"].__func__.__module__.startswith("liger_kernel")
    disable_fused_ops(model)
    assert "forward" not in model.__dict__


def test_the_trainers_use_liger_kernel_is_applied_before_the_token_tiles_and_undone(liger, monkeypatch, tmp_path):
    """--use_liger_kernel with sparse attention: the plugin applies liger-kernel (CUDA, here pretended: only the
    replacement runs) before wrapping the modules in token tiles, and turns the Trainer's own application off (it
    would replace the tiles in train()); the undo restores the modules and the flag."""
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_liger_kernel=True)
    model = _model()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    plugin = SparseCPArguments(sparse_attention=True, sparse_token_tiling_min_length=4096)
    enable_sparse_attention(model, plugin, PATTERN, args, max_length=8192)
    assert args.use_liger_kernel is False
    norm = model.model.layers[0].input_layernorm
    tiled = norm.__dict__["forward"]
    assert isinstance(tiled, ReplacedForward) and tiled._function.__qualname__ == "LigerRMSNorm.forward"
    assert fused_modules(model) == {**ROWWISE, "liger RoPE": 1}
    disable_sparse_attention(model)
    assert args.use_liger_kernel is True and fused_modules(model) == {} and "forward" not in norm.__dict__


def test_use_liger_kernel_with_another_fused_ops_setting_is_refused(tmp_path):
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_liger_kernel=True)
    with pytest.raises(ValueError, match="--use_liger_kernel asks for liger-kernel's kernels and --sparse_fused_ops "
                                         "compile") as refused:
        enable_sparse_attention(_model(), SparseCPArguments(sparse_attention=True, sparse_fused_ops="compile"),
                                PATTERN, args)
    assert is_flag_error(refused.value)  # (a launched script ends with the message alone, not a traceback)


def test_use_liger_kernel_on_cpu_is_refused_naming_the_fix(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_liger_kernel=True)
    with pytest.raises(ValueError, match="need a CUDA GPU; on CPU use --sparse_fused_ops compile or off") as refused:
        enable_sparse_attention(_model(), SparseCPArguments(sparse_attention=True), PATTERN, args)
    # (run_clm.py --use_liger_kernel on CPU under hf_sparse_cp.run ended in this message under a traceback)
    assert is_flag_error(refused.value)


def test_compile_wraps_exactly_the_rowwise_modules_and_undoes():
    model = _model()
    enable_fused_ops(model, "compile")
    assert fused_modules(model) == {"compiled": 2 * LAYERS + 1 + LAYERS}
    assert describe_fused_ops(model) == f"fused ops: torch.compile on {3 * LAYERS + 1} MLP / RMSNorm modules"
    with pytest.raises(ValueError, match="already enabled"):
        enable_fused_ops(model, "compile")
    disable_fused_ops(model)
    assert fused_modules(model) == {} and describe_fused_ops(model).startswith("fused ops: off")


@pytest.mark.parametrize("model_type, compiled, left", [
    ("gemma3_text", {"Gemma3MLP": LAYERS, "Gemma3RMSNorm": 4 * LAYERS + 1}, None),  # (not its q/k norms)
    ("olmo2", {"Olmo2MLP": LAYERS, "Olmo2RMSNorm": 2 * LAYERS + 1}, None),
    ("glm4", {"Glm4MLP": LAYERS, "Glm4RMSNorm": 4 * LAYERS + 1}, None),
    ("cohere", {"CohereMLP": LAYERS, "CohereLayerNorm": LAYERS + 1}, None),
    ("mixtral", {"MixtralRMSNorm": 2 * LAYERS + 1}, "MixtralSparseMoeBlock")])
def test_compile_takes_another_architectures_norms_and_dense_mlps_and_leaves_experts_naming_them(
        model_type, compiled, left, caplog, tmp_path):
    """--sparse_fused_ops compile on an architecture outside the Llama-like families was refused with the token
    tiles' message ("turn token tiles off", a flag the run did not give). Its norms and dense MLP now compile, those
    under other names than the token tiles' too (Gemma 3's pre/post-feedforward norms, OLMo 2's post-feedforward norm
    and GLM-4's post-MLP norm were left eager), never attention's own q/k norms; a mixture of experts is left to
    eager PyTorch, named. Their numbers: tests/integration/test_fused_ops_compile.py."""
    hf_sparse_cp.patch()
    model = AutoModelForCausalLM.from_config(tiny_config(model_type, vocab_size=97, num_hidden_layers=LAYERS))
    configure(model, PATTERN)
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    with caplog.at_level("WARNING", logger=fused_ops.__name__):
        enable_sparse_attention(model, SparseCPArguments(sparse_attention=True, sparse_fused_ops="compile"), PATTERN,
                                args)
    assert {name: sum(isinstance(m.__dict__.get("forward"), ReplacedForward) for m in model.modules()
                      if type(m).__name__ == name) for name in compiled} == compiled
    assert fused_modules(model) == {"compiled": sum(compiled.values())}
    assert (f"--sparse_fused_ops compile: {left} of {type(model).__name__} left to eager PyTorch" in caplog.text
            if left else "left to eager PyTorch" not in caplog.text)
    disable_sparse_attention(model)
    assert fused_modules(model) == {}
