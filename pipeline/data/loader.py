"""Shards → batches: the streaming WebDataset loader for training and evaluation.

A dataset is a `vitp prep` folder: ``_info.json`` (timm's WDS reader layout: splits → filenames,
shard_lengths, num_samples; num_classes; classes) and tars whose samples are ``<key>.cls`` (label
text), ``<key>.jpg|png|webp`` and ``<key>.json``. A multi-label dataset (``"multi_label": true``)
gives multi-hot labels bool ``[B, K]`` from the json's ``labels`` instead of int64 ``[B]``.

A training epoch follows ``data.order``: ``global`` (the default, :mod:`.order`) cuts one order of
the epoch's samples, a function of (seed, epoch, dataset) only, into global batches, each rank and
worker taking its share; ``rank`` (and ``data.resampled``, :mod:`.rank_order`) gives each (rank,
worker) its own contiguous range read through a shuffle buffer. Either way every sample is seen once
per epoch across ranks (the ``num_samples % global_batch`` tail is dropped), and a resume at the same
layout continues bit for bit. At another world size, worker count or micro batch the global order
continues inside the epoch as long as the global batch and dataset are the same; otherwise the
resume starts the next epoch, with a warning. The state (``{"epoch", "step", "seed", ...}``) is equal
on all ranks.

Batches go out as uint8; the training loop normalises on the device::

    for images, labels in loader:                       # one epoch (the rest of it after a resume)
        x = normalize(images.to(dev, non_blocking=True))  # [B, 3, S, S] float in [-1, 1]

Mixup/cutmix come after, outside the loader (pipeline.data.mixing, seeded by ``loader.position``).
:class:`ShardSource` is this module's :class:`~pipeline.data.source.DataSource`; the worker side reads
its settings from one frozen :class:`StreamSpec`.
"""

from __future__ import annotations

import itertools
import math
import os
import warnings
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset

from data_prep import store
from pipeline import faults
from pipeline.config.batch import BatchLayout

from .augment import (
    EvalTransform,
    TrainTransform,
    eval_batch,
    normalize,
)
from .minival import evaluated_split, training_split
from .order import GlobalOrderRun
from .rank_order import RankOrderRun
from .shards import (  # noqa: F401 (re-exported: callers import the dataset API from here)
    EXCLUDED,
    SKIP_REASONS,
    DataError,
    Info,
    SkipCounts,
    SplitInfo,
    range_stop,
    read_info,
    read_positions,
    read_shard,
    shard_labels,
    skip_record,
)
from .source import ClassLoaders, DataSource
from .stream import ReadPolicy
from .workers import current, end_workers, init_worker, wire

__all__ = ["Info", "SplitInfo", "read_info", "TrainLoader", "EvalLoader", "normalize", "DataError",
           "SKIP_REASONS", "ShardSource", "StreamSpec", "collate_as_is"]


def _rank_world(rank: int | None, world: int | None) -> tuple[int, int]:
    if rank is None or world is None:
        from pipeline.distributed import rank_world

        r, w = rank_world()
        rank, world = (r if rank is None else rank), (w if world is None else world)
    if not 0 <= rank < world:
        raise DataError(f"rank {rank} is outside world size {world}")
    return rank, world


def collate_as_is(x):
    """The loader's DataLoader collate_fn: batches are made in the workers; numpy arrays stay numpy."""
    return x


def _unwire(batch: tuple) -> tuple:
    return tuple(torch.from_numpy(x) if isinstance(x, np.ndarray) else x for x in batch)


def _pinned(batch: tuple) -> tuple:
    """Every tensor of ``batch`` in page-locked memory. DataLoader's pin_memory pins what crossed from
    the workers as a tensor (the images); the labels crossed as numpy (:func:`_wire`) and would reach
    the GPU from pageable memory, a copy that waits for the stream's earlier work."""
    return tuple(x.pin_memory() if isinstance(x, torch.Tensor) and not x.is_pinned() else x for x in batch)


def _batches(ds: IterableDataset, workers: int, pin_memory: bool = False):
    """The dataset's items through ``workers`` processes (0: in this process), as tensors (pinned, all
    of them, with ``pin_memory``)."""
    pin = _pinned if pin_memory else (lambda batch: batch)
    if workers <= 0:
        yield from _one_line_errors(map(pin, map(_unwire, ds)))
        return
    it = iter(DataLoader(ds, batch_size=None, num_workers=workers, worker_init_fn=init_worker,
                         collate_fn=collate_as_is, pin_memory=pin_memory, persistent_workers=False))
    try:
        yield from _one_line_errors(map(pin, map(_unwire, it)))
    finally:
        end_workers(it)


def _one_line_errors(batches):
    """A DataError raised in a worker reaches this process wrapped by torch in a multi-line message
    (the worker's traceback); the run stops with the one line the worker meant."""
    try:
        yield from batches
    except DataError as e:
        lines = str(e).strip().splitlines()
        if len(lines) <= 1:
            raise
        raise DataError(lines[-1].split(": ", 1)[-1]) from None


# ── Training ───────────────────────────────────────────────────────────────────────────────────────
@dataclass(frozen=True)
class StreamSpec:
    """Everything a worker needs to make a rank's training batches; pickled to each worker once."""

    seed: int
    rank: int
    split: SplitInfo
    num_classes: int
    multi_label: bool
    micro_batch: int  # B
    micro_batches: int  # per rank and epoch, over all of its streams
    resampled: bool  # shards drawn with replacement instead of an epoch's permutation
    shuffle_buffer: int
    img_size: int
    crop_scale: tuple[float, float]
    hflip: bool
    randaugment: str | None
    policy: ReadPolicy = ReadPolicy()  # remote reads: timeout, retries, skip or stop
    seek_resume: bool = True  # resume by replaying the shuffle on positions and seeking (resume.py)
    random_crop: bool = True  # False: the whole image resized (a crop would change the label)
    order: str = "global"  # "global" (order.py) or "rank" (rank_order.py)
    global_batch: int = 0  # G = micro_batch × accumulation × world_size
    world_size: int = 1
    lanes: int = 64  # global order: see order.py

    def quota_start(self, stream: int, n: int) -> int:
        """Where (rank, stream) of ``n`` streams starts in the epoch's sample sequence."""
        m = self.micro_batches
        before = sum(m // n + (s < m % n) for s in range(stream))
        return (self.rank * m + before) * self.micro_batch

    def transform(self) -> TrainTransform:
        return TrainTransform(self.img_size, self.crop_scale, self.hflip, self.randaugment,
                              random_crop=self.random_crop)


class TrainLoader:
    """Training batches for one rank: iterate for one epoch of ``micro_batches_per_epoch``
    micro-batches ``(images uint8 [B, 3, S, S], labels int64 [B])`` (+ ``keys`` list with
    ``return_keys=True``), the same count on every rank; the next ``iter()`` starts the next epoch.

    ``steps_per_epoch = max(1, num_samples // global_batch)`` optimizer steps, each made of
    ``accum_steps = global_batch / (world_size × micro_batch)`` micro-batches per rank.
    ``skipped``: reason → count of bad samples seen on this rank, and under ``excluded`` the samples of
    the dataset's ``_exclude.json`` (`vitp decontam`) it passed over (log them: :func:`skip_record`).
    ``position``: (epoch, micro-batch) of the batch last yielded (seeds :class:`~pipeline.data.mixing.Mixer`).
    """

    def __init__(self, cfg_data, *, img_size: int, micro_batch: int, global_batch: int,
                 rank: int | None = None, world_size: int | None = None, seed: int = 0, split: str | None = None,
                 num_workers: int | None = None, return_keys: bool = False, pin_memory: bool = False):
        rank, world_size = _rank_world(rank, world_size)
        layout = BatchLayout(int(global_batch), int(micro_batch), world_size)  # ConfigError if it does not split
        self.cfg = cfg_data
        self.info = read_info(cfg_data.path)
        self.split = training_split(cfg_data, self.info, split or cfg_data.train_split)
        self.rank, self.world_size, self.seed = rank, world_size, int(seed)
        self.img_size, self.micro_batch, self.global_batch = int(img_size), int(micro_batch), int(global_batch)
        self.num_workers = cfg_data.workers if num_workers is None else int(num_workers)
        self.return_keys, self.pin_memory = return_keys, pin_memory
        self.order = "rank" if cfg_data.resampled else cfg_data.order  # resampled draws per stream
        self.accum_steps = layout.accumulation
        self.steps_per_epoch = max(1, self.split.num_samples // global_batch)
        self.micro_batches_per_epoch = self.steps_per_epoch * self.accum_steps
        self.stream_spec().transform()  # a bad crop scale or randaugment string fails here, not in a worker
        self.epoch, self.step = 0, 0
        self.skipped: dict[str, int] = {}
        self.position = (0, 0)
        self._io: dict[int, tuple[int, float]] = {}  # worker -> (remote bytes read, seconds reading)

    @property
    def num_classes(self) -> int:
        return self.info.num_classes

    def stream_spec(self) -> StreamSpec:
        """The settings the workers make this rank's batches from (the seed as loaded from a checkpoint)."""
        c = self.cfg
        return StreamSpec(seed=self.seed, rank=self.rank, split=self.split, num_classes=self.info.num_classes,
                          multi_label=self.info.multi_label, micro_batch=self.micro_batch,
                          micro_batches=self.micro_batches_per_epoch, resampled=c.resampled,
                          shuffle_buffer=c.shuffle_buffer, img_size=self.img_size, crop_scale=tuple(c.crop_scale),
                          hflip=c.hflip, randaugment=c.randaugment, policy=ReadPolicy.of(c), random_crop=c.random_crop,
                          seek_resume=not any(v for k, v in getattr(self, "skipped", {}).items()
                                               if k not in ("undecodable_image", EXCLUDED)),
                          order=self.order, global_batch=self.global_batch, world_size=self.world_size,
                          lanes=c.lanes)

    def __len__(self) -> int:
        return self.micro_batches_per_epoch

    def read_stats(self) -> dict:
        """Remote read throughput per loader worker (mean over workers, MB/s) once any was read;
        logged with the training metrics. {} for a local dataset."""
        rates = [b / t for b, t in self._io.values() if b and t > 0]
        return {"read_mb_s_per_worker": sum(rates) / len(rates) / 1e6} if rates else {}

    def __iter__(self):
        if self.step >= self.micro_batches_per_epoch:
            self.epoch, self.step = self.epoch + 1, 0
        yield from self._run(epochs=1)
        if self.step >= self.micro_batches_per_epoch:
            self.epoch, self.step = self.epoch + 1, 0

    def forever(self):
        """Micro-batches across epochs, without end, from one set of loader workers (their shuffle
        buffers stay warm across epoch boundaries); the same batches as epoch after epoch of iter()."""
        if self.step >= self.micro_batches_per_epoch:
            self.epoch, self.step = self.epoch + 1, 0
        return self._run(epochs=None)

    def _run(self, epochs: int | None):
        run = (GlobalOrderRun if self.order == "global" else RankOrderRun)(self, self.epoch, self.step, epochs)
        src = _batches(run, self.num_workers, self.pin_memory)
        for images, labels, keys, skipped, io in src:
            if self.step >= self.micro_batches_per_epoch:  # the stream went on into the next epoch
                self.epoch, self.step = self.epoch + 1, 0
            for k, v in skipped.items():
                self.skipped[k] = self.skipped.get(k, 0) + v
            self._io[io[0]] = io[1:]
            self.position = (self.epoch, self.step)
            faults.record_read(self.rank, self.epoch, self.step, keys)
            self.step += 1
            yield (images, labels, keys) if self.return_keys else (images, labels)

    def state_dict(self) -> dict:
        """Position after the last yielded micro-batch (equal on every rank except ``skipped``)."""
        return {"epoch": self.epoch, "step": self.step, "seed": self.seed, **self._layout(),
                "skipped": dict(self.skipped)}

    def _layout(self) -> dict:
        """What the epoch's cut depends on besides the seed: all of it for the rank order; for the
        global order only its ``_ORDER`` keys fix which samples a step holds, the rest how they are shared."""
        return {"world_size": self.world_size, "workers": max(1, self.num_workers), "micro_batch": self.micro_batch,
                "global_batch": self.global_batch, "num_samples": self.split.num_samples,
                "dataset": self.info.digest, "resampled": bool(self.cfg.resampled), "order": self.order,
                "lanes": self.cfg.lanes, "shuffle_buffer": self.cfg.shuffle_buffer}

    _ORDER = ("global_batch", "num_samples", "dataset", "resampled", "order", "lanes", "shuffle_buffer")

    def load_state_dict(self, sd: dict) -> None:
        """Continue from ``sd``: the next micro-batches equal those the saved run would have yielded.
        At another world size, worker count or micro batch the global order continues at the saved
        run's next optimizer step (its samples, shared the new way); if what the order or a step is
        made of changed (global batch, dataset, order settings), or the rank order's layout changed,
        continue at the next epoch's start instead, with a warning."""
        self.seed = int(sd["seed"])
        self.epoch, self.step = int(sd["epoch"]), int(sd["step"])
        self.skipped = dict(sd.get("skipped", {}))
        now = self._layout()
        if not self.step or all(sd.get(k) == v for k, v in now.items()):
            return
        if self.order == "global" and all(sd.get(k) == now[k] for k in self._ORDER):
            ws, mb = sd.get("world_size") or 0, sd.get("micro_batch") or 0
            saved_accum = BatchLayout(self.global_batch, mb, ws, exact=False).accumulation if ws and mb else 0
            if saved_accum == self.accum_steps and ws * mb == self.world_size * self.micro_batch:
                return  # only the worker count changed: the same micro-batches, made by other workers
            if saved_accum and self.step % saved_accum == 0:
                self.step = self.step // saved_accum * self.accum_steps  # the same optimizer step, shared anew
                return
        warnings.warn("data loader state is from a different layout (global batch/dataset/order, or world "
                      f"size/workers/batch with data.order=rank); continuing at the start of epoch {self.epoch + 1}",
                      stacklevel=2)
        self.epoch, self.step = self.epoch + 1, 0


# ── Evaluation ─────────────────────────────────────────────────────────────────────────────────────
class _EvalRank(IterableDataset):
    """A rank's batches ``[0, num_batches)``; worker d takes a contiguous block of them (eval does
    not care about order, and a block reads its shards in one pass)."""

    def __init__(self, loader: EvalLoader):
        self.sp, self.K, self.B = loader.split, loader.info.num_classes, loader.batch
        self.ml, self.policy = loader.info.multi_label, loader.policy
        self.pos, self.nb = loader.rank_positions, loader.num_batches
        self.tf = EvalTransform(loader.img_size, loader.crop_pct)

    def __iter__(self):
        d, n = current()
        b0, b1 = d * self.nb // n, (d + 1) * self.nb // n
        counts, B = SkipCounts(), self.B
        raw = read_positions(self.sp, self.pos[b0 * B:b1 * B], counts, num_classes=self.K, multi_label=self.ml,
                             policy=self.policy)

        def undecodable(key, err):
            counts.add("undecodable_image")
            warnings.warn(f"sample {key}: {err}; not evaluated", stacklevel=2)

        for b in range(b0, b1):
            real = len(self.pos[b * B:(b + 1) * B])  # fewer come if a shard is cut off
            items = list(itertools.islice(raw, real))
            yield wire((*eval_batch(items, self.tf, B, undecodable, self.K if self.ml else None), counts.take()))


class EvalLoader:
    """Every sample of a split exactly once across ranks: rank r gets the contiguous slice
    ``[r·N/W, (r+1)·N/W)`` in shard order, as ``num_batches`` batches of
    ``(images uint8 [B, 3, S, S], labels int64 [B], valid bool [B])`` (+ keys with ``return_keys``);
    labels are multi-hot bool ``[B, K]`` for a multi-label dataset.

    ``num_batches`` is the same on every rank (rows past a rank's slice, and undecodable images,
    have ``valid=False``, label -1 (no class), zero pixels), so a caller can run the model and any
    per-batch collective on every rank in lock-step, sum ``correct[valid]`` / ``valid.sum()`` locally
    and all-reduce those sums once at the end. ``num_samples_rank`` is this rank's slice length.
    ``positions``: only these sorted positions of the split (e.g. a few-shot subset), cut the same way
    (``rank_positions``: this rank's).
    """

    def __init__(self, cfg_data, *, img_size: int, batch: int, rank: int | None = None,
                 world_size: int | None = None, split: str | None = None, num_workers: int | None = None,
                 return_keys: bool = False, crop_pct: float | None = None, positions=None):
        rank, world_size = _rank_world(rank, world_size)
        name = split or cfg_data.val_split
        if not name:
            raise DataError("data.val_split: not set; no split to evaluate")
        self.info = read_info(cfg_data.path)
        self.split, held = evaluated_split(cfg_data, self.info, name)  # minival: positions of the train split
        if held is not None:
            positions = held if positions is None else [held[i] for i in positions]
        self.rank, self.world_size = rank, world_size
        self.img_size, self.batch = int(img_size), int(batch)
        self.crop_pct = cfg_data.eval_crop_pct if crop_pct is None else float(crop_pct)
        self.num_workers = cfg_data.workers if num_workers is None else int(num_workers)
        self.return_keys = return_keys
        self.policy = ReadPolicy.of(cfg_data)
        positions = range(self.split.num_samples) if positions is None else positions
        n = self.num_samples = len(positions)
        self.rank_positions = positions[rank * n // world_size:(rank + 1) * n // world_size]
        self.num_samples_rank = len(self.rank_positions)
        self.num_batches = math.ceil(math.ceil(n / world_size) / self.batch)
        self.skipped: dict[str, int] = {}

    def __len__(self) -> int:
        return self.num_batches

    def __iter__(self):
        src = _batches(_EvalRank(self), min(self.num_workers, self.num_batches))
        for images, labels, mask, keys, skipped in src:
            for k, v in skipped.items():
                self.skipped[k] = self.skipped.get(k, 0) + v
            yield (images, labels, mask, keys) if self.return_keys else (images, labels, mask)


# ── The source ─────────────────────────────────────────────────────────────────────────────────────
class ShardSource(ClassLoaders, DataSource):
    """A `vitp prep` folder of WebDataset shards as a :class:`~pipeline.data.source.DataSource`."""

    kind = "local"
    normalize = staticmethod(normalize)

    train_loader_class, eval_loader_class = TrainLoader, EvalLoader
    info_reader = staticmethod(read_info)

    def split_labels(self, split: str, rank: int, world_size: int) -> dict[int, list]:
        info = self.read_info()
        sp = info.split(split)
        return {s: [label for _, label in shard_labels(sp.urls[s], info.num_classes)]
                for s in range(rank, len(sp.urls), world_size)}

    def dataset_name(self) -> str:
        return os.path.basename(os.path.normpath(store.public(self.path).split("://", 1)[-1]))

    def source_fields(self) -> dict:
        return {"uri": store.public(self.path) if store.is_remote(self.path) else os.path.abspath(self.path)}

    def where(self) -> str:
        from .shards import INFO_FILE

        return store.public(store.join(self.path, INFO_FILE))

    def check_reachable(self, key: str) -> None:
        from .shards import INFO_FILE

        if store.is_remote(self.path):
            store.check_readable(store.join(self.path, INFO_FILE), key)

    def checked_against(self) -> list[tuple[str, list[str] | None]]:
        """Prep's record and `vitp decontam`'s, as read_info merges them into ``decontaminated`` (each set
        checked after prep carries its own splits)."""
        block = self.read_info().decontaminated or {}
        return [(a["address"].rstrip("/"), a["splits"] if "by" in a else block.get("splits"))
                for a in block.get("against", [])]

    def split_sizes(self) -> dict[str, int]:
        """Shards per split, from ``_info.json`` alone (no shard is listed or counted)."""
        from .shards import DataError, info_file, read_description

        info_file(self.path)  # a missing description is one line worded as every reader words it
        try:
            return {k: len(sp.filenames) for k, sp in read_description(self.path).splits.items()}
        except DataError as e:
            raise DataError(f"data.path: {e}") from None

    def shard_addresses(self, split: str) -> list[str]:
        from .shards import read_description

        return [store.join(self.path, f) for f in read_description(self.path).splits[split].filenames]
