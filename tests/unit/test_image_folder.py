"""ImageFolderSource: a class-per-folder tree read without `vitp prep`, locally and from S3 (moto on
loopback): its description, a deterministic order, batches that do not depend on the rank layout, an
exact mid-epoch resume, each sample evaluated once, a minival, and a bad tree refused in one line."""

from __future__ import annotations

import shutil
from pathlib import Path

import fsspec
import numpy as np
import pytest
import torch

from pipeline.config import DataCfg
from pipeline.data import DataError, check_splits, source_for
from pipeline.data.imagefolder import ImageFolderSource
from tests.data_prep_fixtures import jpeg_bytes, natural_image

CLASSES = ("ant", "bee", "cat")


def make_tree(root: Path, n_train: int = 8, n_val: int = 3, n_test: int = 2) -> Path:
    """root/{train,val,test}/<class>/<i>.jpg, 20-36 px noisy JPEGs; val has no 'cat' (its index stays)."""
    rng = np.random.default_rng(0)
    for split, n in (("train", n_train), ("val", n_val), ("test", n_test)):
        for c in CLASSES if split != "val" else CLASSES[:2]:
            (root / split / c).mkdir(parents=True, exist_ok=True)
            for i in range(n):
                img = natural_image(rng, int(rng.integers(20, 36)), int(rng.integers(20, 36)))
                (root / split / c / f"{i:02d}.jpg").write_bytes(jpeg_bytes(img))
    return root


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    return make_tree(tmp_path_factory.mktemp("folder") / "pets")


def data_cfg(path, **kw) -> DataCfg:
    return DataCfg(path=str(path), workers=0, crop_scale=[0.5, 1.0], **kw)


def train_batches(path, steps: int, *, micro: int, world: int, rank: int, state=None, seed: int = 3):
    src = source_for(str(path))
    loader = src.train_loader(data_cfg(path), img_size=16, micro_batch=micro, global_batch=8, rank=rank,
                              world_size=world, seed=seed)
    if state is not None:
        loader.load_state_dict(state)
    it = loader.forever()
    out = [next(it) for _ in range(steps * loader.accum)]
    return out, loader


def test_description_and_order(tree):
    src = source_for(str(tree))
    assert isinstance(src, ImageFolderSource) and src.kind == "imagefolder"
    info = src.read_info()
    assert info.classes == CLASSES and info.num_classes == 3
    assert {k: sp.num_samples for k, sp in info.splits.items()} == {"train": 24, "val": 6, "test": 6}
    assert src.split_sizes() == {"train": 24, "val": 6, "test": 6}
    # labels in (class, file) order, the same in every process: the few-shot evaluator reads them so
    assert src.split_labels("train", 0, 2) == {0: [0] * 8 + [1] * 8 + [2] * 8}
    assert src.split_labels("val", 0, 1) == {0: [0] * 3 + [1] * 3} and src.split_labels("val", 1, 2) == {}
    assert len(info.digest) == 16 and info.digest == source_for(str(tree)).read_info().digest
    assert src.dataset_name() == "pets" and src.shard_addresses("train") == []
    check_splits(tree, {"data.train_split": "train", "data.val_split": "test"})
    with pytest.raises(DataError, match=r"^data.val_split: 'dev' not in .*pets \(has: test, train, val\)"):
        check_splits(tree, {"data.val_split": "dev"})


def test_batches_do_not_depend_on_the_rank_layout_and_resume_exactly(tree):
    """Global batch 8: one rank x micro 8 sees, step by step, the samples 2 ranks x micro 2 (2 accumulation
    steps) see together, the same pixels; a loader restored from step 2's state (mid-epoch: 3 steps an
    epoch) continues bit-exactly, into the next epoch."""
    one, _ = train_batches(tree, 5, micro=8, world=1, rank=0)
    two = [train_batches(tree, 5, micro=2, world=2, rank=r)[0] for r in (0, 1)]
    for s in range(5):
        # step s: micro m of rank r is the slice at (m * world + r) * micro of the step's 8 samples
        rows = [two[r][s * 2 + m] for m in range(2) for r in range(2)]
        assert torch.equal(torch.cat([x for x, _ in rows]), one[s][0])
        assert torch.equal(torch.cat([y for _, y in rows]), one[s][1])
    assert sorted(torch.cat([y for _, y in one[:3]]).tolist()) == [0] * 8 + [1] * 8 + [2] * 8  # one epoch
    assert not torch.equal(one[0][0], one[3][0])  # epoch 1 is another permutation
    _, loader = train_batches(tree, 2, micro=2, world=2, rank=1)
    state = loader.state_dict()
    assert state == {"steps": 2, "seed": 3}
    resumed, _ = train_batches(tree, 3, micro=4, world=1, rank=0, state=state, seed=99)  # another layout
    for s in range(3):
        assert torch.equal(torch.cat([x for x, _ in resumed[s * 2:s * 2 + 2]]), one[2 + s][0])
    _, loader = train_batches(tree, 1, micro=2, world=2, rank=0)
    assert loader.position == (0, 1)


def test_each_sample_evaluated_once_over_the_ranks(tree):
    src = source_for(str(tree))
    cfg = data_cfg(tree, val_split="val")
    seen = []
    for rank in range(4):
        ev = src.eval_loader(cfg, img_size=16, batch=1, rank=rank, world_size=4, split="val")
        assert len(ev) == 2 and ev.num_samples == 6  # ceil(6 / 4) rows, padded on ranks with one
        for x, y, valid in ev:
            assert x.shape == (1, 3, 16, 16) and x.dtype == torch.uint8
            seen += y[valid].tolist()
    assert sorted(seen) == [0, 0, 0, 1, 1, 1]
    part = src.eval_loader(cfg, img_size=16, batch=4, rank=0, world_size=1, split="train", positions=[0, 9, 23])
    assert [y[v].tolist() for _, y, v in part] == [[0, 1, 2]]


def test_minival_held_out_of_the_folder(tree):
    cfg = data_cfg(tree, minival_fraction=0.25)
    src = source_for(str(tree))
    mini = src.eval_loader(cfg, img_size=16, batch=8, rank=0, world_size=1, split="minival")
    assert mini.num_samples == 6  # 2 of each class's 8
    train = src.train_loader(cfg, img_size=16, micro_batch=2, global_batch=2, rank=0, world_size=1, seed=0)
    held = {mini.items[p] for p in mini.rank_positions}
    assert len(train.items) == 18 and len(held) == 6 and not held & set(train.items)
    assert sorted(label for _, label in held) == [0, 0, 1, 1, 2, 2]


@pytest.mark.parametrize("layout,message", [
    ({"train/a.jpg": 1}, r"^data.path: .*/bad/train: image 'a.jpg' directly in the split folder; an image folder "
                         r"holds train/<class>/<image>$"),
    ({"training/cat/a.jpg": 1}, r"^data.path: .*/bad: no images under train/, val/ or test/ class folders, and no "
                                r"_info.json \(neither an image folder nor a `vitp prep` output\)$"),
    ({"train/cat/notes.txt": 1}, r"^data.path: .*/bad: no images under train/"),
])
def test_a_bad_tree_is_one_line_naming_the_folder(tmp_path, layout, message):
    for rel in layout:
        (tmp_path / "bad" / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "bad" / rel).write_bytes(jpeg_bytes(natural_image(np.random.default_rng(0), 8, 8)))
    with pytest.raises(DataError, match=message):
        check_splits(tmp_path / "bad", {"data.train_split": "train"})


def test_a_prep_output_is_still_read_as_shards(corpus_shards, tmp_path):
    assert type(source_for(str(corpus_shards))).__name__ == "ShardSource"
    (tmp_path / "unfinished/_plan").mkdir(parents=True)  # prep's plan pieces, no _info.json yet
    with pytest.raises(DataError, match=r"_info.json: not found \(is data.path a `vitp prep` output folder, and did "):
        check_splits(tmp_path / "unfinished", {"data.train_split": "train"})


def test_an_s3_folder_reads_as_the_local_one(tree, s3_bucket, tmp_path):
    """The same tree under an S3 prefix (moto on loopback): the same description and the same pixels."""
    fs = fsspec.filesystem("s3")
    local = shutil.copytree(tree, tmp_path / "pets")
    fs.put(str(local), f"{s3_bucket[5:]}/pets", recursive=True)
    remote = f"{s3_bucket}/pets"
    src = source_for(remote)
    assert isinstance(src, ImageFolderSource)
    src.check_reachable("data.path")
    assert src.read_info().splits.keys() == source_for(str(tree)).read_info().splits.keys()
    assert src.read_info().classes == CLASSES
    a, _ = train_batches(remote, 1, micro=8, world=1, rank=0)
    b, _ = train_batches(tree, 1, micro=8, world=1, rank=0)
    assert torch.equal(a[0][0], b[0][0]) and torch.equal(a[0][1], b[0][1])
    with pytest.raises(Exception, match=rf"^data.path: {s3_bucket}/nothing"):
        source_for(f"{s3_bucket}/nothing").check_reachable("data.path")
