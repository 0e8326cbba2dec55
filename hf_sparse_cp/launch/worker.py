"""What `hf-sparse-cp launch` (and `train`) runs in each process it starts under torchrun or accelerate launch:
`python -m hf_sparse_cp.launch.worker ARGS` is `python -m hf_sparse_cp.run ARGS`, except that a Ctrl-C during the
run's imports (torch, transformers: seconds after the start, before the run can end it in silence as
`interrupts.end_interrupted` does) ends the process in silence too, with `INTERRUPTED`: the launcher prints the one
line, where each process printed Python's KeyboardInterrupt traceback through its imports.
"""

from __future__ import annotations

import importlib
import sys

from .interrupts import INTERRUPTED


def main() -> None:
    """Import `hf_sparse_cp.run` (and the Trainer's modules it imports as it runs) and run its `main` on this
    process's command line."""
    try:
        from hf_sparse_cp.run import HEAVY_MODULES
        from hf_sparse_cp.run import main as run

        for module in HEAVY_MODULES:  # (the run imports them once its flags parse: here, within this guard)
            importlib.import_module(module)
    except KeyboardInterrupt:
        sys.exit(INTERRUPTED)
    run()


if __name__ == "__main__":
    main()
