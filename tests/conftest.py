"""Shared fixtures. Service fixtures (SLURM cluster, MLflow server) live in tests/services.py."""

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

os.environ.setdefault("DS_ACCELERATOR", "cpu")

try:
    from tests.services import *  # noqa: F401,F403  (service fixtures)
except ImportError as e:  # only while the services module is being written
    if "tests.services" not in str(e):
        raise


@pytest.fixture
def repo_root() -> Path:
    return ROOT
