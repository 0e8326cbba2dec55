"""An attention engine of one's own (`hf_sparse_cp.attention.register_engine`): named by a config's
attention_engine it computes the pattern's calls, forward and backward, as the built-in engine it stands for; what
the registry cannot run is refused when registered, naming the fix. A worked example for docs/how-it-works.md."""

import pytest
import torch

from hf_sparse_cp import SparseAttentionConfig
from hf_sparse_cp.attention import Engine, register_engine
from hf_sparse_cp.attention.reference import reference_backward, reference_forward
from hf_sparse_cp.attention.sequence import sequence_attention
from hf_sparse_cp.attention.tokens import TokenMeta
from hf_sparse_cp.config.registries import ENGINES, engine_settings


class CountingEngine(Engine):
    """The PyTorch reference, counting the calls it computes."""

    name = "counting"

    def __init__(self):
        self.calls = {"forward": 0, "backward": 0}

    def part(self, call):
        self.calls["forward"] += 1
        return reference_forward(call)

    def part_grads(self, call, out, lse, dout, dlse):
        self.calls["backward"] += 1
        return reference_backward(call, out, lse, dout, dlse)


@pytest.fixture
def registry():
    """The engines' registry, left as it was found."""
    saved = dict(ENGINES)
    yield ENGINES
    ENGINES.clear()
    ENGINES.update(saved)


def _attention(engine: str) -> tuple[torch.Tensor, ...]:
    """(out, dq, dk, dv) of a vertical-slash sequence in fp64 through `engine`."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 150, 16, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    meta = TokenMeta.from_segments(torch.zeros(1, 150, dtype=torch.int32))
    cfg = SparseAttentionConfig(block_size=16, min_seq_len=0, budget_mode="topk", vertical_topk=2, slash_topk=2,
                                sink_tokens=2, local_window=4, last_q=16, attention_engine=engine)
    out, kept = sequence_attention(q, k, v, meta, cfg)
    assert float(kept) < 1.0  # (a sparse layout)
    out.backward(torch.randn(out.shape, generator=g, dtype=out.dtype))
    return out.detach(), q.grad, k.grad, v.grad


def test_a_registered_engine_named_by_the_config_computes_its_calls(registry):
    engine = register_engine(CountingEngine())
    assert engine_settings()[-1] == "counting"
    got, want = _attention("counting"), _attention("reference")
    assert engine.calls["forward"] >= 1 and engine.calls["backward"] >= 1
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert register_engine(CountingEngine()) is not engine  # (its class again: a notebook's cell run again)


def test_the_model_card_names_the_engine_a_config_chose(registry):
    """The card's pattern line named no engine, so a run on an engine of one's own (or a built-in one chosen over
    'auto') read as the kernels' run."""
    from hf_sparse_cp.reporting.model_card import _describe_pattern

    register_engine(CountingEngine())
    assert "; attention engine `counting`;" in _describe_pattern(SparseAttentionConfig(attention_engine="counting"))
    assert "attention engine" not in _describe_pattern(SparseAttentionConfig())  # ('auto': chosen per call)


def test_an_engine_name_no_engine_has_is_refused_naming_register_engine():
    with pytest.raises(ValueError, match=r"attention_engine='counting' \(str\) is not valid: use one of 'auto', "
                                         r"'triton', .* \(an engine of your own: hf_sparse_cp.attention."
                                         r"register_engine\(instance\) first\)"):
        SparseAttentionConfig(attention_engine="counting")


class _Unnamed(Engine):
    def part(self, call):
        return reference_forward(call)


class _NoGradients(CountingEngine):
    name = "no_gradients"
    part_grads = Engine.part_grads


class _Reference(CountingEngine):
    name = "reference"


@pytest.mark.parametrize("engine, error, message", [
    (object(), TypeError, r"register_engine takes an instance of an Engine subclass, not object"),
    (_Unnamed(), ValueError, r"_Unnamed has no `name`"),
    (_NoGradients(), TypeError, r"engine 'no_gradients' \(_NoGradients\) does not implement part_grads or backward: "
                                r"subclass hf_sparse_cp.attention.engines.Engine"),
    (_Reference(), ValueError, r"attention engine 'reference' is already registered \(hf_sparse_cp.attention.engines."
                               r"ReferenceEngine\); give _Reference another `name`"),
])
def test_the_registry_refuses_what_it_cannot_run(registry, engine, error, message):
    with pytest.raises(error, match=message):
        register_engine(engine)
    assert list(registry) == ["triton", "flex", "reference", "masked"]


class _OutAlone(CountingEngine):
    name = "out_alone"

    def part(self, call):
        return reference_forward(call)[0]


class _TwoGradients(CountingEngine):
    name = "two_gradients"

    def part_grads(self, call, out, lse, dout, dlse):
        return reference_backward(call, out, lse, dout, dlse)[:2]


@pytest.mark.parametrize("engine, message", [
    (_OutAlone(), r"attention engine 'out_alone' \(_OutAlone.part\) returned Tensor: it must return \(out, lse\), "
                  r"tensors of shapes \[1, 2, 150, 16\], \[1, 2, 150\]"),
    (_TwoGradients(), r"attention engine 'two_gradients' \(_TwoGradients.part_grads\) returned torch.float64 "
                      r"\[1, 2, 150, 16\], torch.float64 \[1, 2, 150, 16\]: it must return \(dq, dk, dv\)"),
])
def test_what_an_engine_returns_wrongly_is_refused_naming_it_and_what_it_must_return(registry, engine, message):
    """A plug-in's part or part_grads of the wrong kind ended in the merge or autograd ('NoneType' object is not
    subscriptable, a tuple unpacked short, #50)."""
    register_engine(engine)
    with pytest.raises(TypeError, match=message):
        _attention(engine.name)
