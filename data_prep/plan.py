"""The plan: which input goes to which split, shard and key. A pure function of the inputs, seed and options.

Written to OUT/_plan.json before any shard, so reruns, `--workers N` and SLURM array tasks (each
handling a `shard_range`) all agree on the same shards, byte for byte.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
from collections.abc import Callable, Iterable

from . import store
from .sources import SPLIT_NAME, Item, Source

PLAN_FILE = "_plan.json"
PLAN_VERSION = 1


def file_sha256(path: str) -> str | None:
    """Content hash for --dedup; None when unreadable (the image worker will reject it with a reason)."""
    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    except OSError:
        return None
    return h.hexdigest()


def dedup(src: Source, map_fn: Callable[[Callable, Iterable], Iterable] = map) -> tuple[list[Item], list[dict]]:
    """Keep the first of each set of byte-identical files (in path order); the others become rejects."""
    items = sorted(src.items, key=lambda it: it.rel)
    paths = [os.path.join(src.root, it.rel) for it in items]
    hashes = list(map_fn(file_sha256, paths))
    first: dict[str, str] = {}
    kept, rejects = [], []
    for it, h in zip(items, hashes):
        if h is None or it.size == 0:  # empty files are "empty", not duplicates of each other
            kept.append(it)
        elif h in first:
            rejects.append({"path": it.rel, "reason": "duplicate", "detail": f"same bytes as {first[h]}"})
        else:
            first[h] = it.rel
            kept.append(it)
    return kept, rejects


def assign_splits(items: list[Item], val_fraction: float, val_name: str = "val") -> dict[str, list[Item]]:
    """Items (already shuffled) → {split: items}; a val fraction is taken per class (stratified)."""
    if any(it.split for it in items):
        out: dict[str, list[Item]] = {}
        for it in items:
            out.setdefault(it.split, []).append(it)
        return dict(sorted(out.items()))
    if not val_fraction:
        return {"train": items}
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction={val_fraction}: must be in [0, 1)")
    per_class: dict[int, int] = {}
    for it in items:
        per_class[it.cls] = per_class.get(it.cls, 0) + 1
    # round half up, per class, so each class keeps the same val share
    quota = {c: math.floor(n * val_fraction + 0.5) for c, n in per_class.items()}
    train, val = [], []
    for it in items:
        if quota[it.cls] > 0:
            quota[it.cls] -= 1
            val.append(it)
        else:
            train.append(it)
    return {"train": train, val_name: val}


def plan_shards(items: list[Item], split: str, max_samples: int | None, max_bytes: int | None) -> list[dict]:
    """Cut a split into consecutive shards by sample count and/or (source) bytes."""
    shards: list[dict] = []
    cur: list[list] = []
    cur_bytes = 0

    def close():
        shards.append({"name": f"{split}-{len(shards):06d}", "split": split, "samples": list(cur)})

    for i, it in enumerate(items):
        full = (max_samples and len(cur) >= max_samples) or (max_bytes and cur and cur_bytes + it.size > max_bytes)
        if full:
            close()
            cur, cur_bytes = [], 0
        # sample = [key, source path, class index, class name(, every class index: multi-label)]; keys
        # carry no dot (webdataset splits there)
        cur.append([f"{split}_{i:08d}", it.rel, it.cls, it.label, *([list(it.labels)] if it.labels else [])])
        cur_bytes += it.size
    if cur:
        close()
    return shards


def build_plan(
    src: Source,
    *,
    seed: int,
    val_fraction: float,
    max_samples_per_shard: int | None,
    shard_size_bytes: int | None,
    image_options: dict,
    do_dedup: bool,
    map_fn: Callable = map,
) -> dict:
    if not max_samples_per_shard and not shard_size_bytes:
        raise ValueError("give max_samples_per_shard and/or shard_size_bytes")
    items, rejects = (dedup(src, map_fn) if do_dedup else (list(src.items), []))
    # sort first so the shuffle does not depend on directory listing order or manifest row order
    items.sort(key=lambda it: (it.rel, it.cls, it.split or ""))
    random.Random(seed).shuffle(items)
    splits = assign_splits(items, val_fraction)
    for name in splits:
        if not SPLIT_NAME.match(name):
            raise ValueError(f"split name {name!r} must match [A-Za-z0-9_]+")
    shards = [s for name, its in splits.items()
              for s in plan_shards(its, name, max_samples_per_shard, shard_size_bytes)]
    multi = {"multi_label": True} if src.multi_label else {}  # single-label plans keep their bytes and ids
    return {
        **multi,
        "version": PLAN_VERSION,
        "root": src.root,
        "seed": seed,
        "val_fraction": val_fraction,
        "max_samples_per_shard": max_samples_per_shard,
        "shard_size_bytes": shard_size_bytes,
        "dedup": do_dedup,
        "image_options": image_options,
        "classes": src.classes,
        "splits": sorted(splits),
        "num_inputs": len(src.items) + len(src.rejects),
        "rejects": sorted(src.rejects + rejects, key=lambda r: (r["path"], r["reason"])),
        "shards": shards,
    }


def plan_bytes(plan: dict) -> bytes:
    return json.dumps(plan, sort_keys=True, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def plan_id(plan: dict) -> str:
    return hashlib.sha256(plan_bytes(plan)).hexdigest()[:16]


def write_or_check_plan(out: str | os.PathLike, plan: dict) -> str:
    """Store the plan; if OUT (a folder or an object store prefix) already holds a different one,
    refuse rather than mix two datasets."""
    data = plan_bytes(plan)
    old = store.read_file(out, PLAN_FILE)
    if old is not None:
        if old != data:
            raise ValueError(
                f"{store.public(store.join(out, PLAN_FILE))}: OUT already holds shards of a different plan "
                "(other inputs, seed or options); use a new output directory or delete it"
            )
    else:
        store.write_file(out, PLAN_FILE, data)
    return plan_id(plan)


def load_plan(out: str | os.PathLike) -> dict:
    data = store.read_file(out, PLAN_FILE)
    if data is None:
        raise FileNotFoundError(f"{store.public(store.join(out, PLAN_FILE))}: no plan; run `vitp prep` on this "
                                "output directory first")
    return json.loads(data.decode("utf-8"))
