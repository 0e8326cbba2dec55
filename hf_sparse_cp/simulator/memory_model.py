"""How much memory one training step of a decoder holds at its peak, term by term.

`predict_step_memory(arch, seq_len, settings)` replays one step as a sequence of allocations and
frees, in the order the code runs them: the forward (gradient checkpointing: each layer without
autograd, its input kept), the loss (the lean loss, which computes its gradients in forward, or
the stock forward's logits where the lean loss does not replace it), the backward
(each layer recomputed, then differentiated, last layer first) and the optimizer step. Every
allocation is sized from the shapes (bytes per token x tokens + constant bytes) and named by the
term it belongs to; the live bytes are tracked op by op, and each phase's peak is reported with the
live bytes of every term at that moment. The byte counts come from reading the code that runs:
transformers' Qwen2/Llama layers (a config's layers: what they save measured on its model,
`shapes.layer_saved`), the `sparse_cp` backend (estimation, layout, the Triton kernels'
launchers or the PyTorch reference), the chunked loss or liger-kernel 0.8.5's, torch's AdamW, the
ring's buffers; `benchmarks/memory_model.py` compares the sum with peaks measured on a CPU.

What it does not count: the CUDA context and the caching allocator's fragmentation (what a GPU
reserves beyond the live tensors: keep a margin, e.g. 10%), NCCL buffers, and kernels' own scratch
below a few MiB.

Terms (`TERMS`): constant ones (weights, gradients, optimizer state, the loss's weight-gradient
buffers, ...) and ones that grow with the tokens of the rank (saved layer inputs, the recomputed
layer's saved activations, the MLP intermediate, RMSNorm's fp32 copies, attention tensors and
layouts, estimation buffers, CP ring buffers, ...).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Literal

import torch

from ..attention import build, estimate, reference, scoring
from ..config import SparseAttentionConfig
from ..config.model_fields import LEAN_LOSS_FAMILIES, decoder_layers
from ..distributed.heads.split import HeadSplit
from ..memory.savers import MemorySavers
from .kept_curve import DEFAULT_CURVE, KeptCurve
from .lora import LORA_FAMILIES, LORA_LAYERS, MODULE_INPUTS, LoraSettings, module_features
from .shapes import (
    MODELS,
    LayerSaved,
    ModelShape,
    MoeBytes,
    SavedBytes,
    check_decoder,
    check_routing_tensors,
    layer_saved,
    meta_model,
    moe_bytes,
)

GIB = 2**30
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}

# The terms a step's bytes are reported under. Each allocation is bytes per token of the rank x its tokens
# plus constant bytes: `MemoryEstimate.token_scaled_bytes` sums the first parts.
TERMS = (
    "weights", "gradients", "optimizer state", "optimizer step temporaries", "FSDP gathered layers",
    "autocast weight copies", "loss: weight-gradient buffers", "loss: logits chunk", "attention workspace",
    "inputs and token metadata", "rotary cos/sin", "saved layer inputs", "recomputed layer: saved activations",
    "layers' saved activations",
    "MLP intermediate", "RMSNorm fp32 copies", "attention tensors", "attention layouts", "estimation buffers",
    "CP ring buffers", "CP all-to-all buffers", "hidden-state gradients", "loss: hidden gradient", "loss: logits",
)


# --------------------------------------------------------------------------------------------- inputs


def _parts(saved: LayerSaved) -> tuple[SavedBytes, SavedBytes, SavedBytes]:
    return saved.before, saved.inputs, saved.after


class _SavedByDtype(Mapping[str, tuple[LayerSaved, ...]]):
    """`shapes.layer_saved` of the meta-device `model` for each activation dtype of `DTYPE_BYTES`, measured at its
    first lookup (a dtype's is three forwards of the whole model: an 8B config's three dtypes took 5 s, and a
    prediction reads one); bfloat16's at once, so that a model the measurement refuses is refused when it is read.
    `measure` takes the other regimes: LoRA's frozen layers, autocast over fp32 weights. `twin`: builds the Llama model
    of the same shape (`beyond_llama`), for a family that token tiles run."""

    def __init__(self, model: torch.nn.Module, kv_heads: int, where: str,
                 twin: Callable[[], torch.nn.Module] | None = None) -> None:
        self._model, self._kv_heads, self._where, self._twin = model, kv_heads, where, twin
        self._measured: dict[tuple[str, bool, bool], tuple[LayerSaved, ...]] = {}
        self._beyond: dict[tuple[str, bool, bool], tuple[LayerSaved, ...] | None] = {}
        self._moe: dict[tuple[str, bool], MoeBytes] = {}
        self["bfloat16"]  # noqa: B018 (measured for its errors)

    def measure(self, dtype: str, frozen: bool = False, autocast: bool = False) -> tuple[LayerSaved, ...]:
        """What the layers save in `dtype`: `frozen`, with their weights frozen (LoRA's base:
        `layer_saved(frozen=True)`); `autocast`, fp32 weights with autocast to `dtype` (an fp32 residual stream)."""
        key = dtype, frozen, autocast
        if key not in self._measured:
            self._measured[key] = layer_saved(self._model, getattr(torch, dtype), self._kv_heads, self._where,
                                              frozen=frozen, autocast=autocast)
        return self._measured[key]

    def moe(self, dtype: str, autocast: bool = False) -> MoeBytes:
        """What the layers' mixture of experts allocates in `dtype` (`shapes.moe_bytes`; `autocast` as `measure`)."""
        key = dtype, autocast
        if key not in self._moe:
            self._moe[key] = moe_bytes(self._model, getattr(torch, dtype), self._where, autocast=autocast)
        return self._moe[key]

    def beyond_llama(self, dtype: str, frozen: bool = False, autocast: bool = False
                     ) -> tuple[LayerSaved, ...] | None:
        """What each layer saves beyond the Llama layer of its shape (Qwen3's q/k norms: their fp32 inputs, rsqrt
        and outputs), measured on both models as `measure` does: what stays when token tiles replace the Llama
        layer's norms and MLP. None without a twin (a Llama's own layer, or a family tiles do not run)."""
        if self._twin is None:
            return None
        key = dtype, frozen, autocast
        if key not in self._beyond:
            llama = layer_saved(self._twin(), getattr(torch, dtype), self._kv_heads, self._where, frozen=frozen,
                                autocast=autocast)
            self._beyond[key] = tuple(
                LayerSaved(*(SavedBytes(a.per_token - b.per_token, a.const - b.const)
                             for a, b in zip(_parts(mine), _parts(theirs))))
                for mine, theirs in zip(self.measure(*key), llama))
        return self._beyond[key]

    def __getitem__(self, dtype: str) -> tuple[LayerSaved, ...]:
        if dtype not in DTYPE_BYTES:
            raise KeyError(dtype)
        return self.measure(dtype)

    def __iter__(self) -> Iterator[str]:
        return iter(DTYPE_BYTES)

    def __len__(self) -> int:
        return len(DTYPE_BYTES)


@dataclass(frozen=True)
class Architecture:
    """A decoder's shape as its memory depends on it: `ModelShape` (layers, hidden, heads, the MLP's form, ...) plus
    whether the LM head shares the embedding, and the parameters beside the shape's matrices: a layer's
    (`layer_extra`: biases, norm weights) and the model's outside its layers (`model_extra`: the final norm,
    position embeddings, an LM head's bias); whether training computes its loss with the lean loss (`lean_loss`:
    the Llama-like families, `LEAN_LOSS_FAMILIES`) or its stock forward's [tokens, vocab] logits; the elements of
    its largest parameter where that is not the embedding (`largest_param`: GPT-2's learned positions; 0: none);
    what each decoder layer saves for backward besides its attention core and MLP, measured on the model by
    activation dtype (`layer_saved`: `shapes.LayerSaved`, measured when first read; None: a Llama layer's, counted
    on its code); whether LoRA's count reads its layers (`lora_layers`: a family of `lora.LORA_FAMILIES` whose layer
    holds `lora.MODULE_INPUTS` by name and size, and no other matrix)."""

    shape: ModelShape
    tied_embeddings: bool
    layer_extra: int
    model_extra: int
    lean_loss: bool = True
    largest_param: int = 0
    layer_saved: Mapping[str, tuple[LayerSaved, ...]] | None = None
    lora_layers: bool = True

    @property
    def name(self) -> str:
        return self.shape.name

    @property
    def layer_params(self) -> int:
        """Parameters of one decoder layer: its matrices, biases and norm weights."""
        return self.shape.layer_params + self.layer_extra

    @property
    def cast_params(self) -> int:
        """Parameters of one decoder layer that autocast casts to the compute dtype: all but a mixture of experts'
        routed experts (torch's grouped matmul, not autocast's, runs them in their own dtype)."""
        return self.layer_params - self.shape.expert_params

    @property
    def token_tiles(self) -> bool:
        """Whether training runs this model's MLPs and norms in token tiles: the Llama-like families' modules only
        (`LEAN_LOSS_FAMILIES`, as the lean loss); training refuses tiles for any other model at start."""
        return self.lean_loss

    @property
    def embedding_params(self) -> int:
        return self.shape.vocab * self.shape.hidden

    @property
    def params(self) -> int:
        """Every parameter: embedding (and an untied LM head), the layers, the rest (final norm, ...)."""
        heads = 1 if self.tied_embeddings else 2
        return heads * self.embedding_params + self.shape.layers * self.layer_params + self.model_extra

    @classmethod
    def from_config(cls, config, name: str | None = None, where: str | None = None) -> Architecture:
        """From a transformers config of a decoder (`ModelShape.from_config`, which names a missing field), its
        parameters counted on the model transformers builds from it on the meta device: whether the LM head is the
        embedding, the layers' and the rest's parameters (biases, LayerNorms' or RMSNorms' weights, position
        embeddings, an LM head's bias), and what its layers save for backward (`shapes.layer_saved`, in each
        activation dtype).

        Raises:
            ValueError: `ModelShape.from_config`'s and `shapes.layer_saved`'s (naming the field and the fix, after
                `where`), or a model without the lean loss that soft-caps its logits (temporaries not modelled).
        """
        where = where or name or getattr(config, "model_type", "the config")
        kv_heads = check_decoder(config, where)[1]  # (before the build, whose own errors would name less)
        check_routing_tensors(config, where)
        lean = config.model_type in LEAN_LOSS_FAMILIES
        if not lean and getattr(config, "final_logit_softcapping", None) is not None:
            raise ValueError(f"{where}: final_logit_softcapping={config.final_logit_softcapping}: the stock loss of "
                             f"{config.model_type} soft-caps its [tokens, vocab] logits, whose temporaries the "
                             "predictions do not model; give a config without it (null), or a preset (--model).")
        model = meta_model(config, where)
        shape = ModelShape.from_config(config, name, where, model)
        layers = decoder_layers(model)
        embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
        tied = head is not None and head.weight is embedding.weight
        layer = sum(p.numel() for p in layers[0].parameters())
        total = sum(p.numel() for p in model.parameters())
        rest = total - shape.layers * layer - (1 if tied else 2) * shape.vocab * shape.hidden
        largest = max(p.numel() for p in model.parameters())
        # (a Llama has nothing beyond its own layer: no twin to measure)
        twin = lean and config.model_type != "llama"
        saved = _SavedByDtype(model, kv_heads, where, twin=(lambda: meta_model(_llama_twin(config), where))
                              if twin else None)
        return cls(shape, tied, layer - shape.layer_params, rest, lean,
                   largest if largest > shape.vocab * shape.hidden else 0, saved,
                   config.model_type in LORA_FAMILIES and _llama_matrices(layers[0], shape))


def _llama_matrices(layer: torch.nn.Module, shape: ModelShape) -> bool:
    """Whether `layer`'s matrices are a Llama layer's of `shape` (`Architecture.lora_layers`): one of each name of
    `lora.MODULE_INPUTS`, of its (in, out) features, and no other (a fused q/k/v, fc1/fc2, a mixture's experts)."""
    matrices = [(name.split(".")[-2], tuple(p.shape)) for name, p in layer.named_parameters() if p.dim() >= 2]
    expected = sorted((name, module_features(shape, name)[::-1]) for name in MODULE_INPUTS)
    return sorted(matrices) == expected


def _llama_twin(config):
    """The Llama config of `config`'s shape (a family token tiles run: `LEAN_LOSS_FAMILIES`)."""
    from transformers import LlamaConfig

    text = config.get_text_config()
    fields = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "vocab_size", "hidden_act", "rms_norm_eps", "tie_word_embeddings")
    return LlamaConfig(**{name: getattr(text, name) for name in fields},
                       head_dim=getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads)


def _qwen_like(shape: ModelShape, tied_embeddings: bool, qkv_bias: bool) -> Architecture:
    """A Qwen2/Llama layout: RMSNorm weights before attention and the MLP and at the end, q/k/v biases or none."""
    bias = (shape.heads + 2 * shape.kv_heads) * shape.head_dim if qkv_bias else 0
    return Architecture(shape, tied_embeddings, bias + 2 * shape.hidden, shape.hidden)


def _qwen3(shape: ModelShape) -> Architecture:
    """Qwen3 of `shape` (no biases, no tying), built from its config on the meta device: its q/k RMSNorms' weights and
    what they save are measured (`Architecture.from_config`), not a Llama layer's counted."""
    from transformers import Qwen3Config

    config = Qwen3Config(hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                         num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                         num_key_value_heads=shape.kv_heads, head_dim=shape.head_dim, vocab_size=shape.vocab,
                         tie_word_embeddings=False)
    arch = Architecture.from_config(config, shape.name)
    return replace(arch, shape=replace(arch.shape, source=shape.source))


class _Presets(Mapping[str, Architecture]):
    """The size presets `--model` names, the simulator's (`shapes.MODELS`), each built at its first lookup: Qwen2.5
    (config.json on the Hugging Face Hub), q/k/v biases, 0.5B, 1.5B and 3B tying the LM head to the embedding, a
    Llama layer's tensors counted on its code; Qwen3-8B (`_qwen3`: its layers measured on the meta device,
    seconds)."""

    def __init__(self) -> None:
        self._built: dict[str, Architecture] = {}

    def __getitem__(self, name: str) -> Architecture:
        if name not in self._built:
            shape = MODELS[name]
            self._built[name] = _qwen3(shape) if name.startswith("qwen3") else _qwen_like(
                shape, tied_embeddings=name != "qwen2.5-7b", qkv_bias=True)
        return self._built[name]

    def __iter__(self) -> Iterator[str]:
        return iter(MODELS)

    def __len__(self) -> int:
        return len(MODELS)


PRESETS = _Presets()


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


# --------------------------------------------------------------------------------------------- the tape


class _Tape:
    """Live allocations by term; the peak of each phase with the live bytes of every term then."""

    def __init__(self, tokens: int) -> None:
        self.tokens = tokens
        self.live: dict[int, tuple[str, float, float]] = {}  # handle -> (term, per-token bytes, constant bytes)
        self.next = 0
        self.phase = ""
        self.peaks: dict[str, dict] = {}

    def alloc(self, term: str, per_token: float = 0.0, const: float = 0.0) -> int:
        if term not in TERMS:
            raise KeyError(term)
        self.next += 1
        self.live[self.next] = (term, per_token, const)
        self._check()
        return self.next

    def free(self, *handles: int | None) -> None:
        for h in handles:
            if h is not None:
                del self.live[h]

    def transient(self, term: str, per_token: float = 0.0, const: float = 0.0) -> None:
        """An allocation freed right after its use: it counts at this moment only."""
        self.free(self.alloc(term, per_token, const))

    def _check(self) -> None:
        total = sum(p * self.tokens + c for _, p, c in self.live.values())
        best = self.peaks.get(self.phase)
        if best is None or total > best["bytes"]:
            terms: dict[str, list[float]] = {}
            for term, p, c in self.live.values():
                acc = terms.setdefault(term, [0.0, 0.0])
                acc[0] += p * self.tokens
                acc[1] += c
            self.peaks[self.phase] = {"bytes": total, "terms": terms}


# ---------------------------------------------------------------------------------------------- the step


@dataclass
class MemoryEstimate:
    """Predicted peak of one training step on one rank.

    `phases`: per phase ('forward', 'loss', 'backward', 'optimizer'), its peak bytes and the bytes of
    every term then, split into the part that grows with the tokens and the constant part."""

    arch: str
    seq_len: int
    tokens_per_rank: int
    settings: StepSettings
    phases: dict[str, dict]
    layout_width: str = ""  # the widest layout row and where that width comes from

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=lambda p: self.phases[p]["bytes"])

    @property
    def peak_bytes(self) -> float:
        return self.phases[self.peak_phase]["bytes"]

    def terms(self, phase: str | None = None) -> dict[str, float]:
        """Bytes of every term at the peak of `phase` (default: the step's peak), largest first."""
        raw = self.phases[phase or self.peak_phase]["terms"]
        return dict(sorted(((t, sum(v)) for t, v in raw.items() if sum(v) > 0), key=lambda x: -x[1]))

    def token_scaled_bytes(self) -> float:
        """Bytes of the terms that grow with the tokens, at the step's peak."""
        return sum(v[0] for v in self.phases[self.peak_phase]["terms"].values())

    @property
    def dominant_term(self) -> str:
        return next(iter(self.terms()))

    def to_dict(self) -> dict:
        return {"model": self.arch, "seq_len": self.seq_len, "tokens_per_rank": self.tokens_per_rank,
                "layout_width": self.layout_width,
                "peak_gib": self.peak_bytes / GIB, "peak_phase": self.peak_phase, "dominant_term": self.dominant_term,
                "token_scaled_bytes_per_token": self.token_scaled_bytes() / self.tokens_per_rank,
                "phases": {p: {"gib": v["bytes"] / GIB,
                               "terms_gib": {t: sum(x) / GIB for t, x in v["terms"].items() if sum(x) > 0}}
                           for p, v in self.phases.items()}}


@dataclass(frozen=True)
class _AttentionGeometry:
    """Sizes of one attention call's layout and of the buffers built around it (bytes)."""

    layout_per_token: float  # the layout (and the kernels' split of it), per query token of the rank
    construction: tuple[float, float]  # layout construction at its peak, its output included: (per token, constant)
    estimation: tuple[float, float]  # the estimation's buffers at their peak: (per token, constant)
    workspace_forward: float  # the reference's chunk temporaries (0 on the Triton path)
    workspace_backward: float
    width: str  # where the layout's width comes from


def estimation_sets(cfg: SparseAttentionConfig, seq_len: int) -> tuple[int, int]:
    """(score sets, scored offsets) of one document of `seq_len` tokens: 1 and seq_len with 'last_queries';
    with 'causal_chunks' one set per chunk after the first, each scoring the keys before it
    (`estimate.estimation_segments`). One process holds every set's scores over the whole row ([heads, sets, S]),
    a ring rank the slash sums of every set's offsets: both grow as S^2 / estimation_chunk."""
    segments = estimate.estimation_segments([[(0, seq_len)]], cfg)[0]
    return max(1, len(segments)), max(seq_len, sum(sg.scored_end - sg.start for sg in segments))


def layout_construction_bytes(heads: int, query_blocks: int, block_width: int, columns: int,
                              block_size: int, sets: int = 1) -> tuple[float, float]:
    """The peak of `build.build_layout` over its inputs, its output included, for one row of `heads` heads and
    `query_blocks` query blocks that list up to `block_width` key blocks and read a window of up to `columns` kept
    columns (0: none) of `sets` sets of kept columns (causal chunks: `estimation_sets`): (bytes per token held for
    every head, bytes of one head chunk's temporaries). Counted on the code; tests/unit/test_layout_memory.py checks
    it against `AllocationRecorder`."""
    n, tokens = heads * query_blocks, query_blocks * block_size

    def chunk(width: int) -> int:  # elements of a [chunk heads, NQB, width] tensor (`head_chunks`)
        return max(1, min(heads, build.LAYOUT_ELEMENTS // max(1, query_blocks * width))) * query_blocks * width

    # First the document starts of `first_visible_keys` (three int64 and a bool per token); with columns, then
    # their listing (`_compact` over [heads, S]: int32 positions and their int64 copy per head and token, an int64
    # arange per token) beside the masked copy of the kept columns and the diagonals' counts (below).
    first = ((n * 44 + (13 * heads + 8) * tokens * sets) / tokens if columns else 25.0, 0.0)
    # Held through the block pass: block_idx and block_cnt (int32), four int64 per (head, query block) (the kept
    # diagonals' list, each block's base, rank and count); with columns also each window's start and span (int64),
    # the masked copy of the kept columns (bool [heads, S]) and every head's column mask (a bool per window slot).
    blocks_held = n * (4 * block_width + 4) + (n * (16 + columns) + heads * tokens * sets if columns else 0)
    # The block pass peaks at six int64 and a bool per element of its chunk (dense and diagonal key blocks, ranks,
    # the gathered diagonals, the two `where`s).
    phases = [first, ((blocks_held + 32 * n) / tokens, 49.0 * chunk(block_width))]
    # The column pass peaks in its first chunk's compaction: col_idx (int32, at most the window wide) and col_cnt,
    # `_compact`'s int32 window positions and their int64 copy (nothing of the block pass is left).
    if columns:
        phases.append(((blocks_held + n * (4 * columns + 4)) / tokens, 12.0 * chunk(columns)))
    return max(phases, key=lambda bytes_: bytes_[0] * tokens + bytes_[1])


def _attention_geometry(arch: Architecture, s: StepSettings, seq_len: int, tokens: int, heads: int,
                        ring: bool, window: int | None = None) -> _AttentionGeometry:
    """Layout widths from the pattern's budgets: a kept diagonal offset crosses at most two block
    diagonals, plus the local window's and the sink's; columns: the vertical budget and the sinks. `tokens` and
    `heads`: the queries and heads of one attention call on this rank; `ring`: the call runs a ring; `window`: the
    layer's sliding window (such a layer runs dense, unestimated, over the blocks of its window:
    `estimate.pattern_documents`, `build.dense_layout`)."""
    cfg, sh = s.pattern, arch.shape
    bs, hq = cfg.block_size, heads
    nqb_global, nqb = math.ceil(seq_len / bs), math.ceil(tokens / bs)
    sparse = _sparse(s, seq_len, window)
    if sparse:
        window = math.ceil((cfg.local_window - 1) / bs) + 1
        diagonals = cfg.budget.most_diagonal_blocks(bs)
        if diagonals is not None:
            width = min(nqb_global, diagonals + window + 1)
            basis = f"{width} blocks: the budget's bound"
        elif s.kept_curve is not None and s.kept_curve.measures(cfg):
            at = s.kept_curve.at(seq_len)
            width = min(nqb_global, math.ceil(at.width_share * nqb_global))
            basis = f"{width} blocks: {at.width_share:.3f} of the row ({at.basis}; {at.source})"
        else:
            width = nqb_global
            basis = f"{nqb_global} blocks: every block of the row (the bound" + (
                "; the kept-fraction curve measured another pattern)" if s.kept_curve is not None else ")")
        columns = cfg.budget.most_kept("columns")  # (None: a budget that bounds no columns, every key of the row)
        cols = seq_len if columns is None else columns + cfg.sink_tokens
    elif window is None:
        width, cols = nqb_global, 0  # every causal block, on one shared head
        hq, basis = 1, "dense: every causal block"
    else:  # the blocks a query block's window reaches (its first query's reaches furthest back), on one shared head
        width, cols = min(nqb_global, math.ceil((window - 1) / bs) + 1), 0
        hq, basis = 1, f"{width} blocks: a sliding window of {window} tokens"
    # block_idx and col_idx (int32) and two counts per (head, query block); the Triton path adds its
    # full/partial split (an int32 copy of block_idx, a flag per slot) and backward's per-key-block list
    per_block = hq * (4 * width + 4 * cols + 8) + (hq * width * 9 if s.device == "cuda" else 0)
    construction = (0.0, 0.0)
    # causal chunks: one set of scores and kept columns per chunk after the first (1 with 'last_queries')
    sets, offsets = estimation_sets(cfg, seq_len) if sparse else (1, seq_len)
    if sparse:
        # the build, over the whole sequence under the ring (every rank builds the one-process layout:
        # distributed/ring/estimation.py), counted per token of this call; beside it the kept flags of every
        # set (bool [2, heads, sets, S], over the whole sequence on every rank) that it is built from
        built = nqb_global if ring else nqb
        per_token, constant = layout_construction_bytes(hq, built, width, cols, bs, sets)
        construction = ((per_token * built * bs + 2 * hq * sets * seq_len) / tokens if ring else per_token
                        + 2 * hq * sets, constant)
    estimation = (0.0, 0.0)
    if sparse:
        # vertical and slash scores (int64 [heads, sets, S]) and the kept flags [2, heads, sets, S]; the
        # reference scoring's tiles: about seven fp32 [group heads, last_q, keys] tensors (scores, exp,
        # masks, int64 offsets) of at most scoring.SCORE_ELEMENTS elements, and their keys in fp64 [keys, D]
        group = sh.heads // sh.kv_heads
        tile = min(scoring.SCORE_ELEMENTS, group * cfg.scoring.last_q * tokens)
        tile_keys = min(tokens, scoring.SCORE_ELEMENTS // max(1, group * cfg.scoring.last_q, sh.head_dim))
        if ring:
            # distributed/ring/estimation.py: the verticals of this rank's keys of every set (int64), the slash sums
            # over every set's offsets (int64), which every rank holds twice while it packs their diagonals for the
            # reduce-scatter (the sums and the rank-major send buffer), and the kept flags of every set over the
            # whole sequence
            cp = seq_len / tokens
            per_token = (heads * (8 * offsets / cp + 2 * 8 * offsets + 2 * sets * seq_len)) / tokens
        else:
            per_token = heads * (8 * 2 + 2) * sets
        per_token += cfg.scoring.last_q
        estimation = (per_token, 7 * 4 * tile + 8 * sh.head_dim * tile_keys if s.device == "cpu" else 0.0)
    forward = backward = 0.0
    if s.device == "cpu":
        # Chunks of query blocks with at most reference.CHUNK_ELEMENTS score elements. Per element, a chunk's
        # temporaries in attention/reference.py hold at their peak ~13.2 bytes in forward (scores, exp, the
        # probabilities, masks) and ~17.6 in backward (probabilities, dp, ds), plus the gathered fp32 keys and
        # values (8 x head_dim / block_size, 8.8 in backward); the previous chunk's leave ~5.2 (7.8) bytes
        # per element alive until the loop rebinds them. Counted on the code, checked with a tensor-byte tracker.
        n_keys = width * bs + cols
        chunk = max(1, min(nqb, reference.CHUNK_ELEMENTS // (heads * bs * n_keys)))
        per_block_elements = heads * bs * n_keys
        full, last = chunk * per_block_elements, (nqb - (math.ceil(nqb / chunk) - 1) * chunk) * per_block_elements
        for new, old, kv_part in ((13.2, 5.2, 8.0), (17.6, 7.8, 8.8)):
            fresh = new + kv_part * sh.head_dim / bs
            if nqb <= chunk:
                peak = full * fresh
            elif math.ceil(nqb / chunk) == 2:
                peak = max(full * fresh, last * fresh + full * old)
            else:
                peak = full * (fresh + old)
            forward, backward = (peak, backward) if forward == 0.0 else (forward, peak)
    return _AttentionGeometry(per_block / bs, construction, estimation, forward, backward, basis)


def _sparse(s: StepSettings, seq_len: int, window: int | None) -> bool:
    """Whether a layer of sliding window `window` (None: global) estimates a sparse pattern at `seq_len`."""
    return s.pattern.pattern != "dense" and seq_len >= s.pattern.min_seq_len and window is None


def rank_tokens(seq_len: int, s: StepSettings) -> int:
    """The tokens of the busiest rank: the sequence itself on one rank, a block sharding's equal share of its
    blocks, or the document planner's token cap (`max_token_ratio`)."""
    if s.cp == 1:
        return seq_len
    bs = s.pattern.block_size
    blocks = math.ceil(seq_len / bs)
    if s.max_token_ratio is None:
        return math.ceil(blocks / s.cp) * bs
    return min(blocks, math.floor(s.max_token_ratio * blocks / s.cp) + 1) * bs


class _Step:
    """One step of one rank replayed on a tape (see `predict_step_memory`)."""

    def __init__(self, arch: Architecture, seq_len: int, s: StepSettings) -> None:
        if s.savers.tiled and not arch.token_tiles:
            raise ValueError(f"{arch.name}: token tiles run the MLPs and RMSNorms of the Llama-like families "
                             f"({', '.join(LEAN_LOSS_FAMILIES)}) only, and training refuses them for this model: "
                             "predict it without them (MemorySavers(tiled=False); --token-tiling-min-length 0), as it "
                             "trains (--sparse_token_tiling_min_length 0).")
        self.arch, self.s = arch, s
        sh = arch.shape
        # LoRA: the adapters' parameters, of one layer and of the model (0: full fine-tuning); checked on the shape
        self.lora = s.lora
        if s.lora is not None:
            if not arch.lora_layers:
                raise ValueError(f"{arch.name}: {LORA_LAYERS}; predict this model without LoRA (full fine-tuning, an "
                                 "upper bound), or one of those.")
        self.layer_adapters = s.lora.layer_params(sh) if s.lora else 0
        self.t = rank_tokens(seq_len, s)
        self.tape = _Tape(self.t)
        self.a = DTYPE_BYTES[s.dtype]
        self.w = s.weight_bytes
        self.autocast = s.autocast
        # FSDP2 under mixed precision: accelerate's policy (param_dtype, reduce_dtype: the compute dtype) gathers each
        # layer's weights in it and leaves their unsharded gradients in it, so autocast has no weight to cast;
        # otherwise autocast keeps its lower-precision copies of the fp32 weights that train
        self.fsdp_mixed = self.autocast and s.fsdp > 1
        self.weight_casts = self.autocast and not self.fsdp_mixed
        self.h, self.i = sh.hidden, sh.intermediate
        self.q, self.kv = sh.heads * sh.head_dim, sh.kv_heads * sh.head_dim
        # The residual stream's bytes (the embedding's output, the residual sums, the norms' outputs, their
        # gradients): under autocast without FSDP2 (whose mixed precision gathers 16-bit weights) the fp32 embedding
        # makes it fp32, and an RMSNorm returns its input's dtype; the matrix products cast their input to `dtype`,
        # each its own copy (autocast caches the weights' casts only)
        self.r = 4 if self.weight_casts else self.a
        # RMSNorm computes in fp32: a copy of its input unless that is fp32 already
        self.norm32 = 4 * self.h if self.r < 4 else 0
        self.offload = s.savers.offload_layer_inputs and s.gradient_checkpointing and s.device == "cuda"
        # each layer's sliding window (None: global); the tape's current layer's is `window`
        self.windows = sh.windows or (None,) * sh.layers
        self.layer, self.window = 0, self.windows[0]  # the tape's current layer and its window
        self.seq_len = seq_len
        # The attention call: with head groups (the CP mode's head_size) on the head split, over head_size pieces
        # of the sequence for the busiest rank's share of the heads (K/V expanded or replicated as `HeadSplit`
        # gives them); without, on this rank's shard for every head. Its per-token sizes below are per token of
        # this rank's shard (`t`), the unit of the tape.
        self.ring = s.cp // s.head_size > 1
        split = HeadSplit(sh.heads, sh.kv_heads, s.head_size)
        heads, kv_heads = split.busiest, split.busiest_kv
        self.q_att, self.kv_att = heads * sh.head_dim * s.head_size, kv_heads * sh.head_dim * s.head_size
        self.hq_att = heads * s.head_size
        self.geometries = {}
        for window in set(self.windows):
            g = _attention_geometry(arch, s, seq_len, self.t * s.head_size, heads, self.ring, window)
            self.geometries[window] = replace(g, layout_per_token=g.layout_per_token * s.head_size,
                                              construction=(g.construction[0] * s.head_size, g.construction[1]),
                                              estimation=(g.estimation[0] * s.head_size, g.estimation[1]))

    @property
    def fp32_stream(self) -> bool:
        """Whether the residual stream is wider than the compute dtype: autocast over fp32 weights (`r` > `a`),
        where the layers are measured under autocast and each matrix product saves its own cast of its input."""
        return self.r > self.a

    @property
    def geometry(self) -> _AttentionGeometry:
        """The attention of the tape's current layer (`window`)."""
        return self.geometries[self.window]

    @property
    def measured(self) -> LayerSaved | None:
        """What the current layer saves besides its attention core and MLP, measured (`Architecture.layer_saved`);
        None where it is the Llama layer's counted here: a preset's, and with token tiles (which replace the
        Llama-like families' modules only). With LoRA, measured with the layers' weights frozen (Qwen3's q/k norms
        keep their fp32 inputs, which a Llama layer has not), and under autocast with an fp32 residual stream, where
        the measurement can be (`_SavedByDtype.measure`)."""
        if self.arch.layer_saved is None or self.s.savers.tiled:
            return None
        measure = getattr(self.arch.layer_saved, "measure", None)
        if measure is not None:
            return measure(self.s.dtype, frozen=self.lora is not None, autocast=self.fp32_stream)[self.layer]
        if self.lora is not None or self.fp32_stream:  # (a given mapping holds the plain regime's only)
            return None
        return self.arch.layer_saved[self.s.dtype][self.layer]

    @property
    def beyond_tiles(self) -> LayerSaved | None:
        """With token tiles, what the current layer saves beyond the Llama layer whose norms and MLP the tiles
        replace (`_SavedByDtype.beyond_llama`: Qwen3's q/k norms), measured; None without tiles or a measurement."""
        beyond = getattr(self.arch.layer_saved, "beyond_llama", None)
        if not self.s.savers.tiled or beyond is None:
            return None
        layers = beyond(self.s.dtype, frozen=self.lora is not None, autocast=self.fp32_stream)
        return None if layers is None else layers[self.layer]

    @property
    def sparse(self) -> bool:
        """Whether the current layer estimates a sparse pattern."""
        return _sparse(self.s, self.seq_len, self.window)

    @property
    def width(self) -> str:
        """Where the widest layout's width comes from: a global layer's, else a sliding window's."""
        return self.geometries[None if None in self.geometries else max(self.geometries)].width

    def tiles(self, per_token: float) -> tuple[float, float]:
        """(per-token, constant) bytes of a transient of the tiled modules: one tile's with tiles on."""
        if self.s.savers.tiled:
            return 0.0, per_token * min(self.s.savers.tile_tokens, self.t)
        return per_token, 0.0

    # -- modules: each returns (saved handles, output handle); without grad nothing is saved

    def norm(self, grad: bool) -> tuple[list[int], int]:
        """An RMSNorm of a [T, H] input. Stock: fp32 copy x32, pow / x * rsqrt temporaries of its size,
        the normalized input in the input dtype; saved: x32, rsqrt, the normalized input. Tiled: a
        tile's temporaries; saved: nothing of its own (its input, which the caller holds)."""
        tape, r, h = self.tape, self.r, self.h
        if self.s.savers.tiled:
            tape.transient("RMSNorm fp32 copies", *self.tiles(2 * self.norm32 + 2 * r * h))
            return [], tape.alloc("attention tensors", per_token=r * h)
        x32 = tape.alloc("RMSNorm fp32 copies", per_token=self.norm32)
        tape.transient("RMSNorm fp32 copies", per_token=4 * h)  # pow(2); then x * rsqrt
        normed = tape.alloc("RMSNorm fp32 copies", per_token=r * h + (4 if grad else 0))  # (+ rsqrt)
        out = tape.alloc("attention tensors", per_token=r * h)
        if grad and self.lora is not None:  # a frozen weight's product keeps no normalized input: rsqrt alone
            tape.free(normed)
            return [x32, tape.alloc("RMSNorm fp32 copies", per_token=4)], out
        if grad:
            return [x32, normed], out
        tape.free(x32, normed)
        return [], out

    def attention(self, grad: bool) -> list[int]:
        """Projections, RoPE, estimation and layout, the attention call; returns what the layer's
        backward reads (with grad) or nothing (the caller frees the output)."""
        tape, a = self.tape, self.a
        qh, kh, vh = (tape.alloc("attention tensors", per_token=a * x) for x in (self.q, self.kv, self.kv))
        rotated = []
        for x, xh in ((self.q, qh), (self.kv, kh)):  # x * cos, rotate_half(x), * sin, the sum
            c = tape.alloc("attention tensors", per_token=a * x)
            r = tape.alloc("attention tensors", per_token=a * x)
            rs = tape.alloc("attention tensors", per_token=a * x)
            tape.free(r)
            rotated.append(tape.alloc("attention tensors", per_token=a * x))
            tape.free(c, rs, xh)
        qkv = [vh, *rotated]
        if self.s.head_size > 1:
            # the all-to-all to the head split (distributed/heads/all_to_all.py): q, k, v packed into one buffer,
            # received as every piece of this rank's heads (which attention saves in the local ones' place)
            tape.transient("CP all-to-all buffers", per_token=a * (self.q + 2 * self.kv))
            qkv = [tape.alloc("attention tensors", per_token=a * x) for x in (self.kv_att, self.q_att, self.kv_att)]
            tape.free(vh, *rotated)
        q, kv, hq = self.q_att, self.kv_att, self.hq_att
        if self.sparse:
            tape.transient("estimation buffers", *self.geometry.estimation)
            tape.transient("attention layouts", *self.geometry.construction)
        layout = tape.alloc("attention layouts", per_token=self.geometry.layout_per_token)
        if self.ring:
            # the ring (distributed/ring/attention.py): fp32 out and lse merged over the steps, this rank's K/V
            # stacked, the next step's K/V received while this one computes; then out in the input dtype and
            # its [B, S, H, D] copy for o_proj
            ring = [tape.alloc("CP ring buffers", per_token=x) for x in (4 * q, 4 * hq, 2 * kv * a)]
            tape.transient("CP ring buffers", per_token=2 * 2 * kv * a)
            if self.s.device == "cpu":
                tape.transient("attention workspace", const=self.geometry.workspace_forward)
            out = tape.alloc("attention tensors", per_token=a * q)
            lse = tape.alloc("attention tensors", per_token=4 * hq)
            tape.free(*ring)
            kept = [out, lse, tape.alloc("attention tensors", per_token=a * q)]
        elif self.s.device == "cpu":
            q32, o32 = (tape.alloc("attention tensors", per_token=4 * q) for _ in range(2))
            lse = tape.alloc("attention tensors", per_token=4 * hq)
            tape.transient("attention workspace", const=self.geometry.workspace_forward)
            out = tape.alloc("attention tensors", per_token=a * q)
            tape.free(o32, q32)
            kept = [out, lse, tape.alloc("attention tensors", per_token=a * q)]  # + the [B, S, H, D] copy
        else:  # the kernels write out in [B, S, H, D] memory: o_proj reads it as is
            kept = [tape.alloc("attention tensors", per_token=a * q), tape.alloc("attention tensors", per_token=4 * hq)]
        if self.s.head_size > 1:  # the output's all-to-all back to the sequence split: o_proj's own copy
            tape.transient("CP all-to-all buffers", per_token=a * q)
            kept.append(tape.alloc("attention tensors", per_token=a * self.q))
        saved = [*qkv, layout, *kept]
        if grad:
            return saved
        tape.free(*saved)
        return []

    @property
    def moe(self) -> MoeBytes:
        """What the layers' mixture of experts allocates, measured on its block (`_SavedByDtype.moe`), under autocast
        with an fp32 residual stream where the step has one."""
        measure = getattr(self.arch.layer_saved, "moe", None)
        if measure is None:
            raise ValueError(f"{self.arch.name}: a mixture of experts is predicted from its block measured on the "
                             "meta device: build the architecture from its config (Architecture.from_config).")
        return measure(self.s.dtype, autocast=self.fp32_stream)

    def moe_peak(self, part: str) -> tuple[float, float]:
        """(per token, constant) bytes of `MoeBytes` part `part` at this rank's tokens."""
        peak = MoeBytes.at(getattr(self.moe, part), self.t)
        return peak.per_token, peak.const

    def mlp(self, grad: bool) -> list[int]:
        """Gated (SwiGLU): gate, act(gate), up, act * up ([T, I] each); two matrices: fc1's output, act of it. Saved:
        what the activation keeps (SiLU, GELU: its input; a ReLU's input is freed: its output) and its output, and a
        gated MLP's up and product. Tiled: one tile's. A mixture of experts: its block's peak (its output included),
        and with grad what it saves, measured (`moe`)."""
        tape, a, i, sh = self.tape, self.a, self.i, self.arch.shape
        if sh.experts:
            tape.transient("MLP intermediate", *self.moe_peak("recomputed" if grad else "forward"))
            return [tape.alloc("MLP intermediate", *self.moe_peak("saved"))] if grad else []
        if self.s.savers.tiled:
            tape.transient("MLP intermediate", *self.tiles(sh.mlp_saved * a * i))
            return []
        g = tape.alloc("MLP intermediate", per_token=a * i * (sh.activation_saved - 1 if grad else 1))
        act = tape.alloc("MLP intermediate", per_token=a * i)
        if not grad:
            tape.free(g)
        if not sh.gated:
            if grad:
                return [g, act]
            tape.transient("attention tensors", per_token=a * self.h)  # fc2's output
            tape.free(act)
            return []
        up, m = tape.alloc("MLP intermediate", per_token=a * i), tape.alloc("MLP intermediate", per_token=a * i)
        if grad:
            return [g, act, up, m]
        tape.free(act, up)
        tape.transient("attention tensors", per_token=a * self.h)  # down_proj's output
        tape.free(m)
        return []

    def cast_for_products(self, output: int, products: int, saved: list[int]) -> int | None:
        """A norm's `output` read by `products` matrix products: under an fp32 residual stream (`fp32_stream`) each
        casts it to the compute dtype, its own copy, which it saves (appended to `saved`; LoRA's frozen products
        save none) and the output is freed (None returned); otherwise they save the output itself (returned)."""
        if not self.fp32_stream:
            return output
        if self.lora is not None:  # (the adapters' own copies: `lora_saved`)
            self.tape.transient("attention tensors", per_token=self.a * self.h)
            return output
        saved += [self.tape.alloc("attention tensors", per_token=self.a * self.h) for _ in range(products)]
        self.tape.free(output)
        return None

    def lora_saved(self, source: str) -> tuple[list[int], bool]:
        """What the LoRA adapters on the matrices reading `source` (`lora.MODULE_INPUTS`) save for backward (see
        `simulator.lora`): per adapter its input's copy (fp32 adapters of a 16-bit model: fp32; under autocast: the
        compute dtype), a dropout mask (a bool per element on CUDA, fp32 noise on a CPU) and lora_A's rank-wide output;
        and whether `source` itself stays saved instead of a copy (fp32 adapters of an fp32 model, without dropout,
        save the input as it is, once for the targets sharing it). Token tiles run the MLP's adapters inside their
        tiles: nothing beyond the tile's input."""
        targets = [name for name in self.lora.targets if MODULE_INPUTS[name] == source]
        if not targets or (self.s.savers.tiled and source in ("norm2", "mlp")):
            return [], False
        a, rank, dropout = self.a, self.lora.rank, self.lora.dropout
        c = a if self.autocast else 4
        shared = not self.autocast and a == 4 and not dropout
        mask = (1 if self.s.device == "cuda" else 4) if dropout else 0
        handles = []
        for name in targets:
            features = module_features(self.arch.shape, name)[0]
            handles.append(self.tape.alloc("recomputed layer: saved activations",
                                           per_token=rank * c + features * ((0 if shared else c) + mask)))
        return handles, shared

    # -- a decoder layer

    def layer_forward(self) -> int:
        """Without autograd (inside the checkpoint); returns the output."""
        tape, a, r, h = self.tape, self.a, self.r, self.h
        _, n1 = self.norm(False)
        self.attention(False)
        tape.free(n1)
        o = tape.alloc("attention tensors", per_token=a * h)
        h1 = tape.alloc("attention tensors", per_token=r * h)  # the residual sum
        tape.free(o)
        _, n2 = self.norm(False)
        self.mlp(False)
        tape.free(n2)
        out = tape.alloc("saved layer inputs", per_token=0 if self.offload else r * h)
        tape.free(h1)
        return out

    def layer_recompute(self) -> dict[str, list[int]]:
        """With autograd, as the checkpoint replays it in backward: it stops once the last saved tensor
        (down_proj's input; tiled: the MLP's input) exists. Returns the saved tensors by the module whose
        backward frees them."""
        return self.layer_with_grad()[0]

    def layer_with_grad(self, layer_input: int | None = None) -> tuple[dict[str, list[int]], int | None]:
        """The layer's forward with autograd: `layer_recompute`'s (`layer_input` None), or without checkpointing the
        whole forward of the layer whose input is `layer_input`, which it frees once the residual sum is made unless
        its first norm saves it (an fp32 or tiled norm, as the second keeps the residual sum). Returns the saved
        tensors by module and the layer's output (None when recomputed)."""
        tape, a, r, h = self.tape, self.a, self.r, self.h
        saves_input = self.s.savers.tiled or not self.norm32  # the tiled norm saves its input; so does an fp32 one
        saved1, n1 = self.norm(True)
        n1 = self.cast_for_products(n1, 3, saved1)  # (q, k, v)
        att = self.attention(True)
        lora, lora_mlp = [], []  # (LoRA: frozen matrices save no input; the adapters save theirs)
        if self.lora is not None:
            lora, keep = self.lora_saved("norm1")
            if not keep:
                tape.free(n1)
                n1 = None
        o = tape.alloc("attention tensors", per_token=a * h)
        if self.lora is not None:
            adapters, keep = self.lora_saved("attention")
            lora += adapters
            if not keep and (self.s.device == "cpu" or self.s.cp > 1):  # o_proj's own copy of its input
                tape.free(att[-1])
                att[-1] = None
        h1 = tape.alloc("attention tensors", per_token=r * h)
        tape.free(o)
        if layer_input is not None and not saves_input:
            tape.free(layer_input)
        saved2, n2 = self.norm(True)
        if not self.s.savers.tiled:  # (a tile's products cast the tile)
            n2 = self.cast_for_products(n2, self.arch.shape.mlp_matrices - 1, saved2)  # (gate and up, or fc1)
        mlp = self.mlp(True)
        if self.lora is not None:
            lora_mlp, keep = self.lora_saved("norm2")
            if not keep and not self.s.savers.tiled:  # (a tile's MLP saves its input)
                tape.free(n2)
                n2 = None
            adapters, keep = self.lora_saved("mlp")
            lora_mlp += adapters
            if not keep and mlp and self.arch.shape.gated:  # down_proj's input (act * up)
                tape.free(mlp[-1])
                mlp[-1] = None
        out = None
        if layer_input is None:
            tape.transient("attention tensors", per_token=a * h)  # the MLP's output, made before the stop
        else:  # the MLP's output and the residual sum, the next layer's input
            mlp_out = tape.alloc("attention tensors", per_token=a * h)
            out = tape.alloc("layers' saved activations", per_token=r * h)
            tape.free(mlp_out)
        if saves_input:
            saved2.append(h1)
        else:
            tape.free(h1)
        groups = {"norm1": [x for x in (*saved1, n1) if x is not None], "attention": att,
                  "norm2": [x for x in (*saved2, n2) if x is not None], "mlp": mlp, "lora": lora, "lora_mlp": lora_mlp}
        measured = self.measured
        if measured is not None:  # the layer's own tensors in place of the Llama layer's, freed as theirs
            # (LoRA: a normalized input left by `lora_saved` is the fp32 adapters' saved input, not the layer's)
            shared = {n1, n2} - {None} if self.lora is not None else set()
            tape.free(*(x for x in (*groups["norm1"], *groups["norm2"]) if x not in shared))
            if self.s.head_size == 1:  # (with head groups attention saves the all-to-all's copies instead)
                tape.free(*att[:3])
                att[:3] = [tape.alloc("attention tensors", measured.inputs.per_token, measured.inputs.const)]
            groups["norm1"], groups["norm2"] = ([tape.alloc("recomputed layer: saved activations", part.per_token,
                                                            part.const)] for part in (measured.before, measured.after))
            groups["norm1"] += [x for x in (n1,) if x in shared]
            groups["norm2"] += [x for x in (n2,) if x in shared]
        beyond = self.beyond_tiles
        if beyond is not None:  # (saved by the layer's own modules that the tiles leave as they are)
            groups["norm1"].append(tape.alloc("recomputed layer: saved activations",
                                              beyond.before.per_token + beyond.inputs.per_token,
                                              beyond.before.const + beyond.inputs.const))
            groups["norm2"].append(tape.alloc("recomputed layer: saved activations", beyond.after.per_token,
                                              beyond.after.const))
        if layer_input is not None and saves_input:  # (after the measured tensors, which leave the input out)
            groups["norm1"].append(layer_input)
        saved_term = "recomputed layer: saved activations" if layer_input is None else "layers' saved activations"
        for name in ("norm1", "attention", "norm2", "lora", "lora_mlp"):  # one term (the MLP's and layout apart)
            for handle in filter(None, groups[name]):
                term, p, c = tape.live[handle]
                if term != "attention layouts":
                    tape.live[handle] = (saved_term, p, c)
        return groups, out

    def layer_backward(self, saved: dict[str, list[int]], grad_out: int) -> int:
        """Backward through a recomputed layer, freeing each module's saved tensors after its backward;
        returns the gradient of the layer's input."""
        tape, a, r, h, i = self.tape, self.a, self.r, self.h, self.i
        q, kv, hq, sh = self.q_att, self.kv_att, self.hq_att, self.arch.shape
        if self.s.savers.tiled:  # fp32 weight-gradient sums; per tile: the recomputed intermediates and theirs
            trained = sh.mlp_matrices * h * i if self.lora is None else sum(  # (LoRA: the MLP's adapters' only)
                self.lora.rank * sum(module_features(sh, name)) for name in self.lora.targets
                if MODULE_INPUTS[name] in ("norm2", "mlp"))
            sums = tape.alloc("MLP intermediate", const=trained * 4)
            g_n2 = tape.alloc("hidden-state gradients", per_token=r * h)
            tape.transient("MLP intermediate", *self.tiles((sh.mlp_saved + sh.mlp_matrices) * a * i))
            tape.free(sums)
        elif sh.experts:  # its block's backward at its peak, what it saved freed as it goes (measured: `moe`)
            tape.free(*saved["mlp"])
            tape.transient("MLP intermediate", *self.moe_peak("backward"))
            g_n2 = tape.alloc("hidden-state gradients", per_token=r * h)
        elif not sh.gated:
            p, act = saved["mlp"]
            g_act = tape.alloc("MLP intermediate", per_token=a * i)  # fc2 backward
            tape.free(act)
            g_p = tape.alloc("MLP intermediate", per_token=a * i)  # the activation's backward
            tape.free(g_act, p)
            g_n2 = tape.alloc("hidden-state gradients", per_token=r * h)  # fc1 backward
            tape.free(g_p)
        else:
            g, act, up, m = saved["mlp"]
            gm = tape.alloc("MLP intermediate", per_token=a * i)  # down_proj backward
            tape.free(m)
            ga, gu = tape.alloc("MLP intermediate", per_token=a * i), tape.alloc("MLP intermediate", per_token=a * i)
            tape.free(act, up, gm)
            gg = tape.alloc("MLP intermediate", per_token=a * i)  # SiLU backward
            tape.free(ga, g)
            g_n2 = tape.alloc("hidden-state gradients", per_token=r * h)  # up_proj and gate_proj backward
            tape.transient("hidden-state gradients", per_token=r * h)
            tape.free(gu, gg)
        # post-attention RMSNorm backward: a few fp32 temporaries of the input's size (tiled: one tile's)
        tape.transient("RMSNorm fp32 copies", *self.tiles(3 * 4 * h))
        tape.free(*saved["norm2"], *saved.get("lora_mlp", ()))
        g_h1 = tape.alloc("hidden-state gradients", per_token=r * h)  # + the residual's gradient (grad_out)
        tape.free(g_n2, grad_out)
        g_att = tape.alloc("hidden-state gradients", per_token=a * self.q)  # o_proj backward
        if self.s.device == "cpu" or self.s.cp > 1:  # o_proj's input was its own copy of the output
            tape.free(saved["attention"].pop())
        if self.s.head_size > 1:  # the output's gradient to the head split
            tape.transient("CP all-to-all buffers", per_token=a * self.q)
            head_g = tape.alloc("hidden-state gradients", per_token=a * q)
            tape.free(g_att)
            g_att = head_g
        if self.ring:
            # the ring's backward: fp32 dq, this rank's fp32 dK/dV, a travelling source's accumulator and the one
            # received, K/V stacked and in flight, one step's fp32 dq/dk/dv; then the gradients cast back
            held = [tape.alloc("CP ring buffers", per_token=x) for x in (4 * q, 8 * kv, 2 * 8 * kv, 3 * 2 * kv * a)]
            tape.transient("CP ring buffers", per_token=8 * kv + 4 * q + 8 * kv)
            if self.s.device == "cpu":
                tape.transient("attention workspace", const=self.geometry.workspace_backward)
            grads = [tape.alloc("hidden-state gradients", per_token=a * x) for x in (q, kv, kv)]
            tape.free(*held)
        elif self.s.device == "cpu":
            held = [tape.alloc("attention tensors", per_token=4 * x) for x in (q, q, q, 2 * hq)]  # q, out, dout, lse
            held += [tape.alloc("attention tensors", per_token=4 * x) for x in (q, kv, kv)]  # fp32 dq, dk, dv
            tape.transient("attention workspace", const=self.geometry.workspace_backward)
            tape.free(*held[:4])
            grads = [tape.alloc("hidden-state gradients", per_token=a * x) for x in (q, kv, kv)]
            tape.free(*held[4:])
        else:  # dq, dk, dv in the input dtype; the columns' fp32 dk/dv; delta and the base-2 lse
            grads = [tape.alloc("hidden-state gradients", per_token=a * x) for x in (q, kv, kv)]
            tape.transient("attention tensors", per_token=4 * 2 * kv + 4 * 2 * hq)
        tape.free(g_att, *saved["attention"])
        if self.s.head_size > 1:  # dq, dk, dv back to the sequence split, into this rank's pieces of every head
            tape.transient("CP all-to-all buffers", per_token=a * (q + 2 * kv))
            local = [tape.alloc("hidden-state gradients", per_token=a * x) for x in (self.q, self.kv, self.kv)]
            tape.free(*grads)
            grads = local
        tape.transient("hidden-state gradients", per_token=2 * a * self.q)  # RoPE backward: grad * cos, grad * sin
        g_n1 = tape.alloc("hidden-state gradients", per_token=r * h)  # q/k/v projections backward
        tape.free(*grads)
        tape.transient("RMSNorm fp32 copies", *self.tiles(3 * 4 * h))
        tape.free(*saved["norm1"], *saved.get("lora", ()))
        out = tape.alloc("hidden-state gradients", per_token=r * h)
        tape.free(g_n1, g_h1)
        return out

    def run(self) -> dict:
        arch, s, tape, a, r, w, h = self.arch, self.s, self.tape, self.a, self.r, self.w, self.h
        n_layers = arch.shape.layers
        tape.phase = "forward"
        # (LoRA: the frozen base's weights in their dtype, the adapters' in fp32; only the adapters train)
        adapters, lora = self.layer_adapters, self.lora is not None
        tape.alloc("weights", const=(arch.params * w + n_layers * adapters * 4) / s.fsdp)
        tape.alloc("optimizer state", const=_optimizer_state(arch, s))
        if s.fsdp > 1:  # FSDP2: the current layer's gathered weights and the next one's (prefetch)
            gathered = (arch.layer_params + adapters) * a if self.fsdp_mixed else arch.layer_params * w + adapters * 4
            tape.alloc("FSDP gathered layers", const=2 * gathered)
        tape.alloc("inputs and token metadata", per_token=8 * 4 + 12)  # ids, labels, positions, shifted labels
        tape.alloc("rotary cos/sin", per_token=2 * arch.shape.head_dim * r)  # (in the hidden states' dtype)
        checkpointing = s.gradient_checkpointing
        # (autocast caches the copies of the weights that train: a frozen weight is cast at each use, its copy freed)
        casts = tape.alloc("autocast weight copies", const=n_layers * (adapters if lora else arch.cast_params) * a) \
            if self.weight_casts and checkpointing else None
        # without checkpointing: each layer's autocast copies (which its saved tensors hold) and saved tensors, kept
        # to its backward; its input (`floor`) freed by its forward or saved with its first norm's tensors
        layer_casts: list[int | None] = []
        layer_saved: list[dict[str, list[int]]] = []
        floor = [tape.alloc("saved layer inputs", per_token=0 if self.offload else r * h)]  # the embedding
        for layer, window in enumerate(self.windows):
            self.layer, self.window = layer, window
            if checkpointing:
                floor.append(self.layer_forward())
                continue
            layer_casts.append(tape.alloc("autocast weight copies", const=(arch.cast_params + adapters) * a)
                               if self.weight_casts else None)
            saved, out = self.layer_with_grad(floor[-1])
            floor[-1] = None
            layer_saved.append(saved)
            floor.append(out)
        last = floor.pop()  # the final norm's input (saved by the norm, not by a checkpoint)
        tape.live[last] = ("hidden-state gradients", r * h, 0.0)

        tape.phase = "loss"
        final_saved, hidden = self.norm(True)
        loss_saved = _loss(tape, arch, s, self.t, a, w, r)
        if arch.lean_loss:  # (its gradients are computed: the LM head's input is not kept)
            tape.free(hidden)

        tape.phase = "backward"
        if casts is not None:
            tape.free(casts)
        if arch.lean_loss:
            tape.alloc("gradients", const=0 if lora else arch.embedding_params * w / s.fsdp)  # the LM head's
            tape.free(*loss_saved[1:])
            grad_hidden = loss_saved[0]
        else:
            grad_hidden = _stock_loss_backward(tape, arch, s, loss_saved, hidden, a, w, r)
        tape.transient("RMSNorm fp32 copies", *self.tiles(3 * 4 * h))
        tape.free(*final_saved, last)
        grad = tape.alloc("hidden-state gradients", per_token=r * h)
        tape.free(grad_hidden)
        for layer in reversed(range(n_layers)):
            self.layer, self.window = layer, self.windows[layer]
            if checkpointing:
                copied = tape.alloc("saved layer inputs", per_token=r * h) if self.offload else None
                cast = tape.alloc("autocast weight copies", const=(arch.cast_params + adapters) * a) \
                    if self.weight_casts else None  # (the frozen matrices' products save them)
                saved = self.layer_recompute()
            else:
                copied, cast, saved = None, layer_casts[layer], layer_saved[layer]
            trained = adapters * 4 if lora else arch.layer_params * w  # (the layer's gradients' bytes)
            tape.alloc("gradients", const=trained / s.fsdp)
            # FSDP2: the layer's unsharded gradient, freed once reduce-scattered into the shard as its backward ends
            unsharded = tape.alloc("gradients", const=(adapters if lora else arch.layer_params) * a if self.fsdp_mixed
                                   else trained) if s.fsdp > 1 else None
            grad = self.layer_backward(saved, grad)
            tape.free(copied, cast, floor[layer], unsharded)
        # the gradients of the parameters outside the layers and the embedding (position embeddings, the final norm,
        # an LM head's bias), and the embedding's dense gradient
        if not lora:  # (LoRA: frozen)
            tape.alloc("gradients", const=arch.model_extra * w / s.fsdp)
            tape.transient("gradients", const=arch.embedding_params * 4)
        tape.free(grad)

        tape.phase = "optimizer"
        tape.transient("optimizer step temporaries", const=_optimizer_temporaries(arch, s))
        return tape.peaks


def predict_step_memory(arch: Architecture, seq_len: int, settings: StepSettings | None = None) -> MemoryEstimate:
    """Predicted peak bytes of one training step of `arch` on one sequence of `seq_len` tokens.

    Args:
        arch: the model (`PRESETS[name]` or `Architecture.from_config`).
        seq_len: tokens of the sequence (split over `settings.cp` ranks).
        settings: how the step runs (default: bf16, AdamW, gradient checkpointing, one rank, Triton).

    Returns:
        A `MemoryEstimate` of one rank: each phase's peak and the terms live then.
    """
    if seq_len < 1:
        raise ValueError(f"seq_len={seq_len} must be >= 1.")
    s = settings or StepSettings()
    step = _Step(arch, seq_len, s)
    return MemoryEstimate(arch.name, seq_len, step.t, s, step.run(), step.width)


def _loss(tape: _Tape, arch: Architecture, s: StepSettings, t: int, a: int, w: int, r: int) -> list[int]:
    """The loss's forward; returns the tensors kept for backward. The lean loss computes the gradients (the hidden
    states' first, in their dtype: `r` bytes); the stock forward (`arch.lean_loss` off) the LM head's logits in the
    compute dtype, their fp32 copy and its log-softmax, which it keeps (the caller drops the model's output, and with
    it the logits)."""
    sh = arch.shape
    h, v = sh.hidden, sh.vocab
    vh = v * h
    if not arch.lean_loss:  # (fp32 logits are their own fp32 copy)
        logits = tape.alloc("loss: logits", per_token=a * v)
        copy = tape.alloc("loss: logits", per_token=4 * v * (a < 4))
        kept = tape.alloc("loss: logits", per_token=4 * v)
        tape.free(logits, copy)
        return [kept]
    trained = s.lora is None  # (LoRA freezes the LM head: both losses skip its weight's gradient)
    if s.loss_backend == "liger":
        # liger-kernel 0.8.5: chunks of next_pow2(ceil(T / ceil(V / H))) tokens; logits in the input dtype;
        # weight-gradient accumulator in the weight's dtype; the input's gradient; an fp32 loss per token
        chunk = min(t, 2 ** math.ceil(math.log2(max(1, math.ceil(t / math.ceil(v / h))))))
        grad_h = tape.alloc("loss: hidden gradient", per_token=r * h + 4)
        grad_w = tape.alloc("loss: weight-gradient buffers", const=vh * w * trained)
        tape.transient("loss: logits chunk", const=chunk * v * a)
        return [grad_h, grad_w]
    chunk = max(1, min(t, (256 * 2**20) // (4 * v)))  # hf_sparse_cp.loss.chunked.default_chunk_size
    grad_h = tape.alloc("loss: hidden gradient", per_token=r * h + 9)  # + the valid flags and targets
    acc = tape.alloc("loss: weight-gradient buffers", const=vh * 4 * trained)
    # A chunk: fp32 logits, and logsumexp's (logits - max); the previous chunk's gradient (in the input dtype;
    # fp32: the previous logits buffer) is released only when the loop rebinds it, after this chunk's logits.
    previous = chunk * v * min(a, 4) if t > chunk else 0
    tape.transient("loss: logits chunk", const=previous + chunk * v * 8)
    if a < 4:  # the chunk's gradient in the input dtype, and grad.T @ h before its fp32 add (on a CPU the add
        # first copies it to fp32)
        tape.transient("loss: logits chunk",
                       const=chunk * v * a + vh * (a + (4 if s.device == "cpu" else 0)) * trained)
    kept = tape.alloc("loss: weight-gradient buffers", const=vh * w * trained)  # saved for backward in the weight dtype
    tape.free(acc)
    return [grad_h, kept]


def _stock_loss_backward(tape: _Tape, arch: Architecture, s: StepSettings, saved: list[int], hidden: int, a: int,
                         w: int, r: int) -> int:
    """The stock loss's backward: the NLL's and the log-softmax's fp32 [tokens, vocab] gradients beside the saved
    log-softmax, the logits' gradient in the input dtype, then the LM head's (its weight's gradient, the hidden
    states'); returns the hidden states' gradient."""
    v = arch.shape.vocab
    nll, log_softmax = tape.alloc("loss: logits", per_token=4 * v), tape.alloc("loss: logits", per_token=4 * v)
    tape.free(nll, *saved)
    logits = tape.alloc("loss: logits", per_token=a * v * (a < 4))  # (fp32 logits: the log-softmax's gradient)
    tape.free(log_softmax)
    tape.alloc("gradients", const=0 if s.lora else arch.embedding_params * w / s.fsdp)
    grad = tape.alloc("hidden-state gradients", per_token=r * arch.shape.hidden)
    tape.free(logits, hidden)
    return grad


def _optimizer_state(arch: Architecture, s: StepSettings) -> float:
    w = s.weight_bytes
    if s.optimizer == "none":
        return 0.0
    if s.lora is not None:  # the adapters' fp32 moments (SMET with LoRA is refused)
        return 2 * s.lora.params(arch.shape) * 4 / s.fsdp
    if s.optimizer == "adamw":
        return 2 * arch.params * w / s.fsdp
    # SMET: compact moments of the active blocks of every layer matrix, an index and a step counter per block
    dense = arch.params - arch.shape.layers * arch.shape.layer_params
    sparse = arch.shape.layers * arch.shape.layer_params
    blocks = sparse / s.smet_block_size * s.smet_density
    return (2 * dense * w + 2 * s.smet_density * sparse * w + blocks * (4 + 4)) / s.fsdp


def _optimizer_temporaries(arch: Architecture, s: StepSettings) -> float:
    """AdamW's step: foreach keeps a temporary of every parameter (the denominators); the per-tensor step
    two temporaries of the largest parameter (the embedding unless `largest_param`)."""
    w = s.weight_bytes
    if s.optimizer == "none":
        return 0.0
    if s.lora is not None:  # (the adapters': fp32)
        return (s.lora.params(arch.shape) if s.device == "cuda" else 2 * s.lora.largest_param(arch.shape)) * 4 / s.fsdp
    if s.device == "cuda":
        return arch.params * w / s.fsdp
    return 2 * max(arch.embedding_params, arch.largest_param) * w / s.fsdp


# ------------------------------------------------------------------------------------------- questions


def recomputed_layer_bytes(arch: Architecture, seq_len: int, settings: StepSettings | None = None,
                           layer: int = 0) -> dict[str, float]:
    """Bytes decoder layer `layer` saves for its backward when the checkpoint recomputes it, by the module
    whose backward reads them ('norm1', 'attention', 'norm2', 'mlp'); the attention's layout (saved with
    them: `SparseLayout.take_apart`) apart, as 'layout'. The layer's input is not counted (the checkpoint
    holds it: 'saved layer inputs')."""
    step = _Step(arch, seq_len, settings or StepSettings())
    step.layer, step.window = layer, step.windows[layer]
    groups = step.layer_recompute()
    out = {name: 0.0 for name in groups}
    out["layout"] = 0.0
    for name, handles in groups.items():
        for handle in filter(None, handles):
            term, p, c = step.tape.live[handle]
            out["layout" if term == "attention layouts" else name] += p * step.t + c
    return out


# The longest length `longest_fitting_length` tries (2^40 tokens): far beyond any GPU's, so that an answer at it says
# "at least" (the command line says so) rather than standing for a length that did not fit.
SEARCH_LIMIT = 1 << 40


def longest_fitting_length(arch: Architecture, budget_bytes: float,
                           settings: StepSettings | Callable[[int], StepSettings] | None = None,
                           granularity: int = 1024, limit: int = SEARCH_LIMIT) -> int:
    """The longest sequence, a multiple of `granularity` x CP size and at most `limit`, whose predicted peak stays
    within `budget_bytes` on each rank; 0 when not even the first multiple fits.

    Args:
        arch: the model. budget_bytes: usable bytes of one device.
        settings: the step's settings, or a function of the sequence length giving them (settings
            that change with the length: token tiles from a threshold on, pattern budgets).
        granularity: tokens per rank the answer is a multiple of. limit: longest length tried (an answer
            within one multiple of it may be bounded by it rather than by the memory).

    The peak grows with the length (for settings that change with it, the answer is the longest
    length before the first that does not fit, found by doubling then bisecting)."""
    settings_for = settings if callable(settings) else (lambda _, s=settings or StepSettings(): s)
    cp = settings_for(granularity).cp
    unit = granularity * cp

    def fits(n: int) -> bool:
        return predict_step_memory(arch, n * unit, settings_for(n * unit)).peak_bytes <= budget_bytes

    if not fits(1):
        return 0
    lo, hi = 1, 2
    while hi * unit <= limit and fits(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, limit // unit + 1)  # the doubling may stop at the limit: bisect up to it, not below it
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo * unit


def with_savers(settings: StepSettings, **changes) -> StepSettings:
    """`settings` with some `MemorySavers` fields changed."""
    return replace(settings, savers=replace(settings.savers, **changes))
