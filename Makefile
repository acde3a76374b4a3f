# The README's two commands. Each creates .venv and installs what it needs on first run.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The CPU wheel of torch 2.13.0 lies on disk here; an unpinned torch would pull a multi-GB CUDA build.
TORCH := torch==2.13.0

MODEL ?= tiny
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: serve test lint typecheck unit test-slow clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e '.[runtime,operator,bench,test]'
	touch $(STAMP)

serve: $(STAMP)
	$(BIN)/chunkwise serve --model $(MODEL) --host $(HOST) --port $(PORT)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(BIN)/mypy

unit: $(STAMP)
	$(BIN)/pytest -q -m "not slow" --timeout=600

test: lint typecheck unit

test-slow: $(STAMP)
	$(BIN)/pytest -q -m slow

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
