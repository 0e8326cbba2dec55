"""Every change the plugin makes to someone else's object is listed in `compat.PATCHES` and undone by its
feature's undo call: one apply / check / undo scenario per listed change (`tests/patch_scenarios.py`; the
ones that need a process group run in tests/distributed/test_patch_registry_cp.py)."""

import ast
from pathlib import Path

import pytest
from transformers import Trainer

from hf_sparse_cp.integration import compat
from hf_sparse_cp.integration.patching import PatchSet

import patch_scenarios

PACKAGE = Path(__file__).resolve().parents[2] / "hf_sparse_cp"


def test_every_listed_change_has_a_round_trip_scenario():
    covered = [name for names in (*patch_scenarios.ONE_PROCESS, *patch_scenarios.TWO_PROCESSES) for name in names]
    changes = sorted(p.qualified for p in compat.PATCHES if p.changes)
    assert sorted(covered) == changes


@pytest.mark.parametrize("names", list(patch_scenarios.ONE_PROCESS), ids=lambda names: names[0].rpartition(".")[2])
def test_one_process_change_is_made_and_undone(names):
    for member, changed, restored in patch_scenarios.round_trip(patch_scenarios.ONE_PROCESS[names]):
        assert changed, f"{member} did not change"
        assert restored, f"{member} was not restored"


def test_a_change_without_an_entry_is_refused(tmp_path):
    trainer = Trainer(model=__import__("torch").nn.Linear(2, 2),
                      args=patch_scenarios._args(str(tmp_path)))
    with pytest.raises(LookupError, match="compat.PATCHES"):
        PatchSet().set_attr(trainer, "evaluate", lambda *a, **k: None)
    assert "evaluate" not in vars(trainer)


def _bare_changes(path: Path) -> list[str]:
    """`setattr` / `delattr` calls in a module: changes that would bypass the recorder."""
    tree = ast.parse(path.read_text())
    calls = [node for node in ast.walk(tree) if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)]
    return [f"{path.relative_to(PACKAGE.parent)}:{node.lineno}" for node in calls
            if node.func.id in ("setattr", "delattr")]


def test_no_module_changes_an_object_past_the_recorder():
    """Only the recorder sets attributes by name; `configure()` stores the settings it is asked to store."""
    allowed = {"hf_sparse_cp/integration/patching.py", "hf_sparse_cp/integration/registration.py"}
    found = [hit for path in sorted(PACKAGE.rglob("*.py")) for hit in _bare_changes(path)
             if str(path.relative_to(PACKAGE.parent)) not in allowed]
    assert not found, found
