# Two commands a newcomer needs: `make demo` and `make test` (README).
PYTHON ?= python3
# The CPU wheel by default; GPU machines: make setup TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"
TORCH ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp

.PHONY: setup demo test lint typecheck pytest bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH)
	$(BIN)/python -m pip install -q -e '.[dev]'
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
