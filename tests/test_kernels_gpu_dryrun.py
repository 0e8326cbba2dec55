"""The bodies of the GPU tests (test_kernels_gpu.py) on CPU, at small sizes, with the Triton kernels
replaced by the PyTorch reference (attention) and by `reference_vertical_slash` (scoring).

This says nothing about the kernels (the interpreter tests check those): it runs the GPU tests' own
code (inputs, layouts, calls, tolerances, model set-up) so that a GPU session does not find them
broken. Left out: the torch.compile test (compiling the reference says nothing about it) and the
fallback-warning test (it needs inputs that the dispatch, patched here, would send to the reference).
"""

import pytest
import torch

from hf_sparse_cp.attention import ops as public_ops
from hf_sparse_cp.attention.layout import SparseLayout
from hf_sparse_cp.attention.merge import merge_attention
from hf_sparse_cp.attention.reference import reference_backward, reference_forward
from hf_sparse_cp.attention.tokens import TokenMeta
from hf_sparse_cp.kernels import ops as kops
from hf_sparse_cp.kernels import vertical_slash as vs

import test_kernels_gpu as gpu

SMALL_SIZES = {"short": 512, "mid": 512, "odd": 511, "long": 768, "longest": 1024, "model": 512}


def _forward(q, k, v, layout, q_tokens, k_tokens, *, scale, block_size, window=None, out=None, lse=None,
             out_in_input_dtype=False, split=None):
    part = reference_forward(q, k, v, SparseLayout(*layout, block_size), scale=scale, q_meta=TokenMeta(*q_tokens),
                             k_meta=TokenMeta(*k_tokens), sliding_window=window)
    if out is not None:
        return merge_attention(out, lse, *part)
    if not out_in_input_dtype:
        return part
    b, h, s, d = q.shape  # the kernels' fresh output: q's dtype in [B, S, H, D] memory
    return torch.empty(b, s, h, d, dtype=q.dtype).transpose(1, 2).copy_(part[0]), part[1]


def _backward(q, k, v, out, lse, dout, layout, q_tokens, k_tokens, *, scale, block_size, window=None, dlse=None,
              deterministic=None, grads_in_input_dtype=False, split=None):
    grads = reference_backward(q, k, v, out, lse, dout, SparseLayout(*layout, block_size), scale=scale,
                               q_meta=TokenMeta(*q_tokens), k_meta=TokenMeta(*k_tokens), sliding_window=window,
                               dlse=dlse)
    return tuple(g.to(x.dtype) for g, x in zip(grads, (q, k, v))) if grads_in_input_dtype else grads


@pytest.fixture
def on_cpu(monkeypatch):
    monkeypatch.setattr(gpu, "DEVICE", "cpu")
    monkeypatch.setattr(gpu, "SIZES", SMALL_SIZES)
    monkeypatch.setattr(kops, "triton_forward", _forward)
    monkeypatch.setattr(kops, "triton_backward", _backward)
    monkeypatch.setattr(vs, "vertical_slash_scores", vs.reference_vertical_slash)
    # CPU tensors take the stand-in kernels
    monkeypatch.setattr(public_ops, "resolve_engine", lambda q, layout, implementation="auto":
                        "reference" if implementation == "reference" else "triton")


@pytest.mark.parametrize("case", list(gpu.CASES))
def test_kernel_case_bodies(on_cpu, case):
    gpu.test_kernels_match_the_reference(case)


def test_column_gradient_form_bodies(on_cpu):
    for separate_columns in (False, True):
        gpu.test_both_forms_of_the_column_gradients_match_the_reference(separate_columns)


def test_attention_bodies(on_cpu, monkeypatch):
    gpu.test_sliding_window_batch_of_two_d64_bf16()
    for dtype in (torch.bfloat16, torch.float16):
        for layout_kind in ("every_causal_block", "vertical_slash"):
            gpu.test_long_rows_of_masked_keys_give_no_nan(dtype, layout_kind)
    gpu.test_merge_into_existing_result_and_backward_per_part()
    gpu.test_deterministic_mode_is_bitwise_reproducible()
    gpu.test_public_function_dispatches_to_the_kernels(monkeypatch)


def test_estimation_bodies(on_cpu):
    gpu.test_scoring_kernel_matches_the_reference_and_is_reproducible()
    gpu.test_estimated_layout_on_cuda_equals_the_cpu_one()


@pytest.mark.parametrize("pattern_name", ["dense", "vertical_slash"])
def test_model_against_reference_path_body(on_cpu, monkeypatch, pattern_name):
    gpu.test_model_under_sparse_cp_uses_the_kernels_and_matches_the_reference_path(monkeypatch, pattern_name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_model_against_sdpa_body(on_cpu, dtype):
    gpu.test_model_under_sparse_cp_matches_sdpa(dtype)
