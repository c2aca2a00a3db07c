"""The local SLURM cluster is real: a submitit job spans both slurmd nodes, one task on each.

Fixture `slurm_cluster` comes from tests/services.py via tests/conftest.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import submitit

ROOT = Path(__file__).resolve().parents[2]


def _poll_done(job, timeout_s: float) -> None:
    # Polls the result file (no accounting DB, so submitit cannot ask sacct); bounded so a stuck job fails.
    deadline = time.monotonic() + timeout_s
    while not job.done():
        if time.monotonic() > deadline:
            pytest.fail(f"job {job.job_id} not done after {timeout_s}s; stderr:\n{job.stderr()}")
        time.sleep(0.5)


@pytest.mark.slurm
def test_two_node_job_gets_one_rank_per_node(slurm_cluster, tmp_path):
    def whereami():
        import os

        import submitit

        env = submitit.JobEnvironment()
        return {
            "rank": env.global_rank,
            "local_rank": env.local_rank,
            "world": env.num_tasks,
            "node": env.hostnames[env.node],
            "slurmd": os.environ["SLURMD_NODENAME"],
            "job_id": env.job_id,
        }

    executor = submitit.AutoExecutor(folder=tmp_path / "jobs", cluster="slurm")
    executor.update_parameters(
        nodes=2,
        tasks_per_node=1,
        cpus_per_task=2,
        timeout_min=5,
        slurm_partition=slurm_cluster.partition,
        name="vitp-services-test",
    )
    job = executor.submit(whereami)
    _poll_done(job, timeout_s=120)
    results = sorted(job.results(), key=lambda r: r["rank"])

    assert [r["rank"] for r in results] == [0, 1]
    assert [r["local_rank"] for r in results] == [0, 0]
    assert [r["world"] for r in results] == [2, 2]
    assert {r["node"] for r in results} == set(slurm_cluster.nodes)
    # submitit's view of the node agrees with slurmd's own name for it.
    assert [r["node"] for r in results] == [r["slurmd"] for r in results]
    assert {r["job_id"] for r in results} == {str(job.job_id)}


@pytest.mark.slurm
@pytest.mark.mlflow_server
def test_run_with_services_leaves_services_it_did_not_start_up(slurm_cluster, mlflow_server):
    """`make test` inside a session whose services are up (the outer run, `make services-up`) uses them
    and leaves them running."""
    r = subprocess.run(["bash", "tests/run_with_services.sh", "-q", "-p", "no:cacheprovider",
                        "tests/unit/test_install_script.py"], cwd=ROOT, capture_output=True, text=True,
                       env={**os.environ, "VITP_PYTHON": sys.executable}, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "MLflow server already up; leaving it up" in r.stdout
    assert "SLURM cluster already up; leaving it up" in r.stdout
    for script in ("slurm.sh", "mlflow.sh"):
        status = subprocess.run(["bash", f"launch/services/{script}", "status"], cwd=ROOT, capture_output=True)
        assert status.returncode == 0, (script, status.stdout)
