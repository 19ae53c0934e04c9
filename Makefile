# Two commands: `make run` (set up, then train the default experiment) and `make test` (the default
# test tier); `make test-all` is the full suite (CI runs it, and `make test STACK=current`).
# Works from any folder: `make -f /path/to/checkout/Makefile run` trains in the current one.
ROOT   := $(dir $(abspath $(lastword $(MAKEFILE_LIST))))
# Two tested stacks (docs/compatibility.md): STACK=ort (the default) is every backend on Python
# 3.11, ORT's training build and torch 2.6 (constraints.txt); STACK=current is Python 3.12 with the
# newest torch, numpy, transformers and MLflow (constraints-current.txt) and no ORT: every backend
# but ORT's, and the tests that need ORT left out (counted in the summary).
STACK  ?= ort
ifeq ($(STACK),ort)
PYTHON ?= python3.11
VENV   ?= $(ROOT).venv
EXTRAS := test,ort,hf,server,lamb
CONSTRAINTS := $(ROOT)constraints.txt
READY  := $(VENV)/.ortmodule-extensions
else ifeq ($(STACK),current)
PYTHON ?= python3.12
VENV   ?= $(ROOT).venv-current
EXTRAS := test,hf,server,serve,lamb
CONSTRAINTS := $(ROOT)constraints-current.txt
READY  := $(VENV)/.installed
else
$(error STACK=$(STACK): allowed: ort (Python 3.11, every backend; the default) or current (Python 3.12, the newest torch, no ORT))
endif
PY_VERSION := $(if $(filter current,$(STACK)),3.12,3.11)
BIN    := $(VENV)/bin

.PHONY: setup run test test-all test-long lint coverage bench ui server screenshots clean

# The virtual environment, with the stack's pins and this package, editable.
$(VENV)/.installed: $(ROOT)pyproject.toml $(CONSTRAINTS)
	$(PYTHON) -c 'import sys; v = "$(PY_VERSION)"; assert "%d.%d" % sys.version_info[:2] == v, f"STACK=$(STACK) is tested on Python {v}; set PYTHON=..."'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c $(CONSTRAINTS) -e '$(ROOT)[$(EXTRAS)]'
	touch $@

# ORTModule's C++ extensions (the ORT stack), compiled once against the installed torch (about 3
# minutes on 2 cores).
$(VENV)/.ortmodule-extensions: $(VENV)/.installed
	$(BIN)/python -c 'from orchestrate.backends.ortmodule import ensure_extensions; ensure_extensions()'
	touch $@

setup: $(READY)

run: setup
	$(BIN)/python -m orchestrate $(ARGS)

# The default tier: everything shown in one process, on one Ray instance and one MLflow server.
test: setup
	$(BIN)/python -m pytest $(ARGS)

# The full suite: the default tier and the tests marked slow (process boundaries, clusters, the README).
test-all: setup
	$(BIN)/python -m pytest --runslow $(ARGS)

# Every case: the full suite and the tests marked long (the other cases of families CI runs a
# representative of; each names the test that stands for it). Before a release, or after changing
# what such a case goes through.
test-long: setup
	$(BIN)/python -m pytest --runslow --runlong $(ARGS)

# ruff's linter over the tree, as configured in pyproject.toml (CI runs it before the tests).
lint: setup
	$(BIN)/ruff check $(ROOT)

# Line coverage of orchestrate/ over the full suite, subprocesses and Ray workers included (every
# process writes its data beside the checkout's .coverage, whatever folder it runs in).
coverage: setup
	COVERAGE_FILE=$(ROOT).coverage $(BIN)/python -m pytest --runslow --cov --cov-report=term $(ARGS)

bench: setup
	$(BIN)/python $(ROOT)benchmarks/backends.py $(ARGS)

ui:
	@$(BIN)/python -c 'from orchestrate.tracking.stores import runs_pages; print(*runs_pages("sqlite:///mlflow.db"), sep="\n")'
	$(BIN)/mlflow ui --backend-store-uri sqlite:///mlflow.db --host 127.0.0.1 --port 5000

# The team's MLflow server: its own PostgreSQL in ./mlflow-server, artifacts served, on 127.0.0.1:5000.
server: setup
	$(BIN)/python -m orchestrate server $(ARGS)

# The MLflow UI pictures of docs/tracking.md (docs/mlflow_*.png): a backend sweep, then headless Chromium
# (Debian's `chromium`) driven by Playwright (the `docs` extra).
screenshots: setup
	$(BIN)/pip install -q -c $(CONSTRAINTS) -e '$(ROOT)[$(EXTRAS),docs]'
	$(BIN)/python $(ROOT)scripts/mlflow_ui_screenshot.py $(ARGS)

clean:
	rm -rf $(VENV) outputs multirun mlruns mlartifacts mlflow.db
