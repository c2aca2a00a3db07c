"""`prep()`: list → plan → write the (missing) shards → `finalize()` once every shard is complete.

Output directory:
  _plan.json                      the plan (written first)
  classes.json                    class names, index = position
  <split>-NNNNNN.tar              samples <key>.cls / <key>.jpg|png|webp / <key>.json
  <split>-NNNNNN_stats.json       count, bytes, rejects by reason, seconds (written last per shard)
  rejects.jsonl, _info.json       written by finalize() when all shards are complete

Multi-label data (a manifest with a ``labels`` column) keeps the same three members, so timm's and
plain webdataset readers work unchanged: ``.cls`` holds the primary label, and the full set is the
``labels`` list (sorted class indices) in the sample's ``.json`` (timm's WebDataset reader:
``target_key="labels"``; webdataset: ``sample["json"]["labels"]`` after ``.decode()``). Not a member of
its own: webdataset's default decoders know ``.json`` but not a new extension, and a json field costs no
extra tar member per sample. ``_info.json`` then says ``"multi_label": true``.
"""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

from . import store
from .images import DEFAULT_MAX_BYTES, DEFAULT_MAX_PIXELS, ImageOptions
from .plan import build_plan, load_plan, plan_id, write_or_check_plan
from .schema import CLASSES_FILE, FORMAT_VERSION, INFO_FILE, DatasetInfo, SplitShards
from .shards import shard_done, write_shards
from .sources import list_source
from .upload import complete_shards, write_to_store

REJECTS_FILE = "rejects.jsonl"
DEFAULT_MAX_SAMPLES_PER_SHARD = 5000


def _json_bytes(obj) -> bytes:
    return (json.dumps(obj, indent=1, sort_keys=True, ensure_ascii=False) + "\n").encode("utf-8")


def prep(
    source: str | os.PathLike,
    out: str | os.PathLike,
    *,
    seed: int = 0,
    val_fraction: float = 0.0,
    split_column: str | None = None,
    path_column: str = "path",
    label_column: str = "label",
    labels_column: str = "labels",
    classes: str | os.PathLike | list[str] | None = None,
    shard_size_bytes: int | None = None,
    max_samples_per_shard: int | None = DEFAULT_MAX_SAMPLES_PER_SHARD,
    resize_shorter: int | None = None,
    resize_longer: int | None = None,
    quality: int = 90,
    min_size: int = 16,
    max_pixels: int = DEFAULT_MAX_PIXELS,
    max_bytes: int = DEFAULT_MAX_BYTES,
    keep_original: bool = True,
    dedup: bool = False,
    workers: int = 1,
    shard_range: tuple[int, int] | None = None,
    progress: bool = True,
    staging: str | os.PathLike | None = None,
    part_size: int = store.DEFAULT_PART_SIZE,
) -> dict:
    """Shard `source` (ImageFolder dir or CSV/JSONL/Parquet manifest) into WebDataset tars under `out`,
    a folder or an object store prefix (``s3://bucket/prefix``, ``gs://...``: see data_prep/upload.py;
    `staging` is the local folder where shards wait for their upload, `part_size` the multipart part).

    `shard_range=(start, stop)` writes only those planned shards (indices into the plan's shard list,
    all splits in order), for SLURM array tasks; `(0, 0)` only writes the plan and reports
    `shards_total`. Complete shards are skipped, so rerunning after a crash resumes.
    Returns a summary dict (see the keys at the end).
    """
    t0 = time.perf_counter()
    remote = store.is_remote(out)
    if remote:
        store.check_writable(out, "OUT")  # before listing a single image
        if part_size < store.MIN_PART_SIZE:
            raise ValueError(f"part_size={part_size}: object stores take parts of at least {store.MIN_PART_SIZE}")
        out = str(out).rstrip("/")
    else:
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
    opts = ImageOptions(resize_shorter, resize_longer, quality, min_size, max_pixels, max_bytes, keep_original)
    if workers < 1:
        raise ValueError(f"workers={workers}: must be >= 1")
    src = list_source(source, classes, path_column, label_column, split_column, labels_column)
    kwargs = dict(seed=seed, val_fraction=val_fraction, max_samples_per_shard=max_samples_per_shard,
                  shard_size_bytes=shard_size_bytes, image_options=opts.as_dict(), do_dedup=dedup)
    if dedup and workers > 1:
        with ProcessPoolExecutor(workers, mp_context=get_context("fork")) as ex:
            plan = build_plan(src, map_fn=lambda f, xs: ex.map(f, xs, chunksize=64), **kwargs)
    else:
        plan = build_plan(src, **kwargs)
    pid = write_or_check_plan(out, plan)
    store.write_file(out, CLASSES_FILE, _json_bytes(plan["classes"]))

    shards = plan["shards"]
    start, stop = shard_range if shard_range is not None else (0, len(shards))
    if not 0 <= start <= stop <= len(shards):
        raise ValueError(f"shard_range=({start}, {stop}): plan has {len(shards)} shards")
    if remote:
        done = complete_shards(out, shards[start:stop], pid)
        todo = [s for s in shards[start:stop] if s["name"] not in done]
        written = write_to_store(out, plan["root"], opts, todo, pid, workers, progress, staging, part_size)
    else:
        todo = [s for s in shards[start:stop] if not shard_done(out, s["name"], pid)]
        written = write_shards(out, plan["root"], opts, todo, pid, workers, progress)
    info = finalize(out)
    seconds = time.perf_counter() - t0
    n_written = sum(s["planned"] for s in written)
    return {
        "out": store.public(out),
        "plan_id": pid,
        "num_inputs": plan["num_inputs"],
        "shards_total": len(shards),
        "shards_written": len(written),
        "shards_skipped": (stop - start) - len(todo),
        "samples_written": sum(s["count"] for s in written),
        "rejects_written": sum(len(s["rejected"]) for s in written),
        "complete": info is not None,
        "num_samples": {k: v.num_samples for k, v in info.splits.items()} if info else None,
        "num_rejects": info.num_rejects if info else None,
        "rejects_by_reason": info.rejects_by_reason if info else None,
        "seconds": round(seconds, 3),
        "images_per_s": round(n_written / seconds, 2) if seconds > 0 else 0.0,
    }


def finalize(out: str | os.PathLike) -> DatasetInfo | None:
    """Write rejects.jsonl and _info.json if every planned shard is complete; else return None.

    Safe to call from several SLURM tasks at once: all write the same bytes, each file whole (atomic
    renames in a folder, single PUTs in an object store).
    """
    plan = load_plan(out)
    pid = plan_id(plan)
    done = complete_shards(out, plan["shards"], pid, all_or_none=True)
    if len(done) < len(plan["shards"]):
        return None
    stats = [done[sh["name"]] for sh in plan["shards"]]
    rejects = list(plan["rejects"]) + [r for st in stats for r in st["rejected"]]
    by_reason: dict[str, int] = {}
    for r in rejects:
        by_reason[r["reason"]] = by_reason.get(r["reason"], 0) + 1
    splits = {}
    for name in plan["splits"]:
        mine = [(sh, st) for sh, st in zip(plan["shards"], stats) if sh["split"] == name]
        splits[name] = SplitShards(name, filenames=tuple(f"{sh['name']}.tar" for sh, _ in mine),
                                   shard_lengths=tuple(st["count"] for _, st in mine),
                                   num_samples=sum(st["count"] for _, st in mine))
    # no timings here, so a rerun gives the same bytes
    info = DatasetInfo(
        splits, num_classes=len(plan["classes"]), classes=tuple(plan["classes"]),
        multi_label=bool(plan.get("multi_label")), plan_id=pid, num_inputs=plan["num_inputs"],
        num_rejects=len(rejects), rejects_by_reason=dict(sorted(by_reason.items())), seed=plan["seed"],
        image_options=plan["image_options"], format_version=FORMAT_VERSION, digest=pid,
    )
    lines = "".join(json.dumps(r, sort_keys=True, ensure_ascii=False) + "\n" for r in rejects)
    store.write_file(out, REJECTS_FILE, lines.encode("utf-8"))
    # last: its presence means the dataset is complete
    store.write_file(out, INFO_FILE, info.to_json().encode("utf-8"))
    return info
