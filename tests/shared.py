"""What several test modules build and then only read, built once per test session: prepared
datasets (one per shape of data) and the like.

Under pytest-xdist a session fixture runs once per worker process, so the build itself is what is
shared: each is made in a folder every worker of the session sees, under a file lock, and marked
done only once complete (a build that failed is redone by the next test that asks, which then fails
with the build's own error rather than reading half a dataset).
"""

from __future__ import annotations

import fcntl
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest


def session_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder shared by every process of this test session: the session's base temp folder, or,
    under pytest-xdist (each worker has its own base, ``popen-gwN``), the folder they share."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent
    d = base / "shared"
    d.mkdir(exist_ok=True)
    return d


def built_once(tmp_path_factory: pytest.TempPathFactory, name: str, build: Callable[[Path], None]) -> Path:
    """``build(folder)`` once per session, whichever worker asks first; the others wait on the lock
    and get the same folder. Tests only read what is in it (copy it to change it)."""
    root = session_dir(tmp_path_factory)
    out, done = root / name, root / f"{name}.done"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if this process dies
        if not done.exists():
            shutil.rmtree(out, ignore_errors=True)  # what a failed build left
            out.mkdir()
            build(out)
            done.touch()
    return out
