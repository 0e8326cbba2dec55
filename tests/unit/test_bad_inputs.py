"""Inputs that used to be accepted while something else was done (issues #14, #31): the example script, the
config dataclasses and the simulator refuse them, naming the flag or field and the fix; errors that name
their cause and fix."""

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch
from transformers import TrainingArguments

from hf_sparse_cp.distributed import ContextParallelConfig
from hf_sparse_cp.examples.train_long_context import parse_args


@pytest.mark.parametrize(
    "flags, refused",
    [
        (["--sparse_max_length", "0"],
         "--sparse_max_length 0: a training sequence needs at least 2 tokens; e.g. --sparse_max_length 4096"),
        (["--sparse_max_length", "-4096"], "--sparse_max_length -4096: a training sequence needs at least 2 tokens"),
        (["--pack_documents", "0"], "--pack_documents 0 must be >= 1 (1: one document per sequence)"),
        (["--sparse_max_length", "256", "--pack_documents", "512"],
         "--pack_documents 512 leaves documents of 0 tokens in a --sparse_max_length 256 sequence; a document needs "
         "at least 2 tokens: pack at most 128 documents, or raise --sparse_max_length"),
        (["--sparse_max_length", "256", "--pack_documents", "3"],
         "--pack_documents 3 does not divide --sparse_max_length 256: every sequence packs documents of max_length / "
         "pack_documents tokens, so the sequences would come out shorter. Use a divisor of 256 (e.g. 2, 4, 8, 16)"),
        (["--smet_config", "smet.yaml"], "--smet_config smet.yaml given without --smet would be ignored: add --smet"),
        (["--sparse_layer_overrides", '{"1-0": {"pattern": "dense"}}'],
         "layer_overrides key '1-0' is a reversed range"),
        (["--block_size", "64", "--seq_len", "8"], "--block_size is now --sparse_block_size; --seq_len is now "
         "--sparse_max_length."),
        # a file a flag names that is not there: a traceback from the launcher's parse (`hf-sparse-cp train --nproc`)
        # a tiny model type transformers does not build: refused by each process as it built the model
        (["--tiny_model_type", "foo"], "tiny model type 'foo' is not a transformers model type"),
        # a type without a causal LM, or one sparse_cp refuses: refused by each process after it built the data
        (["--tiny_model_type", "t5"], "--tiny_model_type t5: transformers has no causal language model of this type "
         "(AutoModelForCausalLM), which the example trains. Or give a type the plugin is tested with that trains here "
         "at --tiny_num_layers 2: llama, mistral, qwen2"),
        (["--tiny_model_type", "reformer"], "--tiny_model_type reformer: transformers does not build its causal "
         "language model from the tiny model's config (AssertionError: If you want to use `ReformerModelWithLMHead`"),
        (["--tiny_model_type", "bert"], "--tiny_model_type bert: BertLMHeadModel has bidirectional attention layers"),
        # a tiny model with fewer positions than a document's tokens (tiny_config lowers them where they size tensors:
        # GPT-BigCode's [n, n] causal buffer): an IndexError at the first step
        (["--tiny_model_type", "gpt_bigcode", "--sparse_max_length", "8192"], "--tiny_model_type gpt_bigcode: its tiny "
         "model takes 4096 positions (max_position_embeddings, lowered where tensors are sized by it: learned position "
         "tables, causal buffers), fewer than the 8192 tokens of a training document: train at most 4096 "
         "(--sparse_max_length), or a type with rotary positions (e.g. qwen2, llama)."),
        # an architecture whose attention does not run through the backend, or under CP mixes tokens outside it:
        # refused by each process only as it built the Trainer, after the data
        (["--tiny_model_type", "mamba"], "--tiny_model_type mamba: MambaForCausalLM (model type 'mamba') has no "
         "attention layer (its layer_types: linear_attention), so attn_implementation='sparse_cp' has no attention to "
         "compute. Train it with dense attention (--sparse_attention false;"),
        (["--tiny_model_type", "bloom"], "--tiny_model_type bloom: BloomForCausalLM (model type 'bloom') does not "
         "route its attention through transformers' AttentionInterface, so attn_implementation='sparse_cp' cannot take "
         "effect (transformers kept attn_implementation='eager'). Train it with dense attention (--sparse_attention "
         "false;"),
        (["--tiny_model_type", "bloom", "--cp_size", "2"], "--tiny_model_type bloom: BloomForCausalLM (model type "
         "'bloom') does not route its attention through transformers' AttentionInterface, so attn_implementation="
         "'sparse_cp' cannot take effect (transformers kept attn_implementation='eager'). Train it without context "
         "parallelism (drop --cp_size: its ring needs the sparse_cp backend) and with dense attention "
         "(--sparse_attention false;"),
        (["--tiny_model_type", "mamba", "--cp_size", "2"], "--tiny_model_type mamba: MambaForCausalLM (model type "
         "'mamba') has no attention layer (its layer_types: linear_attention), so attn_implementation='sparse_cp' has "
         "no attention to compute. Train it without context parallelism (drop --cp_size"),
        # (Jamba's tiny model attends in its last layer, after a Mamba one)
        (["--tiny_model_type", "jamba", "--cp_size", "2"], "--tiny_model_type jamba: JambaForCausalLM mixes tokens "
         "outside attention (layer type 'linear_attention', Conv1d of kernel (4,) (model.layers.0.mamba.conv1d)): "
         "under context parallelism such layers would see only this rank's shard. Train it without context "
         "parallelism."),
        # CP with the backend that runs its ring off: refused by the Trainer after the data
        (["--sparse_attention", "false", "--cp_size", "2"], "--cp_size 2: context parallelism runs its ring in the "
         "sparse_cp backend, which --sparse_attention false turns off: drop --sparse_attention false (add "
         "--sparse_pattern dense for exact causal attention under CP), or train without context parallelism"),
        (["--sparse_attention", "false", "--cp_schedule", "0:256:1,2:512:2", "--max_steps", "4"],
         "--cp_schedule stage 1 (2:512:2): context parallelism runs its ring in the sparse_cp backend"),
        (["--tiny_model_type", "gemma2", "--cp_size", "1"], "--tiny_model_type gemma2: Gemma2ForCausalLM (model type "
         "'gemma2') soft-caps attention logits"),
        (["--sparse_config", "missing.yaml"], "Config file 'missing.yaml' does not exist, nor is it a shipped pattern "
         "(trial); `hf-sparse-cp recipes` lists them."),
        # an empty value (an unset shell variable) read as no value: the tiny model trained, no summary written
        (["--model_name_or_path", ""], "--model_name_or_path '' is empty (an unset shell variable?): give its value, "
         "or drop the flag."),
        (["--summary_file", " "], "--summary_file ' ' is empty (an unset shell variable?)"),
        # a summary file that cannot be written: an IsADirectoryError / NotADirectoryError once the run had trained
        (["--summary_file", "."], "--summary_file . is a folder; give the path of a file"),
        (["--summary_file", f"{__file__}/summary.json"], f"--summary_file {__file__}/summary.json: {__file__} is a "
         "file, not a folder; give a path in a folder."),
        # flags no layer reads (issue #50): accepted without a word
        (["--sparse_estimation_chunk", "256"], "--sparse_estimation_chunk 256 would be ignored: only a layer with "
         "pattern='vertical_slash' and estimation='causal_chunks' reads it, and no layer of this run has them all "
         "(estimation='last_queries'): drop it, or add --sparse_estimation causal_chunks."),
        (["--sparse_estimation_chunk", "256", "--sparse_layer_overrides", '{"0": {"pattern": "dense"}}'],
         "--sparse_estimation_chunk 256 would be ignored"),
        # typed at their default value: as ignored as at any other
        (["--sparse_estimation_chunk", "1024"], "--sparse_estimation_chunk 1024 would be ignored: only a layer with "
         "pattern='vertical_slash' and estimation='causal_chunks' reads it"),
        (["--cp_planner_comm_per_token", "300"], "--cp_planner_comm_per_token 300.0 would be ignored: the document "
         "planner of --cp_sharding document reads it"),
        (["--smet_density", "0.25"], "--smet_density given without --smet would be ignored: add --smet"),
        (["--cp_planner_comm_per_token", "5"], "--cp_planner_comm_per_token 5.0 would be ignored: the document planner "
         "of --cp_sharding document reads it, and this run shards with --cp_sharding striped: drop it, or add "
         "--cp_sharding document."),
        (["--cp_planner_linear_per_token", "8000", "--cp_schedule", "0:256:1,2:512:2:cp_sharding=zigzag",
          "--max_steps", "4"], "--cp_planner_linear_per_token 8000.0 would be ignored: the document planner of "
         "--cp_sharding document reads it, and this run shards with --cp_sharding striped (nor does any --cp_schedule "
         "stage)"),
        # given in a stage that does not read them (the stage's config alone takes them: no other stage may)
        (["--cp_schedule", "0:256:1,2:512:2:cp_planner_comm_per_token=5", "--max_steps", "4"], "cp_schedule stage 1 "
         "(2:512:2:cp_planner_comm_per_token=5): cp_planner_comm_per_token=5 would be ignored: the document planner of "
         "cp_sharding=document reads it, and this stage shards with cp_sharding=striped"),  # (in the stage's syntax)
        (["--cp_schedule", "0:256:1,2:512:2:estimation_chunk=128", "--max_steps", "4"], "cp_schedule stage 1 "
         "(2:512:2:estimation_chunk=128): estimation_chunk=128 would be ignored: only a layer with "
         "pattern=vertical_slash and estimation=causal_chunks reads it"),  # (in the stage's syntax)
        # an engine that cannot train on this run's device: a traceback from every rank at the first step
        (["--sparse_attention_engine", "triton", "--use_cpu"], "--sparse_attention_engine triton: Triton's kernels "
         "train on CUDA GPUs (Triton's interpreter, a test tool, runs them elsewhere), and this run trains on the CPU "
         "(--use_cpu, or no GPU here): use --sparse_attention_engine auto (the PyTorch reference off CUDA) or "
         "reference, or train on a CUDA GPU."),
        (["--sparse_attention_engine", "flex", "--use_cpu"], "--sparse_attention_engine flex: FlexAttention trains on "
         "CUDA only"),
        (["--sparse_layer_overrides", '{"1": {"attention_engine": "triton"}}', "--use_cpu"],
         "--sparse_attention_engine triton: Triton's kernels train on CUDA GPUs"),
        # data no machine can build: a MemoryError traceback in every process, after they started
        (["--sparse_max_length", "99999999999"], "a passkey sequence of 99999999999 tokens takes at least 18626 GiB of "
         "memory to build (200 bytes per token), more than this machine's"),
    ],
)
def test_the_example_refuses_what_it_would_not_honour(capsys, flags, refused):
    with pytest.raises(SystemExit) as stopped:
        parse_args(flags)
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert re.search(r"^\S+: error: " + re.escape(refused), err, re.MULTILINE), err
    assert "usage:" not in err  # one line, not the Trainer's hundreds of flags


def test_the_types_listed_after_a_refused_tiny_type_are_probed_quietly(capfd):
    """The refusal of a tiny type lists the types that train, found by building each tiny model: transformers' warnings
    on those models' configs (Marian's and Whisper's start tokens, YaRN factors) came before the one-line error."""
    import transformers

    verbosity = transformers.logging.get_verbosity()
    with pytest.raises(SystemExit):
        parse_args(["--tiny_model_type", "t5"])
    err = capfd.readouterr().err
    assert "--tiny_model_type t5: transformers has no causal language model" in err
    assert "[transformers]" not in err and "start_token_id" not in err, err
    assert transformers.logging.get_verbosity() == verbosity


def test_a_missing_file_a_flag_names_is_refused_before_the_processes_start(monkeypatch, tmp_path, capsys):
    """`hf-sparse-cp train --nproc 2` parses the example's flags before starting the processes: a --sparse_config or
    --fsdp_config that is not there ended that parse in a FileNotFoundError's traceback."""
    from hf_sparse_cp import cli
    from hf_sparse_cp.launch import processes

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    started = []
    monkeypatch.setattr(processes, "run_forwarding_signals", lambda command, env=None: started.append(command) or 0)
    for flags, named in ((["--sparse_config", "missing.yaml"], "Config file 'missing.yaml' does not exist"),
                         (["--fsdp", "full_shard", "--fsdp_config", "missing.json"], "'missing.json'"),
                         # (a Triton kernel's ValueError in a traceback from every rank at the first step)
                         (["--sparse_attention_engine", "triton", "--use_cpu"], "Triton's kernels train on CUDA"),
                         (["--sparse_estimation_chunk", "256"], "--sparse_estimation_chunk 256 would be ignored")):
        with pytest.raises(SystemExit) as stopped:
            cli.main(["train", "--nproc", "2", *flags])
        err = capsys.readouterr().err
        assert stopped.value.code == 2 and err.startswith("hf-sparse-cp train: error: ") and named in err, err
    assert not started


@pytest.mark.parametrize("flags", [
    # a layer override or a curriculum stage that reads the flag
    ["--sparse_estimation_chunk", "256", "--sparse_layer_overrides", '{"1": {"estimation": "causal_chunks"}}'],
    ["--sparse_estimation_chunk", "256", "--cp_schedule", "0:512:1,2:1024:1:estimation=causal_chunks", "--max_steps",
     "4"],
    ["--sparse_pattern", "dense", "--sparse_vertical_topk", "8", "--sparse_layer_overrides",
     '{"1": {"pattern": "vertical_slash"}}'],
    ["--cp_planner_comm_per_token", "5", "--cp_schedule", "0:512:1,2:1024:2:cp_sharding=document", "--max_steps", "4"],
    ["--cp_planner_comm_per_token", "5", "--cp_sharding", "document"],
    # the demo's own budget is not refused under a dense pattern, nor warned of without the backend
    ["--sparse_pattern", "dense"],
    ["--sparse_attention", "false"],
    [],  # (defaults only: nothing typed)
])
def test_the_example_takes_flags_a_layer_or_stage_reads(flags, caplog):
    parse_args(flags)
    assert "no effect" not in caplog.text


@pytest.mark.parametrize("flags, said", [
    (["--sparse_pattern", "dense", "--sparse_vertical_topk", "8", "--sparse_last_q", "16"],
     "--sparse_vertical_topk, --sparse_last_q have no effect: only a vertical_slash pattern reads them, and every "
     "layer of this run is dense (--sparse_pattern dense)."),
    (["--sparse_pattern", "dense", "--sparse_layer_overrides", '{"0": {"pattern": "dense"}}', "--sparse_budget_mode",
      "mass"], "--sparse_budget_mode has no effect: only a vertical_slash pattern reads it"),
    (["--sparse_attention", "false", "--sparse_sink_tokens", "8"], "--sparse_sink_tokens has no effect: "
     "--sparse_attention false turns the sparse_cp backend off, so the model trains with its own attention."),
    # typed at its default value
    (["--sparse_attention", "false", "--sparse_sink_tokens", "64"], "--sparse_sink_tokens has no effect: "
     "--sparse_attention false turns the sparse_cp backend off"),
])
def test_flags_a_dense_run_does_not_read_are_taken_and_said_once_to_have_no_effect(flags, said, caplog, monkeypatch):
    """A budget on a dense pattern, or any pattern flag without the backend (issue #50): accepted without a word
    before; taken with one line (not refused: a recipe's dense baseline is the recipe with --sparse_pattern dense, or
    --sparse_attention false without CP), printed once however often the arguments are built."""
    from hf_sparse_cp.trainer import plugin_arguments

    monkeypatch.setattr(plugin_arguments, "_WARNED", set())
    parse_args(flags)
    parse_args(flags)
    assert [r.getMessage() for r in caplog.records if "no effect" in r.getMessage()] == [
        next(r.getMessage() for r in caplog.records if said in r.getMessage())]


def test_the_example_takes_packed_documents_that_divide_the_sequence():
    script, training, *_ = parse_args(["--sparse_max_length", "256", "--pack_documents", "4"])
    assert (training.sparse_max_length, script.pack_documents) == (256, 4)


@pytest.mark.parametrize(
    "kwargs, refused",
    [
        ({"cp_size": "2"}, "cp_size='2' (str) is not valid: use a whole number, e.g. cp_size=1 (the default); this is "
                           "a number written as text: write it without quotes"),
        ({"cp_size": 2.0}, "cp_size=2.0 (float) is not valid: use a whole number"),
        ({"cp_node_size": 2.5}, "cp_node_size=2.5 (float) is not valid: use a whole number or unset"),
        ({"cp_sharding": "random"}, "cp_sharding='random' (str) is not valid: use one of 'striped', 'zigzag', "
                                    "'contiguous'"),
        ({"cp_ring": None}, "cp_ring=None (NoneType) is not valid: use one of 'flat', 'hierarchical'"),
        # (NaN passed the `< 0` check, inf too: every rank's planned load NaN or inf, the document plan arbitrary)
        ({"cp_planner_linear_per_token": float("nan")},
         "cp_planner_linear_per_token=nan must be finite and >= 0 (a cost in attention token pairs; default counted "
         "from the model)"),
        ({"cp_planner_comm_per_token": float("inf")}, "cp_planner_comm_per_token=inf must be finite and >= 0"),
        ({"cp_planner_comm_per_token": -1.0}, "cp_planner_comm_per_token=-1.0 must be finite and >= 0"),
        ({"cp_planner_max_token_ratio": 0.9, "cp_sharding": "document"},
         "cp_planner_max_token_ratio=0.9 must be finite and >= 1 (a multiple of the mean tokens per rank"),
        ({"cp_planner_max_token_ratio": float("nan"), "cp_sharding": "document"},
         "cp_planner_max_token_ratio=nan must be finite and >= 1"),
    ],
)
def test_context_parallel_config_refuses_wrong_types(kwargs, refused):
    with pytest.raises(ValueError, match=re.escape(refused)):
        ContextParallelConfig(**kwargs)


# ---- issue #31: typed fields, settings that do nothing, errors that name cause and fix ----


def _plugin_dataclasses():
    from hf_sparse_cp import SMETArguments, SparseAttentionConfig, SparseCPArguments
    from hf_sparse_cp.attention.budgets import Mass, TopK, TopP
    from hf_sparse_cp.config.sections import Scoring
    from hf_sparse_cp.examples.train_long_context import ScriptArguments
    from hf_sparse_cp.smet import SMETConfig
    from hf_sparse_cp.trainer.schedule import CurriculumArguments
    from hf_sparse_cp.trainer.sparse_trainer import SparseTrainingArguments

    every = (SparseAttentionConfig, TopK, TopP, Mass, Scoring, ContextParallelConfig, SMETConfig, SparseCPArguments,
             SMETArguments, CurriculumArguments, ScriptArguments, SparseTrainingArguments)
    stock = {f.name for f in dataclasses.fields(TrainingArguments)}  # (TrainingArguments checks its own)
    return [(cls, f.name) for cls in every for f in dataclasses.fields(cls) if f.init and f.name not in stock]


@pytest.mark.parametrize("cls, name", _plugin_dataclasses(), ids=lambda x: getattr(x, "__name__", x))
def test_every_typed_field_of_every_plugin_dataclass_is_checked_at_construction(cls, name):
    wrong = object()  # no annotation of a plugin field accepts it
    with pytest.raises(ValueError, match=f"^{re.escape(name)}=<object object"):
        cls(**{name: wrong})


SWITCHES_AS_TEXT = {"sparse_fused_loss": "false", "smet": "no", "sparse_attention": "maybe",
                    "sparse_log_sparsity": "off"}


@pytest.mark.parametrize("name, text", SWITCHES_AS_TEXT.items())
def test_text_in_a_switch_is_refused_from_a_yaml_or_json_file_and_a_dict(tmp_path, name, text):
    """Issue #31: `fused_loss: "false"` was kept as text, and the Trainer then turned the lean loss on."""
    from transformers import HfArgumentParser

    from hf_sparse_cp import SparseTrainingArguments

    parser = HfArgumentParser(SparseTrainingArguments)
    refused = re.escape(f"{name}={text!r} (str) is not valid: use true or false") + ".*without quotes"
    (tmp_path / "args.yaml").write_text(f'output_dir: {tmp_path}\n{name}: "{text}"\n')
    (tmp_path / "args.json").write_text(json.dumps({"output_dir": str(tmp_path), name: text}))
    with pytest.raises(ValueError, match=refused):
        parser.parse_yaml_file(tmp_path / "args.yaml")
    with pytest.raises(ValueError, match=refused):
        parser.parse_json_file(tmp_path / "args.json")
    with pytest.raises(ValueError, match=refused):
        parser.parse_dict({"output_dir": str(tmp_path), name: text})
    (tmp_path / "args.yaml").write_text(f"output_dir: {tmp_path}\n{name}: false\n")  # a YAML boolean is taken
    (args,) = parser.parse_yaml_file(tmp_path / "args.yaml")
    assert getattr(args, name) is False


@pytest.mark.parametrize(
    "flags, refused",
    [
        (["--align_documents"], "--align_documents pads between the documents of a packed sequence, but "
                                "--pack_documents is 1 (one document per sequence) so it would do nothing"),
        (["--num_samples", "0"], "--num_samples 0 must be >= 1"),
        (["--max_steps", "1", "recipes/train/qwen2.5-3b_32k.yaml"],
         "the recipe recipes/train/qwen2.5-3b_32k.yaml must come first, before any flag"),
    ],
)
def test_the_example_refuses_settings_that_do_nothing(capsys, flags, refused):
    test_the_example_refuses_what_it_would_not_honour(capsys, flags, refused)


def test_the_example_names_the_model_path_it_cannot_load(tmp_path, capsys):
    """Issue #31: a missing .gguf file or folder was reported as a malformed Hub repo id, an empty folder
    by a sentencepiece message."""
    from hf_sparse_cp.examples.train_long_context import main

    (tmp_path / "model.gguf").write_bytes(b"")
    for source, refused in [
        ("/nonexistent/model.gguf", "--model_name_or_path /nonexistent/model.gguf: no such GGUF file."),
        (f"{tmp_path}/other.gguf", f"--model_name_or_path {tmp_path}/other.gguf: no such GGUF file; {tmp_path} holds "
                                   "model.gguf."),
        ("/nonexistent/run", "--model_name_or_path /nonexistent/run: no such folder"),
        (str(tmp_path), f"--model_name_or_path {tmp_path}: the folder holds no config.json, so it is not a saved "
                        "model; give the folder that save_pretrained / trainer.save_model() wrote (config.json, "
                        f"weights, tokenizer); {tmp_path} holds model.gguf."),
    ]:
        with pytest.raises(SystemExit) as ended:  # the script's one line, as a bad flag's: status 2, no traceback
            main(["--model_name_or_path", source, "--output_dir", str(tmp_path / "out")])
        assert ended.value.code == 2
        assert f"train_long_context.py: error: {refused}" in capsys.readouterr().err


def test_the_example_names_the_checkpoint_of_an_output_dir_given_as_the_model(tmp_path, capsys):
    """A recipe's next stage starts from the last one's output (`--model_name_or_path outputs/qwen2.5-3b_32k`); run
    without --save_final_model, that folder holds only Trainer checkpoints, and the refusal said "give the folder
    that save_pretrained / trainer.save_model() wrote" without naming the checkpoint that holds one."""
    from transformers import AutoModelForCausalLM

    from hf_sparse_cp.examples.tokenizer import byte_tokenizer
    from hf_sparse_cp.examples.train_long_context import main
    from hf_sparse_cp.testing.tiny_models import tiny_config

    checkpoint = tmp_path / "run" / "checkpoint-3"
    AutoModelForCausalLM.from_config(tiny_config("qwen2", vocab_size=len(byte_tokenizer()))).save_pretrained(checkpoint)
    byte_tokenizer().save_pretrained(checkpoint)
    (tmp_path / "run" / "checkpoint-2").mkdir()  # (an earlier one, not the last)
    flags = ["--output_dir", str(tmp_path / "out"), "--sparse_max_length", "256", "--num_samples", "1", "--max_steps",
             "1", "--report_to", "none", "--save_strategy", "no"]
    with pytest.raises(SystemExit):
        main(["--model_name_or_path", str(tmp_path / "run"), *flags])
    assert (f"{tmp_path / 'run'} holds Trainer checkpoints, the last one's model loads as --model_name_or_path "
            f"{checkpoint} (save a run's final model" in capsys.readouterr().err)
    try:
        main(["--model_name_or_path", str(checkpoint), *flags])  # the fix it names
    finally:
        import hf_sparse_cp

        hf_sparse_cp.disable_lean_loss()
        hf_sparse_cp.unpatch()
    assert "done: 1 step at 256 tokens" in capsys.readouterr().out


def test_the_example_names_a_model_folder_without_its_tokenizer(tmp_path, capsys):
    """A folder of config.json and weights alone (`model.save_pretrained`) loads an empty tokenizer (transformers 5):
    the passkey data stopped with "generated 0 tokens, fewer than seq_len=256; raise the text length", which no
    flag does. Refused naming the tokenizer and the fix, which, followed, builds the data."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_sparse_cp.examples.passkey import passkey_dataset
    from hf_sparse_cp.examples.tokenizer import byte_tokenizer
    from hf_sparse_cp.examples.train_long_context import main
    from hf_sparse_cp.testing.tiny_models import tiny_config

    folder = tmp_path / "run"
    AutoModelForCausalLM.from_config(tiny_config("qwen2", vocab_size=len(byte_tokenizer()))).save_pretrained(folder)
    with pytest.raises(SystemExit) as ended:
        main(["--model_name_or_path", str(folder), "--output_dir", str(tmp_path / "out"), "--sparse_max_length", "256",
              "--num_samples", "1", "--max_steps", "1", "--sparse_config", "trial"])
    assert ended.value.code == 2
    assert (f"train_long_context.py: error: the tokenizer {str(folder)!r} turns text into no tokens" in
            capsys.readouterr().err)
    byte_tokenizer().save_pretrained(folder)  # the fix the message names
    data = passkey_dataset(AutoTokenizer.from_pretrained(folder), 1, 256, cache_dir=tmp_path / "cache")
    assert len(data[0]["input_ids"]) == 256


@pytest.mark.parametrize(
    "flags, refused",
    [
        (["--cp", "0"], "argument --cp: 0 must be >= 1"),
        (["--density", "5"], "argument --density: 5.0 must be in (0, 1]"),
        (["--seq", "-8"], "argument --seq: -8 must be >= 1"),
        (["--estimation-chunk", "64"], "argument --estimation-chunk: 64 must be >= 128"),
        # a value starting with a dash reaches the flag's check (argparse took it for a flag: 'expected one argument')
        (["--seq", "-128k"], "argument --seq: '-128k' is not a whole number; give one >= 1 in digits alone"),
        (["--spread", "-1x"], "argument --spread: '-1x' is not a number; give a fraction in (0, 1]"),
        (["--intra-node-gbps", "-100GB"], "argument --intra-node-gbps: '-100GB' is not a number; give one above 0"),
        (["--gpu-tflops", "0"], "argument --gpu-tflops: 0.0 must be > 0"),
        (["--gpus-per-node", "2.5"], "argument --gpus-per-node: '2.5' is not a whole number"),
        # '' (an unset shell variable) read as no value: the default output file written, the default curve read
        (["--json", ""], "--json '' is empty (an unset shell variable?): give its value, or drop the flag."),
        (["--kept-curve", " "], "--kept-curve ' ' is empty (an unset shell variable?)"),
        # each a traceback after the simulation (numpy's seed; matplotlib's formats), or a file named wrongly ('wrote
        # plot' for the plot.png matplotlib wrote)
        (["--seed", "-1"], "argument --seed: -1 must be >= 0"),
        (["--png", "plot.txt"], "--png plot.txt: '.txt' is no image format matplotlib writes; give a file ending in "
                                ".png, .pdf or .svg (or another of "),
        # flags of the sparse rows with the dense ring's alone: the table did not change
        (["--configs", "dense ring", "--sparse-kernels", "flex"], "--sparse-kernels flex would not be read: --configs "
         "'dense ring' has no sparse configuration; add one (e.g. --configs 'dense ring' 'striped sparse'), or drop "
         "--sparse-kernels."),
        (["--configs", "dense ring", "--density", "0.1"], "--density 0.1 would not be read: --configs 'dense ring'"),
        (["--png", "plot"], "--png plot: no suffix names its image format; give a file ending in .png, .pdf or .svg"),
    ],
)
def test_the_simulator_refuses_values_it_cannot_simulate(capsys, flags, refused):
    """Issue #31: --cp 0 was a ZeroDivisionError, --density 5 was accepted."""
    from hf_sparse_cp.simulator.simulate_cli import parse_args as simulate_args

    with pytest.raises(SystemExit) as stopped:
        simulate_args(flags, prog="hf-sparse-cp simulate")
    assert stopped.value.code == 2
    assert f"hf-sparse-cp simulate: error: {refused}" in capsys.readouterr().err


def _tiny(model_type: str = "llama", **overrides):
    from transformers import AutoModelForCausalLM

    from hf_sparse_cp.testing.tiny_models import tiny_config

    return AutoModelForCausalLM.from_config(tiny_config(model_type, **overrides))


def test_the_cp_check_names_the_one_backend_it_takes():
    """check_model_supports_context_parallel(model, backend=None) told every layer to go through 'None', and
    backend='sdpa' on an sdpa model called its architecture unrouted: only sparse_cp runs the ring."""
    from hf_sparse_cp import check_model_supports_context_parallel

    model = _tiny()
    with pytest.raises(ValueError, match=r"uses attn_implementation='sdpa'; under context parallelism every attention "
                                         r"layer must go through 'sparse_cp', which runs the ring"):
        check_model_supports_context_parallel(model, backend=None)
    with pytest.raises(ValueError, match=re.escape(
            "check_model_supports_context_parallel(model, backend='sdpa'): context parallelism runs its ring in the "
            "'sparse_cp' backend only, so every attention layer must use it (LlamaForCausalLM uses attn_implementation="
            "'sdpa'): leave backend out (or pass backend='sparse_cp').")):
        check_model_supports_context_parallel(model, backend="sdpa")


def test_an_estimation_chunk_that_covers_the_sequence_is_refused():
    """Issue #31: every layer ran dense (kept 1.000) without a word."""
    from hf_sparse_cp import SparseAttentionConfig, SparseCPArguments, disable_sparse_attention
    from hf_sparse_cp.trainer.attach import enable_sparse_attention
    from hf_sparse_cp.trainer.schedule import parse_schedule
    from hf_sparse_cp.trainer.stage_plan import build_schedule

    pattern = SparseAttentionConfig(estimation="causal_chunks", estimation_chunk=1024, block_size=64, min_seq_len=512,
                                    dense_first_layers=1)
    model = _tiny()
    with pytest.raises(ValueError, match=re.escape(
            "estimation_chunk=1024 is not shorter than the 1024-token training sequences: with "
            "estimation='causal_chunks' the first chunk of a document is dense, so layer 1 would run dense") +
            r".*below 1024 \(a multiple of block_size \(--sparse_block_size\)=64, e.g. 512\)"):
        enable_sparse_attention(model, SparseCPArguments(), pattern, max_length=1024)
    assert getattr(model.config, "sparse_attention", None) is None  # refused before anything changed
    for length in (2048, 256):  # a shorter chunk; or documents below min_seq_len, dense by choice
        enable_sparse_attention(model, SparseCPArguments(), pattern, max_length=length)
        disable_sparse_attention(model)
    stages = parse_schedule("0:2048:1,2:1024:1")
    with pytest.raises(ValueError, match=r"cp_schedule stage 1 \(2:1024:1\): estimation_chunk=1024 is not shorter"):
        build_schedule(stages, world_size=1, sparse_config=pattern, max_steps=4, layers=[0, 1])


def test_a_model_the_backend_refuses_is_refused_before_training():
    """Issue #31: --tiny_model_type gemma2 failed inside transformers at the first step."""
    from hf_sparse_cp import SparseCPArguments
    from hf_sparse_cp.trainer.attach import enable_sparse_attention

    model = _tiny("gemma2")
    with pytest.raises(ValueError, match=r"soft-caps attention logits \(attn_logit_softcapping=50.0\).*"
                                         r"attn_implementation='eager', which computes it \(--sparse_attention false; "
                                         r"SDPA does not soft-cap\)"):
        enable_sparse_attention(model, SparseCPArguments())
    with pytest.raises(ValueError, match=r"attention_dropout=0.1.*build the model with attention_dropout=0.0 "
                                         r"\(e.g. from_pretrained\(..., attention_dropout=0.0\)"):
        enable_sparse_attention(_tiny(attention_dropout=0.1), SparseCPArguments())


def test_a_cut_off_trainer_state_is_named(tmp_path):
    from hf_sparse_cp.reporting.kept_fraction_figure import read_log_history

    (tmp_path / "trainer_state.json").write_text('{"log_history": [{"loss": 1')
    with pytest.raises(ValueError, match=re.escape(f"Trainer state file '{tmp_path / 'trainer_state.json'}' is not "
                                                   "valid JSON") + ".*plot an earlier checkpoint-N folder"):
        read_log_history(tmp_path)


def test_an_output_folder_is_refused_naming_its_checkpoint_folders_alone(tmp_path):
    """The refusal listed every name checkpoint-N (a file among them, which is no checkpoint) beside the newest
    checkpoint folder that transformers' get_last_checkpoint named, listing the folder a second time."""
    from hf_sparse_cp.trainer.checkpoints import check_checkpoint, read_marker

    for step in (2, 10):
        (tmp_path / f"checkpoint-{step}").mkdir()
    (tmp_path / "checkpoint-30").write_text("a stray file")
    with pytest.raises(ValueError, match=re.escape("it holds checkpoints (checkpoint-2, checkpoint-10). Resume from "
                                                   "one of them, e.g. the newest complete one: "
                                                   f"--resume_from_checkpoint {tmp_path / 'checkpoint-10'}.")):
        check_checkpoint(tmp_path, {}, read_marker(tmp_path), reshardable=False)


@pytest.mark.parametrize("text", ["{\"complete\": tr", "[1, 2]"], ids=["cut", "list"])
def test_a_damaged_checkpoint_marker_is_refused_naming_the_checkpoint(tmp_path, text):
    """A marker that is no JSON object failed with json's own message ("Expecting value ...") or an AttributeError,
    naming neither the file nor the checkpoint."""
    from hf_sparse_cp.trainer.checkpoints import MARKER, read_marker

    (tmp_path / MARKER).write_text(text)
    with pytest.raises(ValueError, match=f"Checkpoint .* is damaged: its {MARKER} is not the JSON object a run "
                                         "writes .*Resume from another checkpoint"):
        read_marker(tmp_path)


def test_a_checkpoint_saved_without_fsdp_is_refused_by_an_fsdp2_run(tmp_path):
    """Issue #31: it passed the check, then rank 0 died on pytorch_model_fsdp.bin and rank 1 on a closed
    connection."""
    from hf_sparse_cp.trainer.checkpoints import MARKER, check_checkpoint, read_marker

    settings = {"cp_size": 1, "data_parallel_size": 2, "smet": None, "global_batch_size": 4}
    for name in ("model.safetensors", "optimizer.pt", "trainer_state.json"):
        (tmp_path / name).write_text("x")
    files = {p.name: p.stat().st_size for p in tmp_path.iterdir()}
    (tmp_path / MARKER).write_text(json.dumps({"complete": True, "step": 2, "settings": settings, "files": files}))
    assert check_checkpoint(tmp_path, settings, read_marker(tmp_path), reshardable=False) is False  # as saved: fine
    with pytest.raises(ValueError, match="was saved by a run without FSDP.*Resume it without --fsdp, as it was saved"):
        check_checkpoint(tmp_path, settings, read_marker(tmp_path), reshardable=True)
    (tmp_path / "pytorch_model_fsdp.bin").write_text("x")  # accelerate's FSDP save: the Trainer loads it
    assert check_checkpoint(tmp_path, settings, read_marker(tmp_path), reshardable=True) is False


@pytest.mark.parametrize("schedule, refused", [
    ("0:128:1,2:256:2,3:256:1", None),  # a stage from the checkpoint's step on
    ("0:128:1,2:256:2,5:512:1", None),
    ("0:128:1,2:256:2,4:512:4", None),  # the saved run's stage after the checkpoint changed
    ("0:128:1,2:256:2", None),  # ... or dropped
    ("0:128:1,3:256:2", "stage 1 differs (2:256:2 in the saved schedule and 3:256:2 in this run's) from step 2 on, "
                        "before the checkpoint's step 3: the steps before the checkpoint trained with the saved "
                        "stages. Resume with the schedule it was saved with, changing or adding only stages that "
                        "start at step 3 or later"),
    ("0:128:1,2:256:2:vertical_topk=32", "stage 1 differs (2:256:2 in the saved schedule and "
                                         "2:256:2:vertical_topk=32 in this run's) from step 2 on"),
    ("0:128:1,1:128:2,2:256:2", "stage 1 differs (2:256:2 in the saved schedule and 1:128:2 in this run's) from "
                                "step 1 on"),
    ("0:128:1,2:256:2,2ep:512:1", "stage 2 differs (4:512:2 in the saved schedule and 2ep:512:1 in this run's) and "
                                  "starts at an epoch, which the data resolve into a step"),
])
def test_a_curriculum_checkpoint_resumes_with_stages_changed_only_after_its_step(tmp_path, schedule, refused):
    """A --cp_schedule extended after the checkpoint's step was refused as another parallel layout, though the steps
    before it trained with the same stages and samples; a stage changed before it still is, naming the stage."""
    from hf_sparse_cp.trainer.checkpoints import MARKER, check_checkpoint, read_marker

    def settings(text: str) -> dict:
        return {"cp_schedule": text, "world_size": 2, "smet": None, "world_batch_size": 2}

    (tmp_path / MARKER).write_text(json.dumps({"complete": True, "step": 3, "files": {},
                                               "settings": settings("0:128:1,2:256:2,4:512:2")}))
    if refused is None:
        assert check_checkpoint(tmp_path, settings(schedule), read_marker(tmp_path)) is False
        return
    with pytest.raises(ValueError, match=re.escape(f"saved at step 3 with --cp_schedule '0:128:1,2:256:2,4:512:2', "
                                                   f"but this run has '{schedule}': {refused}")):
        check_checkpoint(tmp_path, settings(schedule), read_marker(tmp_path))


def _argument_class(kind: str):
    if kind == "sft":
        pytest.importorskip("trl")
        from hf_sparse_cp import SparseSFTConfig

        assert SparseSFTConfig._length_field == "max_length"  # TRL's own sequence length is checked
        return SparseSFTConfig
    from hf_sparse_cp import SparseTrainingArguments

    return SparseTrainingArguments


@pytest.mark.parametrize("kind", ["trainer", "sft"])
@pytest.mark.parametrize("length", [-5, 0, 1])
def test_the_argument_classes_refuse_a_sequence_length_below_2_tokens(tmp_path, kind, length):
    """Issue #41 item 5: accepted, then TRL's packing failed in pyarrow."""
    cls = _argument_class(kind)
    for name in (cls._length_field,):
        with pytest.raises(ValueError, match=rf"^--{name} {length}: a training sequence needs at least 2 tokens; "
                                             rf"e\.g\. --{name} 4096 \(or leave it unset\)"):
            cls(output_dir=str(tmp_path), report_to="none", **{name: length})
        assert getattr(cls(output_dir=str(tmp_path), report_to="none", **{name: 2}), name) == 2


@pytest.mark.parametrize("kind", ["trainer", "sft"])
def test_the_argument_classes_refuse_batch_sizes_below_1_and_nan_optimizer_settings(tmp_path, kind):
    """transformers takes them as given: a batch size of 0 ended in torch's sampler after the data and the model were
    built (a traceback from each rank), a NaN learning rate trained NaN weights."""
    cls = _argument_class(kind)
    refused = {"per_device_train_batch_size": (0, "must be >= 1; e.g. --per_device_train_batch_size 8"),
               "per_device_eval_batch_size": (-1, "must be >= 1; e.g. --per_device_eval_batch_size 8"),
               "gradient_accumulation_steps": (0, "must be >= 1; e.g. --gradient_accumulation_steps 1"),
               "learning_rate": (float("nan"), "is not a finite number; e.g. --learning_rate 5e-05"),
               "adam_epsilon": (float("inf"), "is not a finite number; e.g. --adam_epsilon 1e-08"),
               "max_grad_norm": (float("nan"), "is not a finite number; e.g. --max_grad_norm 1.0")}
    for name, (value, message) in refused.items():
        with pytest.raises(ValueError, match=f"^--{name} {value} {re.escape(message)}"):
            cls(output_dir=str(tmp_path), report_to="none", **{name: value})
    cls(output_dir=str(tmp_path), report_to="none", max_grad_norm=float("inf"), learning_rate=-1e-5)  # (no clipping;
    # gradient ascent)


@pytest.mark.parametrize("kind", ["trainer", "sft"])
def test_the_trainers_name_an_empty_dataset(tmp_path, kind):
    """Issue #41 item 5: TRL's SFTTrainer stopped in a bare StopIteration, the Trainer in its sampler."""
    import torch
    from transformers import AutoModelForCausalLM

    from hf_sparse_cp.testing.tiny_models import tiny_config

    args = _argument_class(kind)(output_dir=str(tmp_path), report_to="none", max_steps=1)
    if kind == "sft":
        from datasets import Dataset

        from hf_sparse_cp import SparseSFTTrainer as trainer_class

        empty, full = Dataset.from_dict({"text": []}), Dataset.from_dict({"text": ["a b c"]})
    else:
        from hf_sparse_cp import SparseTrainer as trainer_class

        empty, full = [], [{"input_ids": torch.arange(3, 40)}]
    model = AutoModelForCausalLM.from_config(tiny_config("llama"))
    name = trainer_class.__name__
    with pytest.raises(ValueError, match=rf"^{name}: train_dataset is empty \(0 samples\): there is nothing to train"):
        trainer_class(model=model, args=args, train_dataset=empty)
    with pytest.raises(ValueError, match=rf"^{name}: eval_dataset\['held_out'\] is empty \(0 samples\): give it "
                                         r"samples, or pass eval_dataset=None to skip evaluation"):
        trainer_class(model=model, args=args, train_dataset=full, eval_dataset={"seen": full, "held_out": empty})


def _train_command_error(capsys, argv: list[str]) -> str:
    from hf_sparse_cp.cli import main

    with pytest.raises(SystemExit) as stopped:
        main(["train", *argv])
    assert stopped.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--recipe"], ["--recipe="], ["--recipe", "--sparse_max_length", "64"],
                                  ["--sparse_max_length", "64", "--recipe"]],
                         ids=["alone", "equals", "before_a_flag", "last"])
def test_recipe_without_a_name_says_it_needs_one(capsys, argv):
    """Issue #41 item 8: `--recipe` alone ended in 'unrecognized arguments: --recipe'."""
    err = _train_command_error(capsys, argv)
    assert re.search(r"^hf-sparse-cp train: error: --recipe needs a NAME: a shipped training recipe "
                     r"\(`hf-sparse-cp recipes` lists them\) or a YAML/JSON file of flags", err, re.MULTILINE), err


def test_an_accelerate_config_given_as_a_recipe_is_named_a_launch_config(capsys, tmp_path):
    """Issue #41 item 8: it ended in 'unrecognized arguments: --compute_environment ...'."""
    own = tmp_path / "my_launch.yaml"
    own.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_GPU\nnum_processes: 2\n")
    for argv, file in ((["--recipe", "cpu_2proc_cp2"], "cpu_2proc_cp2.yaml"), ([str(own)], str(own))):
        err = _train_command_error(capsys, argv)
        assert re.search(rf"^hf-sparse-cp train: error: \S*{re.escape(file)} is a launch config for `accelerate launch "
                         r"--config_file`, not a training recipe of flags: run `accelerate launch --config_file \S+ "
                         r"-m hf_sparse_cp.examples.train_long_context \[flags\]`", err, re.MULTILINE), err
        assert "unrecognized arguments" not in err


def test_a_refused_recipe_value_names_the_recipe_and_its_line(capsys, tmp_path):
    """Issue #50: a recipe's wrong value was refused as the command line's (`argument --cp_size/--cp-size: invalid int
    value: 'two'`, `unrecognized arguments: --foo_bar 3`), naming neither the file nor its line, where the pages say a
    wrong type in a file is refused naming the file. A value typed on the command line stays the command line's."""
    cases = [("cp_size: two", "argument --cp_size/--cp-size: invalid int value: 'two'", "`cp_size: two`"),
             ("bf16: maybe", "argument --bf16: Truthy value expected: got maybe", "`bf16: maybe`"),
             ("foo_bar: 3", "unrecognized arguments: --foo_bar 3", "`foo_bar: 3`"),
             ("sparse_block_size: 48", "block_size (--sparse_block_size)=48 must be a power of two",
              "`sparse_block_size: 48`")]
    for i, (line, refused, named) in enumerate(cases):
        recipe = tmp_path / f"recipe{i}.yaml"
        recipe.write_text(f"sparse_max_length: 512\n{line}\n")
        for argv in (["--recipe", str(recipe)], [str(recipe), "--max_steps", "1"]):
            err = _train_command_error(capsys, argv)
            assert refused in err and f"(from the recipe {recipe}: {named})" in err, err
    # the command line's own value, and its value over a recipe's that it replaces, name no recipe
    err = _train_command_error(capsys, ["--recipe", "qwen2.5-3b_32k", "--sparse_block_size", "48"])
    assert "must be a power of two" in err and "from the recipe" not in err, err
    err = _train_command_error(capsys, ["--recipe", "qwen2.5-3b_32k", "--max_steps", "x"])
    assert "invalid int value: 'x'" in err and "from the recipe" not in err, err


def test_a_recipe_value_a_check_names_as_field_equals_value_names_the_recipe(capsys):
    """The hybrid recipe scaled to 2 processes as the pages show (`--nproc 2 --cp_size 2`) was refused as
    "cp_ulysses_size=8 does not divide cp_size=2", naming no recipe: the value comes from `cp_ulysses_size: 8` of the
    recipe, which the refusal now names (cp_size, typed on the command line, is not the recipe's)."""
    err = _train_command_error(capsys, ["--recipe", "hybrid_qwen2.5-3b_1m", "--nproc", "2", "--cp_size", "2",
                                        "--sparse_max_length", "512"])
    assert "cp_ulysses_size=8 does not divide cp_size=2" in err, err
    assert err.rstrip().endswith("(from the recipe hybrid_qwen2.5-3b_1m: `cp_ulysses_size: 8`)"), err


def test_a_recipe_key_is_a_flags_whole_name(capsys, tmp_path):
    """A recipe's `max_step: 2` trained 2 steps (argparse reads `--max_step` as its abbreviation of --max_steps), where
    `HfArgumentParser.parse_yaml_file`, a script reading the same recipe, refuses the key: refused naming the flag,
    the recipe and its line. The command line's own abbreviation stays argparse's."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("sparse_max_length: 512\nmax_step: 2\n")
    err = _train_command_error(capsys, ["--recipe", str(recipe)])
    assert "unrecognized arguments: --max_step 2; did you mean --max_steps" in err, err
    assert f"(from the recipe {recipe}: `max_step: 2`)" in err, err
    recipe.write_text("sparse_max_length: 512\nmax_steps: 2\nmax_length: 256\n")  # (a deprecated name is read)
    assert parse_args(["--recipe", str(recipe), "--max_step", "1"]).training.max_steps == 1


def test_train_given_a_script_runs_it_as_launch_does(capsys, tmp_path):
    """Issue #50: `hf-sparse-cp train run_clm.py ...` ended in the example's 'unrecognized arguments: run_clm.py'; a
    `.py` path (or -m module) is the script `launch` runs (here a missing one, refused as `launch` refuses it). Its
    refusals name the command typed, with the script form of its usage (they said `hf-sparse-cp launch: error:`)."""
    usage = "usage: hf-sparse-cp train [--nproc N | --config_file ACCELERATE_CONFIG] [PLUGIN FLAGS] (script.py | -m "
    for argv in (["--nproc", "2", str(tmp_path / "run_clm.py"), "--cp_size", "2"], ["--sparse_block_size", "32", "-m"]):
        err = _train_command_error(capsys, argv)
        assert "hf-sparse-cp train: error: " in err and "unrecognized arguments" not in err, err
        assert err.startswith(usage) and "hf-sparse-cp launch" not in err, err
    assert f"can't open file {str(tmp_path / 'run_clm.py')!r}: no such file" in _train_command_error(
        capsys, [str(tmp_path / "run_clm.py")])


def test_a_recipe_of_another_kind_is_named_with_the_flag_that_takes_it(capsys, tmp_path):
    """Issue #50: `hf-sparse-cp train --recipe trial` (a shipped pattern, which `hf-sparse-cp recipes` lists beside
    the training recipes) was refused with '--min_seq_len is now --sparse_min_seq_len; ...', flags the user never
    typed; a training recipe or a pattern given as --config_file ended in accelerate's traceback on its missing
    distributed_type. Each now names what the file is and the flag it goes to (own files too)."""
    own = tmp_path / "pattern.yaml"
    own.write_text("sparse_attention:\n  block_size: 64\n  budget: {mode: topk, vertical_topk: 32}\n")
    flat = tmp_path / "flat.json"
    flat.write_text('{"vertical_topk": 32, "min_seq_len": 0}')
    for given in ("trial", str(own), str(flat)):
        err = _train_command_error(capsys, ["--recipe", given])
        expected = (r"^hf-sparse-cp train: error: \S+ is a sparse pattern \(SparseAttentionConfig fields\), not a "
                    rf"training recipe of flags: give it as `--sparse_config {re.escape(given)}`\.$")
        assert re.search(expected, err, re.MULTILINE), err
        assert "is now" not in err
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("sparse_max_length: 512\ncp_size: 2\n")
    for given, what, use in (("qwen2.5-3b_32k", "a training recipe of flags", "hf-sparse-cp train --recipe"),
                             (str(recipe), "a training recipe of flags", "hf-sparse-cp train --recipe"),
                             ("trial", r"a sparse pattern \(SparseAttentionConfig fields\)", "--sparse_config")):
        err = _train_command_error(capsys, ["--config_file", given])
        assert re.search(rf"^hf-sparse-cp train: error: --config_file {re.escape(given)}: \S+ is {what}, not a launch "
                         rf"config for `accelerate launch --config_file`: give it as `{use} {re.escape(given)}`\.$",
                         err, re.MULTILINE), err
    # a name of none: the shipped names of the kind the flag takes (they listed every kind)
    err = _train_command_error(capsys, ["--recipe", "nosuch"])
    assert "qwen2.5-3b_32k" in err and "cpu_2proc_cp2" not in err and "trial" not in err, err
    err = _train_command_error(capsys, ["--config_file", "nosuch.yaml"])
    assert "error: --config_file: recipe 'nosuch.yaml' is neither a file nor a shipped recipe (cpu_2proc_cp2" in err
    assert "qwen2.5-3b_32k" not in err and "trial" not in err, err


def _saved_with_sparse_attention(folder, change) -> Path:
    """Save a configured tiny model into `folder`, `change` its config.json's mapping in place; the file's path."""
    import hf_sparse_cp

    hf_sparse_cp.patch()
    model = _tiny()
    hf_sparse_cp.configure(model)
    model.save_pretrained(folder)
    path = folder / "config.json"
    saved = json.loads(path.read_text())
    change(saved)
    path.write_text(json.dumps(saved))
    return path


@pytest.mark.parametrize("value", ["yes", [1, 2], 3])
def test_a_saved_model_whose_sparse_attention_key_is_not_a_mapping_is_named(tmp_path, value):
    """Issue #41 item 7: 'dictionary update sequence element #0 ...' at the first forward."""
    import torch
    from transformers import AutoModelForCausalLM

    from hf_sparse_cp import SparseAttentionConfig

    path = _saved_with_sparse_attention(tmp_path, lambda saved: saved.update(sparse_attention=value))
    named = rf"Model config '{re.escape(str(path))}': key 'sparse_attention' holds {re.escape(repr(value))}; it must " \
            r"hold a mapping of sparse attention fields"
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="sparse_cp")
    with pytest.raises(ValueError, match=named):
        loaded(input_ids=torch.randint(3, 200, (1, 16)))
    with pytest.raises(ValueError, match=rf"Config file '{re.escape(str(path))}': key 'sparse_attention' holds"):
        SparseAttentionConfig.from_file(path)


@pytest.mark.parametrize("change", ["key", "mode", "engine"])
def test_a_saved_model_with_settings_of_a_newer_version_names_the_fixes(tmp_path, change):
    """A saved model whose settings hold a key, a budget mode or an attention engine this installation does not know (a
    newer version's, a plug-in's not registered) failed its first forward naming the key alone (#50): the refusal says
    to upgrade, to register the plug-in (an engine's too: it named a budget mode's alone) or to store settings over
    them, which then run."""
    import torch
    from transformers import AutoModelForCausalLM

    import hf_sparse_cp
    from hf_sparse_cp import SparseAttentionConfig

    newer = {"key": {"new_knob": 3}, "mode": {"budget": {"mode": "newer_mode"}},
             "engine": {"attention_engine": "newer_engine"}}[change]
    _saved_with_sparse_attention(tmp_path, lambda saved: saved["sparse_attention"].update(newer))
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="sparse_cp")
    ids = torch.randint(3, 200, (1, 16))
    with pytest.raises(ValueError, match=r"(new_knob|newer_mode|newer_engine).*if a newer hf-sparse-cp saved them, "
                                         r"upgrade it \(a plug-in's budget mode or attention engine: register it.*"
                                         r"hf_sparse_cp.configure\(model, "
                                         r"SparseAttentionConfig\(...\)\)\), or remove 'sparse_attention'"):
        loaded(input_ids=ids)
    hf_sparse_cp.configure(loaded, SparseAttentionConfig())
    loaded(input_ids=ids)


@pytest.mark.parametrize("key, fix", [("5-10", "use keys within 0-1"), ("7", "use keys within 0-1"),
                                      ("1-3", "use '1-1'")])
def test_a_layer_override_past_the_models_layers_is_refused_naming_the_layer_count(key, fix):
    """Issue #41 item 9: an override of layers a 2-layer model does not have was ignored without a word."""
    import hf_sparse_cp
    from hf_sparse_cp import SparseAttentionConfig, SparseCPArguments
    from hf_sparse_cp.trainer.attach import enable_sparse_attention
    from hf_sparse_cp.trainer.schedule import Stage
    from hf_sparse_cp.trainer.stage_plan import build_schedule

    hf_sparse_cp.patch()
    config = SparseAttentionConfig(layer_overrides={key: {"pattern": "dense"}})
    refused = rf"layer_overrides key '{key}' reaches past the model's 2 layers: {re.escape(fix)}\."
    with pytest.raises(ValueError, match=refused):
        hf_sparse_cp.configure(_tiny(), config)
    with pytest.raises(ValueError, match=refused):
        enable_sparse_attention(_tiny(), SparseCPArguments(), attention_config=config)
    stages = (Stage(1024, 1, sparse={"layer_overrides": {key: {"pattern": "dense"}}}, from_step=0),)
    with pytest.raises(ValueError, match=r"cp_schedule stage 0 .*" + refused):
        build_schedule(stages, world_size=1, sparse_config=SparseAttentionConfig(), max_steps=4, n_layers=2)
    hf_sparse_cp.configure(_tiny(), SparseAttentionConfig(layer_overrides={"0-1": {"pattern": "dense"}}))


@pytest.mark.parametrize("flags, named", [
    ({"cp_mode": "ulysses"}, "--cp_mode ulysses"),
    ({"cp_sharding": "zigzag", "cp_ring": "hierarchical"}, "--cp_sharding zigzag, --cp_ring hierarchical"),
])
def test_cp_settings_in_a_run_without_cp_are_refused_naming_cp_size(tmp_path, flags, named):
    """`torchrun --nproc_per_node 2 train.py --cp_mode ulysses` (the CP degree forgotten) trained data-parallel, the
    setting ignored without a word: a setting of how a CP group shares its sequences, in a run whose CP degree is 1,
    is refused naming it and --cp_size; the defaults given explicitly (--cp_mode ring) are not."""
    import torch
    from transformers import AutoModelForCausalLM

    from hf_sparse_cp import SparseTrainer, SparseTrainingArguments
    from hf_sparse_cp.testing.tiny_models import tiny_config

    rows = [{"input_ids": torch.arange(3, 40), "labels": torch.arange(3, 40)}]

    def build(**cp):
        args = SparseTrainingArguments(output_dir=str(tmp_path), report_to="none", max_steps=1, use_cpu=True, **cp)
        return SparseTrainer(model=AutoModelForCausalLM.from_config(tiny_config("llama")), args=args,
                             train_dataset=rows)

    with pytest.raises(ValueError, match=rf"^{re.escape(named)}: (it|they) would be ignored: this run has no context "
                                         r"parallelism \(a CP degree of 1 over 1 process\)\. Add --cp_size N"):
        build(**flags)
    assert build(cp_mode="ring", cp_sharding="striped").parallel.cp_size == 1


def test_estimate_layout_names_queries_and_keys_it_cannot_estimate_over():
    """`hf_sparse_cp.estimate_layout(q, k, cfg)` with k shorter than q returned a layout (of q's length, listing key
    blocks k does not have), which `block_sparse_attention` then failed on with an IndexError; 3 query heads over 2
    key/value heads failed inside with torch's reshape error. Both are refused at the call, naming the shapes."""
    import torch

    from hf_sparse_cp import SparseAttentionConfig, TokenMeta, estimate_layout

    cfg = SparseAttentionConfig(vertical_topk=64, slash_topk=64, block_size=64, min_seq_len=0)
    q, k = torch.randn(1, 4, 128, 32), torch.randn(1, 2, 128, 32)
    assert estimate_layout(q, k, cfg).block_idx.shape[:3] == (1, 4, 2)
    for q_, k_, meta, message in [
        (q, k[:, :, :64], None, "q (1, 4, 128, 32) and k (1, 2, 64, 32) must have the same length S"),
        (q[:, :3], k, None, "query heads (3) must be a multiple of key/value heads (2)"),
        (q, k[..., :16], None, "k and v must be [B, Hkv, Sk, 32] with q's batch 1"),
        (q, k, TokenMeta.contiguous(1, 64, q.device), "meta must hold index and segment of shape [B, S] = (1, 128)"),
    ]:
        with pytest.raises(ValueError, match=re.escape(message)):
            estimate_layout(q_, k_, cfg, meta)


def test_block_sparse_attention_refuses_a_layout_built_for_more_keys_than_it_is_given():
    """A layout of 128 queries and keys over 64 keys (more queries than keys, default metas) listed key blocks and
    columns k lacks: an IndexError inside the engine. The layout's ranges are checked at the call (`check_layout`)."""
    import torch

    from hf_sparse_cp import SparseAttentionConfig, block_sparse_attention, estimate_layout

    cfg = SparseAttentionConfig(vertical_topk=64, slash_topk=64, block_size=32, min_seq_len=0)
    q, k = torch.randn(1, 2, 128, 16), torch.randn(1, 1, 128, 16)
    layout = estimate_layout(q, k, cfg)
    assert int(layout.block_idx.max()) == 3 and int(layout.block_cnt.sum()) > 0
    with pytest.raises(ValueError, match=re.escape("layout.block_idx holds key blocks outside [0, 2) (the 64 keys")):
        block_sparse_attention(q, k[:, :, :64], k[:, :, :64], layout)
    only_columns = dataclasses.replace(layout, block_cnt=torch.zeros_like(layout.block_cnt),
                                       col_idx=torch.full((*layout.col_cnt.shape, 1), 100, dtype=torch.int32),
                                       col_cnt=torch.ones_like(layout.col_cnt))
    with pytest.raises(ValueError, match=re.escape("layout.col_idx holds key tokens outside [0, 64)")):
        block_sparse_attention(q, k[:, :, :64], k[:, :, :64], only_columns)
    out, _ = block_sparse_attention(q, k, k, layout)  # (the keys it was built for)
    assert out.shape == q.shape


def _one_row_layout(blocks, cols):
    """A layout of one row and head over 32 tokens in blocks of 16: per query block its key blocks and columns,
    kept as given."""
    import torch

    from hf_sparse_cp.attention.layout import SparseLayout

    pack = lambda rows, width: (torch.tensor([[[r + [-1] * (width - len(r)) for r in rows]]], dtype=torch.int32),
                                torch.tensor([[[len(r) for r in rows]]], dtype=torch.int32))
    return SparseLayout(*pack(blocks, 3), *pack(cols, 2), 16)


@pytest.mark.parametrize("blocks,cols,what,fix", [
    ([[0], [0, 0, 1]], [[], []], "a key block twice", "compact_sorted"),
    ([[0], [1]], [[], [3, 3]], "a key column twice", "compact_sorted"),
    ([[0], [0, 1]], [[], [3]], "a key column inside one of its listed key blocks", "drop the columns whose block"),
], ids=["block", "column", "column-in-block"])
def test_block_sparse_attention_refuses_a_layout_listing_a_key_twice(blocks, cols, what, fix):
    """A hand-made layout listing a key twice for one query block was taken: the reference and the kernels counted
    the key twice in the softmax (out 0.27-0.50 off the layout listing it once), the masked engine once, Flex a
    repeated block once and a repeated column twice: one layout, other numbers per engine. The call's layout check
    refuses it, naming the fix for its case (compact_sorted, which the message named for a column inside a listed
    block too, keeps such a column); listed in another order, the keys are taken (the engines agree on those)."""
    import torch

    from hf_sparse_cp import block_sparse_attention
    from hf_sparse_cp.attention.layout import SparseLayout, compact_sorted

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, 32, 8, generator=g, dtype=torch.float64) for _ in range(3))
    for engine in ("reference", "masked"):
        with pytest.raises(ValueError, match=re.escape(f"a query block of the layout lists {what}: list each key "
                                                       "once")) as refused:
            block_sparse_attention(q, k, v, _one_row_layout(blocks, cols), implementation=engine)
        assert fix in str(refused.value) and (fix == "compact_sorted") == ("compact_sorted" in str(refused.value))
    if fix == "compact_sorted":  # (the fix named, followed: the layout is taken)
        given = _one_row_layout(blocks, cols)
        fixed = SparseLayout(*compact_sorted(given.block_idx.long(), given.valid_blocks()),
                             *compact_sorted(given.col_idx.long(), given.valid_cols()), 16)
        block_sparse_attention(q, k, v, fixed)
    reordered = [block_sparse_attention(q, k, v, _one_row_layout([[0], [1, 0]], [[], []]), implementation=engine)[0]
                 for engine in ("reference", "masked")]
    listed_once = block_sparse_attention(q, k, v, _one_row_layout([[0], [0, 1]], [[], []]))[0]
    assert all(torch.allclose(out, listed_once, atol=1e-12) for out in reordered)


def test_the_example_ends_a_setting_its_trainer_refuses_as_a_bad_flag(tmp_path, capsys, monkeypatch):
    """The example ended what its Trainer refused with `SystemExit("error: ...")`: exit status 1, which a launched run
    reports as a crash (the message from every rank, then torchrun's traceback). It ends as a refused flag now:
    `train_long_context.py: error: MESSAGE` once, exit status 2 (`launch.refusals.end_refused`)."""
    from hf_sparse_cp.examples.train_long_context import main

    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    with pytest.raises(SystemExit) as ended:
        main(["--output_dir", str(tmp_path / "out"), "--sparse_max_length", "512", "--max_steps", "4", "--num_samples",
              "8", "--cp_schedule", "0:256:1,1:512:1,0.01ep:512:1"])
    assert ended.value.code == 2
    err = capsys.readouterr().err
    assert err.count("train_long_context.py: error: cp_schedule stage 2 (0.01ep:512:1) starts at step 1") == 1, err


def test_an_fsdp2_checkpoint_resumed_by_one_process_names_a_fix_that_runs_there(tmp_path):
    """Its refusal said only "resume with --fsdp ...", which one process refuses in turn ("--fsdp shards the model
    over processes, and this one runs alone"): a dead end. It names the weights, which one process loads."""
    from hf_sparse_cp.resharding.resume import SHARDED_STATE
    from hf_sparse_cp.trainer.checkpoints import MARKER, check_checkpoint, read_marker

    saved = {"cp_size": 2, "data_parallel_size": 1, "smet": None, "global_batch_size": 1}
    (tmp_path / SHARDED_STATE).mkdir()
    (tmp_path / SHARDED_STATE / "layout.json").write_text("{}")
    (tmp_path / MARKER).write_text(json.dumps({"complete": True, "step": 2, "settings": saved, "files": {}}))
    alone = {"cp_size": 1, "data_parallel_size": 1, "smet": None, "global_batch_size": 1}
    with pytest.raises(ValueError, match="this run is one: resume on several with --fsdp.*or start a new run from its "
                                         f"weights \\(--model_name_or_path {tmp_path}"):
        check_checkpoint(tmp_path, alone, read_marker(tmp_path), reshardable=False)
    with pytest.raises(ValueError, match="only a run with FSDP2 loads it. Resume with --fsdp with --fsdp_config"):
        check_checkpoint(tmp_path, {**alone, "data_parallel_size": 2}, read_marker(tmp_path), reshardable=False)


def test_the_python_api_names_a_config_of_the_wrong_kind():
    """`configure(model, {"vertical_topk": 3})` ended in an AttributeError ('dict' has no check_layers) and
    `SparseAttentionConfig.from_dict(None)` in a TypeError of the key flattening: both name what to pass."""
    from transformers import AutoModelForCausalLM

    from hf_sparse_cp import ContextParallelConfig, SparseAttentionConfig, configure
    from hf_sparse_cp.smet import SMETConfig
    from hf_sparse_cp.testing.tiny_models import tiny_config

    model = AutoModelForCausalLM.from_config(tiny_config("llama"))
    for config in ({"vertical_topk": 3}, ContextParallelConfig()):
        with pytest.raises(TypeError, match=rf"^configure\(model, config\): config must be a SparseAttentionConfig, "
                           rf"not {type(config).__name__}: build it with SparseAttentionConfig\(\*\*fields\), "
                           r"SparseAttentionConfig.from_dict\(mapping\)"):
            configure(model, config, select=False)
    with pytest.raises(TypeError, match=r"^configure\(model, \.\.\., select=\.\.\.\): select must be True or False, "
                       "not str 'no'"):  # (text was true: the model was switched to sparse_cp)
        configure(model, select="no")
    for cls, data in ((SparseAttentionConfig, None), (SparseAttentionConfig, [1]), (SMETConfig, "density: 0.5")):
        with pytest.raises(TypeError, match=rf"^{cls.__name__}.from_dict takes a mapping of .* fields \(name -> "
                           rf"value; {{}} for the defaults\), not {type(data).__name__} .*; for a file, use "
                           rf"{cls.__name__}.from_file\(path\)"):
            cls.from_dict(data)


def test_the_attention_functions_refuse_inputs_they_would_answer_wrongly_or_deep_inside():
    """`block_sparse_attention` with sliding_window 0 (or below) returned zeros for every query without a word (no
    key visible, not even its own); a head_dim of 0 ended in a ZeroDivisionError, a list for q, a layout or a config
    of the wrong kind in AttributeErrors deep inside. Each is refused at the call, naming the fix."""
    import torch

    from hf_sparse_cp import SparseAttentionConfig, block_sparse_attention, estimate_layout

    cfg = SparseAttentionConfig(vertical_topk=64, slash_topk=64, block_size=64, min_seq_len=0)
    q = k = v = torch.randn(1, 2, 128, 16)
    layout = estimate_layout(q, k, cfg)
    window = "sliding_window=0 must be a whole number >= 1 (keys sliding_window or more tokens before a query are"
    for call, error, message in [
        (lambda: block_sparse_attention(q, k, v, layout, sliding_window=0), ValueError, window),
        (lambda: block_sparse_attention(q, k, v, layout, sliding_window=-4), ValueError, "sliding_window=-4 must"),
        (lambda: estimate_layout(q, k, cfg, sliding_window=0), ValueError, window),
        (lambda: block_sparse_attention(q[..., :0], k[..., :0], v[..., :0], layout), ValueError,
         "q, k, v have head_dim 0: attention needs at least 1"),
        (lambda: block_sparse_attention(q.tolist(), k, v, layout), TypeError,
         "q, k, v must be torch.Tensors [batch, heads, seq, head_dim]; got list, Tensor, Tensor"),
        (lambda: block_sparse_attention(q, k, v, None), TypeError,
         "layout must be a SparseLayout (from estimate_layout, build_layout or dense_layout); got NoneType."),
        (lambda: estimate_layout(q, k, {"block_size": 64}), TypeError, "cfg must be a SparseAttentionConfig"),
    ]:
        with pytest.raises(error, match=f"^{re.escape(message)}"):
            call()
    out, lse = block_sparse_attention(q, k, v, layout, sliding_window=1)  # (each query sees itself alone)
    torch.testing.assert_close(out, v)
    torch.testing.assert_close(lse, (q * k).sum(-1) / 4)


# Every public entry point of `hf_sparse_cp.__all__` whose first argument is a model, a Trainer, a class or a text,
# called with what it does not take; (entry point, the call with the wrong value, what the message names).
_MODEL, _TRAINER = "model must be a transformers model", "trainer must be a transformers Trainer"
_WRONG_FIRST = {
    "configure": (lambda h, x: h.configure(x), _MODEL),
    "enable_sparse_attention": (lambda h, x: h.enable_sparse_attention(x, h.SparseCPArguments()), _MODEL),
    "disable_sparse_attention": (lambda h, x: h.disable_sparse_attention(x), _MODEL),
    "check_model_supports_context_parallel": (lambda h, x: h.check_model_supports_context_parallel(x), _MODEL),
    "attach_to_trainer": (lambda h, x: h.attach_to_trainer(x, h.SparseCPArguments()), _TRAINER),
    "detach_from_trainer": (lambda h, x: h.detach_from_trainer(x), _TRAINER),
    "enable_trainer_context_parallel": (lambda h, x: h.enable_trainer_context_parallel(x), _TRAINER),
    "disable_trainer_context_parallel": (lambda h, x: h.disable_trainer_context_parallel(x), _TRAINER),
    "enable_cpu_fsdp2": (lambda h, x: h.enable_cpu_fsdp2(x), _TRAINER),
    "disable_cpu_fsdp2": (lambda h, x: h.disable_cpu_fsdp2(x), _TRAINER),
    "enable_curriculum": (lambda h, x: h.enable_curriculum(x, h.parse_schedule("0:256:1")), _TRAINER),
    "disable_curriculum": (lambda h, x: h.disable_curriculum(x), _TRAINER),
    "install_smet": (lambda h, x: h.install_smet(x, h.SMETArguments(smet=True).to_config()), _TRAINER),
    "uninstall_smet": (lambda h, x: h.uninstall_smet(x), _TRAINER),
    "write_sparse_model_card": (lambda h, x: h.write_sparse_model_card(x), _TRAINER),
    "checkpointing_enabled": (lambda h, x: h.checkpointing_enabled(x), "training_args must be TrainingArguments"),
    "sparse_arguments_class": (lambda h, x: h.sparse_arguments_class(x), "base must be TrainingArguments or a class "
                               "derived from it"),
    "sparse_trainer_class": (lambda h, x: h.sparse_trainer_class(x), "base must be Trainer or a class derived from"),
    "parse_schedule": (lambda h, x: h.parse_schedule(x), "text must be a --cp_schedule string"),
    "schedule_cp_config": (lambda h, x: h.schedule_cp_config(x), "cp_schedule must be a --cp_schedule string"),
    "explicit_fields": (lambda h, x: h.explicit_fields(x, []), "takes the parser (an HfArgumentParser)"),
    "estimate_layout": (lambda h, x: h.estimate_layout(x, x, h.SparseAttentionConfig()), "must be torch.Tensors"),
    "block_sparse_attention": (lambda h, x: h.block_sparse_attention(x, x, x, None), "must be torch.Tensors"),
}
# taking no argument, or transformers' attention interface's (called by the model, never by the user)
_NO_FIRST = {"patch", "unpatch", "is_patched", "enable_lean_loss", "disable_lean_loss", "is_lean_loss_enabled",
             "sparse_cp_attention_forward"}


# The public functions' other required arguments, given None or a mapping: (the call, what the message names).
_WRONG_OTHER = {
    "install_smet": (lambda h, t, m, x: h.install_smet(t, x), "install_smet(trainer, config): config must be a "
                     "SMETConfig, not "),
    "attach_to_trainer": (lambda h, t, m, x: h.attach_to_trainer(t, x), "attach_to_trainer(trainer, sparse_args, "
                          "...): sparse_args must be a SparseCPArguments, not "),
    "attach_to_trainer cp_config": (lambda h, t, m, x: h.attach_to_trainer(t, h.SparseCPArguments(), x or 2),
                                    "cp_config must be a ContextParallelConfig, not "),
    "enable_sparse_attention": (lambda h, t, m, x: h.enable_sparse_attention(m, x), "enable_sparse_attention(model, "
                                "sparse_args, ...): sparse_args must be a SparseCPArguments, not "),
    "enable_curriculum": (lambda h, t, m, x: h.enable_curriculum(t, x), "enable_curriculum(trainer, schedule, ...): "
                          "schedule must be a Schedule, not "),
    "enable_trainer_context_parallel": (lambda h, t, m, x: h.enable_trainer_context_parallel(t, x or 2),
                                        "cp_config must be a ContextParallelConfig, not "),
}


@pytest.mark.parametrize("name", sorted(_WRONG_OTHER))
@pytest.mark.parametrize("wrong", [None, {"density": 0.1}])
def test_a_wrong_config_or_arguments_object_is_a_type_error_naming_what_to_pass(name, wrong, tmp_path):
    """Issue #50: install_smet(trainer, None) ended in an AttributeError ('NoneType' object has no attribute
    'target_modules'), as did attach_to_trainer / enable_sparse_attention without their SparseCPArguments and
    enable_curriculum without a schedule: each is a TypeError naming the argument and what to pass (a mapping:
    the config's from_dict)."""
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    import hf_sparse_cp
    from hf_sparse_cp.testing.tiny_models import tiny_config

    model = AutoModelForCausalLM.from_config(tiny_config("llama"))
    trainer = Trainer(model=model, args=TrainingArguments(str(tmp_path), use_cpu=True, report_to="none"))
    call, named = _WRONG_OTHER[name]
    with pytest.raises(TypeError, match=re.escape(named)) as raised:
        call(hf_sparse_cp, trainer, model, wrong)
    if name == "install_smet" and wrong is not None:
        assert "build it from the mapping with SMETConfig.from_dict(...)" in str(raised.value)


def test_every_public_function_is_checked_for_a_wrong_first_argument():
    import inspect

    import hf_sparse_cp

    functions = {name for name in hf_sparse_cp.__all__ if inspect.isfunction(getattr(hf_sparse_cp, name))}
    assert functions - _NO_FIRST == set(_WRONG_FIRST), "a public function without a case below"


@pytest.mark.parametrize("name", sorted(_WRONG_FIRST))
@pytest.mark.parametrize("wrong", ["hub id", "None", "torch module", "model config", "int"])
def test_a_wrong_first_argument_is_a_type_error_naming_what_to_pass(name, wrong):
    """Issue #50: `hf_sparse_cp.configure("some string")` raised an AttributeError deep inside ('str' object has no
    attribute 'config'; with select=True a ValueError about patch()); attach_to_trainer(model), enable_curriculum(None),
    sparse_trainer_class(a config) and the others likewise (AttributeError, 'unhashable type'), and the undo functions
    did nothing when given a torch module. Each is a TypeError that names the call's argument and what to pass."""
    import torch

    import hf_sparse_cp
    from hf_sparse_cp.testing.tiny_models import tiny_config

    if name in ("parse_schedule", "schedule_cp_config") and wrong == "hub id":
        pytest.skip("its argument is a text (a malformed one is a ValueError naming the stage)")
    value = {"hub id": "Qwen/Qwen2.5-0.5B", "None": None, "torch module": torch.nn.Linear(2, 2),
             "model config": tiny_config("llama"), "int": 3}[wrong]
    call, named = _WRONG_FIRST[name]
    with pytest.raises(TypeError, match=re.escape(named)) as raised:
        call(hf_sparse_cp, value)
    message = str(raised.value)
    if named in (_MODEL, _TRAINER):
        assert message.startswith(f"{name}("), message
    if named == _MODEL and wrong == "hub id":
        assert "AutoModelForCausalLM.from_pretrained('Qwen/Qwen2.5-0.5B')" in message, message
    if named == _MODEL and wrong == "model config":
        assert "AutoModelForCausalLM.from_config(config)" in message, message


def test_a_trainer_given_where_the_model_goes_names_its_model():
    from transformers import Trainer, TrainingArguments

    import hf_sparse_cp

    trainer = Trainer(model=_tiny(), args=TrainingArguments(output_dir="unused", report_to="none", use_cpu=True))
    with pytest.raises(TypeError, match=r"configure\(model, \.\.\.\): model must be a transformers model, not a "
                                        r"Trainer: pass the Trainer's model \(trainer.model\)"):
        hf_sparse_cp.configure(trainer)
    with pytest.raises(TypeError, match=r"pass its class, type\(\.\.\.\)"):
        hf_sparse_cp.sparse_arguments_class(trainer.args)


def test_the_attention_functions_refuse_a_scale_window_metadata_or_heads_they_would_misread():
    """`block_sparse_attention` took sliding_window=2.5 as a window of 3 and True as 1, and ended a window of text in a
    comparison's TypeError; a scale of text ended in a TypeError inside the reference engine; q_meta / meta of the wrong
    kind in AttributeErrors; k and v of 0 heads in a ZeroDivisionError and estimate_layout's q of 0 heads in a reshape's
    RuntimeError. Each is refused at the call, naming the fix; whole numbers of any integer type still pass."""
    import numpy
    import torch

    from hf_sparse_cp import SparseAttentionConfig, TokenMeta, block_sparse_attention, estimate_layout
    from hf_sparse_cp.attention import dense_layout

    cfg = SparseAttentionConfig(vertical_topk=64, slash_topk=64, block_size=64, min_seq_len=0)
    q = k = v = torch.randn(1, 2, 128, 16)
    layout = dense_layout(TokenMeta.contiguous(1, 128), 64)
    window = "must be a whole number >= 1 (keys sliding_window or more tokens before a query are invisible"
    scale = "must be a float (the softmax scale, e.g. 1 / math.sqrt(head_dim)) or None for 1 / sqrt(head_dim)."
    meta = "must be a TokenMeta (TokenMeta.contiguous(batch, seq_len), TokenMeta.from_segments(segment ids [B, S])) or "
    for call, error, message in [
        (lambda: block_sparse_attention(q, k, v, layout, sliding_window=2.5), ValueError,
         f"sliding_window=2.5 {window}"),
        (lambda: block_sparse_attention(q, k, v, layout, sliding_window=True), ValueError,
         f"sliding_window=True {window}"),
        (lambda: estimate_layout(q, k, cfg, sliding_window="4"), ValueError, f"sliding_window='4' {window}"),
        (lambda: block_sparse_attention(q, k, v, layout, scale="0.25"), TypeError, f"scale='0.25' (str) {scale}"),
        (lambda: estimate_layout(q, k, cfg, scale=torch.tensor(0.25)), TypeError, "scale=tensor(0.2500) (Tensor)"),
        (lambda: block_sparse_attention(q, k, v, layout, q_meta={"segment": None}), TypeError, f"q_meta {meta}"),
        (lambda: block_sparse_attention(q, k, v, layout, k_meta=torch.zeros(1, 128)), TypeError, f"k_meta {meta}"),
        (lambda: estimate_layout(q, k, cfg, torch.zeros(1, 128)), TypeError, f"meta {meta}"),
        (lambda: block_sparse_attention(q[:, :0], k[:, :0], v[:, :0], layout), ValueError,
         "k and v have 0 key/value heads ((1, 0, 128, 16)): attention needs at least 1."),
        (lambda: estimate_layout(q[:, :0], k, cfg), ValueError, "q has 0 heads ((1, 0, 128, 16)): a layout is "
                                                                "estimated per query head; give at least 1."),
    ]:
        with pytest.raises(error, match=f"^{re.escape(message)}"):
            call()
    out, _ = block_sparse_attention(q, k, v, layout, sliding_window=numpy.int64(3), scale=numpy.float32(0.5))
    torch.testing.assert_close(out, block_sparse_attention(q, k, v, layout, sliding_window=3, scale=0.5)[0])
    assert block_sparse_attention(q[:, :0], k, v, layout)[0].shape == (1, 0, 128, 16)  # (no query head: as SDPA)


@pytest.mark.parametrize("build, named", [
    (lambda c: c.SparseAttentionConfig(verticle_topk=8), "keys ['verticle_topk'] (did you mean 'vertical_topk'?); "
                                                         "known keys: ['attention_engine', "),
    (lambda c: c.SparseAttentionConfig.from_dict({"sink_token": 8, "colour": 1}),
     "keys ['colour', 'sink_token'] (did you mean 'sink_tokens' for 'sink_token'?); known keys:"),
    (lambda c: c.SparseAttentionConfig(budget={"mode": "topk", "slash_top": 8}),
     "Unknown budget key 'slash_top' (did you mean 'slash_topk' or 'slash_topp'?); the budget section's keys: "),
    (lambda c: c.SMETConfig.from_dict({"densty": 0.1}), "Unknown SMET config keys ['densty'] (did you mean "
                                                        "'density'?); known keys: "),
    # the constructors of the typed configs too (they raised Python's "unexpected keyword argument" alone)
    (lambda c: c.SMETConfig(densty=0.1), "Unknown SMET config keys ['densty'] (did you mean 'density'?); known "),
    (lambda c: c.ContextParallelConfig(mode="ring"), "Unknown context parallel config keys ['mode'] (did you mean "
                                                     "'cp_mode'?); known keys: ['cp_allow_untested_model', "),
    (lambda c: c.Scoring(last_qs=8), "Unknown scoring config keys ['last_qs'] (did you mean 'last_q'?)"),
    (lambda c: c.TopK(slash_top=8), "Unknown budget config keys ['slash_top'] (did you mean 'slash_topk'?)"),
    (lambda c: c.TopK(topk=8), "Unknown budget config keys ['topk'] (did you mean 'vertical_topk' or 'slash_topk'?)"),
    # and the flag dataclasses of a Trainer script, built in code
    (lambda c: c.h.SparseCPArguments(sparse_atention=True), "Unknown plugin config keys ['sparse_atention'] (did "
                                                             "you mean 'sparse_attention'?)"),
    (lambda c: c.h.SMETArguments(smet_densty=0.1), "Unknown SMET flag config keys ['smet_densty'] (did you mean "
                                                   "'smet_density'?)"),
    (lambda c: c.h.CurriculumArguments(schedule="0:128:1"), "Unknown curriculum config keys ['schedule'] (did you "
                                                            "mean 'cp_schedule'?)"),
    (lambda c: c.h.SparseAttentionFlags(sparse_verticle_topk=8), "Unknown sparse attention flag config keys "
                                                                 "['sparse_verticle_topk'] (did you mean "
                                                                 "'sparse_vertical_topk'?)"),
    # and the Trainer argument classes generated from a TrainingArguments class and the plugin's flags (their ~260
    # fields not listed), and the plugin's flags alone (what hf_sparse_cp.run reads)
    (lambda c: c.h.SparseTrainingArguments(output_dir="out", sparse_atention=True), "Unknown training argument config "
     "keys ['sparse_atention'] (did you mean 'sparse_attention'?); known keys: the fields of TrainingArguments and the "
     "plugin's flags (docs/flags.md lists them)."),
    (lambda c: c.h.sparse_arguments_class(c.Seq2SeqTrainingArguments)(output_dir="out", learning_rat=1e-4),
     "Unknown training argument config keys ['learning_rat'] (did you mean 'learning_rate'?); known keys: the fields "
     "of Seq2SeqTrainingArguments and"),
    (lambda c: c.PluginArguments(cp_sise=2), "Unknown plugin config keys ['cp_sise'] (did you mean 'cp_size'?); known "
     "keys: the plugin's flags (docs/flags.md lists them)."),
])
def test_an_unknown_config_key_is_named_with_the_key_it_is_a_typo_of(build, named):
    """An unknown key listed the 25 known ones and left the reader to find `vertical_topk` among them for
    `verticle_topk`: the close keys are named beside it (all of those as close: `slash_top` may be either), in
    a file, a mapping or a constructor's keyword."""
    import types

    from transformers import Seq2SeqTrainingArguments

    import hf_sparse_cp
    from hf_sparse_cp import SparseAttentionConfig
    from hf_sparse_cp.attention.budgets import TopK
    from hf_sparse_cp.config.sections import Scoring
    from hf_sparse_cp.distributed.cp_config import ContextParallelConfig
    from hf_sparse_cp.smet import SMETConfig
    from hf_sparse_cp.trainer.plugin_arguments import PluginArguments

    with pytest.raises(ValueError, match=re.escape(named)):
        build(types.SimpleNamespace(SparseAttentionConfig=SparseAttentionConfig, SMETConfig=SMETConfig,
                                    ContextParallelConfig=ContextParallelConfig, Scoring=Scoring, TopK=TopK,
                                    h=hf_sparse_cp, Seq2SeqTrainingArguments=Seq2SeqTrainingArguments,
                                    PluginArguments=PluginArguments))
    # a constructor's bad keyword is still a TypeError (what its callers catch), as Python's was
    with pytest.raises(TypeError, match=re.escape("(did you mean 'density'?)")):
        SMETConfig(densty=0.1)


def test_create_smet_optimizer_refuses_a_model_config_betas_or_weight_it_cannot_use():
    """`create_smet_optimizer` with a dict for config or a list for the model ended in AttributeErrors inside, betas of
    3 values trained with the first 2 (torch's Adam refuses them at its step), one beta ended in a TypeError, and a
    target weight with no elements (a Linear of 0 inputs) in a ZeroDivisionError: each is refused naming the fix."""
    import torch
    from torch import nn

    from hf_sparse_cp.smet import SMETConfig, create_smet_optimizer

    class Model(nn.Module):
        def __init__(self, inputs=32):
            super().__init__()
            self.q_proj = nn.Linear(inputs, 32)

    config = SMETConfig(density=0.5, target_modules=["q_proj"])
    for call, error, message in [
        (lambda: create_smet_optimizer(Model(), config={"density": 0.5}), TypeError,
         "create_smet_optimizer(..., config=...): config must be an SMETConfig, not dict: build it with "
         "SMETConfig(**fields) or SMETConfig.from_dict(mapping)."),
        (lambda: create_smet_optimizer(list(Model().parameters()), config=config), TypeError,
         "create_smet_optimizer(model, ...): model must be the torch.nn.Module to train"),
        (lambda: create_smet_optimizer(Model(), config=config, betas=(0.9, 0.99, 0.9)), ValueError,
         "betas=(0.9, 0.99, 0.9) must be two numbers, both in [0, 1), e.g. (0.9, 0.999)."),
        (lambda: create_smet_optimizer(Model(), config=config, betas=0.9), ValueError, "betas=0.9 must be two numbers"),
        (lambda: create_smet_optimizer(Model(0), config=config), ValueError,
         "q_proj.weight has shape (32, 0): an empty weight has no blocks to train sparsely. Remove its module from "
         "target_modules."),
    ]:
        with pytest.raises(error, match=f"^{re.escape(message)}"):
            call()
    optimizer = create_smet_optimizer(Model(), config=config, betas=[0.8, torch.tensor(0.9)])
    assert optimizer.param_groups[0]["betas"] == pytest.approx((0.8, 0.9))


def test_cu_seq_lens_q_other_than_cu_seq_lens_k_is_refused():
    """A packed batch whose cu_seq_lens_q ([0, 30, 64]) differ from its cu_seq_lens_k ([0, 20, 64]) was attended by the
    keys' documents alone, the queries' ignored without a word; queries and keys of a call are the same tokens, so the
    two must agree. Equal boundaries in separate tensors (as DataCollatorWithFlattening gives them) pass."""
    import torch

    from hf_sparse_cp.attention.tokens import token_meta_from_kwargs

    def meta(q, k):
        return token_meta_from_kwargs(1, 64, torch.device("cpu"), None, {
            "cu_seq_lens_q": torch.tensor(q, dtype=torch.int32), "cu_seq_lens_k": torch.tensor(k, dtype=torch.int32)})

    with pytest.raises(ValueError, match=re.escape("cu_seq_lens_q [0, 30, 64] and cu_seq_lens_k [0, 20, 64] differ, "
                                                   "but the queries and keys of this call are the same tokens")):
        meta([0, 30, 64], [0, 20, 64])
    assert meta([0, 20, 64], [0, 20, 64]).segment[0, 19:21].tolist() == [0, 1]


def test_layouts_metadata_and_merges_refuse_inputs_they_would_build_wrongly():
    """`merge_attention` of a part of 1 head into one of 2 broadcast it: a result for other queries, without a word.
    `dense_layout(meta, 100)` built a layout of 100-token blocks that only the attention call refused, block_size 0
    ended in a ZeroDivisionError, sliding_window 0 built a layout of what no query sees, meta None an AttributeError;
    `TokenMeta.from_segments` truncated fractional document ids (0.5 -> document 0; whole ones in a float tensor
    are taken) and took [S] for [B, S]."""
    import torch

    from hf_sparse_cp import TokenMeta
    from hf_sparse_cp.attention import dense_layout, merge_attention

    meta = TokenMeta.contiguous(1, 128)
    out, lse = torch.randn(1, 2, 128, 16), torch.randn(1, 2, 128)
    ids = "TokenMeta.from_segments takes the document id of every token as an integer tensor [batch, seq] (-1 for "
    for call, error, message in [
        (lambda: merge_attention(out, lse, out[:, :1], lse[:, :1]), ValueError,
         "merge_attention takes two parts of the same queries: out and out_part [..., S, D], lse and lse_part [..., "
         "S]; got out (1, 2, 128, 16), lse (1, 2, 128), out_part (1, 1, 128, 16), lse_part (1, 1, 128)."),
        (lambda: merge_attention(out, lse[..., :64], out, lse[..., :64]), ValueError, "merge_attention takes two"),
        (lambda: dense_layout(meta, 100), ValueError, "block_size=100 must be a power of two >= 16; use 64 or 128."),
        (lambda: dense_layout(meta, 0), ValueError, "block_size=0 must be a power of two >= 16"),
        (lambda: dense_layout(meta, 64, sliding_window=0), ValueError, "sliding_window=0 must be a whole number >= 1"),
        (lambda: dense_layout(None, 64), TypeError, "meta must be a TokenMeta (TokenMeta.contiguous(batch, seq_len), "
                                                    "TokenMeta.from_segments(segment ids [B, S])); got NoneType."),
        (lambda: TokenMeta.from_segments(torch.tensor([[0.0, 0.5, 1.0]])), ValueError,
         f"{ids}padding; one row: segment[None]); got a (1, 3) torch.float32 tensor."),
        (lambda: TokenMeta.from_segments(torch.tensor([0, 0, 1])), ValueError,
         f"{ids}padding; one row: segment[None]); got a (3,) torch.int64"),
        (lambda: TokenMeta.from_segments([[0, 0, 1]]), TypeError, f"{ids}padding; one row: segment[None]); got list."),
    ]:
        with pytest.raises(error, match=f"^{re.escape(message)}"):
            call()
    assert TokenMeta.from_segments(torch.tensor([[0, 0, -1]], dtype=torch.int16)).documents == [[(0, 2)]]
    assert TokenMeta.from_segments(torch.tensor([[0.0, 1.0, -1.0]])).documents == [[(0, 1), (1, 2)]]
    merged, _ = merge_attention(out, lse, out, torch.full_like(lse, float("-inf")))
    torch.testing.assert_close(merged, out)


def test_the_backend_names_cu_seq_lens_of_the_wrong_form_and_3d_queries(patched):
    """cu_seq_lens of fractions ([0, 32.5, 64]) were truncated to other documents without a word, [1, N] ones ended in
    "only one element tensors can be converted to Python scalars"; `sparse_cp_attention_forward` called with 3-D
    query / key / value in "not enough values to unpack". Each is named; whole offsets in a float tensor pass."""
    import torch
    from transformers import AutoModelForCausalLM

    from hf_sparse_cp import sparse_cp_attention_forward
    from hf_sparse_cp.attention.tokens import token_meta_from_kwargs
    from hf_sparse_cp.testing.tiny_models import tiny_config

    cu = "cu_seq_lens must be a 1-D tensor of whole token offsets [0, ..., total] (as DataCollatorWithFlattening gives "
    for offsets, got in [(torch.tensor([0.0, 32.5, 64.0]), "a (3,) torch.float32 tensor [0.0, 32.5, 64.0]."),
                         (torch.tensor([[0, 32, 64]]), "a (1, 3) torch.int64 tensor [[0, 32, 64]].")]:
        with pytest.raises(ValueError, match=f"^{re.escape(cu)}them\\); got {re.escape(got)}$"):
            token_meta_from_kwargs(1, 64, torch.device("cpu"), None, {"cu_seq_lens_k": offsets})
    whole = token_meta_from_kwargs(1, 64, torch.device("cpu"), None, {"cu_seq_lens_k": torch.tensor([0.0, 32, 64])})
    assert whole.segment[0, 31:33].tolist() == [0, 1]

    model = AutoModelForCausalLM.from_config(tiny_config("llama"), attn_implementation="sparse_cp")
    q, k = torch.randn(4, 64, 32), torch.randn(2, 64, 32)
    with pytest.raises(ValueError, match=re.escape("q, k, v must be 4-D [batch, heads, seq, head_dim]; got "
                                                   "(4, 64, 32), (2, 64, 32), (2, 64, 32)")):
        sparse_cp_attention_forward(model.model.layers[0].self_attn, q, k, k, None)
    out, _ = sparse_cp_attention_forward(model.model.layers[0].self_attn, q[None], k[None], k[None], None)
    assert out.shape == (1, 64, 4, 32)


def test_the_backend_refuses_a_head_dim_scale_mask_or_positions_it_would_misread(patched):
    """Issue #50: `sparse_cp_attention_forward` with a head_dim of 0 ended in a ZeroDivisionError (its default scale),
    a NaN or infinite scaling returned NaN outputs without a word, a mask given as text ended in an AttributeError, and
    position_ids with more rows than the batch in a torch broadcasting error. position_ids of another length than the
    queries' were read as one document (two packed ones attended across), a 2D mask longer than the queries by its
    last columns (transformers' SDPA reads the first), and a NaN or negative dropout as no dropout (NaN > 0 is False).
    Each is refused at the call, naming what to pass; positions of one row for a batch of two still pass."""
    import torch
    from transformers import AutoModelForCausalLM

    from hf_sparse_cp import sparse_cp_attention_forward
    from hf_sparse_cp.testing.tiny_models import tiny_config

    layer = AutoModelForCausalLM.from_config(tiny_config("llama"), attn_implementation="sparse_cp").model.layers[0]
    q, k = torch.randn(2, 4, 64, 32), torch.randn(2, 2, 64, 32)
    finite = "must be finite (the softmax scale, e.g. 1 / math.sqrt(head_dim)), or None for 1 / sqrt(head_dim)."
    positions = ("for a batch of 2 rows of 64 tokens: give one position per token, one row per row of the batch ([2, "
                 "64]), or one row for all of them ([1, 64] or [64]).")
    improbable = "is no dropout probability (a number in [0, 1), 0.0 for none): build the model with attention_dropout"
    for kwargs, error, message in [
        ({"query": q[..., :0], "key": k[..., :0], "value": k[..., :0]}, ValueError,
         "q, k, v have head_dim 0: attention needs at least 1"),
        ({"scaling": float("nan")}, ValueError, f"scale=nan {finite}"),
        ({"scaling": float("inf")}, ValueError, f"scale=inf {finite}"),
        ({"attention_mask": "causal"}, TypeError, "sparse_cp takes attention_mask as a 2D padding mask tensor [batch, "
                                                  "seq] or None, not str 'causal'"),
        ({"position_ids": torch.arange(64).repeat(3, 1)}, ValueError, f"position_ids has shape (3, 64) {positions}"),
        ({"position_ids": torch.arange(32).repeat(2)[None, :60]}, ValueError, f"position_ids has shape (1, 60) "
                                                                               f"{positions}"),
        ({"position_ids": torch.arange(70)}, ValueError, f"position_ids has shape (70,) {positions}"),
        ({"attention_mask": torch.cat([torch.ones(2, 64), torch.zeros(2, 16)], 1)}, ValueError,
         "attention_mask has shape (2, 80) for a batch of 2 rows of 64 tokens: where no KV cache holds earlier tokens, "
         "the 2D padding mask has one entry per token of the input; pass a mask of the input's length ([2, 64])."),
        ({"dropout": float("nan")}, ValueError, f"attention dropout=nan for model type 'llama' {improbable}"),
        ({"dropout": -0.1}, ValueError, f"attention dropout=-0.1 for model type 'llama' {improbable}"),
        ({"dropout": 1.0}, ValueError, f"attention dropout=1.0 for model type 'llama' {improbable}"),
        ({"dropout": 0.1}, ValueError, "sparse_cp does not implement attention dropout (got dropout=0.1 for model"),
    ]:
        call = {"query": q, "key": k, "value": k, "attention_mask": None, **kwargs}
        with pytest.raises(error, match=f"^{re.escape(message)}"):
            sparse_cp_attention_forward(layer.self_attn, **call)
    out, _ = sparse_cp_attention_forward(layer.self_attn, q, k, k, None, position_ids=torch.arange(64)[None])
    assert out.shape == (2, 64, 4, 32)


def test_position_ids_that_restart_inside_a_document_of_the_mask_or_cu_seq_lens_are_refused():
    """#50: cu_seq_lens_k whose documents hold a restart of the position_ids (other boundaries than the positions')
    were followed without a word, where SDPA packs by the positions; and under context parallelism a packed row padded
    with a mask of zeros had its documents attended across, while the same row with no padding (or an all-ones mask)
    kept them apart: one padding token changed the documents. Both are refused, naming the token and the fix (the
    mask's case once per batch that CP splits); boundaries both describe alike pass, as do positions counting on
    across cu_seq_lens' documents (the rotary embedding reads them relative) and a padded row's positions counted
    through its tokens."""
    import torch
    from transformers import AutoModelForCausalLM

    import hf_sparse_cp
    from hf_sparse_cp.attention.tokens import check_positions_inside_mask, token_meta_from_kwargs
    from hf_sparse_cp.distributed.split.blocks import sequence_meta
    from hf_sparse_cp.testing.tiny_models import tiny_config

    cpu = torch.device("cpu")
    pos = torch.cat([torch.arange(20), torch.arange(30), torch.arange(10), torch.arange(4)])[None]  # 3 docs + padding
    mask = torch.ones(1, 64, dtype=torch.long)
    mask[0, 60:] = 0
    ids = torch.randint(3, 259, (1, 64), generator=torch.Generator().manual_seed(0))
    in_mask = re.escape("position_ids restart at token 20 of row 0 (position 0 after 19), inside a run of tokens "
                        "that the attention_mask keeps as one sequence: with a padding mask, SDPA and flash-attention "
                        "attend across such packed documents")
    with pytest.raises(ValueError, match=in_mask):  # the batch context parallelism splits
        sequence_meta({"input_ids": ids, "attention_mask": mask, "position_ids": pos})
    hf_sparse_cp.patch()  # (one process reads the row as SDPA does: one sequence, as through a cache in generate)
    model = AutoModelForCausalLM.from_config(tiny_config("llama"), attn_implementation="sparse_cp")
    assert model(input_ids=ids, attention_mask=mask, position_ids=pos).logits.shape == (1, 64, 259)
    with pytest.raises(ValueError, match=re.escape(
            "position_ids restart at token 50 of row 0 (position 0 after 29), inside the document [20, 64) of "
            "cu_seq_lens_k: the two give other documents")):
        token_meta_from_kwargs(1, 64, cpu, None, {"position_ids": pos, "cu_seq_lens_k": torch.tensor([0, 20, 64])})
    cu = torch.tensor([0, 20, 50, 60])
    packed = [0, 0, 1, 1, 2, 2, -1]
    for attention_mask, kwargs in [(mask, {"position_ids": pos, "cu_seq_lens_k": cu}),
                                   (None, {"position_ids": pos, "cu_seq_lens_k": cu}),
                                   (None, {"position_ids": torch.arange(64), "cu_seq_lens_k": cu})]:
        check_positions_inside_mask(attention_mask, kwargs)
        segment = token_meta_from_kwargs(1, 64, cpu, attention_mask, kwargs).segment[0]
        assert segment[[0, 19, 20, 49, 50, 59, 60]].tolist() == packed, kwargs
    for counted in ((mask.cumsum(-1) - 1).clamp_min(0), torch.arange(64)[None]):
        assert sequence_meta({"input_ids": ids, "attention_mask": mask, "position_ids": counted}).segment[0, 59] == 0



@pytest.mark.parametrize("cp, env, refused", [
    # --cp_node_size 3 for a CP group of 2 (a ValueError traceback on every rank, after the data was built)
    ({"cp_size": 2, "cp_node_size": 3}, {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_WORLD_SIZE": "2"},
     "a node holds 3 ranks (--cp_node_size 3), which is not a multiple of cp_size=2"),
    # the launcher's count of ranks per node
    ({"cp_size": 4}, {"WORLD_SIZE": "12", "RANK": "0", "LOCAL_WORLD_SIZE": "3"},
     "cp_size=4 is not a multiple of the 3 ranks per node (LOCAL_WORLD_SIZE=3)"),
    # set by hand (a job script): int()'s 'invalid literal', or a division by zero
    *(({"cp_size": 4}, {"WORLD_SIZE": "4", "RANK": "0", "LOCAL_WORLD_SIZE": local},
       f"LOCAL_WORLD_SIZE='{local}' is not a count of ranks per node") for local in ("two", "0")),
])
def test_a_hierarchical_ring_the_nodes_cannot_hold_is_refused_at_launch(tmp_path, cp, env, refused):
    """`hf-sparse-cp launch --nproc 2 train.py --cp_size 2 --cp_ring hierarchical --cp_node_size 3` ended in a
    ValueError traceback on every rank once the Trainer built its process groups (exit status 1): the ring's shape
    is checked with the launch (`check_launch`: a refusal before the script builds its data), naming where the ranks
    per node come from; shapes that run pass, and the launcher, which knows no ranks per node, leaves it to them."""
    from hf_sparse_cp import SparseTrainingArguments

    def args(**changed):
        return SparseTrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True,
                                       **{"cp_ring": "hierarchical", **cp, **changed})

    with pytest.raises(ValueError, match=re.escape(refused)):
        args().check_launch(env)
    if "cp_node_size" not in cp:  # (no ranks per node known, from the launch or the flag: nothing to check)
        args().check_launch({"WORLD_SIZE": env["WORLD_SIZE"], "RANK": "0"})
    args(cp_node_size=2).check_launch(env)  # two nodes' inner rings of 2 (4), or one node of 2 (flat)


class _LayerReadingA4DMask(torch.nn.Module):
    """A decoder layer that reads the attention mask as the 4D one eager and sdpa get."""

    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, hidden_states, attention_mask=None, **kwargs):
        attention_mask[:, :, -1]  # a 2D mask has no third dimension; None has none at all
        return self.layer(hidden_states, attention_mask=attention_mask, **kwargs)


def test_a_model_whose_forward_fails_outside_attention_on_the_backend_is_refused_naming_the_fix():
    """A model whose forward on the backend fails outside attention, on the meta device and with its weights, is
    refused as configure() switches it (`ProbeFailed`), naming the model and the dense fix, not with the layer's own
    error at the first training step."""
    from transformers import LlamaForCausalLM

    import hf_sparse_cp
    from hf_sparse_cp import configure
    from hf_sparse_cp.integration.models import ProbeFailed
    from hf_sparse_cp.testing.tiny_models import tiny_config

    class ReadsA4DMask(LlamaForCausalLM):
        def __init__(self, config):
            super().__init__(config)
            self.model.layers = torch.nn.ModuleList(_LayerReadingA4DMask(layer) for layer in self.model.layers)

    hf_sparse_cp.patch()
    model = ReadsA4DMask(tiny_config("llama"))
    before = model.config._attn_implementation
    with pytest.raises(ProbeFailed, match=r"ReadsA4DMask \(model type 'llama'\) does not run with attn_implementation="
                                          r"'sparse_cp': a forward of it with the backend failed outside attention "
                                          r"\(TypeError: .*--sparse_attention false"):
        configure(model)
    assert model.config._attn_implementation == before  # left as it was
