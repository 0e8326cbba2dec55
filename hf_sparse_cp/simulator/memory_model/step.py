"""One training step of one rank replayed on a tape (`predict_step_memory`): the weights and optimizer state, the
forward through every layer, the loss, the backward and the optimizer step."""

from __future__ import annotations

from .architecture import Architecture
from .layer import LayerReplay
from .loss import loss_forward, stock_loss_backward
from .optimizer import optimizer_state_bytes, optimizer_temporary_bytes
from .settings import StepSettings
from .tape import MemoryEstimate


class _Step(LayerReplay):
    """One step of one rank replayed on a tape (see `predict_step_memory`)."""

    def run(self) -> dict:
        """Replays the step on the tape; returns each phase's peak with the live bytes of every term (`Tape.peaks`)."""
        arch, s, tape, a, r, w, h = self.arch, self.s, self.tape, self.a, self.r, self.w, self.h
        n_layers = arch.shape.layers
        tape.phase = "forward"
        # (LoRA: the frozen base's weights in their dtype, the adapters' in fp32; only the adapters train)
        adapters, lora = self.layer_adapters, self.lora is not None
        tape.alloc("weights", const=(arch.params * w + n_layers * adapters * 4) / s.fsdp)
        tape.alloc("optimizer state", const=optimizer_state_bytes(arch, s))
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
        loss_saved = loss_forward(tape, arch, s, self.t, a, w, r)
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
            grad_hidden = stock_loss_backward(tape, arch, s, loss_saved, hidden, a, w, r)
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
        tape.transient("optimizer step temporaries", const=optimizer_temporary_bytes(arch, s))
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
