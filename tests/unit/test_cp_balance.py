"""benchmarks/cp_balance.py at small sizes: striped sharding balances vertical-slash work."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from hf_sparse_cp.attention.build import dense_layout
from hf_sparse_cp.attention.tokens import TokenMeta
from hf_sparse_cp.distributed import ShardPlan
from hf_sparse_cp.simulator.traffic import ring_cost
from hf_sparse_cp.simulator.workloads import random_vertical_slash_layout

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "cp_balance.py"


@pytest.fixture(scope="module")
def rows():
    spec = importlib.util.spec_from_file_location("cp_balance", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
        # 1024 blocks (as S = 128K with blocks of 128), CP 8 and 32
        yield module.main(["--seq", "32768", "--block-size", "32", "--cp", "8", "32"])
    finally:
        sys.modules.pop(spec.name, None)


def _row(rows, cp, pattern, sharding):
    (row,) = [r for r in rows if (r["cp"], r["pattern"], r["sharding"], r["ring"]) == (cp, pattern, sharding, "flat")]
    return row


@pytest.mark.parametrize("cp", [8, 32])
def test_striped_sharding_balances_vertical_slash_work(rows, cp):
    striped = _row(rows, cp, "vertical-slash", "striped")
    assert striped["kept"] < 0.2  # a genuinely sparse layout
    assert striped["rank_imbalance"] <= 1.05
    assert striped["step_imbalance"] <= 1.05  # and every ring step is balanced too
    assert _row(rows, cp, "vertical-slash", "contiguous")["rank_imbalance"] > 1.3


@pytest.mark.parametrize("cp", [8, 32])
def test_dense_ring_reference_points(rows, cp):
    assert _row(rows, cp, "dense", "zigzag")["rank_imbalance"] == pytest.approx(1.0)
    contiguous = _row(rows, cp, "dense", "contiguous")
    n = 1024 // cp  # query blocks per rank; the last rank's sum of (qb + 1) over the mean
    assert contiguous["rank_imbalance"] == pytest.approx((2 * n * (cp - 1) + n + 1) / (n * cp + 1))
    # causal + contiguous: K/V of rank s only travel to ranks after s, half of a full ring's traffic
    assert contiguous["forward_gib"] == pytest.approx(contiguous["full_ring_gib"] / 2)


@pytest.mark.parametrize("sharding", ["contiguous", "zigzag", "striped"])
def test_work_accounts_for_every_computed_block(sharding):
    plan = ShardPlan(sharding, 4, 32, 4096)
    layout = random_vertical_slash_layout(1, 2, 4096, 32, num_diagonals=5, num_verticals=40, sink_tokens=32,
                                          generator=torch.Generator().manual_seed(0))
    cost = ring_cost(layout, plan, kv_heads=1, head_dim=8)
    assert float(cost.work.sum()) == pytest.approx(float(layout.num_computed_blocks().sum()))
    dense = ring_cost(dense_layout(TokenMeta.contiguous(1, 4096), 32), plan, kv_heads=1, head_dim=8)
    assert float(dense.work.sum()) == (4096 // 32) * (4096 // 32 + 1) / 2
