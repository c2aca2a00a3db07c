"""Prep into an object store (``s3://``, ``gs://``): shards are made in a local staging folder exactly
as for a local OUT, and each one is uploaded when it is complete.

Per shard, in this order: ``<name>.tar`` (one PUT, or above two parts a multipart upload, which the
store publishes only when it completes), then ``<name>_sig.npz`` (its images' signatures), then
``<name>_stats.json``, which records the tar's size and
sha256 and whose presence marks the shard complete. Nothing is ever written under a final name before
it is whole; a run killed mid-upload leaves the previous object (or none). A rerun lists OUT once and
keeps each shard whose stats are from this plan and whose tar has the recorded size; any other shard
is made again and its objects replaced whole.

Stream shape: write_shards (staging folder) → finished shard → a queue of at most ``UPLOAD_DEPTH``
shards → one uploader thread (the upload overlaps the next shard's encoding) → OUT. So the staging
folder holds the shard being written plus at most ``UPLOAD_DEPTH`` finished ones, never the dataset.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import tempfile
import threading
from pathlib import Path

from pipeline.errors import Classified

from . import store
from .images import ImageOptions
from .shards import shard_done, signatures_name, stats_path, write_shards

UPLOAD_DEPTH = 2


class UploadFailed(Classified, RuntimeError):
    """An upload to the object store failed (exit 1); rerunning the same command resumes."""

    exit_code = 1


def default_staging() -> str:
    """Where shards wait for their upload when no staging folder is given: the system temp folder."""
    return os.path.join(tempfile.gettempdir(), "vitp-prep-staging")


def complete_shards(out: str | os.PathLike, shards: list[dict], plan_id: str, *, all_or_none: bool = False
                    ) -> dict[str, dict]:
    """{name: stats} of those planned ``shards`` that are complete in OUT (a folder or a prefix).
    ``all_or_none`` (finalize): {} as soon as one is not, before reading any stats."""
    if not store.is_remote(out):
        folder, done = Path(out), {}
        for s in shards:
            if shard_done(folder, s["name"], plan_id):
                done[s["name"]] = json.loads(stats_path(folder, s["name"]).read_text(encoding="utf-8"))
            elif all_or_none:
                return {}
        return done
    sizes = store.list_sizes(out)  # one listing, not a request per shard
    present = [s["name"] for s in shards if f"{s['name']}.tar" in sizes and f"{s['name']}_stats.json" in sizes
               and signatures_name(s["name"]) in sizes]
    if all_or_none and len(present) < len(shards):
        return {}
    stats = store.read_files(out, [f"{n}_stats.json" for n in present])
    done = {}
    for n in present:
        try:
            st = json.loads(stats[f"{n}_stats.json"] or b"null")
        except ValueError:  # not JSON: not ours, make the shard again
            continue
        if isinstance(st, dict) and st.get("plan_id") == plan_id and st.get("bytes") == sizes[f"{n}.tar"]:
            done[n] = st
    return {} if all_or_none and len(done) < len(shards) else done


def write_to_store(out: str, root: str, opts: ImageOptions, shards: list[dict], plan_id: str, workers: int,
                   progress: bool, staging: str | os.PathLike | None, part_size: int) -> list[dict]:
    """Make ``shards`` in a fresh folder under ``staging`` and upload each when complete; returns their
    stats. The staging folder is removed at the end (a killed run leaves it in the temp folder)."""
    base = Path(staging or default_staging())
    base.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix="vitp-prep-", dir=base))  # own folder: array tasks share a node
    try:
        with _Uploader(folder, out, part_size) as up:
            return write_shards(folder, root, opts, shards, plan_id, workers, progress, on_done=up.submit)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


class _Uploader:
    """One thread uploading finished shards in order; ``submit`` blocks while ``UPLOAD_DEPTH`` shards
    wait (bounds the staging folder) and raises the first upload failure."""

    def __init__(self, folder: Path, out: str, part_size: int):
        self.folder, self.out, self.part_size = folder, out, part_size
        self.q: queue.Queue = queue.Queue(maxsize=UPLOAD_DEPTH)
        self.error: UploadFailed | None = None
        self.stop = False
        self.thread = threading.Thread(target=self._run, name="vitp-prep-upload", daemon=True)
        self.thread.start()

    def submit(self, stats: dict) -> None:
        if self.error is not None:
            raise self.error
        self.q.put(stats["shard"].removesuffix(".tar"))

    def _run(self) -> None:
        while (name := self.q.get()) is not None:
            if self.error is None and not self.stop:
                try:
                    self._upload(name)
                except Exception as e:  # noqa: BLE001 (any SDK error: reported once, by the main thread)
                    self.error = e if isinstance(e, UploadFailed) else UploadFailed(str(e))

    def _upload(self, name: str) -> None:
        tar, stats = self.folder / f"{name}.tar", self.folder / f"{name}_stats.json"
        sig = self.folder / signatures_name(name)
        for local, upload in ((tar, lambda a: store.put_file(tar, a, self.part_size)),
                              (sig, lambda a: store.write_bytes(a, sig.read_bytes())),
                              (stats, lambda a: store.write_bytes(a, stats.read_bytes()))):  # stats last: the marker
            address = store.join(self.out, local.name)
            try:
                upload(address)
            except Exception as e:  # noqa: BLE001
                raise UploadFailed(f"{store.public(address)}: upload failed: {store.reason(e)}; rerun the same "
                                   "command to resume (complete shards are kept)") from None
        tar.unlink()
        sig.unlink()
        stats.unlink()

    def __enter__(self) -> _Uploader:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.stop = exc_type is not None  # failing: finish the upload in flight, drop the queued ones
        self.q.put(None)
        self.thread.join()
        if exc_type is None and self.error is not None:
            raise self.error
