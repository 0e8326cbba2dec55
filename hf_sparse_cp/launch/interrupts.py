"""How a launched run ends on Ctrl-C (SIGINT): one line, `interrupted by the user; N ranks stopped; the last
checkpoint is ...`, exit status `INTERRUPTED`, and no traceback (Python's KeyboardInterrupt traceback, once per rank,
and torchrun's own, only show where each process was).

* Each process (`hf_sparse_cp.run`) notes the output folder of each Trainer it builds in the launcher's folder
  (`REPORTS_ENV`: the launcher finds the checkpoints there, whatever the ranks got to do after the signal), and on
  KeyboardInterrupt exits with `INTERRUPTED` in silence; a run in the launcher's own process prints the line itself.
* The launcher (`processes.launch`), once the processes are gone, prints the line (`interrupted_line`).
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from ..launch_env import launched_world_size
from .refusals import REPORTS_ENV

INTERRUPTED = 128 + signal.SIGINT  # (the shell's status for a command ended by Ctrl-C)
_OUTPUT_DIRS = "output_dirs"  # the file of the launcher's folder that lists the Trainers' output folders


def record_output_dir(output_dir: str | os.PathLike | None) -> None:
    """Note a Trainer's `output_dir` in the launcher's folder, where a launched process has one (`REPORTS_ENV`)."""
    folder = os.environ.get(REPORTS_ENV)
    if output_dir is None or not folder:
        return
    try:
        with open(os.path.join(folder, _OUTPUT_DIRS), "a") as listed:  # (each rank alike: read as a set)
            listed.write(f"{os.path.abspath(output_dir)}\n")
    except OSError:  # (the folder gone: the line names no checkpoint)
        pass


def recorded_output_dirs(folder: str | os.PathLike) -> list[str]:
    """The output folders the launched processes noted in the launcher's `folder` (`record_output_dir`)."""
    try:
        return list(dict.fromkeys(Path(folder, _OUTPUT_DIRS).read_text().splitlines()))
    except OSError:
        return []


def interrupted_line(ranks: int, output_dirs: Sequence[str]) -> str:
    """The line a run stopped by Ctrl-C ends with: how many processes stopped and where its last checkpoint is."""
    from hf_sparse_cp.checkpoint_marker import newest_complete_checkpoint  # (only once a run stopped)

    checkpoint = newest_complete_checkpoint(output_dirs)[0]
    where = (f"the last checkpoint is {checkpoint} (--resume_from_checkpoint {checkpoint} continues from it)"
             if checkpoint is not None else "no checkpoint was saved")
    return f"hf-sparse-cp: interrupted by the user; {ranks} rank{'s' if ranks != 1 else ''} stopped; {where}.\n"


def end_interrupted(output_dirs: Sequence[str]) -> NoReturn:
    """Exit with `INTERRUPTED`, no traceback: in silence in a process `hf-sparse-cp` launched (the launcher prints
    the line, once), else after the line from the first rank (of a run under torchrun itself: its world size)."""
    if not os.environ.get(REPORTS_ENV) and os.environ.get("RANK", "0") == "0":
        sys.stderr.write(interrupted_line(launched_world_size() or 1, output_dirs))
        sys.stderr.flush()
    sys.exit(INTERRUPTED)
