"""Planned shards → tar files, in order, with N worker processes; atomic per shard, resumable.

Stream shape: planned samples → chunks of 8-32 samples → worker processes (decode/resize/encode)
→ results in plan order → the main process appends them to `<shard>.tar.partial` → rename to
`<shard>.tar` → `<shard>_stats.json` last (its presence marks the shard complete; it records each
sample's byte offset, where a reader resumes mid-shard with a ranged read).
"""

from __future__ import annotations

import io
import json
import os
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from multiprocessing import get_context
from pathlib import Path

import numpy as np

from pipeline import faults
from pipeline.errors import Classified
from pipeline.files import atomic_write

from .images import NEAR_DUPLICATE, ImageOptions, Reject, init_worker, process_image
from .near import THUMB_BYTES
from .progress import Progress
from .tar import TarSink, tar_member

# Samples per worker task: a ProcessPoolExecutor round trip costs the main process ~0.6 ms of CPU,
# which it takes from the workers' cores; 32 per task keeps that under 2%. Small shards use smaller
# tasks (down to 8), so they still spread over the workers.
CHUNK, MIN_CHUNK = 32, 8


class WorkerDied(Classified, RuntimeError):
    """A prep worker process died (killed, out of memory): the run failed (exit 1); rerunning resumes."""

    exit_code = 1


def stats_path(out: Path, name: str) -> Path:
    return out / f"{name}_stats.json"


def signatures_name(name: str) -> str:
    """Beside each shard: its kept samples' data_prep/near.py signatures and keys, in the shard's order
    (an .npz: ``hash`` [n] uint64, ``thumb`` [n, THUMB_BYTES] uint8, ``key`` [n] str), so `vitp decontam`
    checks the shard against new test sets without reading it."""
    return f"{name}_sig.npz"


def signatures_bytes(rows: list[tuple[str, int, np.ndarray]]) -> bytes:
    """[(key, hash, thumb)] -> the .npz's bytes."""
    buf = io.BytesIO()
    np.savez(buf, hash=np.array([h for _, h, _ in rows], np.uint64),
             thumb=np.stack([t for _, _, t in rows]) if rows else np.zeros((0, THUMB_BYTES), np.uint8),
             key=np.array([k for k, _, _ in rows], dtype=str))
    return buf.getvalue()


def shard_done(out: Path, name: str, plan_id: str) -> bool:
    """Complete = tar, signatures and stats (written last) present, the stats from the same plan (a
    shard of a prep from before signatures were stored is made again, with them)."""
    sp = stats_path(out, name)
    if not (sp.exists() and (out / f"{name}.tar").exists() and (out / signatures_name(name)).exists()):
        return False
    try:
        return json.loads(sp.read_text(encoding="utf-8")).get("plan_id") == plan_id
    except (OSError, ValueError):
        return False


# the test sets' index (data_prep/testsets.py) and its names, set before the workers fork (they inherit it)
_NEAR: tuple | None = None


def use_near(index, names: list[str] | None) -> None:
    """Reject near-duplicates of these test images from now on (None: no more)."""
    global _NEAR
    _NEAR = (index, names) if index is not None else None


def _work(task: tuple) -> list[tuple]:
    """Worker: a chunk of planned samples → results (ok or reject), same order."""
    root, opts, shard, start, samples = task
    out = []
    for i, (key, rel, cls, label, *labels) in enumerate(samples, start):
        faults.hit("prep_sample", i, shard)
        try:
            s = process_image(os.path.join(root, rel), opts, signature=True)
        except Reject as r:
            out.append(("reject", rel, r.reason, r.detail))
            continue
        match = _NEAR[0].nearest(*s.signature) if _NEAR is not None else None
        if match is not None:
            out.append(("reject", rel, NEAR_DUPLICATE,
                        f"near-duplicate of a test image: perceptual hashes {match.distance} bits apart, "
                        f"thumbnails agree by {match.margin}",
                        {"of": _NEAR[1][match.test], "distance": match.distance, "margin": match.margin}))
            continue
        meta = {
            "key": key, "source": rel, "label": label, "cls": cls, "format": s.ext,
            "orig_width": s.orig_width, "orig_height": s.orig_height,
            "width": s.width, "height": s.height, "sha256": s.sha256,
        }
        if labels:  # multi-label: the full set rides in the json (timm: target_key="labels"); .cls stays primary
            meta["labels"] = labels[0]
        # members of a sample sorted by extension: cls < jpg < json < png < webp. Serialised here, in
        # parallel: the main process (one core's worth shared with the workers) only appends bytes.
        members = {"cls": str(cls).encode(), s.ext: s.data, "json": json.dumps(meta, sort_keys=True).encode()}
        out.append(("ok", b"".join(tar_member(f"{key}.{e}", members[e]) for e in sorted(members)),
                    (key, *s.signature)))
    return out


class _ShardWriter:
    def __init__(self, out: Path, shard: dict, plan_id: str):
        self.out, self.name, self.plan_id = out, shard["name"], plan_id
        self.planned = len(shard["samples"])
        self.tmp = out / f"{self.name}.tar.partial"
        self.tar = TarSink(self.tmp)
        self.count, self.rejects, self.t0 = 0, [], time.perf_counter()
        self.offsets: list[int] = []  # byte offset of each sample's first member: a reader seeks there to resume
        self.signatures: list[tuple[str, int, np.ndarray]] = []

    def add(self, result: tuple) -> None:
        if result[0] == "reject":
            _, rel, reason, detail, *extra = result
            self.rejects.append({"path": rel, "reason": reason, "detail": detail, **(extra[0] if extra else {})})
            return
        self.offsets.append(self.tar.pos)
        self.tar.add_members(result[1])
        self.signatures.append(result[2])
        self.count += 1

    def finish(self) -> dict:
        self.tar.close()
        final = self.out / f"{self.name}.tar"
        os.replace(self.tmp, final)
        by_reason: dict[str, int] = {}
        for r in self.rejects:
            by_reason[r["reason"]] = by_reason.get(r["reason"], 0) + 1
        stats = {
            "shard": f"{self.name}.tar", "plan_id": self.plan_id, "planned": self.planned, "count": self.count,
            "bytes": final.stat().st_size, "sha256": self.tar.sha256,
            "rejects": dict(sorted(by_reason.items())), "rejected": self.rejects,
            "seconds": round(time.perf_counter() - self.t0, 3), "offsets": self.offsets,
        }
        atomic_write(self.out / signatures_name(self.name), signatures_bytes(self.signatures), fsync=True)
        atomic_write(stats_path(self.out, self.name), json.dumps(stats, indent=1, sort_keys=True).encode(), fsync=True)
        return stats


def _tasks(root: str, opts: ImageOptions, shards: list[dict]) -> Iterator[tuple[int, bool, tuple]]:
    """(shard index, is the shard's last chunk, worker task)."""
    for si, sh in enumerate(shards):
        s = sh["samples"]
        chunk = max(MIN_CHUNK, min(CHUNK, len(s) // 8))
        for start in range(0, len(s), chunk):
            yield si, start + chunk >= len(s), (root, opts, sh["name"], start, s[start:start + chunk])


def _results(root: str, opts: ImageOptions, shards: list[dict], workers: int) -> Iterator[tuple[int, bool, list]]:
    """(shard index, last chunk?, chunk results) in plan order; <= 4 chunks per worker in flight (bounded memory)."""
    if workers <= 1:
        init_worker()
        for si, last, task in _tasks(root, opts, shards):
            yield si, last, _work(task)
        return
    # fork: workers start in milliseconds and inherit the imported codecs. OpenCV's thread pool does
    # not survive a fork: a child that touches it (even cv2.setNumThreads) waits forever for threads
    # that exist only in the parent. Dropping the parent to one OpenCV thread first stops them.
    init_worker()
    with ProcessPoolExecutor(workers, mp_context=get_context("fork"), initializer=init_worker) as ex:
        pending: deque = deque()
        tasks = _tasks(root, opts, shards)
        for si, last, task in tasks:
            pending.append((si, last, ex.submit(_work, task)))
            if len(pending) >= 4 * workers:
                si0, last0, fut = pending.popleft()
                yield si0, last0, fut.result()
        while pending:
            si0, last0, fut = pending.popleft()
            yield si0, last0, fut.result()


def write_shards(out: Path, root: str, opts: ImageOptions, shards: list[dict], plan_id: str, workers: int,
                 progress: bool, on_done: Callable[[dict], None] | None = None) -> list[dict]:
    """Write the given planned shards (none of them complete yet); returns their stats. ``on_done(stats)``
    runs as each shard is complete (prep to an object store uploads it then)."""
    for sh in shards:  # leftovers of a killed run: never trusted, always redone
        (out / f"{sh['name']}.tar.partial").unlink(missing_ok=True)
    bar = Progress(sum(len(s["samples"]) for s in shards), enabled=progress)
    done: list[dict] = []
    writer: _ShardWriter | None = None
    cur = -1
    try:
        for si, last, results in _results(root, opts, shards, workers):
            if writer is None:
                writer, cur = _ShardWriter(out, shards[si], plan_id), si
            for r in results:
                writer.add(r)
            bar.update(len(results), sum(r[0] == "reject" for r in results))
            if last:  # finish now, not when the next shard's first chunk arrives: a crash there keeps this one
                done.append(writer.finish())
                writer = None
                if on_done is not None:
                    on_done(done[-1])
    except BrokenProcessPool:
        raise WorkerDied(
            f"a worker process died (killed, or out of memory?) while writing "
            f"{shards[max(cur, 0)]['name']}; "
            "rerun the same command to resume"
        ) from None
    finally:
        bar.close()
    return done
