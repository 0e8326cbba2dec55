"""Whether this process is one of a launched group, by one rule for every reader (the launcher, the flags' checks,
the Trainer glue, the parallel layout): torchrun and accelerate launch set WORLD_SIZE and RANK in each process they
start; a WORLD_SIZE alone is a shell's (a cluster job script exports it before its torchrun line, a user's profile
WORLD_SIZE=1), and the process that sees it runs alone. A torch-free leaf: the launcher reads it before any import
of torch."""

from __future__ import annotations

import os
from collections.abc import Mapping


def launched_world_size(env: Mapping[str, str] = os.environ) -> int | None:
    """The processes of the launched group this process is one of (its launcher's WORLD_SIZE), or None where it runs
    alone: WORLD_SIZE and RANK are not both set."""
    return int(env["WORLD_SIZE"]) if "WORLD_SIZE" in env and "RANK" in env else None


def in_launched_group(env: Mapping[str, str] = os.environ) -> bool:
    """Whether this process is one of a launched group (torchrun's, accelerate launch's): `launched_world_size`."""
    return launched_world_size(env) is not None


def launched_env(processes: int) -> dict[str, str]:
    """The variables a launcher sets in the first of `processes` processes it starts, as the checks read them (the
    launcher's checks of the flags before it starts any)."""
    return {"WORLD_SIZE": str(processes), "RANK": "0"}
