# Two commands a newcomer needs: `make demo` and `make test` (README).
PYTHON ?= python3
# The CPU wheel by default; GPU machines: make setup TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"
TORCH ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp

.PHONY: setup demo test lint typecheck pytest bench clean

setup: $(STAMP)

# The installs are what a fresh clone waits for (measured in docs/install.md): say so
# up front, and let pip show what it downloads rather than sit silent for minutes.
$(STAMP): pyproject.toml
	@echo "make: installing torch and batchgen's packages into $(VENV): the one slow step,"
	@echo "make: several minutes on a fresh clone, skipped once done (pip shows its progress)"
	@echo "make: [1/4] a virtualenv in $(VENV)"
	$(PYTHON) -m venv $(VENV)
	@echo "make: [2/4] pip itself"
	$(BIN)/python -m pip install --progress-bar on --upgrade pip
	@echo "make: [3/4] torch ($(TORCH)), the largest download"
	$(BIN)/python -m pip install --progress-bar on $(TORCH)
	@echo "make: [4/4] batchgen and its packages"
	$(BIN)/python -m pip install --progress-bar on -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
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

test: lint typecheck pytest

clean:
	rm -rf $(VENV) build *.egg-info demo
