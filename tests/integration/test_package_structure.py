"""The package's shape: one import direction between its folders, no import cycle, every module
importable on its own, and a repository root that is safe to work in."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Installed package name -> folder in the repository.
FOLDERS = {"hf_sparse_cp": ROOT / "hf_sparse_cp", "hf_sparse_cp.kernels": ROOT / "kernels",
           "hf_sparse_cp.examples": ROOT / "examples", "hf_sparse_cp.recipes": ROOT / "recipes"}

# What each part may import from the rest of hf_sparse_cp besides itself (prefixes); "*" anything. The direction is
# trainer -> reporting / resharding -> integration -> distributed -> attention -> config, with kernels a leaf, the
# simulator (step time and memory on paper) beside the training path, reading the ring's plan, and testing /
# examples on top.
BASE = ("hf_sparse_cp.config", "hf_sparse_cp.backends", "hf_sparse_cp.env", "hf_sparse_cp.lazy", "hf_sparse_cp.recipes",
        "hf_sparse_cp.scoped", "hf_sparse_cp.checkpoint_marker", "hf_sparse_cp.launch_env", "hf_sparse_cp.dtensors",
        "hf_sparse_cp.close_names")
MODEL_PATH = (*BASE, "hf_sparse_cp.distributed", "hf_sparse_cp.attention", "hf_sparse_cp.loss", "hf_sparse_cp.smet",
              "hf_sparse_cp.memory")
ALLOWED = {
    "hf_sparse_cp.kernels": (),
    "hf_sparse_cp.config": ("hf_sparse_cp.scoped", "hf_sparse_cp.close_names"),
    "hf_sparse_cp.backends": (),
    "hf_sparse_cp.lazy": (),
    "hf_sparse_cp.scoped": (),  # a context variable set for a block
    "hf_sparse_cp.checkpoint_marker": (),  # a checkpoint's marker and a run's newest complete checkpoint, torch-free
    "hf_sparse_cp.launch_env": (),  # whether this process is one of a launched group: one rule, torch-free
    "hf_sparse_cp.dtensors": (),  # how a DTensor built from local shards is laid out: torch only
    # the shipped files (training recipes, accelerate configs, patterns) by name, a refusal naming the close ones
    "hf_sparse_cp.recipes": ("hf_sparse_cp.close_names",),
    "hf_sparse_cp.close_names": (),  # the "did you mean" rule: difflib only
    "hf_sparse_cp.env": ("hf_sparse_cp.version",),
    "hf_sparse_cp.attention": (*BASE, "hf_sparse_cp.kernels"),
    "hf_sparse_cp.loss": BASE,
    "hf_sparse_cp.smet": BASE,
    "hf_sparse_cp.distributed": (*BASE, "hf_sparse_cp.attention"),
    # the predictions on paper: step time and memory (which reads the memory savers' settings)
    "hf_sparse_cp.simulator": (*BASE, "hf_sparse_cp.distributed", "hf_sparse_cp.attention", "hf_sparse_cp.memory"),
    # the model shapes both predictions take: a leaf but for the config fields it shares with training
    "hf_sparse_cp.simulator.shapes": ("hf_sparse_cp.config.model_fields",),
    # the command lines' arguments: a --config's architecture is checked as training checks it (`token_mixers`)
    "hf_sparse_cp.simulator.arguments": (*BASE, "hf_sparse_cp.distributed", "hf_sparse_cp.attention",
                                         "hf_sparse_cp.memory", "hf_sparse_cp.simulator",
                                         "hf_sparse_cp.integration.models"),
    # the memory savers that run (token tiles, host offload)
    "hf_sparse_cp.memory": (*BASE, "hf_sparse_cp.attention"),
    # what the ops of a piece of code allocate and free (the simulator's measures and the tests' recorder): torch only
    "hf_sparse_cp.memory.recorder": (),
    "hf_sparse_cp.integration": MODEL_PATH,
    "hf_sparse_cp.resharding": (*MODEL_PATH, "hf_sparse_cp.integration"),
    "hf_sparse_cp.reporting": (*MODEL_PATH, "hf_sparse_cp.integration"),
    "hf_sparse_cp.trainer": (*MODEL_PATH, "hf_sparse_cp.integration", "hf_sparse_cp.resharding",
                             "hf_sparse_cp.reporting"),
    "hf_sparse_cp.testing": ("*",),
    "hf_sparse_cp.examples": ("*",),
    "hf_sparse_cp.cli": ("*",),
    "hf_sparse_cp.run": ("*",),  # the launcher of stock scripts, beside the command line
    "hf_sparse_cp.launch": ("*",),  # what the launcher changes while a script runs, and how it starts processes
    "hf_sparse_cp.version": (),  # a leaf: the command line reads it without importing torch
    "hf_sparse_cp.reporting.plots": ("*",),  # user-facing pictures, beside the command line
    "hf_sparse_cp": ("*",),  # the package root exposes the public API
}


def _modules() -> dict[str, Path]:
    mods = {}
    for package, folder in FOLDERS.items():
        for path in folder.rglob("*.py"):
            parts = [p for p in path.relative_to(folder).with_suffix("").parts if p != "__init__"]
            mods[".".join([package, *parts])] = path
    return mods


def _imports(module: str, path: Path, known: set[str]) -> set[str]:
    """Modules of the package that `module` imports (module level and inside functions)."""
    tree = ast.parse(path.read_text())
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                base += node.module.split(".") if node.module else []
            else:
                base = node.module.split(".")
            prefix = ".".join(base)
            targets = [prefix, *(f"{prefix}.{a.name}" for a in node.names)]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != module and not module.startswith(target + "."):
                found.add(target)
    return found


def _part(module: str) -> str:
    """The longest key of ALLOWED that `module` belongs to."""
    return max((p for p in ALLOWED if module == p or module.startswith(p + ".")), key=len)


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    mods = _modules()
    return {m: _imports(m, path, set(mods)) for m, path in mods.items()}


def test_every_module_has_a_place_in_the_layers(graph):
    loose = [m for m in graph if m != "hf_sparse_cp" and _part(m) == "hf_sparse_cp"]
    assert not loose, f"modules with no entry in ALLOWED (add their layer): {loose}"


def test_every_import_goes_the_allowed_direction(graph):
    wrong = []
    for module, targets in graph.items():
        part = _part(module)
        allowed = (*ALLOWED[part], part) if part != "hf_sparse_cp" else ("*",)
        if "*" in allowed:
            continue
        for target in sorted(targets):
            if not any(target == a or target.startswith(a + ".") for a in allowed):
                wrong.append(f"{module} imports {target}")
    assert not wrong, "imports against the layer direction:\n" + "\n".join(wrong)


def test_the_training_path_never_imports_the_test_helpers(graph):
    users = {m for m, targets in graph.items() for t in targets if t.startswith("hf_sparse_cp.testing")}
    assert all(_part(m) in ("hf_sparse_cp.testing", "hf_sparse_cp.examples") for m in users), users


def test_no_import_cycle(graph):
    index, low, stack, on_stack, cycles, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


def _dependency_order(graph) -> list[str]:
    order, done = [], set()

    def add(module):
        if module not in done:
            done.add(module)
            for target in sorted(graph[module]):
                add(target)
            order.append(module)

    for module in sorted(graph):
        add(module)
    return order


def test_every_module_imports_in_dependency_order(graph):
    """A fresh interpreter imports every module, each after the modules it imports."""
    names = _dependency_order(graph)
    code = f"import importlib\nfor name in {names!r}:\n    importlib.import_module(name)\n"
    subprocess.run([sys.executable, "-c", code], check=True, cwd="/")


def test_import_patches_nothing():
    code = (
        "import hf_sparse_cp; from transformers import AttentionInterface;"
        "from transformers.masking_utils import AttentionMaskInterface;"
        "assert 'sparse_cp' not in AttentionInterface() and 'sparse_cp' not in AttentionMaskInterface();"
        "assert not hf_sparse_cp.is_patched()"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("command", [
    ["-c", "import os, peft, transformers; from transformers import AutoModelForCausalLM, Trainer; import kernels; "
           "f = getattr(kernels, '__file__', None); "
           "assert f is None or not os.path.abspath(f).startswith(os.path.abspath('kernels') + os.sep), kernels"],
    ["-m", "hf_sparse_cp.cli", "env"],
], ids=["python-c", "python-m"])
def test_the_repository_root_is_safe_to_work_in(command):
    """From the repository root (which Python puts on sys.path), our `kernels/` folder must not pass
    for the Hub's `kernels` package that transformers probes for (and, from transformers 5.25, requires: where it is
    installed, `import kernels` must find it, not our folder)."""
    env = {k: v for k, v in __import__("os").environ.items() if k != "PYTHONSAFEPATH"}
    run = subprocess.run([sys.executable, *command], cwd=ROOT, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
