"""`--sparse_config trial`: the one switch for a trial run at 1K-4K tokens, where the defaults train dense (issue
#52): a shipped pattern that every reader of `--sparse_config` takes by name, and that keeps a visibly sparse share
of the causal blocks while the defaults keep them all (on real weights at 1K: tests/integration/test_pretrained.py).
"""

import re

import pytest
import torch

from hf_sparse_cp import SparseAttentionConfig, estimate_layout
from hf_sparse_cp.recipes import pattern_path, recipe_names, recipe_path
from hf_sparse_cp.testing.layouts import planted_qk
from hf_sparse_cp.trainer.arguments import SparseCPArguments


def test_the_trial_pattern_is_shipped_and_read_by_name(tmp_path):
    assert "trial" in recipe_names("pattern")
    config = SparseCPArguments(sparse_config="trial").attention_config()
    assert config.min_seq_len == 0 and config.budget.mode == "topk"
    own = tmp_path / "trial"  # a file of that name is the user's file
    own.write_text("block_size: 32\n")
    assert pattern_path(str(own)) == str(own)


def test_a_pattern_that_is_no_file_and_no_shipped_name_is_refused_with_the_closest_name(tmp_path):
    """`--sparse_config trail` said only "Config file 'trail' does not exist.": the refusal lists the shipped patterns
    and the closest one (as `hf-sparse-cp recipes --path` does, by the same code)."""
    with pytest.raises(FileNotFoundError, match=r"^Config file 'trail' does not exist, nor is it a shipped pattern "
                                                r"\(trial\); did you mean 'trial'\? `hf-sparse-cp recipes` lists them"):
        SparseCPArguments(sparse_config="trail").attention_config()
    with pytest.raises(FileNotFoundError, match=r"'missing.yaml' does not exist, nor is it a shipped pattern "
                                                r"\(trial\); `hf-sparse-cp recipes`"):
        pattern_path("missing.yaml")  # (nothing close: no guess)
    with pytest.raises(FileNotFoundError, match="neither a file nor a shipped recipe .*; did you mean 'trial'"):
        recipe_path("trail")


def test_a_pattern_file_name_with_a_typo_is_refused_with_the_closest_file_beside_it(tmp_path, monkeypatch):
    """`--sparse_config pattern.yml` (the file is pattern.yaml) and `patern.yaml` named no file, as a shipped name's
    typo is named: the refusal names the YAML / JSON files closest to it in the folder it gives (the current one for
    a bare name), spelt as it is; a file of another kind there is no guess."""
    for name in ("pattern.yaml", "my_sparse.json", "pattern.txt"):
        (tmp_path / name).write_text("{}\n")
    monkeypatch.chdir(tmp_path)
    for typo, close in (("pattern.yml", "pattern.yaml"), ("patern.yaml", "pattern.yaml"),
                        ("my_spars.json", "my_sparse.json"), (f"{tmp_path}/pattern.yml", f"{tmp_path}/pattern.yaml")):
        with pytest.raises(FileNotFoundError, match=re.escape(f"Config file {typo!r} does not exist, nor is it a "
                                                              f"shipped pattern (trial); did you mean {close!r}? ")):
            SparseCPArguments(sparse_config=typo).attention_config()
    for unrelated in ("unrelated.yaml", f"{tmp_path}/unrelated.yaml"):  # (names compared, not their folders)
        with pytest.raises(FileNotFoundError, match=re.escape("shipped pattern (trial); `hf-sparse-cp recipes`")):
            pattern_path(unrelated)
    with pytest.raises(FileNotFoundError, match=re.escape("did you mean 'pattern.yaml'?")):
        recipe_path("pattern.yml")  # (`--recipe`, by the same code)


def test_a_folder_given_for_a_pattern_or_recipe_file_is_named_a_folder(tmp_path):
    """`--sparse_config DIR` said the folder did not exist."""
    with pytest.raises(FileNotFoundError, match=re.escape(f"Config file '{tmp_path}' is a folder, not a file, nor is "
                                                          "it a shipped pattern (trial)")):
        SparseCPArguments(sparse_config=str(tmp_path)).attention_config()
    with pytest.raises(FileNotFoundError, match=re.escape(f"recipe '{tmp_path}' (a folder) is neither a file nor")):
        recipe_path(str(tmp_path))
    # a saved model's folder (a run that replaces its pattern says to pass its config.json, #50) names that file,
    # which reads
    (tmp_path / "config.json").write_text('{"model_type": "llama", "sparse_attention": {"local_window": 32}}')
    with pytest.raises(FileNotFoundError, match=re.escape(f"Config file '{tmp_path}' is a folder, not a file: the "
                                                          "pattern a saved model holds is in its config.json; give "
                                                          f"'{tmp_path / 'config.json'}'.")):
        SparseCPArguments(sparse_config=str(tmp_path)).attention_config()
    assert SparseCPArguments(sparse_config=str(tmp_path / "config.json")).attention_config().local_window == 32


@pytest.mark.parametrize("name, text", [("empty.yaml", ""), ("comments.yaml", "# block_size: 32\n"),
                                        ("empty.json", "")])
def test_an_empty_pattern_file_is_refused_naming_it_and_the_fix(tmp_path, name, text):
    """An empty --sparse_config file (or one of comments only) read as every default, silently: refused, naming the
    file and the fix; `{}` still stands for the defaults."""
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ValueError, match=rf"^Config file '{re.escape(str(path))}' is empty \(or holds only comments\): "
                                         r"write the sparse attention fields it should set in it \(\{\} to keep every "
                                         r"default\), or do not pass it"):
        SparseCPArguments(sparse_config=str(path)).attention_config()
    path.write_text("{}\n")
    assert SparseCPArguments(sparse_config=str(path)).attention_config() == SparseAttentionConfig()


def test_the_trial_pattern_is_sparse_at_4k_where_the_defaults_are_dense():
    # attention concentrated on a few columns and diagonals, as in real heads
    q, k = planted_qk(4, 2, 4096, 32, [[0, 5, 300]] * 4, [[0, 1, 100]] * 4, generator=torch.Generator().manual_seed(0))
    trial = SparseAttentionConfig.from_file(pattern_path("trial"))
    kept = float(estimate_layout(q, k, trial).kept_fraction())
    default = float(estimate_layout(q, k, SparseAttentionConfig()).kept_fraction())
    assert default == 1.0 and kept < 0.9, (default, kept)
