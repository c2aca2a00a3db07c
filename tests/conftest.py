"""Shared fixtures. Service fixtures (SLURM cluster, MLflow server) live in tests/services.py."""

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

os.environ.setdefault("DS_ACCELERATOR", "cpu")

from tests.services import *  # noqa: E402,F401,F403  (service fixtures)
from tests.services import in_ci  # noqa: E402


@pytest.fixture
def repo_root() -> Path:
    return ROOT


@pytest.fixture(autouse=True)
def _environment_as_found():
    """A stage run inside the test process exports the torch.distributed variables
    (pipeline.distributed.setup: WORLD_SIZE=1, ...); the next test starts from the environment this
    one found, whatever it ran, and with the torch thread count it found (setup sets the config's:
    cluster.cpus_per_task)."""
    saved = dict(os.environ)
    torch = sys.modules.get("torch")
    threads = torch.get_num_threads() if torch else None
    yield
    os.environ.clear()
    os.environ.update(saved)
    if threads is not None and torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


SERVICE_MARKS = ("mlflow_server", "slurm")
SERVICE_FIXTURES = ("mlflow_server", "slurm_cluster")


def needs_service(item) -> bool:
    return (any(item.get_closest_marker(m) for m in SERVICE_MARKS)
            or any(f in getattr(item, "fixturenames", ()) for f in SERVICE_FIXTURES))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """CI promises the real services: a test that needs one and skipped (for whatever reason, an
    importorskip included) fails there; locally it stays a skip."""
    outcome = yield
    rep = outcome.get_result()
    if rep.skipped and not hasattr(rep, "wasxfail") and in_ci() and needs_service(item):
        reason = rep.longrepr[2] if isinstance(rep.longrepr, tuple) else str(rep.longrepr)
        rep.outcome = "failed"
        rep.longrepr = f"CI=true: {item.nodeid} needs a real service and was skipped: {reason}"


# ── Object stores on loopback (tests/object_store.py) ──────────────────────────────────────────────
@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """moto's S3-compatible server on 127.0.0.1, once per session."""
    from tests.auth_services import stop_process
    from tests.object_store import start_s3

    server = start_s3(tmp_path_factory.mktemp("s3"))
    try:
        yield server
    finally:
        stop_process(server.proc)


@pytest.fixture
def s3_bucket(s3_server, monkeypatch) -> str:
    """``s3://<fresh bucket>``, with this process's environment pointing botocore at the test server
    (subprocesses started from the test inherit it)."""
    for k, v in s3_server.env.items():
        monkeypatch.setenv(k, v)
    return f"s3://{s3_server.make_bucket()}"


@pytest.fixture
def http_folder(tmp_path):
    """``serve(folder) -> base URL``: nginx serving a folder over HTTP on 127.0.0.1 for this test."""
    from tests.auth_services import stop_process
    from tests.object_store import start_http

    procs = []

    def serve(root) -> str:
        proc, base = start_http(tmp_path / f"nginx{len(procs)}", root)
        procs.append(proc)
        return base

    yield serve
    for p in procs:
        stop_process(p)
