"""Minival (pipeline/data/minival.py): held out of training by a hash of each key, per class, the same
on every rank, worker and resume; fixed limits allotted by largest remainder from one hash order."""

from __future__ import annotations

import collections
import itertools
import json
import re

import numpy as np
import pytest

from pipeline.config import ConfigError, DataCfg, load_config
from pipeline.data import check_splits, minival_source
from pipeline.data.loader import DataError, EvalLoader, TrainLoader
from pipeline.data.minival import largest_remainder, select
from tests.unit.test_data_shards import label_of, write_dataset

SIZES = [7, 13, 9, 11]  # 40 training samples of 3 classes (14, 13, 13) in 4 uneven shards


@pytest.fixture
def dataset(tmp_path):
    keys = write_dataset(tmp_path, {"train": SIZES, "test": [6]})
    return tmp_path, keys


def cfg_of(path, **kw):
    return DataCfg.model_validate({"path": str(path), "workers": 0, "shuffle_buffer": 8, **kw})


def trained_keys(cfg, world=1, epochs=1, workers=0, **kw):
    """The keys each rank's training stream yields in ``epochs`` epochs (micro batches of 1)."""
    out = []
    for r in range(world):
        ld = TrainLoader(cfg, img_size=16, micro_batch=1, global_batch=world, rank=r, world_size=world, seed=1,
                         return_keys=True, num_workers=workers, **kw)
        out.append([k for _ in range(epochs) for _, _, ks in ld for k in ks])
    return out


def minival_keys(cfg, world=1):
    keys = []
    for r in range(world):
        ld = EvalLoader(cfg, img_size=16, batch=4, rank=r, world_size=world, split="minival", return_keys=True)
        keys += [k for _, _, m, ks in ld for k, ok in zip(ks, m.tolist()) if ok]
    return keys


def test_fraction_is_disjoint_stratified_and_the_same_everywhere(dataset):
    path, keys = dataset
    cfg = cfg_of(path, minival_fraction=0.2, minival_seed=5)
    mini = minival_keys(cfg)
    assert minival_keys(cfg, world=2) == mini  # two ranks' shares, in order, are the one rank's
    assert collections.Counter(label_of(k) for k in mini) == {0: 3, 1: 3, 2: 3}  # round(0.2 x 14|13|13)
    (one,) = trained_keys(cfg)
    assert len(one) == len(set(one)) == 31 and set(one) | set(mini) == set(keys["train"])
    two = trained_keys(cfg, world=2, workers=2)  # each rank (and loader worker) selects on its own
    assert set(two[0]).isdisjoint(two[1]) and len(two[0]) == len(two[1]) == 15
    assert set(two[0] + two[1]) <= set(one)
    # another seed holds out other samples, still 3 per class
    other = minival_keys(cfg_of(path, minival_fraction=0.2, minival_seed=6))
    assert other != mini and collections.Counter(label_of(k) for k in other) == {0: 3, 1: 3, 2: 3}


def test_at_least_one_per_class():
    keys = [f"k{i}" for i in range(30)]
    labels = [0] * 27 + [1, 2, 2]  # 0.02 of a class of 1 or 2 rounds to 0: still one each
    sel = select(keys, labels, 4, fraction=0.02)
    assert collections.Counter(labels[i] for i in sel.minival) == {0: 1, 1: 1, 2: 1}
    assert set(sel.train).isdisjoint(sel.minival) and len(sel.train) + len(sel.minival) == 30


def test_resume_mid_epoch_continues_on_the_same_samples(dataset):
    path, _ = dataset
    cfg = cfg_of(path, minival_fraction=0.2)
    args = dict(img_size=16, micro_batch=2, global_batch=2, rank=0, world_size=1, seed=1, return_keys=True)
    ref = [ks for _, _, ks in itertools.islice(TrainLoader(cfg, **args).forever(), 25)]
    first = TrainLoader(cfg, **args)
    got = [ks for _, _, ks in itertools.islice(first.forever(), 9)]
    again = TrainLoader(cfg, **args)
    again.load_state_dict(first.state_dict())
    got += [ks for _, _, ks in itertools.islice(again.forever(), 16)]  # into the second epoch
    assert got == ref
    assert not {k for ks in got for k in ks} & set(minival_keys(cfg))


def test_largest_remainder():
    assert largest_remainder(200, [397] + [0] * 3).tolist() == [200, 0, 0, 0]
    assert largest_remainder(10, [1, 1, 1]).tolist() == [4, 3, 3]  # ties: the lower class
    assert largest_remainder(7, [5, 3, 2]).tolist() == [4, 2, 1]  # 3.5, 2.1, 1.4 -> floors 3,2,1 + 1 to .5
    got = largest_remainder(200, np.full(397, 3))  # more classes than examples: some get none
    assert got.sum() == 200 and set(got.tolist()) == {0, 1}


def test_limits_come_from_one_hash_order():
    rng = np.random.default_rng(0)
    keys = [f"img{i:04d}" for i in range(600)]
    labels = rng.choice(7, size=600, p=[0.3, 0.2, 0.2, 0.1, 0.1, 0.05, 0.05]).tolist()
    sizes = np.bincount(labels, minlength=7)
    grid = select(keys, labels, 7, train_limit=80, minival_limit=20, seed=3)
    final = select(keys, labels, 7, train_limit=100, minival_limit=0, seed=3)
    assert (len(grid.train), len(grid.minival), len(final.train), len(final.minival)) == (80, 20, 100, 0)
    assert set(grid.train).isdisjoint(grid.minival) and set(final.train) == set(grid.train) | set(grid.minival)
    used = largest_remainder(100, sizes)
    assert np.bincount([labels[i] for i in final.train], minlength=7).tolist() == used.tolist()
    assert np.bincount([labels[i] for i in grid.minival], minlength=7).tolist() == largest_remainder(20, used).tolist()
    asked = r"data.train_limit \+ data.minival_limit: 700 examples asked of S, which has 600"
    with pytest.raises(DataError, match=asked):
        select(keys, labels, 7, train_limit=600, minival_limit=100, where="S")


def test_limits_in_the_loaders(dataset):
    path, keys = dataset
    grid = cfg_of(path, train_limit=16, minival_limit=8)
    mini = minival_keys(grid)
    (train,) = trained_keys(grid)
    (final,) = trained_keys(cfg_of(path, train_limit=24))
    assert len(mini) == 8 and len(train) == 16 and set(final) == set(train) | set(mini)
    with pytest.raises(DataError, match="data.train_limit: 41 examples asked of split 'train' of .* which has 40"):
        TrainLoader(cfg_of(path, train_limit=41), img_size=16, micro_batch=1, global_batch=1, rank=0, world_size=1)


def test_minival_split_checks_and_config_errors(dataset, tmp_path):
    path, _ = dataset
    check_splits(path, {"data.val_split": "minival"}, minival_from="train")
    with pytest.raises(DataError, match="data.val_split: 'minival' not in .*_info.json \\(has: train, test\\)"):
        check_splits(path, {"data.val_split": "minival"})
    with pytest.raises(ConfigError, match="data.minival_fraction: set it or data.train_limit"):
        load_config("configs/transfer/tiny_cpu.yaml", ["data.minival_fraction=0.1", "data.train_limit=5"])
    with pytest.raises(ConfigError, match="data.minival_limit: needs data.train_limit"):
        load_config("configs/transfer/tiny_cpu.yaml", ["data.minival_limit=5"])
    with pytest.raises(ConfigError, match="data.minival_fraction"):
        load_config("configs/transfer/tiny_cpu.yaml", ["data.minival_fraction=1.5"])


def test_vitp_eval_reads_split_minival(dataset, tmp_path, capsys):
    """`vitp eval --split minival data.minival_fraction=...` scores exactly the held-out samples."""
    from launch.cli import main
    from pipeline.model import build_vit
    from pipeline.weights import save_model

    path, _ = dataset
    model = build_vit(width=32, depth=1, heads=2, mlp_dim=64, patch=4, img_size=16, num_classes=3)
    save_model(model, tmp_path / "m.safetensors")
    argv = ["eval", "--checkpoint", str(tmp_path / "m.safetensors"), "--data", str(path), "--split", "minival",
            "--out", str(tmp_path / "ev"), "--batch", "4", "data.minival_fraction=0.2", "data.workers=0"]
    assert main(argv) == 0
    res = json.loads((tmp_path / "ev" / "results.json").read_text())
    assert res["eval/minival/n"] == 9  # 3 of each class
    assert main(argv[:-2]) == 2  # without the data section's minival there is no split minival
    assert "'minival'" in capsys.readouterr().err
    # the data layer answers whether data.path's kind can hold a minival out: before a stage or a job starts
    line = ("data.minival_fraction: a minival is held out of a `vitp prep` dataset's train split, "
            "not of 'synthetic:train=64'")
    cfg = load_config("configs/transfer/tiny_cpu.yaml", ["data.minival_fraction=0.1", "data.path=synthetic:train=64"])
    with pytest.raises(DataError, match=f"^{re.escape(line)}$"):
        minival_source(cfg.data)
    from launch.submit import SubmitError, check_data

    with pytest.raises(SubmitError, match=f"^{re.escape(line)}$"):
        check_data(cfg, "transfer")
    capsys.readouterr()
    assert main([*argv[:4], "synthetic:train=64", *argv[5:]]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"error: {line}"
