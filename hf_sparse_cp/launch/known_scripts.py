"""What the launcher reads in a script's source before it starts any process: the TRL Trainer classes the script
builds (`trl_trainers`: TRL's own scripts, `-m trl.scripts.reward`, and any script that builds TRL's trainers by
name, as TRL's examples/scripts/orpo.py), whose refusals come, without it, only once every process has loaded and
tokenized the script's data: a trainer whose loss CP does not reproduce (`cp_checks.own_loss_refusal`), and
`--use_liger_kernel` on a machine without CUDA (`attach.training_fused_ops`). Where the source does not say for
sure (a trainer of another package or of the script's own, one built through an attribute, a name bound twice, no
source), nothing is refused here, and the processes refuse as before. `module_found`: whether `-m name` is there;
`reads_trl_config`: whether the script reads TRL's --config file from its command line."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib
import importlib.machinery
import importlib.util
import pathlib
import re
from collections.abc import Sequence
from types import SimpleNamespace

from transformers import HfArgumentParser

from ..trainer.plugin_arguments import PluginArguments


def _spec(name: str):
    """The spec python finds for the module `name`, without running its parents' `__init__` where it can: the top
    package from the import system's finders, each submodule in its parent's search locations (a parent that builds
    its `__path__` at import is imported, as `-m` would). Raises ImportError or ValueError as `find_spec` does."""
    parts = name.split(".")
    spec = importlib.util.find_spec(parts[0])  # (a top-level name: nothing is imported to find it)
    for i in range(1, len(parts)):
        if spec is None or spec.submodule_search_locations is None:
            break
        spec = importlib.machinery.PathFinder.find_spec(".".join(parts[: i + 1]), list(spec.submodule_search_locations))
    else:
        if spec is not None:
            return spec
    return importlib.util.find_spec(name)


def module_found(name: str) -> bool:
    """Whether python finds the module `name` (`-m name`; a misspelled one ended each process in runpy's ImportError
    traceback), without importing its parents where it can (`_spec`)."""
    try:
        return _spec(name) is not None
    except (ImportError, ValueError):
        return False


def _path(target: str, is_module: bool) -> str | None:
    """The file of the script `target` (a path, or with `is_module` a module's name: for a package, its `__main__`,
    which `-m` runs); None without a source file."""
    try:
        if is_module:
            spec = _spec(target)
            if spec is not None and spec.submodule_search_locations is not None:
                spec = _spec(f"{target}.__main__")
            path = spec.origin if spec is not None else None
        else:
            path = target
    except (ImportError, ValueError):
        return None
    return None if not path or path.endswith(".pyc") else path


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as file:
            return file.read()
    except (OSError, ValueError, UnicodeDecodeError):
        return None


def _source(target: str, is_module: bool) -> str | None:
    """The source of the script `target` (`_path`); None without one."""
    path = _path(target, is_module)
    return None if path is None else _read(path)


def _tree(target: str, is_module: bool) -> ast.Module | None:
    """The script's parsed source; None without one, or where python cannot parse it (it says why when it runs)."""
    source = _source(target, is_module)
    try:
        return ast.parse(source) if source is not None else None
    except (SyntaxError, ValueError):
        return None


def source_words(target: str, is_module: bool) -> set[str] | None:
    """The words of the script's source (a path, or a module's name) and of the other Python files of its folder (the
    modules it imports by name, where its argument classes may be declared), dashes read as underscores and without
    leading ones: `--cp-note` in an `add_argument` and a dataclass field `cp_note` both give `cp_note`, so the flags
    the script declares there are among them. None without the script's source."""
    path = _path(target, is_module)
    source = None if path is None else _read(path)
    if source is None:
        return None
    script = pathlib.Path(path).resolve()
    sources = [source] + [_read(str(other)) or "" for other in sorted(script.parent.glob("*.py"))
                          if other.resolve() != script]
    return {word.lstrip("_") for text in sources for word in re.findall(r"\w+", text.replace("-", "_"))}


def trl_trainers(target: str, is_module: bool) -> list[type] | None:
    """The TRL Trainer classes that the script `target` (a path, or a module's name) builds, read from its source:
    every call of a name ending in `Trainer` is of a class the script imports from `trl` (`from trl import
    RewardTrainer`, `from trl.experimental.orpo import ORPOTrainer`) and binds nowhere else. None when the source
    does not say for sure: no call of a Trainer, one of another origin, or through an attribute (`trl.X(...)`)."""
    tree = _tree(target, is_module)
    if tree is None:
        return None
    imported: dict[str, tuple[str, str]] = {}
    bound: list[str] = []  # (every name the script binds otherwise: a class, a function, an assignment)
    called: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "trl" and node.level == 0:
            imported.update({alias.asname or alias.name: (node.module, alias.name) for alias in node.names})
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound += [(alias.asname or alias.name).split(".")[0] for alias in node.names]
        elif isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            bound.append(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            bound.append(node.id)
        elif isinstance(node, ast.Call):
            func = node.func
            name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
            if name.endswith("Trainer"):
                if not isinstance(func, ast.Name):
                    return None
                called.add(name)
    if not called or any(name not in imported or name in bound for name in called):
        return None
    from transformers import Trainer

    classes = []
    for name in sorted(called):
        module, attribute = imported[name]
        try:
            found = getattr(importlib.import_module(module), attribute)
        except (ImportError, AttributeError):
            return None
        if not (isinstance(found, type) and issubclass(found, Trainer)):
            return None
        classes.append(found)
    return classes


def reads_trl_config(target: str, is_module: bool) -> bool:
    """Whether the script `target` reads TRL's `--config FILE` from its command line, as its source says: it calls
    `parse_args_and_config` (TrlParser's), every call without a list of its own (which replaces sys.argv). False
    where the source does not say so (no such call, one given its args, no source): its processes alone read the
    file then, if at all."""
    tree = _tree(target, is_module)
    calls = [node for node in ast.walk(tree) if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
             and node.func.attr == "parse_args_and_config"] if tree is not None else []
    # (a keyword None is `**kwargs`, which may hold args)
    return bool(calls) and all(not call.args and all(keyword.arg not in ("args", None) for keyword in call.keywords)
                               for call in calls)


@dataclasses.dataclass
class DeviceFlags:
    """The two fields of transformers' `TrainingArguments` (and TRL's configs, its subclasses) that decide where a
    launched script trains, declared as there (a bool, False unless given): their flags parse as the script's parser
    parses them, without importing `TrainingArguments` (seconds: the Trainer's dependencies, accelerate) in the
    launcher, which reads them before it starts the processes (tests/unit/test_launch.py checks them against
    transformers')."""

    use_liger_kernel: bool = False
    use_cpu: bool = False


def training_flags(plugin: PluginArguments, args: Sequence[str]) -> SimpleNamespace | None:
    """--use_liger_kernel, --use_cpu, --sparse_attention and --sparse_fused_ops as a TRL script's parser reads them
    from `args` (the plugin's before the script path, `plugin`, as their defaults); None where that parser alone can
    say (a value it will refuse)."""

    class Quiet(argparse.ArgumentParser):
        def error(self, message: str):
            raise ValueError(message)

    parser = Quiet(add_help=False, allow_abbrev=False)
    for source, names in ((HfArgumentParser(DeviceFlags), ("use_liger_kernel", "use_cpu")),
                          (HfArgumentParser(PluginArguments), ("sparse_attention", "sparse_fused_ops"))):
        for action in source._actions:
            if action.dest not in names or not action.option_strings:
                continue
            if action.nargs == 0:  # (`--no_sparse_attention`)
                parser.add_argument(*action.option_strings, dest=action.dest, action="store_const", const=action.const)
            else:
                parser.add_argument(*action.option_strings, dest=action.dest, nargs=action.nargs, const=action.const,
                                    type=action.type, choices=action.choices)
            parser.set_defaults(**{action.dest: getattr(plugin, action.dest, action.default)})
    try:
        return SimpleNamespace(**vars(parser.parse_known_args(list(args))[0]))
    except (ValueError, TypeError):
        return None


def script_refusal(target: str, is_module: bool, cp_size: int, plugin: PluginArguments,
                   args: Sequence[str]) -> str | None:
    """What every process of the script `target` would refuse, with the same message, once it had built its data,
    when the launcher knows it from the source and the command line: the TRL trainer it builds (`trl_trainers`)
    under CP `cp_size` (a compute_loss CP does not reproduce), or `--use_liger_kernel` (with sparse attention) on this
    machine, as the script's parser reads the flags `args` (the plugin's before the script path, `plugin`). None
    otherwise."""
    trainers = trl_trainers(target, is_module)
    if trainers is None:
        return None
    from ..trainer.attach import training_fused_ops

    refusal = trainers_refusal(trainers, cp_size)
    if refusal is not None:
        return refusal
    flags = training_flags(plugin, args)
    if flags is not None and flags.sparse_attention:
        try:
            training_fused_ops(flags.sparse_fused_ops, flags)
        except ValueError as e:
            return str(e)
    return None


def trainers_refusal(trainers: Sequence[type] | None, cp_size: int) -> str | None:
    """The refusal (`cp_checks.own_loss_refusal`) that a script building `trainers` (`trl_trainers`) meets
    under CP `cp_size` whichever it builds; None when one of them (or CP 1) trains."""
    if not trainers or cp_size == 1:
        return None
    from ..trainer.cp_checks import own_loss_refusal

    refusals = [own_loss_refusal(trainer, cp_size) for trainer in trainers]
    return refusals[0] if all(refusals) else None
