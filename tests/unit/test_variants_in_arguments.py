"""Variants of one's own (plug-ins) named in the Trainer's arguments built in code: `SparseTrainingArguments(
cp_mode=..., smet_mode=..., sparse_budget_mode=..., sparse_attention_engine=...)` refused every registered variant
but the built-in ones (their flags' choices), with a message that named no way to register one, so a CP mode of
one's own could not train in a Trainer at all (#50). A registered one is taken; a name nobody registered is refused
naming the registered ones and how to register one."""

import dataclasses

import pytest
import torch

from hf_sparse_cp import SparseTrainingArguments
from hf_sparse_cp.attention import register_engine
from hf_sparse_cp.attention.budgets import Budget
from hf_sparse_cp.attention.engines import ReferenceEngine
from hf_sparse_cp.config import sections
from hf_sparse_cp.config.registries import ENGINES
from hf_sparse_cp.distributed import register_cp_mode
from hf_sparse_cp.distributed.modes import base as cp_mode_registry
from hf_sparse_cp.distributed.modes.ring import RingMode
from hf_sparse_cp.smet import SMETMode, register_smet_mode
from hf_sparse_cp.smet.modes import base as smet_mode_registry


@dataclasses.dataclass
class OwnBudget(Budget):
    mode = "own_budget"

    def most_kept(self, kind):
        return None

    def select(self, columns, diagonals, start, end, scored_end, block_size):
        return torch.ones_like(columns.scores, dtype=torch.bool), torch.ones_like(diagonals.scores, dtype=torch.bool)

    def describe(self):
        return "every entry"


class OwnEngine(ReferenceEngine):
    name = "own_engine"


class OwnRing(RingMode):
    name = "own_ring"
    help = "the ring, as a plug-in"


class OwnSMETMode(SMETMode):
    name = "own_smet"
    help = "random blocks, never pruned first"
    regrowth = "random"

    def initial_scores(self, grid, weights):
        return None

    def prune_scores(self, grid, weights, state):
        return torch.zeros(state["block_index"].shape)


@pytest.fixture
def registered(monkeypatch):
    """One variant of each kind registered, every registry left as it was found."""
    monkeypatch.setattr(sections, "_BUDGETS", dict(sections._registered()))
    monkeypatch.setattr(cp_mode_registry._MODES, "_entries", dict(cp_mode_registry._MODES._entries))
    monkeypatch.setattr(smet_mode_registry._MODES, "_entries", dict(smet_mode_registry._MODES._entries))
    saved = dict(ENGINES)
    sections.register_budget(OwnBudget)
    register_engine(OwnEngine())
    register_cp_mode(OwnRing())
    register_smet_mode(OwnSMETMode())
    yield
    ENGINES.clear()
    ENGINES.update(saved)


def _arguments(tmp_path, **kwargs) -> SparseTrainingArguments:
    return SparseTrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", **kwargs)


def test_variants_of_ones_own_are_taken_by_the_arguments_built_in_code(registered, tmp_path):
    args = _arguments(tmp_path, cp_mode="own_ring", smet=True, smet_mode="own_smet", sparse_budget_mode="own_budget",
                      sparse_attention_engine="own_engine")
    assert args.context_parallel_config().mode.name == "own_ring"
    assert args.smet_optimizer_config().registered_mode.name == "own_smet"
    pattern = args.sparse_attention_config()
    assert (pattern.budget.mode, pattern.attention_engine) == ("own_budget", "own_engine")


@pytest.mark.parametrize("kwargs, refused", [
    (dict(cp_mode="own_rinh"), "cp_mode='own_rinh' (str) is not valid: use one of 'ring', 'ulysses', 'hybrid', "
                               "'own_ring' (a mode of your own: hf_sparse_cp.distributed.register_cp_mode(instance)"),
    (dict(smet=True, smet_mode="own"), "'sparse_update', 'own_smet' (a mode of your own: "
                                       "hf_sparse_cp.smet.register_smet_mode(instance) first)"),
    (dict(sparse_budget_mode="own"), "'mass', 'own_budget' (a mode of your own: "),
    (dict(sparse_attention_engine="own"), "'own_engine' (an engine of your own: "),
    (dict(cp_mode=["own_ring"]), "cp_mode=['own_ring'] (list) is not valid"),
])
def test_a_name_nobody_registered_is_refused_naming_the_registered_ones(registered, tmp_path, kwargs, refused):
    with pytest.raises(ValueError) as error:
        _arguments(tmp_path, **kwargs)
    assert refused in str(error.value)
