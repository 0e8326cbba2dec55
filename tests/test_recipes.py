"""The shipped recipes load and describe consistent runs (accelerate YAMLs and training recipes)."""

from itertools import pairwise
from pathlib import Path

import pytest
from accelerate.commands.config.config_args import load_config_from_file

from hf_sparse_cp.examples.train_long_context import parse_args, recipe_flags
from hf_sparse_cp.integration import checkpointing_enabled

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
ACCELERATE = sorted((RECIPES / "accelerate").glob("*.yaml"))
CURRICULUM = sorted((RECIPES / "train").glob("qwen2.5-3b_*.yaml"))


def test_the_recipes_are_there():
    assert {p.name for p in ACCELERATE} >= {"cpu_2proc_cp2.yaml", "fsdp2_cp8_1node.yaml",
                                            "fsdp2_cp32_4nodes_hierarchical.yaml"}
    assert len(CURRICULUM) == 3


@pytest.mark.parametrize("path", ACCELERATE, ids=lambda p: p.stem)
def test_accelerate_configs_load_and_divide_the_world(path):
    config = load_config_from_file(str(path))
    cp = int(config.parallelism_config.get("parallelism_config_cp_size", 1)) if config.parallelism_config else 1
    assert config.num_processes % cp == 0
    if cp > 1:  # accelerate's CP needs FSDP2
        assert config.distributed_type == "FSDP" and config.fsdp_config["fsdp_version"] == 2
        assert config.num_processes % config.num_machines == 0


@pytest.mark.parametrize("path", CURRICULUM, ids=lambda p: p.stem)
def test_training_recipes_parse_into_a_sparse_cp_run(path):
    script, training, sparse, pattern, cp, smet = parse_args([str(path)])
    assert sparse.sparse_attention and not smet.smet
    assert script.model_name_or_path and script.save_final_model
    assert script.seq_len % (cp.cp_size * pattern.block_size) == 0  # whole blocks on every rank
    assert training.bf16 and checkpointing_enabled(training)
    assert training.save_strategy == "steps" and training.save_steps < training.max_steps  # the recipe's saving
    assert load_config_from_file(str(RECIPES / "accelerate" / "fsdp2_cp8_1node.yaml")).num_processes % cp.cp_size == 0


def test_curriculum_stages_chain_and_grow():
    stages = sorted((parse_args([str(p)]) for p in CURRICULUM), key=lambda a: a[0].seq_len)
    assert [s[0].seq_len for s in stages] == [32768, 131072, 524288]
    for prev, nxt in pairwise(stages):
        assert nxt[0].model_name_or_path == prev[1].output_dir


def test_a_mapping_in_a_recipe_becomes_the_json_its_flag_takes(tmp_path):
    recipe = tmp_path / "overrides.yaml"
    recipe.write_text('seq_len: 512\nlayer_overrides:\n  "0-1": {pattern: dense}\n')
    pattern = parse_args([str(recipe)])[3]
    assert pattern.layer_overrides == {"0-1": {"pattern": "dense"}} and pattern.for_layer(1).pattern == "dense"


def test_flags_after_the_recipe_win_and_bad_recipes_are_refused(tmp_path):
    script, *_ = parse_args([str(CURRICULUM[0]), "--seq_len", "65536"])
    assert script.seq_len == 65536
    bad = tmp_path / "bad.yaml"
    bad.write_text("- seq_len\n")
    with pytest.raises(ValueError, match="mapping of flag names"):
        recipe_flags(str(bad))
