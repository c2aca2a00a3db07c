"""The datasets stages read, behind one declared interface (source.py) that both sources implement:

    source = source_for(path)        a DataSource for ``data.path``, of the first kind that claims it
                                     (kinds.py, one line per kind): SyntheticSource (``synthetic:...``),
                                     ImageFolderSource (a class-per-folder tree) or ShardSource (a `vitp prep` folder)
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
from pipeline.data.kinds import KINDS, Kind, is_image_folder, kinds_help, source_for, synthetic_spec
from pipeline.data.minival import MINIVAL, minival_source, stored_split
from pipeline.data.shards import DataError, Info, SplitInfo
from pipeline.data.source import DataSource, EvalBatches, TrainBatches


def read_info(path: str) -> Info:
    return source_for(path).read_info()


def local_source(path: str) -> DataSource | None:
    """The source of ``data.path`` when it can be read here without the network and is there (a
    synthetic spec, a folder): planning and other estimates work without data; None otherwise."""
    spec = synthetic_spec(str(path))
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


__all__ = ["KINDS", "DataError", "DataSource", "EvalBatches", "Info", "Kind", "SplitInfo", "TrainBatches",
           "check_splits", "dataset_inputs", "is_image_folder", "kinds_help", "local_source", "minival_source",
           "num_classes", "read_info", "source_for", "stored_split", "synthetic_spec"]
