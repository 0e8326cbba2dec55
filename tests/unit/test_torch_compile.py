"""A model compiled whole, as a stock script's --torch_compile has the Trainer compile it (`torch.compile(model)`),
traces the `sparse_cp` attention calls as two opaque custom ops (`integration.compiled`: the plan, which estimates
the layout from tensors read back to the host, and attention over it, whose backward takes the same layout): no graph
break, and the logits, the gradients and the kept fractions are the uncompiled model's. Backends "eager" and
"aot_eager" here (no inductor subprocesses); the Trainer run with inductor: tests/integration/test_fused_ops_compile.py;
under CP 2 (whose calls stay outside the graphs): tests/distributed/test_fused_ops_cp.py."""

import logging

import pytest
import torch
from torch._dynamo.utils import counters
from transformers import AutoModelForCausalLM

from hf_sparse_cp import SparseAttentionConfig, configure
from hf_sparse_cp.attention.opaque import layout_attention, layout_attention_backward
from hf_sparse_cp.integration.compiled import (
    OPS_MIN_TORCH,
    TORCH_TRACES_THE_OPS,
    TRACED_ENV,
    sequence_plan,
    settings_key,
)
from hf_sparse_cp.integration.stats import pop_kept_fractions
from hf_sparse_cp.testing.tiny_models import tiny_config

pytestmark = pytest.mark.usefixtures("patched")
# (what a torch before OPS_MIN_TORCH cannot trace: its compiled calls run outside the graphs, tested below)
traces_the_ops = pytest.mark.skipif(not TORCH_TRACES_THE_OPS, reason=f"torch < {OPS_MIN_TORCH}: the calls stay "
                                    "outside the graphs (test_a_torch_that_cannot_trace_the_ops_...)")

PATTERN = SparseAttentionConfig(block_size=16, min_seq_len=64, dense_first_layers=0, vertical_topk=4, slash_topk=4,
                                sink_tokens=2, local_window=16, last_q=8)


def _step(model, ids, labels=None, **inputs):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids if labels is None else labels, **inputs)
    out.loss.backward()
    return out.logits.detach(), [p.grad for p in model.parameters()], pop_kept_fractions(model), out.loss.detach()


def test_a_model_compiled_whole_trains_as_uncompiled(single_thread):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("qwen2", vocab_size=97))
    configure(model, PATTERN)
    ids = torch.randint(3, 97, (2, 160), generator=torch.Generator().manual_seed(1))
    want = _step(model, ids)
    assert min(want[2].values()) < 1  # the sparse path ran
    torch._dynamo.reset()
    try:  # (dynamic: symbolic shapes from the start, as a recompile for a second length makes them)
        got = _step(torch.compile(model, backend="eager", dynamic=True), ids)
    finally:
        torch._dynamo.reset()
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
    for g, w in zip(got[1], want[1], strict=True):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-7)
    assert got[2] == pytest.approx(want[2], abs=1e-12)


def _graph_breaks_and_recompiles(model, batches, backend="eager"):
    """Per batch: the graph breaks dynamo counted (reason: count), the recompiles it logged and the graphs it
    compiled, one step each of the model compiled whole (the breaks and guards are dynamo's, whichever backend
    compiles), and the warnings dynamo logged (its recompile limit)."""
    recompiles, warnings = [], []
    handler = logging.Handler()
    handler.emit = lambda record: recompiles.append(record.getMessage())
    log = logging.getLogger("torch._dynamo.guards.__recompiles")
    warned = logging.Handler(logging.WARNING)
    warned.emit = lambda record: warnings.append(record.getMessage())
    torch._dynamo.reset()
    torch._logging.set_logs(recompiles=True)
    log.addHandler(handler)
    logging.getLogger("torch._dynamo").addHandler(warned)
    try:
        compiled, steps = torch.compile(model, backend=backend), []
        for batch in batches:
            counters.clear()
            recompiles.clear()
            steps.append((_step(compiled, **batch), dict(counters["graph_break"]), list(recompiles),
                          counters["stats"]["unique_graphs"]))
        return steps, warnings
    finally:
        logging.getLogger("torch._dynamo").removeHandler(warned)
        log.removeHandler(handler)
        torch._logging.set_logs()
        torch._dynamo.reset()


@traces_the_ops
@pytest.mark.parametrize("model_type, packed, backend", [("gemma3_text", False, "eager"), ("llama", True, "aot_eager")],
                         ids=["window-eager", "packed-aot_eager"])
def test_a_compiled_step_has_no_graph_break(single_thread, model_type, packed, backend):
    """The sparse attention calls are traced as the custom ops: no graph break in a compiled step (before, each
    attention call ran outside the graph, `torch.compiler.disable`: 10 breaks for the 2-layer window model, 9 for
    the packed llama, and transformers' deprecate_kwarg wrapper of the decoder layers, compiled again for each
    resumed frame, hit dynamo's recompile limit), nor in the mask build (its check stays in the graph, an ordered
    op of the mask build: `call_tokens.refuse_next_key`). The second length recompiles the model's frame once (its sizes
    become dynamic), a third compiles nothing new, and dynamo never reaches its recompile limit. The compiled steps'
    logits, losses, gradients and kept fractions are the uncompiled ones (the dense window layer runs the engine over
    the dense layout rather than SDPA: fp32 rounding)."""
    torch.manual_seed(0)
    overrides = ({"sliding_window": 32, "layer_types": ["sliding_attention", "full_attention"]}
                 if model_type == "gemma3_text" else {})  # (the window layer runs dense, the full one sparse)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type, vocab_size=97, use_cache=False, **overrides))
    configure(model, PATTERN)

    def batch(length, seed):
        ids = torch.randint(3, 97, (2, length), generator=torch.Generator().manual_seed(seed))
        first = length // 2 + 9  # (packed: two documents per row, the second restarting its positions)
        positions = torch.cat([torch.arange(first), torch.arange(length - first)]) if packed else torch.arange(length)
        return {"ids": ids, "position_ids": positions[None].expand(2, length)}

    batches = [batch(160, 1), batch(192, 2), batch(224, 3)]
    want = _step(model, **batches[0])
    assert min(want[2].values()) < 1  # the sparse path ran
    steps, warnings = _graph_breaks_and_recompiles(model, batches, backend)
    (got, breaks, _, graphs), (_, second_breaks, recompiles, _), (_, third_breaks, third_recompiles, third_graphs) = (
        steps)
    assert (breaks, second_breaks, third_breaks) == ({}, {}, {}) and graphs == 1
    assert not [r for r in recompiles if "hf_sparse_cp" in r], recompiles
    assert (third_recompiles, third_graphs) == ([], 0)
    assert not [w for w in warnings if "recompile_limit" in w], warnings
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[3], want[3], rtol=1e-6, atol=0)
    for g, w in zip(got[1], want[1], strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-7)
    assert got[2] == pytest.approx(want[2], abs=1e-12)


@traces_the_ops
@pytest.mark.parametrize("padding", ["end", "between"])
def test_compiled_gradients_are_the_uncompiled_ones_in_fp64(single_thread, monkeypatch, padding):
    """In fp64, through AOT autograd (backend aot_eager: the backward graph calls the backward op with the layout the
    forward op was given), over a padded batch: a row padded at its end (the sparse path), or a row with padding
    between its tokens (every key block of the batch, not counted in the kept fraction, as the uncompiled call). The
    losses and gradients are the uncompiled step's to fp64 rounding, and so are those of the calls kept outside the
    graphs ($HF_SPARSE_CP_TRACED_ATTENTION=outside)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama", vocab_size=97, use_cache=False)).double()
    configure(model, PATTERN)
    ids = torch.randint(3, 97, (2, 160), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 160, dtype=torch.long)
    mask[1, 140:] = 0
    if padding == "between":
        mask[0, 70:74] = 0
    labels = ids.masked_fill(mask == 0, -100)
    want = _step(model, ids, labels=labels, attention_mask=mask)
    assert (min(want[2].values()) < 1) if padding == "end" else want[2] == {}  # (sparse; not counted)
    for setting in ("auto", "outside"):
        monkeypatch.setenv(TRACED_ENV, setting)
        torch._dynamo.reset()
        counters.clear()
        try:
            got = _step(torch.compile(model, backend="aot_eager"), ids, labels=labels, attention_mask=mask)
        finally:
            torch._dynamo.reset()
        # (the one break left with a padding mask is transformers' own, in the mask build: flash_attention_mask reads
        # whether the mask pads anything; none is at an attention call)
        at_attention = [reason for reason in counters["graph_break"] if "torch.compiler.disable" in reason]
        assert bool(at_attention) == (setting == "outside"), (setting, list(counters["graph_break"]))
        torch.testing.assert_close(got[3], want[3], rtol=1e-12, atol=0)
        torch.testing.assert_close(got[0], want[0], rtol=1e-10, atol=1e-12)
        for g, w in zip(got[1], want[1], strict=True):
            torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)
        assert got[2] == pytest.approx(want[2], abs=1e-12)


@traces_the_ops
def test_an_activation_checkpointed_compiled_step_has_no_graph_break(single_thread):
    """With gradient checkpointing the decoder layers run inside torch.utils.checkpoint, whose trace refuses a Python
    side effect: the first layer's attention call took the forward's mask check off a list (`_DEFERRED`), so that
    layer ran outside the graph (a graph break, "HOP: Unsafe side effect", at each trace). The check is an op of the
    mask build now (`call_tokens.refuse_next_key`): no break of ours, and the fp64 loss and gradients are the
    uncompiled checkpointed step's. (With transformers 5.25 and the Hub's `kernels` package, which it requires, the
    attention modules' `use_kernelized_func` wrapper sets a variable in every layer's forward, a break there for any
    backend: the model on sdpa breaks once per layer where it has the wrapper; configured, the model skips the
    wrapper while nothing is kernelized, `integration.kernel_routing`: one graph.)"""
    torch.manual_seed(0)

    def checkpointed(attention: str):
        model = AutoModelForCausalLM.from_config(tiny_config("llama", vocab_size=97, use_cache=False),
                                                 attn_implementation=attention).double()
        model.gradient_checkpointing_enable()
        return model.train()

    ids = torch.randint(3, 97, (2, 160), generator=torch.Generator().manual_seed(1))
    (_, sdpa_breaks, _, sdpa_graphs), = _graph_breaks_and_recompiles(checkpointed("sdpa"), [{"ids": ids}],
                                                                      backend="aot_eager")[0]
    model = checkpointed("sdpa")
    configure(model, PATTERN)
    want = _step(model, ids)
    assert min(want[2].values()) < 1  # the sparse path ran
    steps, _ = _graph_breaks_and_recompiles(model, [{"ids": ids}], backend="aot_eager")
    (got, breaks, _, graphs), = steps
    assert (breaks, graphs) == ({}, 1), (breaks, graphs)
    routed = any("_kernel_funcs" in m.__dict__ for m in model.modules())
    assert bool(sdpa_breaks) == routed and (sdpa_graphs > 1) == routed, sdpa_breaks
    torch.testing.assert_close(got[3], want[3], rtol=1e-12, atol=0)
    for g, w in zip(got[1], want[1], strict=True):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)
    assert got[2] == pytest.approx(want[2], abs=1e-12)


def _traced_attention(model, ids, **inputs):
    """(the attention ops of the graph dynamo traced for one compiled step of `model`, in their order, the step, the
    graph breaks): backend aot_eager, which differentiates the graph (the backward op takes the layout)."""
    from torch._dynamo.backends.registry import lookup_backend

    graphs = []

    def recording(gm, example_inputs):
        graphs.append(gm)
        return lookup_backend("aot_eager")(gm, example_inputs)

    torch._dynamo.reset()
    counters.clear()
    try:
        got = _step(torch.compile(model, backend=recording), ids, **inputs)
    finally:
        torch._dynamo.reset()
    calls = [node.target for gm in graphs for node in gm.graph.nodes if node.op == "call_function"]
    ops = ["sdpa" if target is torch.nn.functional.scaled_dot_product_attention else str(target).split(".")[1]
           for target in calls
           if target is torch.nn.functional.scaled_dot_product_attention or str(target).startswith("hf_sparse_cp.")]
    return ops, got, dict(counters["graph_break"])


@traces_the_ops
def test_dense_calls_trace_as_sdpa_where_the_eager_calls_run_it(single_thread, monkeypatch):
    """A call that its layer's settings make dense (here the dense first layer) traces as SDPA where the eager call
    runs SDPA ($HF_SPARSE_CP_DENSE_BACKEND=sdpa; 'auto' on CUDA fp16/bf16 without flash-attn), with an op that checks
    the rows as the eager call does and records its kept fraction; the sparse layer keeps the ops. Before, every call
    inside a trace ran the engine over the dense layout inside the ops. Where the eager call runs the kernels ('auto'
    on the CPU) the trace keeps the ops. In fp64 the compiled steps' losses, gradients and kept fractions are the
    uncompiled ones, no graph break; packed rows under 'sdpa' are refused as the eager call refuses them."""
    from hf_sparse_cp.attention.dense import DENSE_BACKEND_ENV

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama", vocab_size=97, use_cache=False)).double()
    configure(model, PATTERN.replace(dense_first_layers=1))
    ids = torch.randint(3, 97, (2, 160), generator=torch.Generator().manual_seed(1))
    for backend, dense_layer in (("sdpa", ["dense_call", "sdpa"]), ("auto", ["sequence_plan", "layout_attention"])):
        monkeypatch.setenv(DENSE_BACKEND_ENV, backend)
        want = _step(model, ids)
        assert want[2][0] == 1 and want[2][1] < 1  # (the dense layer, the sparse one)
        ops, got, breaks = _traced_attention(model, ids)
        # (the mask build's check, then the dense layer's calls, then the sparse layer's)
        assert ops == ["refuse_next_key", *dense_layer, "sequence_plan", "layout_attention"] and breaks == {}, (
            backend, ops, breaks)
        torch.testing.assert_close(got[3], want[3], rtol=1e-12, atol=0)
        for g, w in zip(got[1], want[1], strict=True):
            torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)
        assert got[2] == pytest.approx(want[2], abs=1e-12)
    monkeypatch.setenv(DENSE_BACKEND_ENV, "sdpa")
    packed = torch.cat([torch.arange(100), torch.arange(60)])[None].expand(2, 160)
    for run in (model, torch.compile(model, backend="aot_eager")):
        with pytest.raises(ValueError, match=r"=sdpa computes plain causal attention only, and this batch has packed"):
            run(input_ids=ids, position_ids=packed)
    torch._dynamo.reset()


@pytest.mark.parametrize("change, sdpa", [
    ({}, "plain"), ({"backend": "sdpa"}, "plain"), ({"backend": "kernels"}, None), ({"backend": "flash_attn"}, None),
    ({"position_ids": True}, None), ({"position_ids": True, "backend": "sdpa"}, "checked"),
    ({"window": 100}, "plain"), ({"window": 40}, None), ({"window": 40, "backend": "sdpa"}, "checked"),
    ({"length": 64}, None), ({"length": 64, "pattern": "dense"}, "plain"), ({"mask": True}, None),
    ({"sinks": True}, None), ({"flash": True}, None), ({"deterministic": True}, None), ({"cpu": True}, None),
])
def test_a_traced_dense_call_goes_to_sdpa_where_the_eager_call_would(monkeypatch, change, sdpa):
    """`compiled.dense_sdpa`, from what a trace knows: a dense call (fewer tokens than min_seq_len, a dense pattern or
    a window) goes to SDPA where the eager call's backend would ('auto': CUDA fp16/bf16, faked here, without flash-attn,
    outside deterministic mode; or forced 'sdpa') and its rows are plain whatever its tensors hold ('plain'), or, under
    'sdpa', checked at run time as eagerly ('checked'); a call with a padding mask, sinks, a window shorter than its
    rows or position_ids under 'auto' (which the eager call reads back to choose) keeps the ops (None)."""
    from hf_sparse_cp.attention.dense import DENSE_BACKEND_ENV
    from hf_sparse_cp.integration import compiled

    monkeypatch.setenv(DENSE_BACKEND_ENV, change.get("backend", "auto"))
    monkeypatch.setattr(compiled, "library_takes", lambda q, k: not change.get("cpu"))
    monkeypatch.setattr(compiled, "is_flash_attn_available", lambda: bool(change.get("flash")))
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: bool(change.get("deterministic")))
    length = change.get("length", 48)
    q, k = torch.zeros(2, 4, length, 8), torch.zeros(2, 2, length, 8)
    kwargs = {"position_ids": torch.arange(length)[None]} if change.get("position_ids") else {}
    if change.get("sinks"):
        kwargs["s_aux"] = torch.zeros(4)
    cfg = PATTERN.replace(pattern="dense") if change.get("pattern") else PATTERN
    mask = torch.ones(2, length) if change.get("mask") else None
    assert compiled.dense_sdpa(q, k, mask, cfg, change.get("window"), kwargs) == sdpa


def test_the_dense_sdpa_choice_traces_without_a_graph_break(monkeypatch):
    """`compiled.dense_sdpa` asks whether flash-attn is installed (an import, at which dynamo broke the graph) only
    for a call the library kernels take (CUDA fp16/bf16, faked here): a constant of the trace."""
    from hf_sparse_cp.integration import compiled

    monkeypatch.setattr(compiled, "library_takes", lambda q, k: True)
    q, k = torch.zeros(2, 4, 48, 8), torch.zeros(2, 2, 48, 8)
    torch._dynamo.reset()
    try:
        traced = torch.compile(lambda q, k: compiled.dense_sdpa(q, k, None, PATTERN, None, {}), backend="eager",
                               fullgraph=True)
        assert traced(q, k) == compiled.dense_sdpa(q, k, None, PATTERN, None, {})
    finally:
        torch._dynamo.reset()


def test_the_custom_ops_pass_opcheck():
    """torch.library.opcheck (schema, fake implementations against the real ones, autograd registration, AOT
    dispatch with dynamic shapes, where the plan's widths are unbacked sizes) of the plan op on a packed batch with a
    padded row, and of the attention op and its backward op on the layout it planned (a vertical-slash layout with
    columns, in fp64)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 100, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2))
    positions = torch.cat([torch.arange(70), torch.arange(30)])[None].expand(2, 100)
    mask = torch.ones(2, 100, dtype=torch.long)
    mask[1, 90:] = 0
    plan_args = (q, k, mask, positions, None, None, settings_key(PATTERN), 0.3, None, "", True)
    torch.library.opcheck(sequence_plan, plan_args)
    plan = sequence_plan(*plan_args)
    assert plan[2].shape[-1] > 0  # (columns: the layout is sparse)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    torch.library.opcheck(layout_attention, (q, k, v, *plan, PATTERN.block_size, 0.3, None, "auto"))
    out, lse = layout_attention(q, k, v, *plan, PATTERN.block_size, 0.3, None, "auto")
    dout, dlse = torch.randn_like(out), torch.randn_like(lse)
    saved = (t.detach() for t in (q, k, v, out, lse))  # (the backward is not differentiated again)
    torch.library.opcheck(layout_attention_backward, (dout, dlse, *saved, *plan, PATTERN.block_size, 0.3, None,
                                                      "auto"))


@traces_the_ops
def test_a_compiled_model_follows_a_new_config(single_thread):
    """The plan op takes the layer's settings parsed when they were stored (`layer_settings.parsed_layer`), and the
    trace guards on the config object they came from: configuring the compiled model again (another block size and
    budget) traces again, and each step keeps the fractions the uncompiled model keeps with the config of the moment."""
    other = PATTERN.replace(block_size=32, local_window=32, budget={"mode": "topk", "vertical_topk": 8,
                                                                     "slash_topk": 2})
    model = AutoModelForCausalLM.from_config(tiny_config("llama", vocab_size=97, use_cache=False))
    ids = torch.randint(3, 97, (2, 160), generator=torch.Generator().manual_seed(1))
    torch._dynamo.reset()
    try:
        compiled = torch.compile(model, backend="eager")
        for config in (PATTERN, other, PATTERN):
            configure(model, config)
            want = _step(model, ids)[2]
            assert _step(compiled, ids)[2] == pytest.approx(want, abs=1e-12) and min(want.values()) < 1
    finally:
        torch._dynamo.reset()


@traces_the_ops
def test_settings_set_on_the_config_directly_are_parsed_outside_the_graph_once(single_thread):
    """Settings put on the model config directly (not through `configure`, which parses every layer's before a trace
    reads them) are not parsed inside a trace (torch 2.11's dynamo refused the module argument of the function that
    did: InternalTorchDynamoError, a module is not a constant): the first compiled step runs the calls outside the
    graph (one break each), which parses them, with the uncompiled step's kept fractions; the next step traces again
    and takes the ops, no break."""
    from hf_sparse_cp.config import MODEL_CONFIG_ATTRIBUTE

    other = PATTERN.replace(block_size=32, local_window=32)
    model = AutoModelForCausalLM.from_config(tiny_config("llama", vocab_size=97, use_cache=False))
    ids = torch.randint(3, 97, (2, 160), generator=torch.Generator().manual_seed(1))
    configure(model, other)
    want = _step(model, ids)
    configure(model, PATTERN)
    setattr(model.config, MODEL_CONFIG_ATTRIBUTE, other.to_dict())
    steps, _ = _graph_breaks_and_recompiles(model, [{"ids": ids}, {"ids": ids}])
    (first, breaks, _, _), (second, second_breaks, _, _) = steps
    assert any("torch.compiler.disable" in reason for reason in breaks) and second_breaks == {}, (breaks,
                                                                                                    second_breaks)
    for got in (first, second):
        torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
        assert got[2] == pytest.approx(want[2], abs=1e-12) and min(want[2].values()) < 1


@traces_the_ops
def test_a_compiled_deep_copy_records_its_own_kept_fractions(single_thread):
    """A deep copy of a configured model (TRL's reference model) holds its original's parsed layer configs, whose
    layer keys name the original's modules: its compiled step parses its own (outside the graph once, as unparsed
    settings) and records the kept fractions on its own modules, none on the original's."""
    import copy

    model = AutoModelForCausalLM.from_config(tiny_config("llama", vocab_size=97, use_cache=False))
    configure(model, PATTERN)
    ids = torch.randint(3, 97, (2, 160), generator=torch.Generator().manual_seed(1))
    want = _step(model, ids)
    twin = copy.deepcopy(model)
    steps, _ = _graph_breaks_and_recompiles(twin, [{"ids": ids}, {"ids": ids}])
    assert pop_kept_fractions(model) == {}
    for got, _, _, _ in steps:
        assert got[2] == pytest.approx(want[2], abs=1e-12) and min(want[2].values()) < 1
    assert steps[1][1] == {}, steps[1][1]


@pytest.mark.parametrize("setting", ["auto", pytest.param("ops", marks=traces_the_ops)])
def test_a_torch_that_cannot_trace_the_ops_keeps_the_calls_outside_the_graphs(single_thread, monkeypatch, setting):
    """On a torch before `OPS_MIN_TORCH` (none checked to trace the ops) the calls run outside the graphs, one break at
    each; $HF_SPARSE_CP_TRACED_ATTENTION=ops (to try such a torch) takes the ops whatever the version, no break. The
    step equals the uncompiled one either way."""
    from hf_sparse_cp.integration import compiled

    monkeypatch.setattr(compiled, "TORCH_TRACES_THE_OPS", False)
    monkeypatch.setenv(TRACED_ENV, setting)  # ('auto', the default, whatever the environment running the tests sets)
    model = AutoModelForCausalLM.from_config(tiny_config("llama", vocab_size=97, use_cache=False))
    configure(model, PATTERN)
    ids = torch.randint(3, 97, (2, 160), generator=torch.Generator().manual_seed(1))
    want = _step(model, ids)
    steps, _ = _graph_breaks_and_recompiles(model, [{"ids": ids}])
    (got, breaks, _, _), = steps
    assert bool([reason for reason in breaks if "torch.compiler.disable" in reason]) == (setting == "auto"), breaks
    assert setting == "auto" or breaks == {}, breaks
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
    assert got[2] == pytest.approx(want[2], abs=1e-12)


def test_a_misspelt_traced_attention_setting_is_refused(single_thread, monkeypatch):
    """$HF_SPARSE_CP_TRACED_ATTENTION=outsid was ignored: read only while tracing, its error sent the call outside
    the graph, which never read it. Refused by a compiled step and an uncompiled one, naming the settings."""
    model = AutoModelForCausalLM.from_config(tiny_config("llama", vocab_size=97, use_cache=False))
    configure(model, PATTERN)
    ids = torch.randint(3, 97, (2, 160), generator=torch.Generator().manual_seed(1))
    monkeypatch.setenv(TRACED_ENV, "outsid")
    refused = r"Traced attention backend 'outsid' is unknown .*use one of \('auto', 'ops', 'outside'\)"
    with pytest.raises(ValueError, match=refused):
        model(input_ids=ids)
    torch._dynamo.reset()
    try:
        with pytest.raises(ValueError, match=refused):
            torch.compile(model, backend="eager")(input_ids=ids)
    finally:
        torch._dynamo.reset()
