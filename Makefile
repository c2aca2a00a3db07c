# The README's two commands are `make demo` and `make test`; each does its own setup.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
LOCK := requirements.lock
STAMP := $(VENV)/.vitp-installed
# The torch floor: vitp installed beside the oldest torch it admits (requirements-floor.txt), the way
# it is installed over a cluster image's own torch; the other packages follow the lock.
FLOOR_VENV := .venv-floor
FLOOR_PY := $(FLOOR_VENV)/bin/python
FLOOR_REQ := requirements-floor.txt
FLOOR_STAMP := $(FLOOR_VENV)/.vitp-installed
PYTEST_ARGS ?=

.PHONY: demo test test-quick venv floor-venv services-up services-down bench bench-img2dataset gpu-wheels gpu-check \
	lint lock clean

# A fresh Debian python3 cannot create a venv without python3-venv: installed when root with apt,
# else install-debian.sh says in one line what to run.
$(STAMP): pyproject.toml $(LOCK)
	@test -x $(PY) || $(PYTHON) -c 'import ensurepip, venv' 2>/dev/null || bash launch/services/install-debian.sh venv
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c $(LOCK) -e '.[dev]'
	@touch $(STAMP)

venv: $(STAMP)

# torch first (the registry's build: CUDA, with its nvidia wheels, as a GPU image has), then the lock
# without torch's own packages, then the project, all without resolving again: torch must stay the one
# installed. torchvision (timm's dependency; only RandAugment/mixup and bench/ use it) is left out: an
# image's own torchvision matches its torch, and the lock's is built for the lock's torch.
$(FLOOR_STAMP): pyproject.toml $(LOCK) $(FLOOR_REQ)
	@test -x $(FLOOR_PY) || $(PYTHON) -m venv $(FLOOR_VENV)
	$(FLOOR_PY) -m pip install -q --upgrade pip
	$(FLOOR_PY) -m pip install -q -r $(FLOOR_REQ)
	grep -vE '^(torch|torchvision|triton|nvidia-|cuda-)' $(LOCK) > $(FLOOR_VENV)/others.txt
	$(FLOOR_PY) -m pip install -q --no-deps -r $(FLOOR_VENV)/others.txt
	$(FLOOR_PY) -m pip install -q --no-deps -e .
	$(FLOOR_PY) -c 'import sys, torch; v = open("$(FLOOR_REQ)").read().split("torch==")[1].split()[0]; \
	  sys.exit(0 if torch.__version__.split("+")[0] == v else f"$(FLOOR_VENV): torch {torch.__version__}, not {v}")'
	@touch $(FLOOR_STAMP)

floor-venv: $(FLOOR_STAMP)

demo: $(STAMP)
	$(VENV)/bin/vitp demo

# Installs the Debian packages the services need when missing (root with apt; else one line says what
# to run), starts the services (local SLURM cluster when root, MLflow server), runs pytest, and stops
# what it started, whatever pytest's outcome. Two pytest processes at once (VITP_TEST_STREAMS=2: the tests of
# the services, serially, with the tests that start no ranks; beside them the multi-rank tests), as the first
# kind leaves a core idle while it waits.
test: $(STAMP) $(FLOOR_STAMP)
	VITP_TEST_STREAMS=2 VITP_PYTHON=$(abspath $(PY)) VITP_FLOOR_PYTHON=$(abspath $(FLOOR_PY)) bash tests/run_with_services.sh $(PYTEST_ARGS)

test-quick: $(STAMP)
	VITP_TEST_STREAMS=2 VITP_PYTHON=$(abspath $(PY)) bash tests/run_with_services.sh -m "not slow" $(PYTEST_ARGS)

services-up: $(STAMP)
	bash launch/services/install-debian.sh services
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
	$(PY) bench/loader_remote.py
	$(PY) bench/tracking.py
	$(PY) bench/eval.py
	$(PY) bench/fewshot_eval.py
	$(PY) bench/patch_drop_quality.py
	$(PY) bench/checkpoint.py
	$(PY) bench/resume_world.py

# The peer for `vitp prep`: img2dataset in its own venv (never a vitp dependency), same images and
# worker count, over loopback HTTP; prints `ratio prep_vs_img2dataset`.
PEER_VENV := .bench-venv/img2dataset
$(PEER_VENV)/bin/img2dataset:
	$(PYTHON) -m venv $(PEER_VENV)
	$(PEER_VENV)/bin/python -m pip install -q img2dataset

bench-img2dataset: $(STAMP) $(PEER_VENV)/bin/img2dataset
	$(PY) bench/prep.py --img2dataset $(abspath $(PEER_VENV))/bin/img2dataset --only-img2dataset

# The GPU machine's check (bench/gpu_check.py). `make gpu-wheels` (here, with a package registry) writes
# the cp312 wheels its image lacks into GPU_WHEELS; `make gpu-check` (there, beside them) runs in at
# most 5 minutes and writes at most 8 files into GPU_CHECK_OUT; GPU_CHECK_SMOKE=1 runs every part on
# this CPU; GPU_CHECK_PARTS=a,b runs those parts alone. Neither touches an existing .venv (gpu-wheels
# builds one only where there is none); on the GPU machine, with no .venv, the image's python3 runs it.
GPU_WHEELS ?= .gpu-wheels
GPU_CHECK_OUT ?= .gpu-check/out
GPU_CHECK_WORK ?= .gpu-check
GPU_CHECK_PY ?= $(shell test -x $(PY) && echo $(PY) || echo python3)

gpu-wheels:
	@test -x $(PY) || $(MAKE) venv
	$(PY) bench/gpu_wheels.py --out $(GPU_WHEELS)

gpu-check:
	$(GPU_CHECK_PY) bench/gpu_check.py --wheels $(GPU_WHEELS) --out $(GPU_CHECK_OUT) --work $(GPU_CHECK_WORK) \
	  $(if $(GPU_CHECK_SMOKE),--smoke) $(if $(GPU_CHECK_PARTS),--parts $(GPU_CHECK_PARTS))

lint: $(STAMP)
	$(VENV)/bin/ruff check pipeline launch data_prep tests bench

# Re-pin requirements.lock from the current venv (after changing pyproject's ranges).
lock:
	$(PY) -m pip freeze --exclude-editable | grep -v '^vitp' > $(LOCK)

clean:
	rm -rf runs .pytest_cache
