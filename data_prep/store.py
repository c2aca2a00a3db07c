"""Where a dataset lives: a local folder or an object store / HTTP address, behind one small API.

An *address* is a local path or a URL: ``s3://bucket/prefix``, ``gs://bucket/prefix``,
``https://host/path`` (``http://`` too). This module is the only importer of fsspec; S3 and GCS
need the optional extras (``pip install 'vitp[s3]'`` / ``'vitp[gcs]'``), HTTP needs nothing more.

Credentials come from each SDK's own chain, never from vitp's config: for S3 botocore's
(``AWS_ACCESS_KEY_ID``/``AWS_PROFILE``/instance roles; an S3-compatible endpoint from
``AWS_ENDPOINT_URL``), for GCS google-auth's (``GOOGLE_APPLICATION_CREDENTIALS``, gcloud).
A signed URL carries its secret in the query string: anything that is printed, logged or tracked
names an address through :func:`public`, which drops the query and any user info.
"""

from __future__ import annotations

import functools
import os
import urllib.error
import urllib.parse
import urllib.request
from typing import IO

REMOTE_SCHEMES = ("s3", "gs", "http", "https")
EXTRA_OF = {"s3": "s3", "gs": "gcs"}  # scheme -> the vitp extra that installs its fsspec implementation


class AddressError(ValueError):
    """An address that cannot be used; the message is one line naming the (public) address and why."""


def scheme(address: str) -> str:
    """'s3', 'gs', 'http', 'https', or 'file' for a local path (``file://`` URLs included)."""
    s = urllib.parse.urlsplit(str(address)).scheme.lower()
    return s if s in REMOTE_SCHEMES else "file"


def is_remote(address: str | os.PathLike) -> bool:
    return scheme(str(address)) != "file"


def public(address: str | os.PathLike) -> str:
    """The address as it may be printed, logged or tracked: no query string, fragment or user info."""
    address = str(address)
    if not is_remote(address):
        return address
    u = urllib.parse.urlsplit(address)
    host = u.hostname or ""
    if u.port:
        host = f"{host}:{u.port}"
    return urllib.parse.urlunsplit((u.scheme, host, u.path, "", ""))


def join(base: str | os.PathLike, name: str) -> str:
    """``name`` resolved against the dataset address ``base``: an absolute path or a URL is kept as is.

    A query string on ``base`` (a signed prefix) is not carried over: each object of a signed dataset
    needs its own signature, so its ``_info.json`` names full URLs.
    """
    base = str(base)
    if "://" in name or name.startswith("pipe:") or os.path.isabs(name):
        return name
    if not is_remote(base):
        return os.path.join(base, name)
    u = urllib.parse.urlsplit(base)
    return urllib.parse.urlunsplit((u.scheme, u.netloc, u.path.rstrip("/") + "/" + name, "", ""))


@functools.cache
def _filesystem(proto: str, read_timeout_s: float | None = None, pid: int = 0, endpoint: str | None = None):
    """One filesystem per (protocol, read timeout, process, S3 endpoint): fsspec's async filesystems
    refuse to run in a forked child (a loader worker), so a child makes its own; one made before
    ``AWS_ENDPOINT_URL`` changed would still talk to the old endpoint. With ``read_timeout_s`` the SDK's
    own retries are off: the caller (the loader's shard stream) is the one retry policy, and a read
    that gets no bytes for that long fails instead of hanging."""
    import fsspec

    kw: dict = {}
    if read_timeout_s is not None and proto == "s3":
        kw["config_kwargs"] = {"read_timeout": read_timeout_s, "connect_timeout": read_timeout_s,
                               "retries": {"max_attempts": 0}}
    elif read_timeout_s is not None and proto in ("http", "https"):
        import aiohttp

        kw["client_kwargs"] = {"timeout": aiohttp.ClientTimeout(sock_read=read_timeout_s,
                                                                sock_connect=read_timeout_s)}
    elif read_timeout_s is not None and proto == "gs":
        kw["requests_timeout"] = read_timeout_s
    try:
        fs = fsspec.filesystem(proto, skip_instance_cache=True, **kw)
    except ImportError as e:
        extra = EXTRA_OF.get(proto)
        hint = f"pip install 'vitp[{extra}]'" if extra else "its fsspec implementation is not installed"
        raise AddressError(f"{proto}:// addresses need the {extra or proto} extra: {hint} ({e})") from None
    if read_timeout_s is not None and hasattr(fs, "retries"):
        fs.retries = 1  # s3fs's own retry loop (one try: see above)
    return fs


def filesystem(address: str | os.PathLike, read_timeout_s: float | None = None):
    """(fsspec filesystem, path within it) for an address. One filesystem per protocol and process
    (and read timeout, see _filesystem)."""
    address = str(address)
    proto = scheme(address)
    if proto == "file":
        return _filesystem("file"), os.path.abspath(address.removeprefix("file://"))
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3", os.environ.get("AWS_ENDPOINT_URL")) if proto == "s3" else None
    fs = _filesystem(proto, read_timeout_s, os.getpid(), endpoint)
    if proto in ("http", "https"):
        return fs, address  # the HTTP filesystem takes whole URLs (the query is part of the object's name)
    return fs, fs._strip_protocol(address)


def reason(e: BaseException) -> str:
    """A one-line reason for an I/O error, without the address (the caller names it: an SDK's own
    message may repeat the address with its query string)."""
    if isinstance(e, urllib.error.HTTPError):
        return f"HTTP {e.code} {e.reason}"
    if isinstance(e, FileNotFoundError):
        detail = e.args[0] if e.args and isinstance(e.args[0], str) else ""
        return "not found" + (f" ({detail})" if detail and "/" not in detail else "")
    if isinstance(e, PermissionError):
        return "access denied (check the credentials in the environment)"
    if isinstance(e, urllib.error.URLError):
        return f"cannot connect ({e.reason})"
    return f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"


def read_bytes(address: str | os.PathLike) -> bytes:
    """The whole object (small files: ``_info.json``, ``classes.json``, stats); OSError as is."""
    fs, path = filesystem(address)
    return fs.cat_file(path)


def exists(address: str | os.PathLike) -> bool:
    fs, path = filesystem(address)
    return fs.exists(path)


def size(address: str | os.PathLike) -> int:
    fs, path = filesystem(address)
    return int(fs.size(path))


def open_read(address: str | os.PathLike, start: int = 0, read_timeout_s: float | None = None,
              block_size: int = 1 << 22) -> IO[bytes]:
    """A binary stream of the object from byte ``start``: a local file is seeked; a remote object is
    read as a stream of ranged reads of ``block_size`` bytes (no download to disk).

    No retry here: a caller that must survive network faults reads through :func:`read_range`
    instead (pipeline.data.stream), which keeps what a failed read received.
    """
    fs, path = filesystem(address, read_timeout_s)
    if not is_remote(str(address)):
        f = open(path, "rb", buffering=1 << 16)
        f.seek(start)
        return f
    f = fs.open(path, "rb", block_size=block_size, cache_type="readahead")
    if start:
        f.seek(start)
    return f


def read_range(address: str, start: int, end: int, read_timeout_s: float | None, into: list[bytes]) -> int:
    """One ranged GET of bytes ``[start, end)`` of the remote object ``address``, its body appended to
    ``into`` chunk by chunk as it arrives; returns the object's size, as the reply states it (a range
    past the end is cut there: fewer bytes, or none from ``start`` at or past the end).

    A read that fails part way (a reset, no byte for ``read_timeout_s``) raises as the SDK raises, and
    ``into`` keeps every byte received before: the caller asks for the rest from there instead of
    losing the try. FileNotFoundError / PermissionError for a missing or refused object; an http(s)
    server that ignores ``Range`` past byte 0 is an AddressError (no try can fix it). S3 and http(s)
    bodies arrive in chunks; gs:// gets the range whole from gcsfs (kept or lost whole).
    """
    from fsspec.asyn import sync

    fs, path = filesystem(address, read_timeout_s)
    proto = scheme(address)
    if proto == "s3":
        return sync(fs.loop, _s3_range, fs, path, start, end, into)
    if proto in ("http", "https"):
        return sync(fs.loop, _http_range, fs, path, start, end, into)
    return sync(fs.loop, _gs_range, fs, path, start, end, into)


_CHUNK = 1 << 20  # the most one body read returns (it returns what has arrived, up to this)


def _total(content_range: str | None, start: int) -> int:
    """The object size in a ``Content-Range: bytes a-b/SIZE`` header (``start`` when it says none:
    nothing was there from ``start`` on)."""
    tail = (content_range or "").rpartition("/")[2]
    return int(tail) if tail.isdigit() else start


async def _s3_range(fs, path: str, start: int, end: int, into: list[bytes]) -> int:
    bucket, key, version = fs.split_path(path)
    try:
        resp = await fs._call_s3("get_object", Bucket=bucket, Key=key, Range=f"bytes={start}-{end - 1}",
                                 **({"VersionId": version} if version else {}))
    except OSError as e:  # s3fs's translation of botocore's error keeps the reply as its cause
        if getattr(e.__cause__, "response", {}).get("ResponseMetadata", {}).get("HTTPStatusCode") == 416:
            return start
        raise
    body = resp["Body"]
    try:
        while chunk := await body.read(_CHUNK):
            into.append(chunk)
    finally:
        body.close()
    return _total(resp.get("ContentRange"), start) if "ContentRange" in resp else resp["ContentLength"]


async def _http_range(fs, url: str, start: int, end: int, into: list[bytes]) -> int:
    kw = dict(fs.kwargs)
    headers = {**kw.pop("headers", {}), "Range": f"bytes={start}-{end - 1}"}
    session = await fs.set_session()
    async with session.get(fs.encode_url(url), headers=headers, **kw) as r:
        if r.status == 416:
            return _total(r.headers.get("Content-Range"), start)
        if r.status in (404, 410):
            raise FileNotFoundError(f"HTTP {r.status} {r.reason}")
        if r.status in (401, 403):
            raise PermissionError(f"HTTP {r.status} {r.reason}")
        if r.status >= 400:  # not raise_for_status: its message names the URL, signature and all
            raise OSError(f"HTTP {r.status} {r.reason}")
        if r.status != 206 and start > 0:
            raise AddressError(f"{public(url)}: the server ignores Range requests (HTTP {r.status}): "
                               "it cannot be read from a byte offset")
        want = end - start  # a 200 is the whole object: its first ``want`` bytes are the range
        while want > 0 and (chunk := await r.content.read(min(want, _CHUNK))):
            into.append(chunk)
            want -= len(chunk)
        return _total(r.headers.get("Content-Range"), start) if r.status == 206 else int(r.headers["Content-Length"])


async def _gs_range(fs, path: str, start: int, end: int, into: list[bytes]) -> int:
    try:  # gcsfs's own one-shot ranged GET (_cat_file_sequential), for the reply's headers too
        headers, body = await fs._call("GET", fs.url(path), headers={"Range": f"bytes={start}-{end - 1}"})
    except Exception as e:
        if getattr(e, "code", None) == 416:
            return start
        raise
    into.append(body)
    return _total(headers.get("Content-Range"), start)


def check_readable(address: str | os.PathLike, what: str) -> None:
    """Fail with one line naming ``what`` (e.g. 'data.path: s3://b/x/_info.json') and the reason when
    the object cannot be read: a missing bucket or key, a 403, a 404, a host that does not answer."""
    try:
        if scheme(str(address)) in ("http", "https"):
            _probe_http(str(address))  # fsspec's HTTP info reports every failure as "not found"
        else:
            fs, path = filesystem(address)
            fs.info(path)
    except AddressError:
        raise
    except Exception as e:  # noqa: BLE001 (each SDK has its own error classes; the reason says which)
        raise AddressError(f"{what}: {public(address)}: {reason(e)}") from None


def _probe_http(url: str, timeout_s: float = 30) -> None:
    """Ask for the first byte; HTTPError/URLError say why not."""
    req = urllib.request.Request(url, headers={"Range": "bytes=0-0"})
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        r.read(1)


# ── Writing (prep's output) ──────────────────────────────────────────────────────────────────────
# An object store has no rename: an object appears whole when its PUT (or its multipart upload's
# completion) succeeds, and never before. So prep writes a shard to a local staging folder and puts
# the finished file; nothing is ever written under a final name while it is incomplete.

MIN_PART_SIZE = 5 * 2**20  # S3's smallest multipart part (all but the last)


def check_writable(address: str | os.PathLike, what: str) -> None:
    """Fail with one line before prep starts when ``address`` cannot take its output: an http(s)
    address (read-only), a missing bucket, a bucket these credentials may not use."""
    address = str(address)
    proto = scheme(address)
    if proto in ("http", "https"):
        raise AddressError(f"{what}: {public(address)}: http(s) addresses are read-only; write to a folder, "
                           "s3:// or gs:// (and serve that)")
    if proto == "file":
        return
    fs, path = filesystem(address)
    bucket = path.split("/", 1)[0]
    try:
        fs.invalidate_cache(bucket)
        fs.info(bucket)  # S3: HeadBucket; GCS: the bucket's metadata
    except FileNotFoundError:
        raise AddressError(f"{what}: {public(address)}: no such bucket {bucket!r}") from None
    except Exception as e:  # noqa: BLE001 (each SDK has its own error classes; the reason says which)
        raise AddressError(f"{what}: {public(address)}: bucket {bucket!r}: {reason(e)}") from None


def _writable(address: str) -> None:
    if scheme(address) in ("http", "https"):
        raise AddressError(f"{public(address)}: http(s) addresses are read-only")


def write_bytes(address: str | os.PathLike, data: bytes) -> None:
    """Replace the object/file at ``address`` with ``data``, whole: a local file through a rename
    (fsynced), an object with one PUT."""
    address = str(address)
    _writable(address)
    if not is_remote(address):
        from pipeline.files import atomic_write

        atomic_write(address.removeprefix("file://"), data, fsync=True)
        return
    fs, path = filesystem(address)
    try:
        fs.pipe_file(path, data)
    except Exception as e:  # noqa: BLE001 (each SDK has its own error classes; the reason says which)
        raise AddressError(f"{public(address)}: cannot write: {reason(e)}") from None


def put_file(local: str | os.PathLike, address: str | os.PathLike, part_size: int) -> None:
    """Upload the local file ``local`` as the object ``address``: one PUT below two parts, else a
    multipart upload of ``part_size`` parts, which the store publishes only when it completes (and
    s3fs aborts when a part fails)."""
    address = str(address)
    _writable(address)
    if part_size < MIN_PART_SIZE:
        raise ValueError(f"part size {part_size}: object stores take parts of at least {MIN_PART_SIZE} bytes")
    if not is_remote(address):
        import shutil

        from pipeline.files import replacing

        with replacing(address.removeprefix("file://"), fsync=True) as tmp:
            shutil.copyfile(local, tmp)
        return
    fs, path = filesystem(address)
    fs.put_file(str(local), path, chunksize=part_size)


def remove(address: str | os.PathLike) -> None:
    """Delete the object/file at ``address``; a missing one is fine."""
    address = str(address)
    _writable(address)
    fs, path = filesystem(address)
    try:
        fs.rm_file(path)
    except FileNotFoundError:
        pass


def list_sizes(address: str | os.PathLike) -> dict[str, int]:
    """{name: size} of the files/objects directly under the folder or prefix ``address`` (fresh, not
    from a cached listing); {} when there is none."""
    address = str(address)
    if not is_remote(address):
        folder = address.removeprefix("file://")
        try:
            return {e.name: e.stat().st_size for e in os.scandir(folder) if e.is_file()}
        except FileNotFoundError:
            return {}
    fs, path = filesystem(address)
    fs.invalidate_cache(path)
    try:
        entries = fs.ls(path, detail=True)
    except FileNotFoundError:
        return {}
    return {e["name"].rstrip("/").rsplit("/", 1)[-1]: int(e.get("size") or 0) for e in entries
            if e.get("type") == "file"}


# The one pair every file under a prep output goes through (plan, plan pieces, classes, stats,
# rejects, _info.json), so a folder and an object store prefix take the same code.
def read_file(folder: str | os.PathLike, name: str) -> bytes | None:
    """The bytes of ``name`` under ``folder`` (a local folder or a prefix address); None when it does
    not exist. A remote read that fails otherwise (a 403, a dropped connection) is an AddressError."""
    address = join(folder, name)
    if not is_remote(address):
        try:
            with open(address.removeprefix("file://"), "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None
    try:
        return read_bytes(address)
    except FileNotFoundError:
        return None
    except Exception as e:  # noqa: BLE001 (a 403, a dropped connection: one line naming the address)
        raise AddressError(f"{public(address)}: cannot read: {reason(e)}") from None


def read_files(folder: str | os.PathLike, names: list[str]) -> dict[str, bytes | None]:
    """:func:`read_file` of many small files at once: an object store is asked concurrently (fsspec's
    batched ``cat``), so thousands of shard stats take a few round trips' time, not thousands."""
    if not is_remote(str(folder)) or not names:
        return {n: read_file(folder, n) for n in names}
    fs, _ = filesystem(folder)
    paths = {filesystem(join(folder, n))[1]: n for n in names}
    try:
        got = fs.cat(list(paths), on_error="return")
    except Exception as e:  # noqa: BLE001
        raise AddressError(f"{public(folder)}: cannot read: {reason(e)}") from None
    out: dict[str, bytes | None] = {}
    for path, name in paths.items():
        value = got.get(path)
        if isinstance(value, FileNotFoundError):
            out[name] = None
        elif isinstance(value, BaseException):
            raise AddressError(f"{public(join(folder, name))}: cannot read: {reason(value)}")
        else:
            out[name] = value
    return out


def write_file(folder: str | os.PathLike, name: str, data: bytes) -> None:
    """Write ``name`` under ``folder`` whole (see :func:`write_bytes`)."""
    write_bytes(join(folder, name), data)
