"""The declared data source (pipeline.data.source): both kinds behind one interface, the stream spec."""

from __future__ import annotations

import dataclasses
import itertools
import json
import pickle

import pytest
import torch

from pipeline.config import DataCfg
from pipeline.data import DataError, DataSource, EvalBatches, TrainBatches, dataset_inputs, source_for
from pipeline.data.loader import ShardSource, StreamSpec, TrainLoader
from pipeline.data.synthetic import SyntheticSource
from tests.unit.test_data_shards import write_dataset

KW = dict(img_size=16, micro_batch=2, global_batch=4, rank=1, world_size=2, seed=7)


@pytest.fixture
def shards(tmp_path):
    write_dataset(tmp_path / "pets", {"train": [5, 7], "val": [3]})
    return str(tmp_path / "pets")


@pytest.mark.parametrize("kind", ["shards", "synthetic"])
def test_both_sources_give_the_declared_interface(kind, shards):
    path = shards if kind == "shards" else "synthetic:classes=3,train=12,val=3"
    src = source_for(path)
    assert isinstance(src, DataSource) and type(src) is (ShardSource if kind == "shards" else SyntheticSource)
    info = src.read_info()
    assert info is src.read_info() and info.num_classes == 3 and info.splits["val"].num_samples == 3
    cfg = DataCfg(path=path, workers=0, shuffle_buffer=4)
    train = src.train_loader(cfg, **KW)
    assert isinstance(train, TrainBatches) and train.steps_per_epoch == 3
    it = train.forever()
    for k in range(7):  # 1 micro batch a step, 3 steps an epoch: the 4th is epoch 1's first, the 7th epoch 2's
        images, labels = next(it)
        assert images.dtype == torch.uint8 and images.shape == (2, 3, 16, 16) and labels.shape == (2,)
        assert train.position == divmod(k, 3)
    assert dict(train.skipped) == {}  # nothing bad in these samples (synthetic ones never are)
    ev = src.eval_loader(cfg, img_size=16, batch=2, rank=1, world_size=2, split="val")
    assert isinstance(ev, EvalBatches) and len(ev) == 1
    (x, y, valid), = list(ev)
    assert x.shape == (2, 3, 16, 16) and int(valid.sum()) == (2 if kind == "shards" else 1)  # [1, 3) or 1::2
    n = src.normalize(torch.tensor([0, 255], dtype=torch.uint8).view(2, 1, 1, 1).expand(2, 3, 1, 1))
    assert n.flatten().tolist() == [-1.0] * 3 + [1.0] * 3


@pytest.mark.parametrize("kind", ["shards", "synthetic"])
def test_split_labels_over_the_ranks_are_the_eval_loaders_labels(kind, shards):
    """A few-shot evaluator's label scan (no image decoded) gives every position's label, in the order
    the eval loader reads them, and a subset of positions reads exactly those samples."""
    path = shards if kind == "shards" else "synthetic:classes=3,train=12,val=3"
    src, cfg = source_for(path), DataCfg(path=path, workers=0)
    parts = {}
    for rank in range(2):
        parts.update(src.split_labels("train", rank, 2))
    labels = [y for p in sorted(parts) for y in parts[p]]
    read = [y for _x, ys, ok in src.eval_loader(cfg, img_size=16, batch=4, rank=0, world_size=1, split="train")
            for y in ys[ok].tolist()]
    assert labels == read and len(labels) == 12
    some = [1, 4, 5, 11]
    got = [y for _x, ys, ok in src.eval_loader(cfg, img_size=16, batch=4, rank=0, world_size=1, split="train",
                                               positions=some) for y in ys[ok].tolist()]
    assert got == [labels[p] for p in some]


def test_position_resumes_with_the_loader(shards):
    cfg = DataCfg(path=shards, workers=0, shuffle_buffer=4)
    a = TrainLoader(cfg, **KW)
    it = a.forever()
    next(it), next(it), next(it)
    state = a.state_dict()
    after = [(next(it)[1].tolist(), a.position) for _ in range(4)]
    b = TrainLoader(cfg, **KW)
    b.load_state_dict(state)
    jt = b.forever()
    assert [(next(jt)[1].tolist(), b.position) for _ in range(4)] == after
    assert [p for _, p in after] == [(1, 0), (1, 1), (1, 2), (2, 0)]


def test_stream_spec_is_frozen_and_travels_to_workers(shards):
    ld = TrainLoader(DataCfg(path=shards, workers=0, crop_scale=[0.3, 1.0]), **KW)
    spec = ld.stream_spec()
    assert isinstance(spec, StreamSpec) and pickle.loads(pickle.dumps(spec)) == spec
    assert (spec.seed, spec.rank, spec.micro_batch, spec.micro_batches, spec.crop_scale) == (7, 1, 2, 3, (0.3, 1.0))
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.seed = 1
    # the two ranks' streams cut one epoch of 12 samples into back-to-back ranges
    assert [dataclasses.replace(spec, rank=r).quota_start(0, 1) for r in (0, 1)] == [0, 6]
    assert [spec.quota_start(s, 4) for s in range(4)] == [6, 8, 10, 12]  # 1, 1, 1, 0 batches each


def test_dataset_inputs_name_each_source(shards):
    local = dataset_inputs(shards, {"train": "training", "val": "evaluation", None: "x"})
    assert [(d["name"], d["source_type"], d["context"]) for d in local] == [
        ("pets/train", "local", "training"), ("pets/val", "local", "evaluation")]
    assert json.loads(local[0]["source"]) == {"uri": shards}
    syn = dataset_inputs("synthetic:val=4", {"val": "evaluation"})
    assert [(d["name"], d["source_type"], json.loads(d["source"])) for d in syn] == [
        ("synthetic/val", "synthetic", {"spec": "synthetic:val=4"})]
    assert json.loads(syn[0]["profile"])["num_samples"] == 4
    with pytest.raises(DataError, match="^data.path: empty"):
        source_for("")


def test_a_source_must_implement_every_part():
    class Half(DataSource):
        def _read_info(self):
            raise AssertionError

    with pytest.raises(TypeError, match="abstract"):
        Half("x")
    assert list(itertools.chain(*(getattr(DataSource, m).__isabstractmethod__ and [m] or []
                                  for m in ("train_loader", "eval_loader", "normalize")))) == [
        "train_loader", "eval_loader", "normalize"]


class _Memo(SyntheticSource):
    """A kind this test adds: its module (here) and one line in pipeline.data.kinds.KINDS."""

    kind = "memo"

    def __init__(self, path):
        super().__init__("synthetic:classes=2,train=4,val=2")


def test_a_new_kind_is_its_module_and_one_line(monkeypatch):
    """source_for dispatches on KINDS and `vitp eval --data`'s help lists each kind's phrase from there."""
    import argparse

    from launch.stages import add_eval_args
    from pipeline.data import kinds

    memo = kinds.Kind(lambda p: p.startswith("memo:"), f"{_Memo.__module__}:_Memo", "memo:NAME (this test's kind)")
    monkeypatch.setattr(kinds, "KINDS", (memo, *kinds.KINDS))
    assert type(source_for("memo:x")) is _Memo and type(source_for("synthetic:train=4")) is SyntheticSource
    assert source_for("memo:x").read_info().num_classes == 2
    p = argparse.ArgumentParser()
    add_eval_args(p)
    shown = " ".join(next(a.help for a in p._actions if a.dest == "data").split())
    assert shown == ("memo:NAME (this test's kind), synthetic[:train=N,...] (generated, for tests), a class-per-folder "
                     "tree (train/ val/ test/) or a `vitp prep` output; a folder, s3://, gs:// or https:// address")
