"""The memory savers: token tiles (`tiled_rows`) and host offload of the saved layer inputs
(`HostOffload`) give the untiled step's loss and gradients (fp32 rounding), and
`enable_memory_savers` / `disable_memory_savers` replace and restore exactly the modules' forwards."""

import gc
import re
import weakref

import pytest
import torch
from torch.utils.checkpoint import checkpoint
from transformers import AutoModelForCausalLM, TrainingArguments

import hf_sparse_cp
from hf_sparse_cp import SparseAttentionConfig, SparseCPArguments, configure
from hf_sparse_cp.integration import upstream
from hf_sparse_cp.integration.architectures import rowwise_classes
from hf_sparse_cp.integration.memory_savers import (
    disable_memory_savers,
    enable_memory_savers,
    rowwise_modules,
)
from hf_sparse_cp.memory import MemorySavers
from hf_sparse_cp.memory.offload import HostOffload
from hf_sparse_cp.memory.tiling import tiled_rows
from hf_sparse_cp.testing.tiny_models import tiny_config
from hf_sparse_cp.trainer.attach import disable_sparse_attention, enable_sparse_attention

PATTERN = SparseAttentionConfig(block_size=16, min_seq_len=64, dense_first_layers=0, vertical_topk=8, slash_topk=4,
                                sink_tokens=4, local_window=16, last_q=8)


class SwiGLU(torch.nn.Module):
    def __init__(self, h: int, i: int) -> None:
        super().__init__()
        self.gate, self.up, self.down = torch.nn.Linear(h, i), torch.nn.Linear(h, i), torch.nn.Linear(i, h)

    def forward(self, x):
        return self.down(torch.nn.functional.silu(self.gate(x)) * self.up(x))


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)], ids=["fp64", "fp32"])
@pytest.mark.parametrize("rows, tile", [(37, 10), (37, 37), (37, 64), (1, 1)], ids=lambda v: str(v))
def test_tiled_rows_give_the_untiled_output_and_gradients(dtype, tol, rows, tile):
    torch.manual_seed(0)
    mlp = SwiGLU(24, 56).to(dtype)
    x = torch.randn(3, rows, 24, dtype=dtype, requires_grad=True)
    params = list(mlp.parameters())
    ref = mlp(x)
    g = torch.randn_like(ref)
    ref_grads = torch.autograd.grad(ref, [x, *params], g)
    out = tiled_rows(mlp.forward, x, params, tile)
    grads = torch.autograd.grad(out, [x, *params], g)
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)


def test_tiled_rows_recompute_under_the_forward_autocast():
    torch.manual_seed(0)
    mlp = SwiGLU(32, 64)
    x = torch.randn(50, 32, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = mlp(x)
        out = tiled_rows(mlp.forward, x, list(mlp.parameters()), 16)
    assert out.dtype == ref.dtype == torch.bfloat16
    g = torch.randn_like(ref)
    ref_grads = torch.autograd.grad(ref, [x, mlp.up.weight], g)
    grads = torch.autograd.grad(out, [x, mlp.up.weight], g)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)  # bf16 products, summed in another order


def test_tiled_rows_refuse_an_empty_tile():
    with pytest.raises(ValueError, match="tile_tokens=0"):
        tiled_rows(torch.nn.Identity(), torch.randn(4, 2, requires_grad=True), [], 0)


def test_offloaded_checkpoint_inputs_are_released_and_read_back_exactly():
    torch.manual_seed(0)
    layer = SwiGLU(16, 32)
    leaf = torch.randn(20, 16, requires_grad=True)

    def run(offload: HostOffload | None):
        x = leaf * 2.0
        alive = weakref.ref(x)
        if offload is None:
            y = checkpoint(layer, x, use_reentrant=False)
        else:
            with offload:
                y = checkpoint(layer, x, use_reentrant=False)
        del x
        gc.collect()
        held = alive() is not None
        y.sum().backward()
        grads = [leaf.grad.clone(), *(p.grad.clone() for p in layer.parameters())]
        leaf.grad = None
        layer.zero_grad(set_to_none=True)
        return held, grads

    held, ref = run(None)
    assert held  # the checkpoint keeps its input
    held, grads = run(HostOffload(copy_host_tensors=True))
    assert not held  # the offloaded copy is what backward reads; the original is gone
    for a, b in zip(grads, ref):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def _model(seed: int = 0):
    hf_sparse_cp.patch()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config("qwen2"), attn_implementation="sparse_cp",
                                             dtype=torch.float32)
    configure(model, PATTERN)
    getattr(model, upstream.checkpointing_method())({"use_reentrant": False})
    return model.train()


def _step(model, ids):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_a_training_step_with_tiles_and_offload_equals_the_stock_one():
    hf_sparse_cp.enable_lean_loss()
    try:
        model = _model()
        ids = torch.randint(0, 259, (1, 96), generator=torch.Generator().manual_seed(1))
        loss, grads = _step(model, ids)
        enable_memory_savers(model, MemorySavers(tiled=True, tile_tokens=24, offload_layer_inputs=True))
        tiled_loss, tiled_grads = _step(model, ids)
        disable_memory_savers(model)
    finally:
        hf_sparse_cp.disable_lean_loss()
    torch.testing.assert_close(tiled_loss, loss, rtol=1e-6, atol=1e-6)
    for name, g in grads.items():
        torch.testing.assert_close(tiled_grads[name], g, rtol=1e-5, atol=1e-6, msg=name)


def test_enable_replaces_exactly_the_rowwise_forwards_and_disable_restores_them():
    model = _model()
    # (besides the attention modules' own, where set-up skips the Hub kernels package's routing: `kernel_routing`)
    configured = {n for n, m in model.named_modules() if "forward" in m.__dict__}
    patched = lambda: sorted(n for n, m in model.named_modules() if "forward" in m.__dict__ and n not in configured)  # noqa: E731
    assert patched() == [] and all(n.endswith("self_attn") for n in configured)
    enable_memory_savers(model, MemorySavers(tiled=True, offload_layer_inputs=True))
    names = [f"model.layers.{i}.{m}" for i in range(2) for m in ("input_layernorm", "mlp", "post_attention_layernorm")]
    assert patched() == sorted([*names, "model.layers.0", "model.layers.1", "model.norm"])
    assert {type(m).__name__ for _, m in rowwise_modules(model)} <= set(rowwise_classes())
    with pytest.raises(ValueError, match="already enabled"):
        enable_memory_savers(model, MemorySavers(tiled=True))
    assert disable_memory_savers(model)
    assert patched() == []
    assert not disable_memory_savers(model)


def test_tiles_refuse_a_module_not_known_to_be_rowwise():
    model = _model()
    model.model.layers[1].mlp = torch.nn.Identity()
    with pytest.raises(ValueError, match=r"model.layers.1.mlp is a Identity, not known to treat every token"):
        enable_memory_savers(model, MemorySavers(tiled=True))
    assert "_hf_sparse_cp_memory_savers" not in model.__dict__


def test_offload_without_gradient_checkpointing_is_refused_naming_this_releases_method():
    """The refusal named model.activation_checkpointing_enable(), which transformers has only from 5.23."""
    model = _model()
    getattr(model, upstream.checkpointing_method("disable"))()
    enable_memory_savers(model, MemorySavers(offload_layer_inputs=True))
    ids = torch.randint(0, 259, (1, 32))
    with pytest.raises(ValueError, match=r"turn gradient checkpointing on .*model\.(\w+)\(\)") as refused:
        model(input_ids=ids, labels=ids)
    getattr(model, re.search(r"model\.(\w+)\(\)", str(refused.value)).group(1))()
    model(input_ids=ids, labels=ids)  # (the named method turned it on)


def test_enable_sparse_attention_tiles_from_the_threshold_and_its_undo_restores(tmp_path):
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[])
    model = _model()
    enable_sparse_attention(model, SparseCPArguments(sparse_attention=True, sparse_token_tiling_min_length=4096),
                            PATTERN, args, max_length=2048)
    assert "forward" not in model.model.layers[0].mlp.__dict__  # below the threshold
    enable_sparse_attention(model, SparseCPArguments(sparse_attention=True, sparse_token_tiling_min_length=4096,
                                                     sparse_offload_layer_inputs=True), PATTERN, args, max_length=4096)
    assert "forward" in model.model.layers[0].mlp.__dict__ and "forward" in model.model.layers[0].__dict__
    disable_sparse_attention(model)
    assert "forward" not in model.model.layers[0].mlp.__dict__ and "forward" not in model.model.layers[0].__dict__


@pytest.mark.parametrize("bad, message", [
    (dict(sparse_token_tiling_min_length=-1), "must be >= 0"),
    # (it was taken, and turned gradient checkpointing on at any length)
    (dict(sparse_gradient_checkpointing_min_length=-1),
     r"--sparse_gradient_checkpointing_min_length -1 must be >= 0 \(0: never .*--gradient_checkpointing"),
    (dict(sparse_token_tile_size=0), r"tile_tokens=0 \(--sparse_token_tile_size")])
def test_bad_saver_flags_are_refused(bad, message):
    with pytest.raises(ValueError, match=message):
        SparseCPArguments(**bad)
