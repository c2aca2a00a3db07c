"""Files that are either the old version or the new one, never half written.

Every JSON/YAML/text file vitp publishes (resolved config, metrics, manifests, results, the
checkpoint LATEST pointer, safetensors exports, and prep's plan, stats and ``_info.json``) is written
to a hidden temporary name beside the target and renamed over it: a rename within a folder is
atomic, so a reader (or a job killed mid write) sees one whole file. The temporary name is unique to
the writer (process id + random part), so two writers of one target (two SLURM array tasks finishing
a prep, two ranks) each rename a whole file of their own: the last rename wins, whole.

Standard library only: data_prep (no torch) writes through this module too.
"""

from __future__ import annotations

import contextlib
import json
import os
import uuid
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def replacing(path: str | os.PathLike, *, fsync: bool = False) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; when the block ends without error it replaces ``path``
    (``fsync``: the new file and the folder's entry are on stable storage when the block ends)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:12]}.tmp")
    try:
        yield tmp
        if fsync:
            fsync_path(tmp)
        os.replace(tmp, path)
        if fsync:  # the rename itself is an entry of the folder
            fsync_path(path.parent)
    finally:
        tmp.unlink(missing_ok=True)


def fsync_path(path: str | os.PathLike) -> None:
    """Flush a file's data, or a folder's entries (a rename or a new file in it), to stable storage:
    what a shared file system has acknowledged survives a crash of this node."""
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if os.path.isdir(path) else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str | os.PathLike, data: str | bytes, *, fsync: bool = False) -> Path:
    """Write ``data`` (text or bytes) to ``path`` atomically."""
    with replacing(path, fsync=fsync) as tmp:
        (tmp.write_bytes if isinstance(data, bytes) else tmp.write_text)(data)
    return Path(path)


def write_json(path: str | os.PathLike, doc, *, fsync: bool = False, indent: int | None = 1) -> Path:
    return atomic_write(path, json.dumps(doc, indent=indent, sort_keys=True) + "\n", fsync=fsync)


def read_jsonl(path: str | os.PathLike, *, skip_cut: bool = False) -> list[dict]:
    """The records of a JSON-lines file ([] when it does not exist); blank lines are skipped.

    ``skip_cut``: a line that is not JSON (cut short by a crash mid-append) is skipped, so one lost
    line does not hide the others (append-only logs: the job index, the attempt events)."""
    p = Path(path)
    if not p.is_file():
        return []
    out = []
    for line in p.read_text().splitlines():
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            if not skip_cut:
                raise
    return out
