"""The plugin's flags join the argument classes users already have without a clash (issue #30): a script
shaped like transformers' examples/pytorch/language-modeling/run_clm.py, and TRL's SFT script."""

import dataclasses
from dataclasses import dataclass, field

import pytest
from transformers import HfArgumentParser, TrainingArguments

from hf_sparse_cp import SparseAttentionConfig, SparseTrainingArguments, sparse_arguments_class
from hf_sparse_cp.config.sections import Scoring, budget_class, budget_modes
from hf_sparse_cp.trainer.arguments import PATTERN_PREFIX


# run_clm's own argument classes, field for field (names, types, defaults; help texts shortened; its __post_init__
# checks left out): its DataTrainingArguments has `block_size`, the sequence length.
@dataclass
class ModelArguments:
    model_name_or_path: str | None = field(default=None, metadata={"help": "checkpoint"})
    model_type: str | None = field(default=None, metadata={"help": "model type from scratch"})
    config_overrides: str | None = field(default=None, metadata={"help": "config overrides"})
    config_name: str | None = field(default=None, metadata={"help": "config name"})
    tokenizer_name: str | None = field(default=None, metadata={"help": "tokenizer name"})
    cache_dir: str | None = field(default=None, metadata={"help": "cache dir"})
    use_fast_tokenizer: bool = field(default=True, metadata={"help": "fast tokenizer"})
    model_revision: str = field(default="main", metadata={"help": "revision"})
    token: str = field(default=None, metadata={"help": "hub token"})
    trust_remote_code: bool = field(default=False, metadata={"help": "remote code"})
    dtype: str | None = field(default=None, metadata={"help": "dtype",
                                                      "choices": ["auto", "bfloat16", "float16", "float32"]})


@dataclass
class DataTrainingArguments:
    dataset_name: str | None = field(default=None, metadata={"help": "dataset"})
    dataset_config_name: str | None = field(default=None, metadata={"help": "dataset config"})
    train_file: str | None = field(default=None, metadata={"help": "train file"})
    validation_file: str | None = field(default=None, metadata={"help": "validation file"})
    max_train_samples: int | None = field(default=None, metadata={"help": "max train samples"})
    max_eval_samples: int | None = field(default=None, metadata={"help": "max eval samples"})
    streaming: bool = field(default=False, metadata={"help": "streaming"})
    block_size: int | None = field(default=None, metadata={"help": "input sequence length after tokenization"})
    overwrite_cache: bool = field(default=False, metadata={"help": "overwrite cache"})
    validation_split_percentage: int | None = field(default=5, metadata={"help": "validation split"})
    preprocessing_num_workers: int | None = field(default=None, metadata={"help": "workers"})
    keep_linebreaks: bool = field(default=True, metadata={"help": "line breaks"})


def test_run_clm_arguments_and_ours_parse_together(tmp_path):
    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, SparseTrainingArguments))
    model, data, training = parser.parse_args_into_dataclasses([
        "--model_name_or_path", "Qwen/Qwen2.5-0.5B", "--dataset_name", "wikitext", "--block_size", "1024",
        "--output_dir", str(tmp_path), "--sparse_block_size", "64", "--cp_size", "2", "--smet"])
    assert data.block_size == 1024  # run_clm's sequence length stays run_clm's
    assert training.sparse_block_size == 64 and training.sparse_attention_config().block_size == 64
    assert training.cp_size == 2 and training.smet and model.model_name_or_path == "Qwen/Qwen2.5-0.5B"


# run_mlm's (examples/pytorch/language-modeling/run_mlm.py) data arguments, field for field as above: its sequence
# length is `max_seq_length`.
@dataclass
class MLMDataTrainingArguments:
    dataset_name: str | None = field(default=None, metadata={"help": "dataset"})
    train_file: str | None = field(default=None, metadata={"help": "train file"})
    max_seq_length: int | None = field(default=None, metadata={"help": "sequence length after tokenization"})
    preprocessing_num_workers: int | None = field(default=None, metadata={"help": "workers"})
    mlm_probability: float = field(default=0.15, metadata={"help": "masking ratio"})
    line_by_line: bool = field(default=False, metadata={"help": "one sequence per line"})
    pad_to_max_length: bool = field(default=False, metadata={"help": "pad every sample"})
    max_train_samples: int | None = field(default=None, metadata={"help": "max train samples"})
    streaming: bool = field(default=False, metadata={"help": "streaming"})


# A script's own data arguments with a `max_length`, the name the plugin's sequence length had before every flag was
# prefixed (argparse refused the pair: "conflicting option strings: --max_length").
@dataclass
class DataArguments:
    max_length: int = field(default=2048, metadata={"help": "the script's own sequence length"})
    train_file: str | None = field(default=None, metadata={"help": "train file"})


@pytest.mark.parametrize("script_classes", [(ModelArguments, DataTrainingArguments), (ModelArguments,
                         MLMDataTrainingArguments), (DataArguments,)], ids=["run_clm", "run_mlm", "own_max_length"])
def test_script_arguments_and_ours_parse_together_without_a_clash(tmp_path, script_classes):
    parser = HfArgumentParser((*script_classes, SparseTrainingArguments))
    argv = ["--output_dir", str(tmp_path), "--sparse_max_length", "4096", "--cp_sharding", "zigzag"]
    *script, training = parser.parse_args_into_dataclasses(argv)
    assert training.sequence_length == 4096 and training.context_parallel_config().cp_sharding == "zigzag"
    if script_classes == (DataArguments,):
        (data,) = parser.parse_args_into_dataclasses(["--output_dir", str(tmp_path), "--max_length", "8"])[:1]
        assert data.max_length == 8  # the script's own
    ours = {f.name for f in dataclasses.fields(SparseTrainingArguments)} - {
        f.name for f in dataclasses.fields(TrainingArguments)}
    for cls in script_classes:  # none of the plugin's names is a script field
        assert not ours & {f.name for f in dataclasses.fields(cls)}


def test_a_block_size_given_to_our_parser_alone_is_not_the_sparse_block_size(tmp_path):
    parser = HfArgumentParser(SparseTrainingArguments)
    with pytest.raises(ValueError, match=r"not used by the HfArgumentParser: \['--block_size', '1024'\]"):
        parser.parse_args_into_dataclasses(["--output_dir", str(tmp_path), "--block_size", "1024"])
    (args,) = parser.parse_args_into_dataclasses(["--output_dir", str(tmp_path)])
    assert args.sparse_attention_config().block_size == SparseAttentionConfig().block_size


def test_every_plugin_flag_has_a_prefix_and_the_help_of_its_config_field():
    stock = {f.name for f in dataclasses.fields(TrainingArguments)}
    ours = [f for f in dataclasses.fields(SparseTrainingArguments) if f.name not in stock and f.init]
    assert ours and all(f.name.startswith(("sparse_", "cp_", "smet")) for f in ours), [
        f.name for f in ours if not f.name.startswith(("sparse_", "cp_", "smet"))]
    by_name = {f.name: f for f in ours}
    for config_field in dataclasses.fields(SparseAttentionConfig):  # one source of help text
        if config_field.name in ("budget", "scoring"):
            continue
        flag = by_name[PATTERN_PREFIX + config_field.name]
        assert flag.metadata["help"] == config_field.metadata["help"] and flag.default == config_field.default
    # a section's fields as flags: their own help text, unset by default (the budget mode's value then)
    for section in (*(budget_class(mode) for mode in budget_modes()), Scoring):
        for section_field in dataclasses.fields(section):
            flag = by_name[PATTERN_PREFIX + section_field.name]
            assert flag.metadata["help"].startswith(section_field.metadata["help"]) and flag.default is None


def test_trl_sft_config_and_its_scripts_arguments_parse_with_ours(tmp_path):
    trl = pytest.importorskip("trl")
    SparseSFTConfig = sparse_arguments_class(trl.SFTConfig)
    parser = trl.TrlParser((trl.ScriptArguments, SparseSFTConfig, trl.ModelConfig))
    script, config, model = parser.parse_args_and_config([
        "--dataset_name", "some/data", "--model_name_or_path", "some/model", "--output_dir", str(tmp_path),
        "--max_length", "8192", "--packing", "--padding_free", "true", "--sparse_vertical_topk", "256",
        "--cp_size", "2", "--report_to", "none"])
    assert isinstance(config, trl.SFTConfig) and config.packing and config.padding_free
    assert config.max_length == config.sequence_length == 8192  # SFTConfig's own: one length for TRL and the plugin
    names = [f.name for f in dataclasses.fields(config)]
    assert names.count("max_length") == 1 and "sparse_max_length" not in names
    for cls in (trl.ScriptArguments, trl.ModelConfig):  # no plugin flag is a field of TRL's script arguments
        assert not {n for n in names if n.startswith(("sparse_", "cp_", "smet"))} & {
            f.name for f in dataclasses.fields(cls)}
    assert config.sparse_attention_config().budget.vertical_topk == 256
    assert config.context_parallel_config().cp_size == 2
    assert sparse_arguments_class(trl.SFTConfig) is SparseSFTConfig  # one class per base
    from hf_sparse_cp import SparseSFTConfig as exported

    assert exported is SparseSFTConfig


def test_the_flag_reference_page_is_generated_from_the_help_texts():
    from pathlib import Path

    from hf_sparse_cp.trainer.flag_reference import flag_reference

    page = Path(__file__).resolve().parents[2] / "docs" / "flags.md"
    assert page.read_text() == flag_reference(), (
        "docs/flags.md is stale: regenerate it with `make docs` (python -m hf_sparse_cp.trainer.flag_reference > "
        "docs/flags.md)")
    for f in dataclasses.fields(SparseTrainingArguments):  # every plugin flag is on it
        if f.name.startswith(("sparse_", "cp_", "smet")):
            assert f"| `--{f.name}` |" in page.read_text(), f.name


def test_every_help_text_renders_in_the_parsers_help():
    # argparse formats help texts with %: a bare "%" in a field's help breaks --help for every flag
    parser = HfArgumentParser(SparseTrainingArguments)
    for action in parser._actions:
        if action.help:
            parser._get_formatter()._expand_help(action)
    assert "--sparse_mass_threshold" in parser.format_help()


def test_arguments_saved_by_an_earlier_release_load_with_the_new_names(tmp_path):
    """A checkpoint's training_args.bin pickled before the sequence length was `--sparse_max_length`."""
    import pickle

    from hf_sparse_cp.trainer.sparse_trainer import _rebuild_arguments

    args = SparseTrainingArguments(output_dir=str(tmp_path), report_to="none", sparse_max_length=4096)
    assert pickle.loads(pickle.dumps(args)).sparse_max_length == 4096
    saved = dict(vars(args))
    saved["max_length"] = saved.pop("sparse_max_length")  # what an earlier release saved
    loaded = _rebuild_arguments(TrainingArguments, saved)
    assert type(loaded) is SparseTrainingArguments and loaded.sequence_length == 4096
    assert "max_length" not in vars(loaded)
