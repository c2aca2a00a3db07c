"""Which kind of dataset an address is, and the DataSource that reads it: one line per kind in :data:`KINDS`
(a new kind is its module and its line here). Torch-free: a kind's reader is imported when it is used.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass

from data_prep import store
from data_prep.schema import INFO_FILE
from pipeline.data.shards import DataError
from pipeline.data.source import DataSource


def source_for(path: str) -> DataSource:
    """The source for ``data.path``: the first of :data:`KINDS` that claims it."""
    path = str(path)
    if not path:
        raise DataError("data.path: empty; give a `vitp prep` output folder (or synthetic: for a smoke run)")
    kind = next(k for k in KINDS if k.claims(path))
    module, name = kind.reader.split(":")
    return getattr(importlib.import_module(module), name)(path)  # imported only now: readers import torch


def kinds_help() -> str:
    """The kinds of address ``--data`` takes, one phrase per kind of :data:`KINDS` (for a command's help)."""
    phrases = [k.address for k in KINDS]
    return f"{', '.join(phrases[:-1])} or {phrases[-1]}"


def is_image_folder(path: str) -> bool:
    """Whether ``path`` is read as an image folder: a folder (or prefix) that is not a `vitp prep`
    output (no ``_info.json``) and holds sub-folders other than prep's own (``_plan``: an unfinished
    prep stays a prep output, whose error asks whether prep finished). A tree that is not a valid image
    folder is still claimed here, so that its error names the folders an image folder needs."""
    path = str(path)

    def named(name: str) -> bool:
        return not name.startswith(("_", "."))

    try:
        if not store.is_remote(path):
            return os.path.isdir(path) and not os.path.exists(os.path.join(path, INFO_FILE)) and any(
                e.is_dir() and named(e.name) for e in os.scandir(path))
        if store.exists(store.join(path, INFO_FILE)):
            return False
        fs, root = store.filesystem(path)
        return any(e.get("type") == "directory" and named(e["name"].rstrip("/").rsplit("/", 1)[-1])
                   for e in fs.ls(root, detail=True))
    except Exception:  # OSError, or an HTTP store's own (aiohttp's 403 on a listing): not ours to word
        return False  # the shard reader's error names what is missing (the bucket, the 403, the 404)


def synthetic_spec(path: str) -> bool:
    return path == "synthetic" or path.startswith("synthetic:")


@dataclass(frozen=True)
class Kind:
    """A kind of dataset address: whether an address is one, the DataSource that reads it
    (``module:Class``), and the phrase a command's help shows for it."""

    claims: Callable[[str], bool]
    reader: str
    address: str


# Each kind of dataset, one line, asked in this order (a new kind: its module and its line here).
KINDS = (
    Kind(synthetic_spec, "pipeline.data.synthetic:SyntheticSource", "synthetic[:train=N,...] (generated, for tests)"),
    Kind(is_image_folder, "pipeline.data.imagefolder:ImageFolderSource",
         "a class-per-folder tree (train/ val/ test/)"),
    Kind(lambda path: True, "pipeline.data.loader:ShardSource", "a `vitp prep` output"),
)
