"""The changes that need a process group (context parallelism, the curriculum, FSDP2 on CPU processes), each
made and undone on 2 gloo processes (`tests/patch_scenarios.py`)."""

import pytest

import patch_scenarios


@pytest.fixture(scope="module")
def results():
    from hf_sparse_cp.testing.spawn import run_gloo

    return run_gloo(patch_scenarios.run_two_process_scenarios, 2, timeout_s=300)


@pytest.mark.parametrize("names", list(patch_scenarios.TWO_PROCESSES), ids=lambda names: names[0].rpartition(".")[2])
def test_two_process_change_is_made_and_undone(results, names):
    for rank, per_rank in enumerate(results):
        for member, changed, restored in per_rank[names]:
            assert changed, f"rank {rank}: {member} did not change"
            assert restored, f"rank {rank}: {member} was not restored"
