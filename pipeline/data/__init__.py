"""The datasets stages read, behind one interface that both sources implement:

    source_for(path)           the module for ``data.path``: loader (a `vitp prep` folder) or synthetic
    module.read_info(path)     -> Info (classes, splits with sample counts)
    module.TrainLoader(...)    endless micro batches (uint8 [B, 3, H, W], labels), resumable state
    module.EvalLoader(...)     each sample once over all ranks: (uint8 images, labels, valid mask)
    module.normalize(x)        uint8 on the device -> the model's input range

shards.py reads tars and ``_info.json`` (with data_prep.tar and .schema); loader.py decodes and batches them;
augment.py holds the image transforms; synthetic.py is an in-memory set for tests and smoke runs.
"""

from __future__ import annotations

import json
import os

from pipeline.data.shards import DataError, Info, SplitInfo


def source_for(path: str):
    """pipeline.data.synthetic for ``synthetic:...``, else the shard loader pipeline.data.loader."""
    from pipeline.data import synthetic

    if synthetic.is_synthetic(path):
        return synthetic
    if not path:
        raise DataError("data.path: empty; give a `vitp prep` output folder (or synthetic: for a smoke run)")
    from pipeline.data import loader

    return loader


def read_info(path: str) -> Info:
    return source_for(path).read_info(path)


def num_classes(data_cfg, model_classes: int = 0) -> int:
    """model.num_classes when set, else the dataset's."""
    return model_classes or read_info(data_cfg.path).num_classes


def dataset_inputs(path: str, contexts: dict[str, str]) -> list[dict]:
    """What a run read, as MLflow dataset inputs: one per split (``contexts``: split -> "training" |
    "evaluation"; None or missing splits are left out). The folder is the source, prep's plan id (or a
    content hash) the digest, split/sample/class/shard counts the profile."""
    from pipeline.data import synthetic

    info = read_info(path)
    if synthetic.is_synthetic(path):
        base, source = "synthetic", ("synthetic", json.dumps({"spec": str(path)}))
    else:
        base = os.path.basename(os.path.normpath(str(path)))
        source = ("local", json.dumps({"uri": os.path.abspath(path)}))
    schema = json.dumps({"mlflow_colspec": [{"type": "binary", "name": "image", "required": True},
                                            {"type": "long", "name": "label", "required": True}]})
    out = []
    for split, context in contexts.items():
        if not split or split not in info.splits:
            continue
        sp = info.splits[split]
        profile = {"split": split, "num_samples": sp.num_samples, "num_classes": info.num_classes,
                   "num_shards": len(sp.urls)}
        out.append({"name": f"{base}/{split}", "digest": info.digest, "source_type": source[0],
                    "source": source[1], "schema": schema, "profile": json.dumps(profile), "context": context})
    return out


__all__ = ["DataError", "Info", "SplitInfo", "dataset_inputs", "num_classes", "read_info", "source_for"]
