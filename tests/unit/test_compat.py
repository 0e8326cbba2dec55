"""Every member of someone else's code the plugin uses (`integration/compat.py`'s `PATCHES`): all present
with the parameters we rely on, a clear error naming the member when one changes, and accelerate's data
loader settings passed on by their own names."""

import ast
import importlib
import importlib.util
import inspect
import re
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator, PartialState
from accelerate.data_loader import IterableDatasetShard
from accelerate.state import AcceleratorState
from torch._library.fake_impl import FakeImplCtx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv
from transformers import Trainer, TrainingArguments

import hf_sparse_cp
from hf_sparse_cp.integration import compat, compat_checks, trainer_losses, upstream


def _generating_trainer(tmp_path, name: str):
    """TRL's `<name>Trainer` (GRPO, RLOO) of a tiny model (None without TRL): its instance members."""
    if importlib.util.find_spec("trl") is None:
        return None
    import datasets
    import trl
    from transformers import AutoModelForCausalLM

    from hf_sparse_cp.examples.tokenizer import byte_tokenizer
    from hf_sparse_cp.testing.tiny_models import tiny_config

    tokenizer = byte_tokenizer()
    args = getattr(trl, f"{name}Config")(str(tmp_path), use_cpu=True, report_to="none", per_device_train_batch_size=2,
                                         num_generations=2, beta=0.0)  # (RLOO's default loads a reference)
    return getattr(trl, f"{name}Trainer")(
        model=AutoModelForCausalLM.from_config(tiny_config("llama", vocab_size=len(tokenizer))), args=args,
        reward_funcs=lambda completions, **kwargs: [0.0] * len(completions), processing_class=tokenizer,
        train_dataset=datasets.Dataset.from_dict({"prompt": ["sparse ring"] * 2}))


def _instances(tmp_path) -> dict:
    trainer = Trainer(model=torch.nn.Linear(2, 2),
                      args=TrainingArguments(str(tmp_path), use_cpu=True, report_to="none"))
    return {"accelerate.Accelerator": trainer.accelerator, "transformers.Trainer": trainer,
            **{f"trl.{name}Trainer": _generating_trainer(tmp_path, name) for name in trainer_losses.GENERATING},
            "transformers.trainer_callback.CallbackHandler": trainer.callback_handler,
            "accelerate.PartialState": PartialState(), "accelerate.state.AcceleratorState": AcceleratorState(),
            "accelerate.data_loader.IterableDatasetShard": IterableDatasetShard(range(0)),
            "datasets.Dataset": (importlib.import_module("datasets").Dataset.from_dict({"prompt": ["sparse ring"]})
                                 if importlib.util.find_spec("datasets") else None),
            # (what `torch.library.get_ctx()` gives a fake implementation: the plan op's, integration/compiled.py)
            "torch._library.fake_impl.FakeImplCtx": FakeImplCtx(FakeTensorMode(shape_env=ShapeEnv()), None)}


def test_every_member_is_as_the_plugin_uses_it(tmp_path):
    problems = compat_checks.check_patches(_instances(tmp_path))
    assert not problems, "\n".join(problems)


def test_every_instance_member_is_checked_on_an_instance(tmp_path):
    owners = {p.owner for p in compat.PATCHES if p.on_instances}
    assert owners <= set(_instances(tmp_path))


def test_a_missing_member_is_named_with_the_versions(monkeypatch):
    monkeypatch.delattr(Trainer, compat.TRAINER_TRACK_TOKENS)
    problems = compat_checks.check_patches()
    assert len(problems) == 1
    assert "transformers.Trainer._track_num_input_tokens no longer exists" in problems[0]
    assert "tested 5.15 to 5.25" in problems[0]
    with pytest.raises(RuntimeError, match="_track_num_input_tokens no longer exists.*tested range"):
        compat_checks.require("transformers.Trainer._track_num_input_tokens")


def test_a_changed_signature_is_named(monkeypatch):
    monkeypatch.setattr(Trainer, compat.TRAINER_CP_INPUTS, lambda self, model, inputs, extra: (None, inputs))
    (problem,) = compat_checks.check_patches()
    assert "_prepare_context_parallel_inputs takes (self, model, inputs, extra), not (self, model, inputs)" in problem


def test_instance_members_are_checked_on_an_instance():
    class NoLoaders:
        pass

    problems = compat_checks.check_patches({"accelerate.Accelerator": NoLoaders()})
    # (each member set in the Accelerator's __init__: its data loaders, its models)
    assert sorted(p.split(" no longer exists")[0] for p in problems) == [
        "accelerate.Accelerator._dataloaders", "accelerate.Accelerator._models"]
    with pytest.raises(RuntimeError, match="_dataloaders"):
        upstream.track_data_loader(NoLoaders(), object())


def test_a_member_renamed_in_a_release_is_found_under_either_name():
    assert upstream.cache_field() in ("cache", "past_key_values")


def test_the_token_count_version_switch_matches_the_installed_trainer():
    """Under the plugin's CP the loss's token count must divide by the CP degree once: through the
    patched `get_cp_size()` where the Trainer divides by it (transformers >= 5.19), else by our wrapper.
    If a release moves that division, this names the switch to update."""
    divides = "self.get_cp_size()" in inspect.getsource(getattr(Trainer, compat.TRAINER_COUNT_ITEMS))
    assert upstream.token_count_divides_by_get_cp_size() == divides


def test_dp_data_loaders_take_the_settings_accelerate_itself_passes(monkeypatch):
    """What `Accelerator.prepare_data_loader` hands accelerate's `prepare_data_loader`, but the ranks: our
    DP-only data loader passes the same settings, read by name, so a new accelerate option is not dropped."""
    import accelerate.accelerator
    from accelerate.utils import DataLoaderConfiguration

    seen = {}
    monkeypatch.setattr(accelerate.accelerator, "prepare_data_loader", lambda dl, device, **kw: seen.update(kw) or dl)
    acc = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(even_batches=False, data_seed=7,
                                                                          use_seedable_sampler=True))
    acc.prepare_data_loader(torch.utils.data.DataLoader(range(4)))
    options = upstream.dp_data_loader_options(acc)
    own = {"num_processes", "process_index", "put_on_device", "slice_fn_for_dispatch", "torch_device_mesh"}
    assert set(options) == set(seen) - own
    assert all(options[k] == seen[k] for k in options)
    assert (options["even_batches"], options["data_seed"], options["use_seedable_sampler"]) == (False, 7, True)


def test_an_accelerate_option_we_cannot_find_is_named(monkeypatch):
    import accelerate.data_loader

    def prepare_data_loader(dataloader, device=None, num_processes=None, process_index=None, shuffle_harder=True):
        return dataloader

    monkeypatch.setattr(accelerate.data_loader, "prepare_data_loader", prepare_data_loader)
    with pytest.raises(RuntimeError, match="'shuffle_harder'.*tested range"):
        upstream.dp_data_loader_options(Accelerator(cpu=True))


def test_a_member_newer_than_the_installed_release_is_not_missing(monkeypatch):
    """transformers 5.17 (the GPU image's, in the tested range) has neither the packed-positions remap nor Gemma 4's
    KV-shared slicer, both from 5.23, and does without them: check_patches said each 'no longer exists'. A member
    with a `since` release is checked from that release on."""
    import transformers
    from transformers import masking_utils

    monkeypatch.delattr(masking_utils, "remap_positions_for_packed_sequence", raising=False)
    monkeypatch.setattr(transformers, "__version__", "5.17.0")
    assert not [p for p in compat_checks.check_patches() if "remap_positions" in p]
    monkeypatch.setattr(transformers, "__version__", "5.23.0")
    (problem,) = [p for p in compat_checks.check_patches() if "remap_positions" in p]
    assert "remap_positions_for_packed_sequence no longer exists" in problem


def test_an_optional_package_that_fails_to_import_here_is_not_in_use(monkeypatch):
    """liger-kernel 0.8 imported on Triton 3.2 without a GPU raises RuntimeError ('0 active drivers'): check_patches
    raised it. Such a package is unusable here, so nothing of it is checked; a required one is named."""
    resolve = compat_checks._resolve

    def failing(dotted):
        if dotted.split(".")[0] in ("liger_kernel", "transformers"):
            raise RuntimeError("0 active drivers ([]). There should only be one.")
        return resolve(dotted)

    monkeypatch.setattr(compat_checks, "_resolve", failing)
    liger = next(p for p in compat.PATCHES if p.package == "liger_kernel")
    ours = next(p for p in compat.PATCHES if p.package == "transformers" and not p.on_instances and not p.since)
    if importlib.util.find_spec("liger_kernel") is not None:
        assert compat_checks.problem(liger) is None
    assert "cannot be imported (0 active drivers" in compat_checks.problem(ours)


_PACKAGE = Path(hf_sparse_cp.__file__).parent
# The plugin's modules and packages, at any depth: a dotted name in the table that starts with one is ours.
_PARTS = {p.stem for p in _PACKAGE.rglob("*") if p.is_dir() or p.suffix == ".py"} - {"__init__", "__pycache__"}
_FILE = re.compile(r"\.(json|ya?ml|md|txt|bin|pth?|safetensors)$")  # (a file's name, `config.json`, is no module)


def _top_level_names() -> set[str]:
    names = set()
    for path in _PACKAGE.rglob("*.py"):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Assign):
                names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return names


def _binds(node: ast.stmt, name: str) -> bool:
    """Whether a module's or class's statement `node` defines or imports `name`."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return node.name == name
    if isinstance(node, ast.Assign):
        return any(isinstance(t, ast.Name) and t.id == name for t in node.targets)
    if isinstance(node, ast.AnnAssign):
        return isinstance(node.target, ast.Name) and node.target.id == name
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return any((alias.asname or alias.name.split(".")[0]) == name for alias in node.names)
    return False


def _ours(dotted: str) -> bool:
    """Whether `dotted` (relative to hf_sparse_cp) names a module of the plugin or something one defines: the module
    found without running it, the names read from its source (a module that needs Triton is named where Triton is
    not installed too)."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            spec = importlib.util.find_spec(".".join(["hf_sparse_cp", *parts[:cut]]))
        except ImportError:  # (a parent that is a module, not a package)
            continue
        if spec is None:
            continue
        body = ast.parse(Path(spec.origin).read_text()).body
        for name in parts[cut:]:  # (a module's name, then a class's member)
            node = next((node for node in body if _binds(node, name)), None)
            if node is None:
                return _imported(".".join(["hf_sparse_cp", *parts[:cut]]), parts[cut:])
            body = getattr(node, "body", [])
        return True
    return False


def _imported(module: str, names: list[str]) -> bool:
    """Whether `module` imported has `names` in turn (a member a class inherits), False where it does not import."""
    try:
        target = importlib.import_module(module)
    except ImportError:
        return False
    for name in names:
        if not hasattr(target, name):
            return False
        target = getattr(target, name)
    return True


def test_every_name_of_the_plugins_code_in_the_table_says_its_module():
    """A `why` or an `undo` names the plugin's code that relies on a member as `module.name` under hf_sparse_cp
    (`integration.upstream.seed_workers_by`), which resolves (`_ours`: read from its module's source, so that a module
    needing Triton resolves where Triton is not installed, as in `make test-no-triton`): after the split of compat.py
    the table named `seed_workers_by`, `cp_exact_losses` or `card_tasks` bare, or beside a module that does not hold
    them (`cp_whole_row_losses`, trainer/whole_rows.py). A bare name of ours, a file path, a dotted name that does not
    resolve, or an undo's call that hf_sparse_cp does not export fails here, naming the entry."""
    ours = _top_level_names()
    problems = []
    for patch in compat.PATCHES:
        for text in (patch.why, patch.undo):
            paths = re.findall(r"\S+\.py\b", text)
            problems += [f"{patch.qualified}: {path} (write its module, `a.b`)" for path in paths]
            for ref in re.findall(r"`([A-Za-z_][\w.]*)`", text):
                if "." not in ref and ref in ours:
                    problems.append(f"{patch.qualified}: `{ref}` without its module")
                elif "." in ref and ref.split(".")[0] in _PARTS and not _FILE.search(ref) and not _ours(ref):
                    problems.append(f"{patch.qualified}: `{ref}` does not import from hf_sparse_cp")
        for call in re.findall(r"([A-Za-z_][\w.]*)\(", patch.undo):
            if not hasattr(hf_sparse_cp, call) and not _ours(call):
                problems.append(f"{patch.qualified}: undo {call}() is neither hf_sparse_cp's nor `module.name`")
    assert not problems, "\n".join(problems)


def test_the_tested_releases_the_docs_state_are_the_tables():
    """docs/how-it-works.md states the releases `PATCHES` was tested with: it said accelerate 1.10-1.15 while
    `TESTED_VERSIONS` says 1.16."""
    text = " ".join((Path(__file__).parents[2] / "docs" / "how-it-works.md").read_text().split())
    for package, name in (("transformers", "transformers"), ("accelerate", "accelerate"), ("torch", "torch"),
                          ("triton", "Triton")):
        low, high = compat.TESTED_VERSIONS[package]
        assert f"{name} {low}-{high}" in text, f"docs/how-it-works.md: {name} {low}-{high} (compat.TESTED_VERSIONS)"
