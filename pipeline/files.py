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
import warnings
from collections.abc import Iterable, Iterator
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


class CutLines(UserWarning):
    """Lines of an append-only JSON-lines file that are not JSON, dropped by :func:`read_jsonl`."""


_warned: set[tuple[str, tuple[int, ...]]] = set()  # (file, its bad lines) already reported by this process


def read_jsonl(path: str | os.PathLike, *, name: str | os.PathLike | None = None) -> list[dict]:
    """The records of an append-only JSON-lines file ([] when it does not exist); blank lines are skipped.

    A line that is not a JSON object is dropped: the last append cut short by a full disk or a crash, a
    tail of NUL bytes (what ext4 and NFS can leave where a crash lost the data), a cut line that later
    appends went on after (:func:`append_jsonl` starts each on a fresh line). One :class:`CutLines`
    warning per file names it (``name``: the name to show, for a file read under a temporary one) and
    the line numbers; the rest is used, so one lost record neither hides the others nor blocks a resume.
    """
    p = Path(path)
    try:
        data = p.read_bytes()
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        return []
    records, bad = [], []
    for number, line in enumerate(data.split(b"\n"), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line.decode("utf-8"))
        except ValueError:  # JSONDecodeError, UnicodeDecodeError
            record = None
        if isinstance(record, dict):
            records.append(record)
        else:
            bad.append(number)
    shown = str(name or p)
    if bad and (shown, tuple(bad)) not in _warned:
        _warned.add((shown, tuple(bad)))
        at = ", ".join(map(str, bad[:10])) + (f" and {len(bad) - 10} more" if len(bad) > 10 else "")
        warnings.warn(f"{shown}: skipped what is not JSON (an append cut by a full disk or a crash) at "
                      f"line{'s' * (len(bad) > 1)} {at}; using the other {len(records)} records",
                      CutLines, stacklevel=2)
    return records


def append_jsonl(path: str | os.PathLike, records: Iterable[dict], *, sort_keys: bool = False) -> None:
    """Append ``records`` to a JSON-lines file, one line each, in one write (short appends from several
    processes do not interleave). The append starts on a fresh line: when an earlier one was cut short
    (no newline at the end, or a NUL tail), a record written onto it would be dropped with it."""
    data = "".join(json.dumps(r, sort_keys=sort_keys) + "\n" for r in records).encode()
    if not data:
        return
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o666)
    try:
        size = os.fstat(fd).st_size
        if size and os.pread(fd, 1, size - 1) != b"\n":
            data = b"\n" + data
        view = memoryview(data)
        while view:  # a full disk may take part of it, then raise on the next write
            view = view[os.write(fd, view):]
    finally:
        os.close(fd)
