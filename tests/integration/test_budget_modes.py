"""The budget modes as a user meets them in `hf-sparse-cp train` without a recipe (issue #40): the demo's
top-k budget is a default, so another mode given on the command line, in a --sparse_config file, in a
resumed run or in a --cp_schedule stage trains with that mode, and so does a field of another mode given alone; a
field of a mode the run does not select is refused, naming the mode."""

from __future__ import annotations

import pytest
from transformers import TrainerCallback

import hf_sparse_cp
from hf_sparse_cp import SparseAttentionConfig, SparseTrainer
from hf_sparse_cp.attention.budgets import Mass, TopK
from hf_sparse_cp.cli import main as cli

# The demo at a tiny size: every pattern setting is the demo's own but min_seq_len (documents of 512 tokens).
TINY = ["--sparse_max_length", "512", "--sparse_min_seq_len", "256", "--num_samples", "2", "--tiny_num_layers", "1",
        "--report_to", "none"]


class _StepPatterns(TrainerCallback):
    """The pattern on the model at the end of every step (a cp_schedule stage puts its own there)."""

    def __init__(self) -> None:
        self.patterns: list[SparseAttentionConfig] = []

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.patterns.append(SparseAttentionConfig.from_dict(model.config.sparse_attention))


@pytest.fixture
def trained(monkeypatch) -> list[SparseTrainer]:
    """The trainers the demo runs, as they end (its pattern is on the model's config; each step's pattern in
    `trainer.step_patterns`)."""
    seen = []

    class Recorded(SparseTrainer):
        def train(self, *args, **kwargs):
            self.step_patterns = _StepPatterns()
            self.add_callback(self.step_patterns)
            result = super().train(*args, **kwargs)
            seen.append(self)
            return result

    # (`hf-sparse-cp train` runs the example as __main__, a module of its own, which takes the package's name)
    monkeypatch.setattr(hf_sparse_cp, "SparseTrainer", Recorded)
    return seen


def _pattern(trainer: SparseTrainer) -> SparseAttentionConfig:
    return SparseAttentionConfig.from_dict(trainer.model.config.sparse_attention)


def test_the_demo_trains_in_mass_mode_from_the_command_line(tmp_path, trained, single_thread):
    assert cli(["train", *TINY, "--max_steps", "1", "--output_dir", str(tmp_path),
                "--sparse_budget_mode", "mass", "--sparse_mass_threshold", "0.01"]) == 0
    pattern = _pattern(trained[0])
    assert pattern.budget == Mass(mass_threshold=0.01) and pattern.scoring.sample_groups == 4  # mass's own scoring
    assert (pattern.block_size, pattern.sink_tokens) == (64, 16)  # the demo's other settings stay
    assert cli(["train", *TINY, "--max_steps", "1", "--output_dir", str(tmp_path / "topk")]) == 0
    assert _pattern(trained[1]).budget == TopK(64, 128)  # the demo's own budget, unchanged


def test_a_field_alone_selects_its_mode_and_a_field_the_given_mode_does_not_read_is_refused(tmp_path, trained, capsys,
                                                                                              single_thread):
    """As the flags' help says: given without a budget mode, a field of another mode selects that mode (the demo's
    budget is a default, not the user's choice), a field of the demo's own mode changes that field alone, and a field
    that the mode given does not read is refused, naming the mode that reads it."""
    assert cli(["train", *TINY, "--max_steps", "1", "--output_dir", str(tmp_path / "mass"),
                "--sparse_mass_target", "0.5"]) == 0
    pattern = _pattern(trained[0])
    assert pattern.budget == Mass(mass_target=0.5) and (pattern.block_size, pattern.sink_tokens) == (64, 16)
    assert cli(["train", *TINY, "--max_steps", "1", "--output_dir", str(tmp_path / "topk"),
                "--sparse_vertical_topk", "32"]) == 0
    assert _pattern(trained[1]).budget == TopK(32, 128)  # the demo's slash_topk stays
    with pytest.raises(SystemExit):
        cli(["train", *TINY, "--output_dir", str(tmp_path), "--sparse_budget_mode", "topk", "--sparse_mass_target",
             "0.5"])
    err = capsys.readouterr().err
    assert "mass_target=0.5 is read only in budget_mode='mass' and would do nothing with budget_mode='topk'" in err
    assert "pass --sparse_budget_mode mass" in err


def test_a_mass_mode_config_file_trains_and_resumes(tmp_path, trained, single_thread):
    path = tmp_path / "mass.yaml"
    path.write_text("budget:\n  mode: mass\n  mass_target: 0.8\nblock_size: 64\nmin_seq_len: 256\n")
    out = tmp_path / "out"
    cli(["train", *TINY, "--max_steps", "2", "--save_steps", "1", "--output_dir", str(out), "--sparse_config",
         str(path)])
    want = SparseAttentionConfig.from_file(path)
    assert _pattern(trained[0]) == want  # the file's settings, none of the demo's defaults
    cli(["train", *TINY, "--max_steps", "3", "--output_dir", str(out), "--sparse_config", str(path),
         "--resume_from_checkpoint", str(out / "checkpoint-2")])
    assert trained[1].state.global_step == 3 and _pattern(trained[1]) == want
    # a flat file of an earlier version, in mass mode, trains too
    flat = tmp_path / "flat.json"
    flat.write_text('{"budget_mode": "mass", "mass_threshold": 0.02, "min_seq_len": 256, "block_size": 64}')
    cli(["train", *TINY, "--max_steps", "1", "--output_dir", str(tmp_path / "flat"), "--sparse_config", str(flat)])
    assert _pattern(trained[2]).budget == Mass(mass_threshold=0.02)


def test_a_cp_schedule_stage_trains_in_mass_mode(tmp_path, trained, single_thread):
    cli(["train", *TINY, "--max_steps", "2", "--output_dir", str(tmp_path), "--sparse_budget_mode", "mass",
         "--cp_schedule", "0:256:1,1:512:1:mass_threshold=0.005"])
    trainer = trained[0]
    assert trainer.state.global_step == 2
    assert [p.budget for p in trainer.step_patterns.patterns] == [Mass(), Mass(mass_threshold=0.005)]
