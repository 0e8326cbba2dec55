"""The private transformers / accelerate members the plugin touches (`integration/compat.py`): all
present with the parameters we rely on, and a clear error naming the member when one changes."""

import inspect

import pytest
from accelerate import Accelerator
from transformers import Trainer

from hf_sparse_cp.integration import compat


def test_every_private_member_is_as_the_plugin_uses_it():
    problems = compat.check_private_members({"accelerate.Accelerator": Accelerator(cpu=True)})
    assert not problems, "\n".join(problems)


def test_a_missing_member_is_named_with_the_versions(monkeypatch):
    monkeypatch.delattr(Trainer, compat.TRAINER_TRACK_TOKENS)
    problems = compat.check_private_members()
    assert len(problems) == 1
    assert "transformers.Trainer._track_num_input_tokens no longer exists" in problems[0]
    assert "written for 5.0 to 5.24" in problems[0]
    with pytest.raises(RuntimeError, match="_track_num_input_tokens no longer exists.*tested range"):
        compat.require("transformers.Trainer._track_num_input_tokens")


def test_a_changed_signature_is_named(monkeypatch):
    monkeypatch.setattr(Trainer, compat.TRAINER_CP_INPUTS, lambda self, model, inputs, extra: (None, inputs))
    (problem,) = compat.check_private_members()
    assert "_prepare_context_parallel_inputs takes (self, model, inputs, extra), not (self, model, inputs)" in problem


def test_instance_members_are_checked_on_an_instance():
    class NoLoaders:
        pass

    (problem,) = compat.check_private_members({"accelerate.Accelerator": NoLoaders()})
    assert "accelerate.Accelerator._dataloaders no longer exists" in problem
    with pytest.raises(RuntimeError, match="_dataloaders"):
        compat.track_data_loader(NoLoaders(), object())


def test_the_token_count_version_switch_matches_the_installed_trainer():
    """Under the plugin's CP the loss's token count must divide by the CP degree once: through the
    patched `get_cp_size()` where the Trainer divides by it (transformers >= 5.19), else by our wrapper.
    If a release moves that division, this names the switch to update."""
    divides = "self.get_cp_size()" in inspect.getsource(getattr(Trainer, compat.TRAINER_COUNT_ITEMS))
    assert compat.token_count_divides_by_get_cp_size() == divides
