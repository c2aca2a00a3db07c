"""Inputs → a flat list of Items: an ImageFolder tree (root/<class>/<image>) or a CSV/JSONL/Parquet manifest.

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

IMAGE_EXTS = {".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff", ".ppm", ".pgm", ".pbm"}
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


@dataclass
class Source:
    root: str  # directory that `Item.rel` is relative to
    classes: list[str]
    items: list[Item] = field(default_factory=list)
    rejects: list[dict] = field(default_factory=list)  # {"path", "reason", "detail"}


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
            elif os.path.splitext(path)[1].lower() not in IMAGE_EXTS:
                src.rejects.append(_reject(rel, "extension", "not an image file extension"))
            else:
                src.items.append(Item(rel=rel, label=d, cls=index[d], size=_size(path)))
    return src


def _read_rows(path: Path, columns: list[str]) -> list[dict]:
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
        present = [c for c in columns if c in have]
        rows = pq.read_table(path, columns=present).to_pylist()
    else:
        raise ValueError(f"{path}: manifest must end in .csv, .jsonl or .parquet")
    for c in columns:
        if c not in have:
            raise ValueError(f"{path}: manifest has no column {c!r} (columns: {', '.join(map(str, have))})")
    return rows


def list_manifest(
    manifest: str | os.PathLike,
    classes: list[str] | None = None,
    path_column: str = "path",
    label_column: str = "label",
    split_column: str | None = None,
) -> Source:
    """Rows with a path (relative to the manifest's directory) and a label (class name or integer index)."""
    manifest = Path(manifest).absolute()
    cols = [path_column, label_column] + ([split_column] if split_column else [])
    rows = _read_rows(manifest, cols)
    labels = [r.get(label_column) for r in rows]
    present = [str(x).strip() for x in labels if x is not None and str(x).strip() != ""]
    int_labels = bool(present) and all(isinstance(x, int) or _INT.match(str(x).strip()) for x in labels if x is not None
                                       and str(x).strip() != "")
    if classes is not None:
        class_names = list(classes)
    elif int_labels:  # integer labels are indices already; names are their decimal strings
        class_names = [str(i) for i in range(max(int(x) for x in present) + 1)]
    else:
        class_names = sorted(set(present))
    index = {c: i for i, c in enumerate(class_names)}
    src = Source(root=str(manifest.parent), classes=class_names)
    for n, row in enumerate(rows, 1):
        rel = str(row.get(path_column) or "").strip()
        raw = row.get(label_column)
        label = "" if raw is None else str(raw).strip()
        where = rel or f"{manifest.name}:row {n}"
        if not rel:
            src.rejects.append(_reject(where, "bad_row", f"empty {path_column!r}"))
            continue
        if int_labels and label != "":
            cls = int(label)
            if cls >= len(class_names):
                src.rejects.append(_reject(where, "bad_label", f"label {cls} >= {len(class_names)} classes"))
                continue
            label = class_names[cls]
        elif label in index:
            cls = index[label]
        else:
            src.rejects.append(_reject(where, "bad_label", f"label {label!r} is not a known class"))
            continue
        split = None
        if split_column:
            split = str(row.get(split_column) or "").strip()
            if not SPLIT_NAME.match(split):
                src.rejects.append(_reject(where, "bad_split", f"split {split!r} must match [A-Za-z0-9_]+"))
                continue
        src.items.append(Item(rel=rel, label=label, cls=cls, split=split, size=_size(os.path.join(src.root, rel))))
    return src


def list_source(
    source: str | os.PathLike,
    classes: str | os.PathLike | list[str] | None = None,
    path_column: str = "path",
    label_column: str = "label",
    split_column: str | None = None,
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
    return list_manifest(p, names, path_column, label_column, split_column)
