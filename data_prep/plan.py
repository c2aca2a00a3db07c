"""The plan: which input goes to which split, shard and key. A pure function of the inputs, seed and options.

Planned in bounded memory, however large the source (a 300M-row manifest included):
  listing chunks ──▶ each item's order key: a seeded 64-bit hash of (path, class, split, labels)
               ──▶ spill files by key (data_prep.spill), per-class counts on the side
               ──▶ buckets read back in key order, each sorted on its own = the global shuffle
               ──▶ split: the first `quota[c]` items of class c in that order are val (stratified)
               ──▶ shards cut per split ──▶ plan pieces (JSON lines, one shard a line)
Listing order never matters (the hash orders), so the same inputs, seed and options give the same
plan, byte for byte: on a rerun, with `--workers N`, and in every SLURM array task.

Stored under OUT, written before any shard and read back through `write_piece`/`read_piece` only:
  _plan.json                 the index: options, classes, per split the shard count and its pieces
                             (first shard, file, sha256), the rejects' piece; its hash is the plan id
  _plan/<split>-NNNNNN.jsonl a piece: the shards from `first` on, ~PIECE_SAMPLES samples
  _plan/rejects.jsonl        inputs rejected while listing (and duplicates, with --dedup)
An array task reads the index and the pieces of its own shard range, nothing else.

Memory: a listing chunk, the spill buffer, one bucket being sorted, one shard per split being cut.
Rejects found while listing are kept in memory to be sorted (a bad manifest's share of rows, not the
dataset). `--dedup` hashes every file's bytes and orders items by that hash through a second spill,
so only one group of equal hashes is compared at a time (no whole-dataset list or set of hashes).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import tempfile
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from . import store
from .sources import SPLIT_NAME, Item, Listing, Source, load_classes
from .spill import Spill

PLAN_FILE = "_plan.json"
PIECES = "_plan"
PLAN_VERSION = 2
PIECE_SAMPLES = 200_000  # a piece closes at the first shard end past this many samples (~20 MB of JSON)


def file_sha256(path: str) -> tuple[str | None, int]:
    """(content hash, bytes) for --dedup; (None, 0) when unreadable (the image worker rejects it with a reason)."""
    h, n = hashlib.sha256(), 0
    try:
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
                n += len(block)
    except OSError:
        return None, 0
    return h.hexdigest(), n


def _seed_key(seed: int) -> bytes:
    return str(seed).encode()[:64]  # blake2b's key: up to 64 bytes


def order_key(seed_key: bytes, rel: str, cls: int, split: str, labels: tuple) -> int:
    """The item's place in the global shuffle: a seeded 64-bit hash of what the item is."""
    data = f"{rel}\0{cls}\0{split}\0{','.join(map(str, labels))}".encode("utf-8", "surrogatepass")
    return int.from_bytes(hashlib.blake2b(data, digest_size=8, key=seed_key).digest(), "big")


def _record(seed_key: bytes, it: Item) -> tuple:
    """An item as a spill record: (order key, rel, cls, split, labels, size); sorting records sorts by key,
    then by the item itself (equal keys of different items still order the same way every time)."""
    split, labels = it.split or "", it.labels or ()
    return order_key(seed_key, it.rel, it.cls, split, labels), it.rel, it.cls, split, labels, it.size


def quotas(per_class: dict[int, int], val_fraction: float) -> dict[int, int]:
    """Val samples per class: round half up, per class, so each class keeps the same val share."""
    return {c: math.floor(n * val_fraction + 0.5) for c, n in per_class.items()}


def assign_splits(items: list[Item], val_fraction: float, val_name: str = "val") -> dict[str, list[Item]]:
    """Items (already shuffled) → {split: items}, in memory: the rule the streaming planner follows."""
    if any(it.split for it in items):
        out: dict[str, list[Item]] = {}
        for it in items:
            out.setdefault(it.split, []).append(it)
        return dict(sorted(out.items()))
    if not val_fraction:
        return {"train": items}
    _check_fraction(val_fraction)
    per_class: dict[int, int] = {}
    for it in items:
        per_class[it.cls] = per_class.get(it.cls, 0) + 1
    quota = quotas(per_class, val_fraction)
    train, val = [], []
    for it in items:
        if quota[it.cls] > 0:
            quota[it.cls] -= 1
            val.append(it)
        else:
            train.append(it)
    return {"train": train, val_name: val}


def _check_fraction(val_fraction: float) -> None:
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction={val_fraction}: must be in [0, 1)")


class _Cutter:
    """Consecutive shards of one split, by sample count and/or (source) bytes; `add` returns a closed shard."""

    def __init__(self, max_samples: int | None, max_bytes: int | None):
        self.max_samples, self.max_bytes = max_samples, max_bytes
        self.cur: list[list] = []
        self.cur_bytes = 0

    def add(self, sample: list, size: int) -> list[list] | None:
        closed = None
        if (self.max_samples and len(self.cur) >= self.max_samples) or (
                self.max_bytes and self.cur and self.cur_bytes + size > self.max_bytes):
            closed, self.cur, self.cur_bytes = self.cur, [], 0
        self.cur.append(sample)
        self.cur_bytes += size
        return closed

    def flush(self) -> list[list] | None:
        closed, self.cur, self.cur_bytes = self.cur or None, [], 0
        return closed


def _sample(key: str, rel: str, cls: int, label: str, labels: tuple | None) -> list:
    # sample = [key, source path, class index, class name(, every class index: multi-label)]; keys
    # carry no dot (webdataset splits there)
    return [key, rel, cls, label, list(labels)] if labels else [key, rel, cls, label]


def plan_shards(items: list[Item], split: str, max_samples: int | None, max_bytes: int | None) -> list[dict]:
    """Cut a split into consecutive shards by sample count and/or (source) bytes (in memory)."""
    cutter, shards = _Cutter(max_samples, max_bytes), []
    for i, it in enumerate(items):
        closed = cutter.add(_sample(f"{split}_{i:08d}", it.rel, it.cls, it.label, it.labels), it.size)
        if closed:
            shards.append({"name": f"{split}-{len(shards):06d}", "split": split, "samples": closed})
    if last := cutter.flush():
        shards.append({"name": f"{split}-{len(shards):06d}", "split": split, "samples": last})
    return shards


def _json_line(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, ensure_ascii=False, separators=(",", ":")).encode("utf-8") + b"\n"


class _SplitPieces:
    """One split's shards, cut as its items arrive in plan order, written to piece files in `scratch`."""

    def __init__(self, scratch: str, split: str, max_samples: int | None, max_bytes: int | None):
        self.scratch, self.split = scratch, split
        self.cutter = _Cutter(max_samples, max_bytes)
        self.samples = self.shards = 0
        self.pieces: list[dict] = []
        self.f = self.sha = None
        self.in_piece = 0

    def add(self, rel: str, cls: int, label: str, labels: tuple | None, size: int) -> None:
        closed = self.cutter.add(_sample(f"{self.split}_{self.samples:08d}", rel, cls, label, labels), size)
        self.samples += 1
        if closed:
            self._shard(closed)

    def _shard(self, samples: list[list]) -> None:
        if self.f is None:
            name = f"{PIECES}/{self.split}-{len(self.pieces):06d}.jsonl"
            self.pieces.append({"first": self.shards, "file": name})
            self.f, self.sha, self.in_piece = open(os.path.join(self.scratch, name), "wb"), hashlib.sha256(), 0
        line = _json_line({"name": f"{self.split}-{self.shards:06d}", "split": self.split, "samples": samples})
        self.f.write(line)
        self.sha.update(line)
        self.shards += 1
        self.in_piece += len(samples)
        if self.in_piece >= PIECE_SAMPLES:
            self._close_piece()

    def _close_piece(self) -> None:
        if self.f is not None:
            self.f.close()
            self.pieces[-1]["sha256"] = self.sha.hexdigest()
            self.f = None

    def close(self) -> dict:
        if last := self.cutter.flush():
            self._shard(last)
        self._close_piece()
        return {"shards": self.shards, "samples": self.samples, "pieces": self.pieces}


def _ordered_records(listing: Listing, scratch: str, seed_key: bytes, do_dedup: bool,
                     map_fn: Callable) -> tuple[Spill, dict[int, int], bool, int, list[dict]]:
    """Stream the listing into an order spill: (spill, items per class, any split column, inputs, rejects)."""
    order = Spill(os.path.join(scratch, "order"))
    per_class: dict[int, int] = {}
    has_split, n_inputs, rejects = False, 0, []

    def keep(items: list[Item]) -> None:
        nonlocal has_split
        order.add_many([_record(seed_key, it) for it in items])
        for cls, n in Counter(it.cls for it in items).items():
            per_class[cls] = per_class.get(cls, 0) + n
        has_split = has_split or any(it.split for it in items)

    by_bytes = Spill(os.path.join(scratch, "dedup")) if do_dedup else None
    for items, rej in listing.chunks():
        n_inputs += len(items) + len(rej)
        rejects.extend(rej)
        if by_bytes is None:
            keep(items)
            continue
        hashes = list(map_fn(file_sha256, [os.path.join(listing.root, it.rel) for it in items]))
        # empty and unreadable files are kept: they are "empty"/"unreadable", not duplicates of each other
        keep([it for it, (h, n) in zip(items, hashes) if h is None or n == 0])
        by_bytes.add_many([(int(h[:16], 16), h, it.rel, it.cls, it.split or "", it.labels or (), it.size, it.label)
                           for it, (h, n) in zip(items, hashes) if h is not None and n > 0])
    if by_bytes is not None:
        rejects.extend(_dedup(by_bytes, keep))
    return order, per_class, has_split, n_inputs, rejects


def _dedup(by_bytes: Spill, keep: Callable[[list[Item]], None]) -> list[dict]:
    """Keep the first of each set of byte-identical files (in path order); the others become rejects."""
    rejects, prev, first = [], None, ""
    for run in by_bytes.sorted_runs():
        kept = []
        for _, h, rel, cls, split, labels, size, label in run:  # sorted by hash, then path
            if h == prev:
                rejects.append({"path": rel, "reason": "duplicate", "detail": f"same bytes as {first}"})
                continue
            prev, first = h, rel
            kept.append(Item(rel, label, cls, split or None, size, labels or None))
        keep(kept)
    return rejects


def make_plan(
    listing: Listing,
    scratch: str,
    *,
    seed: int,
    val_fraction: float,
    max_samples_per_shard: int | None,
    shard_size_bytes: int | None,
    image_options: dict,
    do_dedup: bool,
    map_fn: Callable[[Callable, Iterable], Iterable] = map,
    request: dict | None = None,
    val_name: str = "val",
) -> dict:
    """Plan `listing` into pieces under `scratch/_plan/`; returns the index (see the module docstring)."""
    if not max_samples_per_shard and not shard_size_bytes:
        raise ValueError("give max_samples_per_shard and/or shard_size_bytes")
    if val_fraction:
        _check_fraction(val_fraction)
    os.makedirs(os.path.join(scratch, PIECES), exist_ok=True)
    seed_key = _seed_key(seed)
    order, per_class, has_split, n_inputs, rejects = _ordered_records(listing, scratch, seed_key, do_dedup, map_fn)
    quota = {} if has_split or not val_fraction else quotas(per_class, val_fraction)
    splits: dict[str, _SplitPieces] = {}

    def split_of(name: str) -> _SplitPieces:
        if name not in splits:
            if not SPLIT_NAME.match(name):
                raise ValueError(f"split name {name!r} must match [A-Za-z0-9_]+")
            splits[name] = _SplitPieces(scratch, name, max_samples_per_shard, shard_size_bytes)
        return splits[name]

    if not has_split:  # these splits exist even when empty
        split_of("train")
        if val_fraction:
            split_of(val_name)
    classes = listing.classes
    for run in order.sorted_runs():
        for _, rel, cls, split, labels, size in run:
            if not has_split:
                split = "train"
                if quota.get(cls, 0) > 0:
                    quota[cls] -= 1
                    split = val_name
            split_of(split).add(rel, cls, classes[cls], labels, size)
    rejects.sort(key=lambda r: (r["path"], r["reason"], r["detail"]))
    data = b"".join(_json_line(r) for r in rejects)
    Path(scratch, PIECES, "rejects.jsonl").write_bytes(data)
    multi = {"multi_label": True} if listing.multi_label else {}
    return {
        **multi,
        "version": PLAN_VERSION,
        "root": listing.root,
        "seed": seed,
        "val_fraction": val_fraction,
        "max_samples_per_shard": max_samples_per_shard,
        "shard_size_bytes": shard_size_bytes,
        "dedup": do_dedup,
        "image_options": image_options,
        "classes": classes,
        "num_inputs": n_inputs,
        "splits": {name: sp.close() for name, sp in sorted(splits.items())},
        "rejects": {"file": f"{PIECES}/rejects.jsonl", "count": len(rejects),
                    "sha256": hashlib.sha256(data).hexdigest()},
        "request": request,
    }


def build_plan(src: Source | Listing, *, seed: int, val_fraction: float, max_samples_per_shard: int | None,
               shard_size_bytes: int | None, image_options: dict, do_dedup: bool, map_fn: Callable = map) -> dict:
    """The whole plan of a small source in memory: the index plus "shards" (every shard) and "rejects"."""
    listing = src if isinstance(src, Listing) else Listing.of(src)
    with tempfile.TemporaryDirectory(prefix="vitp-plan-") as scratch:
        index = make_plan(listing, scratch, seed=seed, val_fraction=val_fraction,
                          max_samples_per_shard=max_samples_per_shard, shard_size_bytes=shard_size_bytes,
                          image_options=image_options, do_dedup=do_dedup, map_fn=map_fn)
        n = len(shard_names(index))
        return {**index, "shards": shards_in_range(scratch, index, 0, n), "rejects": plan_rejects(scratch, index)}


# --- the plan under OUT: every read and write of it goes through these three -----------------------------

def write_piece(out: str | os.PathLike, name: str, data: bytes) -> None:
    store.write_file(out, name, data)


def read_piece(out: str | os.PathLike, name: str) -> bytes | None:
    """The bytes of a plan file under `out`; None when absent."""
    return store.read_file(out, name)


def has_piece(out: str | os.PathLike, name: str) -> bool:
    return store.exists(store.join(out, name))


def _where(out) -> str:
    return store.public(store.join(out, PLAN_FILE))


def plan_bytes(index: dict) -> bytes:
    return json.dumps(index, sort_keys=True, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def plan_digest(index: dict) -> str:
    """The plan's identity: a hash of the index (which holds every piece's sha256), less the request."""
    return hashlib.sha256(plan_bytes({k: v for k, v in index.items() if k != "request"})).hexdigest()[:16]


def _stored_index(out) -> dict | None:
    data = read_piece(out, PLAN_FILE)
    if data is None:
        return None
    try:
        index = json.loads(data)
    except ValueError as e:  # a torn or foreign file: name it, do not guess
        raise ValueError(f"{_where(out)}: not a plan index ({e}); delete OUT or use a new one") from None
    return index if isinstance(index, dict) else {}


def _but_decontaminated(index: dict) -> str:
    return plan_digest({k: v for k, v in index.items() if k != "decontaminated"})


def write_or_check_plan(out: str | os.PathLike, index: dict, scratch: str) -> str:
    """Store the plan (its pieces first, the index last); if OUT already holds a different one, refuse
    before writing anything, rather than mix two datasets."""
    plan_id = plan_digest(index)
    old = _stored_index(out)
    if old is not None and old.get("version") == PLAN_VERSION and plan_digest(old) != plan_id \
            and _but_decontaminated(old) == _but_decontaminated(index):
        # other test sets or another threshold (`--exclude-near`): the same inputs, other shards. The
        # shards' stats name the old plan, so each is remade; _info.json goes first, as it no longer holds
        store.remove(store.join(out, "_info.json"))
        old = None
    if old is not None and (old.get("version") != PLAN_VERSION or plan_digest(old) != plan_id):
        raise ValueError(
            f"{_where(out)}: OUT already holds shards of a different plan (other inputs, seed or options); "
            "use a new output directory or delete it"
        )
    files = [p["file"] for sp in index["splits"].values() for p in sp["pieces"]] + [index["rejects"]["file"]]
    for name in files:  # all of them the first time; later only those deleted since (a damaged one, say)
        if old is None or not has_piece(out, name):
            write_piece(out, name, Path(scratch, name).read_bytes())
    if old is None or old.get("request") != index.get("request"):  # same plan: a task may now reuse it
        write_piece(out, PLAN_FILE, plan_bytes(index))
    return plan_id


def load_plan(out: str | os.PathLike) -> dict:
    index = _stored_index(out)
    if index is None:
        raise FileNotFoundError(f"{_where(out)}: no plan; run `vitp prep` on this output directory first")
    if index.get("version") != PLAN_VERSION:
        raise ValueError(f"{_where(out)}: plan version {index.get('version')} is not {PLAN_VERSION}; "
                         "rerun `vitp prep` without --shard-range")
    return index


def plan_options(cfg) -> dict:
    """What cuts a plan, of prep's options (``cfg``: pipeline.config.PrepCfg): make_plan's keywords."""
    from .images import ImageOptions

    return {"seed": cfg.seed, "val_fraction": cfg.val_fraction, "max_samples_per_shard": cfg.samples_cap,
            "shard_size_bytes": cfg.shard_size, "image_options": ImageOptions.of(cfg).as_dict(), "do_dedup": cfg.dedup}


def plan_request(source, cfg) -> dict:
    """What a plan was made for: the source (where, and its size and change time), columns and options.

    A task that finds the same request in OUT's index reuses that plan without listing the source. An
    ImageFolder's change time is its top folder's: a file added deeper is seen by a whole run (which
    always plans again and compares), not by an array task. ``cfg``: pipeline.config.PrepCfg."""
    p = Path(source).resolve()  # the submitter and its tasks may spell the same path differently
    st = p.stat()
    names = load_classes(cfg.classes)
    options = plan_options(cfg)
    return {"source": str(p), "size": st.st_size if p.is_file() else None, "mtime_ns": st.st_mtime_ns,
            "classes": names, "columns": [cfg.path_column, cfg.label_column, cfg.split_column, cfg.labels_column],
            **{k: options[k] for k in sorted(options)}}


def reusable_plan(out: str | os.PathLike, request: dict) -> dict | None:
    """The stored index if it was planned for this very request (same source, unchanged, same options)."""
    index = _stored_index(out)
    if index is None or index.get("version") != PLAN_VERSION or index.get("request") != request:
        return None
    return index


def shard_names(index: dict) -> list[tuple[str, str]]:
    """(shard name, split) of every shard, in plan order: splits by name, shards in order."""
    return [(f"{s}-{i:06d}", s) for s, sp in sorted(index["splits"].items()) for i in range(sp["shards"])]


def _piece(out, name: str, sha: str) -> bytes:
    data = read_piece(out, name)
    if data is None or hashlib.sha256(data).hexdigest() != sha:
        why = "missing" if data is None else "damaged (its sha256 differs from the index's): delete it and"
        where = store.public(store.join(out, name))
        raise ValueError(f"{where}: plan piece {why}; rerun `vitp prep` without --shard-range")
    return data


def planned_batches(out: str | os.PathLike, index: dict, start: int, stop: int) -> Iterator[list[dict]]:
    """Planned shards [start, stop) (indices in plan order), each {"name", "split", "samples"}, one
    piece's worth at a time (memory: a piece, never the plan); reads only the pieces holding them."""
    offset = 0
    for _, sp in sorted(index["splits"].items()):
        lo, hi = max(start - offset, 0), min(stop - offset, sp["shards"])
        offset += sp["shards"]
        if lo >= hi:
            continue
        pieces = sp["pieces"]
        for k, p in enumerate(pieces):
            end = pieces[k + 1]["first"] if k + 1 < len(pieces) else sp["shards"]
            if p["first"] >= hi or end <= lo:
                continue
            lines = _piece(out, p["file"], p["sha256"]).splitlines()
            yield [json.loads(line) for i, line in enumerate(lines, p["first"]) if lo <= i < hi]


def shards_in_range(out: str | os.PathLike, index: dict, start: int, stop: int) -> list[dict]:
    """Planned shards [start, stop) as one list (small plans, tests)."""
    return [sh for batch in planned_batches(out, index, start, stop) for sh in batch]


def plan_rejects(out: str | os.PathLike, index: dict) -> list[dict]:
    r = index["rejects"]
    return [json.loads(line) for line in _piece(out, r["file"], r["sha256"]).splitlines()]
