"""One redaction function for every writer (pipeline/secrets.py): URI userinfo and token-like query
values are masked, everything else is kept byte for byte; a job gets the real value back from its
environment; a resolved config, `vitp config show` and MLflow params hold only the redacted one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.config import flatten, from_dict, load_config, secret_values, to_dict, write_resolved
from pipeline.secrets import ENV, redact, remember, restore, strip

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs/pretrain/tiny_cpu.yaml")


@pytest.mark.parametrize("raw,shown", [
    ("https://bob:pw@h:8443/x?X-Amz-Signature=ab&n=1&X-Amz-Credential=c%2Fd#f",
     "https://***@h:8443/x?X-Amz-Signature=***&n=1&X-Amz-Credential=***#f"),
    ("https://TOKEN@github.com/a/b.git", "https://***@github.com/a/b.git"),
    ("gs://b/o?GoogleAccessId=me&Expires=1700000000&Signature=s", "gs://b/o?GoogleAccessId=***&Expires=***&Signature=***"),
    ("https://acct.blob.core.windows.net/c/x.tar?sv=2022&sig=abc&X-Amz-Security-Token=t",
     "https://acct.blob.core.windows.net/c/x.tar?sv=2022&sig=***&X-Amz-Security-Token=***"),
    ("http://h/?access_token=a&api_key=k&password=p&key=q&page=2", "http://h/?access_token=***&api_key=***&password=***&key=***&page=2"),
    ("API request to http://u:p@h:5/api/2.0/x failed", "API request to http://***@h:5/api/2.0/x failed"),
    ("http://127.0.0.1:5055", "http://127.0.0.1:5055"),
    ("sqlite:////runs/a@b/mlflow.db", "sqlite:////runs/a@b/mlflow.db"),
    ("just text with user:pw@host", "just text with user:pw@host"),
])
def test_redact(raw, shown):
    assert redact(raw) == shown
    assert redact(shown) == shown  # idempotent


def test_strip_drops_the_masked_parts_only():
    assert strip("https://***@h/x?sig=***&n=1&token=***#f") == "https://h/x?n=1#f"
    assert strip("https://***@h/gw?token=***") == "https://h/gw"


def test_config_writes_redacted_and_a_job_restores_from_its_environment(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    uri = "https://alice:s3cret-pw@mlflow.example:8443/gw?token=tok-123&x=1"
    cfg = load_config(TINY, [f"tracking.uri={uri}"])
    assert cfg.tracking.uri == uri  # in memory: the real one
    shown = "https://***@mlflow.example:8443/gw?token=***&x=1"
    assert to_dict(cfg)["tracking"]["uri"] == shown and flatten(cfg)["tracking.uri"] == shown
    text = write_resolved(cfg, tmp_path).read_text()
    assert shown in text and "s3cret" not in text and "tok-123" not in text
    assert secret_values(cfg) == [uri]
    # a job unpickles the redacted dict: without the environment the masked parts are dropped ...
    assert from_dict(to_dict(cfg)).tracking.uri == "https://mlflow.example:8443/gw?x=1"
    # ... with it (what `vitp submit` exports to sbatch / the local executor), the real value comes back
    remember(secret_values(cfg))
    assert json.loads(os.environ[ENV]) == [uri]
    assert from_dict(to_dict(cfg)) == cfg and restore(shown) == uri


def test_config_show_prints_the_redacted_uri():
    r = subprocess.run([sys.executable, "-m", "launch.cli", "config", "show", "--config", TINY,
                        "tracking.uri=http://bob:hunter2hunter2@h:1/?sig=zzz"], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "uri: http://***@h:1/?sig=***" in r.stdout and "hunter2" not in r.stdout and "zzz" not in r.stdout


def test_a_library_log_line_naming_a_request_query_is_masked(monkeypatch, caplog):
    """urllib3's retry warning names the request's path and query, not a whole URI: the token and the
    password this process knows are masked there too."""
    import json
    import logging

    from pipeline import secrets

    uri = "https://bob:pw-4f2a9c@mlflow.example/gw?token=gw-secret-77"
    monkeypatch.setenv(secrets.ENV, json.dumps([uri]))
    secrets.mask_library_logs()
    secrets.mask_library_logs()  # idempotent: one filter
    log = logging.getLogger("urllib3.connectionpool")
    assert sum(isinstance(f, secrets._Masking) for f in log.filters) == 1  # noqa: SLF001
    with caplog.at_level(logging.WARNING, logger="urllib3.connectionpool"):
        log.warning("Retrying (%r) after connection broken by '%r': %s", "Retry(total=6)", "ReadTimeout",
                    "/gw/api/2.0/mlflow/runs/log-batch?token=gw-secret-77 (user bob:pw-4f2a9c)")
    text = caplog.text
    assert "gw-secret-77" not in text and "pw-4f2a9c" not in text
    assert "/gw/api/2.0/mlflow/runs/log-batch?token=***" in text
