# The README's two commands are `make demo` and `make test`; each does its own setup.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
LOCK := requirements.lock
STAMP := $(VENV)/.vitp-installed
PYTEST_ARGS ?=

.PHONY: demo test test-quick venv services-up services-down bench lint lock clean

$(STAMP): pyproject.toml $(LOCK)
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c $(LOCK) -e '.[dev]'
	@touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/vitp demo

# Starts the services the tests need (local SLURM cluster when root, MLflow server), runs pytest,
# and stops what it started, whatever pytest's outcome.
test: $(STAMP)
	VITP_PYTHON=$(abspath $(PY)) bash tests/run_with_services.sh $(PYTEST_ARGS)

test-quick: $(STAMP)
	VITP_PYTHON=$(abspath $(PY)) bash tests/run_with_services.sh -m "not slow" $(PYTEST_ARGS)

services-up: $(STAMP)
	VITP_PYTHON=$(abspath $(PY)) bash launch/services/mlflow.sh up
	bash launch/services/slurm.sh up

services-down:
	-bash launch/services/slurm.sh down
	-VITP_PYTHON=$(abspath $(PY)) bash launch/services/mlflow.sh down

# The CPU set: each prints `ratio NAME VALUE` lines, measured side by side in one run.
bench: $(STAMP)
	$(PY) bench/model_step.py
	$(PY) bench/prep.py
	$(PY) bench/loader.py
	$(PY) bench/tracking.py
	$(PY) bench/eval.py

lint: $(STAMP)
	$(VENV)/bin/ruff check pipeline launch data_prep tests bench

# Re-pin requirements.lock from the current venv (after changing pyproject's ranges).
lock:
	$(PY) -m pip freeze --exclude-editable | grep -v '^vitp' > $(LOCK)

clean:
	rm -rf runs .pytest_cache
