"""A model compiled whole, as a stock script's --torch_compile has the Trainer compile it (`torch.compile(model)`),
runs the `sparse_cp` attention function outside the traced graphs (`torch.compiler.disable`): its layout estimation
reads tensors back to the host and keeps per-forward caches that a trace cannot hold (dynamo failed on the layout
build's gather once the shapes went dynamic). Everything around it is traced, and the logits, the gradients and the
kept fractions are the uncompiled model's. Backend "eager" here (no inductor subprocesses); the Trainer run
with inductor: tests/integration/test_fused_ops_compile.py; under CP 2: tests/distributed/test_fused_ops_cp.py."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from hf_sparse_cp import SparseAttentionConfig, configure
from hf_sparse_cp.integration.stats import pop_kept_fractions
from hf_sparse_cp.testing.tiny_models import tiny_config

pytestmark = pytest.mark.usefixtures("patched")

PATTERN = SparseAttentionConfig(block_size=16, min_seq_len=64, dense_first_layers=0, vertical_topk=4, slash_topk=4,
                                sink_tokens=2, local_window=16, last_q=8)


def _step(model, ids, **inputs):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids, **inputs)
    out.loss.backward()
    return out.logits.detach(), [p.grad for p in model.parameters()], pop_kept_fractions(model)


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


def _graph_breaks_and_recompiles(model, batches):
    """Per batch: the graph breaks dynamo counted (reason: count) and the recompiles it logged, one step each of the
    model compiled whole (backend "eager": the breaks and guards are dynamo's, whichever backend compiles)."""
    import logging

    from torch._dynamo.utils import counters

    recompiles = []
    handler = logging.Handler()
    handler.emit = lambda record: recompiles.append(record.getMessage())
    log = logging.getLogger("torch._dynamo.guards.__recompiles")
    torch._dynamo.reset()
    torch._logging.set_logs(recompiles=True)
    log.addHandler(handler)
    try:
        compiled, steps = torch.compile(model, backend="eager"), []
        for batch in batches:
            counters.clear()
            recompiles.clear()
            steps.append((_step(compiled, **batch), dict(counters["graph_break"]), list(recompiles),
                          counters["stats"]["unique_graphs"]))
        return steps
    finally:
        log.removeHandler(handler)
        torch._logging.set_logs()
        torch._dynamo.reset()


@pytest.mark.parametrize("model_type, packed", [("gemma3_text", False), ("llama", True)], ids=["window", "packed"])
def test_a_compiled_step_breaks_its_graphs_at_the_attention_calls_only(single_thread, model_type, packed):
    """transformers builds a window's mask, and under torch.compile any batch's (it cannot tell one document from
    packed ones while tracing), as an and-mask of the causal function, which the mask function checked by evaluating
    it and reading the answer back: a graph break (Tensor.item()) in every compiled forward, which split the mask
    build into frames of their own that recompiled for each new length. The check now stays in the graph and its
    answer is read by the first attention call (`call_tokens.check_deferred_masks`): the breaks left are the sparse
    attention calls, which run outside the graphs (`torch.compiler.disable`). Before, 2 layers: 14 breaks (9 of them
    Tensor.item()) on the first step, sparse_cp_mask and _sees_next_key recompiled on the second length. The
    compiled steps' logits and gradients are the uncompiled ones; a third length compiles nothing new."""
    torch.manual_seed(0)
    overrides = ({"sliding_window": 32, "layer_types": ["sliding_attention", "full_attention"]}
                 if model_type == "gemma3_text" else {})  # (the window layer runs dense, the full one sparse)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type, vocab_size=97, use_cache=False, **overrides))
    configure(model, PATTERN)
    layers = model.config.num_hidden_layers

    def batch(length, seed):
        ids = torch.randint(3, 97, (2, length), generator=torch.Generator().manual_seed(seed))
        first = length // 2 + 9  # (packed: two documents per row, the second restarting its positions)
        positions = torch.cat([torch.arange(first), torch.arange(length - first)]) if packed else torch.arange(length)
        return {"ids": ids, "position_ids": positions[None].expand(2, length)}

    batches = [batch(160, 1), batch(192, 2), batch(224, 3)]
    want = _step(model, **batches[0])
    assert min(want[2].values()) < 1  # the sparse path ran
    steps = _graph_breaks_and_recompiles(model, batches)
    (got, breaks, _, _), (_, _, recompiles, _), (_, third_breaks, third_recompiles, third_graphs) = steps
    assert breaks and all("torch.compiler.disable" in reason for reason in breaks), list(breaks)
    assert sum(breaks.values()) <= 5 * layers, breaks
    assert not [r for r in recompiles if "hf_sparse_cp" in r], recompiles
    assert (third_breaks, third_recompiles, third_graphs) == ({}, [], 0)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
    for g, w in zip(got[1], want[1], strict=True):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-7)
    assert got[2] == pytest.approx(want[2], abs=1e-12)
