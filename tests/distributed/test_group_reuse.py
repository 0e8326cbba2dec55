"""Process groups are created once per default group and role (`mesh._new_groups`): a layout built again reuses
them (before: every build created new ones, which torch keeps until the default group goes; gloo's with their
worker threads), and a new default group gets new ones."""

from __future__ import annotations

import os
from datetime import timedelta

import torch.distributed as dist

from hf_sparse_cp.distributed import mesh
from hf_sparse_cp.testing.spawn import run_gloo


def _reuse(rank: int, world: int, workdir: str) -> list[bool]:
    first = mesh._new_groups([[0]], rank, "cp")
    again, other = mesh._new_groups([[0]], rank, "cp"), mesh._new_groups([[0]], rank, "head")
    dist.barrier()
    dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(workdir, 'store')}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=60))
    anew = mesh._new_groups([[0]], rank, "cp")
    return [again is first, other is not first, anew is not first, len(mesh._created) == 1]


def test_groups_are_reused_until_the_default_group_goes(tmp_path):
    assert run_gloo(_reuse, 1, str(tmp_path), timeout_s=120) == [[True, True, True, True]]
