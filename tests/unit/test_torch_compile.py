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


def _step(model, ids):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids)
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
