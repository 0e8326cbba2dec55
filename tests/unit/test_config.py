import dataclasses
import json
import re
from pathlib import Path

import pytest
from transformers import HfArgumentParser

from hf_sparse_cp import SparseAttentionConfig, SparseAttentionFlags
from hf_sparse_cp.attention.budgets import Mass, TopK, TopP
from hf_sparse_cp.config.sections import Scoring
from hf_sparse_cp.trainer.arguments import SparseCPArguments, explicit_fields


def test_defaults_are_the_mass_budget_chosen_on_the_frontier():
    cfg = SparseAttentionConfig()
    assert cfg.pattern == "vertical_slash" and cfg.block_size == 128 and cfg.dense_first_layers == 1
    assert cfg.budget == Mass(mass_target=0.9, mass_threshold=0.0025, mass_near_blocks=0, vertical_cap=1024)
    assert cfg.scoring == Scoring(last_q=32, sample_groups=4, sample_group_size=16)


def test_the_config_is_a_tree_and_takes_the_flat_keys_too():
    """Sections nested (objects or mappings) or flat keys as files of every version hold them: the same config;
    a budget mode holds only its own fields, so another mode's field cannot be given to it."""
    tree = SparseAttentionConfig(budget=TopK(vertical_topk=64, slash_topk=128), scoring={"last_q": 16}, block_size=64)
    flat = SparseAttentionConfig(budget_mode="topk", vertical_topk=64, slash_topk=128, last_q=16, block_size=64)
    nested = SparseAttentionConfig(budget={"mode": "topk", "vertical_topk": 64, "slash_topk": 128},
                                   scoring=Scoring(last_q=16), block_size=64)
    assert tree == flat == nested and tree.scoring == Scoring(last_q=16, sample_groups=0)
    assert tree.to_dict()["budget"] == {"mode": "topk", "vertical_topk": 64, "slash_topk": 128}
    with pytest.raises(TypeError, match="mass_target"):
        TopK(mass_target=0.5)
    with pytest.raises(ValueError, match="mass_target=0.5 is read only in budget_mode='mass'.*--sparse_budget_mode"):
        SparseAttentionConfig(budget={"mode": "topk", "mass_target": 0.5})
    # a partial scoring goes over the one the budget was measured with; a Scoring object is whole
    assert SparseAttentionConfig(scoring={"last_q": 16}).scoring == Scoring(16, 4, 16)
    assert SparseAttentionConfig(scoring=Scoring(last_q=16)).scoring == Scoring(16, 0, 16)
    with pytest.raises(ValueError, match="Unknown sparse attention config keys \\['colour'\\]"):
        SparseAttentionConfig(colour=1)


def test_a_top_k_budget_alone_selects_top_k_with_its_own_defaults():
    """The top-k flags keep meaning what they said before 'mass' became the default: given without a budget
    mode they select top-k, whose scoring queries are the last 64 (MTraining's); with another mode they are
    refused, naming the flag that makes them count."""
    cfg = SparseAttentionConfig(vertical_topk=1024)
    assert (cfg.budget, cfg.scoring.last_q, cfg.scoring.sample_groups) == (TopK(1024, 1024), 64, 0)
    with pytest.raises(ValueError, match="slash_topk=8 is read only in budget_mode='topk'.*--sparse_budget_mode topk"):
        SparseAttentionConfig(budget_mode="mass", slash_topk=8)
    with pytest.raises(ValueError, match="vertical_topk=8 is read only in budget_mode='topk'"):
        SparseAttentionConfig(budget_mode="topp", vertical_topk=8)
    # so do the top-p budgets, and the two together name the choice to make
    assert SparseAttentionConfig(slash_topp=0.8).budget == TopP(slash_topp=0.8)
    with pytest.raises(ValueError, match="slash_topp=0.8 is read only in budget_mode='topp'"):
        SparseAttentionConfig(budget_mode="mass", slash_topp=0.8)
    with pytest.raises(ValueError, match="budgets of 2 modes; pass --sparse_budget_mode topk or"):
        SparseAttentionConfig(vertical_topk=8, vertical_topp=0.8)
    # a field of two modes (vertical_cap: top-p and mass) selects the default one
    assert SparseAttentionConfig(vertical_cap=64).budget == Mass(vertical_cap=64)
    # given scoring queries stay; switching modes with `replace` drops the old budget and moves the scoring
    # left at the old mode's defaults to the new one's
    assert SparseAttentionConfig(vertical_topk=8, last_q=16).replace(budget_mode="mass").scoring.last_q == 16
    mass = cfg.replace(budget_mode="mass")
    assert (mass.budget, mass.scoring) == (Mass(), Scoring(32, 4, 16))
    assert mass.replace(budget_mode="topk") == SparseAttentionConfig(budget_mode="topk")
    assert cfg.replace(slash_topk=7).budget == TopK(1024, 7)  # the same mode: fields merge
    assert SparseAttentionConfig.from_dict(cfg.to_dict()) == cfg


def test_mass_target_on_a_top_k_run_is_refused_naming_the_mode():
    """A field of another mode would be accepted, saved, and do nothing: refused, naming the flag."""
    with pytest.raises(ValueError, match="mass_target=0.5 is read only in budget_mode='mass' and would do nothing "
                                         "with budget_mode='topk'; pass --sparse_budget_mode mass"):
        SparseAttentionConfig(budget_mode="topk", mass_target=0.5)
    with pytest.raises(ValueError, match="mass_target=0.5 is read only"):
        SparseAttentionConfig(vertical_topk=64).replace(mass_target=0.5)
    with pytest.raises(ValueError, match="slash_cap=8 is read only in budget_mode='topp'"):
        SparseAttentionConfig(budget_mode="mass", slash_cap=8)


# `to_dict()` of the defaults before the mode-only fields (7d004e9): every field, whatever the mode
SAVED_TOPK = dict(pattern="vertical_slash", budget_mode="topk", vertical_topk=512, slash_topk=1024, vertical_topp=0.9,
                  slash_topp=0.9, vertical_cap=4096, slash_cap=4096, mass_target=0.95, mass_threshold=0.0,
                  mass_near_blocks=0, sink_tokens=64, local_window=128, last_q=64, sample_groups=0,
                  sample_group_size=16, estimation="last_queries", estimation_chunk=1024, block_size=128,
                  min_seq_len=8192, dense_first_layers=1, attention_engine="auto", layer_overrides=None)


def test_a_config_built_in_code_refuses_a_value_no_layer_of_it_reads(tmp_path):
    """estimation_chunk without causal-chunk estimation, document-planner costs without document sharding: refused
    only by the command line's arguments (issue #50), so that a config built in code, a file and
    enable_sparse_attention ignored them without a word. A layer override, a dense pattern (no effect, as a dense
    baseline's), a model that stored one (it loads as it ran) and the derived configs of layers and stages take them."""
    from hf_sparse_cp import schedule_cp_config
    from hf_sparse_cp.config.files import setting
    from hf_sparse_cp.distributed import ContextParallelConfig
    from hf_sparse_cp.distributed.split.documents import PlannerCosts
    from hf_sparse_cp.trainer.schedule import parse_schedule

    with pytest.raises(ValueError, match=re.escape(
            "estimation_chunk=256 would be ignored: only a layer with pattern='vertical_slash' and "
            "estimation='causal_chunks' reads it, and no layer of this config has them all (estimation="
            "'last_queries'): drop it, or add estimation='causal_chunks'.")):
        SparseAttentionConfig(estimation_chunk=256)
    path = tmp_path / "pattern.yaml"
    path.write_text("estimation_chunk: 256\nlayer_overrides: {'0': {estimation: causal_chunks}}\n")
    with pytest.raises(ValueError, match=r"pattern.yaml': estimation_chunk=256 would be ignored"):
        SparseAttentionConfig.from_file(path)  # (layer 0 is dense: dense_first_layers 1)
    with pytest.raises(ValueError, match=re.escape(
            "cp_planner_comm_per_token=5.0 would be ignored: the document planner of cp_sharding='document' reads it, "
            "and this config shards with cp_sharding='striped': drop it, or add cp_sharding='document' (or, for a "
            "--cp_schedule stage that does, build this base config with hf_sparse_cp.schedule_cp_config(cp_schedule, "
            "...)).")):
        ContextParallelConfig(cp_planner_comm_per_token=5.0)
    overridden = SparseAttentionConfig(estimation_chunk=256, layer_overrides={
        "1": {"estimation": "causal_chunks"}, "3": {"budget_mode": "topk", "vertical_topk": 8}})
    assert [c.estimation for c in overridden.layer_configs()] == ["last_queries", "causal_chunks", "last_queries",
                                                                   "last_queries"]
    assert SparseAttentionConfig(pattern="dense", estimation_chunk=256).estimation_chunk == 256
    stored = type("ModelConfig", (), {"sparse_attention": {"estimation_chunk": 256}})()
    assert SparseAttentionConfig.stored_on(stored).estimation_chunk == 256
    first, later = parse_schedule("0:512:1:estimation=last_queries,2:1024:2:cp_sharding=zigzag")
    assert first.sparse_config(SparseAttentionConfig(estimation="causal_chunks", estimation_chunk=256)).estimation == (
        "last_queries")
    documents = ContextParallelConfig(cp_sharding="document", cp_planner_comm_per_token=5.0)
    assert later.cp_config(documents).cp_planner_comm_per_token == 5.0
    # a library caller's striped base of a schedule whose later stage shards by document, which reads its costs (the
    # base's construction refused them); refused where no stage reads them, at any value given
    schedule = "0:512:1,2:1024:2:cp_sharding=document"
    base = schedule_cp_config(schedule, cp_planner_comm_per_token=5.0)
    assert base.cp_sharding == "striped" and parse_schedule(schedule)[1].cp_config(base).planner_costs() == (
        PlannerCosts(comm_per_token=5.0))
    for costs in ({"cp_planner_comm_per_token": 5.0}, {"cp_planner_linear_per_token": PlannerCosts.linear_per_token}):
        with pytest.raises(ValueError, match=re.escape(
                f"{setting(*next(iter(costs.items())))} would be ignored: the document planner of cp_sharding="
                "'document' reads it, and this config shards with cp_sharding='striped' (nor does any --cp_schedule "
                "stage): drop it, or add cp_sharding='document'.")):
            schedule_cp_config("0:512:1,2:1024:2:cp_sharding=zigzag", **costs)


def test_enable_sparse_attention_refuses_a_pattern_value_no_layer_reads():
    """The functional API builds its pattern from flags as the Trainer's arguments do: their refusal (issue #50)."""
    from transformers import AutoModelForCausalLM

    from hf_sparse_cp.testing.tiny_models import tiny_config
    from hf_sparse_cp.trainer.attach import enable_sparse_attention

    model = AutoModelForCausalLM.from_config(tiny_config("llama", num_hidden_layers=2))
    with pytest.raises(ValueError, match="estimation_chunk=256 would be ignored"):
        enable_sparse_attention(model, SparseCPArguments(sparse_attention=True),
                                SparseAttentionFlags(sparse_estimation_chunk=256))


def test_a_config_saved_before_the_mode_only_fields_loads_as_it_ran(caplog):
    """Model configs and files saved by earlier versions hold every field whatever the mode; they load as
    they ran (their scoring queries and caps kept), the other modes' fields dropped, a warning for a value
    that was not those versions' default."""
    topk = SparseAttentionConfig.from_dict(SAVED_TOPK)
    assert (topk.budget, topk.scoring) == (TopK(512, 1024), Scoring(64, 0, 16))
    mass = SparseAttentionConfig.from_dict({**SAVED_TOPK, "budget_mode": "mass", "mass_threshold": 0.01})
    assert (mass.budget, mass.scoring.sample_groups) == (Mass(0.95, 0.01, 0, 4096), 0)
    assert not caplog.records
    with caplog.at_level("WARNING"):
        odd = SparseAttentionConfig.from_dict({**SAVED_TOPK, "budget_mode": "mass", "vertical_topk": 100})
    assert odd.budget.mode == "mass" and "Ignoring vertical_topk=100" in caplog.text
    # what this version saves round-trips, and values given for another mode stay refused outside saved configs
    for cfg in (SparseAttentionConfig(), SparseAttentionConfig(vertical_topk=8), topk, mass):
        assert SparseAttentionConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="budgets of 2 modes"):
        SparseAttentionConfig.from_dict({"vertical_topk": 100, "mass_threshold": 0.01})


@pytest.mark.parametrize(
    "kwargs, fix",  # fix: a regular expression
    [
        ({"pattern": "bigbird"}, "use one of"),
        ({"block_size": 100}, "power of two"),
        ({"local_window": 0}, "every query needs its own diagonal"),
        ({"vertical_topp": 1.5}, r"must be in \(0, 1\]"),
        ({"last_q": 0}, "must be >= 1"),
        ({"budget_mode": "greedy"}, "use one of"),
        ({"layer_overrides": {"x-y": {"pattern": "dense"}}}, "not a layer index"),
        ({"layer_overrides": {"0": {"colour": 1}}}, "unknown fields"),
        ({"layer_overrides": "{not json"}, "not valid JSON"),
        ({"layer_overrides": '{"0": {"pattern": "dense"}, "0": {"block_size": 32}}'},
         r"not valid JSON \(key '0' is given twice in one mapping .*keep one\)"),
        ({"layer_overrides": {"1-0": {"pattern": "dense"}}}, "reversed range.*'0-1'"),
        ({"layer_overrides": {"2": {"block_size": 100}}},
         r"layer_overrides\['2'\]: block_size \(--sparse_block_size\)=100 must be a power"),
        ({"layer_overrides": {"2": {"budget_mode": "topk", "slash_topk": "x"}}},
         r"layer_overrides\['2'\]: slash_topk='x' \(str\)"),
        ({"layer_overrides": {"2": {"slash_topk": 8}}}, r"layer_overrides\['2'\]: slash_topk=8 is read only in"),
        # wrong types: refused by name with what to write, not a TypeError from a comparison
        ({"vertical_topk": "abc"}, r"vertical_topk='abc' \(str\) is not valid: use a whole number, e.g. vertical_topk"),
        ({"mass_threshold": "abc"}, r"mass_threshold='abc' \(str\) is not valid: use a number, e.g. mass_threshold"),
        ({"budget": 3}, r"budget=3 \(int\) is not valid: use a mapping of its fields, e.g. budget: \{mode: topk"),
        ({"sink_tokens": "abc"}, r"sink_tokens='abc' \(str\) is not valid: use a whole number, e.g. sink_tokens=64"),
        ({"block_size": 64.5}, r"block_size=64.5 \(float\) is not valid: use a whole number"),
        ({"block_size": 64.0}, r"block_size=64.0 \(float\) is not valid"),
        ({"slash_topk": True}, r"slash_topk=True \(bool\) is not valid"),
        ({"vertical_topp": "0.9"}, r"vertical_topp='0.9' \(str\).*write it without quotes"),
        ({"pattern": 1}, r"pattern=1 \(int\) is not valid: use one of 'vertical_slash', 'dense'"),
        ({"layer_overrides": [0]}, r"layer_overrides=\[0\] \(list\) is not valid: use a mapping"),
        # a budget mode left empty read as budget fields ("mode are budgets of 0 modes; pass  with ..."), a list
        # in a TypeError (unhashable); a range without its end as its first layer alone
        ({"budget": {"mode": ""}}, r"^budget_mode='' \(str\) is not valid: use one of 'topk', 'topp', 'mass' \(a "
         r"mode of your own: @hf_sparse_cp\.config\.sections\.register_budget on its class first\)\.$"),
        ({"budget": {"mode": ["topk"]}}, r"^budget_mode=\['topk'\] \(list\) is not valid: use one of"),
        ({"layer_overrides": {"0-": {"pattern": "dense"}}}, r"key '0-' is not a layer index or a range"),
    ],
)
def test_bad_values_name_the_fix(kwargs, fix):
    with pytest.raises(ValueError, match=fix):
        SparseAttentionConfig(**kwargs)


def test_an_int_is_a_float():
    cfg = SparseAttentionConfig(vertical_topp=1, slash_topp=0.5)  # an int is a fine float
    assert cfg.budget.vertical_topp == 1 and cfg.budget.slash_topp == 0.5


def test_per_layer_overrides():
    cfg = SparseAttentionConfig(budget_mode="topk", dense_first_layers=2,
                                layer_overrides={"3-4": {"slash_topk": 7}, "9": {"last_q": 8}})
    assert cfg.for_layer(0).pattern == "dense" and cfg.for_layer(1).pattern == "dense"
    assert cfg.for_layer(2) is cfg
    assert [cfg.for_layer(i).budget.slash_topk for i in (3, 4, 5)] == [7, 7, 1024]
    assert cfg.for_layer(9).scoring.last_q == 8 and cfg.for_layer(9).pattern == "vertical_slash"
    # an override in the tree's own words: a budget section (its mode: a whole new budget), a scoring section
    nested = SparseAttentionConfig(budget_mode="topk", layer_overrides={"1": {"budget": {"mode": "topp"}},
                                                                        "2": {"scoring": {"sample_groups": 2}}})
    assert nested.for_layer(1).budget == TopP() and nested.for_layer(2).scoring == Scoring(64, 2, 16)
    # every config a layer runs, whatever the layer count: one per run of layers the ranges bound
    assert cfg.layer_configs() == [cfg.for_layer(i) for i in (0, 2, 3, 9)]


def test_overlapping_overrides_run_the_same_pattern_once_saved_and_loaded():
    """Where layer_overrides keys overlap, the narrower one's fields win whatever the mapping's order: applied in
    that order, a layer given a range and its own key ('2-11' then '10') ran its own key's pattern in training and
    the range's once the model was saved and loaded, as config.json holds its keys sorted ('10' before '2-11', #50)."""
    from transformers import LlamaConfig

    overrides = {"2-11": {"pattern": "dense", "sink_tokens": 8}, "10": {"pattern": "vertical_slash"},
                 "0-3": {"sink_tokens": 4}}
    cfg = SparseAttentionConfig(dense_first_layers=0, layer_overrides=overrides)
    model_config = LlamaConfig(num_hidden_layers=12, sparse_attention=cfg.to_dict())
    saved = json.loads(model_config.to_json_string())["sparse_attention"]
    assert list(saved["layer_overrides"]) == ["0-3", "10", "2-11"]  # (what transformers writes)
    loaded = SparseAttentionConfig.from_dict(saved)
    want = [("vertical_slash", 4), ("vertical_slash", 4), ("dense", 4), ("dense", 4), *[("dense", 8)] * 6,
            ("vertical_slash", 8), ("dense", 8)]
    for config in (cfg, loaded):
        assert [(config.for_layer(i).pattern, config.for_layer(i).sink_tokens) for i in range(12)] == want


def test_section_objects_and_int_keys_in_layer_overrides_save_with_the_model():
    """A layer's budget or scoring given as a section object, as the config's own (`budget=TopK(...)`), was kept as
    the object: the model's config.json could not be written (TypeError: Object of type TopK is not JSON
    serializable, at the first checkpoint, #50). They are kept as the mappings they stand for, which load as they
    ran."""
    from transformers import LlamaConfig

    cfg = SparseAttentionConfig(layer_overrides={"1": {"budget": TopK(vertical_topk=3)},
                                                 "2-3": {"scoring": Scoring(last_q=8)}})
    model_config = LlamaConfig(num_hidden_layers=4, sparse_attention=cfg.to_dict())
    loaded = SparseAttentionConfig.from_dict(json.loads(model_config.to_json_string())["sparse_attention"])
    assert loaded == cfg and [loaded.for_layer(i) for i in range(4)] == [cfg.for_layer(i) for i in range(4)]
    assert cfg.for_layer(1).budget == TopK(vertical_topk=3) and cfg.for_layer(3).scoring == Scoring(8, 0, 16)
    # a layer index given as an int is kept as the text config.json holds (loaded, the settings compared unequal to
    # those saved); the same layer as an int and as text is refused
    ints = SparseAttentionConfig(layer_overrides={1: {"pattern": "dense"}})
    model_config = LlamaConfig(num_hidden_layers=4, sparse_attention=ints.to_dict())
    assert SparseAttentionConfig.from_dict(json.loads(model_config.to_json_string())["sparse_attention"]) == ints
    with pytest.raises(ValueError, match=r"layer_overrides names layer 1 twice \(as 1 and '1'\): merge their fields"):
        SparseAttentionConfig(layer_overrides={1: {"pattern": "dense"}, "1": {"sink_tokens": 4}})
    # and so is any other pair of keys that spell the same layers: which one's fields won hung on how they sort
    for keys in (("1", "01"), ("1", "1-1"), ("2-3", " 2-3")):
        with pytest.raises(ValueError, match=rf"layer_overrides keys {keys[0]!r} and {keys[1]!r} name the same layer"):
            SparseAttentionConfig(layer_overrides={keys[0]: {"pattern": "dense"}, keys[1]: {"sink_tokens": 4}})


def test_a_config_says_which_flat_keys_its_layers_read():
    """What the arguments refuse when no layer of a run reads a flag given (issue #50): a budget or scoring key on a
    dense pattern, estimation_chunk without causal-chunk estimation; other keys always."""
    dense = SparseAttentionConfig(pattern="dense", layer_overrides={"2": {"pattern": "vertical_slash"}})
    assert {c.pattern: c.reads("vertical_topk") for c in dense.layer_configs()} == {"dense": False,
                                                                                     "vertical_slash": True}
    assert not dense.reads("last_q") and not dense.reads("budget_mode") and dense.reads("block_size")
    chunks = SparseAttentionConfig(estimation="causal_chunks")
    assert chunks.reads("estimation_chunk") and not SparseAttentionConfig().reads("estimation_chunk")
    assert not chunks.replace(pattern="dense").reads("estimation_chunk")


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_file_round_trip(tmp_path, suffix):
    cfg = SparseAttentionConfig(budget_mode="topp", slash_topp=0.95, layer_overrides={"0": {"pattern": "dense"}})
    path = tmp_path / f"cfg{suffix}"
    cfg.save(path)
    assert SparseAttentionConfig.from_file(path) == cfg


def test_file_errors(tmp_path):
    with pytest.raises(FileNotFoundError):
        SparseAttentionConfig.from_file(tmp_path / "missing.yaml")
    with pytest.raises(FileNotFoundError, match=f"^Config file '{tmp_path}' is a folder, not a file"):  # ('does not
        SparseAttentionConfig.from_file(tmp_path)  # exist')
    # a budget mode left empty (YAML's `mode:`) is the mode its fields select, as no mode (it was refused as a field)
    assert SparseAttentionConfig(budget={"mode": None, "vertical_topk": 5}).budget == TopK(vertical_topk=5)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"slash_budget": 3}))
    with pytest.raises(ValueError, match="known keys"):
        SparseAttentionConfig.from_file(bad)
    section = tmp_path / "section.yaml"
    section.write_text("sparse_attention:\n  slash_topk: 5\n")
    assert SparseAttentionConfig.from_file(section).budget == TopK(slash_topk=5)
    nested = tmp_path / "nested.yaml"
    nested.write_text("budget:\n  mode: mass\n  mass_target: 0.8\nscoring:\n  last_q: 16\nblock_size: 64\n")
    assert SparseAttentionConfig.from_file(nested) == SparseAttentionConfig(
        budget=Mass(mass_target=0.8), scoring={"last_q": 16}, block_size=64)


@pytest.mark.parametrize("given, match", [
    ({"mass_threshold": 0.01, "budget": {"mode": "mass", "mass_threshold": 0.02}},
     r"mass_threshold=0.01 and budget: \{mass_threshold: 0.02\} give one field two values in one mapping"),
    ({"budget_mode": "topk", "budget": {"mode": "mass"}},
     r"budget_mode='topk' and budget: \{mode: 'mass'\} give one field two values"),
    ({"budget_mode": "topk", "budget": {"mass_target": 0.8}},
     r"budget_mode='topk' and a budget section holding mass_target \(read only in budget_mode='mass'\): the "
     r"section's field would be dropped. Give the mode once, in the section \(budget: \{mode: 'mass'\}\) "
     r"with its own fields"),
    ({"last_q": 32, "scoring": {"last_q": 64}}, r"last_q=32 and scoring: \{last_q: 64\} give one field two values"),
    ({"vertical_topk": 10, "budget": TopK(vertical_topk=64)}, r"vertical_topk=10 and budget: \{vertical_topk: 64\}"),
], ids=["flat-beside-section", "mode-beside-mode", "mode-beside-fields-of-another", "scoring", "section-object"])
def test_one_mapping_that_gives_a_field_twice_is_refused_naming_both(tmp_path, given, match):
    """Inside one file (or one constructor call, or one curriculum stage) a flat key beside its nested twin with
    another value was resolved without a word (the flat one won; a flat mode dropped the section's fields): refused,
    naming both; across mappings the upper wins as before (a flag given beats the file)."""
    with pytest.raises(ValueError, match=match):
        SparseAttentionConfig(**given)
    path = tmp_path / "twice.json"
    path.write_text(json.dumps({k: v.to_dict() if hasattr(v, "to_dict") else v for k, v in given.items()}))
    with pytest.raises(ValueError, match=f"Config file '{path}': " + match):
        SparseAttentionConfig.from_file(path)
    # the same value twice says one thing, and a mode given flat beside its own section's fields is that mode
    assert SparseAttentionConfig(mass_threshold=0.02, budget={"mode": "mass", "mass_threshold": 0.02}).budget == \
        Mass(mass_threshold=0.02)
    assert SparseAttentionConfig(budget_mode="topk", budget={"slash_topk": 100}).budget == TopK(slash_topk=100)
    file = SparseAttentionConfig(budget={"mode": "mass", "mass_threshold": 0.02})
    assert file.replace(mass_threshold=0.01).budget.mass_threshold == 0.01  # (another mapping on top: it wins)


@pytest.mark.parametrize("given, match", [
    ({"budget": {"bogus": 1}}, r"Unknown budget key 'bogus'; the budget section's keys: \['mode', 'vertical_topk'"),
    ({"budget": {"mode": "topk", "bogus": 1}}, r"Unknown budget key 'bogus'; the budget section's keys: \['mode'"),
    ({"scoring": {"last_qq": 64}}, r"Unknown scoring key 'last_qq' \(did you mean 'last_q'\?\); the scoring "
                                   r"section's keys: \['last_q', "
                                   r"'sample_groups', 'sample_group_size'\]"),
])
def test_an_unknown_key_in_a_section_is_named_with_the_known_ones(tmp_path, given, match):
    """A budget section without a mode said "bogus are budgets of 0 modes; pass  with the one to use", a scoring
    section gave Python's TypeError: both name the key and list the section's keys, in a file too."""
    with pytest.raises(ValueError, match=match):
        SparseAttentionConfig(**given)
    path = tmp_path / "unknown.yaml"
    path.write_text(json.dumps(given))
    with pytest.raises(ValueError, match=f"Config file '{path}': " + match):
        SparseAttentionConfig.from_file(path)


@pytest.mark.parametrize(
    "name, text, match",
    [
        ("topk.yaml", "vertical_topk: abc\n", r"'topk.yaml': vertical_topk='abc' \(str\) is not valid: use a whole"),
        ("block.yaml", "sparse_attention:\n  block_size: 64.5\n", r"'block.yaml': block_size=64.5 \(float\)"),
        ("exp.yaml", "vertical_topp: 1e-1\n", r"'exp.yaml': vertical_topp='1e-1'.*write 0.001 or 1.0e-3"),
        ("topk.json", '{"vertical_topk": "abc"}', r"'topk.json': vertical_topk='abc' \(str\)"),
        ("range.json", '{"layer_overrides": {"3-1": {"pattern": "dense"}}}', r"'range.json': .*'3-1' is a reversed"),
        # syntax errors: the file, and for YAML the line and column
        ("syntax.yaml", "vertical_topk: [1\n", r"'syntax.yaml' is not valid YAML: .*\s+in \"syntax.yaml\", line 1"),
        ("syntax.json", '{"vertical_topk": 1,}', r"'syntax.json' is not valid JSON: .*line 1 column 21"),
    ],
)
def test_file_errors_name_the_file_and_the_field(tmp_path, monkeypatch, name, text, match):
    monkeypatch.chdir(tmp_path)
    Path(name).write_text(text)
    with pytest.raises(ValueError, match=match):
        SparseAttentionConfig.from_file(name)


@pytest.mark.parametrize("name, text, match", [
    ("twice.yaml", "block_size: 32\nvertical_topk: 4\nblock_size: 64\n",
     r"(?s)'twice.yaml' is not valid YAML: .*found key 'block_size' again \(first on line 1\): keep one.*line 3"),
    ("section.yaml", "budget:\n  mode: topk\n  vertical_topk: 4\n  vertical_topk: 8\n",
     r"(?s)'section.yaml' is not valid YAML: .*found key 'vertical_topk' again \(first on line 3\)"),
    ("twice.json", '{"scoring": {"last_q": 16, "last_q": 64}}',
     r"'twice.json' is not valid JSON: key 'last_q' is given twice in one mapping \(16 and 64\): keep one"),
], ids=["yaml", "yaml-section", "json-section"])
def test_a_key_given_twice_in_one_mapping_of_a_file_is_refused(tmp_path, monkeypatch, name, text, match):
    """A file giving one key twice in a mapping (an edit that added a field already set above) trained with the
    last value, the first dropped without a word (PyYAML and json keep the last): refused, naming the key and, for
    YAML, both lines. A key a YAML merge (`<<: *anchor`) brings in may still be set again beside it."""
    monkeypatch.chdir(tmp_path)
    Path(name).write_text(text)
    with pytest.raises(ValueError, match=match):
        SparseAttentionConfig.from_file(name)
    Path("merge.yaml").write_text("base: &base\n  block_size: 32\nsparse_attention:\n  <<: *base\n  block_size: 64\n")
    assert SparseAttentionConfig.from_file("merge.yaml").block_size == 64


@pytest.mark.parametrize("name", ["weights.json", "weights.yaml"])
def test_a_binary_file_named_as_a_config_is_named_not_utf8_text(tmp_path, monkeypatch, name):
    """A binary file under a config's suffix (model.safetensors copied or renamed) was refused as Python's "'utf-8'
    codec can't decode bytes in position ...", naming neither the file nor what it should be; it is named as the
    syntax errors are."""
    monkeypatch.chdir(tmp_path)
    Path(name).write_bytes(b"\x88\x0b\x00\x00{\"__metadata__\": \xff\xfe}")
    with pytest.raises(ValueError, match=f"Config file '{name}' is not valid {name[-4:].upper()}: not UTF-8 text "
                                         r"\(a binary file\?\)"):
        SparseAttentionConfig.from_file(name)


def test_hf_argument_parser_flags(tmp_path):
    parser = HfArgumentParser((SparseCPArguments, SparseAttentionFlags))
    args, flags = parser.parse_args_into_dataclasses(
        args=["--sparse_attention", "--sparse_slash_topk", "512", "--sparse_layer_overrides",
              '{"0-1": {"pattern": "dense"}}']
    )
    cfg = flags.to_config()
    assert args.sparse_attention and cfg.budget == TopK(slash_topk=512) and cfg.for_layer(1).pattern == "dense"
    assert args.attention_config(flags) == cfg and args.attention_config(cfg) is cfg
    # every flat key is a `sparse_` flag with the field's help text; a section's flags default to unset
    config_fields = {f.name: f for f in dataclasses.fields(SparseAttentionConfig)}
    flag_fields = {f.name: f for f in dataclasses.fields(SparseAttentionFlags)}
    assert set(flag_fields) == {f"sparse_{name}" for name in SparseAttentionConfig.keys()} - {"sparse_budget",
                                                                                             "sparse_scoring"}
    assert all(flag_fields[f"sparse_{name}"].metadata == f.metadata for name, f in config_fields.items()
               if name not in ("budget", "scoring"))
    assert flag_fields["sparse_mass_target"].default is None
    assert flag_fields["sparse_mass_target"].metadata["help"].startswith(Mass.__dataclass_fields__["mass_target"]
                                                                         .metadata["help"])
    with pytest.raises(ValueError, match=r"block_size \(--sparse_block_size\)=48 must be a power of two"):
        SparseAttentionFlags(sparse_block_size=48)


def test_file_config_with_flag_overrides(tmp_path):
    path = tmp_path / "cfg.yaml"
    SparseAttentionConfig(vertical_topk=99, slash_topk=77).save(path)
    args = SparseCPArguments(sparse_config=str(path))
    merged = args.attention_config(SparseAttentionFlags(sparse_slash_topk=5))
    assert merged.budget == TopK(99, 5)


@pytest.mark.parametrize("flags, check", [
    (dict(sparse_estimation="causal_chunks", sparse_estimation_chunk=64), lambda c: c.estimation_chunk == 64),
    (dict(sparse_layer_overrides='{"1": {"slash_topk": 32}}'), lambda c: c.for_layer(1).budget == TopK(64, 32)),
], ids=["chunk-of-the-files-block", "override-of-the-files-budget"])
def test_pattern_flags_are_validated_on_top_of_their_file(flags, check):
    """The pattern flags validated themselves alone, on the library's defaults, before the --sparse_config file went
    under them: with `trial` (block 64, top-k) an estimation chunk of 64 was refused as not a multiple of block_size
    128, and a layer's slash_topk as unread under budget_mode 'mass'. They are validated on top of the file, which
    still refuses what the two together cannot run, naming the file's values."""
    from hf_sparse_cp import SparseTrainingArguments

    args = SparseTrainingArguments(output_dir="out", use_cpu=True, sparse_config="trial", **flags)
    assert check(args.sparse_attention_config())
    chunks = dict(sparse_estimation="causal_chunks", sparse_estimation_chunk=96)
    with pytest.raises(ValueError, match=r"estimation_chunk=96 must be a positive multiple of .*=64"):
        SparseTrainingArguments(output_dir="out", use_cpu=True, sparse_config="trial", **chunks)
    with pytest.raises(ValueError, match=r"layer_overrides\['1'\]: mass_target=0.5 is read only in budget_mode='mass'"):
        SparseTrainingArguments(output_dir="out", use_cpu=True, sparse_config="trial",
                                sparse_layer_overrides='{"1": {"mass_target": 0.5}}')
    with pytest.raises(ValueError, match=r"estimation_chunk=64 must be a positive multiple of .*=128"):  # (no file)
        SparseTrainingArguments(output_dir="out", use_cpu=True, **{**chunks, "sparse_estimation_chunk": 64})


def test_pattern_flags_parsed_alone_wait_for_a_file_that_could_make_them_valid():
    """Parsed as their own dataclass (the functional API), the pattern flags cannot know of the --sparse_config file
    parsed beside them: an estimation chunk of 64, valid over `trial`'s block 64, was refused against the default
    block 128. Now refused at parse time only where no file could make it valid; else when the pattern is built,
    on top of the file, or alone without one."""
    parser = HfArgumentParser((SparseCPArguments, SparseAttentionFlags))
    chunk = ["--sparse_estimation", "causal_chunks", "--sparse_estimation_chunk", "64"]
    args, flags = parser.parse_args_into_dataclasses(args=["--sparse_config", "trial", *chunk])
    assert args.attention_config(flags).estimation_chunk == 64
    args, flags = parser.parse_args_into_dataclasses(args=chunk)  # no file: refused when the pattern is built
    with pytest.raises(ValueError, match=r"estimation_chunk=64 must be a positive multiple of .*=128"):
        args.attention_config(flags)
    with pytest.raises(ValueError, match=r"estimation_chunk=64 must be a positive multiple"):
        flags.to_config()
    overrides = ["--sparse_config", "trial", "--sparse_layer_overrides", '{"1": {"slash_topk": 32}}']
    args, flags = parser.parse_args_into_dataclasses(args=overrides)  # (trial's top-k budget reads it; mass not)
    assert args.attention_config(flags).for_layer(1).budget.slash_topk == 32
    for bad, match in ((["--sparse_estimation_chunk", "24", "--sparse_estimation", "causal_chunks"],
                        r"estimation_chunk=24 must be a positive multiple"),  # (of no block size)
                       (["--sparse_layer_overrides", '{"1": {"block_size": 48}}'], r"power of two")):
        with pytest.raises(ValueError, match=match):
            parser.parse_args_into_dataclasses(args=["--sparse_config", "trial", *bad])


def test_a_config_as_flags_leaves_the_files_budget_alone(tmp_path):
    """A pattern config passed as the flags (SparseTrainingArguments built in code: no parser, no explicit set)
    holds its mode's resolved defaults; at those defaults its fields were not given and the file's stand."""
    path = tmp_path / "cfg.yaml"
    SparseAttentionConfig(vertical_topk=256, block_size=64).save(path)
    args = SparseCPArguments(sparse_attention=True, sparse_config=str(path))
    merged = args.attention_config(SparseAttentionConfig(block_size=32))
    assert (merged.budget, merged.scoring.last_q, merged.block_size) == (TopK(256, 1024), 64, 32)
    merged = args.attention_config(SparseAttentionConfig(budget_mode="topk", slash_topk=7))
    assert (merged.budget, merged.block_size) == (TopK(256, 7), 64)


def test_explicit_flags_beat_the_file_whatever_their_value(tmp_path):
    path = tmp_path / "cfg.yaml"
    SparseAttentionConfig(vertical_topk=256, slash_topk=77, sink_tokens=8).save(path)
    args = SparseCPArguments(sparse_attention=True, sparse_config=str(path))
    flags = SparseAttentionFlags(sparse_vertical_topk=512, sparse_slash_topk=5, sparse_sink_tokens=16,
                                 sparse_block_size=64)
    merged = args.attention_config(flags, explicit={"sparse_vertical_topk", "sparse_slash_topk", "output_dir"})
    # given flags win, top-k's default value 512 included; sink_tokens and block_size (parsed, not given) keep
    # the file's values; names of other configs' fields (output_dir) are ignored
    assert (merged.budget, merged.sink_tokens, merged.block_size) == (TopK(512, 5), 8, 128)
    assert args.attention_config(flags, explicit=set()) == SparseAttentionConfig.from_file(path)
    # without `explicit`: the flags that differ from the defaults (a default value cannot be told from none), and
    # a budget field that defaults to unset: top-k's 512 was given
    legacy = args.attention_config(flags)
    assert (legacy.budget, legacy.sink_tokens, legacy.block_size) == (TopK(512, 5), 16, 64)
    # without a file the flags are the config, given or not
    assert SparseCPArguments(sparse_attention=True).attention_config(flags, explicit=set()) == flags.to_config()
    assert SparseAttentionConfig.from_file_and_flags(None, {"sink_tokens": 16}, explicit=set()).sink_tokens == 16


def test_explicit_fields_finds_every_spelling_and_default_values():
    from transformers import TrainingArguments

    parser = HfArgumentParser((TrainingArguments, SparseCPArguments, SparseAttentionFlags))
    given = explicit_fields(parser, ["--sparse-vertical-topk=1024", "--no_sparse_fused_loss", "--sparse_slash_topk",
                                     "2048", "--report_to", "none", "--sparse_sink_tok", "64", "--help", "--not_a_flag",
                                     "1"])
    assert given == {"sparse_vertical_topk", "sparse_fused_loss", "sparse_slash_topk", "report_to",
                     "sparse_sink_tokens"}
    assert explicit_fields(parser, []) == set()


def test_a_budget_mode_given_over_a_file_of_another_mode_replaces_its_budget_whole_and_says_so(tmp_path, caplog):
    """The precedence rule (docs/usage.md): a flag the user typed beats the file, and a budget mode named on top of
    a budget of another mode replaces that budget whole (a budget holds one mode's fields): the file's fields of
    the mode replaced are not read, and a warning names them, the file and the flag, in both directions; a field of
    a mode not in effect stays refused."""
    topk, mass = tmp_path / "topk.yaml", tmp_path / "mass.yaml"
    topk.write_text("budget:\n  mode: topk\n  vertical_topk: 512\n  slash_topk: 256\nblock_size: 64\n")
    mass.write_text("budget:\n  mode: mass\n  mass_target: 0.8\n")
    with caplog.at_level("WARNING"):
        config = SparseAttentionConfig.from_file_and_flags(topk, {"budget_mode": "mass"}, explicit={"budget_mode"})
    assert config.budget == Mass() and config.block_size == 64  # the rest of the file stands
    assert f"budget_mode='mass' replaces the 'topk' budget of {topk} whole: its vertical_topk=512, slash_topk=256 " \
           "are not read" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING"):
        config = SparseAttentionConfig.from_file_and_flags(mass, {"budget_mode": "topk", "vertical_topk": 8},
                                                           explicit={"budget_mode", "vertical_topk"})
    assert config.budget == TopK(vertical_topk=8) and "its mass_target=0.8 are not read" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING"):  # the same mode: the fields merge, nothing is dropped
        config = SparseAttentionConfig.from_file_and_flags(topk, {"budget_mode": "topk", "slash_topk": 8},
                                                           explicit={"budget_mode", "slash_topk"})
    assert config.budget == TopK(512, 8) and not caplog.records
    with pytest.raises(ValueError, match="pass --sparse_budget_mode mass"):  # a field of another mode, no mode
        SparseAttentionConfig.from_file_and_flags(topk, {"mass_target": 0.5}, explicit={"mass_target"})


def test_a_training_recipe_given_as_a_config_file_is_named_one(tmp_path):
    """Issue #50: a file of flags (a training recipe, whose `sparse_attention: true` / `smet: true` is a flag) given as
    --sparse_config / --smet_config was refused as "key 'sparse_attention' holds True; it must hold a mapping": it
    now says it is a recipe and where it goes."""
    from hf_sparse_cp.smet import SMETConfig

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("sparse_attention: true\nsparse_max_length: 4096\nsmet: true\nsmet_density: 0.5\n")
    for cls, section in ((SparseAttentionConfig, "sparse_attention"), (SMETConfig, "smet")):
        with pytest.raises(ValueError, match=rf"^Config file '{re.escape(str(recipe))}' holds flags, as a training "
                                             rf"recipe does \(`{section}: true` is the flag --{section}; .*\), not the "
                                             rf"{cls.KIND} fields: give it as `hf-sparse-cp train --recipe "):
            cls.from_file(recipe)
    (tmp_path / "alone.yaml").write_text("sparse_attention: true\n")  # (the section alone: the mapping it must hold)
    with pytest.raises(ValueError, match="key 'sparse_attention' holds True; it must hold a mapping"):
        SparseAttentionConfig.from_file(tmp_path / "alone.yaml")
