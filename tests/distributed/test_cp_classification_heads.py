"""Classification heads under CP 2 with the stock Trainer equal one process (`integration/heads.py`): a token-
classification head (run_ner: per-token labels, unshifted, -100 on padding and some tokens; its loss the CP group's
mean over the targets), a sequence-classification head (run_glue / run_classification: the last non-pad token of each
row pooled on the rank holding it; single-label with a -100 row, regression, multi-label, label smoothing, left
padding, hidden states in the predictions, a LoRA adapter) and a question-answering head (run_qa: start and end logits
gathered over the whole row, an answer past the row's end) on tiny Llama and Qwen2 models, under the ring (striped,
zigzag, document sharding), ulysses and a curriculum of CP degrees: the losses logged, eval_loss, the weights after 2
SGD steps and `predict()`'s logits. Before, all were refused at CP start; a sequence-classification head had crashed
sharding its per-row labels, a token-classification head trained on its shard's mean (2.269 logged against 1.134 for
one process), and with gradient accumulation on the mean over the accumulated micro-batches' tokens, which one process
does not take: transformers' head drops `num_items_in_batch`, so one process sums each micro-batch's own mean
(run_ner.py, 2 micro-batches: 1.393 logged against 2.786, the update half one process's)."""

import os
import tempfile

import pytest
import torch

TOKEN, SEQUENCE, REGRESSION, MULTI_LABEL, ANSWERS = "token", "sequence", "regression", "multi-label", "qa"
LABELS = 3
# name -> (model type, head, CP flags, settings: average_tokens_across_devices, label_smoothing_factor, padding_side,
# dtype, gradient_accumulation_steps)
RUNS = {
    "llama token": ("llama", TOKEN, {}, {}),
    "llama token document": ("llama", TOKEN, {"cp_sharding": "document"}, {}),
    "llama token ulysses own counts": ("llama", TOKEN, {"cp_mode": "ulysses"}, {"average": False}),
    "qwen2 token smoothed": ("qwen2", TOKEN, {}, {"smoothing": 0.1}),
    "llama token accumulated": ("llama", TOKEN, {}, {"accumulate": 2}),
    "qwen2 token accumulated own counts": ("qwen2", TOKEN, {"cp_mode": "ulysses"}, {"accumulate": 2, "average": False}),
    "qwen2 sequence": ("qwen2", SEQUENCE, {}, {}),
    "qwen2 sequence document hidden states": ("qwen2", SEQUENCE, {"cp_sharding": "document"}, {"hidden": True}),
    "qwen2 sequence ulysses own counts": ("qwen2", SEQUENCE, {"cp_mode": "ulysses"}, {"average": False}),
    "llama sequence lora": ("llama", SEQUENCE, {}, {"lora": True}),
    "qwen2 sequence cp_schedule": ("qwen2", SEQUENCE, {"cp_schedule": "0:160:2"}, {}),
    "llama sequence zigzag left-padded smoothed": ("llama", SEQUENCE, {"cp_sharding": "zigzag"},
                                                   {"side": "left", "smoothing": 0.1}),
    "llama regression fp64": ("llama", REGRESSION, {}, {"dtype": torch.float64}),
    "qwen2 multi-label ulysses": ("qwen2", MULTI_LABEL, {"cp_mode": "ulysses"}, {}),
    "llama qa": ("llama", ANSWERS, {}, {}),
    "qwen2 qa ulysses hidden states": ("qwen2", ANSWERS, {"cp_mode": "ulysses"}, {"hidden": True}),
}


def _reference(name: str) -> str:
    """The first run of RUNS that one process runs for `name`'s (the CP flags and the token count aside)."""
    model_type, head, _, settings = RUNS[name]
    key = (model_type, head, {k: v for k, v in settings.items() if k != "average"})
    return next(other for other, (m, h, _, s) in RUNS.items()
                if (m, h, {k: v for k, v in s.items() if k != "average"}) == key)


def _rows(head: str, side: str, dtype: torch.dtype = torch.float32) -> list[dict]:
    """6 rows of 90 to 160 tokens padded to 160 (pad id 0, on `side`), labels as `head` takes them (a regression's in
    the model's `dtype`: torch 2.11 fails mse_loss's backward on float32 targets of float64 outputs, 'Found dtype Float
    but expected Double', with or without the plugin; 2.13 promotes them)."""
    g = torch.Generator().manual_seed(0)
    rows = []
    for i, n in enumerate([160, 120, 90, 150, 140, 100]):
        real = torch.arange(160) < n if side == "right" else torch.arange(160) >= 160 - n
        ids = torch.where(real, torch.randint(3, 259, (160,), generator=g), 0)
        row = {"input_ids": ids, "attention_mask": real.long()}
        if head == TOKEN:
            labels = torch.randint(0, LABELS, (160,), generator=g)
            labels[~real | (torch.arange(160) % 7 == i)] = -100
        elif head == SEQUENCE:
            labels = torch.tensor(-100 if i == 1 else i % LABELS)
        elif head == REGRESSION:
            labels = torch.randn((), generator=g).to(dtype)
        elif head == MULTI_LABEL:
            labels = (torch.rand(LABELS, generator=g) > 0.5).float()
        else:  # (an answer past the row's end: left out of the loss, as transformers clamps it)
            start = torch.nonzero(real)[0, 0] + 7 * i
            row.update(start_positions=start, end_positions=start + 5 if i != 2 else torch.tensor(500))
            rows.append(row)
            continue
        rows.append({**row, "labels": labels})
    return rows


def _flat(predictions) -> list[torch.Tensor]:
    """`predict()`'s predictions (the logits, then any hidden states: nested tuples of arrays) as a list of tensors."""
    if isinstance(predictions, tuple):
        return [x for p in predictions for x in _flat(p)]
    return [torch.as_tensor(predictions)]


def _train(rank: int, world: int) -> dict:
    import transformers
    from transformers import Trainer, TrainingArguments, default_data_collator

    import hf_sparse_cp
    from hf_sparse_cp import SparseAttentionConfig, SparseCPArguments, attach_to_trainer, detach_from_trainer
    from hf_sparse_cp.distributed import ContextParallelConfig
    from hf_sparse_cp.testing.tiny_models import tiny_config

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    hf_sparse_cp.patch()
    results = {}
    for name, (model_type, head, flags, settings) in RUNS.items():
        if world == 1 and _reference(name) != name:
            continue
        torch.manual_seed(0)
        problem = {REGRESSION: "regression", MULTI_LABEL: "multi_label_classification"}.get(head)
        config = tiny_config(model_type, num_labels=1 if head == REGRESSION else LABELS, classifier_dropout=0.0,
                             problem_type=problem, output_hidden_states=settings.get("hidden", False))
        auto = {TOKEN: "AutoModelForTokenClassification", ANSWERS: "AutoModelForQuestionAnswering"}.get(
            head, "AutoModelForSequenceClassification")
        model = getattr(transformers, auto).from_config(config).to(settings.get("dtype", torch.float32))
        hf_sparse_cp.configure(model, SparseAttentionConfig(block_size=16, min_seq_len=64, vertical_topk=2,
                                                            slash_topk=2, local_window=16, sink_tokens=4, last_q=16))
        if settings.get("lora"):  # (the score layer trained beside the adapter: PEFT wraps it, modules_to_save)
            from peft import LoraConfig, get_peft_model

            model = get_peft_model(model, LoraConfig(task_type="SEQ_CLS", r=4, lora_alpha=8, lora_dropout=0.0,
                                                     target_modules=["q_proj", "v_proj"], init_lora_weights=False))
        rows = _rows(head, settings.get("side", "right"), settings.get("dtype", torch.float32))
        with tempfile.TemporaryDirectory() as tmp:
            args = TrainingArguments(output_dir=tmp, report_to="none", use_cpu=True, save_strategy="no",
                                     per_device_train_batch_size=2, per_device_eval_batch_size=2, max_steps=2,
                                     optim="sgd", learning_rate=0.5, lr_scheduler_type="constant", logging_steps=1,
                                     average_tokens_across_devices=settings.get("average", True),
                                     label_smoothing_factor=settings.get("smoothing", 0.0),
                                     gradient_accumulation_steps=settings.get("accumulate", 1),
                                     train_sampling_strategy="sequential")
            trainer = Trainer(model=model, args=args, train_dataset=rows[:4], eval_dataset=rows[4:],
                              data_collator=default_data_collator)
            initial = torch.cat([p.detach().flatten() for p in model.parameters()])
            # (the forward hooks of the model and its head's layer: transformers adds its own to the layers that
            # record hidden states)
            watched = [model, *(m for n, m in model.named_modules() if n.rsplit(".", 1)[-1] in ("score", "qa_outputs"))]
            hooks = [list(m._forward_hooks) for m in watched]
            flags = dict(flags)
            schedule = flags.pop("cp_schedule", None)  # (a curriculum of CP degrees: one stage, at CP 2)
            parallel = attach_to_trainer(trainer, SparseCPArguments(sparse_attention=True),
                                         ContextParallelConfig(cp_size=1 if schedule else world, **flags)
                                         if world > 1 else None, cp_schedule=schedule if world > 1 else None)
            trainer.train()
            results[name] = {"loss": [log["loss"] for log in trainer.state.log_history if "loss" in log],
                             "eval_loss": trainer.evaluate()["eval_loss"],
                             "predictions": _flat(trainer.predict(rows[4:]).predictions),
                             "update": torch.cat([p.detach().flatten() for p in model.parameters()]) - initial,
                             "layout": parallel.describe() if world > 1 else "one process"}
            detach_from_trainer(trainer)
            results[name]["hooks restored"] = [list(m._forward_hooks) for m in watched] == hooks
    return results


@pytest.fixture(scope="module")
def runs():
    from hf_sparse_cp.testing.spawn import run_gloo

    return run_gloo(_train, 1, timeout_s=600)[0], run_gloo(_train, 2, timeout_s=900)


@pytest.mark.parametrize("name", list(RUNS))
def test_a_classification_head_under_cp2_trains_as_one_process(runs, name):
    from oracle import rel_rms

    one, ranks = runs
    reference = one[_reference(name)]
    for rank in ranks:
        got = rank[name]
        assert got["layout"].startswith("CP 2 x DP 1") and got["hooks restored"]
        for key, value in RUNS[name][2].items():
            assert key == "cp_schedule" or value in got["layout"].lower(), (value, got["layout"])
        assert got["loss"] == pytest.approx(reference["loss"], rel=1e-5)
        assert got["eval_loss"] == pytest.approx(reference["eval_loss"], rel=1e-5)
        outputs = (2 if RUNS[name][1] == ANSWERS else 1) + (3 if "hidden" in name else 0)  # (and 3 hidden states)
        assert len(got["predictions"]) == len(reference["predictions"]) == outputs
        for x, want in zip(got["predictions"], reference["predictions"]):
            torch.testing.assert_close(x, want, rtol=1e-5, atol=1e-5)
        assert rel_rms(got["update"], reference["update"]) < 1e-5
        assert reference["update"].abs().max() > 0


# Data parallelism x CP: the model types the heads are tried on
DP_HEADS = {TOKEN: "llama", SEQUENCE: "qwen2", ANSWERS: "qwen2"}


def _train_dp(rank: int, world: int, head: str, cp: int) -> dict:
    import transformers
    from transformers import Trainer, TrainingArguments, default_data_collator

    import hf_sparse_cp
    from hf_sparse_cp import SparseAttentionConfig, SparseCPArguments, attach_to_trainer, detach_from_trainer
    from hf_sparse_cp.distributed import ContextParallelConfig
    from hf_sparse_cp.testing.tiny_models import tiny_config

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    hf_sparse_cp.patch()
    torch.manual_seed(0)
    auto = {TOKEN: "AutoModelForTokenClassification", ANSWERS: "AutoModelForQuestionAnswering"}.get(
        head, "AutoModelForSequenceClassification")
    model = getattr(transformers, auto).from_config(tiny_config(DP_HEADS[head], num_labels=LABELS,
                                                                classifier_dropout=0.0)).double()
    hf_sparse_cp.configure(model, SparseAttentionConfig(block_size=16, min_seq_len=64, vertical_topk=2, slash_topk=2,
                                                        local_window=16, sink_tokens=4, last_q=16))
    with tempfile.TemporaryDirectory() as tmp:
        args = TrainingArguments(output_dir=tmp, report_to="none", use_cpu=True, save_strategy="no",
                                 per_device_train_batch_size=2 // min(world, 2), max_steps=2, optim="sgd",
                                 learning_rate=0.5,
                                 lr_scheduler_type="constant", logging_steps=1, train_sampling_strategy="sequential")
        trainer = Trainer(model=model, args=args, train_dataset=_rows(head, "right")[:4],
                          data_collator=default_data_collator)
        initial = torch.cat([p.detach().flatten() for p in model.parameters()])
        attach_to_trainer(trainer, SparseCPArguments(sparse_attention=True),
                          ContextParallelConfig(cp_size=cp) if cp > 1 else None)
        trainer.train()
        result = {"loss": [log["loss"] for log in trainer.state.log_history if "loss" in log],
                  "update": torch.cat([p.detach().flatten() for p in model.parameters()]) - initial}
        detach_from_trainer(trainer)
    return result


@pytest.mark.parametrize("head", list(DP_HEADS))
def test_a_classification_head_under_dp2_x_cp2_trains_as_one_process_or_as_dp2(head):
    """Under data parallelism x CP (4 processes: DP 2 x CP 2, a row per DP rank) a token-classification head trains
    as one process with both rows (its loss the group's token mean), and a sequence-classification or
    question-answering head as data parallelism alone (DP 2, no CP: the stock Trainer's run, whose loss transformers
    scales by the processes): the losses logged and the update after 2 SGD steps. (Stock DP 2 trains the
    token-classification head otherwise: its logged loss twice one process's.)"""
    from hf_sparse_cp.testing.spawn import run_gloo

    from oracle import rel_rms

    (want, *_) = run_gloo(_train_dp, 1 if head == TOKEN else 2, head, 1, timeout_s=600)
    for rank in run_gloo(_train_dp, 4, head, 2, timeout_s=900):
        assert rank["loss"] == pytest.approx(want["loss"], rel=1e-6)
        assert rel_rms(rank["update"], want["update"]) < 1e-9


# Heads that read the padding after a row's tokens under CP 2, every block kept: name -> (head, config's pad_token_id,
# CP flags)
PADDING_READS = {
    "qa ring": (ANSWERS, 0, {}),
    "qa zigzag": (ANSWERS, 0, {"cp_sharding": "zigzag"}),
    "qa ulysses": (ANSWERS, 0, {"cp_mode": "ulysses"}),
    "qa document": (ANSWERS, 0, {"cp_sharding": "document"}),
    "sequence pooling padding": (SEQUENCE, 5, {"cp_sharding": "contiguous"}),
    "sequence pooling padding document": (SEQUENCE, 5, {"cp_sharding": "document"}),
}


def _train_padding_reads(rank: int, world: int) -> dict:
    """Each head of `PADDING_READS` trained 2 SGD steps in fp64 on `_rows` padded on the left and on the right: SDPA
    in one process, sparse_cp with every block kept under CP `world` with the run's flags; by run and side, the losses
    logged, the start/end or pooled logits of `predict()` and how many warnings of padding read otherwise than SDPA."""
    import logging

    import transformers
    from transformers import Trainer, TrainingArguments, default_data_collator

    import hf_sparse_cp
    from hf_sparse_cp import SparseAttentionConfig, SparseCPArguments, attach_to_trainer, detach_from_trainer
    from hf_sparse_cp.distributed import ContextParallelConfig
    from hf_sparse_cp.testing.tiny_models import tiny_config

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    hf_sparse_cp.patch()
    notes = []
    handler = logging.Handler()
    handler.emit = lambda record: notes.append(record.getMessage())
    logging.getLogger("hf_sparse_cp.integration.heads").addHandler(handler)
    results = {}
    for name, (head, pad_token_id, flags) in PADDING_READS.items():
        for side in ("left", "right"):
            notes.clear()
            torch.manual_seed(0)
            auto = "AutoModelForQuestionAnswering" if head == ANSWERS else "AutoModelForSequenceClassification"
            model = getattr(transformers, auto).from_config(
                tiny_config("llama", pad_token_id=pad_token_id, num_labels=LABELS, classifier_dropout=0.0),
                attn_implementation="sdpa").double()
            rows = _rows(head, side)[:4]
            with tempfile.TemporaryDirectory() as tmp:
                args = TrainingArguments(output_dir=tmp, report_to="none", use_cpu=True, save_strategy="no",
                                         per_device_train_batch_size=2, per_device_eval_batch_size=2, max_steps=2,
                                         optim="sgd", learning_rate=0.5, lr_scheduler_type="constant",
                                         logging_steps=1, train_sampling_strategy="sequential")
                trainer = Trainer(model=model, args=args, train_dataset=rows, data_collator=default_data_collator)
                if world > 1:
                    hf_sparse_cp.configure(model, SparseAttentionConfig(block_size=16, min_seq_len=0, sink_tokens=0,
                                                                        dense_first_layers=0, vertical_topk=10**4,
                                                                        slash_topk=10**4))
                    attach_to_trainer(trainer, SparseCPArguments(sparse_attention=True),
                                      ContextParallelConfig(cp_size=world, **flags))
                trainer.train()
                predictions = _flat(trainer.predict(rows).predictions)
                if world > 1:
                    detach_from_trainer(trainer)
            results[name, side] = ([log["loss"] for log in trainer.state.log_history if "loss" in log], predictions,
                                   sum("padding" in note for note in notes))
    return results


def test_heads_reading_padding_under_cp2_give_sdpas_outputs_and_loss():
    """transformers' question-answering loss takes a softmax over every position of the row, padding included, and a
    sequence-classification head whose pad_token_id (5) is not the batch's padding (0) pools a padding position.
    sparse_cp gave the padding queries after a row's tokens no attention (as flash_attention_2), where SDPA attends
    them to the row's tokens: right-padded, CP 2 logged 5.2723 against SDPA's 5.2910, with a warning. Now, with every
    block kept, the ring (striped, zigzag, contiguous, and the document planner, which reorders a row's documents and
    its padding) and ulysses log SDPA's losses and predict SDPA's logits at every position (fp64), left- or
    right-padded, unwarned."""
    from hf_sparse_cp.testing.spawn import run_gloo

    (want,) = run_gloo(_train_padding_reads, 1, timeout_s=600)
    for rank in run_gloo(_train_padding_reads, 2, timeout_s=900):
        for (name, side), (losses, predictions, notes) in rank.items():
            want_losses, want_predictions, _ = want[name, side]
            assert losses == pytest.approx(want_losses, rel=1e-9) and notes == 0, (name, side)
            real = torch.stack([r["attention_mask"] for r in _rows(PADDING_READS[name][0], side)[:4]]).bool()
            for got, expected in zip(predictions, want_predictions, strict=True):
                # (left padding sees no token under either, and SDPA's output there is no one's)
                seen = real if side == "left" and PADDING_READS[name][0] == ANSWERS else slice(None)
                torch.testing.assert_close(got[seen], expected[seen], rtol=1e-9, atol=1e-10)


def _bare_decoder_hidden_states(rank: int, world: int) -> dict:
    """A model without a head (AutoModel) in a loop of its own over `prepare_context_parallel_inputs`, every block
    kept, fp64, under the ring and ulysses: by mode, the largest difference of its last hidden states (gathered over
    the CP group) from SDPA's in one process, at the tokens and at the padding after the second row's tokens."""
    import copy

    import transformers

    import hf_sparse_cp
    from hf_sparse_cp import ContextParallelConfig, SparseAttentionConfig
    from hf_sparse_cp.distributed import CP_SHARD_KWARG, ParallelDims, prepare_context_parallel_inputs
    from hf_sparse_cp.testing.tiny_models import tiny_config

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    hf_sparse_cp.patch()
    torch.manual_seed(0)
    reference = transformers.AutoModel.from_config(tiny_config("llama"), attn_implementation="sdpa").double()
    model = copy.deepcopy(reference)
    pattern = SparseAttentionConfig(block_size=16, min_seq_len=0, sink_tokens=0, dense_first_layers=0,
                                    vertical_topk=10**4, slash_topk=10**4)
    hf_sparse_cp.configure(model, pattern)
    ids = torch.randint(6, 250, (2, 128), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, 50:] = 0
    ids[mask == 0] = 0
    want = reference(input_ids=ids, attention_mask=mask).last_hidden_state.detach()
    results = {}
    for mode in ("ring", "ulysses"):
        parallel = ParallelDims.from_config(ContextParallelConfig(cp_size=world, cp_mode=mode))
        inputs = prepare_context_parallel_inputs({"input_ids": ids, "attention_mask": mask}, parallel, block_size=16,
                                                 sparse_config=pattern)
        got = inputs[CP_SHARD_KWARG].whole_sequence(model(**inputs).last_hidden_state).detach()
        off = (got - want).abs().amax(-1)
        results[mode] = (float(off[mask.bool()].max()), float(off[~mask.bool()].max()))
    return results


def test_a_bare_decoder_under_cp2_gives_sdpas_hidden_states_at_padding():
    """A model without a head (AutoModel: the caller pools its hidden states) gives SDPA's hidden states at every
    position in one process (`heads.with_padding_rows`); under CP, in a loop of its own over
    `prepare_context_parallel_inputs`, no pre-hook gives the shard the rows and its padding queries after a row's
    tokens got no attention: those hidden states 2.09 from SDPA's, unsaid. Now every row's attend
    (`heads.with_shard_padding_rows`), under the ring and ulysses, as in one process."""
    from hf_sparse_cp.testing.spawn import run_gloo

    for rank in run_gloo(_bare_decoder_hidden_states, 2, timeout_s=300):
        for mode, (tokens, padding) in rank.items():
            assert tokens < 1e-12 and padding < 1e-12, (mode, tokens, padding)


def _headed_model_in_a_loop_of_its_own(rank: int, world: int) -> dict:
    """A question-answering and a sequence-classification model in a loop of their own over
    `prepare_context_parallel_inputs` (no Trainer pooling their heads over the CP group): by head, the error of the
    forward (None: it ran)."""
    import transformers

    import hf_sparse_cp
    from hf_sparse_cp import ContextParallelConfig, SparseAttentionConfig
    from hf_sparse_cp.distributed import ParallelDims, prepare_context_parallel_inputs
    from hf_sparse_cp.testing.tiny_models import tiny_config

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    hf_sparse_cp.patch()
    pattern = SparseAttentionConfig(block_size=16, min_seq_len=0)
    parallel = ParallelDims.from_config(ContextParallelConfig(cp_size=world))
    ids = torch.randint(6, 250, (2, 64), generator=torch.Generator().manual_seed(1))
    errors = {}
    for auto in ("AutoModelForQuestionAnswering", "AutoModelForSequenceClassification"):
        model = getattr(transformers, auto).from_config(tiny_config("llama", num_labels=3, pad_token_id=0),
                                                        attn_implementation="sdpa")
        hf_sparse_cp.configure(model, pattern)
        inputs = prepare_context_parallel_inputs({"input_ids": ids}, parallel, block_size=16, sparse_config=pattern)
        try:
            model(**inputs)
            errors[auto] = None
        except ValueError as e:
            errors[auto] = str(e)
    return errors


def test_a_headed_model_in_a_loop_of_its_own_under_cp2_is_refused_naming_the_trainer():
    """A question-answering or sequence-classification head under CP outside the Trainer's CP steps, which pool it over
    the CP group: each rank's pooled (or start and end) logits were its shard's, not the row's (rank 0's pooled logits
    0.68 from SDPA's), unsaid; now refused at the first attention call, naming the Trainer."""
    from hf_sparse_cp.testing.spawn import run_gloo

    for rank in run_gloo(_headed_model_in_a_loop_of_its_own, 2, timeout_s=300):
        for auto, error in rank.items():
            assert error is not None and "outside the Trainer's CP steps" in error, (auto, error)
            assert "--cp_size" in error
