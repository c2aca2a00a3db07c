"""`verify(out)`: read every shard back and check it against _info.json, the stats files and the sample json."""

from __future__ import annotations

import hashlib
import io
import json
import os
import tarfile
import urllib.parse
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context

from PIL import Image

from . import store
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


def check_shard(path: str, num_classes: int, multi_label: bool = False) -> tuple[int, list[str], list[str], dict]:
    """One tar (a file, or an object read as a stream: never downloaded to disk) → (sample count, keys,
    problems, {"bytes": size, "sha256": hash} of the whole tar as read)."""
    name = os.path.basename(urllib.parse.urlsplit(path).path if store.is_remote(path) else path)
    problems: list[str] = []
    samples: dict[str, dict[str, bytes]] = {}
    order: list[str] = []
    stream = None
    try:
        stream = _Hashing(store.open_read(path))
        # the standard library's reader, not data_prep.tar: verify is a second opinion on what that module
        # wrote, so a bug the writer and the loader's reader share cannot pass it
        with tarfile.open(fileobj=stream, mode="r|") as tar:  # "r|": in order, no seeks (a stream)
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
        stream.drain()  # the archive's padding after its end marker belongs to the hashed bytes
    except (tarfile.TarError, EOFError) as e:
        return 0, [], [f"{name}: unreadable tar ({e})"], {}
    except OSError as e:  # an SDK's message may repeat the address with its query string: not printed
        return 0, [], [f"{name}: unreadable tar ({store.reason(e) if store.is_remote(path) else e})"], {}
    finally:
        if stream is not None:
            stream.close()
    for key in order:
        problems += _check_sample(name, key, samples[key], num_classes, multi_label)
    return len(order), order, problems, {"bytes": stream.size, "sha256": stream.hash.hexdigest()}


class _Hashing:
    """A read-only stream that hashes and counts what passes through it (tarfile reads it in order)."""

    def __init__(self, f):
        self.f, self.hash, self.size = f, hashlib.sha256(), 0

    def read(self, n: int = -1) -> bytes:
        b = self.f.read(n)
        self.hash.update(b)
        self.size += len(b)
        return b

    def drain(self) -> None:
        while self.read(1 << 20):
            pass

    def close(self) -> None:
        self.f.close()


def _read_json(out: str, name: str, problems: list[str]):
    """A JSON file of the dataset (folder or address), or None with a problem line when missing/unreadable."""
    where = store.public(store.join(out, name))
    try:
        data = store.read_file(out, name)
        if data is None:
            problems.append(f"{where}: missing")
            return None
        return json.loads(data.decode("utf-8"))
    except (OSError, ValueError) as e:
        problems.append(f"{where}: unreadable ({e})")
        return None


def _classes(out: str) -> tuple[str, ...] | None:
    if not store.is_remote(out):
        return read_classes(out)
    data = store.read_file(out, CLASSES_FILE)
    if data is None:
        return None
    try:
        names = json.loads(data.decode("utf-8"))
    except ValueError as e:
        raise SchemaError(f"{store.public(store.join(out, CLASSES_FILE))}: unreadable ({e})") from None
    if not isinstance(names, list):
        raise SchemaError(f"{store.public(store.join(out, CLASSES_FILE))}: expected a list of class names")
    return tuple(str(x) for x in names)


def verify(out: str | os.PathLike, workers: int = 1) -> list[str]:
    """All problems found in a prepared dataset, a folder or an address (``s3://``, ``gs://``,
    ``https://``: each shard is streamed); empty list = good."""
    out = str(out)
    shown = store.public(store.join(out, INFO_FILE))
    raw = store.read_file(out, INFO_FILE)
    if raw is None:
        return [f"{shown}: missing (prep did not finish; rerun it to resume)"]
    try:
        try:
            info = DatasetInfo.from_json(raw.decode("utf-8"), shown)
        except UnicodeDecodeError as e:
            raise SchemaError(f"{shown}: unreadable ({e})") from None
        classes = _classes(out)
    except SchemaError as e:
        return [str(e)]
    if classes is None:
        return [f"{store.public(store.join(out, CLASSES_FILE))}: missing"]
    problems = []
    if info.classes is None or list(classes) != list(info.classes) or len(classes) != info.num_classes:
        problems.append("classes.json does not match classes/num_classes in _info.json")
    jobs = []  # (split, file, expected count)
    for split, s in info.splits.items():
        lengths = s.shard_lengths or ()
        if len(s.filenames) != len(lengths) or sum(lengths) != s.num_samples:
            problems.append(f"_info.json: split {split}: num_samples/shard_lengths/filenames disagree")
        jobs += [(split, f, n) for f, n in zip(s.filenames, lengths)]
    paths = [store.join(out, f) for _, f, _ in jobs]
    multi = info.multi_label
    if workers > 1:
        # an object store's client (an event loop, open connections) does not survive a fork: remote
        # shards are read by spawned workers, each with its own
        method = "spawn" if store.is_remote(out) else "fork"
        with ProcessPoolExecutor(workers, mp_context=get_context(method)) as ex:
            results = list(ex.map(check_shard, paths, [len(classes)] * len(paths), [multi] * len(paths)))
    else:
        results = [check_shard(p, len(classes), multi) for p in paths]
    seen: set[str] = set()
    total = 0
    for (_split, fname, expected), (count, keys, probs, whole) in zip(jobs, results):
        problems += probs
        total += count
        if count != expected:
            problems.append(f"{fname}: {count} samples, _info.json says {expected}")
        stats_name = fname.replace(".tar", "_stats.json")
        st = _read_json(out, stats_name, problems)
        if isinstance(st, dict):
            if st.get("count") != count:
                problems.append(f"{fname}: {count} samples, {os.path.basename(stats_name)} says {st.get('count')}")
            # the whole tar as prep wrote it (stats from before the checksum was recorded have none)
            if whole and "sha256" in st and (st["sha256"], st.get("bytes")) != (whole["sha256"], whole["bytes"]):
                problems.append(f"{fname}: {whole['bytes']} bytes with sha256 {whole['sha256'][:12]}…, "
                                f"{os.path.basename(stats_name)} says {st.get('bytes')} bytes, {st['sha256'][:12]}…")
        dup = seen.intersection(keys)
        if dup:
            problems.append(f"{fname}: keys also in another shard: {sorted(dup)[:3]}")
        seen.update(keys)
    try:
        data = store.read_file(out, "rejects.jsonl")
        n_rejects = -1 if data is None else sum(1 for ln in data.decode("utf-8").splitlines() if ln.strip())
    except OSError:
        n_rejects = -1
    if n_rejects != info.num_rejects:
        problems.append(f"rejects.jsonl has {n_rejects} lines, _info.json says {info.num_rejects}")
    if total + (info.num_rejects or 0) != info.num_inputs:
        problems.append(f"{total} samples + {info.num_rejects} rejects != {info.num_inputs} inputs")
    return problems
