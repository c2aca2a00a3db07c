"""Real services for the tests: a three-node SLURM cluster and an MLflow tracking server.

Both are started by the scripts in launch/services/ (the same ones `make` and CI use). A fixture reuses a
service that is already running (the Makefile brings them up once and exports the env vars below),
otherwise it brings the service up for the session and takes it down afterwards — only if it started it.

Env read:
  CI=true               a service that cannot run is a test failure, never a skip
  VITP_SLURM=1          the cluster is already up (launch/services/slurm.sh up ran)
  MLFLOW_TRACKING_URI   an http://127.0.0.1 / localhost server to reuse; other hosts are ignored so that
                        tests never write into a team's real tracking server
  VITP_MLFLOW_PORT      port of the server the fixture starts (default 5055)
  VITP_SERVICES_DIR     state dir of both services (read by the scripts)

Conftest usage: `from tests.services import *` exports the fixtures `slurm_cluster` and `mlflow_server`.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

import pytest

__all__ = ["SlurmCluster", "mlflow_server", "mlflow_start", "mlflow_stop", "slurm_cluster"]

SERVICES = Path(__file__).resolve().parents[1] / "launch" / "services"
SLURM_SH = SERVICES / "slurm.sh"
MLFLOW_SH = SERVICES / "mlflow.sh"


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in {"1", "true", "yes"}


def unavailable(reason: str) -> None:
    """Skip locally, fail in CI: CI promises the real services, so their absence is a bug there."""
    if in_ci():
        pytest.fail(f"CI=true but {reason}", pytrace=False)
    pytest.skip(reason)


def _run(script: Path, action: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(script), action],
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        check=False,
    )


def _check(proc: subprocess.CompletedProcess, what: str) -> str:
    if proc.returncode != 0:
        raise RuntimeError(f"{what} failed (exit {proc.returncode}):\n{proc.stdout}{proc.stderr}")
    return proc.stdout


# ---------------------------------------------------------------------------------------------- SLURM


@dataclass(frozen=True)
class SlurmCluster:
    """The local cluster: submit to `partition`; jobs land on `nodes` (all on this host). A job in
    `urgent` (higher PriorityTier, same nodes) preempts `partition`'s jobs: SIGTERM, GraceTime, requeue.
    `faults` spans `faults_nodes`, one more than `nodes`: a job that leaves a node out runs on the others."""

    partition: str = "debug"
    urgent: str = "urgent"
    nodes: tuple[str, ...] = ("node1", "node2")
    faults: str = "faults"
    faults_nodes: tuple[str, ...] = ("node1", "node2", "node3")


@pytest.fixture(scope="session")
def slurm_cluster():
    """A running SLURM cluster -> SlurmCluster(partition="debug", nodes=("node1", "node2"), faults=...)."""
    if os.environ.get("VITP_SLURM") == "1":
        if _run(SLURM_SH, "status").returncode != 0:
            pytest.fail("VITP_SLURM=1 but launch/services/slurm.sh status says the cluster is down", pytrace=False)
        yield SlurmCluster()
        return
    if os.geteuid() != 0:
        unavailable("the local SLURM cluster needs root (run as root, or `slurm.sh up` and set VITP_SLURM=1)")
    if shutil.which("slurmctld") is None or shutil.which("sbatch") is None:
        unavailable("SLURM is not installed (launch/services/install-debian.sh)")
    started = _run(SLURM_SH, "status").returncode != 0
    if started:
        _check(_run(SLURM_SH, "up"), "launch/services/slurm.sh up")
    try:
        yield SlurmCluster()
    finally:
        if started:
            _check(_run(SLURM_SH, "down"), "launch/services/slurm.sh down")


# --------------------------------------------------------------------------------------------- MLflow


def _reusable_uri() -> str | None:
    uri = os.environ.get("MLFLOW_TRACKING_URI", "")
    parsed = urllib.parse.urlparse(uri)
    if parsed.scheme == "http" and parsed.hostname in {"127.0.0.1", "localhost"}:
        return uri.rstrip("/")
    return None


def _mlflow_env() -> dict[str, str]:
    # The helpers drive the server the fixture uses: the port of a reused URI wins over the default.
    port = os.environ.get("VITP_MLFLOW_PORT", "5055")
    uri = _reusable_uri()
    if uri and urllib.parse.urlparse(uri).port:
        port = str(urllib.parse.urlparse(uri).port)
    return {"VITP_PYTHON": sys.executable, "VITP_MLFLOW_PORT": port}


def _mlflow_uri() -> str:
    return f"http://127.0.0.1:{_mlflow_env()['VITP_MLFLOW_PORT']}"


def mlflow_stop() -> None:
    """Stop the tracking server (simulates an outage mid-run); the store on disk is kept."""
    _check(_run(MLFLOW_SH, "down", _mlflow_env()), "launch/services/mlflow.sh down")


def mlflow_start() -> str:
    """Start the server again on the same port and store; returns its tracking URI once /health answers."""
    _check(_run(MLFLOW_SH, "up", _mlflow_env()), "launch/services/mlflow.sh up")
    return _mlflow_uri()


def _healthy(uri: str) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(f"{uri}/health", timeout=5) as resp:
            return resp.status == 200
    except OSError:
        return False


@pytest.fixture(scope="session")
def mlflow_server():
    """A running MLflow tracking server on 127.0.0.1 -> its URI, e.g. "http://127.0.0.1:5055".

    Tests share the server and its store across sessions: give each test its own experiment name.
    """
    uri = _reusable_uri()
    if uri is not None:
        if not _healthy(uri):
            pytest.fail(f"MLFLOW_TRACKING_URI={uri} does not answer /health", pytrace=False)
        yield uri
        return
    if shutil.which("curl") is None:
        unavailable("curl is not installed (launch/services/mlflow.sh polls /health with it)")
    started = _run(MLFLOW_SH, "status", _mlflow_env()).returncode != 0
    if started:
        _check(_run(MLFLOW_SH, "up", _mlflow_env()), "launch/services/mlflow.sh up")
    try:
        yield _mlflow_uri()
    finally:
        if started:
            _check(_run(MLFLOW_SH, "down", _mlflow_env()), "launch/services/mlflow.sh down")
