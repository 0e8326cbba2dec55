import json

import pytest
from transformers import HfArgumentParser

from hf_sparse_cp import SparseAttentionConfig
from hf_sparse_cp.integration.arguments import SparseCPArguments


def test_defaults_are_mtraining_like():
    cfg = SparseAttentionConfig()
    assert cfg.pattern == "vertical_slash" and cfg.last_q == 64 and cfg.block_size == 128


@pytest.mark.parametrize(
    "kwargs, fix",
    [
        ({"pattern": "bigbird"}, "use one of"),
        ({"block_size": 100}, "power of two"),
        ({"local_window": 0}, "every query needs its own diagonal"),
        ({"vertical_topp": 1.5}, "must be in (0, 1]"),
        ({"last_q": 0}, "must be >= 1"),
        ({"budget_mode": "greedy"}, "use one of"),
        ({"layer_overrides": {"x-y": {"pattern": "dense"}}}, "not a layer index"),
        ({"layer_overrides": {"0": {"colour": 1}}}, "unknown fields"),
        ({"layer_overrides": "{not json"}, "not valid JSON"),
    ],
)
def test_bad_values_name_the_fix(kwargs, fix):
    with pytest.raises(ValueError, match=fix.replace("(", r"\(").replace(")", r"\)")):
        SparseAttentionConfig(**kwargs)


def test_per_layer_overrides():
    cfg = SparseAttentionConfig(dense_first_layers=2, layer_overrides={"3-4": {"slash_topk": 7}, "9": {"last_q": 8}})
    assert cfg.for_layer(0).pattern == "dense" and cfg.for_layer(1).pattern == "dense"
    assert cfg.for_layer(2) is cfg
    assert cfg.for_layer(3).slash_topk == 7 and cfg.for_layer(4).slash_topk == 7 and cfg.for_layer(5).slash_topk == 2048
    assert cfg.for_layer(9).last_q == 8 and cfg.for_layer(9).pattern == "vertical_slash"


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_file_round_trip(tmp_path, suffix):
    cfg = SparseAttentionConfig(budget_mode="topp", slash_topp=0.95, layer_overrides={"0": {"pattern": "dense"}})
    path = tmp_path / f"cfg{suffix}"
    cfg.save(path)
    assert SparseAttentionConfig.from_file(path) == cfg


def test_file_errors(tmp_path):
    with pytest.raises(FileNotFoundError):
        SparseAttentionConfig.from_file(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"slash_budget": 3}))
    with pytest.raises(ValueError, match="known keys"):
        SparseAttentionConfig.from_file(bad)
    section = tmp_path / "section.yaml"
    section.write_text("sparse_attention:\n  slash_topk: 5\n")
    assert SparseAttentionConfig.from_file(section).slash_topk == 5


def test_hf_argument_parser_flags(tmp_path):
    parser = HfArgumentParser((SparseCPArguments, SparseAttentionConfig))
    args, cfg = parser.parse_args_into_dataclasses(
        args=["--sparse_attention", "--slash_topk", "512", "--layer_overrides", '{"0-1": {"pattern": "dense"}}']
    )
    assert args.sparse_attention and cfg.slash_topk == 512 and cfg.for_layer(1).pattern == "dense"
    assert args.attention_config(cfg) is cfg


def test_file_config_with_flag_overrides(tmp_path):
    path = tmp_path / "cfg.yaml"
    SparseAttentionConfig(vertical_topk=99, slash_topk=77).save(path)
    args = SparseCPArguments(sparse_config=str(path))
    merged = args.attention_config(SparseAttentionConfig(slash_topk=5))
    assert merged.vertical_topk == 99 and merged.slash_topk == 5
