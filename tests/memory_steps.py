"""The measured training step the memory model's step tests compare against (test_memory_model, test_memory_lora,
test_memory_moe)."""

import torch

from hf_sparse_cp.testing.tiny_models import tiny_config

STEP_TOKENS = 1024


def step_config(layers: int):
    """The tiny Qwen2 of the step tests: wide MLP, one KV head, so the activations dominate the weights."""
    return tiny_config("qwen2", num_hidden_layers=layers, hidden_size=128, intermediate_size=2048,
                       num_attention_heads=2, num_key_value_heads=1, vocab_size=256)


def recorded_step_peak(build_model) -> int:
    """Bytes at the peak of one step (forward, lean loss, backward) on `STEP_TOKENS` random tokens of the model
    `build_model()` returns (built with the lean loss on, as training builds it), the weights apart: measured by the
    allocation recorder on this CPU."""
    from hf_sparse_cp.integration.lean_loss import disable_lean_loss, enable_lean_loss, is_lean_loss_enabled
    from hf_sparse_cp.testing.allocations import AllocationRecorder

    enabled = not is_lean_loss_enabled()
    enable_lean_loss()
    try:
        model = build_model()
        ids = torch.randint(0, model.config.vocab_size, (1, STEP_TOKENS))
        recorder = AllocationRecorder(with_sites=False)
        with recorder:
            model(input_ids=ids, labels=ids).loss.backward()
    finally:
        if enabled:
            disable_lean_loss()
    return recorder.peak_bytes


def unchecked_step_peak(config, pattern) -> tuple[int, float]:
    """(measured, predicted) bytes at the peak of a bf16 step (forward, loss, backward) without gradient checkpointing
    of a `sparse_cp` model of `config` on `pattern`, the weights apart."""
    from transformers import AutoModelForCausalLM

    import hf_sparse_cp
    from hf_sparse_cp.simulator.memory_model.architecture import Architecture
    from hf_sparse_cp.simulator.memory_model.settings import StepSettings
    from hf_sparse_cp.simulator.memory_model.step import predict_step_memory

    def build():
        hf_sparse_cp.patch()
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sparse_cp", dtype=torch.bfloat16)
        hf_sparse_cp.configure(model, pattern)
        return model.train()

    measured = recorded_step_peak(build)
    est = predict_step_memory(Architecture.from_config(config), STEP_TOKENS, StepSettings(
        device="cpu", pattern=pattern, gradient_checkpointing=False, optimizer="none"))
    return measured, est.peak_bytes - est.terms("optimizer")["weights"]
