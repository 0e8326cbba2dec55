"""What every process of `run_gloo` imports anyway, imported once in the fork server they start from (spawn.py)."""

from .hidden import hide_from_environment

hide_from_environment()  # (a run as on a machine without Triton: its processes too)

import torch.distributed  # noqa: E402,F401
from transformers import Trainer  # noqa: E402,F401  (the slowest: accelerate, peft, datasets)
