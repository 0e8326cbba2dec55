"""The memory savers of a long training step, what runs: `savers.MemorySavers` (the settings), MLPs and
RMSNorms in token tiles (`tiling.py`) and saved layer inputs in host memory (`offload.py`);
`integration/memory_savers.py` applies them to a transformers model. What a step holds, and how long a
sequence fits, is predicted beside the simulator (`hf_sparse_cp.simulator.memory_model`); what a piece of code
allocates and frees, on any device, is recorded by `recorder.StorageRecorder` (which the simulator's measures and the
tests' `AllocationRecorder` read)."""

from .savers import CHECKPOINTING_MIN_LENGTH, TILING_MIN_LENGTH, MemorySavers, from_min_length

__all__ = ["CHECKPOINTING_MIN_LENGTH", "TILING_MIN_LENGTH", "MemorySavers", "from_min_length"]
