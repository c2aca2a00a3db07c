"""Inputs → Items, streamed in chunks: an ImageFolder tree (root/<class>/<image>) or a CSV/JSONL/Parquet manifest.

A manifest with a ``labels`` column is multi-label: each cell holds one or more labels, as
``3;17;42``, a JSON list (``[3, 17]``, ``["cat", "dog"]``) or, in JSONL/Parquet, a list value;
class names or integer indices, as for ``label``. The primary label (the sample's ``.cls``) is the
``label`` column's value when the manifest has both (it must be one of ``labels``), else the first
label listed. Duplicates in a cell count once.

Listing never opens images. Entries that can be judged bad without reading them (no class, not an
image extension, a directory symlink loop, a bad label) become plan-level rejects here; everything
else is judged by the image worker.
"""

from __future__ import annotations

import csv
import json
import os
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from .schema import IMAGE_EXTS

MANIFEST_EXTS = {".csv", ".jsonl", ".parquet"}
SPLIT_NAME = re.compile(r"^[A-Za-z0-9_]{1,64}$")
_INT = re.compile(r"^\d+$")
CHUNK_ROWS = 20_000  # inputs per chunk: memory of a listing in flight (a few MB)


class Item(NamedTuple):
    """One input. A named tuple, not a dataclass: a 300M-row manifest makes 300M of them (3x faster to build)."""

    rel: str  # path as recorded in the sample json: relative to the source root (or absolute in a manifest)
    label: str  # class name
    cls: int  # class index
    split: str | None = None  # from a split column, else assigned by the plan
    size: int = 0  # bytes on disk (0 when unknown or not asked for); used only for byte-based shard planning
    labels: tuple[int, ...] | None = None  # multi-label: every class index, sorted (None: single-label)


@dataclass
class Source:
    """A whole source held in memory (small inputs and tests; `vitp prep` streams a `Listing` instead)."""

    root: str  # directory that `Item.rel` is relative to
    classes: list[str]
    items: list[Item] = field(default_factory=list)
    rejects: list[dict] = field(default_factory=list)  # {"path", "reason", "detail"}
    multi_label: bool = False  # items carry `labels` (a manifest with a labels column)


Chunk = tuple[list[Item], list[dict]]  # (items, rejects) of up to CHUNK_ROWS input entries


@dataclass
class Listing:
    """A source that can be streamed (more than once) in chunks: memory bounded by a chunk, not the source."""

    root: str
    classes: list[str]
    multi_label: bool
    chunks: Callable[[], Iterator[Chunk]]

    @classmethod
    def of(cls, src: Source) -> Listing:
        return cls(src.root, src.classes, src.multi_label, lambda: iter([(list(src.items), list(src.rejects))]))

    def collect(self) -> Source:
        src = Source(root=self.root, classes=self.classes, multi_label=self.multi_label)
        for items, rejects in self.chunks():
            src.items.extend(items)
            src.rejects.extend(rejects)
        return src


def _reject(rel: str, reason: str, detail: str) -> dict:
    return {"path": rel, "reason": reason, "detail": detail}


def _size(path: str) -> int:
    try:
        return os.stat(path).st_size
    except OSError:
        return 0


def load_classes(classes: str | os.PathLike | list[str] | None) -> list[str] | None:
    """Given class names: a list, a JSON list file, or a text file with one name per line."""
    if classes is None or isinstance(classes, list):
        return classes
    text = Path(classes).read_text(encoding="utf-8")
    names = json.loads(text) if str(classes).endswith(".json") else [ln.strip() for ln in text.splitlines()]
    names = [n for n in names if n != ""]
    if len(set(names)) != len(names):
        raise ValueError(f"{classes}: duplicate class names")
    return names


def _is_dir(entry: os.DirEntry) -> bool:
    """Follows symlinks; a dangling link or a link loop is not a directory (it stays an input file)."""
    try:
        return entry.is_dir()
    except OSError:
        return False


def _walk_files(top: str, root: str, ancestors: frozenset[str]) -> Iterator[str | dict]:
    """Every non-directory entry below `top` (a path), or a reject (a dict), as os.scandir streams them.

    Not sorted: the plan orders inputs by a hash of their own, so a directory of millions of files is
    never held. Symlinked directories are followed once; a link to an ancestor is a reject."""
    try:
        it = os.scandir(top)
    except OSError as e:
        yield _reject(os.path.relpath(top, root), "unreadable", e.strerror or str(e))
        return
    with it:
        for entry in it:
            if _is_dir(entry):
                real = os.path.realpath(entry.path)
                if real in ancestors:
                    rel = Path(os.path.relpath(entry.path, root)).as_posix()
                    yield _reject(rel, "symlink_loop", "directory link points to one of its ancestors")
                    continue
                yield from _walk_files(entry.path, root, ancestors | {real})
            else:
                yield entry.path


def _chunked(entries: Iterable, chunk_rows: int) -> Iterator[Chunk]:
    """Items and rejects (mixed, in listing order) → (items, rejects) chunks of `chunk_rows` entries."""
    items: list[Item] = []
    rejects: list[dict] = []
    for e in entries:
        (rejects if isinstance(e, dict) else items).append(e)
        if len(items) + len(rejects) >= chunk_rows:
            yield items, rejects
            items, rejects = [], []
    if items or rejects:
        yield items, rejects


def open_image_folder(root: str | os.PathLike, classes: list[str] | None = None, *, sizes: bool = True,
                      chunk_rows: int = CHUNK_ROWS) -> Listing:
    """An ImageFolder tree (root/<class>/<image>) as a streamed listing; only the top level is read now."""
    root = os.path.abspath(root)
    top = sorted(os.scandir(root), key=lambda e: e.name)
    dirs = [e.name for e in top if _is_dir(e) and not e.name.startswith(".")]
    loose = [e.name for e in top if not _is_dir(e)]
    class_names = list(classes) if classes is not None else sorted(dirs)
    index = {c: i for i, c in enumerate(class_names)}

    def entries() -> Iterator[Item | dict]:
        for name in loose:
            yield _reject(name, "no_class", "file at the top level is in no class directory")
        for d in dirs:
            cdir = os.path.join(root, d)
            for path in _walk_files(cdir, root, frozenset({os.path.realpath(root), os.path.realpath(cdir)})):
                if isinstance(path, dict):
                    yield path
                    continue
                rel = Path(os.path.relpath(path, root)).as_posix()
                if d not in index:
                    yield _reject(rel, "bad_label", f"class {d!r} is not in the given classes")
                elif os.path.splitext(path)[1].lower()[1:] not in IMAGE_EXTS:
                    yield _reject(rel, "extension", "not an image file extension")
                else:
                    yield Item(rel, d, index[d], None, _size(path) if sizes else 0)

    return Listing(root, class_names, False, lambda: _chunked(entries(), chunk_rows))


def list_image_folder(root: str | os.PathLike, classes: list[str] | None = None) -> Source:
    return open_image_folder(root, classes).collect()


def _row_chunks(path: Path, wanted: list[str], chunk_rows: int) -> Iterator[list[dict]]:
    """The manifest's rows, `chunk_rows` at a time, as dicts of the ``wanted`` columns it has.

    CSV through the csv module (quoting as today), JSONL line by line, Parquet batch by batch (pyarrow
    reads it row group by row group): memory is a chunk (a Parquet row group at most), never the file."""
    suffix = path.suffix.lower()
    if suffix == ".csv":
        with open(path, newline="", encoding="utf-8") as f:
            reader = csv.reader(f)
            header = next(reader, [])
            last = {h: i for i, h in enumerate(header)}  # a repeated column name: the last one (as DictReader)
            cols = [(c, last[c]) for c in dict.fromkeys(wanted) if c in last]
            chunk: list[dict] = []
            for row in reader:
                if not row:  # a blank line is no row (as csv.DictReader has it)
                    continue
                chunk.append({c: row[i] if i < len(row) else None for c, i in cols})
                if len(chunk) >= chunk_rows:
                    yield chunk
                    chunk = []
            if chunk:
                yield chunk
    elif suffix == ".jsonl":
        with open(path, encoding="utf-8") as f:
            chunk = []
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{n}: not valid JSON ({e.msg})") from None
                if not isinstance(row, dict):
                    raise ValueError(f"{path}:{n}: not a JSON object")
                chunk.append(row)
                if len(chunk) >= chunk_rows:
                    yield chunk
                    chunk = []
            if chunk:
                yield chunk
    elif suffix == ".parquet":
        import pyarrow.parquet as pq  # lazy: pyarrow is only needed for Parquet manifests

        pf = pq.ParquetFile(path)
        have = pf.schema_arrow.names
        for batch in pf.iter_batches(batch_size=chunk_rows, columns=[c for c in dict.fromkeys(wanted) if c in have]):
            yield batch.to_pylist()
    else:
        raise ValueError(f"{path}: manifest must end in .csv, .jsonl or .parquet")


def _column_chunks(path: Path, column: str, chunk_rows: int) -> Iterator[list]:
    """One column's values, a chunk at a time (a CSV's without building a dict per row)."""
    if path.suffix.lower() != ".csv":
        for rows in _row_chunks(path, [column], chunk_rows):
            yield [r.get(column) for r in rows]
        return
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.reader(f)
        i = {h: i for i, h in enumerate(next(reader, []))}[column]
        chunk: list = []
        for row in reader:
            if row:
                chunk.append(row[i] if i < len(row) else None)
                if len(chunk) >= chunk_rows:
                    yield chunk
                    chunk = []
        if chunk:
            yield chunk


def _columns(path: Path) -> list[str] | None:
    """The manifest's column names from its header or schema; None for JSONL (known only after a pass)."""
    suffix = path.suffix.lower()
    if suffix == ".csv":
        with open(path, newline="", encoding="utf-8") as f:
            return next(csv.reader(f), [])
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_schema(path).names
    return None


def _require(path: Path, have: list[str], columns: list[str]) -> None:
    for c in columns:
        if c not in have:
            raise ValueError(f"{path}: manifest has no column {c!r} (columns: {', '.join(map(str, have))})")


def _cell_labels(raw) -> list[str] | None:
    """A labels cell → its labels as stripped strings (ints as decimals); None if it cannot be read."""
    if isinstance(raw, str):
        text = raw.strip()
        if text.startswith(("[", "{")):  # JSON; only a list is one
            try:
                raw = json.loads(text)
            except json.JSONDecodeError:
                return None
        else:
            return [t.strip() for t in text.split(";") if t.strip()]
    if raw is None:
        return []
    if not isinstance(raw, (list, tuple)) or any(isinstance(x, (bool, float, list, dict)) for x in raw):
        return None
    return [str(x).strip() for x in raw if x is not None and str(x).strip() != ""]


def _class_names(values: set[str], classes: list[str] | None) -> tuple[list[str], bool]:
    """(class names, whether labels are integer indices) from the distinct label strings of a manifest."""
    as_index = bool(values) and all(_INT.match(v) for v in values)
    if classes is not None:
        return list(classes), as_index
    if as_index:  # integer labels are indices already; names are their decimal strings
        return [str(i) for i in range(max(int(v) for v in values) + 1)], True
    return sorted(values), False


def _resolve(label: str, as_index: bool, names: list[str], index: dict[str, int]) -> tuple[int | None, str]:
    """One label → (class index, "") or (None, why it is bad)."""
    if as_index:
        if int(label) >= len(names):
            return None, f"label {int(label)} >= {len(names)} classes"
        return int(label), ""
    if label in index:
        return index[label], ""
    return None, f"label {label!r} is not a known class"


@dataclass
class _Columns:
    """How a manifest's rows become items: its columns and its classes (decided by the first pass)."""

    root: str
    name: str
    path: str
    label: str
    labels: str
    split: str | None
    multi: bool
    primary: str | None  # multi-label: the label column giving the primary class, if the manifest has one
    names: list[str]
    index: dict[str, int]
    as_index: bool
    sizes: bool
    known: dict[str, tuple[int | None, str]] = field(default_factory=dict)  # label string → _resolve's answer

    def resolve(self, label: str) -> tuple[int | None, str]:
        if (got := self.known.get(label)) is None:
            got = _resolve(label, self.as_index, self.names, self.index)
        return got


def _row_item(cols: _Columns, n: int, row: dict) -> Item | dict:
    """Row number `n` (1-based) → an Item, or a reject naming the row and why."""
    rel = str(row.get(cols.path) or "").strip()
    where = rel or f"{cols.name}:row {n}"
    if not rel:
        return _reject(where, "bad_row", f"empty {cols.path!r}")
    if not cols.multi:  # the common case, short
        label = _text(row.get(cols.label))
        cls, why = cols.resolve(label) if label != "" else (None, "")
        if cls is None:
            return _reject(where, "bad_label", why or f"label {label!r} is not a known class")
        return _item(cols, row, where, rel, cls, None)
    cell = _cell_labels(row.get(cols.labels))
    if cell is None:
        return _reject(where, "bad_label", f"{cols.labels} {_text(row.get(cols.labels))!r}: not "
                                           "'a;b;c', a JSON list or a list of names/indices")
    if not cell:
        return _reject(where, "bad_label", f"{cols.labels} is empty")
    resolved = [cols.resolve(v) if v != "" else (None, "") for v in cell]
    bad = next((why for c, why in resolved if c is None), None)
    if bad is not None:
        return _reject(where, "bad_label", bad or f"label {cell[0]!r} is not a known class")
    cls = resolved[0][0]
    labels = tuple(sorted({c for c, _ in resolved}))
    primary = _text(row.get(cols.primary)) if cols.primary else ""
    if primary != "":
        cls, why = cols.resolve(primary)
        if cls is None or cls not in labels:
            return _reject(where, "bad_label", why or f"{cols.primary} {primary!r} is not one of its {cols.labels}")
    return _item(cols, row, where, rel, cls, labels)


def _item(cols: _Columns, row: dict, where: str, rel: str, cls: int, labels: tuple | None) -> Item | dict:
    split = None
    if cols.split:
        split = str(row.get(cols.split) or "").strip()
        if not SPLIT_NAME.match(split):
            return _reject(where, "bad_split", f"split {split!r} must match [A-Za-z0-9_]+")
    size = _size(os.path.join(cols.root, rel)) if cols.sizes else 0
    return Item(rel, cols.names[cls], cls, split, size, labels)


def open_manifest(
    manifest: str | os.PathLike,
    classes: list[str] | None = None,
    path_column: str = "path",
    label_column: str = "label",
    split_column: str | None = None,
    labels_column: str = "labels",
    *,
    sizes: bool = True,
    chunk_rows: int = CHUNK_ROWS,
) -> Listing:
    """Rows with a path (relative to the manifest's directory) and a label (class name or integer
    index), or, if the manifest has ``labels_column``, one or more labels (multi-label).

    Read twice, in chunks: a first pass collects the distinct label strings (the class names, and
    whether labels are indices), each `chunks()` call then streams the items."""
    manifest = Path(manifest).absolute()
    extra = [split_column] if split_column else []
    wanted = [path_column, label_column, labels_column, *extra]
    have = _columns(manifest)
    if have is None:  # JSONL: the columns are the keys any row has
        keys: set[str] = set()
        for chunk in _row_chunks(manifest, wanted, chunk_rows):
            for r in chunk:
                keys.update(r)
        have = sorted(keys)
    multi = labels_column in have
    _require(manifest, have, [path_column, labels_column if multi else label_column, *extra])
    values: set[str] = set()
    for chunk in _column_chunks(manifest, labels_column if multi else label_column, chunk_rows):
        if not multi:
            values.update(map(_text, chunk))
            continue
        for raw in chunk:
            if cell := _cell_labels(raw):
                values.update(cell)
    values.discard("")
    class_names, as_index = _class_names(values, classes)
    cols = _Columns(root=str(manifest.parent), name=manifest.name, path=path_column, label=label_column,
                    labels=labels_column, split=split_column, multi=multi,
                    primary=label_column if multi and label_column in have else None, names=class_names,
                    index={c: i for i, c in enumerate(class_names)}, as_index=as_index, sizes=sizes)
    cols.known = {v: cols.resolve(v) for v in values}  # every label string there is: resolved once, not per row

    def chunks() -> Iterator[Chunk]:
        n = 0
        for rows in _row_chunks(manifest, wanted, chunk_rows):
            got = [_row_item(cols, i, row) for i, row in enumerate(rows, n + 1)]
            n += len(rows)
            yield [g for g in got if not isinstance(g, dict)], [g for g in got if isinstance(g, dict)]

    return Listing(cols.root, class_names, multi, chunks)


def list_manifest(manifest: str | os.PathLike, classes: list[str] | None = None, path_column: str = "path",
                  label_column: str = "label", split_column: str | None = None,
                  labels_column: str = "labels") -> Source:
    return open_manifest(manifest, classes, path_column, label_column, split_column, labels_column).collect()


def _text(raw) -> str:
    return "" if raw is None else str(raw).strip()


def open_source(
    source: str | os.PathLike,
    classes: str | os.PathLike | list[str] | None = None,
    path_column: str = "path",
    label_column: str = "label",
    split_column: str | None = None,
    labels_column: str = "labels",
    *,
    sizes: bool = True,
    chunk_rows: int = CHUNK_ROWS,
) -> Listing:
    """Dispatch on the source kind: a directory is an ImageFolder tree, a file is a manifest.

    `sizes=False` skips the stat of every input (needed only to cut shards by bytes)."""
    p = Path(source)
    names = load_classes(classes)
    if p.is_dir():
        if split_column:
            raise ValueError(f"{source}: --split-column needs a manifest, not an ImageFolder directory")
        return open_image_folder(p, names, sizes=sizes, chunk_rows=chunk_rows)
    if not p.exists():
        raise FileNotFoundError(f"{source}: no such directory or manifest")
    if p.suffix.lower() not in MANIFEST_EXTS:
        raise ValueError(f"{source}: not a directory and not a .csv/.jsonl/.parquet manifest")
    return open_manifest(p, names, path_column, label_column, split_column, labels_column, sizes=sizes,
                         chunk_rows=chunk_rows)


def list_source(
    source: str | os.PathLike,
    classes: str | os.PathLike | list[str] | None = None,
    path_column: str = "path",
    label_column: str = "label",
    split_column: str | None = None,
    labels_column: str = "labels",
) -> Source:
    """The whole source in memory (small inputs, tests); `open_source` streams it."""
    return open_source(source, classes, path_column, label_column, split_column, labels_column).collect()
