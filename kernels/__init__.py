"""Triton block-sparse flash-attention kernels (installed as `hf_sparse_cp.kernels`)."""
