"""Example training scripts (installed as `hf_sparse_cp.examples` so the CLI can run them)."""
