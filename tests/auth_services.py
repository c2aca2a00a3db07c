"""A login-protected MLflow server behind a TLS proxy, started for real on loopback by a test module.

- MLflow's basic-auth app (``mlflow server --app-name basic-auth``, the ``mlflow[auth]`` extra) with its
  own SQLite stores and auth config; users are made and re-passworded through its REST API.
- Debian's nginx in front of it with TLS, its certificate signed by a CA this module makes with openssl
  (clients trust it through ``MLFLOW_TRACKING_SERVER_CERT_PATH``). ``/gw`` is a token gateway: a tracking
  URI ``https://HOST/gw?token=T`` reaches MLflow only with the right token (a secret in a query).

Both run in their own process groups and are stopped by the fixture that started them.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from tests.services import unavailable

ADMIN, ADMIN_PW = "admin", "admin-password-123"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class AuthServer:
    http: str  # the MLflow server itself (plain HTTP, loopback)
    https: str  # the same through nginx with TLS
    ca: Path  # the CA that signed nginx's certificate
    token: str  # the gateway's token: f"{https}/gw?token={token}" reaches MLflow
    artifacts: Path

    def _call(self, method: str, path: str, body: dict) -> dict:
        req = urllib.request.Request(f"{self.http}{path}", data=json.dumps(body).encode(), method=method,
                                     headers={"Content-Type": "application/json", "Authorization": "Basic " +
                                              base64.b64encode(f"{ADMIN}:{ADMIN_PW}".encode()).decode()})
        with urllib.request.urlopen(req, timeout=30) as r:
            return json.loads(r.read() or b"{}")

    def create_user(self, name: str, password: str) -> None:
        self._call("POST", "/api/2.0/mlflow/users/create", {"username": name, "password": password})

    def set_password(self, name: str, password: str) -> None:
        self._call("PATCH", "/api/2.0/mlflow/users/update-password", {"username": name, "password": password})

    def admin_env(self) -> dict[str, str]:
        return {"MLFLOW_TRACKING_USERNAME": ADMIN, "MLFLOW_TRACKING_PASSWORD": ADMIN_PW}


def _sh(*cmd: str, cwd: Path) -> None:
    subprocess.run(cmd, cwd=cwd, check=True, capture_output=True)


def make_ca(d: Path) -> tuple[Path, Path, Path]:
    """(ca.pem, server.pem, server.key): a CA and a certificate for 127.0.0.1 signed by it."""
    d.mkdir(parents=True, exist_ok=True)
    _sh("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=vitp test CA",
        "-keyout", "ca.key", "-out", "ca.pem", cwd=d)
    _sh("openssl", "req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1", "-keyout", "server.key",
        "-out", "server.csr", cwd=d)
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    _sh("openssl", "x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
        "-days", "2", "-extfile", "san.ext", "-out", "server.pem", cwd=d)
    return d / "ca.pem", d / "server.pem", d / "server.key"


def wait_ok(url: str, proc: subprocess.Popen, what: str, log: Path, timeout: float = 120, **kw) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited ({proc.returncode}): {log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=5, **kw) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.3)  # polling a condition (the port answers), not a guess at a duration
    raise RuntimeError(f"{what} did not answer {url} within {timeout}s: {log.read_text()[-3000:]}")


def stop_process(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=5)  # uvicorn's graceful shutdown can take its time; the stores are throwaway
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=20)


def start_mlflow(d: Path) -> tuple[subprocess.Popen, str]:
    d.mkdir(parents=True, exist_ok=True)
    port = free_port()
    ini = d / "auth.ini"
    ini.write_text(f"[mlflow]\ndefault_permission = READ\ndatabase_uri = sqlite:///{d / 'auth.db'}\n"
                   f"admin_username = {ADMIN}\nadmin_password = {ADMIN_PW}\n"
                   "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n"
                   "auth_cache_ttl_seconds = 60\n")  # one worker: a password change invalidates it
    env = dict(os.environ, MLFLOW_AUTH_CONFIG_PATH=str(ini), MLFLOW_FLASK_SERVER_SECRET_KEY="vitp-test-secret-key")
    for k in ("MLFLOW_TRACKING_URI", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):
        env.pop(k, None)
    log = d / "mlflow.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--app-name", "basic-auth", "--host", "127.0.0.1",
         "--port", str(port), "--workers", "1", "--backend-store-uri", f"sqlite:///{d / 'mlflow.db'}",
         "--no-serve-artifacts", "--default-artifact-root", (d / "artifacts").as_uri()],
        env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)
    uri = f"http://127.0.0.1:{port}"
    try:
        wait_ok(f"{uri}/health", proc, "mlflow server --app-name basic-auth", log)
    except Exception:
        stop_process(proc)
        raise
    return proc, uri


NGINX_HEAD = """
{user}
daemon off;
worker_processes 1;
pid {d}/nginx.pid;
error_log {d}/error.log;
events {{ worker_connections 256; }}
http {{
    access_log off;
    client_body_temp_path {d}/body; proxy_temp_path {d}/proxy; fastcgi_temp_path {d}/fastcgi;
    uwsgi_temp_path {d}/uwsgi; scgi_temp_path {d}/scgi;
"""


def run_nginx(d: Path, http_block: str, health: str, **kw) -> subprocess.Popen:
    """Debian's nginx in its own session, its pid, logs and temp files under ``d``, serving
    ``http_block`` (the inside of ``http { }``); returned once ``health`` answers 200."""
    nginx = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None)
    if nginx is None:
        unavailable("nginx is not installed (launch/services/install-debian.sh installs nginx-light)")
    d.mkdir(parents=True, exist_ok=True)
    conf = d / "nginx.conf"
    conf.write_text(NGINX_HEAD.format(user="user root;" if os.geteuid() == 0 else "", d=d) + http_block + "}\n")
    log = d / "error.log"
    log.touch()
    proc = subprocess.Popen([nginx, "-c", str(conf), "-p", str(d), "-e", str(log)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_ok(health, proc, "nginx", log, **kw)
    except Exception:
        stop_process(proc)
        raise
    return proc


NGINX_PROXY = """
    client_max_body_size 0;
    server {{
        listen 127.0.0.1:{port} ssl;
        ssl_certificate {cert}; ssl_certificate_key {key};
        location / {{ proxy_pass {upstream}; proxy_set_header Host $host; }}
        # a gateway that wants a token in the query: MLflow appends its endpoint to the URI, so a request
        # for https://HOST/gw?token=T arrives as /gw?token=T/api/2.0/mlflow/...
        location = /gw {{
            if ($arg_token !~ "^{token}(/api/.*)$") {{ return 403; }}
            set $api $1;
            rewrite ^ $api break;
            proxy_pass {upstream};
            proxy_set_header Host $host;
        }}
    }}
"""


def start_nginx(d: Path, upstream: str, token: str) -> tuple[subprocess.Popen, str, Path]:
    import ssl

    ca, cert, key = make_ca(d / "tls")
    port = free_port()
    uri = f"https://127.0.0.1:{port}"
    proc = run_nginx(d, NGINX_PROXY.format(port=port, cert=cert, key=key, upstream=upstream, token=token),
                     f"{uri}/health", context=ssl.create_default_context(cafile=str(ca)))
    return proc, uri, ca


def auth_stack(d: Path):
    """Start MLflow's basic-auth server and nginx in front of it; yields an :class:`AuthServer`."""
    if shutil.which("openssl") is None:
        unavailable("openssl is not installed")
    mlflow_proc, http = start_mlflow(d / "mlflow")
    try:
        token = "gw-" + base64.b32encode(os.urandom(10)).decode().lower()
        nginx_proc, https, ca = start_nginx(d / "nginx", http, token)
        try:
            yield AuthServer(http, https, ca, token, d / "mlflow" / "artifacts")
        finally:
            stop_process(nginx_proc)
    finally:
        stop_process(mlflow_proc)
