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
from hf_sparse_cp.examples import train_long_context
from hf_sparse_cp.examples.tokenizer import byte_tokenizer
from hf_sparse_cp.examples.train_long_context import ScriptArguments, parse_args
from hf_sparse_cp.launch_env import launched_env
from hf_sparse_cp.testing.tiny_models import tiny_config

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
EXAMPLE = ("hf-sparse-cp train", "-m hf_sparse_cp.examples.train_long_context", "examples/train_long_context.py")


def _blocks(language: str) -> list[tuple[str, str]]:
    """(page name, block) for every fenced block of `language` in the README and docs/."""
    return [(page.relative_to(ROOT).as_posix(), block) for page in PAGES
            for block in re.findall(rf"```{language}\n(.*?)```", page.read_text(), flags=re.S)]


SNIPPETS = _blocks("python")


def _indented_blocks() -> list[tuple[str, str]]:
    """(page name, block) for every indented code block (four spaces, after a blank line, outside the fenced
    blocks) of the README and docs/, dedented: the pages show shell commands so too (docs/memory.md's)."""
    out = []
    for page in PAGES:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for block in re.findall(r"(?:^\n)((?:    .*\n)+)", text, flags=re.M):
            out.append((page.relative_to(ROOT).as_posix(), "".join(line[4:] + "\n" for line in block.splitlines())))
    return out


def _spans(page: Path) -> list[str]:
    """The inline code spans of a page (outside its fenced blocks), each joined onto one line."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return [" ".join(span.split()) for span in re.findall(r"`([^`]+)`", text)]


# A command shown inline in the prose: one of the launchers, and no placeholder (`...`, `[--optional]`, `RUN_DIR`).
INLINE = ("hf-sparse-cp train ", "hf-sparse-cp launch ", "hf-sparse-cp memory ", "hf-sparse-cp simulate ",
          "python -m hf_sparse_cp.run ", "torchrun ", "accelerate launch ")


def _inline_commands() -> list[tuple[str, str]]:
    return [(page.relative_to(ROOT).as_posix(), span) for page in PAGES for span in _spans(page)
            if span.startswith(INLINE) and "..." not in span and "[" not in span
            and not re.search(r"\b[A-Z][A-Z_]+\b", span)]


def _commands() -> list[tuple[str, str]]:
    """Every shell command of the bash blocks and the indented blocks, of the prose's inline code, of the example's
    docstring (its indented lines) and of the recipes' comments, continuation lines joined, comments dropped."""
    out = list(_inline_commands())
    shown = "\n".join(line.strip() for line in train_long_context.__doc__.splitlines() if line.startswith("    "))
    recipes = [(path.relative_to(ROOT).as_posix(), "".join(line[4:] + "\n" for line in path.read_text().splitlines()
                                                          if line.startswith("#   ")))
               for path in sorted((ROOT / "recipes").glob("*/*.yaml"))]  # (the commands in their comments)
    for page, block in [*_blocks("bash"), *_indented_blocks(), ("examples/train_long_context.py", shown + "\n"),
                        *recipes]:
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
    # the plugin's length flag, or the one of the snippet's own arguments (TRL's SFTConfig, a script's dataclass)
    length = "--sparse_max_length" if "sparse_max_length" in snippet else "--max_length"
    monkeypatch.setattr(sys, "argv", ["train.py", "--output_dir", str(tmp_path), "--max_steps", "1", "--report_to",
                                      "none", "--save_strategy", "no", length, "256", "--bf16", "false"])
    try:
        exec(compile(snippet, f"{page} snippet", "exec"), {"__name__": "__main__"})
    finally:
        hf_sparse_cp.disable_lean_loss()
        hf_sparse_cp.unpatch()


def test_the_switch_snippet_runs_with_the_flags_the_readme_launches_it_with(tmp_path, monkeypatch):
    """The README launches its train.py as `torchrun --nproc_per_node 2 train.py --output_dir out --cp_size 2`,
    without `--sparse_max_length` (unset: None, the data's first row's length): the snippet built its rows of
    `args.sparse_max_length` tokens and stopped with randint's TypeError. Its data and Trainer build from each
    README command's own flags (CP and FSDP aside: one process here; the launch itself is tested above)."""
    snippet = next(block for page, block in SNIPPETS if page == "README.md" and "SparseTrainer(" in block)
    built = []
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained",
                        lambda name, **kwargs: AutoModelForCausalLM.from_config(tiny_config("qwen2"), **kwargs))
    monkeypatch.setattr(hf_sparse_cp.SparseTrainer, "train",
                        lambda self, *args, **kwargs: built.append(self.train_dataset))
    shown = [command for page, command in COMMANDS if page == "README.md" and " train.py " in command]
    assert len(shown) >= 5
    for command in shown:
        argv = shlex.split(command.split(" train.py ", 1)[1])
        for flag in ("--cp_size", "--cp_mode", "--cp_ulysses_size", "--fsdp_config", "--fsdp"):  # (one process)
            if flag in argv:
                i = argv.index(flag)
                argv = argv[:i] + argv[i + (1 if flag == "--fsdp" else 2):]
        argv = [str(tmp_path) if arg == "out" else arg for arg in argv]
        monkeypatch.setattr(sys, "argv", ["train.py", *argv, "--report_to", "none"])
        try:
            exec(compile(snippet, "README.md snippet", "exec"), {"__name__": "__main__"})
        except Exception as e:
            pytest.fail(f"README.md: the snippet as `{command}` runs it: {type(e).__name__}: {e}")
        finally:
            hf_sparse_cp.disable_lean_loss()
            hf_sparse_cp.unpatch()
        assert len(built[-1]) == 8

def _launched_processes(command: str) -> int:
    """How many processes a shown command starts: `--nproc N`, `--nproc_per_node N`, or the `num_processes` of
    the shipped accelerate config it names; one otherwise."""
    from hf_sparse_cp.config.files import read_mapping
    from hf_sparse_cp.recipes import recipe_path

    if nproc := re.search(r"--nproc(?:_per_node)? (\d+)", command):
        return int(nproc.group(1))
    if config := re.search(r"recipes --path (\w+)", command):
        return read_mapping(recipe_path(config.group(1)))["num_processes"]
    return 1


def test_every_command_of_the_example_parses_and_launches_the_processes_its_cp_degree_needs():
    """A command shown for the example parses and starts as many processes as its CP degrees (a recipe's
    included) need: the README showed `hf-sparse-cp train --recipe qwen2.5-3b_32k --max_steps 10`, which stops
    at once (`cp_size=8 splits each sequence over 8 processes, and this one runs alone`)."""
    shown = [(page, command) for page, command in COMMANDS if any(how in command for how in EXAMPLE)]
    assert len(shown) >= 5
    for page, command in shown:
        how = next(how for how in EXAMPLE if how in command)
        argv = shlex.split(command.split(how, 1)[1])
        for launcher_flag in ("--nproc", "--config_file"):  # the launcher's own flags
            if launcher_flag in argv:
                i = argv.index(launcher_flag)
                argv = argv[:i] + argv[i + 2:]
        try:
            parsed = parse_args(argv)  # exits, naming the flag, on a stale one
        except SystemExit:
            pytest.fail(f"{page}: `{command}` does not parse")
        try:
            parsed.training.check_launch(launched_env(_launched_processes(command)))
        except ValueError as e:
            pytest.fail(f"{page}: `{command}`: {e}")


def test_every_flag_shown_for_a_training_script_exists():
    known = {f.name for cls in (SparseTrainingArguments, ScriptArguments) for f in dataclasses.fields(cls)}
    known |= {"recipe", "nproc"}
    for page, command in COMMANDS:
        if how := next((how for how in (*EXAMPLE, "train.py") if how in command), None):
            script_args = re.sub(r'--config_file "\$\([^)]*\)"', "", command.split(how, 1)[1])  # (the launcher's)
            for flag in re.findall(r"(?<![\w-])--(\w+)", script_args):
                assert flag in known, f"{page}: --{flag} in `{command}`"


# Runs a README snippet as a script of its own under a launcher: the named model replaced by a tiny one of its family.
DRIVER = """
import sys

import torch
from transformers import AutoModelForCausalLM

from hf_sparse_cp.testing.tiny_models import tiny_config


def tiny_from_pretrained(name, **kwargs):
    with torch.random.fork_rng():  # (the same weights on every process, the script's own random state untouched)
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(tiny_config("qwen2"), **kwargs)


AutoModelForCausalLM.from_pretrained = tiny_from_pretrained
snippet = sys.argv.pop(1)
exec(compile(open(snippet).read(), snippet, "exec"), {"__name__": "__main__"})
"""


def test_the_switch_snippet_trains_under_torchrun_cp2_and_data_built_per_process_is_refused_naming_the_fix(tmp_path):
    """`torchrun --nproc_per_node 2 train.py --cp_size 2` with the README's snippet: its data is seeded, so both
    processes build the same rows and it trains; the same snippet with rows that differ by process (seeded by
    rank, as a shuffle seeded per process would) stops at the first step with an error that says the processes
    built different data and how to build it identically."""
    import os
    import subprocess

    snippet = next(block for page, block in SNIPPETS if page == "README.md" and "SparseTrainer(" in block)
    per_process = snippet.replace("torch.Generator().manual_seed(0)",
                               "torch.Generator().manual_seed(int(__import__('os').environ['RANK']))")
    assert per_process != snippet
    (tmp_path / "driver.py").write_text(DRIVER)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    env.pop("WORLD_SIZE", None)
    results = {}
    for name, text in (("seeded", snippet), ("per_process", per_process)):
        (tmp_path / f"{name}.py").write_text(text)
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                   str(tmp_path / "driver.py"), str(tmp_path / f"{name}.py"), "--output_dir", str(tmp_path / name),
                   "--max_steps", "2", "--sparse_max_length", "256", "--cp_size", "2", "--report_to", "none",
                   "--save_strategy", "no", "--sparse_block_size", "32", "--sparse_min_seq_len", "128"]
        results[name] = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert results["seeded"].returncode == 0, results["seeded"].stderr[-4000:]
    refused = results["per_process"]
    assert refused.returncode != 0
    assert "hold different rows of tokens" in refused.stderr and "build it identically on every process" in (
        refused.stderr), refused.stderr[-4000:]


def test_every_plugin_flag_shown_with_the_launcher_exists():
    from hf_sparse_cp.launch.launched import plugin_flag_names

    names = plugin_flag_names()
    shown = [(page, command) for page, command in COMMANDS if "hf_sparse_cp.run" in command or
             "hf-sparse-cp launch" in command]
    assert len(shown) >= 4
    for page, command in shown:
        for flag in re.findall(r"(?<![\w-])--((?:sparse|cp|smet)\w*)", command):
            assert flag in names, f"{page}: --{flag} in `{command}`"


def test_the_install_line_names_the_extras_the_demo_command_needs():
    """The README's install command names its extras, each one setup.cfg declares, and together they hold what
    `hf-sparse-cp train` needs beyond the base install (its demo data: `datasets`, the extra its error names)."""
    import configparser

    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    extras = {name: value.split() for name, value in config["options.extras_require"].items()}
    readme = (ROOT / "README.md").read_text()
    install = readme[readme.index("## Install"):].split("```bash\n", 1)[1].split("```", 1)[0]
    command = next(line for line in install.splitlines() if line.startswith("pip install"))
    named = [extra.strip() for group in re.findall(r"\.\[([\w,-]+)\]", command.split(" #", 1)[0])
             for extra in group.split(",")]
    assert named, f"the install line names no extra: {command!r}"
    assert all(extra in extras for extra in named), (named, sorted(extras))
    needed = {re.split(r"[<>=!~\[;]", requirement, maxsplit=1)[0] for extra in named for requirement in extras[extra]}
    assert "datasets" in needed, f"`hf-sparse-cp train` needs datasets; the install line installs {sorted(needed)}"
    for extra in re.findall(r"\.\[([\w-]+)\]", command.split(" #", 1)[1]):  # the extras the comment names
        assert extra in extras, extra


def test_the_claim_that_cp_equals_one_process_names_its_precision_and_what_bf16_gives():
    """"Losses equal the run without CP" holds in fp32; under bf16 autocast (TRL's default) they differ by bf16's
    rounding: the README says which, with the measured difference, and links the page that says how it was
    measured (docs/context-parallelism.md#precision)."""
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert "In fp32, losses and gradients equal the run without CP" in readme
    bf16 = re.search(r"Under bf16 autocast \(`--bf16`, TRL's default\) they agree to bf16's rounding: the demo's "
                     r"losses to (\S+) at step 1 and within (\S+) \(\S+ relative\) after it "
                     r"\(\[precision\]\(docs/context-parallelism.md#precision\)\)", readme)
    assert bf16, "the README's CP paragraph no longer says what bf16 gives"
    page = " ".join((ROOT / "docs" / "context-parallelism.md").read_text().split())
    section = page[page.index("### Precision"):]
    assert "holds in fp32" in section and "--bf16 true" in section and "--summary_file" in section
    assert f"at most {bf16.group(2)}" in section


def _anchors(page: Path) -> set[str]:
    """The anchors GitHub gives a page's headings (lowercased, punctuation dropped, spaces as hyphens)."""
    seen: dict[str, int] = {}
    for heading in re.findall(r"^#+ (.*)$", re.sub(r"```.*?```", "", page.read_text(), flags=re.S), flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        seen[slug + (f"-{seen[slug]}" if slug in seen else "")] = seen.get(slug, 0) + 1
    return set(seen)


def test_every_relative_link_and_anchor_of_the_docs_resolves():
    """docs/benchmarks.md linked `results/README.md#...` and docs/scaling.md showed its figure from
    `benchmarks/results/...`, both relative to docs/ where no such file is: a reader got a 404."""
    for page in [*PAGES, ROOT / "CONTRIBUTING.md"]:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for link in re.findall(r"\]\(([^)\s]+)\)", text):
            if link.startswith(("http://", "https://", "mailto:")):
                continue
            path, _, anchor = link.partition("#")
            target = (page.parent / path).resolve() if path else page
            assert target.exists(), f"{page.relative_to(ROOT)}: ({link}) names no file"
            if anchor and target.suffix == ".md":
                assert anchor in _anchors(target), f"{page.relative_to(ROOT)}: ({link}) names no heading"


@pytest.mark.parametrize("page, block", _blocks("yaml"), ids=[f"{p}-{i}" for i, (p, _) in enumerate(_blocks("yaml"))])
def test_each_yaml_block_loads_as_a_sparse_config_file(page, block, tmp_path):
    """A `--sparse_config` file shown in the docs loads as written and sets every value it holds."""
    import yaml
    from transformers import HfArgumentParser

    (tmp_path / "pattern.yaml").write_text(block)
    (args,) = HfArgumentParser(SparseTrainingArguments).parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--sparse_config", str(tmp_path / "pattern.yaml")])
    config = args.sparse_attention_config()

    def leaves(tree, obj):
        for key, value in tree.items():
            got = getattr(obj, key)
            yield from leaves(value, got) if isinstance(value, dict) else [(key, got, value)]

    shown = yaml.safe_load(block)
    budget = shown.pop("budget", {})
    assert type(config.budget).__name__.lower().startswith(budget.pop("mode", "")), (page, config.budget)
    for key, got, want in [*leaves(budget, config.budget), *leaves(shown, config)]:
        assert got == want, f"{page}: {key}: {got} != {want}"


def test_every_memory_and_simulate_command_shown_parses():
    """`hf-sparse-cp memory` / `simulate` as the pages show them (in blocks and inline) take the flags shown."""
    from hf_sparse_cp.simulator import memory_cli, simulate_cli

    shown = [(page, command) for page, command in COMMANDS if re.match(r"hf-sparse-cp (memory|simulate) ", command)]
    assert any("memory" in command for _, command in shown) and any("simulate" in command for _, command in shown)
    for page, command in shown:
        cli, argv = shlex.split(command)[1], shlex.split(command)[2:]
        try:
            (memory_cli if cli == "memory" else simulate_cli).build_parser().parse_args(argv)
        except SystemExit:
            pytest.fail(f"{page}: `{command}` does not parse")


def _resolve(name: str):
    """The object a dotted `hf_sparse_cp....` name names: the longest importable module, then attributes."""
    import importlib

    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(name)


def test_every_python_name_and_repository_file_the_pages_name_exists():
    """An inline `hf_sparse_cp.x.y` resolves and a repository path (`hf_sparse_cp/...`, `tests/...`, a package's
    `trainer/x.py`; globs matched) names a file: docs/usage.md named `hf_sparse_cp.integration.write_sparse_model_card`
    and docs/context-parallelism.md `hf_sparse_cp.integration.enable_trainer_context_parallel`, both exported by
    `hf_sparse_cp` itself, and docs/memory.md `hf_sparse_cp.memory.predict_step_memory` (the simulator's)."""
    packages = {path.name for path in (ROOT / "hf_sparse_cp").iterdir() if path.is_dir()}
    tops = {"hf_sparse_cp", "tests", "benchmarks", "examples", "recipes", "kernels", "docs", *packages}
    names = paths = 0
    for page in [*PAGES, ROOT / "CONTRIBUTING.md"]:
        where = page.relative_to(ROOT).as_posix()
        for span in _spans(page):
            for name in re.findall(r"(?<![\w/.])(hf_sparse_cp(?:\.\w+)+)", span):
                names += 1
                try:
                    _resolve(name)
                except (ImportError, AttributeError) as e:
                    pytest.fail(f"{where}: `{name}` does not resolve ({e})")
            for path in re.findall(r"(?<![\w/.-])((?:[\w.-]+/)+[\w.*{},-]*)", span):
                if path.split("/")[0] not in tops:
                    continue
                paths += 1
                globs = [path.replace("{json,png}", suffix) for suffix in ("json", "png")] if "{" in path else [path]
                for glob in globs:
                    assert any(next(base.glob(glob), None) for base in (ROOT, ROOT / "hf_sparse_cp")), (
                        f"{where}: `{path}` names no file")
    assert names > 20 and paths > 20


def test_the_memory_command_names_modules_that_exist(capsys):
    """`hf-sparse-cp memory` said its predictions were `hf_sparse_cp.memory`'s, a package of the memory savers that
    predicts nothing: every module its report names exists and holds the prediction (a package: one of its modules)."""
    import importlib
    import pkgutil

    from hf_sparse_cp.simulator import memory_cli

    memory_cli.main(["--model", "qwen2.5-0.5b", "--gpu-memory", "80GB", "--seq-len", "32768"])
    named = re.findall(r"\bhf_sparse_cp(?:\.\w+)+", capsys.readouterr().out)
    assert named
    for name in named:
        module = _resolve(name)
        held = [module] + [importlib.import_module(info.name)
                           for info in pkgutil.iter_modules(getattr(module, "__path__", []), f"{name}.")]
        assert any(hasattr(m, "predict_step_memory") for m in held), name


class _Parsed(Exception):
    """Raised once a benchmark's parser took its command line: the test stops there, before any work."""


def test_every_benchmark_command_shown_parses(monkeypatch):
    """`python benchmarks/NAME.py ARGS` as the pages show it (in fenced and indented blocks, and inline: the commands
    docs/accuracy.md says its reports were measured with) runs NAME as python does, up to its parser, which takes
    ARGS: a renamed or dropped flag fails here, not in a reader's shell. A loop's variable stands for its first
    value; `$(...)`, what follows `;`, `&` or `|`, and a placeholder (`...`) are left out."""
    import argparse
    import runpy

    shown = [(page, match.group(1), match.group(2)) for page, command in COMMANDS
             for match in [re.search(r"python (benchmarks/\w+\.py)\b(.*)", command)] if match]
    assert len(shown) >= 10
    parse_known_args = argparse.ArgumentParser.parse_known_args

    def parse_then_stop(self, args=None, namespace=None):
        namespace, extras = parse_known_args(self, args, namespace)  # (exits on a bad value)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        raise _Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", parse_then_stop)
    for page, script, args in shown:
        if "..." in args:
            continue
        args = re.split(r"[;&|]", re.sub(r"\$\(.*\)", "", args))[0].replace("$arm", "default")  # (one command)
        monkeypatch.setattr(sys, "argv", [script, *shlex.split(args)])
        try:
            runpy.run_path(str(ROOT / script), run_name="__main__")
        except _Parsed:
            continue
        except SystemExit:
            pytest.fail(f"{page}: `python {script}{args}` does not parse")
        pytest.fail(f"{page}: `python {script}{args}` ran without parsing its command line")
