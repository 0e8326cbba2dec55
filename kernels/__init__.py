"""Triton block-sparse flash-attention kernels (installed as `hf_sparse_cp.kernels`).

Layers: `block_sparse_fwd` / `block_sparse_bwd` hold the `@triton.jit` kernels and their
launchers (`tiles` the shared device helpers, `configs` the tile shapes, `indexing` the block
summaries and the backward's index structures); `ops` registers them as `torch.library` custom
ops and offers the forward/backward primitives that `hf_sparse_cp.ops` dispatches CUDA tensors
to; `vertical_slash` scores the vertical-slash pattern of a document (what
`hf_sparse_cp.pattern` runs on CUDA), with its fp32 reference; `interpreter` runs the kernels on
CPU tensors through Triton's interpreter (tests, debugging); `sm90` builds them for Hopper without
a GPU and reads the registers, spills and shared memory each build uses.
"""

from .ops import SUPPORTED_DTYPES, sparse_attention_backward, sparse_attention_forward, unsupported

__all__ = ["SUPPORTED_DTYPES", "sparse_attention_backward", "sparse_attention_forward", "unsupported"]
