"""The model card of a run with the plugin (issue #15): what it states about sparse long-context training,
the batch size and optimizer lines the stock card gets wrong, and a saved model that needs no plugin."""

import dataclasses
import importlib.metadata
import json
import os
import re
import subprocess
import sys

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments, default_data_collator
from transformers.modelcard import extract_hyperparameters_from_trainer

from hf_sparse_cp import (
    SparseAttentionConfig,
    attach_to_trainer,
    disable_sparse_attention,
    enable_sparse_attention,
    install_smet,
)
from hf_sparse_cp.checkpoint_marker import MARKER
from hf_sparse_cp.distributed import ContextParallelConfig
from hf_sparse_cp.examples.passkey import passkey_dataset
from hf_sparse_cp.examples.tokenizer import byte_tokenizer
from hf_sparse_cp.reporting.card_metadata import TAGS
from hf_sparse_cp.reporting.kept_fraction_figure import mean_kept_fraction_per_layer
from hf_sparse_cp.reporting.model_card import KEPT_FRACTION_PLOT, RESULTS_TITLE, SECTION_TITLE, write_sparse_model_card
from hf_sparse_cp.smet import SMETConfig
from hf_sparse_cp.testing.tiny_models import tiny_config
from hf_sparse_cp.trainer.arguments import SparseCPArguments

SEQ_LEN = 512
PATTERN = SparseAttentionConfig(block_size=32, min_seq_len=128, vertical_topk=8, slash_topk=16, local_window=32,
                                sink_tokens=4, last_q=32)


def _trainer(output_dir, cp_size: int = 1, smet: bool = True, pattern: SparseAttentionConfig = PATTERN,
             sharding: str = "striped", collator=default_data_collator):
    """A tiny Qwen2 with sparse attention (and SMET) on 512-token passkey rows: 2 per device, 2 accumulated."""
    tok = byte_tokenizer()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("qwen2", vocab_size=len(tok)))
    training = TrainingArguments(output_dir=str(output_dir), max_steps=2, per_device_train_batch_size=2,
                                 gradient_accumulation_steps=2, logging_steps=1, report_to="none", save_strategy="no",
                                 use_cpu=True)
    sparse = SparseCPArguments(sparse_attention=True)
    enable_sparse_attention(model, sparse, pattern, training, max_length=SEQ_LEN)
    trainer = Trainer(model=model, args=training, train_dataset=passkey_dataset(tok, 8, SEQ_LEN),
                      data_collator=collator, processing_class=tok)
    parallel = attach_to_trainer(trainer, sparse, ContextParallelConfig(cp_size=cp_size, cp_sharding=sharding))
    if smet:
        install_smet(trainer, SMETConfig(density=0.5, update_interval=2))
    return trainer, parallel


def _measured_throughput(log_history: list[dict]) -> str:
    """The card's throughput row: the mean of the logged tokens per second (issue #52: measured, not estimated)."""
    measured = [log["tokens_per_second"] for log in log_history if "tokens_per_second" in log]
    assert measured and all(log["peak_memory_gib"] > 0 for log in log_history if "tokens_per_second" in log)
    return f"| throughput | {sum(measured) / len(measured):,.0f} tokens/s (measured"


def _front_matter(card: str) -> dict:
    assert card.startswith("---\n")
    return yaml.safe_load(card[4:card.index("\n---\n", 3)])


@pytest.fixture(scope="module")
def smet_run(tmp_path_factory):
    """A trained tiny run with SMET and sparse attention, and its card."""
    trainer, parallel = _trainer(tmp_path_factory.mktemp("smet_run"))
    trainer.train()
    path = write_sparse_model_card(trainer, parallel=parallel, max_length=SEQ_LEN)
    yield trainer, parallel, path
    disable_sparse_attention(trainer.model)


def test_the_card_describes_the_sparse_training(smet_run):
    trainer, _, path = smet_run
    card = path.read_text()
    assert set(TAGS) | {"generated_from_trainer"} <= set(_front_matter(card)["tags"])
    assert "| sequence length | 512 tokens |" in card
    assert "top-k: 8 key columns and 16 diagonals per head" in card and "blocks of 32 tokens" in card
    assert "slash_topk: 16" in card  # the full pattern config
    assert "| context parallelism |" not in card and "| distributed set-up | 1 CPU process |" in card
    # the stock card named AdamW; the optimizer was SMET over it
    optimizer = re.findall(r"^- optimizer: (.*)$", card, re.MULTILINE)
    assert len(optimizer) == 1 and optimizer[0].startswith("SMET (sparse_weights, density 0.5, blocks of 16 columns")
    assert "adamw_torch" in optimizer[0] and "OptimizerNames" not in card
    assert "mode: sparse_weights" in card and "update_interval: 2" in card  # the SMET config
    # one process: 2 per device x 2 accumulated
    assert "- total_train_batch_size: 4\n" in card and "| total train batch size | 4 distinct sequences" in card
    means = mean_kept_fraction_per_layer(trainer.state.log_history)
    assert sorted(means) == [0, 1] and means[0] == 1 and 0 < means[1] < 1  # layer 0 dense (the default), 1 sparse
    assert "first 1 layer(s) dense" in card
    for layer, value in means.items():
        assert f"| {layer} | {value:.3f} |" in card
    assert f"**{sum(means.values()) / 2:.3f}** over all layers" in card
    assert _measured_throughput(trainer.state.log_history) in card
    assert f"]({KEPT_FRACTION_PLOT})" in card
    assert (path.parent / KEPT_FRACTION_PLOT).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "This model was trained from scratch on an unknown dataset." in card  # not a link to an empty base model


def test_the_cards_metadata_is_what_a_hub_page_accepts(smet_run, tmp_path):
    """license as a lowercase id; base_model a Hub id, or omitted for a local model (the stock card's link to it
    named as local); datasets only Hub ids; all settable by the card's arguments."""
    trainer, parallel, path = smet_run
    local_model, local_data = tmp_path / "my_model", tmp_path / "corpus.txt"
    local_model.mkdir()
    local_data.write_text("x")
    card = write_sparse_model_card(trainer, parallel=parallel, max_length=SEQ_LEN, license="Apache-2.0",
                                   finetuned_from=str(local_model), dataset_tags=[str(local_data), "wikitext"]
                                   ).read_text()
    meta = _front_matter(card)
    assert meta["license"] == "apache-2.0" and "base_model" not in meta and meta["datasets"] == ["wikitext"]
    assert f"fine-tuned version of a local model (`{local_model}`)" in card and "huggingface.co/" + str(
        local_model) not in card
    assert f"| base model | `{local_model}` (a local model) |" in card
    card = write_sparse_model_card(trainer, parallel=parallel, max_length=SEQ_LEN, base_model="Qwen/Qwen2.5-0.5B",
                                   datasets="trl-lib/Capybara").read_text()
    meta = _front_matter(card)
    assert meta["base_model"] == "Qwen/Qwen2.5-0.5B" and meta["datasets"] == ["trl-lib/Capybara"]
    assert card.count("### Framework versions") == 1


def test_a_streaming_datasets_generator_is_named_no_dataset(smet_run, monkeypatch):
    """run_clm.py --streaming trains on an IterableDataset.from_generator (its split of a text file), whose builder
    `datasets` records as 'generator': the stock card named it a Hub dataset (`datasets: [generator]`, 'on the
    generator dataset')."""
    from datasets import IterableDataset

    trainer, parallel, _ = smet_run
    rows = list(trainer.train_dataset)
    monkeypatch.setattr(trainer, "train_dataset", IterableDataset.from_generator(lambda: iter(rows)))
    card = write_sparse_model_card(trainer, parallel=parallel, max_length=SEQ_LEN).read_text()
    assert "datasets" not in _front_matter(card) and "generator" not in card, card
    assert "This model was trained from scratch on an unknown dataset." in card


def test_a_card_of_accelerates_cp_over_a_tensor_parallel_mesh_counts_its_data_parallel_ranks(smet_run, tmp_path,
                                                                                                 monkeypatch):
    """Without the plugin's layout (`parallel` not given), the card reads the CP degree and the data-parallel one from
    accelerate's ParallelismConfig: on 8 processes of dp_shard 2 x cp 2 x tp 2 the DP degree is 2 (#50: the card
    divided the processes by the CP degree alone, 'DP 4', and stated an evaluation batch of 4 ranks', beside the
    Trainer's training batch of 2 ranks')."""
    from accelerate.parallelism_config import ParallelismConfig

    trainer, _, _ = smet_run
    mesh = ParallelismConfig(dp_shard_size=2, cp_size=2, tp_size=2)
    monkeypatch.setattr(type(trainer.accelerator), "parallelism_config", property(lambda self: mesh))
    monkeypatch.setattr(TrainingArguments, "world_size", property(lambda self: 8))
    monkeypatch.setattr(trainer.args, "output_dir", str(tmp_path))
    card = write_sparse_model_card(trainer, max_length=SEQ_LEN).read_text()
    assert "| context parallelism | CP 2 x DP 2 x TP 2 (8 processes); sharding and ring not recorded |" in card, card
    # (2 per device x 2 accumulated x DP 2, each sequence once; the evaluation batch: 8 per device x DP 2)
    assert "- total_train_batch_size: 8 (distinct sequences; each is split over 2 context-parallel ranks)" in card
    assert f"- total_eval_batch_size: {trainer.args.eval_batch_size * 2}\n" in card, card


def test_writing_the_card_again_amends_the_fresh_stock_card_once(smet_run):
    trainer, parallel, path = smet_run
    write_sparse_model_card(trainer, parallel=parallel, max_length=SEQ_LEN, tags=["passkey"])
    card = path.read_text()
    assert card.count(SECTION_TITLE) == 1
    tags = _front_matter(card)["tags"]
    assert "passkey" in tags and all(tags.count(tag) == 1 for tag in TAGS)


def test_without_matplotlib_the_card_says_what_to_install(smet_run, tmp_path, monkeypatch):
    trainer, parallel, _ = smet_run
    monkeypatch.setattr(trainer.args, "output_dir", str(tmp_path))
    for name in ("matplotlib", "matplotlib.figure"):
        monkeypatch.setitem(sys.modules, name, None)  # importing it raises ImportError
    card = write_sparse_model_card(trainer, parallel=parallel, max_length=SEQ_LEN).read_text()
    assert "needs matplotlib: `pip install 'hf-sparse-cp[plot]'`" in card
    assert not (tmp_path / KEPT_FRACTION_PLOT).exists()


def test_a_card_written_before_training_keeps_the_stock_optimizer(tmp_path):
    trainer, parallel = _trainer(tmp_path, smet=False)
    try:
        card = write_sparse_model_card(trainer, parallel=parallel).read_text()
    finally:
        disable_sparse_attention(trainer.model)
    assert re.search(r"^- optimizer: Use \S*ADAMW", card, re.MULTILINE | re.IGNORECASE)
    assert "| sequence length | not recorded |" in card and "| throughput | not measured" in card
    assert "Not logged" in card and not (tmp_path / KEPT_FRACTION_PLOT).exists()
    assert "SMET config" not in card


# Run in a fresh interpreter that never imports hf_sparse_cp: load with SDPA, compare logits, generate.
LOAD_WITHOUT_PLUGIN = """
import sys, torch
from transformers import AttentionInterface, AutoModelForCausalLM
folder = sys.argv[1]
ids, expected = torch.load(folder + "/expected.pt")
model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa")
assert model.config._attn_implementation == "sdpa"
with torch.no_grad():
    logits = model(input_ids=ids).logits
torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
generated = model.generate(ids, max_new_tokens=5, do_sample=False)
default = AutoModelForCausalLM.from_pretrained(folder)  # no attn_implementation: whatever the model defaults to
assert torch.equal(default.generate(ids, max_new_tokens=5, do_sample=False), generated)
assert "hf_sparse_cp" not in sys.modules and "sparse_cp" not in AttentionInterface._global_mapping
print(generated.shape[1] - ids.shape[1])
"""


def test_the_saved_model_loads_and_generates_without_the_plugin(smet_run, tmp_path):
    trainer, _, _ = smet_run
    trainer.save_model(str(tmp_path))
    assert "sparse_cp" not in (tmp_path / "config.json").read_text().replace('"sparse_attention"', "")
    ids = torch.arange(64).remainder(200).add(3).view(1, 64)
    with torch.no_grad():  # under 128 tokens (min_seq_len) sparse_cp is exact dense attention
        expected = trainer.model(input_ids=ids).logits
    torch.save((ids, expected), tmp_path / "expected.pt")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-c", LOAD_WITHOUT_PLUGIN, str(tmp_path)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-1] == "5"


def _card_under_cp2(rank: int, world: int, output_dir: str, smet: bool = True, sharding: str = "striped",
                    collator=default_data_collator) -> dict | None:
    """Two processes, one CP group: train two steps, write the card (rank 0 only)."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    trainer, parallel = _trainer(output_dir, cp_size=2, smet=smet, sharding=sharding, collator=collator)
    trainer.train()
    path = write_sparse_model_card(trainer, parallel=parallel, max_length=SEQ_LEN)
    disable_sparse_attention(trainer.model)
    if path is None:
        return None
    stock = extract_hyperparameters_from_trainer(trainer)["total_train_batch_size"]
    return {"card": path.read_text(), "stock_total": stock, "log": trainer.state.log_history}


def _cards_under_cp2(rank: int, world: int, output_dir: str) -> dict | None:
    """The CP run with SMET (striped) and without (the document planner; the same with a packing collator), one after
    the other in the same two processes."""
    from transformers import DataCollatorWithFlattening

    collators = {"cp_packed": DataCollatorWithFlattening()}
    runs = {name: _card_under_cp2(rank, world, os.path.join(output_dir, name), smet=name == "cp_smet",
                                  sharding="striped" if name == "cp_smet" else "document",
                                  collator=collators.get(name, default_data_collator))
            for name in ("cp_smet", "cp", "cp_packed")}
    return None if runs["cp"] is None else runs


@pytest.fixture(scope="module")
def cp_runs(tmp_path_factory):
    from hf_sparse_cp.testing.spawn import run_gloo

    out = tmp_path_factory.mktemp("cp_runs")
    main, other = run_gloo(_cards_under_cp2, 2, str(out), timeout_s=400)
    assert other is None  # only the main process writes
    return main, out


def test_the_card_of_a_cp2_run_counts_distinct_sequences(cp_runs):
    runs, tmp_path = cp_runs
    main, tmp_path = runs["cp_smet"], tmp_path / "cp_smet"
    card = main["card"]
    # 2 per device x 2 accumulated x 2 processes = 8 rows read, but both ranks of the CP group read the same 4
    assert main["stock_total"] == 8
    assert "- total_train_batch_size: 4 (distinct sequences; each is split over 2 context-parallel ranks)" in card
    assert "- num_devices: 2" in card and "| total train batch size | 4 distinct sequences" in card
    assert ("| context parallelism | CP 2 x DP 1 (2 processes): each sequence split over 2 ranks, striped sharding, "
            "flat ring |") in card
    assert card.count("- optimizer: SMET (") == 1
    means = mean_kept_fraction_per_layer(main["log"])
    assert means[0] == 1 and 0 < means[1] < 1  # layer 0 dense (the default), 1 sparse
    assert all(f"| {layer} | {v:.3f} |" in card for layer, v in means.items())
    assert (tmp_path / KEPT_FRACTION_PLOT).is_file()
    assert _measured_throughput(main["log"]) in card  # (each CP group's tokens counted once: the step metrics)
    # the document planner's count is one process's on the same row, as a block sharding's (#50: it counted the
    # documents block aligned, which the card then said)
    assert "document sharding" in runs["cp"]["card"] and "BlockAlignedFlattening" not in runs["cp"]["card"]
    assert set(TAGS) <= set(_front_matter(card)["tags"])
    # a packing collator under CP: the 4 examples a step reads are packed 2 to a sequence, each sequence split over
    # the 2 ranks (the CP branch of the line; the one-process table row is tested below)
    packed = runs["cp_packed"]["card"]
    assert ("- total_train_batch_size: 4 (examples, packed into 2 distinct sequences; each is split over 2 "
            "context-parallel ranks)") in packed, packed
    assert _rows(packed)["total train batch size"] == "4 examples per optimizer step, packed into 2 distinct sequences"


def _rows(card: str) -> dict[str, str]:
    """The plugin section's table: row name -> value."""
    section = card[card.index(SECTION_TITLE):]
    table = section[:section.index(RESULTS_TITLE)]
    return {m[1]: m[2] for m in re.finditer(r"^\| ([a-z][^|]*?) \| (.*) \|$", table, re.MULTILINE)}


def _check_statements(card: str, trainer_args: dict, log_history: list[dict], *, processes: int, cp: int,
                      smet: SMETConfig | None, pattern: SparseAttentionConfig) -> None:
    """Every statement of the card, against the run's settings."""
    rows = _rows(card)
    intro = card[card.index(SECTION_TITLE):].splitlines()[2]
    # what the run used, and only that
    assert ("context parallelism" in intro) == (cp > 1) and ("SMET" in intro) == (smet is not None), intro
    assert ("context parallelism" in rows) == (cp > 1) and ("SMET config:" in card) == (smet is not None)
    assert card.count("- optimizer: SMET (") == (smet is not None)
    assert rows["base model"] == "none: trained from a config (random initialization)"
    assert rows["training data"] == "8 training sequences"  # an in-memory dataset: its size, no name
    assert rows["sequence length"] == f"{SEQ_LEN} tokens"
    # the distributed set-up: CPU processes joined by gloo, not "multi-GPU"
    assert rows["distributed set-up"] == (
        "1 CPU process" if processes == 1 else f"{processes} CPU processes (gloo), data parallel (DDP)" if cp == 1
        else f"{processes} CPU processes (gloo), gradients averaged over the processes by DDP")  # (no DDP by DP 1)
    assert "multi-GPU" not in card and ("- distributed_type: multi-CPU (gloo)" in card) == (processes > 1)
    if cp > 1:
        assert rows["context parallelism"].startswith(f"CP {cp} x DP {processes // cp} ({processes} processes)")
    # the pattern as configured; no "documents under 0 tokens"
    assert "under 0 tokens" not in card
    assert (f"documents under {pattern.min_seq_len:,} tokens dense" in rows["attention"]) == (pattern.min_seq_len > 0)
    assert pattern.budget.describe() in rows["attention"]
    yaml_blocks = re.findall(r"```yaml\n(.*?)```", card, re.S)
    assert yaml.safe_load(yaml_blocks[0]) == pattern.to_dict()
    if smet is not None:  # the regrowth rule, the same in the table and the YAML
        saved = yaml.safe_load(yaml_blocks[1])
        assert f"{saved['regrowth']} regrowth" in rows["optimizer"] and saved["regrowth"] == smet.regrowth_rule
        assert saved["density"] == smet.density and f"density {smet.density}" in rows["optimizer"]
    batch = trainer_args["per_device_train_batch_size"] * trainer_args["gradient_accumulation_steps"] * (
        processes // cp)
    assert rows["total train batch size"] == f"{batch} distinct sequences per optimizer step"
    # the results: every logged loss, the final loss
    losses = [log for log in log_history if "loss" in log]
    for log in losses:
        assert f"| {log['step']} | {log['epoch']:.3g} | {log['loss']:.4f} |" in card
    final = log_history[-1]
    assert f"Final training loss (mean over the run): **{final['train_loss']:.4f}** after {final['step']} steps" in card
    assert "eval loss" not in card  # no evaluation ran
    assert card.count(RESULTS_TITLE) == 1  # the plugin's, the stock card's (empty) given way to it
    # the versions that trained it (no TRL, no PEFT in these runs), in the stock card's one section, and how to
    # load it; metadata a Hub page accepts: no base model (trained from a config), no dataset (in memory)
    assert card.count("### Framework versions") == 1
    for package, name in (("hf-sparse-cp", "hf-sparse-cp"), ("transformers", "Transformers"),
                          ("accelerate", "Accelerate"), ("torch", "Pytorch")):
        assert f"\n- {name} {importlib.metadata.version(package)}\n" in card, package
    assert "TRL" not in card and "PEFT" not in card and "| license |" not in card
    assert not {"base_model", "datasets"} & set(_front_matter(card))
    assert f'AutoModelForCausalLM.from_pretrained("{trainer_args["output_dir"]}")' in card


def test_the_cards_of_a_plain_a_cp_and_a_cp_smet_run_state_what_each_run_did(tmp_path, cp_runs):
    pattern = dataclasses.replace(PATTERN, min_seq_len=0)  # every document sparse: no "documents under" clause
    trainer, parallel = _trainer(tmp_path / "plain", smet=False, pattern=pattern)
    try:
        trainer.train()
        card = write_sparse_model_card(trainer, parallel=parallel, max_length=SEQ_LEN, license="apache-2.0").read_text()
    finally:
        disable_sparse_attention(trainer.model)
    plain_args = trainer.args.to_dict()
    check = dict(trainer_args=plain_args, pattern=PATTERN)
    _check_statements(card.replace("| license | apache-2.0 |\n", ""), plain_args, trainer.state.log_history,
                      processes=1, cp=1, smet=None, pattern=pattern)
    assert "| license | apache-2.0 |" in card and _front_matter(card)["license"] == "apache-2.0"
    runs, out = cp_runs
    for name, smet in (("cp", None), ("cp_smet", SMETConfig(density=0.5, update_interval=2))):
        args = dict(check["trainer_args"], output_dir=str(out / name))
        _check_statements(runs[name]["card"], args, runs[name]["log"], processes=2, cp=2, smet=smet,
                          pattern=PATTERN)


def test_the_card_parses_with_huggingface_hubs_parser(smet_run):
    """The stock card amended by the plugin: huggingface_hub's card parser reads its metadata without error (the
    model-index results included), with the plugin's tags."""
    from huggingface_hub import ModelCard

    _, _, path = smet_run
    card = ModelCard.load(path, ignore_metadata_errors=False)
    assert {"hf-sparse-cp", "sparse-attention", "long-context"} <= set(card.data.tags)
    assert card.text.count("Quick start") == 1


def test_a_folder_an_earlier_run_saved_names_its_recorded_base_model(tmp_path):
    from hf_sparse_cp.reporting.card_metadata import recorded_base_model

    (tmp_path / "README.md").write_text("---\nbase_model: Qwen/Qwen2.5-0.5B\n---\n# card\n")
    assert recorded_base_model(str(tmp_path)) == "Qwen/Qwen2.5-0.5B"
    assert recorded_base_model("Qwen/Qwen2.5-3B") == "Qwen/Qwen2.5-3B"
    (tmp_path / "README.md").write_text("# a card without metadata\n")
    assert recorded_base_model(str(tmp_path)) == str(tmp_path)


def test_a_card_without_a_saved_tokenizer_loads_no_tokenizer(smet_run, tmp_path, monkeypatch):
    """The quick start names a tokenizer only where one is saved with the model (files in the folder, or the
    Trainer's processing class, which it saves with the model)."""
    trainer, parallel, _ = smet_run
    monkeypatch.setattr(trainer.args, "output_dir", str(tmp_path))
    monkeypatch.setattr(trainer, "processing_class", None)
    card = write_sparse_model_card(trainer, parallel=parallel, max_length=SEQ_LEN).read_text()
    assert f'AutoModelForCausalLM.from_pretrained("{tmp_path}")' in card and "AutoTokenizer" not in card
    assert "Sparse attention config (saved in config.json as `sparse_attention`)" in card
    byte_tokenizer().save_pretrained(str(tmp_path))
    card = write_sparse_model_card(trainer, parallel=parallel, max_length=SEQ_LEN).read_text()
    assert f'tokenizer = AutoTokenizer.from_pretrained("{tmp_path}")' in card


def _python_blocks(card: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```$", card, re.MULTILINE | re.DOTALL)


def test_the_card_of_a_lora_run_says_no_folder_holds_an_adapter_none_saved_there(tmp_path):
    """A LoRA run's card written before its adapter was saved said that no model was saved in the output folder, then
    "This folder holds a PEFT adapter" (so did one loading the last checkpoint, which is not that folder)."""
    from types import SimpleNamespace

    from peft import LoraConfig, get_peft_model

    from hf_sparse_cp.reporting.card_quick_start import quick_start

    model = get_peft_model(AutoModelForCausalLM.from_config(tiny_config("llama")),
                           LoraConfig(r=4, target_modules=["q_proj"]))
    trainer = SimpleNamespace(args=SimpleNamespace(output_dir=str(tmp_path)), processing_class=None,
                              data_collator=None, accelerator=SimpleNamespace(unwrap_model=lambda m: m), model=model)
    card = "\n".join(quick_start(trainer, None, tmp_path))
    assert f"No model was saved in `{tmp_path}`" in card and "This folder holds" not in card
    assert "The model is a PEFT adapter (adapter_config.json and its weights), not a whole model" in card


def test_the_card_of_a_lora_run_loads_the_adapter_as_it_says(tmp_path, monkeypatch):
    """A LoRA run saves an adapter (adapter_config.json and its weights, no config.json): its card keeps the pattern
    itself, loads the adapter onto its base model (both quick-start snippets run as written, the second one with the
    trained pattern), loads the tokenizer saved beside it, and names no empty adapter base in its tags."""
    from peft import LoraConfig, PeftModel, get_peft_model

    from hf_sparse_cp import SparseTrainer, SparseTrainingArguments

    base_dir, out = tmp_path / "base", tmp_path / "adapter"
    tok = byte_tokenizer()
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_config("llama", vocab_size=len(tok))).save_pretrained(str(base_dir))
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(str(base_dir)),
                           LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    args = SparseTrainingArguments(output_dir=str(out), max_steps=1, per_device_train_batch_size=1, report_to="none",
                                   save_strategy="no", use_cpu=True, sparse_block_size=32, sparse_min_seq_len=128,
                                   sparse_vertical_topk=8, sparse_slash_topk=16)
    trainer = SparseTrainer(model=model, args=args, train_dataset=passkey_dataset(tok, 1, 256),
                            data_collator=default_data_collator, processing_class=tok)
    try:
        trainer.train()
        trainer.save_model()  # writes the card
        pattern = SparseAttentionConfig.stored_on(trainer.model.config)
    finally:
        disable_sparse_attention(trainer.model)
    assert (out / "adapter_config.json").is_file() and not (out / "config.json").exists()
    card = (out / "README.md").read_text()
    assert "config.json as `sparse_attention`" not in card and "AutoModelForCausalLM.from_pretrained(\"" + str(
        out) not in card
    assert "not saved with the adapter: it has no config.json; this card holds it" in card
    assert not [tag for tag in _front_matter(card)["tags"] if tag.startswith("base_model:adapter:")]  # a local base
    # the stock card links Hub ids only and called a model from a local folder trained from scratch
    assert f"This model is a fine-tuned version of a local model (`{base_dir}`) on" in card
    assert "from scratch" not in card
    load, train_on = _python_blocks(card)
    assert f'AutoModelForCausalLM.from_pretrained("{base_dir}")' in load
    loaded = {}
    exec(load, loaded)  # generates with the saved tokenizer
    assert isinstance(loaded["model"], PeftModel)
    exec(train_on, loaded)
    model = loaded["model"]
    try:
        assert model.config._attn_implementation == "sparse_cp"
        assert SparseAttentionConfig.stored_on(model.config) == pattern and pattern.budget.slash_topk == 16
        assert any(p.requires_grad for name, p in model.named_parameters() if "lora_" in name)
    finally:
        disable_sparse_attention(model)
    # pushed, the card names the repo the Trainer created (without --hub_model_id: <user>/<output folder's name>),
    # not the local folder; with a --hub_model_id never pushed to, the folder
    monkeypatch.setattr(trainer, "hub_model_id", "someone/adapter", raising=False)
    assert 'PeftModel.from_pretrained(base, "someone/adapter")' in write_sparse_model_card(trainer).read_text()
    monkeypatch.setattr(trainer, "hub_model_id", None)
    monkeypatch.setattr(trainer.args, "hub_model_id", "someone/never-pushed")
    assert f'PeftModel.from_pretrained(base, "{out}")' in write_sparse_model_card(trainer).read_text()
    # a Hub base model is named by the adapter tag, as by base_model
    card = write_sparse_model_card(trainer, base_model="Qwen/Qwen2.5-0.5B").read_text()
    assert "base_model:adapter:Qwen/Qwen2.5-0.5B" in _front_matter(card)["tags"]
    hub_link = "[Qwen/Qwen2.5-0.5B](https://huggingface.co/Qwen/Qwen2.5-0.5B)"
    assert f"This model is a fine-tuned version of {hub_link} on" in card


def test_a_length_set_above_the_data_is_stated_beside_the_longest_sequence_trained(tmp_path):
    """--sparse_max_length 4096 on 200-token rows: the card said "4,096 tokens", a length the model never saw."""
    from hf_sparse_cp import SparseTrainer, SparseTrainingArguments

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama"))
    rows = [{"input_ids": ids, "labels": ids} for ids in torch.randint(3, 200, (2, 200)).unbind()]
    args = SparseTrainingArguments(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=1,
                                   report_to="none", save_strategy="no", use_cpu=True, logging_steps=5,
                                   sparse_max_length=4096, sparse_block_size=32, sparse_min_seq_len=128)
    trainer = SparseTrainer(model=model, args=args, train_dataset=rows)
    trainer.train()  # (no training log before its end: the longest row is gathered as training ends)
    trainer.create_model_card()
    card = (tmp_path / "README.md").read_text()
    assert "| sequence length | 4,096 tokens set; the longest sequence trained held 200 |" in card, card


def test_a_run_that_sets_no_length_states_the_longest_sequence_trained_and_no_set_length(tmp_path):
    """#50: without --sparse_max_length the trainer takes the first row's length (96) for its pattern; the card
    called it set: "96 tokens set; the longest sequence trained held 144", where nothing set a length."""
    from padding import pad_collate

    from hf_sparse_cp import SparseTrainer, SparseTrainingArguments

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama"))
    rows = [{"input_ids": ids, "labels": ids} for ids in (torch.randint(3, 200, (n,)) for n in (96, 144))]
    args = SparseTrainingArguments(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=2,
                                   report_to="none", save_strategy="no", use_cpu=True, sparse_block_size=32,
                                   sparse_min_seq_len=128)
    trainer = SparseTrainer(model=model, args=args, train_dataset=rows, data_collator=pad_collate)
    trainer.train()
    trainer.create_model_card()
    card = (tmp_path / "README.md").read_text()
    assert "| sequence length | 144 tokens (the longest sequence trained) |" in card, card


def test_a_dense_run_of_a_model_saved_by_a_sparse_run_is_described_as_dense(tmp_path):
    """#50: a model saved by a sparse run keeps its pattern in config.json (`sparse_attention`); a dense run of it
    (--sparse_attention false, sdpa) had a card saying it trained with that pattern ("attention | `sparse_cp`:
    vertical-slash ...")."""
    from hf_sparse_cp import SparseTrainer, SparseTrainingArguments
    from hf_sparse_cp.config.sparse_attention import MODEL_CONFIG_ATTRIBUTE

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama"))
    setattr(model.config, MODEL_CONFIG_ATTRIBUTE, PATTERN.to_dict())  # (what a sparse run's save leaves)
    model.save_pretrained(str(tmp_path / "sparse_run"))
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "sparse_run"), attn_implementation="sdpa")
    rows = [{"input_ids": ids, "labels": ids} for ids in torch.randint(3, 200, (2, 160)).unbind()]
    args = SparseTrainingArguments(output_dir=str(tmp_path / "dense"), max_steps=1, per_device_train_batch_size=2,
                                   report_to="none", save_strategy="no", use_cpu=True, sparse_attention=False)
    trainer = SparseTrainer(model=model, args=args, train_dataset=rows, data_collator=default_data_collator)
    trainer.train()
    trainer.save_model()  # writes the card
    card = (tmp_path / "dense" / "README.md").read_text()
    assert "| attention | dense (the sparse_cp backend was not used) |" in card, card
    assert "vertical-slash" not in card and "Sparse attention config" not in card


def test_a_packing_collators_examples_are_not_counted_as_sequences(tmp_path):
    """#50: a DataCollatorWithFlattening packing 2 documents of 128 tokens into each 256-token row: the card said
    "4 training sequences" and "2 distinct sequences per optimizer step" beside "sequence length 256 tokens",
    twice the tokens each step trained."""
    from transformers import DataCollatorWithFlattening

    from hf_sparse_cp import SparseTrainer, SparseTrainingArguments

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama"))
    rows = [{"input_ids": ids} for ids in torch.randint(3, 200, (4, 128)).tolist()]
    args = SparseTrainingArguments(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=2,
                                   report_to="none", save_strategy="no", use_cpu=True, logging_steps=1,
                                   sparse_max_length=256, sparse_block_size=32, sparse_min_seq_len=128)
    trainer = SparseTrainer(model=model, args=args, train_dataset=rows, data_collator=DataCollatorWithFlattening())
    trainer.train()
    trainer.create_model_card()
    table = _rows((tmp_path / "README.md").read_text())
    assert table["sequence length"].startswith("256 tokens (documents packed into each sequence"), table
    assert table["training data"] == "4 training examples (the collator packs each device batch of 2 into one sequence)"
    assert table["total train batch size"] == "2 examples per optimizer step, packed into 1 distinct sequence"
    # a curriculum's card states each stage's examples and the sequences they are packed into (it said sequences)
    from hf_sparse_cp.distributed import ParallelDims
    from hf_sparse_cp.reporting.model_card import CardStage

    one = ParallelDims.from_config(ContextParallelConfig())
    write_sparse_model_card(trainer, cp_schedule="0:256:1,1:256:1", max_length=256,
                            cp_stages=[CardStage(0, 256, one), CardStage(1, 256, one)])
    card = (tmp_path / "README.md").read_text()
    stages = "2 from step 0 (packed into 1), 2 from step 1 (packed into 1)"
    assert _rows(card)["total train batch size"] == stages.replace(" from", " examples per optimizer step from", 1)


def test_the_card_states_the_density_smet_trains_at_where_whole_blocks_move_it(tmp_path):
    """SMET keeps whole blocks of a row, at least one: density 0.1 of the tiny Qwen2's rows of 4 and 8 blocks of 16
    columns keeps 1 block (0.25, 0.125); the card said 'density 0.1' alone."""
    trainer, parallel = _trainer(tmp_path, smet=False)
    config = SMETConfig(density=0.1, update_interval=2)
    install_smet(trainer, config)
    trainer.train()
    path = write_sparse_model_card(trainer, parallel=parallel, max_length=SEQ_LEN)
    targets = [m.weight for name, m in trainer.model.named_modules()
               if name.rsplit(".", 1)[-1] in config.target_modules]
    blocks = [(w.shape[0], w.shape[1] // config.block_size) for w in targets]
    kept = sum(rows * max(1, round(0.1 * b)) for rows, b in blocks) / sum(rows * b for rows, b in blocks)
    assert kept > 0.11
    optimizer = re.findall(r"^- optimizer: (.*)$", path.read_text(), re.MULTILINE)
    assert optimizer[0].startswith(f"SMET (sparse_weights, density 0.1 asked, {kept:.3g} trained (whole blocks of "
                                   "16 columns per row, at least one)")
    disable_sparse_attention(trainer.model)


@pytest.mark.parametrize(("first_step", "wanted"), [
    (0, "mean over the run"), (2, "mean over steps 3-5, trained after resuming from step 2"),
    (4, "mean over step 5, trained after resuming from step 4")])
def test_the_final_loss_line_names_the_steps_the_trainer_averaged(first_step, wanted):
    """The Trainer's train_loss averages the steps of its last train() call: after a resume, those since its checkpoint
    (one step where transformers trains one past max_steps after a resume from the final checkpoint)."""
    from hf_sparse_cp.reporting.model_card import _results

    logs = [{"loss": 2.0 - step / 10, "step": step, "epoch": step / 5} for step in range(1, 6)]
    (line,) = [line for line in _results([*logs, {"train_loss": 1.6, "step": 5}], first_step) if "Final" in line]
    assert f"Final training loss ({wanted}): **1.6000** after 5 steps." == line


def test_a_lora_card_with_evaluations_has_one_results_section_holding_every_metric(tmp_path):
    """The stock card's "Training results" (its table of evaluations, empty without one) came beside the plugin's
    section's own: two headings of that name in every card (a LoRA run's, with an evaluation, included). The card
    has one, the plugin's, whose evaluation table holds every metric the stock one showed."""
    from peft import LoraConfig, get_peft_model

    from hf_sparse_cp import SparseTrainer, SparseTrainingArguments

    tok = byte_tokenizer()
    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_config(tiny_config("llama", vocab_size=len(tok))),
                           LoraConfig(r=4, target_modules="all-linear", task_type="CAUSAL_LM"))
    args = SparseTrainingArguments(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=1,
                                   logging_steps=1, eval_strategy="steps", eval_steps=1, report_to="none",
                                   save_strategy="no", use_cpu=True, sparse_block_size=32, sparse_min_seq_len=128,
                                   sparse_vertical_topk=8, sparse_slash_topk=16)

    def accuracy(prediction):  # and a count logged as a float, as TRL's num_tokens
        hits = prediction.predictions.argmax(-1)[:, :-1] == prediction.label_ids[:, 1:]
        return {"accuracy": float(hits.mean()), "targets": float(hits.size)}

    trainer = SparseTrainer(model=model, args=args, train_dataset=passkey_dataset(tok, 2, 256),
                            eval_dataset=passkey_dataset(tok, 2, 256), compute_metrics=accuracy,
                            data_collator=default_data_collator, processing_class=tok)
    try:
        trainer.train()
        trainer.save_model()  # writes the card
    finally:
        disable_sparse_attention(trainer.model)
    card = (tmp_path / "README.md").read_text()
    assert card.count("Training results") == 1 and card.index(RESULTS_TITLE) > card.index(SECTION_TITLE)
    evals = [log for log in trainer.state.log_history if "eval_loss" in log]
    assert len(evals) == 2
    assert "| step | eval loss | eval accuracy | eval targets |" in card
    for log in evals:
        assert f"| {log['step']} | {log['eval_loss']:.4f} | {log['eval_accuracy']:.4f} | 510 |" in card
    assert "eval runtime" not in card and "Validation Loss" not in card


@pytest.mark.parametrize("lora", [False, True], ids=["whole model", "lora adapter"])
def test_the_card_of_a_sequence_classifier_loads_it_with_its_head(tmp_path, lora):
    """A run that trains a sequence-classification head: its card's quick start loads the saved model (or the
    adapter's base) with AutoModelForSequenceClassification, the trained `score` head and all, and runs a forward.
    Before, it said AutoModelForCausalLM, which loads the checkpoint into a causal LM whose `lm_head` is new and
    random (the trained head dropped with a warning), and generates from it."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForSequenceClassification

    from hf_sparse_cp import SparseTrainer, SparseTrainingArguments

    base_dir, out = tmp_path / "base", tmp_path / "out"
    tok = byte_tokenizer()
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(tiny_config("llama", vocab_size=len(tok), num_labels=3))
    if lora:
        model.save_pretrained(str(base_dir))
        model = get_peft_model(AutoModelForSequenceClassification.from_pretrained(str(base_dir)),
                               LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="SEQ_CLS"))
    ids = torch.arange(160).remainder(200).add(3)
    rows = [{"input_ids": ids, "attention_mask": torch.ones(160, dtype=torch.long), "labels": torch.tensor(i)}
            for i in range(2)]
    args = SparseTrainingArguments(output_dir=str(out), max_steps=1, per_device_train_batch_size=2, report_to="none",
                                   save_strategy="no", use_cpu=True, learning_rate=0.1, sparse_block_size=16,
                                   sparse_min_seq_len=64, sparse_vertical_topk=2, sparse_slash_topk=2)
    trainer = SparseTrainer(model=model, args=args, train_dataset=rows, data_collator=default_data_collator,
                            processing_class=tok)
    try:
        trainer.train()
        trainer.save_model()  # writes the card
        trained = trainer.model.merge_and_unload() if lora else trainer.model
        trained = {name: value.detach().clone() for name, value in trained.state_dict().items()}
    finally:
        disable_sparse_attention(trainer.model)
    load = _python_blocks((out / "README.md").read_text())[0]
    assert "AutoModelForSequenceClassification.from_pretrained(" in load and "generate" not in load
    loaded = {}
    exec(load, loaded)  # loads the saved tokenizer and runs a forward
    model = loaded["model"].merge_and_unload() if lora else loaded["model"]
    assert type(model).__name__ == "LlamaForSequenceClassification"
    assert model.state_dict().keys() == trained.keys()
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, trained[name], msg=name)


def test_a_dense_runs_card_keeps_no_plot_an_earlier_sparse_run_drew_in_its_folder(tmp_path):
    """#50: `hf-sparse-cp train` into a folder a sparse run had written, with --no_sparse_attention: the card left the
    earlier run's sparse_kept_fraction.png beside it (push_to_hub uploads it), and said the kept fraction was "Not
    logged", naming the logging flag, for a run that had no sparse attention to log; a run that ended before its
    first logging step (logging_steps 500) was said to have its card "written before the first logging step", its final
    loss (the Trainer's mean over the run) left out."""
    from hf_sparse_cp import SparseTrainer, SparseTrainingArguments

    output_dir = tmp_path / "run"
    output_dir.mkdir()
    (output_dir / KEPT_FRACTION_PLOT).write_bytes(b"an earlier sparse run's plot")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama"))
    rows = [{"input_ids": ids, "labels": ids} for ids in torch.randint(3, 200, (2, 160)).unbind()]
    args = SparseTrainingArguments(output_dir=str(output_dir), max_steps=1, per_device_train_batch_size=2,
                                   report_to="none", save_strategy="no", use_cpu=True, sparse_attention=False)
    trainer = SparseTrainer(model=model, args=args, train_dataset=rows, data_collator=default_data_collator)
    trainer.train()
    trainer.save_model()  # writes the card
    card = (output_dir / "README.md").read_text()
    assert not (output_dir / KEPT_FRACTION_PLOT).exists()
    assert "None: dense attention computes every block (a kept fraction of 1.0)." in card and "Not logged" not in card
    final = trainer.state.log_history[-1]["train_loss"]
    assert "No step's loss logged (the run ended before its first logging step, --logging_steps)." in card
    assert f"Final training loss (mean over the run): **{final:.4f}** after 1 steps." in card


def test_the_quick_start_loads_the_model_where_it_is_saved(smet_run, tmp_path, monkeypatch):
    """#50: `hf-sparse-cp train` (no --save_final_model) wrote a card whose quick start loaded the output folder, which
    held no model: it loads the last checkpoint where there is one, and says where nothing is saved yet."""
    trainer, parallel, _ = smet_run
    monkeypatch.setattr(trainer.args, "output_dir", str(tmp_path))
    card = write_sparse_model_card(trainer, parallel=parallel, max_length=SEQ_LEN).read_text()
    assert f"No model was saved in `{tmp_path}` when this card was written: `Trainer.save_model()`" in card
    trainer._save(str(tmp_path / "checkpoint-2"))
    trainer._save(str(tmp_path / "checkpoint-10"))
    card = write_sparse_model_card(trainer, parallel=parallel, max_length=SEQ_LEN).read_text()
    assert (f"No final model is saved in `{tmp_path}`: the code below loads its last checkpoint, `checkpoint-10`."
            in card)
    assert f'AutoModelForCausalLM.from_pretrained("{tmp_path / "checkpoint-10"}")' in card
    # (a run stopped while saving checkpoint-12: its marker says in progress, and the folder may hold no weights yet;
    # transformers' get_last_checkpoint named it)
    (tmp_path / "checkpoint-12").mkdir()
    (tmp_path / "checkpoint-12" / MARKER).write_text(json.dumps({"complete": False, "step": 12}))
    card = write_sparse_model_card(trainer, parallel=parallel, max_length=SEQ_LEN).read_text()
    assert f'AutoModelForCausalLM.from_pretrained("{tmp_path / "checkpoint-10"}")' in card
    trainer.save_model()
    card = write_sparse_model_card(trainer, parallel=parallel, max_length=SEQ_LEN).read_text()
    assert "No final model" not in card and "No model was saved" not in card
    assert f'AutoModelForCausalLM.from_pretrained("{tmp_path}")' in card
