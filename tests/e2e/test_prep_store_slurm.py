"""On the local SLURM cluster with a real S3 server (moto on loopback): `vitp submit prep` as an array
writes the same objects as a single-process prep, and `vitp submit` refuses a bad dataset address
before anything is queued."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from data_prep import prep
from launch.jobs import read_index
from tests.data_prep_fixtures import build_corpus, tree_bytes
from tests.integration.test_prep_store import body, objects

ROOT = Path(__file__).resolve().parents[2]
RES = "configs/cluster/local_debug.yaml"

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


def cli(args: list, timeout: int = 900) -> subprocess.CompletedProcess:
    # the job inherits this environment (sbatch exports it): AWS_ENDPOINT_URL and the test credentials
    return subprocess.run([sys.executable, "-m", "launch.cli", *map(str, args)], capture_output=True, text=True,
                          cwd=ROOT, env=dict(os.environ), timeout=timeout)


def queued() -> set[str]:
    r = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True, check=True)
    return set(r.stdout.split())


def test_prep_array_to_s3_matches_local_prep(slurm_cluster, s3_bucket, tmp_path):
    src = tmp_path / "images"
    build_corpus(src, n_good_per_class=3)
    prep(src, tmp_path / "local", max_samples_per_shard=4, progress=False)
    url = f"{s3_bucket}/array"
    r = cli(["submit", "prep", src, url, "--tasks", "3", "--max-samples-per-shard", "4", "--resources", RES,
             f"cluster.log_dir={tmp_path / 'jobs'}", "--wait"])
    assert r.returncode == 0, r.stdout + r.stderr
    tasks = [e["job_id"] for e in read_index(tmp_path / "jobs")]
    assert len(tasks) == 3 and len({t.split("_")[0] for t in tasks}) == 1  # one array
    local = tree_bytes(tmp_path / "local")
    shards = [n for n in local if n.endswith(".tar")]
    assert len(shards) >= 3
    objs = objects(url)
    assert set(objs) == set(local) | {n.replace(".tar", "_stats.json") for n in shards}
    differ = [n for n in local if body(url, n) != local[n]]
    assert differ == []
    assert json.loads(body(url, "_info.json"))["splits"]["train"]["filenames"] == sorted(shards)


def test_submit_refuses_bad_dataset_addresses_before_queueing(slurm_cluster, s3_bucket, http_folder, tmp_path):
    (tmp_path / "site" / "forbidden").mkdir(parents=True)
    base = http_folder(tmp_path / "site")
    before = queued()
    cases = {
        "s3://no-such-bucket-vitp/ds": "data.path: s3://no-such-bucket-vitp/ds/_info.json: not found",
        f"{base}/forbidden/ds?X-Amz-Signature=SECRET": f"data.path: {base}/forbidden/ds/_info.json: HTTP 403",
        f"{base}/nope": f"data.path: {base}/nope/_info.json: HTTP 404 Not Found",
    }
    for address, expect in cases.items():
        r = cli(["submit", "pretrain", "--config", "configs/pretrain/tiny_cpu.yaml", "--resources", RES,
                 f"data.path={address}", f"run.dir={tmp_path / 'run'}", f"cluster.log_dir={tmp_path / 'jobs'}"],
                timeout=120)
        err = r.stderr.strip().splitlines()
        assert r.returncode == 2, r.stdout + r.stderr
        assert len(err) == 1 and err[0].startswith(f"error: {expect}"), err
        assert "SECRET" not in r.stdout + r.stderr
    r = cli(["submit", "prep", tmp_path / "site", "s3://no-such-bucket-vitp/ds", "--tasks", "2", "--resources", RES,
             f"cluster.log_dir={tmp_path / 'jobs'}"], timeout=120)
    assert r.returncode == 2 and r.stderr.strip() == (
        "error: OUT: s3://no-such-bucket-vitp/ds: no such bucket 'no-such-bucket-vitp'")
    assert queued() == before and not (tmp_path / "jobs").exists()
