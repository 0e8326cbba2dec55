"""accelerate's own context-parallel layout (a `ParallelismConfig` with cp_size, as the GPU recipes set it) in the
gloo processes of a CPU test, where accelerate does not build one."""

from __future__ import annotations

from typing import Any


def allow_parallelism_config_on_cpu() -> None:
    """Let this process's Accelerators take a `ParallelismConfig`: accelerate accepts one under FSDP2 or on GPU
    processes only, and gloo processes are MULTI_CPU until the Trainer's FSDP2 set-up. Call it in a spawned process
    (the bypass lasts as long as the process), never in the test runner's own."""
    from accelerate.parallelism_config import ParallelismConfig

    ParallelismConfig._validate_accelerator = lambda self, accelerator: None


def give_accelerate_cp(trainer: Any, **sizes: int) -> Any:
    """Hand `trainer`'s built accelerator the layout `ParallelismConfig(**sizes)` (its device mesh on CPU), as
    accelerate holds one it was built with; returns the config. Undo with `take_accelerate_cp`."""
    from accelerate.parallelism_config import ParallelismConfig

    state, config = trainer.accelerator.state, ParallelismConfig(**sizes)
    state.parallelism_config, state.device_mesh = config, config.build_device_mesh("cpu")
    return config


def take_accelerate_cp(trainer: Any) -> None:
    """Leave `trainer`'s accelerator (and accelerate's process-wide state) without a parallel layout again."""
    state = trainer.accelerator.state
    state.parallelism_config, state.device_mesh = None, None
