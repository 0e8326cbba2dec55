"""A whole decoder layer replayed on the tape (`LayerReplay`): its forward inside the checkpoint, its recomputation
with autograd (or its forward with autograd, without checkpointing) and its backward; what a recomputed layer saves
(`recomputed_layer_bytes`)."""

from __future__ import annotations

from ..lora import MODULE_INPUTS, module_features
from .architecture import Architecture
from .layer_modules import ModuleReplay
from .settings import StepSettings


class LayerReplay(ModuleReplay):
    """A decoder layer of one rank's step on a tape: `ModuleReplay`'s modules in the layer's order."""

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


def recomputed_layer_bytes(arch: Architecture, seq_len: int, settings: StepSettings | None = None,
                           layer: int = 0) -> dict[str, float]:
    """Bytes decoder layer `layer` saves for its backward when the checkpoint recomputes it, by the module
    whose backward reads them ('norm1', 'attention', 'norm2', 'mlp'); the attention's layout (saved with
    them: `SparseLayout.take_apart`) apart, as 'layout'. The layer's input is not counted (the checkpoint
    holds it: 'saved layer inputs')."""
    step = LayerReplay(arch, seq_len, settings or StepSettings())
    step.layer, step.window = layer, step.windows[layer]
    groups = step.layer_recompute()
    out = {name: 0.0 for name in groups}
    out["layout"] = 0.0
    for name, handles in groups.items():
        for handle in filter(None, handles):
            term, p, c = step.tape.live[handle]
            out["layout" if term == "attention layouts" else name] += p * step.t + c
    return out
