"""--sparse_fused_ops compile through the stock-shaped Trainer script: the MLPs and RMSNorms run through
torch.compile (inductor, on the CPU here), inside the token tiles, and the run's losses and weights (SGD, so that they
move by the gradients themselves) are the unfused run's (fp32 rounding); the start-up line says what runs fused. So
are a stock --torch_compile run's (the Trainer compiles the whole model; the sparse attention calls are traced as the
plugin's custom ops, no graph break at them), alone and with the fused ops, token tiles and gradient checkpointing.
Under CP 2: tests/distributed/test_fused_ops_cp.py."""

import copy
import warnings

import pytest
import torch
from torch._dynamo.utils import counters
from transformers import AutoModelForCausalLM, HfArgumentParser

import hf_sparse_cp
from hf_sparse_cp import SparseTrainer, SparseTrainingArguments
from hf_sparse_cp.integration.compiled import TORCH_TRACES_THE_OPS
from hf_sparse_cp.integration.fused_ops import enable_fused_ops, fused_modules
from hf_sparse_cp.testing.tiny_models import tiny_config

FLAGS = ["--max_steps", "2", "--per_device_train_batch_size", "1", "--learning_rate", "0.5", "--logging_steps", "1",
         "--report_to", "none", "--use_cpu", "--save_strategy", "no", "--optim", "sgd", "--train_sampling_strategy",
         "sequential", "--seed", "0", "--sparse_block_size", "32", "--sparse_min_seq_len", "128",
         "--sparse_vertical_topk", "8", "--sparse_slash_topk", "8", "--sparse_local_window", "32",
         "--sparse_sink_tokens", "4", "--sparse_last_q", "16", "--sparse_dense_first_layers", "0"]


@pytest.fixture(autouse=True)
def _fresh_compiles():
    """Each test compiles afresh in this process (inductor's disk cache still serves it): nothing an earlier test of
    this pytest process left in inductor's in-process caches (a build refused by the unit tier's one-process guard,
    held as a failed job) is handed to it."""
    import torch._inductor.utils

    torch._inductor.utils.clear_inductor_caches()
    torch._dynamo.reset()


def _train(out, *flags):
    (args,) = HfArgumentParser(SparseTrainingArguments).parse_args_into_dataclasses(
        ["--output_dir", str(out), *FLAGS, *flags])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama"))
    ids = torch.randint(3, 259, (2, 256), generator=torch.Generator().manual_seed(0))
    trainer = SparseTrainer(model=model, args=args, train_dataset=[{"input_ids": r, "labels": r} for r in ids])
    trainer.train()
    return trainer


@pytest.fixture(scope="module")
def stock(tmp_path_factory):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _train(tmp_path_factory.mktemp("off"), "--sparse_fused_ops", "off")
    finally:
        torch.set_num_threads(threads)


def _assert_trained_alike(run, stock):
    losses = [[log["loss"] for log in t.state.log_history if "loss" in log] for t in (run, stock)]
    assert losses[0] == pytest.approx(losses[1], rel=1e-5) and len(losses[0]) == 2
    for (name, p), q in zip(run.model.named_parameters(), stock.model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6, msg=name)


def test_compiled_mlps_and_norms_train_like_the_unfused_step(tmp_path, caplog, single_thread, stock):
    with caplog.at_level("WARNING"):
        fused = _train(tmp_path / "compile", "--sparse_fused_ops", "compile", "--sparse_token_tiling_min_length", "128",
                       "--sparse_token_tile_size", "96")
    layers = fused.model.config.num_hidden_layers
    assert fused_modules(fused.model) == {"compiled": 3 * layers + 1} and fused_modules(stock.model) == {}
    assert f"fused ops: torch.compile on {3 * layers + 1} MLP / RMSNorm modules" in caplog.text
    _assert_trained_alike(fused, stock)


@pytest.mark.parametrize("flags", [
    (),
    ("--sparse_fused_ops", "compile", "--sparse_token_tiling_min_length", "128", "--sparse_token_tile_size", "96",
     "--gradient_checkpointing", "true"),
], ids=["alone", "fused_tiled_checkpointed"])
def test_torch_compile_trains_like_the_uncompiled_step(tmp_path, single_thread, stock, flags):
    torch._dynamo.reset()
    counters.clear()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            run = _train(tmp_path, "--torch_compile", "true", *flags)
    finally:
        torch._dynamo.reset()
    # (the fused ops' compiled forwards run plainly inside the compiled model: dynamo traced through their cached
    # compile function, warning of "potential silent incorrectness")
    assert not [str(w.message) for w in caught if "lru_cache" in str(w.message)]
    if TORCH_TRACES_THE_OPS:  # (no break at an attention call; an older torch keeps the calls outside the graphs)
        assert not [reason for reason in counters["graph_break"] if "torch.compiler.disable" in reason]
    assert isinstance(run.model_wrapped, torch._dynamo.eval_frame.OptimizedModule)  # the Trainer compiled it
    assert run.model.is_gradient_checkpointing == ("--gradient_checkpointing" in flags)
    kept = [log["sparse/kept_fraction"] for log in run.state.log_history if "loss" in log]
    assert kept == pytest.approx([log["sparse/kept_fraction"] for log in stock.state.log_history if "loss" in log])
    assert kept[0] < 1  # (the sparse path ran, inside the compiled graphs)
    _assert_trained_alike(run, stock)


@pytest.mark.parametrize("model_type", ["gemma3_text", "phi3", "cohere", "mixtral", "glm4"])
def test_another_architectures_compiled_norms_and_mlps_give_the_unfused_numbers(model_type, single_thread):
    """Gemma 3's (1 + weight) RMSNorm and GeGLU tanh, Phi-3's fused gate_up, Cohere's LayerNorm, Mixtral's norms (its
    experts left eager): the compiled model's logits, loss and gradients are the unfused one's (fp32 rounding)."""
    hf_sparse_cp.patch()
    torch.manual_seed(0)
    stock = AutoModelForCausalLM.from_config(tiny_config(model_type, vocab_size=97, num_hidden_layers=2))
    model = copy.deepcopy(stock)
    enable_fused_ops(model, "compile")
    assert fused_modules(model)["compiled"] >= 5
    ids = torch.randint(0, 97, (2, 48), generator=torch.Generator().manual_seed(0))
    outputs = []
    for m in (model, stock):
        out = m(input_ids=ids, labels=ids)
        out.loss.backward()
        outputs.append((out.logits, out.loss, [p.grad for p in m.parameters()]))
    (logits, loss, grads), (stock_logits, stock_loss, stock_grads) = outputs
    torch.testing.assert_close(logits, stock_logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loss, stock_loss, rtol=1e-6, atol=0)
    for grad, stock_grad in zip(grads, stock_grads, strict=True):
        torch.testing.assert_close(grad, stock_grad, rtol=1e-4, atol=1e-6)
