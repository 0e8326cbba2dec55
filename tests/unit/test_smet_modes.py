"""A SMET mode of one's own (`hf_sparse_cp.smet.register_smet_mode`): named by `SMETConfig.mode` it decides how the
optimizer starts, masks and prunes a sparse weight; a mode nobody registered, and a mode the registry cannot take,
are refused naming the registered ones or the fix. A worked example for docs/smet.md."""

import re

import pytest
import torch
from torch import nn

from hf_sparse_cp.smet import SMETConfig, SMETMode, create_smet_optimizer, register_smet_mode, smet_modes
from hf_sparse_cp.smet import modes as smet_mode_registry
from hf_sparse_cp.smet.masks import active_mask

ROWS, COLS, BLOCK = 16, 64, 8


class RandomStartMode(SMETMode):
    """Masked weights (inactive ones zero) that start from random blocks, not the largest, and prune the blocks
    whose updates moved them least (as sparse_update does), counting what the optimizer asked of it."""

    name = "random_start"
    help = "masked weights from random blocks"
    regrowth = "gradient"
    zeroes_inactive_weights = True
    slot_state = {"moved": torch.float64}

    def __init__(self):
        self.asked = {"initial_scores": 0, "prune_scores": 0, "record_update": 0}

    def initial_scores(self, grid, weights):
        self.asked["initial_scores"] += 1
        return None

    def prune_scores(self, grid, weights, state):
        self.asked["prune_scores"] += 1
        return state["moved"]

    def record_update(self, state, old, new):
        self.asked["record_update"] += 1
        state["moved"].add_((new - old).abs().sum(-1))


class OneMatrix(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.q_proj = nn.Linear(COLS, ROWS, bias=False)


@pytest.fixture
def registry(monkeypatch):
    """The modes' registry, left as it was found."""
    monkeypatch.setattr(smet_mode_registry.base._MODES, "_entries", dict(smet_mode_registry.base._MODES._entries))


def _blocks(weight: torch.Tensor) -> torch.Tensor:
    return weight.detach().view(ROWS, COLS // BLOCK, BLOCK)


def test_a_registered_mode_named_by_the_config_decides_for_the_optimizer(registry):
    mode = register_smet_mode(RandomStartMode())
    assert smet_modes()[-1] is mode
    config = SMETConfig(mode="random_start", density=0.25, block_size=BLOCK, update_interval=2, prune_rate=0.5)
    assert config.registered_mode is mode and config.regrowth_rule == "gradient"  # (the mode's default)

    model = OneMatrix()
    weight = model.q_proj.weight
    opt = create_smet_optimizer(model, torch.optim.AdamW, config, lr=1e-2)
    state = opt.state[weight]
    # the first blocks are the random ones sparse_update starts from (the same seed), not the largest
    reference = OneMatrix()
    update = create_smet_optimizer(reference, torch.optim.AdamW, SMETConfig(
        mode="sparse_update", density=0.25, block_size=BLOCK), lr=1e-2).state[reference.q_proj.weight]
    assert torch.equal(state["block_index"], update["block_index"])
    assert state["moved"].dtype == torch.float64 and state["moved"].shape == state["block_index"].shape
    inactive = ~active_mask(state["block_index"], COLS // BLOCK)
    assert _blocks(weight)[inactive].abs().max() == 0 and _blocks(weight)[~inactive].abs().min() > 0

    gen = torch.Generator().manual_seed(0)
    for _ in range(4):  # (topology updates after steps 2 and 4)
        weight.grad = torch.randn(ROWS, COLS, generator=gen)
        opt.step()
        inactive = ~active_mask(state["block_index"], COLS // BLOCK)
        assert _blocks(weight)[inactive].abs().max() == 0  # pruned blocks zeroed, as the mode says
    assert mode.asked == {"initial_scores": 1, "prune_scores": 2, "record_update": 4}
    assert opt.topology_updates == 2 and opt.last_replaced_fraction > 0
    assert (state["moved"] == 0).any()  # the slots refilled at step 4 start again from zero
    assert opt.state_dict()["state"][0]["moved"].shape == (ROWS, 2)


def test_a_registered_mode_is_read_from_a_config_file(registry, tmp_path):
    register_smet_mode(RandomStartMode())
    path = tmp_path / "smet.yaml"
    path.write_text("mode: random_start\ndensity: 0.5\n")
    assert SMETConfig.from_file(path).mode == "random_start"


def test_an_unknown_mode_is_refused_naming_the_registered_ones(registry):
    with pytest.raises(ValueError, match=re.escape(
            "mode='random_start' (str) is not valid: use one of 'sparse_weights', 'sparse_update' (a mode of your "
            "own: hf_sparse_cp.smet.register_smet_mode(instance) first).")):
        SMETConfig(mode="random_start")
    register_smet_mode(RandomStartMode())
    with pytest.raises(ValueError, match=re.escape("use one of 'sparse_weights', 'sparse_update', 'random_start' (")):
        SMETConfig(mode="random")


def test_what_the_registry_cannot_take_is_refused_naming_the_fix(registry):
    with pytest.raises(TypeError, match="takes an instance of a SMETMode subclass"):
        register_smet_mode(RandomStartMode)  # (the class, not an instance)

    class Taken(RandomStartMode):
        name = "sparse_update"

    with pytest.raises(ValueError, match=r"SMET mode 'sparse_update' is already registered .* another `name`"):
        register_smet_mode(Taken())

    class NoRule(RandomStartMode):
        regrowth = "magnitude"

    with pytest.raises(ValueError, match="regrowth='magnitude'.*one of 'random', 'gradient'"):
        register_smet_mode(NoRule())
    assert [mode.name for mode in smet_modes()] == ["sparse_weights", "sparse_update"]


def test_a_resume_of_a_checkpoint_of_a_registered_mode_is_told_how_to_name_it(registry, tmp_path):
    """A checkpoint saved with another SMET setting names what resumes it: for a mode of one's own it said
    `--smet_mode random_start`, which the flag parser refused (its choices were the built-in modes), then a
    --smet_config file holding it (#50); the flag takes a registered mode now. The flags it names parse, and give
    the saved setting."""
    from transformers import HfArgumentParser

    from hf_sparse_cp import SparseTrainingArguments
    from hf_sparse_cp.trainer.checkpoints import _smet_flags

    register_smet_mode(RandomStartMode())
    hint = _smet_flags({"mode": "random_start", "density": 0.5, "block_size": 8})
    assert "--smet --smet_mode random_start --smet_density 0.5 --smet_block_size 8" in hint
    flags = hint.split("Resume with ")[1].split(" (")[0].split()
    (args,) = HfArgumentParser(SparseTrainingArguments).parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--use_cpu", *flags])
    config = args.smet_optimizer_config()
    assert (config.mode, config.density, config.block_size) == ("random_start", 0.5, 8)
    builtin = _smet_flags({"mode": "sparse_update", "density": 0.5, "block_size": 8})
    assert "--smet --smet_mode sparse_update --smet_density 0.5 --smet_block_size 8" in builtin


class _ScoresOfOneRow(RandomStartMode):
    name = "scores_of_one_row"

    def prune_scores(self, grid, weights, state):
        return state["moved"][0]  # (a row's, not every row's)


class _ListOfScores(RandomStartMode):
    name = "list_of_scores"

    def initial_scores(self, grid, weights):
        return weights.abs().tolist()


def test_what_a_mode_returns_or_declares_wrongly_is_refused_naming_the_mode_and_the_fix(registry):
    """A plug-in's scores of the wrong kind ended deep in the optimizer ('list' object has no attribute 'shape', an
    unpacking ValueError), a slot_state dtype as text in torch.zeros (#50): each is refused naming the mode, the
    method and what it must return."""
    for mode, refused in ((_ScoresOfOneRow(), r"SMET mode 'scores_of_one_row' \(_ScoresOfOneRow.prune_scores\) "
                                              r"returned a torch.float64 tensor of shape \[2\]: it must return a real "
                                              r"tensor of shape \[16, 2\]"),
                          (_ListOfScores(), r"'list_of_scores' \(_ListOfScores.initial_scores\) returned list: it must "
                                            r"return a real tensor of shape \[16, 8\] .*or None for random blocks")):
        register_smet_mode(mode)
        model = OneMatrix()
        with pytest.raises(TypeError, match=refused):
            opt = create_smet_optimizer(model, torch.optim.AdamW, SMETConfig(
                mode=mode.name, density=0.25, block_size=BLOCK, update_interval=2), lr=1e-2)
            for _ in range(2):
                model.q_proj.weight.grad = torch.ones(ROWS, COLS)
                opt.step()

    class TextDtype(RandomStartMode):
        name = "text_dtype"
        slot_state = {"moved": "float64"}

    with pytest.raises(TypeError, match=r"slot_state \{'moved': 'float64'\}: it maps each state's name to a "
                                        r"torch.dtype"):
        register_smet_mode(TextDtype())
