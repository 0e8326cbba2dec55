"""What a decoder's layers save for backward (`layer_saved`) and what its mixture of experts' block allocates
(`moe_bytes`), measured on the model transformers builds from its config on the meta device: autograd's hooks and the
storage recorder the allocation tests read too (`memory.recorder`) count the bytes, with stand-ins for the attention
call, autocast and the experts' grouped matmul, at a few lengths, taken apart into bytes per token and a constant."""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from ...config.model_fields import decoder_layers
from ...memory.recorder import StorageRecorder, storage_id
from ..shapes import MOE_FAMILIES

# The lengths a decoder layer's saved tensors are measured at (on the meta device, where nothing is computed): the
# bytes per token and the constant bytes from the first two, the third checks that the bytes are affine in the tokens.
SAVED_LENGTHS = (64, 128, 192)


@dataclass(frozen=True)
class SavedBytes:
    """Bytes saved for backward: `per_token` x the tokens + `const`."""

    per_token: float
    const: float = 0.0


@dataclass(frozen=True)
class LayerSaved:
    """What one decoder layer's forward saves for its backward, counted by autograd's hooks (`layer_saved`), apart
    from what the attention call creates (its output, log-sum-exp and layout: sized from our kernels) and what the
    MLP creates (sized from its activation: `shapes.activation_saved`): `before` the attention call (the first norm's
    tensors, the projections' input, rotary's and q/k norms' tensors), the attention's `inputs` (q, k, v as the layer
    hands them, which our attention saves as given: the whole output of a fused projection that v is a view of),
    saved by nothing else, and `after` it (the next norms' tensors, the MLP's input)."""

    before: SavedBytes
    inputs: SavedBytes
    after: SavedBytes


class _GroupedMatmulStandIn(torch.autograd.Function):
    """torch's grouped matmul (transformers' experts: `integrations.moe`) in a measuring forward, in any dtype (its meta
    kernel takes bf16 alone): an output of [rows of a, columns of b] in a's dtype; saved, as its autograd formula saves
    them, both operands and the offsets."""

    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(a, b, offs)
        return a.new_empty(a.shape[0], b.shape[-1])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # (as its autograd formula: each operand's gradient, of its size)
        a, b, _ = ctx.saved_tensors
        return grad.new_empty(a.shape), grad.new_empty(b.shape), None


class _AttentionStandIn(TorchFunctionMode):
    """SDPA's stand-in in a measuring forward: returns an output of the query's shape in [B, S, H, D] memory (as the
    sparse_cp kernels write it, so that transformers' transpose back is a view of it), saves nothing, and records
    each call's (layer, q, k, v, output) under `layer`, the decoder layer running. Torch's grouped matmul (a mixture
    of experts') runs through `_GroupedMatmulStandIn`."""

    def __init__(self) -> None:
        super().__init__()
        self.layer: int | None = None
        self.calls: list[tuple[int | None, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch._grouped_mm:  # (a mixture of experts' grouped matmul: on the meta device, bf16 only)
            return _GroupedMatmulStandIn.apply(*args[:2], (kwargs or {}).get("offs", args[2:3] or None))
        if func is not torch.nn.functional.scaled_dot_product_attention:
            return func(*args, **(kwargs or {}))
        q, k, v = args[:3]
        b, heads, tokens, _ = q.shape
        out = q.new_empty(b, tokens, heads, v.shape[-1]).transpose(1, 2).requires_grad_(q.requires_grad)
        self.calls.append((self.layer, q, k, v, out))
        return out


class _AutocastStandIn(TorchFunctionMode):
    """Autocast's casts in a measuring forward on the meta device (where torch's autocast casts nothing): the matrix
    products take their floating inputs in `dtype`, each cast its own copy (which the product saves), except a
    parameter's, cast once and kept (autocast's weight cache: `weight_casts`, not an activation); the normalizations
    and softmaxes of autocast's fp32 list take theirs in fp32. `sources` maps each activation cast's storage to its
    input's, so that a module's own casts of its input are told from what it creates."""

    LOWER = (torch.nn.functional.linear, torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.mm,
             torch.bmm, torch.addmm, torch.baddbmm, torch.Tensor.addmm,
             torch.nn.functional.scaled_dot_product_attention)  # (our attention takes q, k, v in autocast's dtype)
    FP32 = (torch.nn.functional.layer_norm, torch.nn.functional.group_norm, torch.softmax, torch.log_softmax,
            torch.nn.functional.softmax, torch.nn.functional.log_softmax, torch.Tensor.softmax)

    def __init__(self, dtype: torch.dtype, hold: bool = True) -> None:
        super().__init__()
        self.dtype, self.hold = dtype, hold
        self.weight_casts: dict[int, torch.Tensor] = {}
        self.weight_storages: set[int] = set()
        self.sources: dict[int, int] = {}
        self.held: list[torch.Tensor] = []  # (casts alive until the end: a freed storage's identity is reused)

    def _cast(self, value: Any, dtype: torch.dtype) -> Any:
        if not isinstance(value, torch.Tensor) or not value.is_floating_point() or value.dtype == dtype:
            return value
        if isinstance(value, torch.nn.Parameter):
            if id(value) not in self.weight_casts:
                self.weight_casts[id(value)] = value.to(dtype)
                self.weight_storages.add(storage_id(self.weight_casts[id(value)]))
            return self.weight_casts[id(value)]
        cast = value.to(dtype)
        self.sources[storage_id(cast)] = storage_id(value)
        if self.hold:  # (the recorder numbers storages instead: a cast goes when its last tensor does)
            self.held.append(cast)
        return cast

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        dtype = self.dtype if func in self.LOWER else torch.float32 if func in self.FP32 else None
        if dtype is not None:
            args = tuple(self._cast(value, dtype) for value in args)
            kwargs = {name: self._cast(value, dtype) for name, value in kwargs.items()}
        return func(*args, **kwargs)


def _grouped_heads(*_: Any, **__: Any) -> bool:
    return True


@contextlib.contextmanager
def _sdpa_keeps_key_value_heads() -> Iterator[None]:
    """transformers' SDPA call takes grouped K/V heads as they are (`enable_gqa`) rather than repeating them, as our
    attention takes them: its `use_gqa_in_sdpa` (looked up at each call; its signature and its conditions differ
    between releases, an environment variable only in some) answers yes inside the block, and is restored after (set
    here, not through integration.patching: the simulator sits below the integration layer)."""
    from transformers.integrations import sdpa_attention

    before = sdpa_attention.use_gqa_in_sdpa
    sdpa_attention.use_gqa_in_sdpa = _grouped_heads
    try:
        yield
    finally:
        sdpa_attention.use_gqa_in_sdpa = before


def _tensors(value: Any) -> list[torch.Tensor]:
    """The tensors in a forward's argument (a tensor, or a tuple or list of them: rotary's cos and sin)."""
    if isinstance(value, torch.Tensor):
        return [value]
    return [t for item in value for t in _tensors(item)] if isinstance(value, (tuple, list)) else []


def _saved_at(model: torch.nn.Module, layers: list[torch.nn.Module], tokens: int, kv_heads: int, where: str,
              autocast: torch.dtype | None = None) -> list[tuple[int, int, int]]:
    """Per decoder layer, (before, inputs, after) bytes of `LayerSaved` in one forward of `model` (on the meta device,
    with grad) of one sequence of `tokens`, attention through `_AttentionStandIn`; with autocast's casts to
    `autocast` (`_AutocastStandIn`) where given."""
    known = {storage_id(t) for t in (*model.parameters(), *model.buffers())}
    saved: list[dict[int, tuple[int, bool]]] = [{} for _ in layers]  # storage -> (bytes, after the attention call)
    mlp_saved: list[set[int]] = [set() for _ in layers]  # saved inside the MLP: its input, and what it creates
    mlp_inputs: list[set[int]] = [set() for _ in layers]
    state = {"mlp": False}
    stand_in = _AttentionStandIn()
    casts = _AutocastStandIn(autocast) if autocast is not None else None
    held: list[torch.Tensor] = []  # (the arguments, alive until the end: a freed storage's identity is reused)

    def enter(index: int, args, kwargs) -> None:
        held.extend(_tensors([*args, *kwargs.values()]))
        known.update(storage_id(t) for t in held)
        stand_in.layer = index

    def leave(*_) -> None:
        stand_in.layer = None

    def enter_mlp(index: int, args, kwargs) -> None:
        inputs = _tensors([*args, *kwargs.values()])
        held.extend(inputs)
        mlp_inputs[index].update(storage_id(t) for t in inputs)
        state["mlp"] = True

    def pack(t: torch.Tensor) -> torch.Tensor:
        index = stand_in.layer
        if index is not None and storage_id(t) not in known and (casts is None or
                                                                  storage_id(t) not in casts.weight_storages):
            after = any(call[0] == index for call in stand_in.calls)
            saved[index].setdefault(storage_id(t), (t.untyped_storage().nbytes(), after))
            if state["mlp"]:
                mlp_saved[index].add(storage_id(t))
        return t

    handles = []
    for index, layer in enumerate(layers):
        handles += [layer.register_forward_pre_hook(lambda m, a, k, i=index: enter(i, a, k), with_kwargs=True),
                    layer.register_forward_hook(leave),
                    layer.mlp.register_forward_pre_hook(lambda m, a, k, i=index: enter_mlp(i, a, k),
                                                        with_kwargs=True),
                    layer.mlp.register_forward_hook(lambda *_: state.update(mlp=False))]
    kwargs = {"use_cache": False} if "use_cache" in inspect.signature(model.forward).parameters else {}
    try:
        # (a 4D mask: transformers' mask functions return it as given, reading no token's value on the meta device)
        # (autocast's casts entered last: they run first, and the attention's stand-in records the cast q, k, v)
        with stand_in, casts or contextlib.nullcontext(), _sdpa_keeps_key_value_heads(), \
                torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(input_ids=torch.zeros(1, tokens, dtype=torch.long, device="meta"),
                  attention_mask=torch.ones(1, 1, tokens, tokens, dtype=torch.bool, device="meta"), **kwargs)
    except Exception as error:  # (any architecture's failure on the meta device: reported, never guessed around)
        raise ValueError(f"{where}: the predictions measure what a decoder layer saves for backward in a forward "
                         f"of the model on the meta device, which failed ({type(error).__name__}: {error}); give a "
                         "decoder that runs there, or a preset (--model).") from error
    finally:
        for handle in handles:
            handle.remove()
    out = []
    for index, layer in enumerate(layers):
        calls = [call for call in stand_in.calls if call[0] == index]
        heads = [call[2].shape[1] for call in calls]
        if heads != [kv_heads]:
            raise ValueError(f"{where}: decoder layer {index} ({type(layer).__name__}) made {len(calls)} SDPA calls "
                             f"(key/value heads {heads}); the predictions measure what a layer saves around one "
                             f"attention call of the config's {kv_heads} key/value heads; give a decoder with one, or "
                             "a preset (--model).")
        _, q, k, v, output = calls[0]
        # (the MLP's products' casts of its input are the input's copies, not what it creates)
        inputs_cast = {c for c, source in casts.sources.items() if source in mlp_inputs[index]} if casts else set()
        created = (mlp_saved[index] - mlp_inputs[index] - inputs_cast) | {storage_id(output)}
        parts = [sum(n for s, (n, late) in saved[index].items() if late == after and s not in created)
                 for after in (False, True)]
        inputs = {storage_id(t): t.untyped_storage().nbytes() for t in (q, k, v)
                  if storage_id(t) not in known and storage_id(t) not in saved[index]}
        out.append((parts[0], sum(inputs.values()), parts[1]))
    return out


def layer_saved(model: torch.nn.Module, dtype: torch.dtype, kv_heads: int, where: str, frozen: bool = False,
                autocast: bool = False) -> tuple[LayerSaved, ...]:
    """`LayerSaved` of each decoder layer of `model` (built on the meta device) with activations in `dtype`, counted by
    autograd's saved-tensor hooks in forwards with grad at `SAVED_LENGTHS` tokens, the attention through SDPA's
    stand-in (`_AttentionStandIn`), without dropout. The model is moved to `dtype`, set to eval and its attention to
    SDPA. `frozen`: the decoder layers' weights without grad (LoRA's frozen base: a product keeps no input for its
    weight's gradient, a norm no normalized input), the layers' input still with it. `autocast`: the model in fp32
    with autocast's casts to `dtype` (`_AutocastStandIn`), as the Trainer's mixed precision runs an fp32 model: its
    embedding's output, and so the residual stream, fp32.

    Raises:
        ValueError: the model does not run on the meta device, a layer makes other than one attention call of
            `kv_heads` key/value heads, or a layer's bytes are not affine in the tokens; naming the fix, after `where`.
    """
    try:
        model.set_attn_implementation("sdpa")
    except (ValueError, ImportError) as error:
        raise ValueError(f"{where}: the predictions measure what a decoder layer saves around its attention call "
                         f"through SDPA, which {type(model).__name__} does not take ({error}); give a decoder that "
                         "does, or a preset (--model).") from error
    # (dropout's masks are not counted: on the meta device they are not a CPU's or a GPU's)
    model.to(torch.float32 if autocast else dtype).eval()
    layers = decoder_layers(model)
    trained = [p for layer in layers for p in layer.parameters() if p.requires_grad] if frozen else []
    for p in trained:
        p.requires_grad_(False)
    try:
        counts = [_saved_at(model, layers, tokens, kv_heads, where, dtype if autocast else None)
                  for tokens in SAVED_LENGTHS]
    finally:
        for p in trained:
            p.requires_grad_(True)
    return tuple(LayerSaved(*_affine(by_length, SAVED_LENGTHS, f"{where}: decoder layer {index}"))
                 for index, by_length in enumerate(zip(*counts)))


@dataclass(frozen=True)
class MoeBytes:
    """What a mixture of experts' block (a decoder layer's `mlp`, `MOE_FAMILIES`) allocates, measured on the block
    itself (`moe_bytes`): the peak of its forward without grad (`forward`, its output included), the peak of its
    forward with grad (`recomputed`: what it saves and its output included), what it saves for backward (`saved`:
    the router's probabilities, the tokens' gathered copies, the experts' intermediates; its input, which the layer
    holds, apart), and the peak of its backward (`backward`: what is left of the saved tensors and the gradients made,
    its input's included; not the output's gradient, nor the weights', the model's "gradients")."""

    forward: tuple[SavedBytes, ...]  # (each a candidate for the peak: the peak at a length is the largest then)
    recomputed: tuple[SavedBytes, ...]
    saved: tuple[SavedBytes]
    backward: tuple[SavedBytes, ...]

    @staticmethod
    def at(candidates: tuple[SavedBytes, ...], tokens: int) -> SavedBytes:
        """The candidate of the most bytes at `tokens` tokens."""
        return max(candidates, key=lambda c: c.per_token * tokens + c.const)


class _BlockRecorder(StorageRecorder):
    """The package's storage recorder (its ordered log of creations and frees, its numbered storages) noting in
    `copies` the numbers of the copies made of `sources` (autocast's casts of them)."""

    def __init__(self, *sources: torch.Tensor) -> None:
        super().__init__()
        self.sources, self.copies = {storage_id(t) for t in sources}, set()

    def _created(self, number: int, t: torch.Tensor, func, args: tuple) -> None:
        if func is torch.ops.aten._to_copy.default and storage_id(args[0]) in self.sources:
            self.copies.add(number)

    def curve(self, start: int, end: int, left_out: set[int] = frozenset()) -> list[int]:
        """The recorder's curve, the copies of the sources not counted either."""
        return super().curve(start, end, left_out | self.copies)


def moe_at(block: torch.nn.Module, tokens: int, dtype: torch.dtype, autocast: torch.dtype | None = None
           ) -> tuple[list[int], ...]:
    """The bytes alive after each op of the parts of `MoeBytes` (saved: one number) of `block` run on `tokens` tokens
    in `dtype` where its weights are (on the meta device: grouped matmuls through `_GroupedMatmulStandIn`, autocast's
    casts to `autocast` through `_AutocastStandIn`), its weights' gradients, autocast's copies of the block's input
    (which the layer saves: `LayerSaved.after`) and of its weights (the model's "autocast weight copies") left out."""
    device = next(block.parameters()).device
    x = torch.randn(1, tokens, block.experts.hidden_dim, dtype=dtype, device=device, requires_grad=True)
    live = _BlockRecorder(x, *block.parameters())
    meta = device.type == "meta"

    def casts() -> contextlib.AbstractContextManager:  # (each forward its own: a weight's cast without grad kept
        # for a forward with grad would save no input for its gradient)
        return _AutocastStandIn(autocast, hold=False) if autocast is not None and meta else contextlib.nullcontext()

    with _AttentionStandIn() if meta else contextlib.nullcontext(), live:
        with torch.no_grad(), casts():
            block(x)
        forward = live.curve(0, len(live.events))
        start = len(live.events)
        with casts():
            y = block(x)
        grad = torch.randn_like(y)
        left_out = {live.number(grad)}
        recomputed = live.curve(start, len(live.events), left_out)
        saved = recomputed[-1] - y.untyped_storage().nbytes()
        left_out.add(live.number(y))
        middle = len(live.events)
        y.backward(grad)
        left_out |= {live.number(p.grad) for p in block.parameters() if p.grad is not None}
    for p in block.parameters():
        p.grad = None
    return forward, recomputed, [saved], live.curve(middle, len(live.events), left_out)


def moe_bytes(model: torch.nn.Module, dtype: torch.dtype, where: str, autocast: bool = False) -> MoeBytes:
    """`MoeBytes` of the mixture of experts in `model`'s decoder layers (every layer's alike: `shapes.moe_form`), built
    on the meta device, with activations in `dtype`: its first layer's block run alone at `SAVED_LENGTHS` tokens,
    forward without grad, forward with grad and backward, the bytes its ops create followed (`memory.recorder`) and
    taken apart into a number per token and a constant. The model is moved to `dtype`; `autocast`: fp32 weights with
    autocast's casts to `dtype`, as `layer_saved` (torch's grouped matmul of the experts is not autocast's: it runs in
    fp32).

    Raises:
        ValueError: the block does not run on the meta device, or its bytes are not affine in the tokens, naming the
            fix after `where`.
    """
    model.to(torch.float32 if autocast else dtype).eval()
    block = decoder_layers(model)[0].mlp
    try:
        counts = [moe_at(block, tokens, torch.float32 if autocast else dtype, dtype if autocast else None)
                  for tokens in SAVED_LENGTHS]
    except Exception as error:  # (any block's failure on the meta device: reported, never guessed around)
        raise ValueError(f"{where}: the predictions measure a mixture of experts' block on the meta device, where "
                         f"{type(block).__name__} failed ({type(error).__name__}: {error}); give a config of "
                         f"{', '.join(MOE_FAMILIES)}, or a dense model's.") from error
    what = f"{where}: the mixture of experts' block ({type(block).__name__})"
    parts = []
    for curves in zip(*counts):  # (the same ops at every length: the bytes alive after each op, by length)
        if len({len(curve) for curve in curves}) != 1:
            raise ValueError(f"{what} runs other ops at {', '.join(map(str, SAVED_LENGTHS))} tokens, whose peak the "
                             f"predictions cannot scale; give a config of {', '.join(MOE_FAMILIES)}, or a dense "
                             "model's.")
        alive = _affine(list(curves), SAVED_LENGTHS, what)
        # (the peak over the ops at any length: the ops that no other op holds more bytes than at every length)
        parts.append(tuple(sorted({a for a in alive if not any(
            b != a and b.per_token >= a.per_token and b.const >= a.const for b in alive)},
            key=lambda a: (a.per_token, a.const))))
    return MoeBytes(*parts)


def _affine(counts: list[tuple[int, ...]], lengths: tuple[int, int, int], what: str) -> list[SavedBytes]:
    """`SavedBytes` of each part of `counts` (bytes of the parts at each of three `lengths`).

    Raises:
        ValueError: a part is not a number per token and a constant, naming `what`.
    """
    (t1, t2, t3), parts = lengths, []
    for b1, b2, b3 in zip(*counts):
        per_token = (b2 - b1) / (t2 - t1)
        const = b1 - per_token * t1
        if (b3 - b2) * (t2 - t1) != (b2 - b1) * (t3 - t2) or const < 0:
            raise ValueError(f"{what} saves {b1:,}, {b2:,} and {b3:,} bytes for backward at {t1}, {t2} and {t3} "
                             "tokens, not a number per token and a constant, which the predictions scale; give a "
                             "decoder whose layers save per token, or a preset (--model).")
        parts.append(SavedBytes(per_token, const))
    return parts
