"""Helpers for tests and benchmarks, never imported by the training path.

* `layouts.py`: random layouts (the one generator of random vertical-slash layouts) and q/k with
  planted vertical-slash structure;
* `spawn.py`: `run_gloo`, a function run in a few local gloo processes (forked from a server that imported what
  they all import, `preload.py`);
* `packing.py`: packed rows of documents (length mixes, per-document patterns in any split's order);
* `benchmarking.py`: timing, profiles and the JSON reports of the benchmarks;
* `hidden.py`: installed packages hidden from imports (`$HF_SPARSE_CP_TEST_HIDE=triton`: a machine without Triton);
* `pretrained.py`: SmolLM2-135M-Instruct and a public-domain text from installed packages (`eval` extra);
* `pattern_quality.py`: what a sparse pattern keeps of a model's real dense attention (recall, error).
"""
