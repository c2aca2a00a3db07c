"""Shard files → raw samples: the dataset description (``_info.json``) and tar reading, no decoding.

``read_shard`` yields (key, image bytes, label) for a position range of one shard; a truncated
tar, a sample without a valid ``.cls`` or without an image is counted by reason and skipped, so
positions agree with prep's ``shard_lengths``. In a multi-label dataset (``_info.json``:
``"multi_label": true``) the label is the tuple of class indices in the sample json's ``labels``
(``.cls`` is only the primary one); ``read_positions`` reads any sorted positions of a split.
A dataset address may be a folder, ``s3://``, ``gs://`` or ``https://`` (``data_prep.store``): remote
shards are read as retried, read-ahead streams (``pipeline.data.stream``), local ones as plain files,
seekable, so skipping costs header reads only; ``pipe:`` URLs of foreign descriptions go through
webdataset's ``gopen``. A read that starts mid-shard begins at the sample's byte offset, which prep
records in ``<shard>_stats.json`` (``offsets``); a shard without them is scanned from its start.

Tar members are parsed by ``data_prep.tar.iter_tar`` (the tar module prep writes with); the
description is parsed by ``data_prep.schema.DatasetInfo`` (the one ``_info.json`` schema).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from data_prep import store
from data_prep.schema import CLASSES_FILE, IMAGE_EXTS, INFO_FILE, DatasetInfo, SchemaError, parse_classes
from data_prep.tar import TarError, iter_tar
from pipeline.errors import Classified

from .stream import ReadPolicy, ShardReadError, ShardStream

SKIP_REASONS = ("corrupt_tar", "missing_cls", "bad_cls", "bad_labels", "missing_image", "undecodable_image",
                "unreadable_shard")


class DataError(Classified, ValueError):
    """A dataset that cannot be read as configured; the message is one line naming the file/key."""

    retry = False


# ── Dataset description ────────────────────────────────────────────────────────────────────────────
@dataclass(frozen=True)
class SplitInfo:
    name: str
    num_samples: int
    urls: tuple[str, ...]  # one per shard: a local path or a dataset address (s3://, gs://, https://, pipe:)
    lengths: tuple[int, ...]  # samples per shard
    # a split cut to some of its samples (pipeline/data/minival.py): per shard, the indices kept; positions
    # and ``lengths`` then count kept samples only, and reads translate them (``read_slices``)
    keep: tuple[tuple[int, ...], ...] | None = None
    # `vitp decontam`'s exclusions: per shard, per kept sample, how many listed samples it stands for (those
    # between the kept one before it and it; a shard's last kept sample also those after it). A reader
    # counts them as ``excluded`` when it yields that sample, so an epoch counts each listed sample once
    excluded: tuple[tuple[int, ...], ...] | None = None


@dataclass(frozen=True)
class Info:
    path: str
    num_classes: int
    classes: tuple[str, ...]
    splits: dict[str, SplitInfo] = field(default_factory=dict)
    digest: str = ""  # names this exact content: prep's plan id, else a hash of the description
    multi_label: bool = False  # labels are sets of classes (json "labels"); .cls is the primary one
    # every test set it was checked against: `vitp prep --exclude-near`'s (how many dropped) and
    # `vitp decontam`'s (``"by"`` it; how many its list leaves out) (data_prep.schema.with_exclusions)
    decontaminated: dict | None = None
    excluded: dict | None = None  # `vitp decontam`'s OUT/_exclude.json, its samples left out (without the list)

    def split(self, name: str) -> SplitInfo:
        """The named split; an error naming the dataset if it is missing or empty."""
        if name not in self.splits:
            raise DataError(f"{self.path}/_info.json: no split {name!r} (has: {', '.join(self.splits) or 'none'})")
        sp = self.splits[name]
        if sp.num_samples <= 0:
            raise DataError(f"{self.path}/_info.json: split {name!r} is empty (0 samples)")
        return sp


def _is_url(s: str) -> bool:
    return "://" in s or s.startswith("pipe:")


def info_file(path: str | os.PathLike) -> str:
    """``<path>/_info.json``, or a DataError saying the address is not (yet) a prep output."""
    f = store.join(str(path), INFO_FILE)
    try:
        found = store.exists(f)
    except Exception as e:  # noqa: BLE001 (each SDK has its own errors; store.reason names them)
        raise DataError(f"{store.public(f)}: unreadable ({store.reason(e)})") from None
    if not found:
        raise DataError(f"{store.public(f)}: not found "
                        "(is data.path a `vitp prep` output folder, and did prep finish?)")
    return f


def read_description(path: str | os.PathLike) -> DatasetInfo:
    """``<path>/_info.json`` of a folder or a remote address, parsed (DataError if missing/malformed)."""
    f = info_file(path)
    try:
        return DatasetInfo.from_json(store.read_bytes(f).decode("utf-8"), store.public(f))
    except SchemaError as e:
        raise DataError(str(e)) from None
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"{store.public(f)}: unreadable ({store.reason(e)})") from None


def _classes(raw: DatasetInfo, root: str) -> tuple[str, ...]:
    """The description's class list, else ``classes.json`` beside it (else empty)."""
    if raw.classes is not None:
        return raw.classes
    f = store.join(root, CLASSES_FILE)
    try:
        if not store.exists(f):
            return ()
        return parse_classes(store.read_bytes(f), store.public(f))
    except SchemaError as e:
        raise DataError(str(e)) from None
    except OSError as e:
        raise DataError(f"{store.public(f)}: unreadable ({store.reason(e)})") from None


def read_info(path: str | os.PathLike) -> Info:
    """Read ``<path>/_info.json`` (+ ``classes.json`` if the info has no class list) from a folder or
    a remote address, and check that every local shard it names exists (remote shards are checked
    when read: a listing of a large bucket costs more than it tells)."""
    root = str(path)
    if root.startswith("pipe:"):
        raise DataError(f"data.path: {root!r}: give the dataset's folder or address, not a pipe: command")
    raw = read_description(root)
    where = store.public(store.join(root, INFO_FILE))
    classes = _classes(raw, root)
    num_classes = raw.num_classes if raw.num_classes is not None else len(classes)
    splits = {}
    for name, sp in raw.splits.items():
        urls = tuple(store.join(root, u) for u in sp.filenames)
        for u in urls:
            if not _is_url(u) and not os.path.isfile(u):
                raise DataError(f"{where}: split {name!r} names shard {u} which does not exist")
        lengths = sp.shard_lengths
        if lengths is None or len(lengths) != len(urls):
            lengths = tuple(_count_samples(u) for u in urls)  # older/foreign info: count once, by headers
        n = sp.num_samples if sp.num_samples is not None else sum(lengths)
        splits[name] = SplitInfo(name, n, urls, lengths)
    if not splits:
        raise DataError(f"{where}: no splits")
    if num_classes <= 0:
        raise DataError(f"{where}: num_classes is {num_classes}; need >= 1")
    info = Info(root, num_classes, classes, splits, raw.digest, multi_label=raw.multi_label,
                decontaminated=raw.decontaminated)
    return _without_excluded(info)


def _without_excluded(info: Info) -> Info:
    """The dataset less the samples of its ``_exclude.json`` (`vitp decontam`), if it has one: each split
    cut with ``keep`` (positions count kept samples, so a resumed run reads on exactly where it stopped)
    and the digest naming the cut, so a run begun before the list was written does not resume into it.
    ``decontaminated``: prep's sets and the list's (data_prep.schema.with_exclusions), the latter taken
    from the list the loader honours, whatever _info.json said of them (the one door for both files)."""
    from data_prep.schema import read_exclusions, with_exclusions

    try:
        doc = read_exclusions(info.path)
    except ValueError as e:
        raise DataError(str(e)) from None
    except OSError as e:
        raise DataError(f"{store.public(info.path)}/_exclude.json: unreadable ({store.reason(e)})") from None
    if doc is None:  # the sets of a list deleted since (which undoes it) no longer show
        return dataclasses.replace(info, decontaminated=with_exclusions(info.decontaminated, None))
    gone: dict[tuple[str, str], set[int]] = {}
    for split, shard, i in doc["pairs"]:  # shard: as _info.json names it, so joined as read_info joins it
        gone.setdefault((split, store.join(info.path, shard)), set()).add(i)
    splits = dict(info.splits)
    for name, sp in info.splits.items():
        if not any((name, u) in gone for u in sp.urls):
            continue
        keep = tuple(tuple(i for i in range(n) if i not in gone.get((name, u), ()))
                     for u, n in zip(sp.urls, sp.lengths))
        splits[name] = dataclasses.replace(sp, num_samples=sum(map(len, keep)), lengths=tuple(map(len, keep)),
                                           keep=keep, excluded=tuple(map(_gaps, keep, sp.lengths)))
    summary = {k: v for k, v in doc.items() if k not in ("samples", "pairs")}
    cut = hashlib.sha256(json.dumps(sorted(doc["pairs"])).encode()).hexdigest()[:16]
    return dataclasses.replace(info, splits=splits, digest=f"{info.digest}-x{cut}", excluded=summary,
                               decontaminated=with_exclusions(info.decontaminated, summary))


def _gaps(kept: tuple[int, ...], n: int) -> tuple[int, ...]:
    """A shard of n samples keeping ``kept`` -> per kept sample, the left-out samples it stands for
    (SplitInfo.excluded). A shard left out whole has no sample to count its own with."""
    gaps = [b - a - 1 for a, b in zip((-1, *kept[:-1]), kept)]
    if gaps:
        gaps[-1] += n - 1 - kept[-1]
    return tuple(gaps)


def excluded_by_position(sp: SplitInfo) -> dict[int, int]:
    """{split position: the left-out samples its kept sample stands for} (SplitInfo.excluded), nonzero
    ones only: as many entries as the list has runs, whatever the split's size."""
    if sp.excluded is None:
        return {}
    out, at = {}, 0
    for gaps in sp.excluded:
        out.update((at + j, g) for j, g in enumerate(gaps) if g)
        at += len(gaps)
    return out


def _count_samples(url: str) -> int:
    return sum(1 for _ in read_shard(url, SkipCounts(), 0, None, num_classes=None, read=False))


# ── Raw samples out of tars (no decoding) ──────────────────────────────────────────────────────────
EXCLUDED = "excluded"  # SkipCounts' reason for a sample of `vitp decontam`'s list: left out, not bad


def skip_record(skipped: dict[str, int]) -> dict[str, int]:
    """A loader's counts (reason -> n) as a training record's: ``skipped`` the bad samples, ``excluded``
    the listed ones passed over (0 without a list)."""
    bad = sum(v for k, v in skipped.items() if k != EXCLUDED)
    return {"skipped": int(bad), EXCLUDED: int(skipped.get(EXCLUDED, 0))}


class SkipCounts(dict):
    """Skip counters by reason; ``active=False`` while re-reading already-consumed samples."""

    active = True  # False while skipping samples consumed before a resume (counted then)
    rereading = False  # True on a stream's second pass over its range (counted on the first)

    def add(self, reason: str, n: int = 1) -> None:
        if self.active and not self.rereading:
            self[reason] = self.get(reason, 0) + n

    def take(self) -> dict:
        out = dict(self)
        self.clear()
        return out


def _split_name(name: str) -> tuple[str, str]:
    """"dir/abc.def.jpg" → ("dir/abc", "def.jpg") — webdataset's key/extension convention."""
    d, _, base = name.rpartition("/")
    stem, _, ext = base.partition(".")
    return (f"{d}/{stem}" if d else stem), ext.lower()


def _multi_labels(meta: bytes | None, num_classes: int | None) -> tuple[int, ...] | None:
    """A sample json's ``labels`` as a tuple of class indices; None if missing or invalid."""
    try:
        labels = json.loads(meta)["labels"] if meta is not None else None
    except (ValueError, KeyError, TypeError):
        return None
    if not isinstance(labels, list) or not labels:
        return None
    if not all(type(c) is int and c >= 0 and (num_classes is None or c < num_classes) for c in labels):
        return None
    return tuple(labels)


def stats_address(url: str) -> str:
    """``<shard>_stats.json`` beside a shard (prep writes it when the shard is complete)."""
    return url[:-len(".tar")] + "_stats.json" if url.endswith(".tar") else url + "_stats.json"


@functools.lru_cache(maxsize=64)
def shard_offsets(url: str) -> tuple[int, ...] | None:
    """Byte offset of each sample's first member in a shard, from its stats (prep records them);
    None for a shard without them (older/foreign datasets: a read then scans from the start)."""
    if url.startswith("pipe:"):
        return None
    try:
        stats = json.loads(store.read_bytes(stats_address(url)))
        offsets = stats.get("offsets")
        if (isinstance(offsets, list) and len(offsets) == stats.get("count")
                and all(type(o) is int and o >= 0 for o in offsets)):
            return tuple(offsets)
    except Exception:  # noqa: BLE001, S110 (no stats or unreadable ones: the shard is scanned instead)
        pass
    return None


@dataclass
class OpenShard:
    """A shard opened for reading: its byte stream, the index of the sample it is positioned at, and
    whether it can seek (skipping then costs header reads only)."""

    f: object
    index: int
    seekable: bool


def open_shard(url: str, start: int, policy: ReadPolicy | None = None, stop: int | None = None) -> OpenShard:
    """Open a shard at sample ``start``: at its byte offset where the stats record one, else at 0.
    Remote shards start their read-ahead now (see :class:`~pipeline.data.stream.ShardStream`), and
    with ``stop`` (a sample the read ends before) ask for no byte from that sample's offset on."""
    offsets = shard_offsets(url) if start > 0 or stop is not None else None
    index, byte = (start, offsets[start]) if offsets is not None and start < len(offsets) else (0, 0)
    end = offsets[stop] if offsets is not None and stop is not None and stop < len(offsets) else None
    if url.startswith("pipe:"):
        import webdataset  # foreign descriptions' shell commands only

        return OpenShard(webdataset.gopen(url, "rb"), 0, False)
    if store.is_remote(url):
        return OpenShard(ShardStream(url, byte, policy or ReadPolicy(), end=end), index, False)
    f = open(url, "rb", buffering=1 << 16)
    f.seek(byte)
    return OpenShard(f, index, True)


def read_shard(url: str, counts: SkipCounts, start: int, stop: int | None, *, num_classes: int | None,
               read: bool = True, multi_label: bool = False, want=None, policy: ReadPolicy | None = None,
               opened: OpenShard | None = None) -> Iterator[tuple[str, bytes | None, int | tuple]]:
    """Valid samples ``start <= i < stop`` of one shard as (key, image bytes, label).

    A valid sample has an image member and a ``.cls`` holding an int in [0, num_classes) (and with
    ``multi_label`` a json whose ``labels`` are such ints, the label then being their tuple); invalid
    ones are counted and do not take an index (so indices agree with prep's shard_lengths).
    Image bytes are read only for samples in range (and in ``want``, a set of indices, when given:
    only those are yielded). The read starts at ``start``'s byte offset when the shard's stats
    record it (``opened``: a stream :func:`open_shard` opened ahead), else skips from the start.
    A truncated or unreadable tar ends the shard, counted; a remote one that fails past the retries
    of ``policy`` is skipped (counted as ``unreadable_shard``) or, with ``on_error="stop"``, a DataError.
    """
    policy = policy or ReadPolicy()

    last = max(want) if want else None

    def bad(reason: str) -> None:
        # only the reader whose range holds this position counts it, so a shard read in pieces
        # by several streams reports each problem once; with ``want``, the reader of the valid sample
        # that follows it (or, past a shard's last sample, the reader of that one)
        if index >= start and (stop is None or index < stop) and (
                want is None or index in want or (stop is None and last is not None and index > last)):
            counts.add(reason)

    index = start
    try:
        opened = opened or open_shard(url, start, policy, stop)
    except OSError as e:
        bad("corrupt_tar")
        warnings.warn(f"{store.public(url)}: unreadable shard, skipped ({store.reason(e)})", stacklevel=2)
        return
    f, seekable, index = opened.f, opened.seekable, opened.index
    key, cls, img, meta = None, None, None, None

    def finish():
        nonlocal index
        if key is None:
            return None
        if cls is None:
            bad("missing_cls")
            return None
        try:
            label = int(cls.decode().strip())
        except (UnicodeDecodeError, ValueError):
            bad("bad_cls")
            return None
        if label < 0 or (num_classes is not None and label >= num_classes):
            bad("bad_cls")
            return None
        if multi_label:
            label = _multi_labels(meta, num_classes)
            if label is None:
                bad("bad_labels")
                return None
        if img is None:
            bad("missing_image")
            return None
        i, index = index, index + 1
        return (key, img if img is not True else None, label) if i >= start and (want is None or i in want) else None

    try:
        with f:
            for name, _, data in iter_tar(f, seekable):
                if stop is not None and index >= stop:
                    return
                k, ext = _split_name(name)
                if k != key:
                    out = finish()
                    if out is not None:
                        yield out
                    key, cls, img, meta = k, None, None, None
                    if stop is not None and index >= stop:
                        return
                if ext == "cls":
                    cls = data()
                elif ext == "json" and multi_label:  # a few hundred bytes: reading costs what skipping does
                    meta = data()
                elif ext in IMAGE_EXTS:
                    # index is the one this sample gets if valid; bytes only when it is in range
                    img = data() if read and index >= start and (want is None or index in want) else True
            out = finish()
            if out is not None:
                yield out
    except ShardReadError as e:
        if policy.on_error == "stop":
            raise DataError(f"{e} (data.on_read_error: stop)") from None
        bad("unreadable_shard")
        warnings.warn(f"{e}; rest of the shard skipped (data.read_retries: {policy.retries})", stacklevel=2)
    except (TarError, OSError, EOFError) as e:
        bad("corrupt_tar")
        warnings.warn(f"{store.public(url)}: corrupt or cut-off shard, rest skipped ({e})", stacklevel=2)


def shard_labels(url: str, num_classes: int, policy: ReadPolicy | None = None) -> list[tuple[str, int]]:
    """(key, label) of every valid sample of one shard, read from its ``.cls`` members only (tar
    headers and label bytes, no image): a few-shot label scan, a minival's selection."""
    return [(key, label) for key, _, label in read_shard(url, SkipCounts(), 0, None, num_classes=num_classes,
                                                         read=False, policy=policy)]


def segments(lengths: list[int], order, start: int, count: int) -> list[tuple[int, int, int]]:
    """Positions ``[start, start+count)`` of the (cyclic) concatenation of shards in ``order`` →
    [(shard, lo, hi)] slices."""
    total = sum(lengths[s] for s in order)
    cum = np.cumsum([0] + [lengths[s] for s in order])
    out, pos = [], start % total
    while count > 0:
        j = int(np.searchsorted(cum, pos, side="right") - 1)
        lo = pos - int(cum[j])
        take = min(lengths[order[j]] - lo, count)
        out.append((int(order[j]), lo, lo + take))
        count -= take
        pos = (pos + take) % total
    return out


def range_stop(hi: int, length: int) -> int | None:
    """A range that ends with its shard reads on to the end: trailing bad samples get counted and
    a cut-off tar is noticed even when the cut fell after the last good sample."""
    return None if hi >= length else hi


def kept_slice(keep: tuple[int, ...], s: int, lo: int, stop: int | None, want) -> tuple | None:
    """A slice in kept-sample indices of shard ``s`` (``keep``: its kept indices) as the slice of the
    shard's own indices that reads exactly those samples; None when it holds none."""
    idx = keep[lo:len(keep) if stop is None else stop] if want is None else [keep[i] for i in sorted(want)]
    if not len(idx):
        return None
    return s, idx[0], idx[-1] + 1, set(idx)


def _excluded_of(excluded, sl) -> list[int]:
    """Per sample a kept-index slice (shard, lo, stop, want) yields, in order: how many listed samples it stands for."""
    s, lo, stop, want = sl
    return [excluded[s][j] for j in (range(lo, len(excluded[s]) if stop is None else stop) if want is None
                                      else sorted(want))]


def _counting(items: Iterator, gaps: list[int], counts: SkipCounts) -> Iterator:
    """``items``, counting each one's left-out samples as EXCLUDED as it is yielded (when ``counts`` is
    active then: a resumed stream does not count again what it counted before its checkpoint)."""
    for i, x in enumerate(items):  # items drives: its end (trailing bad samples counted) runs as without
        if i < len(gaps) and gaps[i]:
            counts.add(EXCLUDED, gaps[i])
        yield x


def read_slices(urls, slices, counts: SkipCounts, keep=None, excluded=None, **kw) -> Iterator[tuple]:
    """Samples of ``slices`` = [(shard, start, stop, want)] in order (read_shard's arguments; ``kw``:
    its keywords; ``keep``: a cut split's kept indices per shard, see :class:`SplitInfo`, the slices
    then counting kept samples; ``excluded``: SplitInfo.excluded, counted as the samples are yielded).
    While a remote shard is consumed the next slice's stream is already open and fetching its first
    blocks, so a reader does not wait a round trip at each shard boundary."""
    gaps = [None] * len(slices)
    if keep is not None:
        pairs = [(sl, kept_slice(keep[sl[0]], *sl)) for sl in slices]
        gaps = [_excluded_of(excluded, sl) if excluded is not None else None for sl, x in pairs if x is not None]
        slices = [x for _, x in pairs if x is not None]
    policy, ahead = kw.get("policy"), None
    try:
        for j, (s, lo, stop, want) in enumerate(slices):
            cur, ahead = ahead, None
            if j + 1 < len(slices) and store.is_remote(urls[slices[j + 1][0]]):
                nxt = slices[j + 1]
                try:
                    ahead = open_shard(urls[nxt[0]], nxt[1], policy, nxt[2])
                except OSError:
                    ahead = None  # read_shard opens it again when its turn comes, and reports the error
            items = read_shard(urls[s], counts, lo, stop, want=want, opened=cur, **kw)
            yield from items if gaps[j] is None else _counting(items, gaps[j], counts)
    finally:
        if ahead is not None:
            ahead.f.close()


def read_segments(urls, lengths, segs, counts: SkipCounts, **kw) -> Iterator[tuple]:
    """Samples of the stream slices ``segs`` = [(shard, lo, hi)] in order (see :func:`read_slices`)."""
    return read_slices(urls, [(s, lo, range_stop(hi, lengths[s]), None) for s, lo, hi in segs], counts, **kw)


def read_positions(sp: SplitInfo, positions, counts: SkipCounts, **kw) -> Iterator[tuple]:
    """Samples at the sorted ``positions`` of split ``sp`` (its shards in order), as ``read_shard``
    yields them (``kw``: its keywords). Each shard's part is one pass from its first wanted position
    to its last (image bytes of wanted samples only); a contiguous range reads exactly that range."""
    n = len(positions)
    if not n:
        return
    cum = np.cumsum([0, *sp.lengths])
    pos = np.asarray(positions, dtype=np.int64)
    shard = np.searchsorted(cum, pos, side="right") - 1
    slices, j = [], 0
    while j < n:
        s = int(shard[j])
        k = j + int(np.searchsorted(shard[j:], s, side="right"))
        local = pos[j:k] - cum[s]
        lo, hi = int(local[0]), int(local[-1]) + 1
        want = None if hi - lo == k - j else set(local.tolist())
        slices.append((s, lo, range_stop(hi, sp.lengths[s]), want))
        j = k
    yield from read_slices(sp.urls, slices, counts, keep=sp.keep, excluded=sp.excluded, **kw)
