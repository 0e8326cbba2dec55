"""How a training step runs, as its memory depends on it besides the model and the length (`StepSettings`), and
the tokens of the busiest rank it gives (`rank_tokens`) and of the whole sequence as its split pads it
(`padded_tokens`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Literal

from ...config import SparseAttentionConfig
from ...distributed.split.blocks import SHARDINGS, head_group_plan
from ...memory.savers import MemorySavers
from ..kept_curve import DEFAULT_CURVE, KeptCurve
from ..lora import LoraSettings

# The activation dtypes (`StepSettings.dtype`) and the bytes of one element of each.
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


@dataclass(frozen=True)
class StepSettings:
    """How the step runs (what its memory depends on besides the model and the length)."""

    dtype: Literal["bfloat16", "float16", "float32"] = field(
        default="bfloat16", metadata={"help": "Activation (compute) dtype; also the weights' unless master_weights."})
    master_weights: bool = field(
        default=False,
        metadata={"help": "fp32 weights, gradients and optimizer state with autocast compute in `dtype` (the "
                  "Trainer's --bf16); off: everything in `dtype` (a bf16 model, as the benchmarks train)."})
    optimizer: Literal["adamw", "smet", "none"] = field(
        default="adamw", metadata={"help": "torch AdamW (foreach on a GPU), SMET (compact state) or none."})
    smet_density: float = field(default=0.25, metadata={"help": "SMET's active fraction of the layer matrices."})
    smet_block_size: int = field(default=16, metadata={"help": "SMET's block of input columns."})
    cp: int = field(default=1, metadata={"help": "Context-parallel ranks sharing one sequence."})
    max_token_ratio: float | None = field(
        default=None,
        metadata={"help": "Under --cp_sharding document: the planner's token cap (--cp_planner_max_token_ratio), the "
                  "busiest rank holding up to this multiple of the mean of the sequence's blocks plus one block; "
                  "None: a block sharding's equal shares."})
    sharding: Literal["striped", "zigzag", "contiguous"] = field(
        default="striped",
        metadata={"help": "The block sharding (--cp_sharding) whose grid a sequence pads to, as training pads it "
                  "(zigzag's two chunks a rank: twice the others' grid); with max_token_ratio, unread."})
    head_size: int = field(
        default=1,
        metadata={"help": "Ranks of a head group (the CP mode's: 1 for the ring, cp for ulysses, cp_ulysses_size for "
                  "hybrid): attention runs on the head split, over the ring's shard for this rank's heads."})
    fsdp: int = field(
        default=1, metadata={"help": "Ranks the weights, gradients and optimizer state are sharded over (FSDP2 "
                             "shards over data x context parallel ranks)."})
    gradient_checkpointing: bool = field(
        default=True,
        metadata={"help": "Checkpoint every decoder layer; off: every layer keeps what its forward saves until its "
                  "backward (training's below --sparse_gradient_checkpointing_min_length, unless "
                  "--gradient_checkpointing)."})
    savers: MemorySavers = field(default_factory=MemorySavers, metadata={"help": "Token tiles, host offload."})
    pattern: SparseAttentionConfig = field(default_factory=SparseAttentionConfig,
                                           metadata={"help": "The sparse pattern (layout sizes, estimation)."})
    kept_curve: KeptCurve | None = field(
        default=DEFAULT_CURVE,
        metadata={"help": "The measured layout width at a length (`kept_curve.KeptCurve`) for a budget that bounds "
                  "no diagonals ('mass'), read where it measured `pattern`; otherwise, or None, such a layout is "
                  "sized at every block of its rows (the bound)."})
    device: Literal["cuda", "cpu"] = field(
        default="cuda",
        metadata={"help": "'cuda': the Triton kernels, AdamW's multi-tensor step; 'cpu': the PyTorch reference "
                  "attention, AdamW per tensor, and the CPU's mixed-dtype copies (what benchmarks/memory_model.py "
                  "measures)."})
    loss_backend: Literal["torch", "liger"] = field(
        default="torch", metadata={"help": "The lean loss: chunked PyTorch, or liger-kernel's fused kernel (CUDA)."})
    lora: LoraSettings | None = field(
        default=None,
        metadata={"help": "LoRA adapters (`lora.LoraSettings`): the base model frozen, its weights in their dtype "
                  "without gradients or optimizer state, the adapters' in fp32 with theirs; the layers save what the "
                  "frozen matrices and the adapters keep. None: full fine-tuning."})

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype={self.dtype!r} is unknown; use one of {sorted(DTYPE_BYTES)}.")
        if self.cp < 1 or self.fsdp < 1:
            raise ValueError(f"cp={self.cp} and fsdp={self.fsdp} must be >= 1.")
        if self.max_token_ratio is not None and not 1 <= self.max_token_ratio < math.inf:
            raise ValueError(f"max_token_ratio={self.max_token_ratio} must be finite and >= 1 (or None).")
        if self.head_size < 1 or self.cp % self.head_size:
            raise ValueError(f"head_size={self.head_size} must divide cp={self.cp} (whole head groups).")
        if not 0.0 < self.smet_density <= 1.0:
            raise ValueError(f"smet_density={self.smet_density} must be in (0, 1].")
        if self.lora is not None and self.optimizer == "smet":
            raise ValueError("optimizer='smet' with LoRA: SMET's compact state is for full fine-tuning's layer "
                             "matrices, which LoRA freezes; use optimizer='adamw' for the adapters.")
        for name, allowed in (("optimizer", ("adamw", "smet", "none")), ("device", ("cuda", "cpu")),
                              ("sharding", SHARDINGS),
                              ("loss_backend", ("torch", "liger"))):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name}={getattr(self, name)!r} is unknown; use one of {allowed}.")

    @property
    def weight_bytes(self) -> int:
        """Bytes of a weight, its gradient and each optimizer moment: fp32 under master weights, else `dtype`'s."""
        return 4 if self.master_weights else DTYPE_BYTES[self.dtype]

    @property
    def autocast(self) -> bool:
        """Whether the step computes in a lower precision than its fp32 weights, holding autocast's copies of them
        (master weights and a 16-bit `dtype`; #50: float32 compute has no autocast, whatever master_weights says)."""
        return self.master_weights and DTYPE_BYTES[self.dtype] < 4


def with_savers(settings: StepSettings, **changes) -> StepSettings:
    """`settings` with some `MemorySavers` fields changed."""
    return replace(settings, savers=replace(settings.savers, **changes))


def rank_tokens(seq_len: int, s: StepSettings) -> int:
    """The tokens of the busiest rank: the sequence itself on one rank, a block sharding's equal share of the
    sequence padded to its grid (`padded_tokens`), or the document planner's token cap (`max_token_ratio`)."""
    if s.cp == 1:
        return seq_len
    if s.max_token_ratio is None:
        return padded_tokens(seq_len, s) // s.cp
    bs = s.pattern.block_size
    blocks = math.ceil(seq_len / bs)
    return min(blocks, math.floor(s.max_token_ratio * blocks / s.cp) + 1) * bs


def padded_tokens(seq_len: int, s: StepSettings) -> int:
    """The tokens of the whole sequence as training holds it under CP, the length of the ring's global layout and of
    the estimation's flags over the sequence: padded to a block sharding's grid (`head_group_plan`, the split training
    runs and `simulate` costs), to whole blocks by the document planner (one sequence: its ragged split pads its last
    block only); unpadded on one rank."""
    if s.cp == 1:
        return seq_len
    bs = s.pattern.block_size
    if s.max_token_ratio is None:
        return head_group_plan(s.sharding, s.cp, s.head_size, bs, seq_len).padded_len
    return math.ceil(seq_len / bs) * bs
