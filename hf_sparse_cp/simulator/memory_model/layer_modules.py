"""A decoder layer's modules replayed on the tape (`ModuleReplay`): the sizes of one rank's step, and each module's
allocations (RMSNorm, attention, the MLP or mixture of experts, the products' casts, the LoRA adapters)."""

from __future__ import annotations

from dataclasses import replace

from ...config.model_fields import LEAN_LOSS_FAMILIES
from ...distributed.heads.split import HeadSplit
from ..lora import LORA_LAYERS, MODULE_INPUTS, module_features
from .architecture import Architecture
from .attention_geometry import AttentionGeometry, attention_geometry, estimates_sparse
from .measurements import LayerSaved, MoeBytes
from .settings import DTYPE_BYTES, StepSettings, rank_tokens
from .tape import Tape


class ModuleReplay:
    """One rank's step on a tape: its sizes (tokens, bytes per element, the attention call's split and
    geometry), the current layer, and the allocations of each of a decoder layer's modules."""

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
        self.tape = Tape(self.t)
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
            g = attention_geometry(arch, s, seq_len, self.t * s.head_size, heads, self.ring, window)
            self.geometries[window] = replace(g, layout_per_token=g.layout_per_token * s.head_size,
                                              construction=(g.construction[0] * s.head_size, g.construction[1]),
                                              estimation=(g.estimation[0] * s.head_size, g.estimation[1]))

    @property
    def fp32_stream(self) -> bool:
        """Whether the residual stream is wider than the compute dtype: autocast over fp32 weights (`r` > `a`),
        where the layers are measured under autocast and each matrix product saves its own cast of its input."""
        return self.r > self.a

    @property
    def geometry(self) -> AttentionGeometry:
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
        return estimates_sparse(self.s, self.seq_len, self.window)

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
