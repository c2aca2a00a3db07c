"""The shard set's description, ``_info.json``: one dataclass, written by prep, read by everyone.

Layout (timm's WebDataset reader reads the same: splits → name/num_samples/filenames/shard_lengths)::

    {"format_version": 1, "plan_id": "…", "num_classes": 3, "classes": ["cat", …], "multi_label": false,
     "num_inputs": 120, "num_rejects": 2, "rejects_by_reason": {"too_small": 2}, "seed": 0,
     "image_options": {…},
     "splits": {"train": {"name": "train", "num_samples": 118, "filenames": ["train-000000.tar"],
                          "shard_lengths": [118]}}}

Every key is optional on reading, so descriptions written by other tools (or by older vitp) still
read: a missing class list comes from ``classes.json`` beside it, missing shard lengths are None
(the loader counts them), a missing ``num_samples`` is their sum. A key that is present must have
the right type: a wrong one is a `SchemaError` naming the file and the key
(``out/_info.json: splits.train.shard_lengths[1]: expected an integer >= 0, got 'x'``).

Also the sample layout every reader agrees on: `IMAGE_EXTS`, the image member extensions.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from . import store

INFO_FILE = "_info.json"
# `vitp decontam`'s list of samples every loader leaves out (data_prep/decontam.py writes it)
EXCLUDE_FILE, EXCLUDE_VERSION = "_exclude.json", 1
CLASSES_FILE = "classes.json"
FORMAT_VERSION = 1

# Image extensions (lower case, no dot) that prep accepts as inputs and the loader and verify take as a
# sample's image member: every one decodes with Pillow (prep also stores jpg/png/webp as they are).
IMAGE_EXTS = frozenset({"jpg", "jpeg", "png", "webp", "bmp", "gif", "tif", "tiff", "ppm", "pgm", "pbm"})


class SchemaError(ValueError):
    """A malformed ``_info.json``/``classes.json``; the message is one line naming the file and key."""


@dataclass(frozen=True)
class SplitShards:
    """One split: its shard files (relative to the folder, absolute, or URLs) and their sample counts."""

    name: str
    filenames: tuple[str, ...] = ()
    shard_lengths: tuple[int, ...] | None = None  # None: not recorded (a foreign description)
    num_samples: int | None = None  # None: not recorded and not derivable

    def to_dict(self) -> dict:
        out: dict = {"name": self.name, "filenames": list(self.filenames)}
        if self.num_samples is not None:
            out["num_samples"] = self.num_samples
        if self.shard_lengths is not None:
            out["shard_lengths"] = list(self.shard_lengths)
        return out


@dataclass(frozen=True)
class DatasetInfo:
    """What ``_info.json`` says. ``digest`` (not written) names the exact content it was read from:
    prep's plan id, else a hash of the file's text."""

    splits: dict[str, SplitShards]
    num_classes: int | None = None
    classes: tuple[str, ...] | None = None
    multi_label: bool = False  # labels are sets of classes (sample json "labels"); .cls is the primary one
    plan_id: str | None = None
    num_inputs: int | None = None
    num_rejects: int | None = None
    rejects_by_reason: dict[str, int] | None = None
    seed: int | None = None
    image_options: dict | None = None
    format_version: int | None = None
    # `vitp prep --exclude-near`: {"signature", "version", "threshold", "splits", "against": [{"address",
    # "images", "digest", "rejected", "duplicated"}], "rejected"}; after `vitp decontam` also the sets of
    # its _exclude.json, each marked "by" it, and their "excluded" in all (with_exclusions)
    decontaminated: dict | None = None
    digest: str = field(default="", compare=False)

    # ── writing ──
    def to_dict(self) -> dict:
        out: dict = {"splits": {k: sp.to_dict() for k, sp in self.splits.items()}}
        if self.classes is not None:
            out["classes"] = list(self.classes)
        for key in ("format_version", "plan_id", "num_classes", "num_inputs", "num_rejects", "rejects_by_reason",
                    "seed", "image_options", "decontaminated"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        out["multi_label"] = self.multi_label
        return out

    def to_json(self) -> str:
        """Sorted keys, one item per line: the same description gives the same bytes."""
        return json.dumps(self.to_dict(), indent=1, sort_keys=True, ensure_ascii=False) + "\n"

    # ── reading ──
    @classmethod
    def from_json(cls, text: str, source: str = INFO_FILE) -> DatasetInfo:
        """Parse ``_info.json`` text; ``source`` names the file in errors."""
        try:
            raw = json.loads(text)
        except ValueError as e:
            raise SchemaError(f"{source}: not valid JSON ({e})") from None
        info = cls.from_dict(raw, source)
        digest = info.plan_id or hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]
        return _replace_digest(info, digest)

    @classmethod
    def from_dict(cls, raw, source: str = INFO_FILE) -> DatasetInfo:
        c = _Checker(source)
        c.check(raw, dict, "", "an object")
        splits_raw = c.opt(raw, "splits", dict, "an object of splits") or {}
        splits = {str(name): _split(c, str(name), sp) for name, sp in splits_raw.items()}
        classes = c.opt(raw, "classes", list, "a list of class names")
        if classes is not None:
            classes = tuple(str(x) for x in classes)
        by_reason = c.opt(raw, "rejects_by_reason", dict, "an object of counts")
        if by_reason is not None:
            by_reason = {str(k): c.count(v, f"rejects_by_reason.{k}") for k, v in by_reason.items()}
        multi = c.opt(raw, "multi_label", bool, "true or false")
        plan_id = c.opt(raw, "plan_id", str, "a string")
        return cls(splits=splits, num_classes=c.opt_count(raw, "num_classes"), classes=classes,
                   multi_label=bool(multi), plan_id=plan_id or None, num_inputs=c.opt_count(raw, "num_inputs"),
                   num_rejects=c.opt_count(raw, "num_rejects"), rejects_by_reason=by_reason,
                   seed=c.opt(raw, "seed", int, "an integer"),
                   image_options=c.opt(raw, "image_options", dict, "an object"),
                   format_version=c.opt_count(raw, "format_version"),
                   decontaminated=c.opt(raw, "decontaminated", dict, "an object"))

    @classmethod
    def read(cls, path: str | os.PathLike) -> DatasetInfo:
        """``path``: the ``_info.json`` file or its folder. SchemaError if missing, unreadable or malformed."""
        f = Path(path)
        if f.is_dir() or f.name != INFO_FILE:
            f = f / INFO_FILE
        try:
            text = f.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise SchemaError(f"{f}: not found") from None
        except (OSError, UnicodeDecodeError) as e:
            raise SchemaError(f"{f}: unreadable ({e})") from None
        return cls.from_json(text, str(f))

    def class_names(self, folder: str | os.PathLike) -> tuple[str, ...]:
        """The class list: this description's, else ``classes.json`` in ``folder`` (else empty)."""
        if self.classes is not None:
            return self.classes
        return read_classes(folder) or ()

    def count_of_classes(self, folder: str | os.PathLike) -> int:
        return self.num_classes if self.num_classes is not None else len(self.class_names(folder))


def read_classes(folder: str | os.PathLike) -> tuple[str, ...] | None:
    """``classes.json`` in ``folder`` (a list of names, index = class); None when there is none."""
    f = Path(folder) / CLASSES_FILE
    if not f.is_file():
        return None
    try:
        raw = f.read_bytes()
    except OSError as e:
        raise SchemaError(f"{f}: unreadable ({e})") from None
    return parse_classes(raw, str(f))


def parse_classes(raw: bytes, source: str = CLASSES_FILE) -> tuple[str, ...]:
    """``classes.json`` content (read from a folder or an object store); ``source`` names it in errors."""
    try:
        names = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise SchemaError(f"{source}: unreadable ({e})") from None
    if not isinstance(names, list):
        raise SchemaError(f"{source}: expected a list of class names, got {type(names).__name__}")
    return tuple(str(x) for x in names)


def _replace_digest(info: DatasetInfo, digest: str) -> DatasetInfo:
    object.__setattr__(info, "digest", digest)  # set once, right after parsing (the field is not compared)
    return info


def _split(c: _Checker, name: str, sp) -> SplitShards:
    where = f"splits.{name}"
    c.check(sp, dict, where, "an object")
    files = c.opt(sp, "filenames", list, "a list of shard file names", where) or []
    for i, fn in enumerate(files):
        c.check(fn, str, f"{where}.filenames[{i}]", "a string")
    lengths = c.opt(sp, "shard_lengths", list, "a list of sample counts", where)
    if lengths is not None:
        lengths = tuple(c.count(n, f"{where}.shard_lengths[{i}]") for i, n in enumerate(lengths))
    n = c.opt_count(sp, "num_samples", where)
    if n is None and lengths is not None and len(lengths) == len(files):
        n = sum(lengths)
    return SplitShards(name, tuple(files), lengths, n)


class _Checker:
    """Type checks that raise SchemaError("<file>: <dotted key>: expected …, got …")."""

    def __init__(self, source: str):
        self.source = source

    def fail(self, key: str, want: str, got) -> SchemaError:
        shown = repr(got) if len(repr(got)) <= 60 else repr(got)[:57] + "..."
        return SchemaError(f"{self.source}: {key or 'top level'}: expected {want}, got {shown}")

    def check(self, value, typ: type, key: str, want: str) -> None:
        if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
            raise self.fail(key, want, value)

    def opt(self, obj: dict, key: str, typ: type, want: str, where: str = ""):
        value = obj.get(key)
        if value is not None:
            self.check(value, typ, f"{where}.{key}" if where else key, want)
        return value

    def count(self, value, key: str) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise self.fail(key, "an integer >= 0", value)
        return value

    def opt_count(self, obj: dict, key: str, where: str = "") -> int | None:
        value = obj.get(key)
        return None if value is None else self.count(value, f"{where}.{key}" if where else key)


AFTER_PREP = "vitp decontam"  # an ``against[]`` entry's ``by``: checked after prep, listed in _exclude.json


def with_exclusions(block: dict | None, listed: dict | None) -> dict | None:
    """_info.json's ``decontaminated`` block with the test sets of ``listed`` (_exclude.json without its
    ``samples``; None: there is none) as the ones checked after prep, in place of any it held.

    Prep's own keys and ``against[]`` entries stay as prep wrote them (``rejected``: the images it
    dropped). Each set of the list follows them: its address, images, digest, ``excluded`` (the training
    samples the list leaves out for it), ``duplicated``, ``splits`` and ``threshold`` (of its check),
    ``"by": "vitp decontam"`` and the list's version (``exclude_version``); the block's ``excluded`` is their sum (the
    list's), beside prep's ``rejected``. A prep output made without --exclude-near gets a block of those
    entries alone (``"rejected": 0``); without a list, prep's block as prep wrote it (None if it had none).
    """
    prep = {k: v for k, v in (block or {}).items() if k != "excluded"} if block and "signature" in block else {}
    if prep:
        prep["against"] = [a for a in prep.get("against", []) if a.get("by") != AFTER_PREP]
    if listed is None:
        return prep or None
    after = [{**{k: v for k, v in a.items() if k != "rejected"}, "excluded": a["rejected"], "by": AFTER_PREP,
              "splits": listed.get("splits"), "threshold": listed.get("threshold"),
              "signature_version": listed.get("signature_version"), "exclude_version": listed["version"]}
             for a in listed.get("against", [])]
    return {"rejected": 0, **prep, "against": [*prep.get("against", []), *after], "excluded": listed["excluded"]}


def info_with_exclusions(text: str, listed: dict | None) -> str:
    """_info.json's text with its ``decontaminated`` block as with_exclusions() makes it, every other key
    as it was, written as DatasetInfo.to_json writes (the same block gives the same bytes)."""
    raw = json.loads(text)
    block = with_exclusions(raw.get("decontaminated"), listed)
    raw = {k: v for k, v in raw.items() if k != "decontaminated"} | ({"decontaminated": block} if block else {})
    return json.dumps(raw, indent=1, sort_keys=True, ensure_ascii=False) + "\n"


def read_exclusions(root: str) -> dict | None:
    """OUT/_exclude.json parsed (None: there is none); a newer version or a malformed file is one line."""
    raw = store.read_file(root, EXCLUDE_FILE)
    if raw is None:
        return None
    where = store.public(store.join(root, EXCLUDE_FILE))
    try:
        doc = json.loads(raw)
        version, samples = doc["version"], doc["samples"]
        pairs = [(s["split"], s["shard"], int(s["index"])) for s in samples]
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{where}: malformed ({e})") from None
    if version != EXCLUDE_VERSION:
        raise ValueError(f"{where}: version {version!r}; this vitp reads version {EXCLUDE_VERSION}")
    return {**doc, "pairs": pairs}
