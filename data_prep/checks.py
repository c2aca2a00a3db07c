"""`verify(out)`: read every shard back and check it against _info.json, the stats files and the sample json."""

from __future__ import annotations

import hashlib
import io
import json
import os
import tarfile
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

from PIL import Image

from .schema import CLASSES_FILE, IMAGE_EXTS, INFO_FILE, DatasetInfo, SchemaError, read_classes


def _check_labels(where: str, meta: dict, cls: int, num_classes: int) -> list[str]:
    """A multi-label sample's json ``labels``: sorted distinct class indices that include ``.cls``."""
    labels = meta.get("labels")
    ok = (isinstance(labels, list) and labels and all(type(c) is int and 0 <= c < num_classes for c in labels)
          and labels == sorted(set(labels)) and cls in labels)
    return [] if ok else [f"{where}: json labels {labels!r} are not sorted distinct indices < {num_classes} "
                          f"holding cls {cls}"]


def _check_sample(shard: str, key: str, members: dict[str, bytes], num_classes: int,
                  multi_label: bool = False) -> list[str]:
    where = f"{shard}: sample {key}"
    exts = sorted(members)
    images = [e for e in exts if e in IMAGE_EXTS]
    if len(images) != 1 or "cls" not in members or "json" not in members or len(exts) != 3:
        return [f"{where}: members {exts}, expected cls + json + one image ({'/'.join(sorted(IMAGE_EXTS))})"]
    problems = []
    data = members[images[0]]
    try:
        meta = json.loads(members["json"])
        cls = int(members["cls"])
    except ValueError as e:
        return [f"{where}: unreadable cls/json ({e})"]
    if meta.get("cls") != cls or not 0 <= cls < num_classes:
        problems.append(f"{where}: cls {cls} (json says {meta.get('cls')}, {num_classes} classes)")
    if multi_label:
        problems += _check_labels(where, meta, cls, num_classes)
    if hashlib.sha256(data).hexdigest() != meta.get("sha256"):
        problems.append(f"{where}: sha256 of .{images[0]} does not match its json")
    try:
        with Image.open(io.BytesIO(data)) as im:
            im.load()
            if im.mode != "RGB" or im.size != (meta.get("width"), meta.get("height")):
                problems.append(f"{where}: image is {im.mode} {im.size}, json says RGB "
                                f"{(meta.get('width'), meta.get('height'))}")
    except Exception as e:  # any decoder failure is a problem to report, not a crash
        problems.append(f"{where}: image does not decode ({e})")
    return problems


def check_shard(path: str, num_classes: int, multi_label: bool = False) -> tuple[int, list[str], list[str]]:
    """One tar → (sample count, keys, problems)."""
    name = os.path.basename(path)
    problems: list[str] = []
    samples: dict[str, dict[str, bytes]] = {}
    order: list[str] = []
    try:
        with tarfile.open(path, "r") as tar:
            for m in tar:
                if not m.isfile():
                    problems.append(f"{name}: member {m.name} is not a regular file")
                    continue
                key, _, ext = m.name.partition(".")
                if not order or order[-1] != key:
                    if key in samples:  # webdataset groups by consecutive key: a split sample reads as two
                        problems.append(f"{name}: members of {key} are not contiguous")
                    else:
                        samples[key] = {}
                        order.append(key)
                f = tar.extractfile(m)
                samples[key][ext] = f.read() if f else b""
    except (tarfile.TarError, OSError, EOFError) as e:
        return 0, [], [f"{name}: unreadable tar ({e})"]
    for key in order:
        problems += _check_sample(name, key, samples[key], num_classes, multi_label)
    return len(order), order, problems


def verify(out: str | os.PathLike, workers: int = 1) -> list[str]:
    """All problems found in a prepared directory (empty list = good)."""
    out = Path(out)
    info_path = out / INFO_FILE
    if not info_path.exists():
        return [f"{info_path}: missing (prep did not finish; rerun it to resume)"]
    try:
        info = DatasetInfo.read(info_path)
        classes = read_classes(out)
    except SchemaError as e:
        return [str(e)]
    if classes is None:
        return [f"{out / CLASSES_FILE}: missing"]
    problems = []
    if info.classes is None or list(classes) != list(info.classes) or len(classes) != info.num_classes:
        problems.append("classes.json does not match classes/num_classes in _info.json")
    jobs = []  # (split, file, expected count)
    for split, s in info.splits.items():
        lengths = s.shard_lengths or ()
        if len(s.filenames) != len(lengths) or sum(lengths) != s.num_samples:
            problems.append(f"_info.json: split {split}: num_samples/shard_lengths/filenames disagree")
        jobs += [(split, f, n) for f, n in zip(s.filenames, lengths)]
    paths = [str(out / f) for _, f, _ in jobs]
    multi = info.multi_label
    if workers > 1:
        with ProcessPoolExecutor(workers, mp_context=get_context("fork")) as ex:
            results = list(ex.map(check_shard, paths, [len(classes)] * len(paths), [multi] * len(paths)))
    else:
        results = [check_shard(p, len(classes), multi) for p in paths]
    seen: set[str] = set()
    total = 0
    for (_split, fname, expected), (count, keys, probs) in zip(jobs, results):
        problems += probs
        total += count
        if count != expected:
            problems.append(f"{fname}: {count} samples, _info.json says {expected}")
        stats_file = out / fname.replace(".tar", "_stats.json")
        try:
            st = json.loads(stats_file.read_text(encoding="utf-8"))
            if st["count"] != count:
                problems.append(f"{fname}: {count} samples, {stats_file.name} says {st['count']}")
        except (OSError, ValueError, KeyError) as e:
            problems.append(f"{stats_file.name}: unreadable ({e})")
        dup = seen.intersection(keys)
        if dup:
            problems.append(f"{fname}: keys also in another shard: {sorted(dup)[:3]}")
        seen.update(keys)
    try:
        n_rejects = sum(1 for ln in (out / "rejects.jsonl").read_text(encoding="utf-8").splitlines() if ln.strip())
    except OSError:
        n_rejects = -1
    if n_rejects != info.num_rejects:
        problems.append(f"rejects.jsonl has {n_rejects} lines, _info.json says {info.num_rejects}")
    if total + (info.num_rejects or 0) != info.num_inputs:
        problems.append(f"{total} samples + {info.num_rejects} rejects != {info.num_inputs} inputs")
    return problems
