"""Memory of a long training step: what a step holds (`model.py`: a prediction for any model, length,
CP size and dtype, term by term, and how long a sequence fits; `cli.py`: `hf-sparse-cp memory`) and
the savers that cut its largest terms (`savers.MemorySavers`: MLPs and RMSNorms in token tiles,
`tiling.py`; saved layer inputs in host memory, `offload.py`). `integration/memory_savers.py`
applies the savers to a transformers model."""

from .savers import MemorySavers

__all__ = ["MemorySavers"]
