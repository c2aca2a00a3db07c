"""A plain class-per-folder tree read as it is, without `vitp prep`: :class:`ImageFolderSource`.

    ROOT/train/<class>/<image>      the layout torchvision's ImageFolder and timm's folder reader take;
    ROOT/val/<class>/<image>        any of train/, val/, test/ may be missing; ROOT is a folder or an
    ROOT/test/<class>/<image>       s3://, gs://, https:// prefix (listed once through data_prep.store)

Classes are the sorted union of the class folder names over the splits (so a class missing from val
keeps its index); a split's samples are ordered by (class, path). Downstream sets are small, so images
are read and decoded in the process that trains (no loader workers).

Training batches follow one global order, as :mod:`pipeline.data.synthetic`'s do: optimizer step ``s``
takes positions ``[s*G, (s+1)*G)`` of the epoch-wise permuted split (seed, epoch); micro batch ``m`` of
rank ``r`` is the slice at ``(m*world + r)*micro``; sample ``i``'s augmentation is seeded by (seed,
position). The loader's state is a step count, so a resume mid-epoch repeats exactly the batches the
saved run would have made, on any world size and micro batch that keep the global batch.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import warnings

import numpy as np

from data_prep import store
from data_prep.schema import IMAGE_EXTS, INFO_FILE
from pipeline.config.batch import BatchLayout
from pipeline.data.augment import EvalTransform, TrainTransform, augment_batch, eval_batch, normalize, sample_seed
from pipeline.data.minival import MINIVAL, active, select, stored_split
from pipeline.data.shards import DataError, Info, SplitInfo
from pipeline.data.source import ClassLoaders, DataSource

SPLITS = ("train", "val", "test")


@functools.lru_cache(maxsize=8)
def _listing(path: str) -> tuple[tuple[str, int], ...]:
    """(path relative to ROOT, size) of every file under ROOT, sorted; one listing per process."""
    fs, root = store.filesystem(path)
    root = root.rstrip("/")
    try:
        found = fs.find(root, detail=True)
    except FileNotFoundError:
        found = {}
    return tuple(sorted((name[len(root) + 1:], int(d.get("size") or 0)) for name, d in found.items()
                        if d.get("type", "file") == "file"))


@functools.lru_cache(maxsize=8)
def _tree(path: str) -> tuple[tuple[str, ...], dict[str, tuple[tuple[str, int], ...]], str]:
    """(classes, {split: ((relative path, label), ...)}, digest) of the tree; DataError naming the
    folder when it is not a class-per-folder tree."""
    where = store.public(path)
    files = _listing(path)
    by_split: dict[str, list[tuple[str, str]]] = {}
    for rel, _ in files:
        parts = rel.split("/")
        if parts[0] not in SPLITS or rel.rsplit(".", 1)[-1].lower() not in IMAGE_EXTS:
            continue
        if len(parts) < 3:
            raise DataError(f"data.path: {where}/{parts[0]}: image {parts[1]!r} directly in the split folder; an "
                            f"image folder holds {parts[0]}/<class>/<image>")
        by_split.setdefault(parts[0], []).append((parts[1], rel))
    if not by_split:
        raise DataError(f"data.path: {where}: no images under train/, val/ or test/ class folders, and no "
                        f"{INFO_FILE} (neither an image folder nor a `vitp prep` output)")
    classes = tuple(sorted({c for items in by_split.values() for c, _ in items}))
    index = {c: i for i, c in enumerate(classes)}
    splits = {s: tuple((rel, index[c]) for c, rel in sorted(items)) for s, items in by_split.items()}
    digest = hashlib.sha256(json.dumps(files).encode()).hexdigest()[:16]
    return classes, splits, digest


def read_info(path: str) -> Info:
    """The description a `vitp prep` folder gives, from the listing (no shard files: ``urls`` empty)."""
    classes, splits, digest = _tree(str(path))
    return Info(str(path), len(classes), classes,
                {s: SplitInfo(s, len(items), (), ()) for s, items in splits.items()}, digest)


def _samples(path: str, split: str) -> tuple[tuple[str, int], ...]:
    return _tree(str(path))[1].get(split, ())


def _read(path: str, items) -> list[tuple[str, bytes, int]]:
    """[(relative path, label)] → [(key, bytes, label)]; a file that cannot be read is one line."""
    out = []
    for rel, label in items:
        try:
            out.append((rel, store.read_bytes(store.join(path, rel)), label))
        except OSError as e:
            raise DataError(f"data.path: {store.public(store.join(path, rel))}: {store.reason(e)}") from None
    return out


def _positions(cfg_data, info: Info, split: str, training: bool) -> list[int] | None:
    """Positions of ``split`` a stream reads when the data section holds a minival out of it
    (:mod:`pipeline.data.minival`, keyed by relative path); None: all of it."""
    if not active(cfg_data) or stored_split(cfg_data, split) != cfg_data.train_split:
        return None
    if not training and split != MINIVAL:
        return None
    items = _samples(info.path, cfg_data.train_split)
    sel = select([r for r, _ in items], [lab for _, lab in items], info.num_classes,
                 fraction=cfg_data.minival_fraction, seed=cfg_data.minival_seed, train_limit=cfg_data.train_limit,
                 minival_limit=cfg_data.minival_limit,
                 where=f"split {cfg_data.train_split!r} of {store.public(info.path)}")
    return list(sel.train if training else sel.minival)


class TrainLoader:
    """Endless micro batches ``(uint8 [micro, 3, S, S], int64 [micro])`` for this rank."""

    def __init__(self, cfg_data, *, img_size: int, micro_batch: int, global_batch: int, rank: int = 0,
                 world_size: int = 1, seed: int = 0, pin_memory: bool = False):
        layout = BatchLayout(global_batch, micro_batch, world_size)
        self.path, self.seed, self.pin_memory = cfg_data.path, int(seed), pin_memory
        info = read_info(cfg_data.path)
        every = _samples(cfg_data.path, info.split(cfg_data.train_split).name)
        keep = _positions(cfg_data, info, cfg_data.train_split, training=True)
        self.items = every if keep is None else tuple(every[i] for i in keep)
        if not self.items:
            raise DataError(f"data.minival_fraction: leaves nothing of split {cfg_data.train_split!r} of "
                            f"{store.public(cfg_data.path)} to train on")
        self.micro, self.global_batch, self.rank, self.world = micro_batch, global_batch, rank, world_size
        self.accum = layout.accumulation
        self.steps_per_epoch = max(1, len(self.items) // global_batch)
        self.transform = TrainTransform(img_size, cfg_data.crop_scale, cfg_data.hflip, cfg_data.randaugment,
                                        random_crop=cfg_data.random_crop)
        self._micro_done = 0  # micro batches yielded by this rank
        self._perm_epoch, self._perm = -1, None

    def _order(self, epoch: int) -> np.ndarray:
        if epoch != self._perm_epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(len(self.items))
            self._perm_epoch = epoch
        return self._perm

    def _batch(self, k: int):
        """Micro batch ``k`` of this rank → (images, labels)."""
        step, m = divmod(k, self.accum)
        start = step * self.global_batch + (m * self.world + self.rank) * self.micro
        n = len(self.items)
        pos = list(range(start, start + self.micro))
        raw = _read(self.path, [self.items[int(self._order(p // n)[p % n])] for p in pos])

        def undecodable(key, err):
            warnings.warn(f"sample {key}: {err}; replaced by another of its batch", stacklevel=2)

        out = augment_batch(raw, self.transform, [sample_seed(self.seed, p) for p in pos],
                            lambda j: sample_seed(self.seed, pos[j], 1), undecodable)
        if out is None:
            raise DataError(f"data.path: {store.public(self.path)}: no image of a batch decodes ({raw[0][0]}, ...)")
        return out[0], out[1]

    def forever(self):
        """Micro batches without end (the order already crosses epochs)."""
        while True:
            x, y = self._batch(self._micro_done)
            self._micro_done += 1
            yield (x.pin_memory(), y.pin_memory()) if self.pin_memory else (x, y)

    @property
    def position(self) -> tuple[int, int]:
        """(epoch, micro batch within it) of the batch last yielded, epochs of ``steps_per_epoch`` steps."""
        return divmod(max(self._micro_done - 1, 0), self.steps_per_epoch * self.accum)

    @property
    def skipped(self) -> dict[str, int]:
        return {}

    def read_stats(self) -> dict:
        return {}

    def state_dict(self) -> dict:
        """Position in optimizer steps (independent of world size and micro batch); at a step boundary."""
        return {"steps": self._micro_done // self.accum, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        self.seed = int(state.get("seed", self.seed))
        self._micro_done = int(state["steps"]) * self.accum


class EvalLoader:
    """Every sample of a split once over the ranks (rank r: the contiguous slice ``[r·N/W, (r+1)·N/W)``)
    as ``len()`` batches ``(uint8 [B, 3, S, S], int64 [B], valid bool [B])``, the same count on every rank."""

    def __init__(self, cfg_data, *, img_size: int, batch: int, rank: int = 0, world_size: int = 1,
                 split: str | None = None, positions=None, num_workers: int | None = None):
        name = split or cfg_data.val_split
        if not name:
            raise DataError("data.val_split: not set; no split to evaluate")
        self.path, self.batch = cfg_data.path, int(batch)
        info = read_info(cfg_data.path)
        held = _positions(cfg_data, info, name, training=False)
        stored = stored_split(cfg_data, name) if held is not None else name
        every = _samples(cfg_data.path, info.split(stored).name)
        if held is not None:
            positions = held if positions is None else [held[i] for i in positions]
        positions = list(range(len(every)) if positions is None else positions)
        self.items = every
        n = self.num_samples = len(positions)
        self.rank_positions = positions[rank * n // world_size:(rank + 1) * n // world_size]
        self.num_batches = math.ceil(math.ceil(n / world_size) / self.batch)
        self.transform = EvalTransform(img_size, cfg_data.eval_crop_pct)

    def __len__(self) -> int:
        return self.num_batches

    def __iter__(self):
        def undecodable(key, err):
            warnings.warn(f"sample {key}: {err}; not evaluated", stacklevel=2)

        for b in range(self.num_batches):
            pos = self.rank_positions[b * self.batch:(b + 1) * self.batch]
            raw = _read(self.path, [self.items[p] for p in pos])
            yield eval_batch(raw, self.transform, self.batch, undecodable)[:3]


class ImageFolderSource(ClassLoaders, DataSource):
    """A class-per-folder tree (see the module docstring) as a :class:`~pipeline.data.source.DataSource`."""

    kind = "imagefolder"
    normalize = staticmethod(normalize)

    train_loader_class, eval_loader_class = TrainLoader, EvalLoader
    info_reader = staticmethod(read_info)

    def split_labels(self, split: str, rank: int, world_size: int) -> dict[int, list]:
        return {0: [label for _, label in _samples(self.path, split)]} if rank == 0 else {}

    def dataset_name(self) -> str:
        return os.path.basename(os.path.normpath(store.public(self.path).split("://", 1)[-1]))

    def source_fields(self) -> dict:
        return {"uri": store.public(self.path) if store.is_remote(self.path) else os.path.abspath(self.path)}
