"""Where a run's checkpoints are and which of them count: the layout, known in this one place.

Under ``RUN_DIR/checkpoints/``::

    tmp-step-00000040/     being written; resume ignores it, the next save deletes it
    step-00000040/         published: its manifest.json is written last, then the folder renamed
    LATEST                 name of the newest published checkpoint

A checkpoint exists iff its ``step-*`` folder holds a manifest; it is trusted iff every file the
manifest records is there at its recorded size. The writer (pipeline/train/checkpoint.py) and every
reader (weights, evaluation, the suite) ask this module; it needs neither torch nor DeepSpeed.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

MANIFEST = "manifest.json"
PREFIX, TMP_PREFIX = "step-", "tmp-step-"


def root(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / "checkpoints"


def tag_for(step: int) -> str:
    return f"{PREFIX}{step:08d}"


def tmp_tag_for(step: int) -> str:
    return f"{TMP_PREFIX}{step:08d}"


def complete_checkpoints(run_dir: str | os.PathLike) -> list[Path]:
    """Published checkpoints of a run, oldest first."""
    r = root(run_dir)
    if not r.is_dir():
        return []
    found = [p for p in r.iterdir() if p.name.startswith(PREFIX) and p.name[len(PREFIX):].isdigit()
             and (p / MANIFEST).is_file()]
    return sorted(found, key=lambda p: int(p.name[len(PREFIX):]))


def latest_checkpoint(run_dir: str | os.PathLike, *, warn: bool = True) -> Path | None:
    """The newest published checkpoint whose files are all there at their recorded sizes; an
    incomplete newer one is skipped with a one-line warning on stderr."""
    for ckpt in reversed(complete_checkpoints(run_dir)):
        problem = incomplete(ckpt)
        if problem is None:
            return ckpt
        if warn:
            print(f"warning: skipping checkpoint {ckpt}: {problem}", file=sys.stderr, flush=True)
    return None


def read_manifest(ckpt: str | os.PathLike) -> dict:
    return json.loads((Path(ckpt) / MANIFEST).read_text())


def checkpoint_in(path: str | os.PathLike) -> Path | None:
    """The checkpoint ``path`` names: a ``step-*`` folder itself, else a run dir's newest complete
    one; None when there is none."""
    p = Path(path)
    return p if (p / MANIFEST).is_file() else latest_checkpoint(p)


def incomplete(ckpt: str | os.PathLike) -> str | None:
    """Why ``ckpt`` cannot be trusted (a file missing or of another size than the manifest records),
    or None. Manifests written before sizes were recorded are taken as they are."""
    ckpt = Path(ckpt)
    try:
        sizes = read_manifest(ckpt).get("sizes") or {}
    except (OSError, ValueError) as e:
        return f"unreadable {MANIFEST} ({e})"
    for name, size in sorted(sizes.items()):
        try:
            got = (ckpt / name).stat().st_size
        except FileNotFoundError:
            return f"{name} is missing"
        if got != size:
            return f"{name} has {got} bytes, the manifest recorded {size}"
    return None
