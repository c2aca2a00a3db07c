"""The epoch's global sample order: a function of (seed, epoch, dataset) only, cut the same way at any
world size, worker count or micro batch.

Order of epoch e over a split of N samples (``lanes`` C and ``shuffle_buffer`` S are data settings,
part of the order; ranks and workers are not)::

    shards permuted with (seed, e) → one sequence of N samples
    cut into C lanes of L = N // C contiguous samples (the last N - C·L form the order's tail;
                                                 C is cut to N // S so that a lane holds a window)
    lane c: its L samples permuted window by window (S samples each, seed (seed, e, c, window))
    order[t] = lane t % C, its (t // C)-th sample                 (t < C·L; then the tail, in order)

Interleaving the lanes makes every global batch draw from C places spread over the whole dataset
(as many shuffle-buffer streams do), windows mix within a lane. The global batch g of G samples is
``order[g·G : (g+1)·G]``; rank r of W takes ``[r·G/W, (r+1)·G/W)`` of it, as G/(W·B) micro-batches
of B in a row; DataLoader worker d of n makes every n-th micro-batch. Sample ``t`` is augmented with
seed (seed, e, t): the pixels of a sample do not depend on who reads it. An epoch is
``N // G`` global batches; resuming after step g at any layout with the same G (and dataset, seed,
lanes, S) continues at ``order[(g+1)·G]``: no sample is seen twice or skipped.

Reading: a worker reads the samples of its next micro-batches together (a shuffle buffer's worth,
at most READ_AHEAD), per shard one pass from the first wanted sample to the last, split at gaps wider
than GAP where prep's offsets let a read start mid-shard; a local file seeks over what it skips, a
remote store is asked for each part's bytes only (``data.order: rank`` reads long contiguous ranges
instead, at the price of a layout-bound order).
"""

from __future__ import annotations

import functools
import itertools
import warnings

import numpy as np
from torch.utils.data import IterableDataset

from data_prep import store
from pipeline.config.batch import BatchLayout

from .augment import augment_batch, sample_seed
from .shards import (
    EXCLUDED,
    DataError,
    SkipCounts,
    SplitInfo,
    excluded_by_position,
    range_stop,
    read_slices,
    shard_offsets,
)
from .workers import current, io_report, wire


class GlobalOrder:
    """The epoch's order as split positions; ``positions(a, b)`` → int64 ``[b - a]`` (any slice,
    without materialising the N-sample order: memory is C lanes' current window)."""

    def __init__(self, seed: int, epoch: int, lengths, lanes: int, window: int):
        self.seed, self.epoch = int(seed), int(epoch)
        lengths = np.asarray(lengths, dtype=np.int64)
        self.n = int(lengths.sum())
        self.window = max(1, min(int(window), self.n))
        self.lanes = max(1, min(int(lanes), self.n // self.window))  # a lane holds at least one window
        self.lane_len = self.n // self.lanes
        shard_order = np.random.default_rng([self.seed, self.epoch, 0]).permutation(len(lengths))
        self._seq_cum = np.concatenate([[0], np.cumsum(lengths[shard_order])])  # sequence → shard in order
        self._shard_first = np.concatenate([[0], np.cumsum(lengths)])[shard_order]  # its first split position
        self._perm = functools.lru_cache(maxsize=4 * self.lanes)(self._window_perm)

    def _window_perm(self, lane: int, w: int) -> np.ndarray:
        size = min(self.window, self.lane_len - w * self.window)
        return np.random.default_rng([self.seed, self.epoch, 5, lane, w]).permutation(size)

    def sequence_index(self, t: np.ndarray) -> np.ndarray:
        """Order indices → indices into the epoch's shard-permuted sequence."""
        out = t.copy()  # the tail (t >= C·L) stays in sequence order
        body = t < self.lanes * self.lane_len
        lane, i = t[body] % self.lanes, t[body] // self.lanes
        w, within = i // self.window, i % self.window
        perm = np.empty_like(within)
        # one look-up per (lane, window) the indices fall in, not per index: a micro-batch draws from
        # every lane, a read-ahead's worth of them from a few windows each
        cells, which = np.unique(lane * (self.lane_len // self.window + 1) + w, return_inverse=True)
        for k, cell in enumerate(cells.tolist()):
            at = which == k
            c, win = divmod(cell, self.lane_len // self.window + 1)
            perm[at] = self._perm(c, win)[within[at]]
        out[body] = lane * self.lane_len + w * self.window + perm
        return out

    def positions(self, a: int, b: int) -> np.ndarray:
        """Split positions (shards in their listed order) of order indices ``[a, b)``; past the end the
        order wraps (a split smaller than one global batch)."""
        q = self.sequence_index(np.arange(a, b, dtype=np.int64) % self.n)
        j = np.searchsorted(self._seq_cum, q, side="right") - 1
        return self._shard_first[j] + (q - self._seq_cum[j])


READ_AHEAD = 1024  # samples a worker reads together at most (a shuffle buffer's worth, up to this)
GAP = 64  # wanted samples further apart than this in a remote shard with offsets: read as two slices


def read_at(sp: SplitInfo, positions, counts: SkipCounts, **kw) -> dict[int, tuple]:
    """Samples at split ``positions`` (any order) → {position: (key, bytes, label)}; a position a cut-off
    or unreadable shard lost is absent. Per shard, one pass from the first wanted sample to the last
    (image bytes of wanted ones only), split where wanted samples lie more than GAP apart and the
    shard's offsets let a read start there. A bad sample is counted by the reader of the valid sample
    after it (read_shard), so each once across ranks and workers."""
    cum = np.concatenate([[0], np.cumsum(sp.lengths)])
    pos = np.unique(np.asarray(positions, dtype=np.int64))
    shard = np.searchsorted(cum, pos, side="right") - 1
    out: dict[int, tuple] = {}
    for s in np.unique(shard).tolist():
        local = (pos[shard == s] - cum[s]).tolist()
        # a local file seeks to each run of wanted samples (parsing the headers of the samples between
        # costs more than a seek: the workers, and the global batch's other shares, want those); a
        # remote one is asked for one range per GAP's worth, a request costing a round trip
        gap = None if shard_offsets(sp.urls[s]) is None else GAP if store.is_remote(sp.urls[s]) else 1
        cuts = [i for i in range(1, len(local)) if gap is not None and local[i] - local[i - 1] > gap]
        for a, b in zip([0, *cuts], [*cuts, len(local)]):
            run = local[a:b]
            lo, hi = run[0], run[-1] + 1
            want = None if hi - lo == len(run) else set(run)
            got = read_slices(sp.urls, [(s, lo, range_stop(hi, sp.lengths[s]), want)], counts, keep=sp.keep, **kw)
            out.update(zip((int(cum[s]) + q for q in run), got))  # a cut shard yields a prefix of its run
    return out


def first_index(p, j: int) -> int:
    """Where micro-batch ``j`` of rank ``p.rank``'s epoch starts in the order (``p``: its StreamSpec):
    step j // accum's global batch, this rank's share, its (j % accum)-th micro-batch."""
    layout = BatchLayout(p.global_batch, p.micro_batch, p.world_size)
    accum = layout.accumulation
    return (j // accum) * layout.global_batch + p.rank * layout.per_rank + (j % accum) * layout.micro_batch


def reader_kw(p) -> dict:
    return dict(num_classes=p.num_classes, multi_label=p.multi_label, policy=p.policy)


def micro_batch(p, order: GlobalOrder, t0: int, got: dict, tf, counts: SkipCounts, seen_bad: set):
    """The micro-batch at order indices ``[t0, t0 + B)`` (``p``: the loader's StreamSpec; ``got``: the
    samples read, by split position) → (images uint8 [B, 3, S, S], labels, keys); ``tf``: the
    TrainTransform. A sample that cannot be read or decoded is replaced by another of its
    micro-batch (the batch keeps its size and place)."""
    B, kw = p.micro_batch, reader_kw(p)
    items = [got.get(q) for q in order.positions(t0, t0 + B).tolist()]

    def undecodable(key, err):
        if key not in seen_bad:  # another epoch or a fill meets it again
            seen_bad.add(key)
            counts.add("undecodable_image")
            warnings.warn(f"sample {key}: {err}; skipped", stacklevel=2)

    seed, e, t = p.seed, order.epoch, t0 + B
    while True:
        fill = [x for x in items if x is not None]
        if fill:
            items = [x if x is not None else fill[i % len(fill)] for i, x in enumerate(items)]
            out = augment_batch(items, tf, [sample_seed(seed, e, t0 + i) for i in range(B)],
                                lambda i: sample_seed(seed, e, t0 + i, 1), undecodable,
                                p.num_classes if p.multi_label else None)
            if out is not None:
                return out
        # nothing in the batch reads or decodes (a lost shard): fill it from the order's next samples,
        # read again uncounted (their own batches count them)
        if t - t0 >= order.n:
            raise DataError(f"{p.split.name}: no sample of epoch {order.epoch} reads and decodes "
                            f"(shards {sorted({store.public(u) for u in p.split.urls})[:4]}...)")
        counts.active = False
        more = read_at(p.split, order.positions(t, t + B), counts, **kw)
        counts.active = True
        items, t = list(more.values()), t + B


class GlobalOrderRun(IterableDataset):
    """A rank's micro-batches from (``epoch``, ``start``) on, for ``epochs`` epochs (None: without end).
    DataLoader hands out an iterable dataset's items round-robin over its workers, so worker d of n
    makes micro-batches d, d + n, ... of the run; each is placed by the order alone, so the batches
    do not depend on the worker count, and workers persist across epochs. A worker reads the samples
    of its next micro-batches (a shuffle buffer's worth, at most READ_AHEAD) together, a pass per shard."""

    def __init__(self, loader, epoch: int, start: int, epochs: int | None = None):
        self.spec, self.epoch, self.start, self.epochs = loader.stream_spec(), epoch, start, epochs

    def __iter__(self):
        p = self.spec
        d, n = current()
        m, tf, order = p.micro_batches, p.transform(), None
        counts, seen_bad = SkipCounts(), set()
        ahead = max(1, min(p.shuffle_buffer, READ_AHEAD) // p.micro_batch)  # micro-batches read together
        # the left-out samples are counted with the micro-batch that holds the kept one beside them, not
        # when read: a chunk's reads are grouped by worker turns, which a resume at another step regroups
        gaps = excluded_by_position(p.split)
        mine = itertools.count(self.start + d, n)
        if self.epochs is not None:
            mine = itertools.takewhile(lambda k: k < self.epochs * m, mine)
        while chunk := list(itertools.islice(mine, ahead)):
            for e, ks in itertools.groupby(chunk, key=lambda k: self.epoch + k // m):
                ks = list(ks)
                if order is None or order.epoch != e:
                    order = GlobalOrder(p.seed, e, p.split.lengths, p.lanes, p.shuffle_buffer)
                starts = [first_index(p, k % m) for k in ks]
                got = read_at(p.split, np.concatenate([order.positions(t, t + p.micro_batch) for t in starts]),
                              counts, **reader_kw(p))
                for t in starts:
                    out = micro_batch(p, order, t, got, tf, counts, seen_bad)
                    if gaps and (n_out := sum(gaps.get(q, 0) for q in order.positions(t, t + p.micro_batch).tolist())):
                        counts.add(EXCLUDED, n_out)
                    yield wire((*out, counts.take(), io_report()))
