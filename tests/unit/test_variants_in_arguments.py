"""Variants of one's own (plug-ins) named in the Trainer's arguments built in code: `SparseTrainingArguments(
cp_mode=..., smet_mode=..., sparse_budget_mode=..., sparse_attention_engine=...)` refused every registered variant
but the built-in ones (their flags' choices), with a message that named no way to register one, so a CP mode of
one's own could not train in a Trainer at all (#50). A registered one is taken; a name nobody registered is refused
naming the registered ones and how to register one."""

import dataclasses

import pytest
import torch
from transformers import HfArgumentParser

from hf_sparse_cp import SparseTrainingArguments
from hf_sparse_cp.attention import register_engine
from hf_sparse_cp.attention.budgets import Budget
from hf_sparse_cp.attention.engines import ReferenceEngine
from hf_sparse_cp.config import sections
from hf_sparse_cp.config.registries import ENGINES, VariantFlag
from hf_sparse_cp.distributed import ContextParallelConfig, register_cp_mode
from hf_sparse_cp.distributed.modes import base as cp_mode_registry
from hf_sparse_cp.distributed.modes.ring import RingMode
from hf_sparse_cp.smet import SMETMode, register_smet_mode
from hf_sparse_cp.smet.modes import base as smet_mode_registry
from hf_sparse_cp.trainer.arguments import SMETArguments, SparseAttentionFlags, SparseCPArguments


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


# A variant of each kind as its flag names it, and what the arguments built in code select.
FLAGS = [
    (["--cp_mode", "own_ring"], dict(cp_mode="own_ring")),
    (["--sparse_budget_mode", "own_budget"], dict(sparse_budget_mode="own_budget")),
    (["--sparse_attention_engine", "own_engine"], dict(sparse_attention_engine="own_engine")),
    (["--smet", "--smet_mode", "own_smet"], dict(smet=True, smet_mode="own_smet")),
]


def _parsed(parser: HfArgumentParser, tmp_path, flags: list[str]):
    return parser.parse_args_into_dataclasses(["--output_dir", str(tmp_path), "--use_cpu", "--report_to", "none",
                                               *flags])


@pytest.mark.parametrize("flags, kwargs", FLAGS)
def test_a_flag_takes_a_variant_registered_before_the_command_line_parses(registered, tmp_path, flags, kwargs):
    """`python train.py --cp_mode own_ring`, the script registering own_ring on import: HfArgumentParser made each
    such flag take its Literal's built-in variants alone (argparse choices), 'invalid choice: 'own_ring'', though the
    same name in code or in a config file was taken (#50). The flag reads the registry as it parses: the arguments
    are those built in code; parsed as the functional API's dataclasses too."""
    (args,) = _parsed(HfArgumentParser(SparseTrainingArguments), tmp_path, flags)
    in_code = _arguments(tmp_path, **kwargs)
    assert (args.context_parallel_config(), args.sparse_attention_config(), args.smet_optimizer_config()) == (
        in_code.context_parallel_config(), in_code.sparse_attention_config(), in_code.smet_optimizer_config())
    assert {name: getattr(args, name) for name in kwargs} == kwargs
    parser = HfArgumentParser((SparseCPArguments, SparseAttentionFlags, ContextParallelConfig, SMETArguments))
    _, pattern, layout, smet = parser.parse_args_into_dataclasses([arg for arg in flags if arg != "--use_cpu"])
    assert {name: getattr(args, name) for name in kwargs} == {
        name: next(getattr(part, name) for part in (pattern, layout, smet) if hasattr(part, name)) for name in kwargs}


@pytest.mark.parametrize("flag, value, refused", [
    ("--cp_mode", "own_rinh", "argument --cp_mode/--cp-mode: cp_mode='own_rinh' (str) is not valid: use one of 'ring', "
                              "'ulysses', 'hybrid', 'own_ring' (a mode of your own: "
                              "hf_sparse_cp.distributed.register_cp_mode(instance) first)."),
    ("--sparse_budget_mode", "own", "'topk', 'topp', 'mass', 'own_budget' (a mode of your own: "
                                    "@hf_sparse_cp.config.sections.register_budget on its class first)."),
    ("--sparse_attention_engine", "own", "'masked', 'own_engine' (an engine of your own: "
                                         "hf_sparse_cp.attention.register_engine(instance) first)."),
    ("--smet_mode", "own", "'sparse_update', 'own_smet' (a mode of your own: "
                           "hf_sparse_cp.smet.register_smet_mode(instance) first)."),
])
def test_a_flag_naming_nothing_registered_is_refused_naming_the_registered_ones(registered, tmp_path, capsys, flag,
                                                                                 value, refused):
    """As argparse refuses a bad flag (one line, status 2), naming the registered variants and how to register one,
    as a config file naming it is refused; `--help` lists the registered ones, the built-in first."""
    parser = HfArgumentParser(SparseTrainingArguments)
    with pytest.raises(SystemExit) as error:
        _parsed(parser, tmp_path, ["--smet", flag, value])
    err = capsys.readouterr().err
    assert error.value.code == 2 and refused in err.splitlines()[-1], err
    assert ("{ring,ulysses,hybrid,own_ring}" in parser.format_help()
            and "{topk,topp,mass,own_budget}" in parser.format_help())


def test_the_flags_list_the_built_in_variants_where_nothing_else_is_registered():
    """Outside a script that registers its own, `--help` lists the built-in variants, as the Literal does."""
    text = HfArgumentParser(SparseTrainingArguments).format_help()
    for choices in ("{ring,ulysses,hybrid}", "{topk,topp,mass}", "{auto,triton,flex,reference,masked}",
                    "{sparse_weights,sparse_update}"):
        assert f" {choices}" in text, choices


def test_every_field_naming_a_registered_variant_is_a_flag_that_reads_its_registry():
    """One mechanism for every such flag: a field the arguments name in `REGISTERED_FIELDS` (its class checks the
    registry) parses through `VariantFlag` (the registry read as the flags parse), and no other field does."""
    fields = {f.name: f for f in dataclasses.fields(SparseTrainingArguments)}
    reading = {name for name, f in fields.items() if f.metadata.get("action") is VariantFlag}
    assert reading == set(SparseTrainingArguments.REGISTERED_FIELDS) == {
        "cp_mode", "sparse_budget_mode", "sparse_attention_engine", "smet_mode"}


def test_a_budget_mode_of_ones_own_over_a_files_budget_names_the_file_for_its_fields(registered, tmp_path, caplog):
    """`--sparse_budget_mode own_budget` over a file's topk budget warned 'give the own_budget budget's fields as
    flags', which a budget mode of one's own does not have (#50): its fields go in the file's budget section. A
    built-in mode's fields are still named as flags."""
    from hf_sparse_cp import SparseAttentionConfig

    topk = tmp_path / "topk.yaml"
    topk.write_text("budget:\n  mode: topk\n  vertical_topk: 64\n")
    with caplog.at_level("WARNING"):
        config = SparseAttentionConfig.from_file_and_flags(topk, {"budget_mode": "own_budget"},
                                                           explicit={"budget_mode"})
    assert config.budget.mode == "own_budget"
    assert ("give the own_budget budget's fields in the file's budget section (mode: own_budget; a budget mode of "
            "your own has no flags)") in caplog.text, caplog.text
    caplog.clear()
    with caplog.at_level("WARNING"):
        SparseAttentionConfig.from_file_and_flags(topk, {"budget_mode": "mass"}, explicit={"budget_mode"})
    assert "give the mass budget's fields as flags" in caplog.text, caplog.text
