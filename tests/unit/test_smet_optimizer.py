"""SMET optimizer: cold-start cure, equivalence to AdamW, masks, sparse updates, memory, checkpoints."""

import dataclasses
import logging
import math
import re

import pytest
import torch
from torch import nn

from hf_sparse_cp.smet import SMETAdam, SMETConfig, create_smet_optimizer, state_nbytes
from hf_sparse_cp.smet.masks import active_mask

from smet_common import assert_resumes_exactly, fit, markov_tokens, naive, tiny_llama

BETAS = (0.9, 0.999)

pytestmark = pytest.mark.usefixtures("single_thread")


class OneMatrix(nn.Module):
    """A single sparse matrix (named like an attention projection) and a dense bias vector."""

    def __init__(self, rows: int = 32, cols: int = 64, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.q_proj = nn.Linear(cols, rows, bias=True)


def _first_regrown_update(config: SMETConfig, steps_before: int = 3000):
    """Run `steps_before` steps of random gradients (the topology update happens at the last one),
    then one more step; return |update| / lr of regrown and of long-active coordinates at that step."""
    model = OneMatrix()
    lr = 1e-3
    # eps far below sqrt(1 - b2) * |g| so the measured ratios are the Adam ratios themselves.
    opt = create_smet_optimizer(model, torch.optim.AdamW, config, lr=lr, betas=BETAS, eps=1e-14, weight_decay=0.0)
    weight = model.q_proj.weight
    gen = torch.Generator().manual_seed(0)

    def random_step():
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()

    for _ in range(steps_before):
        random_step()
    state = opt.state[weight]
    assert opt.topology_updates == 1
    regrown = state["block_step"] == 0
    assert 0 < regrown.sum() < regrown.numel()
    index = state["block_index"].long()
    before = weight.detach().clone().view(32, -1, config.block_size)
    random_step()
    after = weight.detach().view(32, -1, config.block_size)
    delta = (after - before).gather(1, index.unsqueeze(-1).expand(-1, -1, config.block_size)).abs()
    unit = lr * config.lr_scale_at(config.density)
    return delta[regrown] / unit, delta[~regrown] / unit, steps_before + 1


def _naive_first_step(t: int) -> float:
    """|first update| / lr of a coordinate whose moments start at zero under the global step t."""
    b1, b2 = BETAS
    return (1 - b1) / math.sqrt(1 - b2) * math.sqrt(1 - b2**t) / (1 - b1**t)


def test_first_update_of_a_regrown_block_is_no_larger_than_a_normal_step():
    base = SMETConfig(density=0.5, block_size=8, update_interval=3000, prune_rate=0.25)
    naive_regrown, naive_normal, t = _first_regrown_update(naive(base))
    expected = _naive_first_step(t)
    assert expected > 3.0  # the cold-start overshoot, -> (1 - b1) / sqrt(1 - b2) = 3.16 late in training
    torch.testing.assert_close(naive_regrown, torch.full_like(naive_regrown, expected), rtol=1e-4, atol=0)
    assert naive_regrown.min() > 2 * naive_normal.max()

    smet_regrown, smet_normal, _ = _first_regrown_update(base)
    assert smet_regrown.max() <= smet_normal.median()
    assert smet_regrown.max() <= 1.0 / base.regrow_warmup_steps * (1 + 1e-5)

    # Local bias correction alone: the first step is a sign step of exactly lr, never 3.16 lr.
    bias_only, _, _ = _first_regrown_update(dataclasses.replace(naive(base), local_bias_correction=True))
    torch.testing.assert_close(bias_only, torch.ones_like(bias_only), rtol=1e-4, atol=0)


@pytest.mark.parametrize("decoupled", [True, False], ids=["adamw", "adam"])
def test_density_one_and_dense_groups_match_torch_adam(decoupled):
    """With every block active, SMET's compact update is exactly (fp64) the stock Adam/AdamW update."""
    stock_cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    tokens = markov_tokens(4, 16)
    ours, ref = tiny_llama(dtype=torch.float64), tiny_llama(dtype=torch.float64)
    opt = create_smet_optimizer(ours, stock_cls, SMETConfig(density=1.0, block_size=16, update_interval=2),
                                lr=3e-3, weight_decay=0.1)
    decay = [p for p in ref.parameters() if p.dim() >= 2]
    no_decay = [p for p in ref.parameters() if p.dim() < 2]
    ref_opt = stock_cls([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                        lr=3e-3, foreach=False)
    for _ in range(4):
        for model, optimizer in ((ours, opt), (ref, ref_opt)):
            model(input_ids=tokens, labels=tokens).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    for (name, a), b in zip(ours.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14, msg=name)


@pytest.mark.parametrize("betas", [(0.9, 0.999), (0.9, 0.99999), (0.0, 0.95)])
def test_density_one_in_float32_steps_as_adamw_does_to_rounding(betas):
    """The block-local bias corrections 1 - beta**t were computed in float32, where they cancel: at density 1 every
    step of SMET's sparse weights was 7e-6 (beta2=0.999) to 7e-4 (0.99999) off AdamW's, not float32 rounding."""
    torch.manual_seed(0)
    ours, ref = (nn.Parameter(torch.zeros(32, 64)) for _ in range(2))  # (zero weights: the update itself compared)
    opt = SMETAdam([{"params": [ours], "smet": True}], lr=1e-3, betas=betas, weight_decay=0.0,
                   config=SMETConfig(density=1.0, block_size=16)).attach()
    ref_opt = torch.optim.AdamW([ref], lr=1e-3, betas=betas, weight_decay=0.0, foreach=False)
    for _ in range(3):
        grad = torch.randn(32, 64)
        ours.grad, ref.grad = grad.clone(), grad.clone()
        opt.step()
        ref_opt.step()
        # (to 1e-6 of the step size lr: weights that a later step brings back near 0 have no relative precision)
        torch.testing.assert_close(ours.detach(), ref.detach(), rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("stock_cls", [torch.optim.Adam, torch.optim.AdamW])
def test_built_directly_without_weight_decay_it_decays_as_the_stock_class_does(stock_cls):
    """`SMETAdam(..., decoupled_weight_decay=False)` stands for torch's Adam, whose weight decay defaults to 0, but
    decayed by 1e-2 (AdamW's default) unless told: its steps left Adam's. Each mode's default is now its stock
    class's, and at density 1 it steps as that class does."""
    torch.manual_seed(0)
    ours, ref = (nn.Parameter(w) for w in torch.randn(2, 32, 64, dtype=torch.float64))
    ref.data.copy_(ours.data)
    opt = SMETAdam([{"params": [ours], "smet": True}], lr=1e-2, config=SMETConfig(density=1.0, block_size=16),
                   decoupled_weight_decay=stock_cls is torch.optim.AdamW).attach()
    ref_opt = stock_cls([ref], lr=1e-2, foreach=False)
    assert opt.defaults["weight_decay"] == ref_opt.defaults["weight_decay"]
    for _ in range(3):
        grad = torch.randn(32, 64, dtype=torch.float64)
        ours.grad, ref.grad = grad.clone(), grad.clone()
        opt.step()
        ref_opt.step()
    torch.testing.assert_close(ours.detach(), ref.detach(), rtol=1e-12, atol=1e-14)


def test_sparse_weights_keep_inactive_weights_zero_and_mask_gradients_before_clipping():
    config = SMETConfig(density=0.25, block_size=8, update_interval=3, regrowth="gradient")
    model = tiny_llama()
    opt = create_smet_optimizer(model, torch.optim.AdamW, config, lr=1e-2)
    tokens = markov_tokens(8, 32)
    sparse = [p for g in opt.param_groups if g["smet"] for p in g["params"]]
    assert len(sparse) == 14  # q, k, v, o, gate, up, down in 2 layers; embeddings and lm_head dense
    for _ in range(1, 8):
        model(input_ids=tokens, labels=tokens).loss.backward()
        for p in sparse:
            state = opt.state[p]
            inactive = ~active_mask(state["block_index"], p.shape[1] // 8)
            grad = p.grad.view(p.shape[0], -1, 8)
            assert grad[inactive].abs().max() == 0  # hooks zeroed them during backward
            assert grad[~inactive].abs().sum() > 0
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        assert math.isfinite(norm)
        opt.step()
        opt.zero_grad()
        for p in sparse:
            index = opt.state[p]["block_index"].long()
            rows, blocks = p.shape[0], p.shape[1] // 8
            assert index.shape == (rows, blocks // 4) and index.max() < blocks
            assert (index.sort(1).values.diff(dim=1) > 0).all()  # distinct blocks in every row
            inactive = ~active_mask(index, blocks)
            assert p.detach().view(rows, blocks, 8)[inactive].abs().max() == 0
    assert opt.topology_updates == 2 and opt.last_replaced_fraction > 0


def test_sparse_update_keeps_pretrained_weights_and_regrows_by_gradient():
    config = SMETConfig(mode="sparse_update", density=0.25, block_size=8, update_interval=4, prune_rate=0.5)
    model = OneMatrix(rows=16, cols=64)
    weight = model.q_proj.weight
    pretrained = weight.detach().clone()
    opt = create_smet_optimizer(model, torch.optim.AdamW, config, lr=1e-2)
    assert torch.equal(weight, pretrained)  # attaching changes no weight in sparse_update mode
    gen = torch.Generator().manual_seed(0)
    hot = torch.zeros(16, 8, dtype=torch.bool)
    for step in range(1, 5):
        index = opt.state[weight]["block_index"].long()
        active = active_mask(index, 8)
        grad = torch.randn(16, 8, 8, generator=gen) * 0.01
        if step == 4:
            # Make one inactive block per row the clear gradient winner before the topology update.
            hot = torch.zeros(16, 8, dtype=torch.bool)
            first_inactive = (~active).float().argmax(1)
            hot[torch.arange(16), first_inactive] = True
            grad[hot] = 10.0
        weight.grad = grad.view(16, 64).clone()
        model.q_proj.bias.grad = torch.randn(16, generator=gen)
        before = weight.detach().clone().view(16, 8, 8)
        opt.step()
        changed = (weight.detach().view(16, 8, 8) != before).any(-1)
        assert not (changed & ~active).any()  # only active blocks move
        assert changed[active].all()
    moved = (weight.detach() != pretrained).view(16, 8, 8).any(-1)
    new_index = opt.state[weight]["block_index"].long()
    now_active = active_mask(new_index, 8)
    assert now_active[hot].all()  # the largest-gradient blocks were regrown
    assert (moved & ~now_active).any()  # pruned blocks keep their trained values (not reset)
    regrown_slots = hot.gather(1, new_index)
    assert (opt.state[weight]["update_magnitude"][regrown_slots] == 0).all()  # counted from regrowth on


def test_optimizer_state_at_density_0_1_is_at_most_15_percent_of_adamw():
    # hidden 160 and intermediate 320 with 16-wide blocks: 10 or 20 blocks per row, density exactly 0.1.
    shape = dict(hidden_size=160, intermediate_size=320, num_attention_heads=5, num_key_value_heads=5, head_dim=32)
    tokens = markov_tokens(2, 16)
    smet_model, adam_model = tiny_llama(**shape), tiny_llama(**shape)
    opt = create_smet_optimizer(smet_model, torch.optim.AdamW, SMETConfig(density=0.1, block_size=16))
    adam = torch.optim.AdamW(adam_model.parameters())
    for model, optimizer in ((smet_model, opt), (adam_model, adam)):
        model(input_ids=tokens, labels=tokens).loss.backward()
        optimizer.step()
    names = [n for g in opt.param_groups if g["smet"] for n in g["param_names"]]
    params = dict(adam_model.named_parameters())
    sparse_bytes = state_nbytes(opt, [p for g in opt.param_groups if g["smet"] for p in g["params"]])
    adam_bytes = state_nbytes(adam, [params[n] for n in names])
    assert opt.trained_density() == pytest.approx(0.1)
    ratio = sparse_bytes / adam_bytes
    assert 0.1 < ratio <= 0.15, ratio  # 0.1 of the moments + int16 index + int32 step counter per block


@pytest.mark.parametrize("mode", ["sparse_weights", "sparse_update"])
def test_state_dict_round_trip_resumes_exactly(mode):
    config = SMETConfig(mode=mode, density=0.5, block_size=8, update_interval=3, regrowth="gradient",
                        regrow_warmup_steps=4, prune_decay_steps=20)
    batches = [markov_tokens(4, 16, seed=s) for s in range(12)]
    assert_resumes_exactly(tiny_llama, config, batches, 7)


@pytest.mark.parametrize("change, named", [
    (dict(density=0.25), r"density=0\.5 \(this run: 0\.25\)"),
    # 4 of 8 blocks per row either way (round(3.6) = 4): the state would fit, the setting still differs
    (dict(density=0.45), r"density=0\.5 \(this run: 0\.45\)"),
    (dict(block_size=16), r"block_size=8 \(this run: 16\)"),
    (dict(mode="sparse_update"), r"mode='sparse_weights' \(this run: 'sparse_update'\)"),
])
def test_loading_a_checkpoint_of_other_smet_settings_names_them(change, named):
    config = SMETConfig(density=0.5, block_size=8)
    saved = create_smet_optimizer(tiny_llama(), torch.optim.AdamW, config).state_dict()
    assert [g.get("smet_density") for g in saved["param_groups"]] == [0.5, None, None]
    other = create_smet_optimizer(tiny_llama(), torch.optim.AdamW, dataclasses.replace(config, **change))
    with pytest.raises(ValueError, match=named):
        other.load_state_dict(saved)


def test_a_checkpoint_without_recorded_settings_is_still_checked_by_shape():
    saved = create_smet_optimizer(tiny_llama(), torch.optim.AdamW, SMETConfig(density=0.5, block_size=8)).state_dict()
    for group in saved["param_groups"]:
        for key in [k for k in group if k.startswith("smet_")]:
            del group[key]
    other = create_smet_optimizer(tiny_llama(), torch.optim.AdamW, SMETConfig(density=0.25, block_size=8))
    with pytest.raises(ValueError, match="another density or block_size"):
        other.load_state_dict(saved)


def test_loading_a_stock_optimizer_s_state_or_one_of_other_targets_names_the_fix():
    """A dense run's checkpoint (torch's AdamW: no SMET groups) resumed with --smet, and a SMET checkpoint of other
    target_modules (other group sizes), were both refused as grouped otherwise, asking to 'build the optimizer the same
    way (same model, same target_modules)': the first can't be resumed with SMET at all, the second named no
    targets. Now the first says to resume without --smet or start SMET from the weights alone, the second names the
    checkpoint's targets."""
    model = tiny_llama()
    stock = torch.optim.AdamW([{"params": [p for p in model.parameters() if p.dim() >= 2]},
                               {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}])
    fit(model, stock, [markov_tokens(4, 16)])
    smet = create_smet_optimizer(tiny_llama(), torch.optim.AdamW, SMETConfig(density=0.5, block_size=8))
    with pytest.raises(ValueError, match="not saved by SMET .*resume that checkpoint without --smet, or start SMET "
                                         "from its weights without its optimizer state"):
        smet.load_state_dict(stock.state_dict())
    other = create_smet_optimizer(tiny_llama(), torch.optim.AdamW, SMETConfig(density=0.5, block_size=8,
                                                                              target_modules=["q_proj", "v_proj"]))
    with pytest.raises(ValueError, match=re.escape(
            "same target_modules: the checkpoint's sparse weights are ['down_proj', 'gate_proj', 'k_proj', 'o_proj', "
            "'q_proj', 'up_proj', 'v_proj'], e.g. --smet_target_modules down_proj,gate_proj,k_proj,o_proj,q_proj,"
            "up_proj,v_proj) before loading")):
        other.load_state_dict(smet.state_dict())
    deeper = create_smet_optimizer(tiny_llama(num_hidden_layers=3), torch.optim.AdamW, SMETConfig(density=0.5,
                                                                                                   block_size=8))
    with pytest.raises(ValueError, match=re.escape("(same model, same target_modules) before loading")):
        deeper.load_state_dict(smet.state_dict())  # (the same targets: only the model differs)


def test_loading_the_state_of_other_weights_of_the_same_shapes_is_refused_naming_them():
    """With q_proj, k_proj, v_proj and o_proj of one shape (multi-head attention), a checkpoint saved with
    target_modules=['q_proj'] loaded into a run targeting o_proj fitted every shape: q_proj's masks and compact
    moments went to o_proj, whose inactive blocks attach() then zeroed (half its weights), and the dense moments
    went to the other weights. Refused, naming the weights and the fix."""
    config = SMETConfig(density=0.5, block_size=8, target_modules=["q_proj"])
    model = tiny_llama(num_key_value_heads=4)
    opt = create_smet_optimizer(model, torch.optim.AdamW, config, lr=5e-3)
    fit(model, opt, [markov_tokens(4, 16, seed=s) for s in range(2)])
    saved = opt.state_dict()
    other = tiny_llama(num_key_value_heads=4)
    other.load_state_dict(model.state_dict())
    before = other.model.layers[0].self_attn.o_proj.weight.clone()
    reloaded = create_smet_optimizer(other, torch.optim.AdamW, dataclasses.replace(config, target_modules=["o_proj"]),
                                     lr=5e-3, attach=False)
    with pytest.raises(ValueError, match=re.escape(
            "saved for model.layers.0.self_attn.q_proj.weight where this run has "
            "model.layers.0.self_attn.o_proj.weight") + ".*resume with the same target_modules \\(the checkpoint's "
            "sparse weights: \\['q_proj'\\]\\)"):
        reloaded.load_state_dict(saved)
    assert torch.equal(other.model.layers[0].self_attn.o_proj.weight, before)
    # the same weights under a wrapper's prefix (torch.compile's _orig_mod., DDP's module.) still load
    for group in saved["param_groups"]:
        group["param_names"] = [f"_orig_mod.{name}" for name in group["param_names"]]
    same = create_smet_optimizer(tiny_llama(num_key_value_heads=4), torch.optim.AdamW, config, lr=5e-3, attach=False)
    same.load_state_dict(saved)


def _warnings_of_set_up(caplog, config: SMETConfig, model=OneMatrix) -> tuple[list[str], float]:
    """(what set-up warns, building SMET for `model()` twice as the Trainer does, the density it trains at)."""
    with caplog.at_level(logging.WARNING, logger="hf_sparse_cp.smet"):
        caplog.clear()
        create_smet_optimizer(model(), config=config, attach=False)
        opt = create_smet_optimizer(model(), config=config)
    return [record.getMessage() for record in caplog.records], opt.trained_density()


def test_a_density_whole_blocks_move_far_is_said_once_at_set_up_with_what_comes_closer(caplog):
    """Every row keeps a whole number of blocks, at least one: density 0.1 of 64 columns in blocks of 16 (4 a row,
    0.4 of a block) trains at 0.25, one block a row, and set-up says so once (not only the smet/density log)."""
    warned, trained = _warnings_of_set_up(caplog, SMETConfig(density=0.1, block_size=16))
    assert trained == 0.25
    assert warned == ["SMET trains at density 0.25, not the 0.1 asked: every row keeps a whole number of its blocks of "
                      "block_size=16 input columns, at least one, and a row of 64 columns keeps 1 of its 4 blocks "
                      "(0.25). Closer: block_size (--smet_block_size) 2 trains at 0.0938; or ask for a density every "
                      "row keeps exactly, a multiple of 1/4 (e.g. 0.25)."]
    # within 5% of the density asked (0.3 of 32 blocks: 10, 0.3125), or exact: nothing to say
    assert _warnings_of_set_up(caplog, SMETConfig(density=0.3, block_size=2)) == ([], 0.3125)
    assert _warnings_of_set_up(caplog, SMETConfig(density=0.75, block_size=16)) == ([], 0.75)


def test_factory_rejects_unsupported_optimizers_and_arguments():
    with pytest.raises(ValueError, match="SMET supports"):
        create_smet_optimizer(tiny_llama(), torch.optim.SGD)
    with pytest.raises(ValueError, match="amsgrad"):
        create_smet_optimizer(tiny_llama(), torch.optim.AdamW, amsgrad=True)
    with pytest.raises(ValueError, match="No module of the model matches"):
        create_smet_optimizer(tiny_llama(), config=SMETConfig(target_modules=["c_attn"]))
    with pytest.raises(ValueError, match="not a multiple of block_size"):
        create_smet_optimizer(tiny_llama(), config=SMETConfig(block_size=48))
    opt = create_smet_optimizer(tiny_llama(), torch.optim.AdamW, fused=True, lr=1e-3)
    assert opt.param_groups[0]["lr"] == 1e-3 and opt.decoupled_weight_decay


def test_target_modules_whose_weight_is_not_laid_out_as_a_linear_s_are_refused():
    """SMET keeps blocks of each output's input columns of an [out, in] weight: GPT-2's Conv1D ([in, out]) and an
    embedding (rows are tokens) were accepted and trained another pattern than the documented one."""
    from transformers import AutoModelForCausalLM

    from hf_sparse_cp.testing.tiny_models import tiny_config

    gpt2 = AutoModelForCausalLM.from_config(tiny_config("gpt2"))
    with pytest.raises(ValueError, match=r"transformer.h.0.attn.c_attn \(Conv1D\) is not an nn.Linear.*\[in, out\]"):
        create_smet_optimizer(gpt2, config=SMETConfig(target_modules=["c_attn"]))
    with pytest.raises(ValueError, match=r"model.embed_tokens \(Embedding\) is not an nn.Linear"):
        create_smet_optimizer(tiny_llama(), config=SMETConfig(target_modules=["embed_tokens"], block_size=16))
    create_smet_optimizer(tiny_llama(), config=SMETConfig(target_modules=["lm_head"], block_size=16))


def test_a_target_weight_that_is_not_contiguous_is_refused_at_set_up_naming_it_and_the_fix():
    """A sparse weight stored as a transposed view failed in the first backward, inside the gradient hook: 'SMET needs
    contiguous weights and gradients to view them as blocks', naming neither the weight nor the fix. Set-up refuses
    it by name; made contiguous as the message says, it trains."""
    model = tiny_llama()
    o_proj = model.model.layers[0].self_attn.o_proj
    o_proj.weight = nn.Parameter(o_proj.weight.detach().t().contiguous().t())
    with pytest.raises(ValueError, match=re.escape("model.layers.0.self_attn.o_proj.weight is not contiguous") +
                       ".*param.data = param.data.contiguous()"):
        create_smet_optimizer(model, torch.optim.AdamW, SMETConfig(mode="sparse_update", density=0.5))
    o_proj.weight.data = o_proj.weight.data.contiguous()
    fit(model, create_smet_optimizer(model, torch.optim.AdamW, SMETConfig(mode="sparse_update", density=0.5)),
        [markov_tokens(4, 16)])


@pytest.mark.parametrize("wrong", ["self_attn.o_proj", "o_prj"])
def test_a_target_name_that_matches_nothing_next_to_ones_that_do_is_refused_naming_it(wrong):
    """A typo or a dotted path in a target list whose other names matched left that projection dense without a
    word; the default list names what the model has (GPT-OSS, Mixtral: no gate_proj module) and stays quiet."""
    with pytest.raises(ValueError, match=rf"target_modules names \['{re.escape(wrong)}'\], which no module of the "
                                         r"model has, .* the last part \(q_proj, not self_attn\.q_proj\).* named "
                                         r"\['down_proj', 'gate_proj', 'k_proj', 'lm_head', 'o_proj', 'q_proj', "
                                         r"'up_proj', 'v_proj'\]; correct or remove"):
        create_smet_optimizer(tiny_llama(), config=SMETConfig(block_size=16, target_modules=["q_proj", wrong]))
    from smet_common import tiny_moe

    create_smet_optimizer(tiny_moe("gpt_oss"), config=SMETConfig(block_size=16))
    create_smet_optimizer(tiny_moe("gpt_oss"), config=SMETConfig(block_size=16, target_modules=["up_proj"]))


def test_a_target_weight_a_module_not_targeted_shares_is_refused_and_one_targeted_modules_share_is_one_weight():
    """With tied word embeddings a targeted lm_head's weight is the input embedding: it was made sparse (the embedding
    lost blocks of every token's vector) without a word. Refused naming the fix; a projection shared by two layers
    (both targeted) trains as one sparse weight, every row at the density asked, in both places."""
    tied = tiny_llama(tie_word_embeddings=True)
    with pytest.raises(ValueError, match=r"the weight of target module lm_head is also model\.embed_tokens\.weight "
                                         r"\(Embedding\), which target_modules does not name .* Leave lm_head out of "
                                         r"target_modules \(--smet_target_modules\), or untie the weights"):
        create_smet_optimizer(tied, config=SMETConfig(target_modules=["lm_head", "q_proj"], block_size=16))
    create_smet_optimizer(tied, config=SMETConfig(block_size=16))  # (lm_head not targeted: nothing shared)
    # (the same weight under a target and a module of another name: refused too)
    model = tiny_llama()
    model.model.layers[0].mlp.extra = nn.Linear(128, 64, bias=False)
    model.model.layers[0].mlp.extra.weight = model.model.layers[0].mlp.down_proj.weight
    with pytest.raises(ValueError, match=r"target module model\.layers\.0\.mlp\.down_proj is also "
                                         r"model\.layers\.0\.mlp\.extra\.weight \(Linear\)"):
        create_smet_optimizer(model, config=SMETConfig(block_size=16))
    shared = tiny_llama()
    shared.model.layers[1].mlp.up_proj.weight = weight = shared.model.layers[0].mlp.up_proj.weight
    opt = create_smet_optimizer(shared, config=SMETConfig(density=0.5, block_size=16, update_interval=2), lr=1e-2)
    assert sum(p is weight for g in opt.param_groups for p in g["params"]) == 1
    fit(shared, opt, [markov_tokens(4, 16, seed=s) for s in range(7)])  # (3 topology updates)
    assert shared.model.layers[1].mlp.up_proj.weight is weight
    assert ((weight.detach().view(128, 4, 16).abs().sum(-1) != 0).sum(-1) == 2).all()


def test_a_step_the_loss_scaler_skipped_leaves_no_masked_gradient_to_the_next_regrowth():
    """Before a gradient-regrowth update the hooks keep what they mask away. A step skipped by the loss scaler (fp16:
    an inf or NaN gradient) kept it for the next step, whose scores added it: the SMET callback forgets it at such a
    step, so the update chooses what a run without the skipped backward chooses."""
    from types import SimpleNamespace

    from hf_sparse_cp.trainer.callbacks import SMETCallback

    config = SMETConfig(density=0.5, block_size=8, update_interval=2, prune_rate=0.5, regrowth="gradient")
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(32, 64, generator=gen) for _ in range(2)]
    spike = torch.randn(32, 64, generator=gen) * 1e6  # the skipped step's gradient

    def run(skipped: bool) -> torch.Tensor:
        model = OneMatrix()
        opt = create_smet_optimizer(model, torch.optim.AdamW, config, lr=1e-2)
        weight = model.q_proj.weight
        for step, grad in enumerate(grads):
            for g in (spike, grad) if skipped and step == 1 else (grad,):
                opt.zero_grad()
                (weight * g).sum().backward()  # the hooks mask the gradient, keeping its inactive part
                if g is spike:  # the scaler skips the step; the Trainer calls the callbacks as after any step
                    SMETCallback().on_optimizer_step(None, None, None, optimizer=SimpleNamespace(
                        optimizer=opt, step_was_skipped=True))
            opt.step()
        assert opt.topology_updates == 1
        return opt.state[weight]["block_index"]

    assert torch.equal(run(skipped=True), run(skipped=False))


@pytest.mark.parametrize("density", [0.1, 0.5])
def test_the_learning_rate_scales_with_the_density_a_weight_trains_at(density):
    """The density-aware learning rate of a weight whose rows keep whole blocks: 0.1 asked of 4 blocks a row keeps one
    (0.25), whose scale is 0.25**-0.5 = 2; it was scaled as 0.1**-0.5 = 3.16."""
    config = SMETConfig(density=density, block_size=16, update_interval=1000)
    model = OneMatrix(rows=32, cols=64)
    lr = 1e-3
    opt = create_smet_optimizer(model, torch.optim.AdamW, config, lr=lr, betas=BETAS, eps=1e-14, weight_decay=0.0)
    weight = model.q_proj.weight
    before = weight.detach().clone()
    weight.grad = torch.randn(weight.shape, generator=torch.Generator().manual_seed(0))
    model.q_proj.bias.grad = torch.zeros_like(model.q_proj.bias)
    opt.step()
    moved = (weight.detach() - before).abs()
    kept = (moved > 0).float().mean().item()
    assert kept == max(1, round(density * 4)) / 4  # (the density this weight trains at)
    # the first Adam step of a coordinate is a sign step: |update| = lr x the scale
    torch.testing.assert_close(moved[moved > 0] / lr, torch.full_like(moved[moved > 0], kept**-0.5), rtol=1e-4, atol=0)


@pytest.mark.parametrize("mode", ["sparse_weights", "sparse_update"])
def test_gradient_regrowth_chooses_the_same_blocks_whatever_clipping_scales_the_gradient_by(mode):
    """Clipping (and a loss scaler's unscaling) scales the gradient after the hooks, uniformly, which must leave the
    blocks gradient regrowth chooses alone. Its scores added the masked-away part, as the hooks saw it, to the active
    blocks' part in `param.grad`, clipped: the blocks just pruned were scored by their clipped gradient against the
    others' unclipped one: here, clipped to under a hundredth, none of the 27 (sparse_weights; sparse_update: 20)
    just-pruned blocks that come back unclipped came back, and 20 of 32 rows chose other blocks; a tiny Llama clipped
    so chose otherwise in 31-38% of its rows. The scores now read the whole gradient as the hooks saw it."""
    config = SMETConfig(mode=mode, density=0.5, block_size=8, update_interval=2, prune_rate=0.5, regrowth="gradient")
    grad = torch.randn(32, 64, generator=torch.Generator().manual_seed(0), dtype=torch.float64)

    def blocks_chosen(max_norm: float | None) -> torch.Tensor:
        model = OneMatrix().double()
        # (eps far below the gradient: a uniformly scaled gradient gives the same Adam steps, so the same pruning)
        opt = create_smet_optimizer(model, torch.optim.AdamW, config, lr=1e-2, eps=1e-30)
        weight = model.q_proj.weight
        for _ in range(2):
            (weight * grad).sum().backward()
            if max_norm is not None:  # (the active set is the same at both steps: so is the clipping factor)
                assert torch.nn.utils.clip_grad_norm_([weight], max_norm) > 100 * max_norm
            opt.step()
            opt.zero_grad()
        assert opt.topology_updates == 1 and opt.last_replaced_fraction > 0.3
        return opt.state[weight]["block_index"].sort(dim=1).values

    assert torch.equal(blocks_chosen(max_norm=0.01 * grad.norm().item() / 2), blocks_chosen(max_norm=None))


def test_an_optimizer_stepped_before_attach_warns_what_its_step_ran_with(caplog):
    """SMETAdam built directly (the way to give groups learning rates of their own) and stepped without attach()
    attached itself at the step with an INFO note, unseen by default: that step's forward had run on the dense
    weights (here loss 4.16500 where the attached run has 4.16507) and clipping had seen the unmasked gradient. It
    warns now, naming the fix; attached first, it says nothing, also when a dense group is added later (its state is
    created at its first step, as stock Adam's is). torch.distributed.checkpoint's loading (accelerate's under FSDP2:
    the Trainer's resume) steps an optimizer without state once with zero gradients to create it: nothing reached
    the weights, nothing is said."""
    from torch.distributed.checkpoint.state_dict import _init_optim_state

    quiet = create_smet_optimizer(tiny_llama(), torch.optim.AdamW, SMETConfig(density=0.5, block_size=8), attach=False)
    with caplog.at_level(logging.WARNING, logger="hf_sparse_cp.smet"):
        caplog.clear()
        _init_optim_state(quiet)
    assert quiet.state and not caplog.records
    tokens = markov_tokens(4, 16)
    for attach in (False, True):
        model = tiny_llama()
        groups = [{"params": [model.model.layers[0].self_attn.q_proj.weight], "smet": True, "lr": 1e-2},
                  {"params": [model.model.layers[0].mlp.up_proj.weight], "smet": True, "lr": 3e-3}]
        opt = SMETAdam(groups, config=SMETConfig(density=0.5, block_size=8))
        if attach:
            opt.attach()
        with caplog.at_level(logging.WARNING, logger="hf_sparse_cp.smet"):
            caplog.clear()
            fit(model, opt, [tokens])
            opt.add_param_group({"params": [model.lm_head.weight], "lr": 1e-3})
            fit(model, opt, [tokens])
        warned = [r.getMessage() for r in caplog.records if "SMET attached at a step" in r.getMessage()]
        assert warned == ([] if attach else [
            "SMET attached at a step: 2 sparse weights (parameter 0, ...) had no SMET state or gradient-masking hook "
            "yet (SMETAdam built without attach(), or parameters swapped or added since), so the forward and backward "
            "before this step ran with their inactive blocks (sparse_weights: not zeroed yet) and clipping saw their "
            "unmasked gradient. Call optimizer.attach() after building it or changing its parameters, before the "
            "forward (create_smet_optimizer and install_smet do)."])
        assert opt.state[model.lm_head.weight]["step"] == 1
