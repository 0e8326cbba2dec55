"""The long-context training example that `hf-sparse-cp train` runs, and its demo data (passkey retrieval, a
byte tokenizer built in code, a tiny random-init model), installed as `hf_sparse_cp.examples`."""
