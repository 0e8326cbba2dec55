"""Every change the plugin makes to transformers, a model, a Trainer or the user's TrainingArguments
is recorded and undone by the matching disable call, leaving what others changed after us; and the
attention backend's hot path parses no config and reads no layout back from the device."""

import torch
from transformers import AttentionInterface, AutoModelForCausalLM, Trainer, TrainingArguments

import hf_sparse_cp
from hf_sparse_cp import (
    SparseAttentionConfig,
    SparseCPArguments,
    SparsityLoggingCallback,
    attach_to_trainer,
    checkpointing_enabled,
    detach_from_trainer,
    disable_sparse_attention,
    enable_sparse_attention,
    is_lean_loss_enabled,
)
from hf_sparse_cp.attention.layout import SparseLayout
from hf_sparse_cp.integration import patching, upstream
from hf_sparse_cp.integration.patching import PatchSet
from hf_sparse_cp.testing.tiny_models import tiny_config


class Owner:
    value = "class"


def test_patch_set_restores_only_what_is_still_ours(monkeypatch):
    monkeypatch.setattr(patching, "replacement_for", lambda owner, name: None)  # any change listed
    obj = Owner()
    obj.items = ["a"]
    env = {"KEPT": "theirs"}
    patches = PatchSet()
    patches.set_attr(obj, "value", "ours")
    patches.set_attr(Owner, "other", "ours")
    patches.insert(obj, "items", 0, "ours")
    patches.set_item(env, "NEW", "ours")
    patches.set_item(env, "KEPT", "ours")
    assert obj.value == "ours" and Owner.other == "ours" and obj.items == ["ours", "a"]
    assert env == {"KEPT": "ours", "NEW": "ours"}
    Owner.other = "theirs"  # replaced after us
    env["NEW"] = "theirs"
    patches.undo()
    assert obj.value == "class" and "value" not in obj.__dict__  # the instance attribute is gone again
    assert Owner.other == "theirs" and obj.items == ["a"]
    assert env == {"KEPT": "theirs", "NEW": "theirs"}
    del Owner.other


def _args(tmp_path, **kw):
    return TrainingArguments(output_dir=str(tmp_path), report_to="none", save_strategy="no", use_cpu=True, **kw)


def test_enable_and_disable_sparse_attention_round_trip(tmp_path):
    assert not hf_sparse_cp.is_patched() and not is_lean_loss_enabled()
    model = AutoModelForCausalLM.from_config(tiny_config("llama"), attn_implementation="sdpa")
    training = _args(tmp_path)
    hooks, decoder_hooks = dict(model._forward_pre_hooks), dict(model.model._forward_pre_hooks)
    sparse = SparseCPArguments(sparse_attention=True, sparse_gradient_checkpointing_min_length=1024)
    enable_sparse_attention(model, sparse, SparseAttentionConfig(slash_topk=7), training, max_length=4096)
    assert hf_sparse_cp.is_patched() and is_lean_loss_enabled()
    assert upstream.attn_implementation(model.config) == "sparse_cp"
    assert model.config.sparse_attention["budget"]["slash_topk"] == 7
    assert checkpointing_enabled(training)
    enable_sparse_attention(model, sparse, SparseAttentionConfig(slash_topk=9), training, max_length=4096)  # replaces
    assert model.config.sparse_attention["budget"]["slash_topk"] == 9
    assert len(model._forward_pre_hooks) == len(hooks) + 1  # the guard that names patch() after unpatch()
    assert len(model.model._forward_pre_hooks) == len(decoder_hooks) + 1  # position_ids on to attention
    disable_sparse_attention(model)
    assert model._forward_pre_hooks == hooks and model.model._forward_pre_hooks == decoder_hooks
    assert not hf_sparse_cp.is_patched() and not is_lean_loss_enabled()
    assert upstream.attn_implementation(model.config) == "sdpa" and not hasattr(model.config, "sparse_attention")
    assert not checkpointing_enabled(training)
    disable_sparse_attention(model)  # a no-op once disabled


def test_disable_keeps_registrations_it_did_not_make(tmp_path):
    hf_sparse_cp.patch()
    model = AutoModelForCausalLM.from_config(tiny_config("llama"))
    enable_sparse_attention(model, SparseCPArguments(sparse_attention=True, sparse_fused_loss=False))
    disable_sparse_attention(model)
    assert hf_sparse_cp.is_patched()  # the user patched before: still patched
    hf_sparse_cp.unpatch()


def test_unpatch_leaves_a_registration_made_after_ours():
    def theirs(*args, **kwargs):
        raise AssertionError("not called")

    hf_sparse_cp.patch()
    AttentionInterface.register("sparse_cp", theirs)
    try:
        hf_sparse_cp.unpatch()
        assert AttentionInterface()["sparse_cp"] is theirs
    finally:
        upstream.unregister(AttentionInterface, "sparse_cp")


def test_attach_and_detach_round_trip(tmp_path):
    model = AutoModelForCausalLM.from_config(tiny_config("llama"))
    trainer = Trainer(model=model, args=_args(tmp_path))
    before = list(trainer.callback_handler.callbacks)
    attach_to_trainer(trainer, SparseCPArguments(sparse_attention=True))
    assert isinstance(trainer.callback_handler.callbacks[0], SparsityLoggingCallback)
    detach_from_trainer(trainer)
    assert trainer.callback_handler.callbacks == before


def test_the_backend_hot_path_parses_the_config_once_and_validates_no_layout(monkeypatch):
    """Layer configs are parsed once per layer when the settings are stored (`configure`: a compiled model's trace
    then reads them), never per call, and the layouts the backend builds are not read back from the device to be
    checked."""
    hf_sparse_cp.patch()
    model = AutoModelForCausalLM.from_config(tiny_config("qwen2"))
    parsed = []
    from_dict = SparseAttentionConfig.from_dict.__func__
    monkeypatch.setattr(SparseAttentionConfig, "from_dict",
                        classmethod(lambda cls, data: parsed.append(1) or from_dict(cls, data)))
    hf_sparse_cp.configure(model, SparseAttentionConfig(block_size=16, min_seq_len=64, vertical_topk=4,
                                                        slash_topk=4, local_window=16))
    at_configure = len(parsed)
    assert at_configure >= model.config.num_hidden_layers

    def refuse(*args, **kwargs):
        raise AssertionError("the backend read a layout back from the device to validate it")

    monkeypatch.setattr(SparseLayout, "validate", refuse)
    ids = torch.randint(3, 259, (1, 128))
    for _ in range(3):
        model(ids, labels=ids).loss.backward()
    assert len(parsed) == at_configure  # (none per call)
    hf_sparse_cp.configure(model, SparseAttentionConfig(block_size=16))  # new settings: parsed again, once
    again = len(parsed)
    assert again >= at_configure + model.config.num_hidden_layers
    model(ids)
    assert len(parsed) == again


def _plugin_state(model) -> dict:
    return {(name, key) for name, module in model.named_modules() for key in module.__dict__
            if key.startswith("_hf_sparse_cp")}


def test_disable_leaves_the_modules_without_what_the_backend_kept_on_them(tmp_path):
    """The backend keeps on the attention modules each layer's parsed config and its kept fractions until a log reads
    them, and on a model under CP the forward's shard: none stays after the undo (before: every attention module kept
    `_hf_sparse_cp_layer_config` and the unread `_hf_sparse_cp_kept*`, the model an empty
    `_hf_sparse_cp_cp_forward`)."""
    from hf_sparse_cp.integration.call_context import guard_context_parallel

    model = AutoModelForCausalLM.from_config(tiny_config("llama"))
    assert not _plugin_state(model)
    pattern = SparseAttentionConfig(block_size=16, min_seq_len=32, vertical_topk=2, slash_topk=2, local_window=16)
    enable_sparse_attention(model, SparseCPArguments(sparse_attention=True, sparse_fused_loss=False), pattern)
    ids = torch.randint(3, 259, (1, 96))
    model.train()
    model(ids)
    model.eval()
    model(ids)
    kept = {key for _, key in _plugin_state(model)}
    assert {"_hf_sparse_cp_layer_config", "_hf_sparse_cp_kept", "_hf_sparse_cp_kept_eval"} <= kept
    disable_sparse_attention(model)
    assert not _plugin_state(model)

    class Forward(torch.nn.Module):  # (a forward under CP: its shard in the keyword arguments)
        def forward(self, x, **kwargs):
            return x

    guarded = Forward()
    handles = guard_context_parallel(guarded)
    guarded(ids, cp_shard=object())
    for handle in handles:
        handle.remove()
    assert not _plugin_state(guarded)
