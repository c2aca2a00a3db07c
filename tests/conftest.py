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
from tests.shared import built_once  # noqa: E402


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


# `make test` runs the suite as two pytest processes at once (tests/run_with_services.sh): "cluster",
# the tests of the services one after another (they share the cluster and the MLflow server) and
# every test that starts no ranks of its own (unit tests, one-process stages); and "rest", the tests
# marked distributed, whose ranks run here (DeepSpeed over gloo). The first kind mostly waits (on the
# scheduler, a server, a timeout) or uses one core, so beside the second they fill cores one stream
# would leave idle.
STREAM = os.environ.pop("VITP_TEST_STREAM", None)  # not inherited by a pytest a test starts


def in_cluster_stream(item) -> bool:
    # Every test of a shared service runs in this stream: some stop the MLflow server (an outage
    # mid-run) and a test beside them in the other stream would find it down.
    return bool(needs_service(item) or not item.get_closest_marker("distributed"))


def pytest_collection_modifyitems(config, items):
    if STREAM not in ("cluster", "rest"):
        return
    keep = [it for it in items if bool(in_cluster_stream(it)) == (STREAM == "cluster")]
    if len(keep) < len(items):
        config.hook.pytest_deselected(items=[it for it in items if it not in keep])
        items[:] = keep


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


# ── Data several modules read (tests/shared.py: built once per session, also under pytest-xdist) ──────
@pytest.fixture(scope="session")
def corpus_shards(tmp_path_factory) -> Path:
    """`vitp prep` of tests/data_prep_fixtures.build_corpus (3 classes x 12 good images, and one of every
    bad input), ``--val-fraction 0.2 --max-samples-per-shard 16``: >= 2 train shards and a val split.
    Read only: a test that changes it copies it first."""
    from tests.data_prep_fixtures import build_corpus, vitp_prep

    def build(d: Path) -> None:
        build_corpus(d / "images", n_good_per_class=12)
        info = vitp_prep(d / "images", d / "shards", "--val-fraction", "0.2", "--max-samples-per-shard", "16")
        assert len(info["splits"]["train"]["filenames"]) >= 2 and info["splits"]["val"]["num_samples"] > 0

    return built_once(tmp_path_factory, "corpus_shards", build) / "shards"


@pytest.fixture(scope="session")
def tiny_reference(tmp_path_factory):
    """``get(stage, data) -> run dir``: the uninterrupted 6-step tiny pre-training on 2 ranks
    (tests/integration/test_pretrain.py's ``pretrain``: constant lr after warm-up, a checkpoint every 2
    steps) at that ZeRO stage over that data, made once per session on first use, for every test that
    compares a run with it. Read only."""
    import hashlib

    from tests.integration.test_pretrain import SYNTHETIC, pretrain

    def get(stage: int, data: list[str] = SYNTHETIC) -> Path:
        def build(d: Path) -> None:
            assert pretrain(d, f"engine.zero_stage={stage}", data=data) == 0

        key = hashlib.sha1(repr((stage, tuple(data))).encode()).hexdigest()[:10]
        return built_once(tmp_path_factory, f"ref_zero{stage}_{key}", build)

    return get


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
