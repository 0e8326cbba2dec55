"""TRL's RLOOTrainer under context parallelism, as GRPO's (`test_trl_grpo.py`): each CP group's first rank generates
and scores the step's rows (its leave-one-out baselines over each prompt's completions, the KL penalty in their
rewards, its advantages' normalization and slices seen over the data-parallel ranks) and shares them with its group;
the loss's forwards take each rank's shard of every row and gather the per-token log-probabilities back into whole
rows. The logged loss, rewards, KL, clip ratios and the weights after the steps are one process's."""

import pytest

from hf_sparse_cp.testing.spawn import run_gloo

pytest.importorskip("trl")
pytest.importorskip("datasets")

from test_trl_grpo import _assert_equal, _train, distinct, tiny  # noqa: E402, F401 (tiny: the fixture)


@pytest.mark.parametrize(("cp", "rloo"), [
    # (4 completions a prompt: each baseline the mean of 3 others' rewards, with their KL to the reference model)
    ({}, {"num_generations": 4, "beta": 0.1}),
    # (a generation batch of 8 prompts at 4 per device: 2 steps a generation, as on one process; old log-probs: the
    # ratio of 7 of 8 rows clipped at step 2 (at a learning rate of 0.5 all: no gradient); advantages normalized
    # over the batch)
    ({"cp_mode": "ulysses"}, {"beta": 0.0, "generation_batch_size": 8, "gradient_accumulation_steps": 2,
                              "num_iterations": 2, "normalize_advantages": True, "learning_rate": 0.05}),
], ids=["ring-striped-kl-4-generations", "ulysses-accumulated-iterations-normalized"])
def test_rloo_under_cp2_equals_one_process(tmp_path, tiny, cp, rloo):  # noqa: F811 (the fixture)
    """Losses, rewards, KL, clip ratios, entropy and the weights after three steps under CP 2, and an evaluation's
    loss and rewards after them, are one process's."""
    one = run_gloo(_train, 1, tiny, str(tmp_path / "one"), {}, rloo, distinct, "RLOO", timeout_s=400)[0]
    # (it trained, on completions whose rewards differ within a group: advantages that are not all 0)
    assert all(log["grad_norm"] > 0 and log.get("reward_std", 1) > 0 for log in one["logs"]), one["logs"]
    assert any(kept is not None and 0 < kept < 1 for kept in one["kept"]), one["kept"]  # the sparse path ran
    for rank in run_gloo(_train, 2, tiny, str(tmp_path / "cp2"), {"cp_size": 2, **cp}, rloo, distinct, "RLOO",
                         timeout_s=400):
        _assert_equal(rank, one)


def test_rloo_under_dp2_x_cp2_equals_data_parallel(tmp_path, tiny):  # noqa: F811 (the fixture)
    """DP 2 x CP 2 (4 processes) trains as DP 2 without CP: RLOO's leave-one-out groups span the data-parallel ranks
    (one prompt per rank and step: each completion's baseline is the other rank's), its KL penalties are gathered with
    the rewards over them, and each rank draws the completions of the DP run's process of its DP rank."""
    rloo = {"per_device_train_batch_size": 1, "beta": 0.1}
    dp = run_gloo(_train, 2, tiny, str(tmp_path / "dp2"), {}, rloo, distinct, "RLOO", timeout_s=400)
    assert all(log["grad_norm"] > 0 for log in dp[0]["logs"]), dp[0]["logs"]
    for rank, run in enumerate(run_gloo(_train, 4, tiny, str(tmp_path / "dp2cp2"), {"cp_size": 2}, rloo, distinct,
                                        "RLOO", timeout_s=400)):
        # (the logged loss is 0 but for rounding: the advantages of a group sum to 0 and the ratio to the old
        # log-probabilities is 1, but for the rounding of sums of about 12 log-probabilities of about -5.5 computed
        # by different forwards, each term's about 0.2 x 4e-6; measured 1.4e-6 against -3e-8 at step 2)
        _assert_equal(run, dp[rank // 2], absolute={"loss": 1e-5})
