"""Inputs → a flat list of Items: an ImageFolder tree (root/<class>/<image>) or a CSV/JSONL/Parquet manifest.

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
from dataclasses import dataclass, field
from pathlib import Path

from .schema import IMAGE_EXTS

MANIFEST_EXTS = {".csv", ".jsonl", ".parquet"}
SPLIT_NAME = re.compile(r"^[A-Za-z0-9_]{1,64}$")
_INT = re.compile(r"^\d+$")


@dataclass(frozen=True)
class Item:
    rel: str  # path as recorded in the sample json: relative to the source root (or absolute in a manifest)
    label: str  # class name
    cls: int  # class index
    split: str | None = None  # from a split column, else assigned by the plan
    size: int = 0  # bytes on disk (0 when unknown); used only for byte-based shard planning
    labels: tuple[int, ...] | None = None  # multi-label: every class index, sorted (None: single-label)


@dataclass
class Source:
    root: str  # directory that `Item.rel` is relative to
    classes: list[str]
    items: list[Item] = field(default_factory=list)
    rejects: list[dict] = field(default_factory=list)  # {"path", "reason", "detail"}
    multi_label: bool = False  # items carry `labels` (a manifest with a labels column)


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


def _walk_files(top: str, root: str, out_files: list[str], rejects: list[dict], ancestors: frozenset[str]) -> None:
    """Depth-first, name-sorted listing of every non-directory entry below `top` (symlinked dirs followed once)."""
    try:
        entries = sorted(os.scandir(top), key=lambda e: e.name)
    except OSError as e:
        rejects.append(_reject(os.path.relpath(top, root), "unreadable", e.strerror or str(e)))
        return
    for entry in entries:
        if _is_dir(entry):
            real = os.path.realpath(entry.path)
            if real in ancestors:
                rel = Path(os.path.relpath(entry.path, root)).as_posix()
                rejects.append(_reject(rel, "symlink_loop", "directory link points to one of its ancestors"))
                continue
            _walk_files(entry.path, root, out_files, rejects, ancestors | {real})
        else:
            out_files.append(entry.path)


def list_image_folder(root: str | os.PathLike, classes: list[str] | None = None) -> Source:
    root = os.path.abspath(root)
    top = sorted(os.scandir(root), key=lambda e: e.name)
    dirs = [e.name for e in top if _is_dir(e) and not e.name.startswith(".")]
    class_names = classes if classes is not None else sorted(dirs)
    index = {c: i for i, c in enumerate(class_names)}
    src = Source(root=root, classes=list(class_names))
    for e in top:
        if not _is_dir(e):
            src.rejects.append(_reject(e.name, "no_class", "file at the top level is in no class directory"))
    for d in dirs:
        files: list[str] = []
        cdir = os.path.join(root, d)
        _walk_files(cdir, root, files, src.rejects, frozenset({os.path.realpath(root), os.path.realpath(cdir)}))
        for path in files:
            rel = Path(os.path.relpath(path, root)).as_posix()
            if d not in index:
                src.rejects.append(_reject(rel, "bad_label", f"class {d!r} is not in the given classes"))
            elif os.path.splitext(path)[1].lower()[1:] not in IMAGE_EXTS:
                src.rejects.append(_reject(rel, "extension", "not an image file extension"))
            else:
                src.items.append(Item(rel=rel, label=d, cls=index[d], size=_size(path)))
    return src


def _read_rows(path: Path, wanted: list[str]) -> tuple[list[dict], list[str]]:
    """(rows, the manifest's column names); a Parquet file is read only for the ``wanted`` columns it has."""
    suffix = path.suffix.lower()
    if suffix == ".csv":
        with open(path, newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f)
            rows, have = list(reader), reader.fieldnames or []
    elif suffix == ".jsonl":
        rows = []
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if line.strip():
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError as e:
                        raise ValueError(f"{path}:{n}: not valid JSON ({e.msg})") from None
        have = sorted({k for r in rows for k in r}) if rows else []
    elif suffix == ".parquet":
        import pyarrow.parquet as pq  # lazy: pyarrow is only needed for Parquet manifests

        have = pq.read_schema(path).names
        rows = pq.read_table(path, columns=[c for c in dict.fromkeys(wanted) if c in have]).to_pylist()
    else:
        raise ValueError(f"{path}: manifest must end in .csv, .jsonl or .parquet")
    return rows, list(have)


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


def _class_names(values: list[str], classes: list[str] | None) -> tuple[list[str], bool]:
    """(class names, whether labels are integer indices) from every label string of a manifest."""
    as_index = bool(values) and all(_INT.match(v) for v in values)
    if classes is not None:
        return list(classes), as_index
    if as_index:  # integer labels are indices already; names are their decimal strings
        return [str(i) for i in range(max(int(v) for v in values) + 1)], True
    return sorted(set(values)), False


def _resolve(label: str, as_index: bool, names: list[str], index: dict[str, int]) -> tuple[int | None, str]:
    """One label → (class index, "") or (None, why it is bad)."""
    if as_index:
        if int(label) >= len(names):
            return None, f"label {int(label)} >= {len(names)} classes"
        return int(label), ""
    if label in index:
        return index[label], ""
    return None, f"label {label!r} is not a known class"


def list_manifest(
    manifest: str | os.PathLike,
    classes: list[str] | None = None,
    path_column: str = "path",
    label_column: str = "label",
    split_column: str | None = None,
    labels_column: str = "labels",
) -> Source:
    """Rows with a path (relative to the manifest's directory) and a label (class name or integer
    index), or, if the manifest has ``labels_column``, one or more labels (multi-label)."""
    manifest = Path(manifest).absolute()
    extra = [split_column] if split_column else []
    rows, have = _read_rows(manifest, [path_column, label_column, labels_column, *extra])
    multi = labels_column in have
    _require(manifest, have, [path_column, labels_column if multi else label_column, *extra])
    primary_column = label_column if multi and label_column in have else None
    cells = [_cell_labels(r.get(labels_column)) if multi else [_text(r.get(label_column))] for r in rows]
    values = [v for c in cells if c for v in c if v != ""]
    class_names, as_index = _class_names(values, classes)
    index = {c: i for i, c in enumerate(class_names)}
    src = Source(root=str(manifest.parent), classes=class_names, multi_label=multi)
    for n, (row, cell) in enumerate(zip(rows, cells), 1):
        rel = str(row.get(path_column) or "").strip()
        where = rel or f"{manifest.name}:row {n}"
        if not rel:
            src.rejects.append(_reject(where, "bad_row", f"empty {path_column!r}"))
            continue
        if cell is None:
            src.rejects.append(_reject(where, "bad_label", f"{labels_column} {_text(row.get(labels_column))!r}: not "
                                                           "'a;b;c', a JSON list or a list of names/indices"))
            continue
        if multi and not cell:
            src.rejects.append(_reject(where, "bad_label", f"{labels_column} is empty"))
            continue
        resolved = [_resolve(v, as_index, class_names, index) if v != "" else (None, "") for v in cell]
        bad = next((why for c, why in resolved if c is None), None)
        if bad is not None:
            src.rejects.append(_reject(where, "bad_label", bad or f"label {cell[0]!r} is not a known class"))
            continue
        cls = resolved[0][0]
        labels = None
        if multi:
            labels = tuple(sorted({c for c, _ in resolved}))
            if primary_column and _text(row.get(primary_column)) != "":
                cls, why = _resolve(_text(row.get(primary_column)), as_index, class_names, index)
                if cls is None or cls not in labels:
                    src.rejects.append(_reject(where, "bad_label", why or f"{primary_column} "
                                               f"{_text(row.get(primary_column))!r} is not one of its {labels_column}"))
                    continue
        split = None
        if split_column:
            split = str(row.get(split_column) or "").strip()
            if not SPLIT_NAME.match(split):
                src.rejects.append(_reject(where, "bad_split", f"split {split!r} must match [A-Za-z0-9_]+"))
                continue
        src.items.append(Item(rel=rel, label=class_names[cls], cls=cls, split=split,
                              size=_size(os.path.join(src.root, rel)), labels=labels))
    return src


def _text(raw) -> str:
    return "" if raw is None else str(raw).strip()


def list_source(
    source: str | os.PathLike,
    classes: str | os.PathLike | list[str] | None = None,
    path_column: str = "path",
    label_column: str = "label",
    split_column: str | None = None,
    labels_column: str = "labels",
) -> Source:
    """Dispatch on the source kind: a directory is an ImageFolder tree, a file is a manifest."""
    p = Path(source)
    names = load_classes(classes)
    if p.is_dir():
        if split_column:
            raise ValueError(f"{source}: --split-column needs a manifest, not an ImageFolder directory")
        return list_image_folder(p, names)
    if not p.exists():
        raise FileNotFoundError(f"{source}: no such directory or manifest")
    if p.suffix.lower() not in MANIFEST_EXTS:
        raise ValueError(f"{source}: not a directory and not a .csv/.jsonl/.parquet manifest")
    return list_manifest(p, names, path_column, label_column, split_column, labels_column)
