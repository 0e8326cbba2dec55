"""Helpers for tests and benchmarks, never imported by the training path.

* `tiny_models.py`: a small random-init config of any architecture (tests, smoke benchmarks, the demo's model);
  `tiny_vlms.py`: small vision-language models and batches with an image per row;
* `layouts.py`: random layouts (the one generator of random vertical-slash layouts) and q/k with
  planted vertical-slash structure;
* `spawn.py`: `run_gloo`, a function run in a few local gloo processes (forked from a server that imported what
  they all import, `preload.py`), and `run_cli`, an `hf-sparse-cp` command run as torchrun's processes would;
* `interpreter.py`: the kernels on CPU tensors through Triton's interpreter; `sm90.py`: their Hopper builds
  compiled without a GPU, and what each uses;
* `allocations.py`: the tensors a piece of code allocates and holds (what grows as S^2, without a GPU);
* `benchmarking.py`: timing, profiles and the JSON reports of the benchmarks;
* `accelerate_cp.py`: accelerate's own CP layout (a `ParallelismConfig`, the GPU recipes' path) in CPU test processes;
* `hidden.py`: installed packages hidden from imports (`$HF_SPARSE_CP_TEST_HIDE=triton`: a machine without Triton);
* `pretrained.py`: SmolLM2-135M-Instruct, Gemma 3 270M and a public-domain text from installed packages (`eval`
  extra);
* `pattern_quality.py`, `pattern_limit.py`: what a sparse pattern keeps of a model's real dense attention, and the
  best pattern of a family;
* `retrieval.py`, `kv_recall.py`: long-range tasks (needle retrieval, key-value recall) to train and score.
"""
