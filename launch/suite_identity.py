"""What made a suite cell: its identity, recorded in its run dir and compared before anything runs.

A cell's identity is the checkpoint it starts from (``init.from`` and a digest of what it holds,
pipeline.weights.source_digest) and its resolved config, flattened to dotted keys, less the keys
that name where it runs and where it is tracked (not what it computes): ``run.dir``, ``run.fresh``,
``tracking.*``, ``cluster.log_dir``. A final's identity also holds its dataset's grid (the configs of
the cells its lr was chosen on), so a changed grid changes the final that depends on it.

    .suite_identity.json  {"digest": <sha256 of the rest>, "source", "source_digest", "config": {...},
                           "grid": [<grid cells' digests>] (a final's)}

A completed cell is reused only when its recorded identity equals the one asked for now; otherwise
the suite refuses in one line naming the dataset, the cell and the first key that differs, or, with
``--rerun-changed``, runs the cell again from scratch.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

IDENTITY_FILE = ".suite_identity.json"  # a dot file: the transfer stage leaves it be in its run dir
_NOT_IDENTITY = ("run.dir", "run.fresh", "tracking.", "cluster.log_dir")


def config_identity(cfg) -> dict:
    """A cell's validated config -> its dotted keys that decide what it computes."""
    from pipeline.config import flatten

    return {k: v for k, v in flatten(cfg).items() if not k.startswith(_NOT_IDENTITY)}


def digest(doc: dict) -> str:
    return hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()


def make(source: str, source_digest: str, config: dict, grid: list[str] | None = None) -> dict:
    """The identity document (see the module docstring)."""
    doc = {"source": source, "source_digest": source_digest, "config": config}
    if grid is not None:
        doc["grid"] = grid
    return {"digest": digest(doc), **doc}


def recorded(run_dir: Path) -> dict | None:
    try:
        return json.loads((Path(run_dir) / IDENTITY_FILE).read_text())
    except (OSError, ValueError):
        return None


def record(run_dir: Path, ident: dict) -> None:
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    (Path(run_dir) / IDENTITY_FILE).write_text(json.dumps(ident, indent=1, default=str))


def first_difference(was: dict | None, now: dict) -> str | None:
    """The first key where a recorded identity differs from ``now`` (None: the same). ``init.from``
    for another checkpoint, ``init.from (its weights' digest)`` for other weights at the same path, a
    config key, ``grid`` for a final whose grid changed; ``identity`` when none was recorded."""
    if was is None:
        return "identity (none recorded)"
    if was.get("digest") == now["digest"]:
        return None
    if was.get("source") != now["source"]:
        return "init.from"
    if was.get("source_digest") != now["source_digest"]:
        return "init.from (its weights' digest)"
    old, new = was.get("config", {}), now["config"]
    for k in [*new, *(k for k in old if k not in new)]:
        if old.get(k, "<unset>") != new.get(k, "<unset>"):
            return k
    return "grid" if was.get("grid") != now.get("grid") else "identity"


def wipe(run_dir: Path) -> None:
    """A cell run again from scratch: nothing of its other identity (results, checkpoints) is reused."""
    shutil.rmtree(run_dir, ignore_errors=True)


def checkpoint_name(source: str) -> str:
    """The name a table column gives the checkpoint a suite evaluates: its run's ``run.name`` (else
    its run dir's name) for one of our run dirs or checkpoint folders, else the file's stem."""
    import yaml

    p = Path(source.rstrip("/"))
    if not p.is_dir():  # a weights file (here or at a remote address)
        return p.parent.name if p.name == "model.safetensors" else p.stem
    run_dir = p.parents[1] if p.parent.name == "checkpoints" else p
    try:
        name = (yaml.safe_load((run_dir / "config.yaml").read_text()) or {}).get("run", {}).get("name")
    except (OSError, ValueError, AttributeError):
        name = None
    return name or run_dir.name
