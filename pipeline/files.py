"""Files that are either the old version or the new one, never half written.

Every JSON/YAML/text file vitp publishes (resolved config, metrics, manifests, results, the
checkpoint LATEST pointer, safetensors exports) is written to a hidden temporary name beside the
target and renamed over it: a rename within a folder is atomic, so a reader (or a job killed mid
write) sees one whole file.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def replacing(path: str | os.PathLike, *, fsync: bool = False) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; when the block ends without error it replaces ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        yield tmp
        if fsync:
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def atomic_write(path: str | os.PathLike, data: str | bytes, *, fsync: bool = False) -> Path:
    """Write ``data`` (text or bytes) to ``path`` atomically."""
    with replacing(path, fsync=fsync) as tmp:
        (tmp.write_bytes if isinstance(data, bytes) else tmp.write_text)(data)
    return Path(path)


def write_json(path: str | os.PathLike, doc, *, fsync: bool = False, indent: int | None = 1) -> Path:
    return atomic_write(path, json.dumps(doc, indent=indent, sort_keys=True) + "\n", fsync=fsync)


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """The records of a JSON-lines file ([] when it does not exist); blank lines are skipped."""
    p = Path(path)
    if not p.is_file():
        return []
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
