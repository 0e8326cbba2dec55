"""TRL's SFT with the one switch (issue #30): a stock `SFTTrainer` script with `SparseSFTConfig` /
`SparseSFTTrainer` trains packed documents (padding-free rows, restarting position_ids) under CP 2 as one
process does, and TRL's own model card is kept with the plugin's section merged into it."""

import os
import re

import pytest
import torch
from transformers import AutoModelForCausalLM

from hf_sparse_cp.examples.tokenizer import byte_tokenizer
from hf_sparse_cp.testing.spawn import run_gloo, run_gloo_each
from hf_sparse_cp.testing.tiny_models import tiny_config

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

MAX_LENGTH = 256
# the SFT config of a small packed run: TRL's defaults but bf16 and gradient checkpointing (not on CPU here)
SFT = dict(max_length=MAX_LENGTH, packing=True, padding_free=True, max_steps=2, per_device_train_batch_size=1,
           learning_rate=1e-3, logging_steps=1, report_to="none", save_strategy="no", bf16=False,
           gradient_checkpointing=False, seed=0, data_seed=0, dataset_num_proc=None)
# a pattern sparse at these lengths: documents of 64 tokens or more get vertical-slash attention
PATTERN = dict(sparse_block_size=32, sparse_min_seq_len=64, sparse_vertical_topk=8, sparse_slash_topk=8,
               sparse_local_window=32, sparse_sink_tokens=4, sparse_last_q=16)


def _texts(n: int = 12) -> list[str]:
    """Documents of 40 to 200 bytes: a packed row of 256 tokens holds several, some sparse, some dense."""
    g = torch.Generator().manual_seed(0)
    words = ["sparse", "attention", "ring", "packed", "document", "token", "block", "query", "key", "value"]
    out = []
    for length in torch.randint(40, 200, (n,), generator=g).tolist():
        picks = torch.randint(0, len(words), (length // 4,), generator=g).tolist()
        out.append(" ".join(words[i] for i in picks)[:length])
    return out


def _train(output_dir: str, model_type: str = "llama", **plugin) -> tuple[object, dict]:
    """A stock SFT script, switched: the two class names are the plugin's."""
    from hf_sparse_cp import SparseSFTConfig as SFTConfig
    from hf_sparse_cp import SparseSFTTrainer as SFTTrainer

    os.environ.update(HF_HUB_DISABLE_TELEMETRY="1", HF_HUB_OFFLINE="1")
    torch.manual_seed(0)
    tokenizer = byte_tokenizer()
    model = AutoModelForCausalLM.from_config(tiny_config(model_type, vocab_size=len(tokenizer)))
    args = SFTConfig(output_dir=output_dir, **SFT, **PATTERN, **plugin)
    trainer = SFTTrainer(model=model, args=args, train_dataset=datasets.Dataset.from_dict({"text": _texts()}),
                         processing_class=tokenizer)
    trainer.train()
    logs = [log for log in trainer.state.log_history if "loss" in log]
    weights = {name: p.detach().double().sum().item() for name, p in trainer.model.named_parameters()}
    return trainer, {"loss": [log["loss"] for log in logs], "grad_norm": [log["grad_norm"] for log in logs],
                     "weights": weights, "kept": [log.get("sparse/kept_fraction") for log in logs],
                     **{key: [log.get(key) for log in logs] for key in ("aux_loss", "entropy", "mean_token_accuracy")}}


def _cp2(rank: int, world: int, output_dir: str, mode: str = "ring", model_type: str = "llama") -> dict:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    trainer, result = _train(output_dir, model_type, cp_size=2, cp_mode=mode)
    trainer.create_model_card()
    return result | {"cp_size": trainer.parallel.cp_size, "mode": trainer.parallel.mode.name}


def _under_accelerates_cp2(rank: int, world: int, output_dir: str) -> dict:
    """TRL's packed SFT under accelerate's own CP group (a ParallelismConfig, as the GPU recipes set)."""
    from accelerate.parallelism_config import ParallelismConfig

    from hf_sparse_cp.testing.accelerate_cp import allow_parallelism_config_on_cpu

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    allow_parallelism_config_on_cpu()
    trainer, result = _train(output_dir, parallelism_config=ParallelismConfig(cp_size=2))
    trainer.create_model_card()
    return result | {"cp_size": trainer.parallel.cp_size, "mode": trainer.parallel.mode.name,
                     "packing": (trainer.args.packing, trainer.args.eval_packing)}


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    out = tmp_path_factory.mktemp("sft_one")
    trainer, result = _train(str(out))
    trainer.create_model_card(dataset_name="packed-words")
    return trainer, result, out


def test_the_switched_sft_trainer_is_trls_and_trains_sparse(one_process):
    trainer, result, _ = one_process
    assert isinstance(trainer, trl.SFTTrainer) and trainer.padding_free
    assert trainer.model.config._attn_implementation == "sparse_cp"
    assert trainer.max_length == MAX_LENGTH  # SFTConfig's own max_length
    assert all(0 < kept < 1 for kept in result["kept"])  # the packed rows' long documents ran sparse
    assert result["loss"][1] < result["loss"][0] + 1.0 and all(torch.isfinite(torch.tensor(result["loss"])))


@pytest.mark.parametrize("mode", ["ring", "ulysses", "accelerate"])
def test_packed_sft_under_cp2_equals_one_process(one_process, on_two_processes, mode):
    """Padding-free packed rows (position_ids restarting per document) under the sparse ring, under head
    parallelism and under accelerate's own CP group: TRL's losses, gradient norms, kept fractions and weights of one
    process. TRL refuses packing under accelerate's CP group, whose attention drops the mask that keeps documents
    apart: the sparse ring keeps them apart, and its check saw packing off, the arguments say it again after."""
    _, one, _ = one_process
    runs, folder = on_two_processes
    for rank in runs[mode]:
        assert (rank["cp_size"], rank["mode"]) == (2, "ring" if mode == "accelerate" else mode)
        assert rank.get("packing", (True, None)) == (True, None)
        assert rank["loss"] == pytest.approx(one["loss"], rel=1e-4)
        assert rank["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-4)
        assert rank["kept"] == pytest.approx(one["kept"], rel=1e-4)
        for name, total in one["weights"].items():  # after two optimizer steps on those gradients
            assert rank["weights"][name] == pytest.approx(total, rel=1e-4, abs=1e-4), name
    card = (folder / mode / "README.md").read_text()
    assert "CP 2 x DP 1" in card and "2 CPU processes (gloo)" in card
    assert ("head-parallel (Ulysses) over 2 ranks" in card) == (mode == "ulysses")


def test_moe_sft_metrics_gathered_in_the_step_under_cp2_are_one_processs(tmp_path):
    """A MoE model (Mixtral), whose router auxiliary loss TRL adds and logs by default: the metrics TRL gathers in its
    step are each rank's shard's, and the CP gather keeps every rank's, so that TRL's sums (token entropy, correct
    tokens) are the batch's and its mean of the auxiliary loss the mean over the shards (it was their sum, 2x at
    CP 2). The auxiliary loss is computed over the CP group (`router_loss.py`): every rank logs one process's, and
    the update is one process's (it was each shard's: step-2 loss 5.206497 against 5.207169)."""
    trainer, one = _train(str(tmp_path / "one"), "mixtral")
    assert trainer.aux_loss_enabled and all(value > 0 for value in one["aux_loss"])
    for rank in run_gloo(_cp2, 2, str(tmp_path / "cp2"), "ring", "mixtral", timeout_s=400):
        for key in ("loss", "grad_norm", "aux_loss", "entropy", "mean_token_accuracy"):
            assert rank[key] == pytest.approx(one[key], rel=1e-5), key
        for name, total in one["weights"].items():  # after two optimizer steps on those gradients
            assert rank["weights"][name] == pytest.approx(total, rel=1e-5, abs=1e-5), name


def _front_matter(card: str) -> dict:
    import yaml

    return yaml.safe_load(card.split("---\n")[1])


def test_trls_card_is_kept_and_ours_merged_into_it(one_process):
    trainer, _, out = one_process
    card = (out / "README.md").read_text()
    # TRL's card: its front matter (library, tags), its quick start, its training procedure and citations
    assert card.startswith("---\n") and "library_name: transformers" in card
    for tag in ("trl", "sft", "hf-sparse-cp", "sparse-attention", "long-context"):
        assert f"- {tag}\n" in card, tag
    assert "This model was trained with SFT." in card and "## Training procedure" in card
    assert "TRL" in card and _front_matter(card)["datasets"] == ["packed-words"]
    # ours, once, after TRL's
    assert card.count("## Sparse long-context training") == 1
    assert card.index("## Training procedure") < card.index("## Sparse long-context training")
    # one "Framework versions" section, TRL's, with the plugin's packages added in its style
    assert card.count("### Framework versions") == 1 and f"- TRL: {trl.__version__}\n" in card
    assert "- hf-sparse-cp: " in card and "- Accelerate: " in card
    assert "base_model" not in _front_matter(card)  # trained from a config: no Hub model to name
    # (TRL's packing fills each row up to its max_length: the longest packed row, stated beside it, stays below)
    row = card[card.index("| sequence length |"):].split("\n", 1)[0]
    held = int(re.search(r"256 tokens set; the longest sequence trained held (\d+) \(documents packed into each "
                         r"sequence", row).group(1))
    assert 200 < held < 256, row


def test_saving_the_final_model_writes_a_card_the_hubs_parser_accepts(one_process, tmp_path, monkeypatch):
    """TRL's sft.py ends with `trainer.save_model(output_dir)` (and pushes only when asked): that save writes the
    card, with the metadata the --sparse_card_* flags give, TRL's placeholders for a run without a Hub base model
    replaced, one quick start and the measured throughput (issue #52)."""
    from huggingface_hub import ModelCard

    trainer, _, _ = one_process
    flags = {"output_dir": str(tmp_path), "sparse_card_license": "Apache-2.0", "sparse_card_tags": ["passkey"],
             "sparse_card_base_model": "HuggingFaceTB/SmolLM2-135M", "sparse_card_datasets": ["trl-lib/Capybara"]}
    for name, value in flags.items():
        monkeypatch.setattr(trainer.args, name, value)
    trainer.save_model(str(tmp_path))
    card = ModelCard.load(tmp_path / "README.md", ignore_metadata_errors=False)  # huggingface_hub's parser
    meta = card.data.to_dict()
    assert meta["license"] == "apache-2.0" and "licence" not in meta  # TRL writes `licence: license`
    assert meta["base_model"] == "HuggingFaceTB/SmolLM2-135M" and meta["datasets"] == ["trl-lib/Capybara"]
    assert {"passkey", "trl", "sft", "hf-sparse-cp"} <= set(meta["tags"])
    text = card.text
    for placeholder in ("huggingface.co/None", 'model="None"', "Model Card for None"):
        assert placeholder not in text, placeholder
    assert "fine-tuned version of [HuggingFaceTB/SmolLM2-135M](https://huggingface.co/HuggingFaceTB/SmolLM2-135M)" \
        in text
    assert text.count("Quick start") == 1 and f'from_pretrained("{tmp_path}")' in text
    assert "tokens/s (measured" in text and "peak memory" in text


def _evaluate(rank: int, world: int, output_dir: str, cp_size: int, eval_batch_size: int = 2, steps: int = 1,
              label_smoothing: float = 0.0, average_tokens: bool = True) -> dict:
    """SFT's evaluation with run_clm.py's compute_metrics (the argmax of preprocess_logits_for_metrics against the
    shifted labels) after `steps` steps, on 7 packed eval documents in batches of `eval_batch_size`, the token counts
    averaged across devices or not (`average_tokens`). Records the length of every evaluation forward."""
    from hf_sparse_cp import SparseSFTConfig as SFTConfig
    from hf_sparse_cp import SparseSFTTrainer as SFTTrainer

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      HF_HUB_DISABLE_TELEMETRY="1", HF_HUB_OFFLINE="1")
    torch.manual_seed(0)
    tokenizer = byte_tokenizer()
    model = AutoModelForCausalLM.from_config(tiny_config("llama", vocab_size=len(tokenizer)))

    def compute_metrics(prediction):
        preds, labels = prediction.predictions[:, :-1], prediction.label_ids[:, 1:]
        return {"accuracy": float((preds == labels)[labels != -100].mean()), "targets": int((labels != -100).sum())}

    plugin = {"cp_size": cp_size} if cp_size > 1 else {}
    args = SFTConfig(output_dir=output_dir, **{**SFT, "max_steps": max(steps, 1)}, **PATTERN, **plugin,
                     per_device_eval_batch_size=eval_batch_size, label_smoothing_factor=label_smoothing,
                     average_tokens_across_devices=average_tokens)
    trainer = SFTTrainer(model=model, args=args, train_dataset=datasets.Dataset.from_dict({"text": _texts()}),
                         eval_dataset=datasets.Dataset.from_dict({"text": _texts(7)}), processing_class=tokenizer,
                         compute_metrics=compute_metrics,
                         preprocess_logits_for_metrics=lambda logits, labels: logits.argmax(-1))
    if steps:
        trainer.train()
    lengths = []
    hook = trainer.model.register_forward_pre_hook(
        lambda module, args, kwargs: lengths.append(kwargs["input_ids"].shape[1]), with_kwargs=True)
    metrics = trainer.evaluate()
    hook.remove()
    return {"metrics": metrics, "lengths": lengths}


def _label_smoothing_refusal(rank: int, world: int, output_dir: str) -> str:
    """The error `_evaluate` under CP 2 with label smoothing ends with (its type and text), or "not refused"."""
    try:
        _evaluate(rank, world, output_dir, 2, 2, 1, 0.1)
    except Exception as e:  # (the refusal's type is TRL's path's; its text is what the test reads)
        return f"{type(e).__name__}: {e}"
    return "not refused"


@pytest.fixture(scope="module")
def on_two_processes(tmp_path_factory):
    """({name: per-rank results}, their folder) of what the tests run on two processes, one after the other in one
    spawned pair: the evaluation under DP 2 before training, TRL's packed SFT under CP 2 with the ring and with
    ulysses, the evaluation under CP 2 after a step (--average_tokens_across_devices true and false), label
    smoothing under CP 2 (refused), and the packed SFT under accelerate's CP group."""
    folder = tmp_path_factory.mktemp("two_processes")
    calls = {"dp2": (_evaluate, (f"{folder}/dp2", 1, 1, 0)), "ring": (_cp2, (f"{folder}/ring", "ring")),
             "ulysses": (_cp2, (f"{folder}/ulysses", "ulysses")),
             **{f"evaluate-{flag}": (_evaluate, (f"{folder}/cp2-{flag}", 2, 2, 1, 0.0, flag))
                for flag in (True, False)},
             "label_smoothing": (_label_smoothing_refusal, (f"{folder}/label_smoothing",)),
             # (last: it sets accelerate's process-wide state)
             "accelerate": (_under_accelerates_cp2, (f"{folder}/accelerate",))}
    return run_gloo_each(calls, 2, timeout_s=900), folder


@pytest.mark.parametrize("average_tokens", [True, False], ids=["tokens-across-devices", "tokens-per-device"])
def test_sft_evaluation_with_compute_metrics_under_cp2_is_sharded_and_equals_one_process(tmp_path, on_two_processes,
                                                                                         average_tokens):
    """TRL's prediction_step hands compute_loss the whole batch, without the Trainer's CP preparation: under CP 2
    each rank's evaluation forwards take its shard (half the row), and eval_loss, TRL's eval_entropy and
    eval_mean_token_accuracy (sums over every rank's shard) and compute_metrics' accuracy are one process's, after a
    training step, with the token counts averaged across devices (TRL's default) or per device (--
    average_tokens_across_devices false: compute_loss then does not multiply the shards' losses by the processes)."""
    settings = (2, 1, 0.0, average_tokens)  # eval batches of 2, one step, no label smoothing
    one = run_gloo(_evaluate, 1, str(tmp_path / "one"), 1, *settings, timeout_s=300)[0]
    assert len(one["lengths"]) == 4  # two batches (the last short), two forwards each (TRL's, then the logits)
    assert 0 < one["metrics"]["eval_accuracy"] < 1
    for rank in on_two_processes[0][f"evaluate-{average_tokens}"]:
        assert all(n < m for n, m in zip(rank["lengths"], one["lengths"], strict=True)), rank["lengths"]
        for key in ("eval_loss", "eval_entropy", "eval_mean_token_accuracy", "eval_accuracy", "eval_targets"):
            assert rank["metrics"][key] == pytest.approx(one["metrics"][key], rel=1e-6), key


def test_sft_with_label_smoothing_under_cp2_is_refused_at_start_naming_the_fix(on_two_processes):
    """TRL's SFTTrainer computes its token accuracy from the labels it is handed beside the smoothed loss; under CP
    the smoothing wrapper hands the smoother the shard's targets in their place, so the logged accuracy would be
    the shard's re-shifted targets' (eval_mean_token_accuracy 0.01063 against one process's 0.01162, the loss equal):
    refused before training, naming the flag. The Trainer's own loss smooths exactly under CP (test_trainer_cp.py)."""
    for refusal in on_two_processes[0]["label_smoothing"]:
        assert re.search(r"label smoothing \(--label_smoothing_factor 0.1\) with SFTTrainer's own compute_loss.*"
                         r"drop --label_smoothing_factor", refusal), refusal


def test_sft_evaluation_under_dp2_x_cp2_equals_dp2(tmp_path, on_two_processes):
    """Four processes, DP 2 x CP 2: the two CP groups evaluate different packed rows (one each per step, the last step
    short), with TRL's own loss (the rank's token mean, computed without a label count). eval_loss, TRL's eval_entropy
    and eval_mean_token_accuracy and compute_metrics' accuracy are those of DP 2 without CP: the CP group's label count
    alone divides its shards' losses, never the other group's (eval_loss was 5.058 instead of 5.602 when the groups'
    rows held different counts). Evaluated before training."""
    two = on_two_processes[0]["dp2"][0]
    assert 0 < two["metrics"]["eval_accuracy"] < 1
    for rank in run_gloo(_evaluate, 4, str(tmp_path / "dp2cp2"), 2, 1, 0, timeout_s=300):
        for key in ("eval_loss", "eval_entropy", "eval_mean_token_accuracy", "eval_accuracy", "eval_targets"):
            assert rank["metrics"][key] == pytest.approx(two["metrics"][key], rel=1e-6), key


def _one_target_per_row(rank: int, world: int, output_dir: str, cp_size: int, loss_kwargs: bool = True) -> dict:
    """SFT without `average_tokens_across_devices` (each process's batch its own mean) on rows with one target each
    (the token at position 40; a prompt-completion row whose completion is its EOS), batches of one row: one training
    step, then evaluation. Without `loss_kwargs`, the model is taken for one whose forward takes no loss keywords
    (`model_accepts_loss_kwargs` False: the Trainer counts no targets), with two accumulated batches a step."""
    from hf_sparse_cp import SparseSFTConfig as SFTConfig
    from hf_sparse_cp import SparseSFTTrainer as SFTTrainer

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      HF_HUB_DISABLE_TELEMETRY="1", HF_HUB_OFFLINE="1")
    torch.manual_seed(0)
    tokenizer = byte_tokenizer()
    model = AutoModelForCausalLM.from_config(tiny_config("llama", vocab_size=len(tokenizer)))
    rows = datasets.Dataset.from_dict({"input_ids": [tokenizer(text)["input_ids"] for text in _texts(3)]})

    def collate(batch):
        lengths = torch.tensor([len(row["input_ids"]) for row in batch])
        ids = torch.tensor([row["input_ids"] + [0] * (int(lengths.max()) - len(row["input_ids"])) for row in batch])
        labels = torch.full_like(ids, -100)
        labels[:, 40] = ids[:, 40]
        mask = (torch.arange(ids.shape[1]) < lengths[:, None]).long()
        return {"input_ids": ids, "labels": labels, "attention_mask": mask}

    plugin = {"cp_size": cp_size} if cp_size > 1 else {}
    args = SFTConfig(output_dir=output_dir, **{**SFT, "max_steps": 1, "packing": False, "padding_free": False},
                     **PATTERN, **plugin, average_tokens_across_devices=False, per_device_eval_batch_size=1,
                     gradient_accumulation_steps=1 if loss_kwargs else 2,
                     dataset_kwargs={"skip_prepare_dataset": True}, remove_unused_columns=False)
    trainer = SFTTrainer(model=model, args=args, train_dataset=rows, eval_dataset=rows, processing_class=tokenizer,
                         data_collator=collate)
    trainer.model_accepts_loss_kwargs = loss_kwargs
    trainer.train()
    (log,) = [log for log in trainer.state.log_history if "loss" in log]
    return {"loss": log["loss"], "grad_norm": log["grad_norm"], "eval_loss": trainer.evaluate()["eval_loss"]}


def test_sft_without_averaging_tokens_across_devices_under_cp2_equals_one_process_on_a_single_target(tmp_path):
    """Without --average_tokens_across_devices a CP rank's label count was the CP group's over the CP degree: half a
    token for a batch with one target under CP 2, which TRL's loss clamps to 1 (`num_tokens.clamp(min=1)`), so the
    loss was halved (eval_loss 2.7836 against one process's 5.5672; the step's loss and grad_norm 2.835 / 7.44
    against 5.669 / 14.88). The count is now the group's whole count, as with the flag on."""
    one = run_gloo(_one_target_per_row, 1, str(tmp_path / "one"), 1, timeout_s=300)[0]
    for rank in run_gloo(_one_target_per_row, 2, str(tmp_path / "cp2"), 2, timeout_s=300):
        for key in ("loss", "grad_norm", "eval_loss"):
            assert rank[key] == pytest.approx(one[key], rel=1e-5), key


def test_sft_of_a_model_whose_forward_takes_no_loss_keywords_under_cp2_equals_one_process(tmp_path):
    """For a model whose forward takes no loss keywords the Trainer counts no targets, and TRL's loss divided each
    rank's shard's sum by the shard's own count: a shard's mean, whose mean over the CP group is not the batch's (a
    row's one target on one rank: half its loss). The step's loss and grad_norm, with two accumulated batches, and
    eval_loss now equal one process's."""
    one = run_gloo(_one_target_per_row, 1, str(tmp_path / "one"), 1, False, timeout_s=300)[0]
    for rank in run_gloo(_one_target_per_row, 2, str(tmp_path / "cp2"), 2, False, timeout_s=300):
        for key in ("loss", "grad_norm", "eval_loss"):
            assert rank[key] == pytest.approx(one[key], rel=1e-5), key


def _through_a_cp_schedule(rank: int, world: int, output_dir: str) -> dict:
    """TRL's packed SFT (rows of several documents, their lengths in `seq_lengths`) cropped to 128 tokens at step 0 and
    192 from step 1, on CP `world` (from step 1 head-parallel): `_train`'s result."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    mode = ":cp_mode=ulysses" if world > 1 else ""
    return _train(output_dir, cp_schedule=f"0:128:{world},1:192:{world}{mode}")[1]


def test_packed_sft_through_a_cp_schedule_equals_one_process(tmp_path):
    """A stage cropped a packed row's tokens but not its document lengths (`seq_lengths`, TRL's packing), from which
    TRL's collator builds the position_ids: every run stopped as it began, on an IndexError in the collator ('The
    shape of the mask [1, 231] ... does not match ... [1, 128]'). Each stage now trains the documents of the row's
    first tokens, the last one cut, under CP 2 as one process does."""
    one = run_gloo(_through_a_cp_schedule, 1, str(tmp_path / "one"), timeout_s=300)[0]
    for rank in run_gloo(_through_a_cp_schedule, 2, str(tmp_path / "cp2"), timeout_s=300):
        for key in ("loss", "grad_norm", "entropy", "mean_token_accuracy"):
            assert len(rank[key]) == 2 and rank[key] == pytest.approx(one[key], rel=1e-4), key
        for name, total in one["weights"].items():
            assert rank["weights"][name] == pytest.approx(total, rel=1e-4, abs=1e-4), name
