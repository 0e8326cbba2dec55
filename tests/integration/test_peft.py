"""PEFT (LoRA) with the plugin: sparse attention, context parallelism and the lean loss keep working on a
LoRA model, and SMET refuses a LoRA model (its target weights are frozen) and never masks an adapter."""

from __future__ import annotations

import os
import tempfile
import time

import pytest
import torch
from peft import (
    AdaLoraConfig,
    AdaptionPromptConfig,
    IA3Config,
    LoHaConfig,
    LoKrConfig,
    LoraConfig,
    MultitaskPromptTuningConfig,
    PeftModel,
    PrefixTuningConfig,
    PromptEncoderConfig,
    PromptTuningConfig,
    ShadowConfig,
    VeraConfig,
    get_peft_model,
)
from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments, default_data_collator

import hf_sparse_cp
from hf_sparse_cp import (
    ContextParallelConfig,
    SparseAttentionConfig,
    SparseCPArguments,
    attach_to_trainer,
    install_smet,
)
from hf_sparse_cp.integration.lean_loss import disable_lean_loss, enable_lean_loss
from hf_sparse_cp.integration.models import check_model_supports_context_parallel
from hf_sparse_cp.integration.stats import pop_kept_fractions
from hf_sparse_cp.smet import SMETConfig, create_smet_optimizer
from hf_sparse_cp.smet.masks import active_mask
from hf_sparse_cp.testing.spawn import run_gloo_each
from hf_sparse_cp.testing.tiny_models import tiny_config

from oracle import rel_rms
from smet_common import TokenRows, markov_tokens

BS, SEQ, VOCAB = 16, 157, 64
# Sparse from 64 tokens on, so the 157-token rows take the estimated vertical-slash layouts.
PATTERN = SparseAttentionConfig(block_size=BS, min_seq_len=64, vertical_topk=8, slash_topk=8, sink_tokens=2,
                                local_window=4, last_q=16, dense_first_layers=0)

pytestmark = pytest.mark.usefixtures("single_thread")


def _base(model_type: str = "llama", dtype: torch.dtype = torch.float32, **overrides) -> torch.nn.Module:
    hf_sparse_cp.patch()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type, vocab_size=VOCAB, **overrides)).to(dtype)
    hf_sparse_cp.configure(model, PATTERN)
    return model


def _lora_config(**lora) -> LoraConfig:
    """LoRA on q_proj and v_proj, B nonzero (`init_lora_weights=False`: A gets a gradient too) unless `lora` says."""
    config = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, task_type="CAUSAL_LM",
                  init_lora_weights=False)
    return LoraConfig(**{**config, **lora})


def _lora(model: torch.nn.Module, **lora) -> torch.nn.Module:
    """`_lora_config` on `model`, B zero as peft initializes it unless `lora` says."""
    torch.manual_seed(1)
    return get_peft_model(model, _lora_config(**{"init_lora_weights": True, **lora}))


def _trainable(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def _rows(num: int) -> torch.Tensor:
    return markov_tokens(num, SEQ, vocab=VOCAB)


def _sparse(kept: dict[int, float]) -> bool:
    """Whether the layers ran the sparse path (mean kept fraction of attention blocks; dense keeps 1)."""
    return bool(kept) and sum(kept.values()) / len(kept) < 0.9


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_lora_trains_with_sparse_attention_and_only_lora_weights_change(model_type):
    model = _lora(_base(model_type))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainable = _trainable(model)
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    opt = torch.optim.AdamW(trainable.values(), lr=1e-2)
    ids = _rows(2)
    losses = []
    for _ in range(6):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.05, losses
    kept = pop_kept_fractions(model)
    assert _sparse(kept), kept
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert changed == set(trainable)


def test_the_context_parallel_check_probes_a_lora_model_quickly():
    """The check probes a PeftModel itself, not its base architecture on the meta device (an adapter may run attention
    layers of its own): one 8-token forward whose attention calls compute nothing, fast, and it still finds the
    layers the CP shard does not reach through the LoRA wrapper."""
    model = _lora(_base("qwen2"))
    start = time.perf_counter()
    check_model_supports_context_parallel(model)
    assert time.perf_counter() - start < 5.0
    stablelm = _lora(_base("stablelm"))
    with pytest.raises(ValueError, match="does not reach StableLmDecoderLayer"):
        check_model_supports_context_parallel(stablelm)
    stablelm.set_attn_implementation("sdpa")
    with pytest.raises(ValueError, match="attn_implementation='sdpa'"):
        check_model_supports_context_parallel(stablelm)


@pytest.mark.parametrize(
    ("lora", "lean"),
    [({}, True), ({"modules_to_save": ["lm_head"]}, False), ({"target_modules": ["q_proj", "lm_head"]}, False)],
    ids=["lora", "modules_to_save_lm_head", "lora_on_lm_head"],
)
def test_lean_loss_on_a_lora_model_takes_the_lean_path_only_with_a_plain_head(lora, lean):
    """The lean loss reads `lm_head.weight`: with the head wrapped by PEFT (a trained copy, or LoRA on it)
    that weight is not the head, so the stock path runs. Either way loss and gradients are stock's."""
    model = _lora(_base(dtype=torch.float64, tie_word_embeddings=False), init_lora_weights=False, **lora)
    ids = _rows(2)
    results = []
    for enabled in (True, False):
        (enable_lean_loss if enabled else disable_lean_loss)()
        try:
            out = model(input_ids=ids, labels=ids)
        finally:
            disable_lean_loss()
        results.append((out, torch.autograd.grad(out.loss, list(_trainable(model).values()))))
    (lean_out, lean_grads), (stock_out, stock_grads) = results
    assert (lean_out.logits is None) == lean and stock_out.logits is not None
    # stock casts the logits to fp32 for the loss; the lean path stays in fp64
    assert abs(lean_out.loss.item() - stock_out.loss.item()) <= 1e-6 * stock_out.loss.item()
    assert max(rel_rms(a, b) for a, b in zip(lean_grads, stock_grads)) <= 1e-5


def _lora_step_under_cp(rank: int, world: int, mode: str = "ring") -> dict:
    """A LoRA model's loss and LoRA gradients under CP (`mode`; fp64, stock and lean loss) against one process."""
    from hf_sparse_cp.distributed import (
        ParallelDims,
        global_mean_loss,
        global_num_items,
        prepare_context_parallel_inputs,
        rank_loss,
    )

    model = _lora(_base(dtype=torch.float64), init_lora_weights=False)
    params = list(_trainable(model).values())
    ids = _rows(1)
    labels = ids.clone()
    labels[:, :30] = -100
    ref = model(input_ids=ids, labels=labels)
    ref_grads = torch.autograd.grad(ref.loss, params)
    par = ParallelDims.from_config(ContextParallelConfig(cp_size=world, cp_mode=mode))
    errors = {}
    for lean in (False, True):
        if lean:
            enable_lean_loss()
        inputs = prepare_context_parallel_inputs({"input_ids": ids, "labels": labels}, par, block_size=BS)
        num_items = global_num_items(inputs["shift_labels"])
        loss_sum = model(**inputs, num_items_in_batch=1).loss  # this rank's sum of token losses
        grads = torch.autograd.grad(rank_loss(loss_sum, num_items, world), params)
        worst = 0.0
        for grad, ref_grad in zip(grads, ref_grads):
            grad = grad.clone()
            torch.distributed.all_reduce(grad)
            worst = max(worst, rel_rms(grad / world, ref_grad))  # what DDP averaging gives
        loss = global_mean_loss(loss_sum, num_items).item()
        errors["lean" if lean else "stock"] = {"loss": abs(loss - ref.loss.item()) / ref.loss.item(), "grads": worst}
    disable_lean_loss()
    kept = pop_kept_fractions(model)
    return {"errors": errors, "lora_params": len(params), "sparse": _sparse(kept),
            "grad_norm": float(torch.stack([g.norm() for g in ref_grads]).min())}


MODES = ("ring", "ulysses")


# Adapters other than plain LoRA, each through the Trainer under CP 2 in the modes listed ("document": the ring with
# --cp_sharding document, on packed rows) against one process.
_ADAPTERS = {
    "lora_embeddings": (lambda: _lora_config(target_modules=["q_proj", "v_proj", "embed_tokens"],
                                             modules_to_save=["lm_head"]), ("ulysses",)),
    "dora": (lambda: _lora_config(use_dora=True), ("ring",)),
    "rslora": (lambda: _lora_config(use_rslora=True), ("document",)),
    "ia3": (lambda: IA3Config(task_type="CAUSAL_LM", target_modules=["k_proj", "v_proj", "down_proj"],
                              feedforward_modules=["down_proj"], init_ia3_weights=False), ("ring",)),
    "loha": (lambda: LoHaConfig(task_type="CAUSAL_LM", r=4, alpha=8, target_modules=["q_proj", "v_proj"],
                                init_weights=False), ("ulysses",)),
    "lokr": (lambda: LoKrConfig(task_type="CAUSAL_LM", r=4, alpha=8, target_modules=["q_proj", "v_proj"],
                                init_weights=False), ("document",)),
    "vera": (lambda: VeraConfig(task_type="CAUSAL_LM", r=8, target_modules=["q_proj", "v_proj"], init_weights=False),
             ("ulysses",)),
    # (its adapted attention modules wrap the model's, and attend to its adaption prompts from every query)
    "adaption_prompt": (lambda: AdaptionPromptConfig(task_type="CAUSAL_LM", adapter_len=8, adapter_layers=2),
                        ("ring",)),
    # (its rank allocator masks ranks from the second step on: `_AllocateRanks`)
    "adalora": (lambda: AdaLoraConfig(task_type="CAUSAL_LM", init_r=6, target_r=2, tinit=0, tfinal=0, deltaT=1,
                                      total_step=3, target_modules=["q_proj", "v_proj"], lora_alpha=8),
                ("ring", "document")),
}

_SAVED = ("dora", "adalora")  # (saved by their CP ring runs: AdaLoRA's saved ranks are its allocator's)


@pytest.fixture(scope="module")
def under_cp2(tmp_path_factory):
    """{"step MODE" (`_lora_step_under_cp`) | "trainer MODE" (`_train_lora`) | "ADAPTER MODE" (`_train_adapter`):
    per-rank results} under CP 2, one spawned pair for all, and the one-process Trainer runs: "one" (LoRA),
    "one ADAPTER" and "one ADAPTER packed"; "saved": {ADAPTER: the folder its CP ring run saved it in}."""
    calls = {f"{kind} {mode}": (fn, (mode,)) for kind, fn in (("step", _lora_step_under_cp), ("trainer", _train_lora))
             for mode in MODES}
    saved = {name: str(tmp_path_factory.mktemp(name)) for name in _SAVED}
    calls.update({f"{name} {mode}": (_train_adapter, (mode, name, saved.get(name) if mode == "ring" else None))
                  for name, (_, modes) in _ADAPTERS.items() for mode in modes})
    one = {f"one {name}{' packed' * packed}": _train_adapter(None, 1, "document" if packed else "ring", name)
           for name, (_, modes) in _ADAPTERS.items() for packed in {mode == "document" for mode in modes}}
    return {**run_gloo_each(calls, 2, timeout_s=900), "one": _train_lora(), **one, "saved": saved}


@pytest.mark.parametrize("mode", MODES)
def test_lora_under_cp2_equals_one_process(under_cp2, mode):
    for r in under_cp2[f"step {mode}"]:
        assert r["lora_params"] == 8 and r["sparse"] and r["grad_norm"] > 0  # A and B of q, v in 2 layers
        for errs in r["errors"].values():
            # fp64 model; the stock loss casts the logits to fp32, hence fp32 rounding
            assert errs["loss"] <= 1e-6 and errs["grads"] <= 1e-6, r["errors"]


class _PackedRows(TokenRows):
    """Rows packing two documents (position_ids restart at 96)."""

    def __getitem__(self, i):
        row = super().__getitem__(i)
        row["position_ids"] = torch.cat([torch.arange(96), torch.arange(SEQ - 96)])
        row["labels"] = row["labels"].clone()
        row["labels"][96] = -100  # (what transformers' flattening collator does: no target across the boundary)
        return row


class _AllocateRanks(TrainerCallback):
    """AdaLoRA's rank allocation after each optimizer step, before the gradients are zeroed (as peft prescribes)."""

    def on_optimizer_step(self, args, state, control, model=None, **kwargs):
        while hasattr(model, "module"):  # (DDP)
            model = model.module
        model.base_model.update_and_allocate(state.global_step)


def _trainer_run(model: torch.nn.Module, world: int, mode: str, rows: torch.utils.data.Dataset,
                 save_to: str | None = None, **arguments) -> dict:
    """Train `model` through `enable_sparse_attention` and `attach_to_trainer` (CP `world` in `mode`: 'ring',
    'ulysses', or 'document': the ring with document sharding) with Trainer `arguments`, then save it in `save_to`
    (`trainer.save_model`) if given: the losses and the trained weights, before and after."""
    from hf_sparse_cp import disable_sparse_attention, enable_sparse_attention

    sparse = SparseCPArguments(sparse_attention=True)
    enable_sparse_attention(model, sparse, PATTERN)  # on the PeftModel: backend, pattern, lean loss
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    document = mode == "document" and world > 1  # (one process runs the rows of that mode unsharded)
    cp = ContextParallelConfig(cp_size=world, cp_mode="ring" if mode == "document" else mode,
                               cp_sharding="document" if document else "striped")
    callbacks = [_AllocateRanks()] if type(model.base_model).__name__ == "AdaLoraModel" else []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            args = TrainingArguments(output_dir=tmp, report_to="none", use_cpu=True, per_device_train_batch_size=1,
                                     logging_steps=1, save_strategy="no", train_sampling_strategy="sequential",
                                     weight_decay=0.0, **arguments)
            trainer = Trainer(model=model, args=args, train_dataset=rows, data_collator=default_data_collator,
                              callbacks=callbacks)
            parallel = attach_to_trainer(trainer, sparse, cp)
            trainer.train()
            if save_to is not None:
                trainer.save_model(save_to)
    finally:
        disable_sparse_attention(model)
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    changed = sorted(n for n, p in model.named_parameters() if not torch.equal(p, initial[n]))
    return {"cp": parallel.cp_size, "mode": parallel.mode.name, "losses": losses, "changed": changed,
            "kept": [log["sparse/kept_fraction"] for log in trainer.state.log_history if "loss" in log],
            "weights": {n: p.detach().clone() for n, p in model.named_parameters() if n in changed},
            "initial": {n: initial[n] for n in changed}}


def _launched(rank: int | None, world: int) -> None:
    if rank is not None:  # what torchrun sets: the Trainer and accelerate then see run_gloo's group
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))


def _train_lora(rank: int | None = None, world: int = 1, mode: str = "ring") -> dict:
    """Three Trainer steps (AdamW) of a LoRA model (CP `world` when run under `run_gloo`)."""
    _launched(rank, world)
    model = _lora(_base(dtype=torch.float64), init_lora_weights=False)
    return _trainer_run(model, world, mode, TokenRows(_rows(3)), max_steps=3, learning_rate=1e-2)


def _adapter_base() -> torch.nn.Module:
    return _base(dtype=torch.float64, tie_word_embeddings=False)


def _train_adapter(rank: int | None, world: int, mode: str, name: str, save_to: str | None = None) -> dict:
    """Two Trainer steps (SGD: the update is the gradient, which AdamW's normalization would blur) of the adapter
    `name` of `_ADAPTERS` on a model with untied embeddings; packed rows in the 'document' mode. With `save_to`: the
    adapter saved there, and the trained model's logits on `_probe()` with sdpa."""
    _launched(rank, world)
    base = _adapter_base()
    torch.manual_seed(1)
    model = get_peft_model(base, _ADAPTERS[name][0]())
    rows = (_PackedRows if mode == "document" else TokenRows)(_rows(2))
    run = _trainer_run(model, world, mode, rows, save_to, max_steps=2, learning_rate=0.5, optim="sgd")
    if save_to is not None:
        base.set_attn_implementation("sdpa")
        with torch.no_grad():
            run["logits"] = model(input_ids=_probe()).logits
    return run


def _probe() -> torch.Tensor:
    return markov_tokens(2, SEQ, seed=5, vocab=VOCAB)


@pytest.mark.parametrize("mode", MODES)
def test_lora_through_the_trainer_with_cp2_equals_one_process(under_cp2, mode):
    ref = under_cp2["one"]
    assert ref["cp"] == 1 and len(ref["losses"]) == 3 and ref["losses"][-1] < ref["losses"][0]
    assert ref["changed"] and all(".lora_A." in n or ".lora_B." in n for n in ref["changed"])
    assert max(ref["kept"]) < 0.9  # (the mean over layers)
    for run in under_cp2[f"trainer {mode}"]:
        assert (run["cp"], run["mode"]) == (2, mode) and run["changed"] == ref["changed"]
        for got, want in zip(run["losses"], ref["losses"]):
            assert abs(got - want) <= 1e-6 * want, (run["losses"], ref["losses"])
        assert run["kept"] == pytest.approx(ref["kept"], abs=1e-5)  # (logged rounded to 5 digits)
        for name, weight in run["weights"].items():
            assert rel_rms(weight, ref["weights"][name]) <= 1e-6, name


@pytest.mark.parametrize(("name", "mode"), [(n, m) for n, (_, modes) in _ADAPTERS.items() for m in modes])
def test_adapters_through_the_trainer_with_cp2_equal_one_process(under_cp2, name, mode):
    """DoRA, rsLoRA, IA3, LoHa, LoKr, VeRA, AdaLoRA, llama-adapter's adaption prompts, LoRA on the embeddings with a
    trained copy of the head: two
    steps under CP 2 give one process's losses and updates (fp64; the logged losses are fp32). AdaLoRA adds its
    orthogonal regularizer to the loss on every rank: the CP group counted it twice (the loss 22% above one
    process's, the updates 100% apart), now once (`trainer/adapter_loss.py`), its rank allocator masking the
    same ranks."""
    ref = under_cp2[f"one {name}{' packed' * (mode == 'document')}"]
    assert ref["cp"] == 1 and len(ref["losses"]) == 2 and ref["changed"]
    for run in under_cp2[f"{name} {mode}"]:
        assert run["cp"] == 2 and run["changed"] == ref["changed"]
        for got, want in zip(run["losses"], ref["losses"]):
            assert abs(got - want) <= 1e-6 * want, (run["losses"], ref["losses"])
        assert run["kept"] == pytest.approx(ref["kept"], abs=1e-5)
        assert max(run["kept"]) < (1.0 if mode == "document" else 0.95)  # sparse (a packed 61-token document is not)
        for n, weight in run["weights"].items():  # (the updates: the weights moved little)
            assert rel_rms(weight - run["initial"][n], ref["weights"][n] - ref["initial"][n]) <= 1e-6, n
    if name == "adalora":  # the allocator ran: ranks masked to 0 in the trained weights
        assert any(w.eq(0).any() for n, w in ref["weights"].items() if ".lora_E." in n)


@pytest.mark.parametrize("name", _SAVED)
def test_an_adapter_trained_under_cp2_loads_and_merges_without_the_plugin(under_cp2, name):
    """The adapter the Trainer saved under CP 2 loads onto a fresh model with sdpa (no plugin) and gives the trained
    model's logits; merged into the weights (`merge_and_unload`) it gives them too."""
    run = under_cp2[f"{name} ring"][0]
    base = _adapter_base()
    base.set_attn_implementation("sdpa")
    with torch.no_grad():
        plain = base(input_ids=_probe()).logits
        model = PeftModel.from_pretrained(base, under_cp2["saved"][name])
        loaded = model(input_ids=_probe()).logits
        merged = model.merge_and_unload()(input_ids=_probe()).logits
    assert rel_rms(run["logits"], plain) > 1e-9  # (the adapter changes them)
    assert rel_rms(loaded, run["logits"]) <= 1e-12 and rel_rms(merged, run["logits"]) <= 1e-12


@pytest.mark.parametrize("name", sorted(_ADAPTERS))
def test_adapters_with_every_block_kept_compute_what_sdpa_computes(name):
    """In one process, with a pattern that keeps every block, an adapter's loss and gradients are sdpa's."""
    base = _adapter_base()
    hf_sparse_cp.configure(base, SparseAttentionConfig(block_size=BS, min_seq_len=0, vertical_topk=10**4,
                                                       slash_topk=10**4, dense_first_layers=0))
    torch.manual_seed(1)
    model = get_peft_model(base, _ADAPTERS[name][0]())
    params = list(_trainable(model).values())
    ids = _rows(2)
    results = []
    for implementation in ("sparse_cp", "sdpa"):
        base.set_attn_implementation(implementation)
        loss = model(input_ids=ids, labels=ids).loss
        results.append((loss.item(), torch.autograd.grad(loss, params)))
    (loss, grads), (sdpa_loss, sdpa_grads) = results
    assert abs(loss - sdpa_loss) <= 1e-6 * sdpa_loss  # (the stock loss casts the logits to fp32)
    assert max(rel_rms(g, want) for g, want in zip(grads, sdpa_grads)) <= 1e-6
    assert any(g.abs().max() > 0 for g in sdpa_grads)


def test_an_adapter_with_attention_layers_of_its_own_is_refused_for_context_parallelism():
    """SHADOW runs a network of its own (decoder layers beside the base model's) on the model's inputs: the check
    probed the base architecture, which lacks it, and passed; under CP each rank would run that network on its own
    shard. A PEFT model is now probed itself, and refused, naming the adapter, the layer and the fix."""
    model = get_peft_model(_base(), ShadowConfig(task_type="CAUSAL_LM", r=4, shadow_dropout=0.0,
                                                 shadow_num_hidden_layers=1))
    with pytest.raises(ValueError, match=r"PEFT SHADOW model whose adapter runs attention layers of its own "
                                         r"\(base_model\.shadow_backbone\..*--cp_size 1"):
        check_model_supports_context_parallel(model)


# ---- SMET on a PEFT model ----


def test_smet_refuses_a_lora_model_whose_target_weights_are_frozen():
    model = _lora(_base())
    with pytest.raises(ValueError, match=r"only frozen weights \(.*q_proj\.base_layer\.weight.*LoRA") as refused:
        create_smet_optimizer(model, torch.optim.AdamW, SMETConfig())
    assert "Train either with SMET" in str(refused.value) and "or with LoRA" in str(refused.value)


def test_install_smet_refuses_a_lora_model_before_training(tmp_path):
    args = TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True)
    trainer = Trainer(model=_lora(_base()), args=args)
    with pytest.raises(ValueError, match="LoRA"):
        install_smet(trainer, SMETConfig())
    assert trainer.optimizer_cls_and_kwargs is None  # nothing installed


@pytest.mark.parametrize(
    ("targets", "lora"),
    [(["default"], {}), (["q_proj", "default"], {}), (["lm_head"], {"modules_to_save": ["lm_head"]})],
    ids=["lora_matrices", "lora_matrices_beside_a_base_target", "modules_to_save_copy"],
)
def test_smet_never_masks_adapter_weights(targets, lora):
    """Target names that reach LoRA's A/B (their modules are named after the adapter, `default`) or a
    module PEFT trains a copy of are refused, naming the weight and the fix."""
    model = _lora(_base(tie_word_embeddings=False), **lora)
    model.base_model.model.model.layers[0].mlp.requires_grad_(True)  # a trainable target beside them
    with pytest.raises(ValueError, match=r"reaches PEFT adapter weights .*(lora_A\.default|modules_to_save)"):
        create_smet_optimizer(model, torch.optim.AdamW, SMETConfig(target_modules=targets + ["down_proj"]))


def test_smet_with_lora_trains_the_base_weights_that_were_unfrozen_sparsely():
    """The combination that works: LoRA on attention, MLP weights unfrozen and fine-tuned by SMET's
    sparse updates. SMET's sparse set is exactly the unfrozen weights; LoRA's matrices are dense AdamW."""
    model = _lora(_base())
    for layer in model.base_model.model.model.layers:
        layer.mlp.requires_grad_(True)
    config = SMETConfig(mode="sparse_update", density=0.5, block_size=8)
    opt = create_smet_optimizer(model, torch.optim.AdamW, config, lr=1e-2)
    sparse = {n for g in opt.param_groups if g["smet"] for n in g["param_names"]}
    assert sparse == {n for n in _trainable(model) if ".mlp." in n}
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ids = _rows(2)
    for _ in range(2):
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    params = dict(model.named_parameters())
    for name, param in params.items():
        delta = (param.detach() - before[name]).ne(0)
        if name in sparse:  # only active blocks moved
            inactive = ~active_mask(opt.state[param]["block_index"], param.shape[1] // 8)
            assert delta.any() and not delta.view(param.shape[0], -1, 8)[inactive].any(), name
        elif param.requires_grad:  # LoRA: a dense update
            assert delta.float().mean() > 0.9, name
        else:
            assert not delta.any(), name


# ---- PEFT prompt learning (virtual tokens) under CP ----

_PROMPT_LEARNING = {
    "prompt_tuning": lambda: PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=8),
    "p_tuning": lambda: PromptEncoderConfig(task_type="CAUSAL_LM", num_virtual_tokens=8, encoder_hidden_size=32),
    "prefix_tuning": lambda: PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=8),
    "multitask_prompt_tuning": lambda: MultitaskPromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=8,
                                                                   num_tasks=2),
}


def _task_ids(kind: str, rows: int) -> dict:
    """The task of each row, which multitask prompt tuning's forward takes."""
    return {"task_ids": torch.arange(rows) % 2} if kind == "multitask_prompt_tuning" else {}


@pytest.mark.parametrize("kind", sorted(_PROMPT_LEARNING))
def test_a_prompt_learning_model_is_refused_for_context_parallelism_and_trains_in_one_process(kind):
    """Prompt tuning (multitask too), p-tuning and prefix tuning add virtual tokens to the tokens the model gets (each
    rank's shard under CP): the set-up check passed them, and the first forward failed deep in the ring ('this rank's
    shard has 80 tokens but q has 88', or 'decoding with a KV cache is not sharded'). Refused before training, naming
    the setting and the fix; in one process, with every block kept, a padded batch computes what sdpa does (left
    padding after prompt tuning's virtual tokens: padding between a row's tokens, which cut its document in two)."""
    base = _base(dtype=torch.float64)
    hf_sparse_cp.configure(base, SparseAttentionConfig(block_size=BS, min_seq_len=0, vertical_topk=10**4,
                                                       slash_topk=10**4, dense_first_layers=0))
    torch.manual_seed(1)
    model = get_peft_model(base, _PROMPT_LEARNING[kind]())
    with pytest.raises(ValueError, match=r"PEFT \w+ model: it adds 8 virtual tokens.*without context parallelism "
                                         r"\(--cp_size 1\)"):
        check_model_supports_context_parallel(model)
    ids = _rows(2)
    mask = torch.ones_like(ids)
    mask[0, -30:] = 0
    mask[1, :40] = 0  # left padding: between the virtual tokens and the row's tokens
    labels = ids.masked_fill(mask == 0, -100)  # (the stock loss reads the last padding position's logit)
    sparse = model(input_ids=ids, attention_mask=mask, labels=labels, **_task_ids(kind, 2))
    base.set_attn_implementation("sdpa")
    dense = model(input_ids=ids, attention_mask=mask, labels=labels, **_task_ids(kind, 2))
    real = mask.bool() if kind == "prefix_tuning" else torch.cat([torch.ones(2, 8, dtype=torch.bool), mask.bool()], 1)
    assert rel_rms(sparse.logits[real], dense.logits[real]) <= 1e-6  # (the stock loss casts logits to fp32)
    assert abs(sparse.loss.item() - dense.loss.item()) <= 1e-6 * dense.loss.item()


@pytest.mark.parametrize("kind", sorted(_PROMPT_LEARNING))
def test_a_prompt_learning_model_generates_the_tokens_sdpa_generates(kind):
    """generate() on a left-padded batch through the virtual tokens (prefix tuning: virtual keys and values in the
    cache from the first call on; prompt tuning: virtual embeddings before the padding) gives SDPA's tokens."""
    base = _base(dtype=torch.float64)
    hf_sparse_cp.configure(base, SparseAttentionConfig(block_size=BS, min_seq_len=0, vertical_topk=10**4,
                                                       slash_topk=10**4, dense_first_layers=0))
    torch.manual_seed(1)
    model = get_peft_model(base, _PROMPT_LEARNING[kind]()).eval()
    ids = _rows(2)[:, :40]
    mask = torch.ones_like(ids)
    mask[1, :10] = 0
    sparse = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False, **_task_ids(kind, 2))
    base.set_attn_implementation("sdpa")
    dense = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False, **_task_ids(kind, 2))
    assert sparse.shape == (2, 46) and torch.equal(sparse, dense)
