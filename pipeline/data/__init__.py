"""The datasets stages read, behind one interface that both sources implement:

    source_for(path)           the module for ``data.path``: loader (a `vitp prep` folder) or synthetic
    module.read_info(path)     -> Info (classes, splits with sample counts)
    module.TrainLoader(...)    endless micro batches (uint8 [B, 3, H, W], labels), resumable state
    module.EvalLoader(...)     each sample once over all ranks: (uint8 images, labels, valid mask)
    module.normalize(x)        uint8 on the device -> the model's input range

shards.py reads tars and ``_info.json`` (its only parser); loader.py decodes and batches them;
augment.py holds the image transforms; synthetic.py is an in-memory set for tests and smoke runs.
"""

from __future__ import annotations

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


__all__ = ["DataError", "Info", "SplitInfo", "num_classes", "read_info", "source_for"]
