"""`MemorySavers`: which of the long-sequence memory savers a training step uses.

Both are exact (the same loss and gradients, up to the rounding of a different summation order):
* token tiles: each decoder layer's MLP and RMSNorms, and the final norm, run in tiles of
  `tile_tokens` tokens (`tiling.tiled_rows`), so a layer's recomputation keeps no [tokens,
  intermediate] tensor and no fp32 copy of the hidden states;
* host offload of the saved layer inputs (`offload.HostOffload`): what gradient checkpointing keeps
  per layer between forward and backward waits in pinned host memory instead.

`hf_sparse_cp.integration.memory_savers.enable_memory_savers` applies them to a model;
`hf_sparse_cp.simulator.memory_model` predicts what they save.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# The lengths from which training turns token tiles and gradient checkpointing on by default (the plugin's
# --sparse_token_tiling_min_length and --sparse_gradient_checkpointing_min_length), which the memory and simulate
# commands predict with by default too.
TILING_MIN_LENGTH = 32768
CHECKPOINTING_MIN_LENGTH = 16384


def from_min_length(min_length: int, length: int | None) -> bool:
    """Whether a saver switched on from `min_length` tokens (one of the lengths above, as a flag gives it; 0: never)
    runs on sequences of `length` tokens (None: unknown, no). The one rule of training's flags and of the memory and
    simulate commands that predict it."""
    return bool(min_length) and length is not None and length >= min_length


@dataclass(frozen=True)
class MemorySavers:
    """The memory savers of a training step (all off by default)."""

    tiled: bool = field(
        default=False,
        metadata={"help": "Compute the MLPs and RMSNorms in token tiles of tile_tokens: exact, one more MLP forward "
                  "per layer in backward, and no [tokens, intermediate] activation kept."},
    )
    tile_tokens: int = field(default=8192, metadata={"help": "Tokens per tile of the tiled MLPs and RMSNorms."})
    offload_layer_inputs: bool = field(
        default=False,
        metadata={"help": "Keep the decoder layers' saved inputs (gradient checkpointing's only activation per "
                  "layer) in pinned host memory until backward, copied asynchronously on a GPU. Needs gradient "
                  "checkpointing."},
    )

    def __post_init__(self) -> None:
        if self.tile_tokens < 1:
            raise ValueError(f"tile_tokens={self.tile_tokens} (--sparse_token_tile_size; `hf-sparse-cp memory "
                             "--token-tile-size`) must be >= 1; e.g. 8192.")

    @property
    def active(self) -> bool:
        return self.tiled or self.offload_layer_inputs
