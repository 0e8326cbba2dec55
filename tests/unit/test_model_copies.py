"""Copies of a model the plugin changed (`pickle`, `torch.save`, `copy.deepcopy`; issue #41 item 4).

A configured or enabled model pickles and deep-copies. The copy holds the sparse settings and the backend
selection (its config), the registration guard, and the memory savers bound to its own modules;
`disable_sparse_attention(copy)` restores the copy, while the process-wide registrations stay the
original's to undo."""

import copy
import io
import pickle

import pytest
import torch
from transformers import AutoModelForCausalLM, TrainingArguments

import hf_sparse_cp
from hf_sparse_cp import SparseAttentionConfig, SparseCPArguments
from hf_sparse_cp.integration import upstream
from hf_sparse_cp.integration.lean_loss import is_lean_loss_enabled
from hf_sparse_cp.testing.tiny_models import tiny_config
from hf_sparse_cp.trainer.attach import disable_sparse_attention, enable_sparse_attention

PATTERN = SparseAttentionConfig(block_size=16, min_seq_len=64, dense_first_layers=0, vertical_topk=4, slash_topk=4,
                                sink_tokens=2, local_window=16, last_q=8)
SAVERS = SparseCPArguments(sparse_gradient_checkpointing_min_length=64, sparse_token_tiling_min_length=32,
                           sparse_token_tile_size=24,
                           sparse_offload_layer_inputs=True)


def _torch_save_load(model):
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


COPIES = {"pickle": lambda m: pickle.loads(pickle.dumps(m)), "torch_save": _torch_save_load,
          "deepcopy": copy.deepcopy}


def _model():
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config("llama"))


def _ids(seq=96):
    return torch.randint(3, 259, (1, seq), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("how", COPIES)
def test_a_configured_model_copies_with_its_settings_and_its_guard(how):
    hf_sparse_cp.patch()
    model = _model()
    hf_sparse_cp.configure(model, PATTERN)
    ids = _ids()
    with torch.no_grad():
        want = model(ids).logits
    clone = COPIES[how](model)
    assert clone.config._attn_implementation == "sparse_cp"
    assert SparseAttentionConfig.from_dict(clone.config.sparse_attention) == PATTERN
    with torch.no_grad():
        torch.testing.assert_close(clone(ids).logits, want, rtol=1e-6, atol=1e-6)
    hf_sparse_cp.unpatch()  # the copy keeps the guard: a forward names the fix, not transformers' KeyError
    with pytest.raises(RuntimeError, match=r"not registered with transformers in this process.*hf_sparse_cp.patch"):
        clone(ids)


def _perturb_mlps(model) -> None:
    with torch.no_grad():
        for layer in model.model.layers:
            for p in layer.mlp.parameters():
                p.mul_(1.5)


@pytest.mark.parametrize("how", COPIES)
def test_copies_with_memory_savers_run_their_own_weights_and_undo_on_themselves(how):
    """The savers' replaced forwards were closures over the original modules: a deep copy ran the
    original's MLP weights, silently, and pickle refused the model."""
    model = _model()
    training_args = TrainingArguments(output_dir="unused", report_to="none", use_cpu=True)
    enable_sparse_attention(model, SAVERS, PATTERN, training_args, max_length=96)
    getattr(model, upstream.checkpointing_method())()  # (offload keeps the inputs that checkpointing saves)
    # transformers' hook that makes the embeddings' output require grad is a local function, which pickle refuses;
    # with every weight trained, that output requires grad anyway
    model.disable_input_require_grads()
    ids = _ids()
    clone = COPIES[how](model)
    for layer, original in zip(clone.model.layers, model.model.layers):  # the savers are on the copy's modules
        assert layer.mlp.forward.module is layer.mlp and layer.forward.module is layer
        assert original.mlp.forward.module is original.mlp

    def loss_and_grads(m):
        m.train()
        loss = m(ids, labels=ids).loss
        return loss, torch.autograd.grad(loss, [p for p in m.parameters() if p.requires_grad])

    want_loss, want_grads = loss_and_grads(model)  # offload and tiles in a training step of the copy
    got_loss, got_grads = loss_and_grads(clone)
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-6, atol=1e-6)
    for got, want in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)

    _perturb_mlps(clone)  # the copy computes with its own weights, the original with its own
    reference = _model()
    hf_sparse_cp.configure(reference, PATTERN)
    reference.load_state_dict(clone.state_dict())
    for m in (model, clone, reference):
        m.eval()
    with torch.no_grad():
        torch.testing.assert_close(clone(ids).logits, reference(ids).logits, rtol=1e-5, atol=1e-5)
        assert (clone(ids).logits - model(ids).logits).abs().max() > 1e-2

    disable_sparse_attention(clone)  # restores the copy: its forwards and attention implementation
    assert all("forward" not in m.__dict__ for m in clone.modules())
    assert clone.config._attn_implementation != "sparse_cp" and getattr(clone.config, "sparse_attention", None) is None
    assert hf_sparse_cp.is_patched() and is_lean_loss_enabled()  # the original's registrations stay
    assert model.config._attn_implementation == "sparse_cp" and training_args.gradient_checkpointing
    disable_sparse_attention(model)
    assert not hf_sparse_cp.is_patched() and not is_lean_loss_enabled()
    assert all("forward" not in m.__dict__ for m in model.modules())
