"""Secrets in settings stay in memory: every value vitp writes or shows goes through :func:`redact`.

A URI may carry credentials: userinfo (``https://user:password@host``) or a token in its query
(pre-signed object-store URLs: ``X-Amz-Signature``, ``sig``, ``token``, ...). vitp connects with the
real value and writes only the redacted one (``https://***@host/?sig=***``): resolved configs,
checkpoint manifests, the MLflow spool, MLflow params and tags, logs, `vitp config show`, `vitp jobs`.

A job gets the redacted config (submitit pickles it into the job folder) and the real values through
its environment, ``VITP_SECRETS`` (a JSON list that sbatch and the local executor pass on, as they
pass MLFLOW_TRACKING_PASSWORD); :func:`restore` puts them back in the job's memory. A redacted value
nobody remembers (a manifest read in a new shell) loses its masked parts instead: the credentials
then come from MLflow's own variables (MLFLOW_TRACKING_USERNAME/PASSWORD/TOKEN).
"""

from __future__ import annotations

import json
import logging
import os
import re

MASK = "***"
ENV = "VITP_SECRETS"
# query parameters whose value is a secret (or names one): compared lower-case, without - and _
_SECRET_NAMES = {"sig", "signature", "token", "accesstoken", "idtoken", "refreshtoken", "key", "apikey",
                 "password", "passwd", "pwd", "secret", "clientsecret", "authorization", "googleaccessid",
                 "expires", "xamzsignature", "xamzcredential", "xamzsecuritytoken", "xgoogsignature",
                 "xgoogcredential"}
_SECRET_SUFFIXES = ("token", "signature", "secret", "password", "credential", "apikey", "accesskey")
_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>`]+")


def _secret_param(name: str) -> bool:
    n = name.lower().replace("-", "").replace("_", "")
    return n in _SECRET_NAMES or n.endswith(_SECRET_SUFFIXES)


def _redact_url(url: str) -> str:
    scheme, _, rest = url.partition("://")
    cut = min([i for i in (rest.find("/"), rest.find("?"), rest.find("#")) if i >= 0], default=len(rest))
    authority, tail = rest[:cut], rest[cut:]
    if "@" in authority:  # the whole userinfo: a token is often the user name (https://TOKEN@host)
        authority = f"{MASK}@{authority.rpartition('@')[2]}"
    head, q, query = tail.partition("?")
    if q:
        query, h, fragment = query.partition("#")
        parts = []
        for item in query.split("&"):
            name, eq, value = item.partition("=")
            parts.append(f"{name}={MASK}" if eq and value and _secret_param(name) else item)
        tail = f"{head}?{'&'.join(parts)}{h}{fragment}"
    return f"{scheme}://{authority}{tail}"


def redact(text: str) -> str:
    """``text`` with the secrets of every URI in it masked (userinfo, token-like query values).

    ``redact("https://bob:pw@h/x?X-Amz-Signature=ab&n=1") == "https://***@h/x?X-Amz-Signature=***&n=1"``;
    a string without a URI comes back unchanged. Works on whole messages (exception texts, log lines).
    """
    if not isinstance(text, str) or "://" not in text:
        return text
    return _URL.sub(lambda m: _redact_url(m.group(0)), text)


def has_secret(text: str) -> bool:
    return redact(text) != text


def remember(values) -> None:
    """Keep the real ``values`` (secret-bearing strings) in this process's environment, for the jobs it
    starts (sbatch and submitit's local executor pass the environment on) and :func:`restore`."""
    known = _known()
    new = [v for v in values if isinstance(v, str) and has_secret(v) and v not in known]
    if new:
        os.environ[ENV] = json.dumps(known + new)


def _known() -> list[str]:
    try:
        vals = json.loads(os.environ.get(ENV) or "[]")
    except json.JSONDecodeError:
        return []
    return [v for v in vals if isinstance(v, str)] if isinstance(vals, list) else []


def strip(text: str) -> str:
    """A redacted URI without its masked parts (``https://***@h/?sig=***&n=1`` -> ``https://h/?n=1``)."""
    def one(url: str) -> str:
        url = url.replace(f"://{MASK}@", "://", 1)
        head, q, query = url.partition("?")
        if not q:
            return url
        query, h, fragment = query.partition("#")
        kept = "&".join(i for i in query.split("&") if i.partition("=")[2] != MASK)
        return f"{head}{'?' if kept else ''}{kept}{h}{fragment}"

    return _URL.sub(lambda m: one(m.group(0)), text)


def restore(value):
    """The real value behind a redacted one: a remembered value (``VITP_SECRETS``) or
    ``$MLFLOW_TRACKING_URI`` that redacts to it; else the value without its masked parts."""
    if not isinstance(value, str) or MASK not in value:
        return value
    for real in [*_known(), os.environ.get("MLFLOW_TRACKING_URI") or ""]:
        if real and redact(real) == value:
            return real
    return strip(value)


def _secret_parts(url: str) -> list[str]:
    """The secret substrings of a URI: its userinfo (whole, and each side of ``:``) and the values of
    its token-like query parameters."""
    scheme, _, rest = url.partition("://")
    cut = min([i for i in (rest.find("/"), rest.find("?"), rest.find("#")) if i >= 0], default=len(rest))
    authority, query = rest[:cut], rest[cut:].partition("?")[2].partition("#")[0]
    parts = []
    if "@" in authority:
        info = authority.rpartition("@")[0]
        parts += [info, *info.split(":", 1)]
    for item in query.split("&") if query else []:
        name, eq, value = item.partition("=")
        if eq and value and _secret_param(name):
            parts.append(value)
    return sorted({p for p in parts if len(p) >= 4}, key=len, reverse=True)  # longest first


def mask_known(text: str) -> str:
    """``text`` with every URI redacted and every secret this process knows (``VITP_SECRETS``,
    ``$MLFLOW_TRACKING_URI``) masked wherever it stands, also outside a whole URI (a request's path
    and query in a library's log line)."""
    for real in [*_known(), os.environ.get("MLFLOW_TRACKING_URI") or ""]:
        for part in _secret_parts(real) if real else []:
            text = text.replace(part, MASK)
    return redact(text)


class _Masking(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        masked = mask_known(msg)
        if masked != msg:
            record.msg, record.args = masked, None
        return True


# urllib3 logs a retried request's path and query (`Retrying (...) after connection broken by ...:
# /gw/api/2.0/...?token=...`): a token in the tracking URI's query would reach the job's log
LIBRARY_LOGGERS = ("urllib3.connectionpool", "urllib3.connection", "urllib3.util.retry")


def mask_library_logs() -> None:
    """Mask known secrets in the records of the libraries that log request URLs (idempotent)."""
    for name in LIBRARY_LOGGERS:
        log = logging.getLogger(name)
        if not any(isinstance(f, _Masking) for f in log.filters):
            log.addFilter(_Masking())
