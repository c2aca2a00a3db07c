"""The test sets of `vitp prep --exclude-near`: read once at planning, hashed (data_prep/near.py), and
stored under OUT as one index every worker and array task loads.

A test set is an image folder (local, or an object store prefix), a manifest (.csv/.jsonl/.parquet with
a path column, paths relative to it) or a `vitp prep` output (its _info.json; of its splits, the chosen
ones, else ``test`` if it has one, else all) at any address store.py reads. A test image's name in
rejects.jsonl is ``<address without secrets>/<path or key>``.

Under OUT: ``_near.npz`` (the index: hashes, their owners, the second signatures) and ``_near.json``
(the names, in the index's order, and the ``decontaminated`` block of _info.json without its counts).
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import os
from collections.abc import Iterator

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from . import store
from .images import to_rgb_array
from .near import SIGNATURE, SIGNATURE_VERSION, NearIndex, reference
from .schema import IMAGE_EXTS, INFO_FILE, DatasetInfo
from .tar import iter_tar

INDEX_FILE, NAMES_FILE = "_near.npz", "_near.json"
MANIFEST_EXTS = (".csv", ".jsonl", ".parquet")


def image_signatures(data: bytes) -> tuple[tuple[int, ...], np.ndarray]:
    """A test file's bytes -> reference() of the picture as shown (EXIF orientation applied; grey,
    palette, CMYK and 16-bit images as RGB)."""
    im = Image.open(io.BytesIO(data))
    im.draft("RGB", (256, 256))  # a JPEG decoded at 1/2..1/8 scale: the hash looks at 32x32
    im = ImageOps.exif_transpose(im)
    return reference(to_rgb_array(im) if im.mode in ("I;16", "I", "F") else np.asarray(im.convert("RGB")))


def _is_image(name: str) -> bool:
    return name.rsplit(".", 1)[-1].lower() in IMAGE_EXTS


def _prep_output(address: str, splits: list[str] | None) -> Iterator[tuple[str, bytes]]:
    info = DatasetInfo.from_json(store.read_file(address, INFO_FILE).decode("utf-8"))
    chosen = splits or (["test"] if "test" in info.splits else sorted(info.splits))
    missing = [s for s in chosen if s not in info.splits]
    if missing:
        raise ValueError(f"--exclude-near-splits: {store.public(address)} has no split {missing[0]!r} "
                         f"(has: {', '.join(sorted(info.splits))})")
    for split in chosen:
        for fname in info.splits[split].filenames:
            with store.open_read(store.join(address, fname)) as f:
                for name, _, read in iter_tar(f, seekable=False):
                    if _is_image(name):
                        yield name.rsplit(".", 1)[0], read()


def _manifest(address: str) -> Iterator[tuple[str, bytes]]:
    data = store.read_bytes(address)
    if address.endswith(".parquet"):
        import pyarrow.parquet as pq

        paths = pq.read_table(io.BytesIO(data), columns=["path"]).column("path").to_pylist()
    elif address.endswith(".jsonl"):
        paths = [json.loads(line)["path"] for line in data.decode("utf-8").splitlines() if line.strip()]
    else:
        paths = [row["path"] for row in csv.DictReader(io.StringIO(data.decode("utf-8")))]
    base = address.rsplit("/", 1)[0]
    for rel in paths:
        try:
            data = store.read_bytes(store.join(base, rel))
        except FileNotFoundError:
            raise ValueError(f"--exclude-near {store.public(address)}: {rel}: not found (listed there)") from None
        except OSError as e:
            raise ValueError(f"--exclude-near {store.public(address)}: {rel}: cannot be read ({e})") from None
        yield rel, data


def _folder(address: str) -> Iterator[tuple[str, bytes]]:
    if store.is_remote(address):
        fs, path = store.filesystem(address)
        names = sorted(p[len(path.rstrip("/")) + 1:] for p in fs.find(path))
    else:
        root = address.removeprefix("file://")
        names = sorted(os.path.relpath(os.path.join(d, f), root).replace(os.sep, "/")
                       for d, _, fs_ in os.walk(root) for f in fs_)
    for rel in names:
        if _is_image(rel):
            yield rel, store.read_bytes(store.join(address, rel))


def _images(address: str, splits: list[str] | None) -> Iterator[tuple[str, bytes]]:
    if address.lower().endswith(MANIFEST_EXTS):
        return _manifest(address)
    if store.read_file(address, INFO_FILE) is not None:
        return _prep_output(address, splits)
    return _folder(address)


def check_test_sets(addresses: list[str]) -> None:
    """Each address there, before any work: one line naming --exclude-near."""
    for a in addresses:
        if not store.is_remote(a):
            if not os.path.exists(a.removeprefix("file://")):
                raise ValueError(f"--exclude-near {a}: not found")
            continue
        # over HTTP a folder cannot be listed: a manifest, or a prep output's _info.json
        probe = a if a.lower().endswith(MANIFEST_EXTS) or not a.startswith("http") else store.join(a, INFO_FILE)
        try:
            store.check_readable(probe, "--exclude-near")
        except (ValueError, OSError) as e:
            raise ValueError(f"--exclude-near {store.public(a)}: {e}") from None


def build_index(addresses: list[str], splits: list[str] | None, threshold: int) -> tuple[NearIndex, list[str], dict]:
    """Read and hash every test image: (the index, each image's name, the decontaminated block)."""
    hashes, thumbs, names, against = [], [], [], []
    for address in addresses:
        shown, digest, n = store.public(address), hashlib.sha256(), 0
        for rel, data in _images(address, splits):
            try:
                hs, ts = image_signatures(data)
            except Exception as e:  # a test image that does not decode cannot be matched: say so, early
                why = "not an image format Pillow knows" if isinstance(e, UnidentifiedImageError) else e
                raise ValueError(f"--exclude-near {shown}/{rel}: not a readable image ({why})") from None
            hashes.append(hs)
            thumbs.append(ts)
            names.append(f"{shown}/{rel}")
            digest.update(f"{rel}\t{' '.join(map(str, hs))}\t{ts.tobytes().hex()}\n".encode())
            n += 1
        if n == 0:
            raise ValueError(f"--exclude-near {shown}: no test images found")
        against.append({"address": shown, "images": n, "digest": digest.hexdigest()[:16]})
    block = {"signature": SIGNATURE, "version": SIGNATURE_VERSION, "threshold": threshold,
             "splits": splits, "against": against}
    return NearIndex.build(hashes, threshold, np.stack(thumbs)), names, block


def write_index(out, index: NearIndex, names: list[str], block: dict) -> None:
    store.write_file(out, INDEX_FILE, index.to_bytes())
    store.write_file(out, NAMES_FILE, json.dumps({"names": names, "decontaminated": block}).encode())


def read_index(out) -> tuple[NearIndex, list[str], dict] | None:
    data, meta = store.read_file(out, INDEX_FILE), store.read_file(out, NAMES_FILE)
    if data is None or meta is None:
        return None
    m = json.loads(meta)
    return NearIndex.from_bytes(data), m["names"], m["decontaminated"]
