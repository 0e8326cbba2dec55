"""Example training scripts and their demo data (passkey retrieval, a byte tokenizer built in code),
and the cluster simulator's report (`simulate_cluster.py`), installed as `hf_sparse_cp.examples`
so the CLI can run them."""
