"""The limit patterns of benchmarks/pattern_quality.py's frontier (hf_sparse_cp.testing.pattern_limit):
exact masses per query block, the greedy trajectories and the layouts they stand for, the budgets."""

from __future__ import annotations

import pytest
import torch

from hf_sparse_cp.attention.build import dense_layout
from hf_sparse_cp.attention.tokens import TokenMeta
from hf_sparse_cp.testing import pattern_limit as pl

S, BS, HQ, HKV, D = 256, 16, 4, 2, 16
NQB = S // BS
CAUSAL = NQB * (NQB + 1) / 2


@pytest.fixture(scope="module")
def qk():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, HQ, S, D, generator=g)
    k = torch.randn(1, HKV, S, D, generator=g)
    k[:, :, 3] *= 4  # a heavy column and a local bias, so that the patterns have something to find
    q[:, :, 1:] += 0.5 * k.repeat_interleave(HQ // HKV, 1)[:, :, :-1]
    return q, k


@pytest.fixture(scope="module")
def mass(qk):
    return pl.query_block_mass(*qk, scale=D**-0.5, block_size=BS, rows=64)


def test_query_block_mass_sums_the_exact_causal_probabilities(qk, mass):
    q, k = (x.double() for x in qk)
    sc = (q[0] @ k[0].repeat_interleave(HQ // HKV, 0).transpose(1, 2)) * D**-0.5
    p = torch.softmax(sc.masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), float("-inf")), -1)
    assert torch.allclose(mass.double(), p.view(HQ, NQB, BS, S).sum(2), atol=1e-5)
    assert torch.allclose(pl.layout_mass(dense_layout(TokenMeta.contiguous(1, S), BS), mass),
                          torch.full((HQ,), float(S), dtype=torch.float64))


@pytest.mark.parametrize("family", pl.FAMILIES)
def test_a_trajectory_prefix_is_the_layout_it_costs_and_keeps(mass, family):
    build = pl.block_trajectory if family == "block" else pl.vertical_slash_trajectory
    traj = build(mass, BS, max_fraction=0.6)
    assert bool((traj.steps > 0).all())
    assert bool((traj.cost[:, 1:] >= traj.cost[:, :-1]).all())
    assert bool((traj.mass[:, 1:] >= traj.mass[:, :-1] - 1e-9).all())
    for steps in (torch.zeros(HQ, dtype=torch.long), traj.steps // 3, traj.steps):
        layout = traj.layout(steps)
        layout.validate(HQ, S, S, strict=True)
        cost, kept = traj.at(steps)
        assert torch.allclose(layout.num_computed_blocks()[0], cost)
        assert torch.allclose(pl.layout_mass(layout, mass), kept, rtol=1e-9)
    assert bool((traj.cost[torch.arange(HQ), traj.steps] <= 0.6 * CAUSAL + 1e-9).all())


def test_the_vertical_slash_greedy_takes_the_best_mass_per_cost_first(mass):
    # step 1, by brute force: every column (token) and block diagonal d >= 1 on top of the main diagonal
    traj = pl.vertical_slash_trajectory(mass, BS, max_fraction=0.3)
    base_cost, base_mass = traj.at(torch.zeros(HQ, dtype=torch.long))
    best = []
    for h in range(2):
        ratios = []
        for item in range(S + NQB):
            if item == S:  # diagonal 0 is kept from the start
                continue
            probe = pl.Trajectory("vertical_slash", S, BS, torch.tensor([[item]]), traj.cost[h : h + 1, :2],
                                  traj.mass[h : h + 1, :2], torch.ones(1, dtype=torch.long))
            layout = probe.layout(torch.ones(1, dtype=torch.long))
            cost = float(layout.num_computed_blocks()[0, 0]) - float(base_cost[h])
            gain = float(pl.layout_mass(layout, mass[h : h + 1])[0]) - float(base_mass[h])
            ratios.append((gain / cost if cost > 0 else -1.0, -item))
        best.append(-max(ratios)[1])
    assert traj.items[:2, 0].tolist() == best


@pytest.mark.parametrize("family", pl.FAMILIES)
def test_budgets_stay_within_their_fraction_and_allocation_keeps_more(mass, family):
    build = pl.block_trajectory if family == "block" else pl.vertical_slash_trajectory
    # two "layers": the second's heads focused on a few keys, so that one budget is best split unevenly
    focused = mass.clone()
    focused[..., :BS] *= 20
    focused /= focused.sum(-1, keepdim=True) / mass.sum(-1, keepdim=True).clamp_min(1e-30)
    trajs = [build(mass, BS, max_fraction=0.6), build(focused, BS, max_fraction=0.6)]
    for fraction in (0.2, 0.4):
        per_head = pl.limit_steps(trajs, fraction, "per_head")
        allocated = pl.limit_steps(trajs, fraction, "allocated")
        ph = [t.at(s) for t, s in zip(trajs, per_head)]
        al = [t.at(s) for t, s in zip(trajs, allocated)]
        assert all(bool((c <= fraction * CAUSAL + 1e-9).all()) for c, _ in ph)
        assert sum(float(c.sum()) for c, _ in al) <= fraction * CAUSAL * HQ * 2 + 1e-9
        assert sum(float(m.sum()) for _, m in al) >= sum(float(m.sum()) for _, m in ph) - 1e-9
        figures = pl.layer_figures([c for c, _ in al], [m for _, m in al], S, BS)
        assert figures["kept_fraction"] <= fraction + 1e-9 and 0 < figures["recall_worst_layer"] <= 1


def test_an_unknown_allocation_is_refused(mass):
    with pytest.raises(ValueError, match="allocation"):
        pl.limit_steps([pl.block_trajectory(mass, BS)], 0.2, "uniform")


def test_fixed_layouts_run_the_model_with_the_given_patterns(single_thread):
    from transformers import AutoModelForCausalLM

    from hf_sparse_cp.testing.pattern_quality import fixed_layouts
    from hf_sparse_cp.testing.tiny_models import tiny_config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama"), attn_implementation="sdpa").eval()
    ids = torch.randint(3, 259, (1, S))
    meta = TokenMeta.contiguous(1, S)
    with torch.no_grad():
        want = model(ids).logits
        with fixed_layouts(model, {i: dense_layout(meta, BS) for i in range(2)}):
            dense = model(ids).logits
        local = pl.Trajectory("block", S, BS, torch.full((4, 0), -1), torch.zeros(4, 1), torch.zeros(4, 1),
                              torch.zeros(4, dtype=torch.long)).layout(torch.zeros(4, dtype=torch.long))
        with fixed_layouts(model, {0: dense_layout(meta, BS), 1: local}):
            sparse = model(ids).logits
        with fixed_layouts(model, {0: local}), pytest.raises(ValueError, match="layer 1"):
            model(ids)
    assert model.config._attn_implementation == "sdpa"
    assert torch.allclose(dense, want, atol=1e-4) and not torch.allclose(sparse, want, atol=1e-2)


@pytest.mark.parametrize("family", pl.FAMILIES)
def test_the_joint_greedy_of_several_layers_gives_each_layers_own_trajectory(mass, family):
    build = pl.block_trajectory if family == "block" else pl.vertical_slash_trajectory
    focused = mass.clone()
    focused[..., :BS] *= 20
    layers = [mass, focused[:3]]
    joint = pl.trajectories(family, layers, BS, max_fraction=0.5)
    assert len(joint) == 2 and [t.heads for t in pl.trajectories(family, layers, BS, 0.5, layers_per_loop=1)] == [4, 3]
    for one, m in zip(joint, layers):
        alone = build(m, BS, max_fraction=0.5)
        assert torch.equal(one.items, alone.items) and torch.equal(one.steps, alone.steps)
        assert torch.equal(one.cost, alone.cost) and torch.allclose(one.mass, alone.mass, rtol=1e-12)
    with pytest.raises(ValueError, match="family"):
        pl.trajectories("columns", layers, BS)
