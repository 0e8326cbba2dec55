"""`--sparse_config trial`: the one switch for a trial run at 1K-4K tokens, where the defaults train dense (issue
#52): a shipped pattern that every reader of `--sparse_config` takes by name, and that keeps a visibly sparse share
of the causal blocks while the defaults keep them all (on real weights at 1K: tests/integration/test_pretrained.py).
"""

import torch

from hf_sparse_cp import SparseAttentionConfig, estimate_layout
from hf_sparse_cp.recipes import pattern_path, recipe_names
from hf_sparse_cp.testing.layouts import planted_qk
from hf_sparse_cp.trainer.arguments import SparseCPArguments


def test_the_trial_pattern_is_shipped_and_read_by_name(tmp_path):
    assert "trial" in recipe_names("pattern")
    config = SparseCPArguments(sparse_config="trial").attention_config()
    assert config.min_seq_len == 0 and config.budget.mode == "topk"
    own = tmp_path / "trial"  # a file of that name is the user's file
    own.write_text("block_size: 32\n")
    assert pattern_path(str(own)) == str(own) and pattern_path("missing.yaml") == "missing.yaml"


def test_the_trial_pattern_is_sparse_at_4k_where_the_defaults_are_dense():
    # attention concentrated on a few columns and diagonals, as in real heads
    q, k = planted_qk(4, 2, 4096, 32, [[0, 5, 300]] * 4, [[0, 1, 100]] * 4, generator=torch.Generator().manual_seed(0))
    trial = SparseAttentionConfig.from_file(pattern_path("trial"))
    kept = float(estimate_layout(q, k, trial).kept_fraction())
    default = float(estimate_layout(q, k, SparseAttentionConfig()).kept_fraction())
    assert default == 1.0 and kept < 0.9, (default, kept)
