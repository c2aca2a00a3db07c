"""``data.order: rank`` (and ``data.resampled``): each (rank, loader worker) reads its own contiguous
range of the epoch's shard sequence through a seeded shuffle buffer. Long sequential reads (the
cheapest for a remote store), but the order depends on the world size and worker count, so a resume
at another layout starts the next epoch (the default, ``data.order: global``, is :mod:`.order`).

An epoch is a pure function of (seed, epoch, rank, stream), a stream being one worker: the shards,
permuted with (seed, epoch), form one sample sequence (lengths from ``_info.json``); each (rank, stream)
owns a contiguous range of exactly ``batches × micro_batch`` samples of it (every sample once per epoch
across ranks; the ``num_samples % global_batch`` tail is dropped), reads it through a seeded shuffle
buffer, and re-reads its own range if bad samples left it short. Sample ``i`` of a stream is augmented
with seed (seed, epoch, rank, stream, i); an undecodable image is replaced by another sample of its
batch, so batch ``b`` always consumes raw samples ``[b·B, (b+1)·B)``. Resume = re-create the epoch's
streams and skip raw samples without decoding: bit-identical continuation.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Iterator

import numpy as np
from torch.utils.data import IterableDataset

from data_prep import store

from .augment import augment_batch, sample_seed, shuffle_buffer
from .resume import dropping, resumed
from .shards import DataError, SkipCounts, read_segments, read_slices, segments
from .workers import current, io_report, wire


class RankOrderRun(IterableDataset):
    """A rank's micro-batches from (``epoch``, ``start``) on, for ``epochs`` epochs (None: without
    end, so one DataLoader's workers serve the whole run instead of restarting every epoch).

    DataLoader hands out an iterable dataset's items round-robin over its workers, so worker d
    yields every n-th micro-batch of the run. Micro-batch i of an epoch belongs to logical stream
    i % n (which fixes its samples); worker d therefore serves, in each epoch, the stream whose
    batches fall on its turns: (start + d) % n in the first epoch, shifted by the batches yielded
    before each later epoch began. The batches are the same whether workers persist or not.
    """

    def __init__(self, loader, epoch: int, start: int, epochs: int | None = None):
        self.spec, self.epoch, self.start, self.epochs = loader.stream_spec(), epoch, start, epochs

    def __iter__(self):
        p = self.spec
        d, n = current()
        m = p.micro_batches
        before = -self.start  # batches of the run yielded before epoch e begins, minus start
        for k in itertools.count() if self.epochs is None else range(self.epochs):
            first = self.start if k == 0 else 0
            stream = (first + d) % n if k == 0 else (d - before) % n
            count = m // n + (stream < m % n)
            done = max(0, -(-(first - stream) // n))
            yield from map(wire, _train_stream(p, self.epoch + k, stream, n, count, done))
            before += m


def _raw_stream(p, epoch: int, stream: int, n: int, count: int, counts: SkipCounts,
                skip: int = 0) -> Iterator:
    """Endless raw samples of (rank, stream) for this epoch after the first ``skip``: its range, then
    (if bad samples left it short) the range again with a new shuffle; resampled mode draws shards
    with replacement. A resume (``skip`` > 0) seeks to where the stream was (:func:`.resume.resumed`), or,
    where that cannot be exact, reads the first ``skip`` samples again and drops them."""
    seed, rank, sp, K, ml = p.seed, p.rank, p.split, p.num_classes, p.multi_label
    lengths, urls = list(sp.lengths), sp.urls
    kw = dict(num_classes=K, multi_label=ml, policy=p.policy, keep=sp.keep, excluded=sp.excluded)
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


def _train_stream(p, epoch: int, stream: int, n: int, count: int, done: int):
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
        yield (*out, counts.take(), io_report())
