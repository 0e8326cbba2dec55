"""LoRA fine-tuning as the memory model counts it (`memory_model.settings.StepSettings.lora`,
`hf-sparse-cp memory --lora-rank`): the adapters PEFT's `get_peft_model(model, LoraConfig(r=rank,
target_modules=targets, lora_dropout=dropout))` adds to the matrices of every decoder layer of the families whose layers
hold a Llama layer's (q/k/v/o projections, gate/up/down; `LORA_FAMILIES`: Llama, Mistral, Qwen2/3, Gemma, Gemma 3,
Granite; what else a layer saves, its norms', is measured), and what they save.

What LoRA changes in a step (measured on a CPU with autograd's saved-tensor hooks, tests/unit/test_memory_lora.py):
the base model is frozen, so no weight needs a gradient or optimizer state; only the adapters (rank x (in + out) per
targeted matrix, fp32: PEFT upcasts a bf16/fp16 model's adapters, `autocast_adapter_dtype`) have them. A frozen
matrix's product saves no input for its weight's gradient, nor does a frozen RMSNorm's weight product: the layer keeps
no normalized input (before: the projections' and the MLP's input, the RMSNorm's weighted input), no o_proj input
copy and no down_proj input. Each adapter saves its input in its own copy: fp32 where the model's weights are 16-bit
(PEFT casts it to the adapter's dtype), the compute dtype under autocast (fp32 weights, bf16 compute: autocast's
copy), the input itself where both are fp32 (one storage for the targets that share it); and lora_A's output, rank
wide, in that dtype. Dropout (`lora_dropout` > 0) adds a mask per adapted input (a bool per element on CUDA; on a
CPU the fp32 noise) and gives every target its own dropped copy. The embedding and the LM head are frozen: the loss
computes no weight gradient (the lean loss and liger-kernel's skip it).
"""

from __future__ import annotations

from dataclasses import dataclass

from .shapes import ModelShape

# The matrices of a Llama-like decoder layer (`ModelShape`'s gated layer) by PEFT's module name: which of the layer's
# tensors each reads ('norm1': the first RMSNorm's output, 'attention': the attention's output, 'norm2': the second
# RMSNorm's output, 'mlp': act(gate) * up), and its (in, out) features.
MODULE_INPUTS = {"q_proj": "norm1", "k_proj": "norm1", "v_proj": "norm1", "o_proj": "attention",
                 "gate_proj": "norm2", "up_proj": "norm2", "down_proj": "mlp"}
# PEFT's default `target_modules` for the Llama-like families and Gemma's (its
# TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING for llama, mistral, qwen2, qwen3, gemma and gemma3_text; a test
# checks it), and its name for every linear layer but the output's.
DEFAULT_TARGETS = ("q_proj", "v_proj")
ALL_LINEAR = "all-linear"
# The families whose layers LoRA's count was checked on against autograd's hooks (tests/unit/test_memory_lora.py):
# a Llama layer's matrices (`MODULE_INPUTS`), q/k/v reading a norm's output, gate/up another's (or Gemma 3's second
# pre-MLP norm's), what else the layer saves measured. Not OLMo2 (no norm before q/k/v: its input is the layer's),
# nor a parallel block (Cohere: one norm for both), whose adapters' inputs are other tensors.
LORA_FAMILIES = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3", "gemma": "Gemma",
                 "gemma3_text": "Gemma 3", "granite": "Granite"}
# Why another model is refused LoRA (`memory_model.architecture.Architecture.lora_layers`).
LORA_LAYERS = (f"LoRA is modelled on the decoder layers of {', '.join(LORA_FAMILIES.values())} (a Llama layer's "
               f"matrices, {', '.join(MODULE_INPUTS)}, each reading a norm's output or the attention's), whose saved "
               "tensors it counts")


def module_features(shape: ModelShape, name: str) -> tuple[int, int]:
    """(in, out) features of the layer matrix `name` (`MODULE_INPUTS`) of `shape`."""
    h, q, kv, i = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim, shape.intermediate
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h), "gate_proj": (h, i),
            "up_proj": (h, i), "down_proj": (i, h)}[name]


@dataclass(frozen=True)
class LoraSettings:
    """LoRA adapters on every decoder layer (PEFT's `LoraConfig` fields of the same meaning)."""

    rank: int
    targets: tuple[str, ...] = DEFAULT_TARGETS
    dropout: float = 0.0

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"LoRA rank={self.rank!r} must be a whole number >= 1 (PEFT's r, e.g. 16).")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LoRA dropout={self.dropout} must be in [0, 1) (PEFT's lora_dropout; 0: none).")
        unknown = [t for t in self.targets if t not in MODULE_INPUTS]
        if unknown or not self.targets or len(set(self.targets)) != len(self.targets):
            raise ValueError(f"LoRA targets {list(self.targets)}: give distinct matrices of a Llama-like decoder "
                             f"layer, among {', '.join(MODULE_INPUTS)} (or '{ALL_LINEAR}' for all of them)"
                             + (f"; {', '.join(unknown)} is none of them" if unknown else "") + ".")

    def layer_params(self, shape: ModelShape) -> int:
        """Adapter parameters of one decoder layer: rank x (in + out) per targeted matrix (lora_A, lora_B)."""
        return sum(self.rank * sum(module_features(shape, name)) for name in self.targets)

    def params(self, shape: ModelShape) -> int:
        """Adapter parameters of the model (PEFT's trainable parameters)."""
        return shape.layers * self.layer_params(shape)

    def largest_param(self, shape: ModelShape) -> int:
        """Elements of the largest adapter matrix (AdamW's per-tensor step's temporaries)."""
        return max(self.rank * max(module_features(shape, name)) for name in self.targets)

    def describe(self) -> str:
        """One line for the command's header: rank, targets and dropout."""
        return (f"LoRA rank {self.rank} on {', '.join(self.targets)}" +
                (f", dropout {self.dropout:g}" if self.dropout else "") + " (base weights frozen)")


def resolve_targets(targets: list[str] | None) -> tuple[str, ...]:
    """`--lora-targets` as given: None (PEFT's default for the architecture), ['all-linear'], or module names."""
    if not targets:
        return DEFAULT_TARGETS
    if targets == [ALL_LINEAR]:
        return tuple(MODULE_INPUTS)
    return tuple(targets)
