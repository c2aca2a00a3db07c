"""The datasets stages read, behind one declared interface (source.py) that both sources implement:

    source = source_for(path)        a DataSource for ``data.path``: ShardSource (a `vitp prep` folder)
                                     or SyntheticSource (``synthetic:...``)
    source.read_info()               -> Info (classes, splits with sample counts)
    source.train_loader(cfg.data, ...)  endless micro batches (uint8 [B, 3, H, W], labels), resumable
    source.eval_loader(cfg.data, ...)   each sample once over all ranks: (uint8 images, labels, valid mask)
    source.split_labels(split, rank, world)  its labels, without decoding images (this rank's shards)
    source.normalize(x)              uint8 on the device -> the model's input range
    check_splits(path, {key: split})  before a run starts: every split it reads is there (one line naming
                                     the key, the file and the remedy otherwise)

shards.py reads tars and ``_info.json`` (with data_prep.tar and .schema); loader.py decodes and batches them;
augment.py holds the image transforms; mixing.py mixup/cutmix/label smoothing (the training step's,
after the loader); synthetic.py is an in-memory set for tests and smoke runs.
"""

from __future__ import annotations

import json
import os

from data_prep import store
from data_prep.schema import INFO_FILE
from pipeline.data.minival import MINIVAL, minival_source, stored_split
from pipeline.data.shards import DataError, Info, SplitInfo
from pipeline.data.source import DataSource, EvalBatches, TrainBatches


def source_for(path: str) -> DataSource:
    """The source for ``data.path``: SyntheticSource for ``synthetic[:...]``, ImageFolderSource for a
    class-per-folder tree (:func:`is_image_folder`), else a ShardSource (a `vitp prep` output)."""
    from pipeline.data import synthetic

    if synthetic.is_synthetic(path):
        return synthetic.SyntheticSource(path)
    if not path:
        raise DataError("data.path: empty; give a `vitp prep` output folder (or synthetic: for a smoke run)")
    if is_image_folder(path):  # imported only then: the loaders import torch, a command's checks do not
        from pipeline.data.imagefolder import ImageFolderSource

        return ImageFolderSource(path)
    from pipeline.data.loader import ShardSource

    return ShardSource(path)


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


def read_info(path: str) -> Info:
    return source_for(path).read_info()


def local_source(path: str) -> DataSource | None:
    """The source of ``data.path`` when it can be read here without the network and is there (a
    synthetic spec, a folder): planning and other estimates work without data; None otherwise."""
    spec = str(path).split(":", 1)[0] == "synthetic"  # synthetic.is_synthetic, without importing torch
    if not path or store.is_remote(path) or not (spec or os.path.exists(path)):
        return None
    src = source_for(path)
    try:
        src.split_sizes()
    except DataError:
        return None  # not (yet) a dataset: a prep that has not finished
    return src


def num_classes(data_cfg, model_classes: int = 0) -> int:
    """model.num_classes when set, else the dataset's."""
    return model_classes or read_info(data_cfg.path).num_classes


_HINTS = {
    "data.val_split": "re-run vitp prep with --val-fraction or set data.val_split= (no evaluation)",
    "data.train_split": "set data.train_split to one of those, or re-run vitp prep",
}


def check_splits(path: str | os.PathLike, splits: dict[str, str | None], *, minival_from: str | None = None) -> None:
    """Every split a run will read is in the dataset, before anything starts (submission, stage start).

    ``splits``: config key → split name, e.g. ``{"data.train_split": "train", "data.val_split": "val"}``;
    a None/empty name (no evaluation) is not read and not checked; ``minival`` is held out of the split
    ``minival_from`` when that is set (:func:`pipeline.data.minival.minival_source`). Reads only ``_info.json`` (or the
    synthetic spec). Raises DataError with one line naming the key, the file and what to do::

        data.val_split: 'val' not in SHARDS/_info.json (has: train); re-run vitp prep with --val-fraction ...
    """

    want = {k: (minival_from if v == MINIVAL and minival_from else v) for k, v in splits.items() if v}
    src = source_for(str(path))
    has, where = src.split_sizes(), src.where()
    for key, name in want.items():
        hint = _HINTS.get(key, "re-run vitp prep or pick another split")
        if name not in has:
            raise DataError(f"{key}: {name!r} not in {where} (has: {', '.join(has) or 'none'}); {hint}")
        if not has[name]:
            raise DataError(f"{key}: {name!r} in {where} is empty; {hint}")


def dataset_inputs(path: str, contexts: dict[str, str]) -> list[dict]:
    """What a run read, as MLflow dataset inputs: one per split (``contexts``: split -> "training" |
    "evaluation"; None or missing splits are left out). The folder is the source, prep's plan id (or a
    content hash) the digest, split/sample/class/shard counts the profile."""
    src = source_for(path)
    info, base, source = src.read_info(), src.dataset_name(), (src.kind, json.dumps(src.source_fields()))
    schema = json.dumps({"mlflow_colspec": [{"type": "binary", "name": "image", "required": True},
                                            {"type": "long", "name": "label", "required": True}]})
    out = []
    for split, context in contexts.items():
        if not split or split not in info.splits:
            continue
        sp = info.splits[split]
        profile = {"split": split, "num_samples": sp.num_samples, "num_classes": info.num_classes,
                   "num_shards": len(sp.urls)}
        if getattr(info, "decontaminated", None):  # every set checked: prep's and `vitp decontam`'s, with counts
            profile["decontaminated"] = info.decontaminated
        if getattr(info, "excluded", None):  # the summary of `vitp decontam`'s list (its sets are in the above)
            profile["excluded"] = info.excluded
        out.append({"name": f"{base}/{split}", "digest": info.digest, "source_type": source[0],
                    "source": source[1], "schema": schema, "profile": json.dumps(profile), "context": context})
    return out


__all__ = ["DataError", "DataSource", "EvalBatches", "Info", "SplitInfo", "TrainBatches", "dataset_inputs",
           "check_splits", "local_source", "minival_source", "num_classes", "stored_split", "read_info", "source_for"]
