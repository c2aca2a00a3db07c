"""`prep()`: list → plan → write the (missing) shards → `finalize()` once every shard is complete.

Output directory:
  _plan.json, _plan/              the plan's index and its pieces (written first; see plan.py)
  classes.json                    class names, index = position
  <split>-NNNNNN.tar              samples <key>.cls / <key>.jpg|png|webp / <key>.json
  <split>-NNNNNN_sig.npz          each kept sample's key and near-duplicate signature (data_prep/near.py)
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
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

from pipeline.config.prep import DEFAULT_MAX_SAMPLES_PER_SHARD, PrepCfg, prep_cfg

from . import store
from .contact import write_sheet
from .images import NEAR_DUPLICATE, ImageOptions
from .plan import (
    load_plan,
    make_plan,
    plan_digest,
    plan_options,
    plan_rejects,
    plan_request,
    planned_batches,
    reusable_plan,
    shard_names,
    write_or_check_plan,
)
from .schema import CLASSES_FILE, FORMAT_VERSION, INFO_FILE, DatasetInfo, SplitShards, read_exclusions, with_exclusions
from .shards import shard_done, use_near, write_shards
from .sources import open_source
from .testsets import build_index, check_test_sets, read_index, write_index
from .upload import complete_shards, write_to_store

REJECTS_FILE = "rejects.jsonl"
__all__ = ["DEFAULT_MAX_SAMPLES_PER_SHARD", "REJECTS_FILE", "finalize", "prep"]


def _json_bytes(obj) -> bytes:
    return (json.dumps(obj, indent=1, sort_keys=True, ensure_ascii=False) + "\n").encode("utf-8")


def prep(
    source: str | os.PathLike,
    out: str | os.PathLike,
    cfg: PrepCfg | None = None,
    *,
    shard_range: tuple[int, int] | None = None,
    progress: bool = True,
    **options,
) -> dict:
    """Shard `source` (ImageFolder dir or CSV/JSONL/Parquet manifest) into WebDataset tars under `out`,
    a folder or an object store prefix (``s3://bucket/prefix``, ``gs://...``: see data_prep/upload.py;
    `cfg.staging_dir` is the local folder where shards wait for their upload, `cfg.part_size` the
    multipart part).

    `cfg` is prep's one schema (pipeline.config.PrepCfg, what `vitp prep` parses into); `options`, its
    fields by name, replace the cfg's (``prep(src, out, max_samples_per_shard=8)``).
    `shard_range=(start, stop)` writes only those planned shards (indices into the plan's shard list,
    all splits in order), for SLURM array tasks; `(0, 0)` only writes the plan and reports
    `shards_total`. Complete shards are skipped, so rerunning after a crash resumes.
    Returns a summary dict (see the keys at the end).
    """
    cfg = prep_cfg({**(cfg.model_dump() if cfg is not None else {}), **options})
    t0 = time.perf_counter()
    remote = store.is_remote(out)
    if remote:
        store.check_writable(out, "OUT")  # before listing a single image
        if cfg.part_size < store.MIN_PART_SIZE:
            raise ValueError(f"--part-size {cfg.part_size}: object stores take parts of at least {store.MIN_PART_SIZE}")
        out = str(out).rstrip("/")
    else:
        out = Path(out)
    opts = ImageOptions.of(cfg)
    workers = cfg.workers
    array_task = shard_range not in (None, (0, 0))
    if not Path(source).exists():  # before OUT is made, as every input mistake
        raise FileNotFoundError(f"{source}: no such directory or manifest")
    near = _test_sets(out, cfg, array_task)  # a missing or empty test set: one line, before OUT is made
    if not remote:
        out.mkdir(parents=True, exist_ok=True)
    # an array task (a shard range) reuses the plan its submitter stored for this very request, and
    # so never lists the source; a whole run, or the submitter (0:0), plans and checks it against OUT's
    request = {**plan_request(source, cfg), **({"decontaminated": near[2]} if near else {})}
    index = reusable_plan(out, request) if array_task else None
    if index is None:
        index = _plan(out, source, cfg, near)
        if near:  # once the plan is OUT's: what every worker and array task of it reads
            write_index(out, *near)
    plan_id = plan_digest(index)
    use_near(*(near[:2] if near else (None, None)))
    store.write_file(out, CLASSES_FILE, _json_bytes(index["classes"]))

    n_shards = len(shard_names(index))
    start, stop = shard_range if shard_range is not None else (0, n_shards)
    if not 0 <= start <= stop <= n_shards:
        raise ValueError(f"shard_range=({start}, {stop}): plan has {n_shards} shards")
    written, skipped = [], 0
    for batch in planned_batches(out, index, start, stop):  # a plan piece at a time: memory stays a piece's
        if remote:
            done = complete_shards(out, batch, plan_id)
            todo = [s for s in batch if s["name"] not in done]
            written += write_to_store(out, index["root"], opts, todo, plan_id, workers, progress, cfg.staging_dir,
                                      cfg.part_size)
        else:
            todo = [s for s in batch if not shard_done(out, s["name"], plan_id)]
            written += write_shards(out, index["root"], opts, todo, plan_id, workers, progress)
        skipped += len(batch) - len(todo)
    info = finalize(out)
    if info is not None and info.decontaminated and info.decontaminated.get("rejected"):
        rejects = [json.loads(line) for line in store.read_file(out, REJECTS_FILE).decode("utf-8").splitlines()]
        write_sheet(out, index["root"], rejects, cfg.exclude_near, cfg.near_threshold)
    seconds = time.perf_counter() - t0
    n_written = sum(s["planned"] for s in written)
    return {
        "out": store.public(out),
        "plan_id": plan_id,
        "num_inputs": index["num_inputs"],
        "shards_total": n_shards,
        "shards_written": len(written),
        "shards_skipped": skipped,
        "samples_written": sum(s["count"] for s in written),
        "rejects_written": sum(len(s["rejected"]) for s in written),
        "complete": info is not None,
        "num_samples": {k: v.num_samples for k, v in info.splits.items()} if info else None,
        "num_rejects": info.num_rejects if info else None,
        "rejects_by_reason": info.rejects_by_reason if info else None,
        **({"decontaminated": info.decontaminated} if info and info.decontaminated else {}),
        "seconds": round(seconds, 3),
        "images_per_s": round(n_written / seconds, 2) if seconds > 0 else 0.0,
    }


def _test_sets(out, cfg: PrepCfg, array_task: bool) -> tuple | None:
    """--exclude-near: the test sets' index, built here once (a whole run, or the submitter of an array)
    and stored under OUT, or, in an array task, the one its submitter stored there."""
    if not cfg.exclude_near:
        use_near(None, None)
        return None
    settings = {"addresses": [store.public(a) for a in cfg.exclude_near], "splits": cfg.exclude_near_splits,
                "threshold": cfg.near_threshold}
    if array_task:
        stored = read_index(out)
        if stored is not None and _settings(stored[2]) == settings:
            return stored
    check_test_sets(cfg.exclude_near)
    return build_index(cfg.exclude_near, cfg.exclude_near_splits, cfg.near_threshold)


def _settings(block: dict) -> dict:
    return {"addresses": [a["address"] for a in block["against"]], "splits": block["splits"],
            "threshold": block["threshold"]}


def _plan(out: Path, source, cfg: PrepCfg, near: tuple | None) -> dict:
    """List and plan the source in bounded memory (spilling to a temporary folder), store the plan in OUT."""
    listing = open_source(source, cfg.classes, path_column=cfg.path_column, label_column=cfg.label_column,
                          split_column=cfg.split_column, labels_column=cfg.labels_column, sizes=bool(cfg.shard_size))
    request = {**plan_request(source, cfg), **({"decontaminated": near[2]} if near else {})}
    kwargs = plan_options(cfg)
    with tempfile.TemporaryDirectory(prefix="vitp-plan-") as scratch:
        if cfg.dedup and cfg.workers > 1:
            with ProcessPoolExecutor(cfg.workers, mp_context=get_context("fork")) as ex:
                index = make_plan(listing, scratch, map_fn=lambda f, xs: ex.map(f, xs, chunksize=64),
                                  request=request, **kwargs)
        else:
            index = make_plan(listing, scratch, request=request, **kwargs)
        if near:  # in the index, so in the plan id: other test sets or another threshold remake the shards
            index["decontaminated"] = near[2]
        write_or_check_plan(out, index, scratch)
    return index


def _decontaminated(block: dict | None, rejects: list[dict]) -> dict | None:
    """The plan's decontaminated block with its counts: per test set, the training images rejected and
    the distinct test images that had a duplicate among them (``duplicated``: as BiT counts per test
    set), and the training images rejected in all."""
    if block is None:
        return None
    near = [r["of"] for r in rejects if r["reason"] == NEAR_DUPLICATE]
    against = []
    for a in block["against"]:
        mine = [o for o in near if o.startswith(a["address"] + "/")]
        against.append({**a, "rejected": len(mine), "duplicated": len(set(mine))})
    return {**block, "against": against, "rejected": len(near)}


def finalize(out: str | os.PathLike) -> DatasetInfo | None:
    """Write rejects.jsonl and _info.json if every planned shard is complete; else return None.

    Safe to call from several SLURM tasks at once: all write the same bytes, each file whole (atomic
    renames in a folder, single PUTs in an object store).
    """
    index = load_plan(out)
    plan_id = plan_digest(index)
    names = shard_names(index)
    done = complete_shards(out, [{"name": name} for name, _ in names], plan_id, all_or_none=True)
    if len(done) < len(names):
        return None
    stats = [done[name] for name, _ in names]
    rejects = plan_rejects(out, index) + [r for st in stats for r in st["rejected"]]
    by_reason: dict[str, int] = {}
    for r in rejects:
        by_reason[r["reason"]] = by_reason.get(r["reason"], 0) + 1
    splits = {}
    for split in index["splits"]:
        mine = [(name, st) for (name, s), st in zip(names, stats) if s == split]
        splits[split] = SplitShards(split, filenames=tuple(f"{name}.tar" for name, _ in mine),
                                    shard_lengths=tuple(st["count"] for _, st in mine),
                                    num_samples=sum(st["count"] for _, st in mine))
    # no timings here, so a rerun gives the same bytes
    info = DatasetInfo(
        splits, num_classes=len(index["classes"]), classes=tuple(index["classes"]),
        multi_label=bool(index.get("multi_label")), plan_id=plan_id, num_inputs=index["num_inputs"],
        num_rejects=len(rejects), rejects_by_reason=dict(sorted(by_reason.items())), seed=index["seed"],
        image_options=index["image_options"], format_version=FORMAT_VERSION, digest=plan_id,
        # with the sets `vitp decontam` checked after an earlier run, so a rerun keeps _info.json and
        # _exclude.json in agreement
        decontaminated=with_exclusions(_decontaminated(index.get("decontaminated"), rejects), read_exclusions(out)),
    )
    lines = "".join(json.dumps(r, sort_keys=True, ensure_ascii=False) + "\n" for r in rejects)
    store.write_file(out, REJECTS_FILE, lines.encode("utf-8"))
    # last: its presence means the dataset is complete
    store.write_file(out, INFO_FILE, info.to_json().encode("utf-8"))
    return info
