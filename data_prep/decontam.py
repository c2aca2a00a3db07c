"""`vitp decontam OUT --exclude-near TEST ...`: check a finished prep output against test sets chosen
after it was made, from the signatures prep stored beside each shard (``<shard>_sig.npz``; no image
is read or decoded), and write ``OUT/_exclude.json``, the samples every loader then leaves out
(pipeline/data/shards.py: read_info) without the shards being rewritten, and add its test sets to
``OUT/_info.json``'s ``decontaminated`` block, marked as checked after prep (schema.with_exclusions).

``_exclude.json`` (``version``: EXCLUDE_VERSION): the signature, its version and the threshold, per test set its address
without secrets, image count, digest, the training samples it excluded (``rejected``) and the distinct
test images that had a duplicate (``duplicated``); ``excluded`` in all; and ``samples``: [{"split",
"shard", "index" (the sample's number in its shard), "key", "of", "distance", "margin"}] sorted. The
same test sets again give the same bytes.

An output from before prep stored signatures: ``rehash=True`` decodes each shard lacking them once
and writes its ``_sig.npz`` (the signature of the stored pixels: a re-encoded JPEG's decode, which
moves a thumbnail by a grey level or so); without it, one line saying so, before anything is written.

In steps, so that `vitp submit decontam` runs the middle one as a SLURM array over shard ranges
(launch/job_body.py: run_decontam): ``plan`` (checks, and the test sets' index), ``check_shards`` (one
range's excluded samples, a ``part``), ``write_exclusions`` (the parts merged into the file). The
array's submitter stores the index under ``OUT/_decontam/<request>/`` (``submit_plan``), each task its
part there (``run_part``), and the task that finds every part written merges them: the same bytes as
one process writes.
"""

from __future__ import annotations

import hashlib
import io
import json
import os

import numpy as np
from PIL import Image

from . import store
from .images import to_rgb_array
from .near import signature
from .schema import EXCLUDE_FILE, EXCLUDE_VERSION, IMAGE_EXTS, INFO_FILE, DatasetInfo, info_with_exclusions
from .shards import signatures_bytes, signatures_name
from .tar import iter_tar
from .testsets import build_index, check_test_sets, read_index, write_index

WORK_DIR = "_decontam"  # under OUT: an array's index and its tasks' parts
BATCH = 64  # signature files read at once (an object store is asked for them concurrently)


def shard_list(out: str) -> list[tuple[str, str]]:
    """[(split, shard filename)] of a finished prep output, in split then shard order (the array's ranges
    index it). OUT without _info.json is one line."""
    raw = store.read_file(out, INFO_FILE)
    if raw is None:
        raise ValueError(f"{store.public(out)}: no {INFO_FILE} (not a finished `vitp prep` output)")
    info = DatasetInfo.from_json(raw.decode("utf-8"), store.public(store.join(out, INFO_FILE)))
    return [(split, f) for split, sp in info.splits.items() for f in sp.filenames]


def _sig_name(shard: str) -> str:
    return signatures_name(shard.removesuffix(".tar"))


def check_signatures(out: str, shards: list[tuple[str, str]], rehash: bool) -> None:
    """Without ``rehash``, every shard's signatures there (one listing), else one line naming the first
    missing file: an output prepared before prep stored them."""
    if rehash:
        return
    have = store.list_sizes(out)
    for _, f in shards:
        if _sig_name(f) not in have:
            raise ValueError(f"{store.public(store.join(out, _sig_name(f)))}: not found: this output was prepared "
                             "before prep stored signatures; run the same `vitp prep` again (it remakes the "
                             "shards without them) or pass --rehash (decodes each such shard once)")


def rehash_shard(out: str, shard: str) -> bytes:
    """Decode every sample's image of one shard, in its order -> its ``_sig.npz`` bytes (written by the caller)."""
    rows = []
    with store.open_read(store.join(out, shard)) as f:
        for name, _, read in iter_tar(f, seekable=False):
            key, _, ext = name.rpartition(".")
            if ext.lower() in IMAGE_EXTS:
                im = Image.open(io.BytesIO(read()))
                rows.append((key, *signature(to_rgb_array(im) if im.mode != "RGB" else np.asarray(im))))
    return signatures_bytes(rows)


def plan(out: str | os.PathLike, test_sets: list[str], splits: list[str] | None, threshold: int,
         rehash: bool = False) -> tuple[str, list[tuple[str, str]], tuple]:
    """Every check before any work: (OUT as a string, its shards, build_index()'s (index, names, block)).
    Bad input (OUT not a finished prep output or not writable, a missing or unreadable test set, missing
    signatures without ``rehash``) is a ValueError of one line."""
    out = str(out).rstrip("/")
    shards = shard_list(out)
    store.check_writable(out, "vitp decontam")
    check_signatures(out, shards, rehash)
    check_test_sets(test_sets)
    return out, shards, build_index(test_sets, splits, threshold)


def check_shards(out: str, shards: list[tuple[str, str]], index, names: list[str]) -> list[dict]:
    """The excluded samples of these shards (a part): a shard without signatures is rehashed first and
    its ``_sig.npz`` written (plan() let that through only with ``rehash``)."""
    samples = []
    for at, (split, f) in enumerate(shards):
        if at % BATCH == 0:  # a batch of files at a time: memory stays a batch's, however many shards
            got = store.read_files(out, [_sig_name(g) for _, g in shards[at:at + BATCH]])
        raw = got[_sig_name(f)]
        if raw is None:
            raw = rehash_shard(out, f)
            store.write_file(out, _sig_name(f), raw)
        z = np.load(io.BytesIO(raw), allow_pickle=False)
        for i, (h, t, key) in enumerate(zip(z["hash"], z["thumb"], z["key"])):
            m = index.nearest(int(h), t)
            if m is not None:
                samples.append({"split": split, "shard": f, "index": i, "key": str(key),
                                "of": names[m.test], "distance": m.distance, "margin": m.margin})
    return samples


def write_exclusions(out: str, block: dict, samples: list[dict]) -> dict:
    """Write OUT/_exclude.json from every part's samples; return its summary (the file without ``samples``)."""
    against = []
    for a in block["against"]:
        mine = [s["of"] for s in samples if s["of"].startswith(a["address"] + "/")]
        against.append({**a, "rejected": len(mine), "duplicated": len(set(mine))})
    summary = {**{k: v for k, v in block.items() if k not in ("against", "version")},
               "signature_version": block["version"], "version": EXCLUDE_VERSION, "against": against,
               "excluded": len(samples)}
    doc = {**summary, "samples": sorted(samples, key=lambda s: (s["split"], s["shard"], s["index"]))}
    store.write_file(out, EXCLUDE_FILE, (json.dumps(doc, indent=1, sort_keys=True) + "\n").encode("utf-8"))
    show_in_info(out, summary)
    return summary


def show_in_info(out: str, summary: dict) -> None:
    """OUT/_info.json's ``decontaminated`` block with the list's test sets (schema.with_exclusions),
    written whole in one step (a rename in a folder, one PUT in an object store), and only if it
    changes: the same sets again leave it as it was. After _exclude.json, so that between the two
    writes _info.json names the sets of a list no longer there; readers (pipeline/data read_info)
    take the list's sets from _exclude.json itself, so they see no gap."""
    text = store.read_file(out, INFO_FILE).decode("utf-8")
    new = info_with_exclusions(text, summary)
    if new != text:
        store.write_file(out, INFO_FILE, new.encode("utf-8"))


def decontam(out: str | os.PathLike, test_sets: list[str], splits: list[str] | None, threshold: int,
             rehash: bool = False) -> dict:
    """Check every sample of OUT against ``test_sets`` in this process; write OUT/_exclude.json; return
    its summary. See plan() for what is refused before anything is written."""
    out, shards, (index, names, block) = plan(out, test_sets, splits, threshold, rehash)
    return write_exclusions(out, block, check_shards(out, shards, index, names))


# --------------------------------------------------------------------------------------------------
# The array's files (launch/job_body.py: run_decontam)
# --------------------------------------------------------------------------------------------------
def request_id(block: dict, ranges: list) -> str:
    """Names one array request's parts: the test sets' block (addresses, digests, threshold) and the
    ranges, so a part of another request is never merged."""
    return hashlib.sha256(json.dumps([block, ranges], sort_keys=True).encode()).hexdigest()[:12]


def part_name(request: str, r: tuple[int, int] | list[int]) -> str:
    return f"part-{request}-{r[0]:06d}-{r[1]:06d}.json"


def work_dir(out: str, request: str) -> str:
    return store.join(out, f"{WORK_DIR}/{request}")


def submit_plan(out: str | os.PathLike, test_sets: list[str], splits: list[str] | None, threshold: int,
                rehash: bool, ranges_of) -> tuple[str, list[tuple[int, int]], str]:
    """The submitter's part: plan() (every check, the test sets hashed once), the shard ranges
    (``ranges_of(number of shards)``) and the index stored for the tasks -> (OUT, ranges, request)."""
    out, shards, (index, names, block) = plan(out, test_sets, splits, threshold, rehash)
    ranges = [tuple(r) for r in ranges_of(len(shards))]
    request = request_id(block, ranges)
    write_index(work_dir(out, request), index, names, block)
    return out, ranges, request


def run_part(out: str, ranges: list, request: str, task: int) -> dict:
    """One array task: its range's excluded samples written as its part; the task that then finds
    every part there writes OUT/_exclude.json (two finding it at once write the same bytes)."""
    work = work_dir(out, request)
    got = read_index(work)
    if got is None:
        raise ValueError(f"{store.public(work)}: no index (written by `vitp submit decontam` before the array)")
    index, names, block = got
    a, b = ranges[task]
    samples = check_shards(out, shard_list(out)[a:b], index, names)
    store.write_file(work, part_name(request, ranges[task]),
                     (json.dumps(samples, sort_keys=True) + "\n").encode("utf-8"))
    parts = store.read_files(work, [part_name(request, r) for r in ranges])
    summary = {"excluded_here": len(samples), "complete": all(v is not None for v in parts.values())}
    if summary["complete"]:
        merged = [x for raw in parts.values() for x in json.loads(raw)]
        summary["excluded"] = write_exclusions(out, block, merged)["excluded"]
    return summary
