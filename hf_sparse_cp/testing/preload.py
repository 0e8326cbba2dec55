"""What every process of `run_gloo` imports anyway, imported once in the fork server they start from (spawn.py)."""

import gc

from .hidden import hide_from_environment

hide_from_environment()  # (a run as on a machine without Triton: its processes too)

import torch.distributed  # noqa: E402,F401
from transformers import Trainer  # noqa: E402,F401  (the slowest: accelerate, peft, datasets)

from ..trainer import sparse_trainer  # noqa: E402,F401  (the plugin's Trainer: ~0.4 s of CPU a process)

try:  # TRL's trainers, which its tests' processes build (~0.4 s a process)
    from trl import DPOTrainer, SFTTrainer  # noqa: F401
except ImportError:  # (an optional dependency)
    pass

# The forked processes would otherwise scan (and so copy, page by page) all that in each full collection: a Trainer's
# train() starts with one (accelerate's free_memory), ~0.5 s of CPU a process.
gc.freeze()
