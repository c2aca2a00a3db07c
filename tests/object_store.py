"""Object stores for the tests, started for real on loopback: an S3-compatible server and an HTTP server.

- S3: moto's standalone server (``moto_server``, the ``moto[server]`` dev extra; s3fs's own tests use
  it). Clients find it through botocore's own ``AWS_ENDPOINT_URL``, with throwaway credentials.
- HTTP: Debian's nginx serving a folder (static files, ``Range`` requests, 404s), as a dataset behind
  a plain web server is served.

Each runs in its own process group and is stopped by the fixture that started it (tests/conftest.py:
``s3_server`` once per session, ``s3_bucket`` a fresh bucket per test, ``http_folder`` per test).
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from tests.auth_services import free_port, run_nginx, stop_process, wait_ok
from tests.services import unavailable

_buckets = itertools.count()


@dataclass
class S3Server:
    endpoint: str  # http://127.0.0.1:PORT
    proc: subprocess.Popen

    @property
    def env(self) -> dict[str, str]:
        """What a client process needs to reach this server (botocore's own variables)."""
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": "testing",
                "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}

    def make_bucket(self, prefix: str = "vitp-test") -> str:
        """A new, empty bucket; returns its name."""
        import boto3

        name = f"{prefix}-{os.getpid()}-{next(_buckets)}"
        boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id="testing",
                     aws_secret_access_key="testing", region_name="us-east-1").create_bucket(Bucket=name)
        return name


def start_s3(d: Path) -> S3Server:
    exe = Path(sys.executable).with_name("moto_server")
    if not exe.exists():
        unavailable("moto_server is not installed (the dev extra installs moto[server])")
    d.mkdir(parents=True, exist_ok=True)
    port = free_port()
    log = d / "moto.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([str(exe), "-H", "127.0.0.1", "-p", str(port)], stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    endpoint = f"http://127.0.0.1:{port}"
    try:
        wait_ok(f"{endpoint}/moto-api/", proc, "moto_server", log)
    except Exception:
        stop_process(proc)
        raise
    return S3Server(endpoint, proc)


NGINX_STATIC = """
    default_type application/octet-stream;
    sendfile on;
    server {{
        listen 127.0.0.1:{port};
        root {root};
        location = /health {{ return 200; }}
        location /forbidden/ {{ return 403; }}
    }}
"""


def start_http(d: Path, root: Path) -> tuple[subprocess.Popen, str]:
    """nginx serving ``root`` read-only at the returned base URL (``/forbidden/...`` answers 403)."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    return run_nginx(d, NGINX_STATIC.format(port=port, root=Path(root).resolve()), f"{base}/health"), base
