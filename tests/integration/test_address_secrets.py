"""Credentials in a dataset's addresses or in the environment never reach a file of the run, its
MLflow run (the real server) or what the commands print: a run reads signed shard URLs
(``...?X-Amz-Signature=SECRET``, served by nginx) with an AWS secret key in its environment."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import mlflow.tracking as mlflow_tracking
import pytest

from data_prep import prep
from tests.data_prep_fixtures import build_corpus

REPO = Path(__file__).resolve().parents[2]
SIGNATURE = "SIGNATURE-0d1e2f"
AWS_SECRET = "vitp-test-aws-secret-9c8b"


def files_holding(root: Path, secret: str) -> list[str]:
    return [str(p) for p in root.rglob("*") if p.is_file() and secret.encode() in p.read_bytes()]


@pytest.mark.mlflow_server
@pytest.mark.slow
def test_signed_shard_urls_and_aws_secret_reach_no_run_file_nor_mlflow(mlflow_server, http_folder, tmp_path):
    build_corpus(tmp_path / "images", n_good_per_class=8)
    prep(tmp_path / "images", tmp_path / "site" / "ds", max_samples_per_shard=8, val_fraction=0.25, progress=False)
    base = http_folder(tmp_path / "site")
    # a description whose shards are signed URLs (the form a pre-signed dataset takes)
    signed = tmp_path / "signed"
    signed.mkdir()
    info = json.loads((tmp_path / "site" / "ds" / "_info.json").read_text())
    for sp in info["splits"].values():
        sp["filenames"] = [f"{base}/ds/{f}?X-Amz-Expires=600&X-Amz-Signature={SIGNATURE}" for f in sp["filenames"]]
    (signed / "_info.json").write_text(json.dumps(info))
    experiment = f"vitp-secrets-{uuid.uuid4().hex[:8]}"
    run = tmp_path / "run"
    env = {**os.environ, "MLFLOW_TRACKING_URI": mlflow_server, "AWS_ACCESS_KEY_ID": "testing",
           "AWS_SECRET_ACCESS_KEY": AWS_SECRET}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    r = subprocess.run([sys.executable, "-m", "launch.cli", "pretrain", "--config", "configs/pretrain/tiny_cpu.yaml",
                        f"data.path={signed}", f"run.dir={run}", "train.steps=4", "checkpoint.every=2",
                        "train.log_every=2", "data.workers=0", f"tracking.experiment={experiment}"],
                       cwd=REPO, capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    for secret in (SIGNATURE, AWS_SECRET):
        assert secret not in r.stdout + r.stderr
        assert files_holding(run, secret) == []

    client = mlflow_tracking.MlflowClient(tracking_uri=mlflow_server)
    exp = client.get_experiment_by_name(experiment)
    (mlrun,) = client.search_runs([exp.experiment_id])
    logged = json.dumps({"params": mlrun.data.params, "tags": mlrun.data.tags,
                         "inputs": [[d.dataset.source, d.dataset.name, d.dataset.profile]
                                    for d in (mlrun.inputs.dataset_inputs if mlrun.inputs else [])]})
    assert mlrun.data.metrics and SIGNATURE not in logged and AWS_SECRET not in logged
    got = Path(client.download_artifacts(mlrun.info.run_id, "", str(tmp_path / "artifacts")))
    assert any(p.is_file() for p in got.rglob("*"))
    for secret in (SIGNATURE, AWS_SECRET):
        assert files_holding(got, secret) == []
