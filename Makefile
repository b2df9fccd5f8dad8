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
# built once); tests/conftest.py says what keeps them apart.
# PYTEST_WORKERS=0 runs them in this process, one by one.
PYTEST_WORKERS ?= 2
pytest: $(STAMP)
	$(BIN)/python -m pytest -n $(PYTEST_WORKERS) --dist loadfile

test: lint typecheck pytest

clean:
	rm -rf $(VENV) build *.egg-info demo
