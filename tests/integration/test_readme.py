"""The README and docs/ as a reader uses them: every Python snippet runs as written (the model download
replaced by a tiny model of the named family, the tokenizer by the byte tokenizer, a small command line),
every command of the example script parses, every flag shown exists, and the README stays short."""

import dataclasses
import re
import shlex
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

import hf_sparse_cp
from hf_sparse_cp import SparseTrainingArguments
from hf_sparse_cp.examples.tokenizer import byte_tokenizer
from hf_sparse_cp.examples.train_long_context import ScriptArguments, parse_args
from hf_sparse_cp.testing.models import tiny_config

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
EXAMPLE = ("hf-sparse-cp train", "-m hf_sparse_cp.examples.train_long_context")


def _blocks(language: str) -> list[tuple[str, str]]:
    """(page name, block) for every fenced block of `language` in the README and docs/."""
    return [(page.relative_to(ROOT).as_posix(), block) for page in PAGES
            for block in re.findall(rf"```{language}\n(.*?)```", page.read_text(), flags=re.S)]


SNIPPETS = _blocks("python")


def _commands() -> list[tuple[str, str]]:
    """Every shell command of the bash blocks, continuation lines joined, comments dropped."""
    out = []
    for page, block in _blocks("bash"):
        for command in block.replace("\\\n", " ").splitlines():
            command = command.split(" #", 1)[0].strip()
            if command:
                out.append((page, command))
    return out


COMMANDS = _commands()


def test_the_readme_is_short_and_shows_the_switch_for_trainer_and_trl():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    snippets = [block for page, block in SNIPPETS if page == "README.md"]
    assert "SparseTrainer(" in snippets[0] and "SparseSFTTrainer(" in snippets[1]
    for internal in ("#19", "../shared", "this 2-core machine", "this machine"):
        assert all(internal not in page.read_text() for page in PAGES), internal


@pytest.mark.parametrize("page, snippet", SNIPPETS, ids=[f"{p}-{i}" for i, (p, _) in enumerate(SNIPPETS)])
def test_each_snippet_runs_as_written(page, snippet, tmp_path, monkeypatch):
    def tiny_from_pretrained(name, **kwargs):  # what a download would give, at tiny size
        model_type = AutoConfig.for_model("qwen2").model_type if "qwen" in name.lower() else "llama"
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(tiny_config(model_type), **kwargs)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", tiny_from_pretrained)
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", lambda name, **kwargs: byte_tokenizer())
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    monkeypatch.setattr(sys, "argv", ["train.py", "--output_dir", str(tmp_path), "--max_steps", "1", "--report_to",
                                      "none", "--save_strategy", "no", "--sparse_max_length", "256", "--bf16", "false"])
    try:
        exec(compile(snippet, f"{page} snippet", "exec"), {"__name__": "__main__"})
    finally:
        hf_sparse_cp.disable_lean_loss()
        hf_sparse_cp.unpatch()


def test_every_command_of_the_example_parses():
    shown = [(page, command) for page, command in COMMANDS if any(how in command for how in EXAMPLE)]
    assert len(shown) >= 5
    for page, command in shown:
        how = next(how for how in EXAMPLE if how in command)
        argv = shlex.split(command.split(how, 1)[1])
        if "--nproc" in argv:  # the launcher's own flag
            i = argv.index("--nproc")
            argv = argv[:i] + argv[i + 2:]
        try:
            parse_args(argv)  # exits, naming the flag, on a stale one
        except SystemExit:
            pytest.fail(f"{page}: `{command}` does not parse")


def test_every_flag_shown_for_a_training_script_exists():
    known = {f.name for cls in (SparseTrainingArguments, ScriptArguments) for f in dataclasses.fields(cls)}
    known |= {"recipe", "nproc"}
    for page, command in COMMANDS:
        if "train.py" in command or any(how in command for how in EXAMPLE):
            script_args = command.split("train.py", 1)[-1] if "train.py" in command else command
            for flag in re.findall(r"(?<![\w-])--(\w+)", script_args.split("--config_file")[-1]):
                assert flag in known or flag in ("path",), f"{page}: --{flag} in `{command}`"
