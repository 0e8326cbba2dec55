"""A checkpoint's marker (`MARKER`), read without torch or transformers, and the newest complete checkpoint of a
run, the one rule by which the launcher (once a run it started was stopped, naming the checkpoint it continues from:
`launch.interrupts`, where importing the Trainer's `checkpoints` took seconds after the Ctrl-C) and the reports (the
model card's quick start, `hf-sparse-cp plot`) find a run's last checkpoint. A leaf below every layer that reads
it; `trainer.checkpoints` writes the markers and checks a resume against them."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

MARKER = "hf_sparse_cp_checkpoint.json"
CHECKPOINT_PREFIX = "checkpoint"  # (transformers' PREFIX_CHECKPOINT_DIR: the Trainer's checkpoint-N folders)


def read_marker(folder: str | Path) -> dict[str, Any] | None:
    """What the checkpoint `folder`'s marker says (None without one: not saved by an hf-sparse-cp run, or on a node
    without shared storage, which only the first node's folder holds it on). ValueError, naming the checkpoint, for
    a marker that is not JSON (runs write it whole: damaged since)."""
    marker = Path(folder) / MARKER
    if not marker.is_file():
        return None
    try:
        content = json.loads(marker.read_text())
    except ValueError as e:
        content = e
    if not isinstance(content, dict):
        raise ValueError(f"Checkpoint {str(folder)!r} is damaged: its {MARKER} is not the JSON object a run writes "
                         f"({content}). Resume from another checkpoint.")
    return content


def newest_complete_checkpoint(output_dirs: Iterable[str | Path]) -> tuple[Path | None, list[Path]]:
    """(The newest checkpoint-N folder of `output_dirs` that is complete, or None; the newer ones it passes over,
    newest first.) Complete: marked complete by the plugin, or without its marker (saved without the plugin, nothing
    to check); passed over: marked in progress (the run ended while saving it) or with a marker that does not read."""

    def complete(folder: Path) -> bool:
        try:
            marker = read_marker(folder)
        except ValueError:
            return False
        return marker is None or bool(marker.get("complete"))

    found = [path for output_dir in output_dirs for path in Path(output_dir).glob(f"{CHECKPOINT_PREFIX}-*")
             if path.name.rsplit("-", 1)[1].isdigit() and path.is_dir()]
    newest_first = sorted(found, key=lambda path: int(path.name.rsplit("-", 1)[1]), reverse=True)
    for i, path in enumerate(newest_first):
        if complete(path):
            return path, newest_first[:i]
    return None, newest_first
