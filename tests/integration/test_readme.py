"""The README's snippets run as written: its Python blocks under "Use it in your own script", with
the model download replaced by a tiny model of the named family and a small command line."""

import re
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import hf_sparse_cp
from hf_sparse_cp.testing.models import tiny_config

README = Path(__file__).resolve().parents[2] / "README.md"


def _snippets() -> list[str]:
    text = README.read_text()
    section = text[text.index("## Use it in your own script"):text.index("## Context parallelism")]
    return re.findall(r"```python\n(.*?)```", section, flags=re.S)


def test_the_readme_shows_the_one_switch_and_the_functional_api():
    snippets = _snippets()
    assert len(snippets) == 3
    assert "SparseTrainer(" in snippets[0] and "attach_to_trainer(" in snippets[1] and "patch()" in snippets[2]


@pytest.mark.parametrize("index", range(3), ids=["one-switch", "functional", "no-trainer"])
def test_each_snippet_runs_as_written(index, tmp_path, monkeypatch):
    def tiny_from_pretrained(name, **kwargs):  # what a download would give, at tiny size
        model_type = AutoConfig.for_model("qwen2").model_type if "qwen" in name.lower() else "llama"
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(tiny_config(model_type), **kwargs)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", tiny_from_pretrained)
    argv = ["train.py", "--output_dir", str(tmp_path), "--max_steps", "1", "--report_to", "none", "--use_cpu",
            "--save_strategy", "no"]
    argv += [["--max_length", "256"], ["--max_length", "256"], []][index]
    monkeypatch.setattr(sys, "argv", argv if index < 2 else ["python"])
    try:
        exec(compile(_snippets()[index], f"README.md snippet {index}", "exec"), {"__name__": "__main__"})
    finally:
        hf_sparse_cp.disable_lean_loss()
        hf_sparse_cp.unpatch()
