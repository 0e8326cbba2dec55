"""A model set up for sparse_cp skips the Hub `kernels` package's per-forward routing of its attention's functions
while none is kernelized (`integration.kernel_routing`): that routing is a side effect the trace of an
activation-checkpointed layer refuses, so each checkpointed layer of a compiled model broke the graph
(`tests/unit/test_torch_compile.py` counts the graphs)."""

import copy
import io
import types

import pytest
import torch
from transformers import AutoModelForCausalLM

from hf_sparse_cp.integration.kernel_routing import route_kernel_funcs, unroute_kernel_funcs
from hf_sparse_cp.integration.registration import guard_registration
from hf_sparse_cp.testing.tiny_models import tiny_config

pytest.importorskip("kernels")


def _model(layers: int = 2) -> torch.nn.Module:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama", num_hidden_layers=layers), attn_implementation="sdpa")
    if not any("_kernel_funcs" in m.__dict__ for m in model.modules()):
        pytest.skip("this transformers release routes no function of Llama's attention through `kernels`")
    return model


def _routed(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if "_kernel_funcs" in m.__dict__]


def test_the_registration_guard_skips_the_routing_and_its_removal_restores_it():
    model = _model()
    routed = _routed(model)
    ids = torch.randint(0, 97, (2, 64))
    reference = model(input_ids=ids).logits
    unguard = guard_registration(model)  # (what configure adds to a model it switches to sparse_cp)
    assert all("forward" in m.__dict__ for m in routed) and len(routed) == 2
    torch.testing.assert_close(model(input_ids=ids).logits, reference, rtol=0, atol=0)  # (the same function runs)
    buffer = io.BytesIO()
    torch.save(model, buffer)  # (a copy gets its own forwards: pickled, the class's function found by name)
    buffer.seek(0)
    for copied in (copy.deepcopy(model), torch.load(buffer, weights_only=False)):
        forwards = [m.__dict__["forward"] for m in _routed(copied)]
        assert len(forwards) == 2 and all(f.module is m for f, m in zip(forwards, _routed(copied), strict=True))
        torch.testing.assert_close(copied(input_ids=ids).logits, reference, rtol=0, atol=0)
    unguard()
    assert not any("forward" in m.__dict__ for m in routed)
    assert unroute_kernel_funcs(model) == 2 and route_kernel_funcs(model) and not route_kernel_funcs(model)


def test_a_kernelized_function_still_runs_through_the_routing():
    """Once `kernelize` gives a function's private copy a forward of its own, the module's calls run it."""
    model = _model()
    unroute_kernel_funcs(model)
    calls = []
    def kernel(self, *args, **kwargs):  # (a kernel computing what the function computes)
        calls.append(self)
        return type(self).forward(self, *args, **kwargs)

    for module in _routed(model):
        for func in module._kernel_funcs.values():
            func.forward = types.MethodType(kernel, func)
    model(input_ids=torch.randint(0, 97, (1, 32)))
    assert len(calls) == 2  # (one rotary call per layer, through each layer's own copy)
