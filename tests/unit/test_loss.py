"""The memory-lean causal-LM loss equals transformers' stock loss, in value and gradients."""

import sys
import types
import warnings

import pytest
import torch
import torch.nn.functional as F
import transformers
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM, modeling_utils
from transformers.loss.loss_utils import ForCausalLMLoss

import hf_sparse_cp
from hf_sparse_cp.integration import lean_loss as lean_loss_module
from hf_sparse_cp.integration.architectures import lean_loss_classes, lean_loss_model_types
from hf_sparse_cp.integration.lean_loss import disable_lean_loss, enable_lean_loss
from hf_sparse_cp.loss import (
    BACKEND_ENV,
    chunked_linear_cross_entropy,
    dispatch,
    linear_cross_entropy,
    resolve_backend,
)
from hf_sparse_cp.testing.tiny_models import tiny_config

VOCAB = 97
HIDDEN = 24


def _rel_err(x, ref):
    x, ref = x.double(), ref.double()
    return ((x - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def _shift(labels):
    return F.pad(labels, (0, 1), value=-100)[..., 1:]


def _problem(dtype, batch=3, seq=45, bias=False, seed=0):
    """Random hidden states, head and labels with ignored tokens, including a fully ignored stretch."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(batch, seq, HIDDEN, generator=g).to(dtype)
    weight = (torch.randn(VOCAB, HIDDEN, generator=g) / HIDDEN**0.5).to(dtype)
    b = (torch.randn(VOCAB, generator=g) * 0.1).to(dtype) if bias else None
    labels = torch.randint(0, VOCAB, (batch, seq), generator=g)
    labels[0, 3:30] = -100  # with chunk sizes below 27 this empties whole chunks
    labels[2, ::4] = -100
    return hidden, weight, b, labels


def _stock(hidden, weight, bias, labels, **loss_kwargs):
    """Loss and (hidden, weight, bias) grads through transformers' ForCausalLMLoss on full logits."""
    leaves = [t.detach().clone().requires_grad_() for t in (hidden, weight) + ((bias,) if bias is not None else ())]
    logits = F.linear(leaves[0], leaves[1], leaves[2] if bias is not None else None)
    loss = ForCausalLMLoss(logits, labels, VOCAB, **loss_kwargs)
    loss.backward()
    return loss.detach(), [t.grad for t in leaves]


def _chunked(hidden, weight, bias, labels, *, num_items_in_batch=None, chunk_size=None):
    leaves = [t.detach().clone().requires_grad_() for t in (hidden, weight) + ((bias,) if bias is not None else ())]
    h = leaves[0]
    loss = chunked_linear_cross_entropy(
        h.reshape(-1, h.shape[-1]), leaves[1], _shift(labels).reshape(-1),
        bias=leaves[2] if bias is not None else None, num_items_in_batch=num_items_in_batch, chunk_size=chunk_size,
    )
    loss.backward()
    return loss.detach(), [t.grad for t in leaves]


NUM_ITEMS = {"mean": None, "int": 50, "tensor": torch.tensor(77)}


@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("num_items", list(NUM_ITEMS), ids=[f"norm_{k}" for k in NUM_ITEMS])
@pytest.mark.parametrize("chunk_size", [7, 16, 1000, None], ids=lambda c: f"chunk_{c}")
def test_chunked_matches_stock_fp32(chunk_size, num_items, bias):
    hidden, weight, b, labels = _problem(torch.float32, bias=bias)
    kwargs = {"num_items_in_batch": NUM_ITEMS[num_items]}
    loss, grads = _chunked(hidden, weight, b, labels, chunk_size=chunk_size, **kwargs)
    ref_loss, ref_grads = _stock(hidden, weight, b, labels, **kwargs)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
    for g, r in zip(grads, ref_grads):
        assert g.dtype == r.dtype
        assert _rel_err(g, r) < 1e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("chunk_size", [7, 64], ids=lambda c: f"chunk_{c}")
def test_chunked_low_precision_is_as_accurate_as_stock(dtype, chunk_size):
    hidden, weight, b, labels = _problem(dtype, bias=True)
    loss, grads = _chunked(hidden, weight, b, labels, chunk_size=chunk_size)
    stock_loss, stock_grads = _stock(hidden, weight, b, labels)
    exact_loss, exact_grads = _stock(hidden.double(), weight.double(), b.double(), labels)
    eps = torch.finfo(torch.float32).eps
    assert abs(loss.item() - exact_loss.item()) <= 2 * abs(stock_loss.item() - exact_loss.item()) + 4 * eps
    for g, s, e in zip(grads, stock_grads, exact_grads):
        assert g.dtype == dtype
        assert _rel_err(g, e) <= 2 * _rel_err(s, e) + 4 * eps


def test_fp16_gradients_under_a_loss_scale_are_as_accurate_as_stock():
    """fp16 training (--fp16) scales the loss by its GradScaler's factor (2^16 at first) so that small gradients stay
    within fp16's range: the stock loss's gradients of its fp32 logits reach the fp16 head scaled. The chunked loss
    computed its gradients in forward, divided by the 2048 targets, and rounded them to fp16 there, where probabilities
    times 1 / 2048 fall below fp16's smallest step (6e-8): the input and weight gradients had 11 times stock's error
    (4.1e-3 and 3.8e-3 against 3.6e-4; 545 weight gradients exactly 0), and more the more tokens. Computed and held at a
    power-of-two scale instead, and rescaled in backward, they have stock's (the weight's rounded once per chunk)."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2048, 64, generator=g)
    weight = torch.randn(4000, 64, generator=g) * 0.02
    bias = torch.randn(4000, generator=g) * 0.1
    labels = torch.randint(0, 4000, (2048,), generator=g)
    loss_scale = 2.0**16

    def grads(loss_fn, amp: bool) -> list[torch.Tensor]:
        leaves = [t.clone().double().requires_grad_() if not amp else t.clone().requires_grad_()
                  for t in (hidden, weight, bias)]
        with torch.autocast("cpu", dtype=torch.float16, enabled=amp):
            loss = loss_fn(*leaves)
        (loss * loss_scale).backward()
        return [t.grad / loss_scale for t in leaves]

    def stock(h, w, b):
        return F.cross_entropy(F.linear(h, w, b).float(), labels)

    def chunked(h, w, b):
        return chunked_linear_cross_entropy(h, w, labels, bias=b, chunk_size=300)

    exact = grads(stock, amp=False)
    for ours, theirs, ref in zip(grads(chunked, amp=True), grads(stock, amp=True), exact, strict=True):
        assert _rel_err(ours, ref) <= 1.5 * _rel_err(theirs, ref)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
def test_no_tokens_give_a_nan_loss_and_zero_gradients(dtype):
    """A call without tokens (N = 0) computes no chunk: the loss is 0 / 0 as stock's mean, the gradients zero (fp16's
    scale of its gradients is read off the tokens, which there are none of)."""
    hidden = torch.zeros(0, HIDDEN, dtype=dtype, requires_grad=True)
    weight = torch.randn(VOCAB, HIDDEN).to(dtype).requires_grad_()
    loss = chunked_linear_cross_entropy(hidden, weight, torch.zeros(0, dtype=torch.long))
    loss.backward()
    assert loss.isnan() and not weight.grad.any() and hidden.grad.shape == hidden.shape


@pytest.mark.parametrize("chunk_size", [7, 64], ids=lambda c: f"chunk_{c}")
def test_chunked_fp64_gradients_do_not_depend_on_the_chunks(chunk_size):
    """In float64 (the dtype the CP tests compare in) the head and bias gradients, summed over the chunks, keep fp64:
    summed in fp32 they moved by 1e-8 with the chunking, as they do when a CP shard sums its tokens in another order.
    (Their per-token terms are fp32's, as the stock loss's on `logits.float()`.)"""
    hidden, weight, b, labels = _problem(torch.float64, bias=True)
    _, grads = _chunked(hidden, weight, b, labels, chunk_size=chunk_size)
    _, whole = _chunked(hidden, weight, b, labels, chunk_size=hidden.shape[0] * hidden.shape[1])
    _, stock_grads = _stock(hidden, weight, b, labels)
    for g, w, s in zip(grads, whole, stock_grads):
        assert g.dtype == torch.float64
        assert _rel_err(g, w) < 1e-14 and _rel_err(g, s) < 1e-6


def test_all_tokens_ignored_with_num_items_gives_zero_loss_and_grads():
    hidden, weight, _, labels = _problem(torch.float32)
    labels.fill_(-100)
    loss, (gh, gw) = _chunked(hidden, weight, None, labels, num_items_in_batch=5, chunk_size=8)
    assert loss.item() == 0.0 and not gh.any() and not gw.any()


def test_custom_ignore_index_and_scaled_upstream_gradient():
    hidden, weight, _, labels = _problem(torch.float32)
    h, w = hidden.reshape(-1, HIDDEN).requires_grad_(), weight.clone().requires_grad_()
    targets = _shift(labels).reshape(-1).masked_fill(_shift(labels).reshape(-1) == -100, 5)
    (3.5 * chunked_linear_cross_entropy(h, w, targets, ignore_index=5, chunk_size=10)).backward()
    h_ref, w_ref = hidden.reshape(-1, HIDDEN).clone().requires_grad_(), weight.clone().requires_grad_()
    (3.5 * F.cross_entropy(h_ref @ w_ref.T, targets, ignore_index=5)).backward()
    assert _rel_err(h.grad, h_ref.grad) < 1e-5 and _rel_err(w.grad, w_ref.grad) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_compiled_whole_graph_scales_the_gradient_as_eager(dtype):
    """Under torch.compile (a stock script's --torch_compile) the backward's host read of the incoming gradient broke
    the graph, with a 30-line warning at every compilation: compiled it scales by the tensor, in fp32 as eager does,
    and a whole-graph compile (fullgraph, which refuses any break) gives eager's gradients."""
    hidden, weight, _, labels = _problem(dtype)
    targets = _shift(labels).reshape(-1)
    grads = []
    for fn in (lambda h, w: 3.5 * chunked_linear_cross_entropy(h, w, targets, chunk_size=10),) * 2:
        fn = torch.compile(fn, fullgraph=True, backend="aot_eager") if grads else fn
        h, w = hidden.reshape(-1, HIDDEN).clone().requires_grad_(), weight.clone().requires_grad_()
        fn(h, w).backward()
        grads.append((h.grad, w.grad))
    assert all(torch.equal(c, e) for c, e in zip(grads[1], grads[0], strict=True))


def test_no_grad_computes_the_same_loss():
    hidden, weight, _, labels = _problem(torch.float32)
    args = (hidden.reshape(-1, HIDDEN), weight.requires_grad_(), _shift(labels).reshape(-1))
    with torch.no_grad():
        loss = chunked_linear_cross_entropy(*args, chunk_size=9)
    assert not loss.requires_grad
    torch.testing.assert_close(loss, _stock(hidden, weight.detach(), None, labels)[0], rtol=1e-6, atol=0)


def test_autocast_computes_in_the_autocast_dtype():
    hidden, weight, _, labels = _problem(torch.float32)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    h_ref, w_ref = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = chunked_linear_cross_entropy(h.reshape(-1, HIDDEN), w, _shift(labels).reshape(-1), chunk_size=11)
        ref = ForCausalLMLoss(F.linear(h_ref, w_ref), labels, VOCAB)
    loss.backward()
    ref.backward()
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=0)  # both round the logits to bf16
    assert h.grad.dtype == w.grad.dtype == torch.float32
    assert _rel_err(h.grad, h_ref.grad) < 2e-2 and _rel_err(w.grad, w_ref.grad) < 2e-2


class _LargestTensor(TorchDispatchMode):
    """Records the element count of the largest tensor any op produces."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_never_materializes_full_logits():
    n, hidden_size, vocab, chunk = 600, 16, 500, 50
    hidden = torch.randn(n, hidden_size, requires_grad=True)
    weight = torch.randn(vocab, hidden_size, requires_grad=True)
    labels = torch.randint(0, vocab, (n,))
    with _LargestTensor() as probe:
        chunked_linear_cross_entropy(hidden, weight, labels, chunk_size=chunk).backward()
    assert probe.largest <= chunk * vocab < n * vocab


def test_default_chunk_is_bounded_for_a_large_vocabulary():
    from hf_sparse_cp.loss import default_chunk_size

    rows = default_chunk_size(1 << 20, 151936)
    assert 64 <= rows < 4096  # a few hundred MiB of fp32 logits, not [N, V]
    assert default_chunk_size(10, 151936) == 10


@pytest.mark.parametrize(
    "bad",
    [
        dict(hidden=torch.randn(2, 3, HIDDEN)),
        dict(weight=torch.randn(VOCAB, HIDDEN + 1)),
        dict(labels=torch.zeros(5, dtype=torch.long)),
        dict(labels=torch.zeros(10)),
        dict(bias=torch.zeros(VOCAB + 1)),
        dict(chunk_size=0),
    ],
    ids=["hidden_3d", "weight_width", "labels_len", "labels_float", "bias_len", "chunk_zero"],
)
def test_bad_inputs_raise_value_error(bad):
    args = dict(hidden=torch.randn(10, HIDDEN), weight=torch.randn(VOCAB, HIDDEN),
                labels=torch.zeros(10, dtype=torch.long))
    args.update(bad)
    with pytest.raises(ValueError):
        chunked_linear_cross_entropy(args.pop("hidden"), args.pop("weight"), args.pop("labels"), **args)


# ----------------------------------------------------------------------------------------- dispatch


def test_backend_resolution(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    assert resolve_backend(cpu) == "torch"
    monkeypatch.setattr(dispatch, "is_liger_kernel_available", lambda: True)
    assert resolve_backend(cuda) == "liger"
    monkeypatch.setenv(BACKEND_ENV, "torch")
    assert resolve_backend(cuda) == "torch"
    monkeypatch.setenv(BACKEND_ENV, "triton")
    with pytest.raises(ValueError, match="unknown"):
        resolve_backend(cuda)
    with pytest.raises(ValueError, match="CUDA"):
        resolve_backend(cpu, "liger")
    monkeypatch.setattr(dispatch, "is_liger_kernel_available", lambda: False)
    assert resolve_backend(cuda, "auto") == "torch"
    with pytest.raises(ValueError, match="liger-kernel"):
        resolve_backend(cuda, "liger")


def test_auto_keeps_fp16_to_the_chunked_loss(monkeypatch):
    """liger-kernel sums the weight gradient of the loss sum (what the dispatch asks of it) over every token in the
    weight's dtype: in fp16 6000 tokens, 2000 of one target, hidden states with a component of 50, gave an inf weight
    gradient (its CPU branch under Triton's interpreter; stock's and the chunked loss's: finite, 6.7e-4 and 2.1e-4 off
    fp64), for which fp16 training's loss scaler skips the step, at every step whatever its scale. 'auto' picks the
    chunked loss for fp16, from the autocast dtype where autocast is on; an explicit 'liger' is kept."""
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    monkeypatch.setattr(dispatch, "is_liger_kernel_available", lambda: True)
    cuda = torch.device("cuda")
    assert resolve_backend(cuda, dtype=torch.float16) == "torch"
    assert resolve_backend(cuda, dtype=torch.bfloat16) == resolve_backend(cuda, dtype=torch.float32) == "liger"
    assert resolve_backend(cuda, "liger", dtype=torch.float16) == "liger"
    seen = []
    monkeypatch.setattr(dispatch, "resolve_backend", lambda device, backend=None, dtype=None: seen.append(dtype) or
                        "torch")
    hidden, weight, _, labels = _problem(torch.float32)
    with torch.autocast("cpu", dtype=torch.float16):
        _dispatched(hidden, weight, labels)
    _dispatched(hidden.bfloat16(), weight.bfloat16(), labels)
    assert seen == [torch.float16, torch.bfloat16]


class _LigerLikeLoss(torch.autograd.Function):
    """What liger-kernel's fused loss does, in plain torch: the gradients of the reduced loss are computed
    in forward and only multiplied by the incoming gradient in backward."""

    @staticmethod
    def forward(ctx, hidden, weight, target, ignore_index, reduction):
        with torch.enable_grad():
            h, w = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
            loss = F.cross_entropy(F.linear(h, w).float(), target, ignore_index=ignore_index, reduction=reduction)
            ctx.save_for_backward(*torch.autograd.grad(loss, (h, w)))
        return loss.detach()

    @staticmethod
    def backward(ctx, grad_loss):
        grad_h, grad_w = ctx.saved_tensors
        return grad_h * grad_loss, grad_w * grad_loss, None, None, None


@pytest.fixture
def liger_like(monkeypatch):
    """The liger branch of `linear_cross_entropy` on CPU, with liger itself replaced by `_LigerLikeLoss`;
    yields the reductions it was called with."""
    calls = []

    def fake_liger(input, weight, target, bias=None, ignore_index=-100, reduction="mean"):
        assert bias is None
        calls.append(reduction)
        return _LigerLikeLoss.apply(input, weight, target, ignore_index, reduction)

    fake = types.ModuleType("liger_kernel.transformers.functional")
    fake.liger_fused_linear_cross_entropy = fake_liger
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers.functional", fake)
    monkeypatch.setattr(dispatch, "resolve_backend", lambda device, backend=None, dtype=None: "liger")
    return calls


def _dispatched(hidden, weight, labels, **kwargs):
    """Loss and (hidden, weight) grads through `linear_cross_entropy` (whichever backend it resolves)."""
    h, w = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    loss = linear_cross_entropy(h.reshape(-1, HIDDEN), w, _shift(labels).reshape(-1), **kwargs)
    loss.backward()
    return loss.detach(), [h.grad, w.grad]


def test_liger_call_normalizes_like_transformers(liger_like):
    """The liger branch asks for the loss sum and divides it by num_items_in_batch, or by the number of
    targets (the mean), like the chunked loss."""
    hidden, weight, _, labels = _problem(torch.float32)
    for num_items in (None, 40, torch.tensor(40.0)):
        loss, grads = _dispatched(hidden, weight, labels, num_items_in_batch=num_items)
        ref_loss, ref_grads = _stock(hidden, weight, None, labels, num_items_in_batch=num_items)
        torch.testing.assert_close(loss, ref_loss)
        for g, r in zip(grads, ref_grads):
            assert _rel_err(g, r) < 1e-5
    assert liger_like == ["sum"] * 3


def test_liger_loss_runs_outside_a_compiled_models_graph(liger_like, monkeypatch):
    """In a model compiled whole (--torch_compile), liger-kernel's loss runs as it does eagerly, outside the graphs:
    dynamo traced into it, compiling liger's forward frame by frame (a break at each host read) with its Triton
    kernels' in-place writes into slices of its buffers in the graphs (the compiled H200 step faulted)."""
    fake = sys.modules["liger_kernel.transformers.functional"]
    liger, traced = fake.liger_fused_linear_cross_entropy, []

    def recording(*args, **kwargs):
        traced.append(torch.compiler.is_compiling())
        return liger(*args, **kwargs)

    monkeypatch.setattr(fake, "liger_fused_linear_cross_entropy", recording)
    hidden, weight, _, labels = _problem(torch.float32)
    eager_loss, eager_grads = _dispatched(hidden, weight, labels)
    torch._dynamo.reset()
    h, w = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    loss = torch.compile(lambda h, w: 2.0 * linear_cross_entropy(h.reshape(-1, HIDDEN), w, _shift(labels).reshape(-1)),
                         backend="eager")(h, w)
    loss.backward()
    assert traced == [False, False]
    torch.testing.assert_close(loss, 2.0 * eager_loss)
    for g, r in zip([h.grad, w.grad], eager_grads, strict=True):
        torch.testing.assert_close(g, 2.0 * r)


@pytest.mark.gpu
def test_chunked_on_cuda_is_as_accurate_as_stock():
    hidden, weight, b, labels = (t.cuda() if t is not None else None for t in _problem(torch.bfloat16, bias=True))
    loss, grads = _chunked(hidden, weight, b, labels, chunk_size=13)
    stock_loss, stock_grads = _stock(hidden, weight, b, labels)
    exact_loss, exact_grads = _stock(hidden.double(), weight.double(), b.double(), labels)
    eps = torch.finfo(torch.float32).eps
    assert abs(loss.item() - exact_loss.item()) <= 2 * abs(stock_loss.item() - exact_loss.item()) + 4 * eps
    for g, s, e in zip(grads, stock_grads, exact_grads):
        assert _rel_err(g, e) <= 2 * _rel_err(s, e) + 4 * eps


@pytest.mark.gpu
@pytest.mark.parametrize("num_items", [None, 60], ids=["mean", "num_items"])
def test_liger_backend_matches_the_chunked_one(num_items):
    if not dispatch.is_liger_kernel_available():
        pytest.skip("liger-kernel is not installed")
    hidden, weight, _, labels = (t.cuda() if t is not None else None for t in _problem(torch.bfloat16))
    results = []
    for backend in ("liger", "torch"):
        h, w = hidden.reshape(-1, HIDDEN).clone().requires_grad_(), weight.clone().requires_grad_()
        loss = linear_cross_entropy(h, w, _shift(labels).reshape(-1), num_items_in_batch=num_items, backend=backend)
        loss.backward()
        results.append((loss.detach(), h.grad, w.grad))
    (liger_loss, *liger_grads), (loss, *grads) = results
    torch.testing.assert_close(liger_loss, loss, rtol=1e-3, atol=1e-3)
    for g, r in zip(liger_grads, grads):
        assert _rel_err(g, r) < 2e-2


# ------------------------------------------------------------------------------------ patched models


def _tiny_model(model_type, seed=0, configured=True, **overrides):
    """A tiny model in train mode with eager attention, configured for the plugin (the lean loss applies
    only to such models) unless `configured` is False."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type, **overrides), attn_implementation="eager")
    if configured:
        hf_sparse_cp.configure(model, select=False)
    return model.train()


def _loss_and_grads(model, **inputs):
    model.zero_grad(set_to_none=True)
    out = model(**inputs)
    out.loss.backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.fixture
def lean_loss():
    enable_lean_loss()
    yield
    disable_lean_loss()


def _batch(seq=37, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 259, (2, seq), generator=g)
    labels = ids.clone()
    labels[1, :11] = -100
    return ids, labels


def _assert_same(out, grads, ref_out, ref_grads):
    torch.testing.assert_close(out.loss, ref_out.loss, rtol=1e-5, atol=0)
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        assert _rel_err(grads[name], ref_grads[name]) < 1e-4, name


@pytest.mark.parametrize("model_type", lean_loss_model_types())
def test_patched_model_matches_stock(model_type):
    model = _tiny_model(model_type)
    ids, labels = _batch()
    ref = _loss_and_grads(model, input_ids=ids, labels=labels)
    enable_lean_loss()
    try:
        out, grads = _loss_and_grads(model, input_ids=ids, labels=labels)
    finally:
        disable_lean_loss()
    assert out.logits is None and ref[0].logits is not None
    _assert_same(out, grads, *ref)


def test_patched_untied_head_with_gradient_checkpointing(lean_loss):
    model = _tiny_model("qwen2", tie_word_embeddings=False)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids, labels = _batch()
    out, grads = _loss_and_grads(model, input_ids=ids, labels=labels)
    with torch.no_grad():
        model.eval()  # eval goes through the stock forward: full logits, stock loss
        ref_logits = model(input_ids=ids).logits
    model.train()
    assert "lm_head.weight" in grads
    ref_loss = ForCausalLMLoss(ref_logits, labels, model.config.vocab_size)
    torch.testing.assert_close(out.loss, ref_loss, rtol=1e-5, atol=0)


def test_patched_honours_num_items_shift_labels_and_logits_to_keep():
    model = _tiny_model("llama")
    ids, labels = _batch()
    shifted = _shift(labels).contiguous()
    shifted[0, 5:9] = -100
    tail, middle = labels[:, -9:].contiguous(), labels[:, 4:20].contiguous()
    cases = [
        # (stock inputs, lean inputs): stock only computes a loss when `labels` is given.
        (dict(labels=labels, num_items_in_batch=torch.tensor(101)), dict(labels=labels, num_items_in_batch=101)),
        (dict(labels=labels, shift_labels=shifted), dict(shift_labels=shifted)),
        (dict(labels=tail, logits_to_keep=9), dict(labels=tail, logits_to_keep=9)),
        (dict(labels=middle, logits_to_keep=torch.arange(4, 20)),
         dict(labels=middle, logits_to_keep=torch.arange(4, 20))),
    ]
    refs = [_loss_and_grads(model, input_ids=ids, **stock) for stock, _ in cases]
    enable_lean_loss()
    try:
        for (_, lean), ref in zip(cases, refs):
            _assert_same(*_loss_and_grads(model, input_ids=ids, **lean), *ref)
        with pytest.raises(ValueError, match="logits_to_keep"):
            model(input_ids=ids, labels=labels, logits_to_keep=5)
    finally:
        disable_lean_loss()


@pytest.mark.skipif(not hasattr(modeling_utils, "slice_logits_to_keep"),
                    reason="2D logits_to_keep tensors came with transformers' slice_logits_to_keep (5.24)")
def test_patched_honours_2d_logits_to_keep_as_the_stock_forward_slices_it():
    """transformers 5.24 keeps per-row positions (2D integers) or a boolean mask (kept positions flattened): the lean
    path trains the same loss and gradients on them (before: a misleading error, and an IndexError for the mask)."""
    model = _tiny_model("llama")
    ids, _ = _batch()
    g = torch.Generator().manual_seed(3)
    positions = torch.stack([torch.randperm(ids.shape[1], generator=g)[:8].sort().values for _ in range(2)])
    mask = torch.rand(ids.shape, generator=g) > 0.5
    cases = [dict(logits_to_keep=positions, labels=torch.take_along_dim(ids, positions, 1)),
             dict(logits_to_keep=mask, labels=ids[mask])]
    refs = [_loss_and_grads(model, input_ids=ids, **case) for case in cases]
    enable_lean_loss()
    try:
        for case, ref in zip(cases, refs):
            _assert_same(*_loss_and_grads(model, input_ids=ids, **case), *ref)
    finally:
        disable_lean_loss()


def test_patched_passes_attention_kwargs_to_the_base_model(lean_loss, monkeypatch):
    model = _tiny_model("qwen3")
    seen = {}
    base_forward = model.model.forward

    def spy(**kwargs):
        seen.update(kwargs)
        return base_forward(**kwargs)

    monkeypatch.setattr(model.model, "forward", spy)
    ids, labels = _batch()
    position_ids = torch.cat([torch.arange(20), torch.arange(17)]).expand(2, -1)
    marker = torch.tensor([0, 20, 37], dtype=torch.int32)
    model(input_ids=ids, labels=labels, position_ids=position_ids, cu_seq_lens_q=marker, num_items_in_batch=30)
    assert seen["position_ids"] is position_ids and seen["cu_seq_lens_q"] is marker
    assert "num_items_in_batch" not in seen and "labels" not in seen


def test_patched_return_dict_false_gives_a_tuple_with_the_loss_first(lean_loss):
    model = _tiny_model("mistral")
    ids, labels = _batch()
    out = model(input_ids=ids, labels=labels, use_cache=False, return_dict=False)
    assert isinstance(out, tuple) and out[0].dim() == 0 and out[0].requires_grad


def test_patched_eval_and_unlabeled_calls_return_logits(lean_loss):
    model = _tiny_model("qwen2")
    ids, labels = _batch()
    train_unlabeled = model(input_ids=ids)
    assert train_unlabeled.loss is None and train_unlabeled.logits.shape == (2, 37, model.config.vocab_size)
    model.eval()
    evaluated = model(input_ids=ids, labels=labels)
    assert evaluated.logits is not None
    torch.testing.assert_close(
        evaluated.loss, ForCausalLMLoss(evaluated.logits, labels, model.config.vocab_size), rtol=1e-6, atol=0
    )


def test_patched_forward_passes_the_callers_arguments_on_unchanged():
    """Generation (the KV cache under whichever name this transformers release uses) goes through the
    stock forward exactly as called, and the lean path returns the base model's cache: no deprecated
    argument added on the way (transformers 5.24 renamed past_key_values -> cache)."""
    model = _tiny_model("qwen2").eval()
    ids, labels = _batch()
    reference = model.generate(ids, max_new_tokens=4, do_sample=False)
    enable_lean_loss()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            generated = model.generate(ids, max_new_tokens=4, do_sample=False)
            model.train()
            out = model(input_ids=ids, labels=labels, use_cache=True)
    finally:
        disable_lean_loss()
    torch.testing.assert_close(generated, reference, rtol=0, atol=0)
    assert out.logits is None and out[lean_loss_module._CACHE_FIELD].get_seq_length() == ids.shape[1]
    assert not [str(w.message) for w in caught if "past_key_values" in str(w.message)]


def test_a_model_not_configured_for_the_plugin_keeps_the_stock_forward(lean_loss):
    """Issue #31: with the lean loss on, another model of the process (sdpa, not configured) training
    with labels got logits=None."""
    other = _tiny_model("llama", configured=False)
    other.set_attn_implementation("sdpa")
    ids, labels = _batch()
    out = other(input_ids=ids, labels=labels)
    assert out.logits is not None and out.logits.shape[:2] == ids.shape
    assert _tiny_model("llama")(input_ids=ids, labels=labels).logits is None  # a configured one: the lean path


def test_custom_loss_function_goes_through_the_stock_forward(lean_loss):
    model = _tiny_model("llama")
    model.loss_function = lambda logits, labels, vocab_size, **kw: logits.float().mean()
    out = model(input_ids=_batch()[0], labels=_batch()[1])
    assert out.logits is not None
    torch.testing.assert_close(out.loss, out.logits.float().mean())


def test_wrapped_lm_head_goes_through_the_stock_forward(lean_loss):
    """A head that is not a plain nn.Linear (as PEFT wraps it) is more than its weight: stock path."""
    model = _tiny_model("qwen2", tie_word_embeddings=False)
    head = model.lm_head
    model.lm_head = torch.nn.Sequential(head, torch.nn.Tanh())
    ids, labels = _batch()
    out = model(input_ids=ids, labels=labels)
    assert out.logits is not None and out.logits.abs().max() <= 1
    torch.testing.assert_close(out.loss, ForCausalLMLoss(out.logits, labels, model.config.vocab_size))


def test_lean_loss_is_its_own_opt_in_and_undoes_only_what_it_patched():
    """patch() registers the backend only; enable_lean_loss() swaps the class forwards and
    disable_lean_loss() restores them, except a forward another library installed after us."""
    classes = [getattr(transformers, name) for name in lean_loss_classes()]
    originals = [cls.__dict__["forward"] for cls in classes]
    hf_sparse_cp.patch()
    assert all(cls.__dict__["forward"] is f for cls, f in zip(classes, originals))
    hf_sparse_cp.unpatch()
    enable_lean_loss()
    enable_lean_loss()  # idempotent
    try:
        for cls, original in zip(classes, originals):
            assert cls.__dict__["forward"] is not original
            assert cls.forward.__wrapped__ is original
        hf_sparse_cp.unpatch()  # the backend's undo leaves the lean loss alone
        assert all(cls.__dict__["forward"] is not f for cls, f in zip(classes, originals))

        def theirs(self, *args, **kwargs):
            raise AssertionError("not called")

        classes[0].forward = theirs  # another library (e.g. Liger) patches after us
    finally:
        disable_lean_loss()
    try:
        assert classes[0].__dict__["forward"] is theirs
        assert all(cls.__dict__["forward"] is f for cls, f in zip(classes[1:], originals[1:]))
    finally:
        classes[0].forward = originals[0]


def test_trainer_with_gradient_accumulation_matches_stock(tmp_path, monkeypatch):
    """The Trainer passes num_items_in_batch over accumulated micro-batches; patched training follows stock."""
    from transformers import Trainer, TrainingArguments

    g = torch.Generator().manual_seed(0)
    rows = []
    for i in range(8):
        ids = torch.randint(3, 259, (40,), generator=g)
        labels = ids.clone()
        labels[: 5 * (i % 3)] = -100  # unequal label counts make the normalization matter
        rows.append({"input_ids": ids, "labels": labels})

    def train(out_dir):
        model = _tiny_model("qwen2")
        args = TrainingArguments(
            output_dir=str(out_dir), max_steps=2, per_device_train_batch_size=2, gradient_accumulation_steps=2,
            learning_rate=1e-2, report_to="none", save_strategy="no", use_cpu=True, logging_steps=1, seed=0,
        )
        trainer = Trainer(model=model, args=args, train_dataset=rows)
        trainer.train()
        losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
        return losses, {n: p.detach().clone() for n, p in model.named_parameters()}

    ref_losses, ref_params = train(tmp_path / "stock")
    calls = []

    def counting(*args, **kwargs):
        calls.append(kwargs["num_items_in_batch"])
        return linear_cross_entropy(*args, **kwargs)

    monkeypatch.setattr(lean_loss_module, "linear_cross_entropy", counting)
    enable_lean_loss()
    try:
        losses, params = train(tmp_path / "lean")
    finally:
        disable_lean_loss()
    assert len(losses) == 2 and len(calls) == 4  # 2 optimizer steps x 2 micro-batches, all on the lean path
    assert all(n is not None for n in calls)
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=0)
    for name in ref_params:
        assert _rel_err(params[name], ref_params[name]) < 1e-3, name


# ------------------------------------------------------------------------ batches without targets (#14)

# A batch whose labels are all ignored (prompt-only samples), normalized by its own count (the mean), or
# by num_items_in_batch = 0: an int, an integer tensor, or the float tensor the Trainer passes (its count
# divided by the number of ranks sharing the batch), also the global count under context parallelism.
NO_TARGET_NORMALIZERS = {"mean": None, "int": 0, "tensor": torch.tensor(0), "float_tensor": torch.tensor(0.0)}


def _without_targets(dtype=torch.float32, bias=False):
    hidden, weight, b, labels = _problem(dtype, bias=bias)
    return hidden, weight, b, torch.full_like(labels, -100)


def _assert_all_zero(grads):
    for g in grads:
        assert g is not None and bool(g.isfinite().all()) and not bool(g.any())


def test_stock_loss_without_targets_is_nan_with_a_zero_gradient():
    """What the lean loss follows: transformers' ForCausalLMLoss gives 0 / 0 = NaN as the value and a zero
    gradient, with every normalizer."""
    hidden, weight, _, labels = _without_targets()
    for num_items in NO_TARGET_NORMALIZERS.values():
        loss, grads = _stock(hidden, weight, None, labels, num_items_in_batch=num_items)
        assert bool(loss.isnan())
        _assert_all_zero(grads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("num_items", list(NO_TARGET_NORMALIZERS), ids=[f"norm_{k}" for k in NO_TARGET_NORMALIZERS])
def test_chunked_loss_without_targets_has_a_zero_gradient(num_items, dtype):
    hidden, weight, b, labels = _without_targets(dtype, bias=True)
    normalizer = NO_TARGET_NORMALIZERS[num_items]
    loss, grads = _chunked(hidden, weight, b, labels, num_items_in_batch=normalizer, chunk_size=16)
    ref_loss, _ = _stock(hidden, weight, b, labels, num_items_in_batch=normalizer)
    torch.testing.assert_close(loss, ref_loss, equal_nan=True)  # NaN, as stock
    _assert_all_zero(grads)


@pytest.mark.parametrize("backend", ["torch", "liger"])
def test_linear_cross_entropy_without_targets_has_a_zero_gradient(backend, request):
    """Every backend shares the normalization: liger (CUDA-only, replaced by a liger-like loss) would
    otherwise get 1 / 0 as the incoming gradient and multiply its zero gradients into NaN."""
    if backend == "liger":
        request.getfixturevalue("liger_like")
    hidden, weight, _, labels = _without_targets()
    for num_items in NO_TARGET_NORMALIZERS.values():
        loss, grads = _dispatched(hidden, weight, labels, num_items_in_batch=num_items)
        assert bool(loss.isnan())
        _assert_all_zero(grads)


@pytest.mark.parametrize("num_items", [None, torch.tensor(0.0)], ids=["mean", "num_items_0"])
def test_lean_forward_without_targets_has_a_zero_gradient(lean_loss, num_items):
    model = _tiny_model("llama")
    ids, labels = _batch()
    labels.fill_(-100)
    extra = {} if num_items is None else {"num_items_in_batch": num_items}
    out, grads = _loss_and_grads(model, input_ids=ids, labels=labels, **extra)
    assert out.logits is None and bool(out.loss.isnan())
    assert grads.keys() == {name for name, _ in model.named_parameters()}
    _assert_all_zero(grads.values())


def test_trainer_step_without_targets_leaves_the_weights_as_they_were(tmp_path):
    """A Trainer step whose batch has no target (num_items_in_batch = 0.0) gets a zero gradient: AdamW's
    first update is then 0 (no weight decay) and the weights stay finite; the next step trains. With the
    lean loss as with stock."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    g = torch.Generator().manual_seed(0)
    rows = []
    for i in range(4):
        ids = torch.randint(3, 259, (24,), generator=g)
        rows.append({"input_ids": ids, "labels": torch.full_like(ids, -100) if i < 2 else ids.clone()})

    class Probe(TrainerCallback):
        """Gradients before each optimizer step, weights after it."""

        def __init__(self):
            self.grads, self.weights = [], []

        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            self.grads.append({n: p.grad.clone() for n, p in model.named_parameters()})

        def on_optimizer_step(self, args, state, control, model=None, **kwargs):
            self.weights.append({n: p.detach().clone() for n, p in model.named_parameters()})

    def train(out_dir):
        model = _tiny_model("qwen2")
        start = {n: p.detach().clone() for n, p in model.named_parameters()}
        args = TrainingArguments(
            output_dir=str(out_dir), max_steps=2, per_device_train_batch_size=2, learning_rate=1e-2,
            weight_decay=0.0, train_sampling_strategy="sequential", report_to="none", save_strategy="no",
            use_cpu=True, logging_steps=1, seed=0,
        )
        probe = Probe()
        trainer = Trainer(model=model, args=args, train_dataset=rows, callbacks=[probe])
        trainer.train()
        losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
        return start, probe, losses

    _, ref_probe, ref_losses = train(tmp_path / "stock")
    enable_lean_loss()
    try:
        start, probe, losses = train(tmp_path / "lean")
    finally:
        disable_lean_loss()
    assert len(probe.grads) == len(probe.weights) == 2
    _assert_all_zero(probe.grads[0].values())  # the batch without targets
    for name, weight in probe.weights[0].items():
        assert torch.equal(weight, start[name]), name
    assert any(bool(g.any()) for g in probe.grads[1].values())  # the next batch trains
    assert all(bool(w.isfinite().all()) for w in probe.weights[1].values())
    assert losses[1] > 0 and losses[1] == pytest.approx(ref_losses[1], rel=1e-5)
    for name, weight in probe.weights[1].items():  # Adam's update magnifies rounding in near-zero gradients
        assert _rel_err(weight, ref_probe.weights[1][name]) < 1e-3, name
