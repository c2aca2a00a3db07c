"""Shards → batches: the streaming WebDataset loader for training and evaluation.

A dataset is a `vitp prep` folder: ``_info.json`` (timm's WDS reader layout: splits → filenames,
shard_lengths, num_samples; num_classes; classes) and tars whose samples are ``<key>.cls`` (label
text), ``<key>.jpg|png|webp`` and ``<key>.json``. A multi-label dataset (``"multi_label": true``)
gives multi-hot labels bool ``[B, K]`` from the json's ``labels`` instead of int64 ``[B]``.

A training epoch is a pure function of (seed, epoch, rank, stream), a stream being one worker:
the shards, permuted with (seed, epoch), form one sample sequence (lengths from ``_info.json``);
each (rank, stream) owns a contiguous range of exactly ``batches × micro_batch`` samples of it
(every sample once per epoch across ranks; the ``num_samples % global_batch`` tail is dropped),
reads it through a seeded shuffle buffer, and re-reads its own range if bad samples left it short.
Sample ``i`` of a stream is augmented with seed (seed, epoch, rank, stream, i); an undecodable image
is replaced by another sample of its batch, so batch ``b`` always consumes raw samples
``[b·B, (b+1)·B)``. Resume = re-create the epoch's streams and skip raw samples without decoding:
bit-identical continuation. The state (``{"epoch", "step", "seed", ...}``) is equal on all ranks.

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
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from data_prep import store

from .augment import (
    EvalTransform,
    TrainTransform,
    augment_batch,
    eval_batch,
    normalize,
    sample_seed,
    shuffle_buffer,
)
from .minival import evaluated_split, training_split
from .resume import dropping, resumed
from .shards import (  # noqa: F401 (re-exported: callers import the dataset API from here)
    SKIP_REASONS,
    DataError,
    Info,
    SkipCounts,
    SplitInfo,
    range_stop,
    read_info,
    read_positions,
    read_segments,
    read_shard,
    read_slices,
    segments,
    shard_labels,
)
from .source import ClassLoaders, DataSource
from .stream import ReadPolicy, io_stats
from .workers import end_workers, init_worker

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


def _worker() -> tuple[int, int]:
    wi = get_worker_info()
    return (0, 1) if wi is None else (wi.id, wi.num_workers)


def _io() -> tuple[int, int, float]:
    """(worker, remote bytes read, seconds since its first remote read): sent with each batch."""
    st = io_stats()
    return _worker()[0], st["bytes"], st["seconds"]


def collate_as_is(x):
    """The loader's DataLoader collate_fn: batches are made in the workers; numpy arrays stay numpy."""
    return x


def _wire(batch: tuple) -> tuple:
    """Worker side: every tensor after the first (the image batch) as a numpy array, pickled inline
    with the message. Each tensor sent from a worker is a shared-memory block whose descriptor the
    main process fetches over a socket (~0.5 ms of both processes' time), so only images go that way."""
    return tuple(x.numpy() if i and isinstance(x, torch.Tensor) else x for i, x in enumerate(batch))


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

    def quota_start(self, stream: int, n: int) -> int:
        """Where (rank, stream) of ``n`` streams starts in the epoch's sample sequence."""
        m = self.micro_batches
        before = sum(m // n + (s < m % n) for s in range(stream))
        return (self.rank * m + before) * self.micro_batch

    def transform(self) -> TrainTransform:
        return TrainTransform(self.img_size, self.crop_scale, self.hflip, self.randaugment)


class _TrainRun(IterableDataset):
    """A rank's micro-batches from (``epoch``, ``start``) on, for ``epochs`` epochs (None: without
    end, so one DataLoader's workers serve the whole run instead of restarting every epoch).

    DataLoader hands out an iterable dataset's items round-robin over its workers, so worker d
    yields every n-th micro-batch of the run. Micro-batch i of an epoch belongs to logical stream
    i % n (which fixes its samples); worker d therefore serves, in each epoch, the stream whose
    batches fall on its turns: (start + d) % n in the first epoch, shifted by the batches yielded
    before each later epoch began. The batches are the same whether workers persist or not.
    """

    def __init__(self, loader: TrainLoader, epoch: int, start: int, epochs: int | None = None):
        self.spec, self.epoch, self.start, self.epochs = loader.stream_spec(), epoch, start, epochs

    def __iter__(self):
        p = self.spec
        d, n = _worker()
        m = p.micro_batches
        before = -self.start  # batches of the run yielded before epoch e begins, minus start
        for k in itertools.count() if self.epochs is None else range(self.epochs):
            first = self.start if k == 0 else 0
            stream = (first + d) % n if k == 0 else (d - before) % n
            count = m // n + (stream < m % n)
            done = max(0, -(-(first - stream) // n))
            yield from map(_wire, _train_stream(p, self.epoch + k, stream, n, count, done))
            before += m


def _raw_stream(p: StreamSpec, epoch: int, stream: int, n: int, count: int, counts: SkipCounts,
                skip: int = 0) -> Iterator:
    """Endless raw samples of (rank, stream) for this epoch after the first ``skip``: its range, then
    (if bad samples left it short) the range again with a new shuffle; resampled mode draws shards
    with replacement. A resume (``skip`` > 0) seeks to where the stream was (:func:`.resume.resumed`), or,
    where that cannot be exact, reads the first ``skip`` samples again and drops them."""
    seed, rank, sp, K, ml = p.seed, p.rank, p.split, p.num_classes, p.multi_label
    lengths, urls = list(sp.lengths), sp.urls
    kw = dict(num_classes=K, multi_label=ml, policy=p.policy, keep=sp.keep)
    if p.resampled:
        rng = np.random.default_rng([seed, epoch, rank, stream, 1])

        def draws():
            while True:
                got = 0
                for _ in range(len(urls)):
                    for x in read_slices(urls, [(int(rng.integers(len(urls))), 0, None, None)], counts, **kw):
                        got += 1
                        yield x
                if not got:
                    raise DataError(f"{sp.name}: {len(urls)} shards drawn in a row held no readable sample")

        yield from dropping(shuffle_buffer(draws(), p.shuffle_buffer,
                                            np.random.default_rng([seed, epoch, rank, stream, 2])), skip, counts)
        return
    order = np.random.default_rng([seed, epoch, 0]).permutation(len(urls))
    segs = segments(lengths, order, p.quota_start(stream, n), count * p.micro_batch)
    for rnd in itertools.count():
        got = 0
        counts.rereading = rnd > 0
        rng = np.random.default_rng([seed, epoch, rank, stream, 3, rnd])
        if rnd == 0 and skip and p.seek_resume:
            items, got, skip = resumed(p, segs, counts, rng, skip), skip, 0
        else:
            items = shuffle_buffer(read_segments(urls, lengths, segs, counts, **kw), p.shuffle_buffer, rng)
        for x in items:
            got += 1
            if skip:  # a resume that re-reads: these were consumed before the checkpoint (and counted)
                counts.active = False
                skip -= 1
                continue
            counts.active = True
            yield x
        if not got:
            raise DataError(f"{sp.name}: rank {rank} stream {stream} found no readable sample in its shards "
                            f"{sorted({store.public(urls[s]) for s, _, _ in segs})}")


def _train_stream(p: StreamSpec, epoch: int, stream: int, n: int, count: int, done: int):
    """Batches ``done .. count-1`` of (rank, stream): (images, labels, keys, skip-count delta)."""
    counts, seen_bad = SkipCounts(), set()
    mb, seed, rank = p.micro_batch, p.seed, p.rank
    classes = p.num_classes if p.multi_label else None
    tf = p.transform()
    raw = enumerate(_raw_stream(p, epoch, stream, n, count, counts, skip=done * mb), done * mb)

    def undecodable(key, err):
        if key not in seen_bad:  # a stream that wraps meets it again
            seen_bad.add(key)
            counts.add("undecodable_image")
            warnings.warn(f"sample {key}: {err}; skipped", stacklevel=2)

    for _ in range(done, count):
        out = None
        while out is None:  # None: nothing in the batch decoded; take more (shifts later positions)
            batch = list(itertools.islice(raw, mb))
            pos = [i for i, _ in batch]
            out = augment_batch([x for _, x in batch], tf, [sample_seed(seed, epoch, rank, stream, i) for i in pos],
                                lambda j, pos=pos: sample_seed(seed, epoch, rank, stream, pos[j], 1), undecodable,
                                classes)
        yield (*out, counts.take(), _io())


class TrainLoader:
    """Training batches for one rank: iterate for one epoch of ``micro_batches_per_epoch``
    micro-batches ``(images uint8 [B, 3, S, S], labels int64 [B])`` (+ ``keys`` list with
    ``return_keys=True``), the same count on every rank; the next ``iter()`` starts the next epoch.

    ``steps_per_epoch = max(1, num_samples // global_batch)`` optimizer steps, each made of
    ``accum_steps = global_batch / (world_size × micro_batch)`` micro-batches per rank.
    ``skipped``: reason → count of bad samples seen on this rank (log it as a metric).
    ``position``: (epoch, micro-batch) of the batch last yielded (seeds :class:`~pipeline.data.mixing.Mixer`).
    """

    def __init__(self, cfg_data, *, img_size: int, micro_batch: int, global_batch: int,
                 rank: int | None = None, world_size: int | None = None, seed: int = 0, split: str | None = None,
                 num_workers: int | None = None, return_keys: bool = False, pin_memory: bool = False):
        rank, world_size = _rank_world(rank, world_size)
        if global_batch % (world_size * micro_batch):
            raise DataError(f"train.global_batch: {global_batch} is not divisible by world size {world_size} x "
                            f"train.micro_batch {micro_batch}")
        self.cfg = cfg_data
        self.info = read_info(cfg_data.path)
        self.split = training_split(cfg_data, self.info, split or cfg_data.train_split)
        self.rank, self.world_size, self.seed = rank, world_size, int(seed)
        self.img_size, self.micro_batch, self.global_batch = int(img_size), int(micro_batch), int(global_batch)
        self.num_workers = cfg_data.workers if num_workers is None else int(num_workers)
        self.return_keys, self.pin_memory = return_keys, pin_memory
        self.accum_steps = global_batch // (world_size * micro_batch)
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
                          hflip=c.hflip, randaugment=c.randaugment, policy=ReadPolicy.of(c),
                          seek_resume=not any(v for k, v in getattr(self, "skipped", {}).items()
                                               if k != "undecodable_image"))

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
        src = _batches(_TrainRun(self, self.epoch, self.step, epochs), self.num_workers, self.pin_memory)
        for images, labels, keys, skipped, io in src:
            if self.step >= self.micro_batches_per_epoch:  # the stream went on into the next epoch
                self.epoch, self.step = self.epoch + 1, 0
            for k, v in skipped.items():
                self.skipped[k] = self.skipped.get(k, 0) + v
            self._io[io[0]] = io[1:]
            self.position = (self.epoch, self.step)
            self.step += 1
            yield (images, labels, keys) if self.return_keys else (images, labels)

    def state_dict(self) -> dict:
        """Position after the last yielded micro-batch (equal on every rank except ``skipped``)."""
        return {"epoch": self.epoch, "step": self.step, "seed": self.seed, **self._layout(),
                "skipped": dict(self.skipped)}

    def _layout(self) -> dict:  # what an epoch's cut depends on besides the seed
        return {"world_size": self.world_size, "workers": max(1, self.num_workers), "micro_batch": self.micro_batch,
                "global_batch": self.global_batch, "num_samples": self.split.num_samples,
                "resampled": bool(self.cfg.resampled)}

    def load_state_dict(self, sd: dict) -> None:
        """Continue from ``sd``: the next micro-batches equal those the saved run would have yielded.
        If the epoch's layout changed (world size, workers, batch, dataset), continue at the next
        epoch's start instead, with a warning."""
        self.seed = int(sd["seed"])
        self.epoch, self.step = int(sd["epoch"]), int(sd["step"])
        self.skipped = dict(sd.get("skipped", {}))
        if any(sd.get(k) != v for k, v in self._layout().items()) and self.step:
            warnings.warn("data loader state is from a different layout (world size/workers/batch/dataset); "
                          f"continuing at the start of epoch {self.epoch + 1}", stacklevel=2)
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
        d, n = _worker()
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
            yield _wire((*eval_batch(items, self.tf, B, undecodable, self.K if self.ml else None), counts.take()))


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
