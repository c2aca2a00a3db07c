"""Minival: a per-class stratified part of the training split, held out of training and read as split
``minival`` (the paper's Appendix B.1.1: choose the learning rate on 2% of train; VTAB-1k: 800 + 200).

Which samples are minival is a function of the split's (key, label) list and the ``data`` section
alone: each class's samples are ordered by a hash of ``(data.minival_seed, key)``, and the first ones
of that order are taken. So every rank, loader worker, resumed run, array task and `vitp eval --split
minival` with the same data settings reads exactly the same samples, without talking to each other.

    data.minival_fraction f     class c of n_c samples: its first max(1, round(f n_c)) are minival,
                                the rest are trained on
    data.train_limit T          N = T + M examples of the hash order are used at all, allotted to the
    data.minival_limit M        classes in proportion to their sizes (largest remainder; a class may get
                                none); of each class's a_c, the first m_c are minival (M allotted in
                                proportion to the a_c), the next a_c - m_c trained on. A final run with
                                train_limit T + M and minival_limit 0 trains on exactly the same N.

The labels are read once per process from the shards' ``.cls`` members (no image bytes); a
multi-label dataset is stratified by each sample's primary class.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from dataclasses import dataclass

import numpy as np

from .shards import DataError, SplitInfo, shard_labels
from .stream import ReadPolicy

MINIVAL = "minival"


@dataclass(frozen=True)
class Selection:
    """Sorted positions of the training split: those trained on and those read as ``minival``."""

    train: tuple[int, ...]
    minival: tuple[int, ...]


def active(cfg_data) -> bool:
    """Whether the data section holds a minival (or a train limit) out of the training split."""
    return bool(cfg_data.minival_fraction) or cfg_data.train_limit is not None


def minival_source(cfg_data) -> str | None:
    """The split ``minival`` is drawn from (data.train_split), None when none is held out; DataError
    when data.path's kind cannot hold one out (:attr:`DataSource.holds_minival`)."""
    if not active(cfg_data):
        return None
    from pipeline.data.kinds import source_for

    if not source_for(cfg_data.path).holds_minival:
        raise DataError("data.minival_fraction: a minival is held out of a `vitp prep` dataset's train split, "
                        f"not of {cfg_data.path!r}")
    return cfg_data.train_split


def stored_split(cfg_data, name: str) -> str:
    """The dataset's split that reading split ``name`` reads (``minival``: data.train_split's part)."""
    return cfg_data.train_split if name == MINIVAL and active(cfg_data) else name


def key_hash(seed: int, key: str) -> int:
    """The 64-bit hash that orders a class's samples: the same on every machine and Python."""
    return int.from_bytes(hashlib.blake2b(f"{seed}/{key}".encode(), digest_size=8).digest(), "big")


def largest_remainder(total: int, weights) -> np.ndarray:
    """``total`` split into integers in proportion to ``weights`` [K] (Hamilton's method: floors, then
    one more to the largest remainders; ties to the lower index). Sums to ``total``."""
    w = np.asarray(weights, dtype=np.float64)
    if total <= 0 or w.sum() <= 0:
        return np.zeros(len(w), dtype=np.int64)
    quota = total * w / w.sum()
    out = np.floor(quota).astype(np.int64)
    rest = total - int(out.sum())
    order = np.lexsort((np.arange(len(w)), -(quota - out)))  # largest remainder first, then index
    out[order[:rest]] += 1
    return out


def select(keys: list[str], labels, num_classes: int, *, fraction: float = 0.0, seed: int = 0,
           train_limit: int | None = None, minival_limit: int | None = None, where: str = "") -> Selection:
    """The minival of a split whose position i holds ``keys[i]`` of class ``labels[i]`` (see the module
    docstring). A limit beyond the split is a DataError naming the key (``where``: the split, for it)."""
    labels = np.asarray(labels, dtype=np.int64)
    n = len(keys)
    h = np.array([key_hash(seed, k) for k in keys], dtype=np.uint64)
    by_class = [np.flatnonzero(labels == c) for c in range(num_classes)]
    by_class = [idx[np.lexsort((idx, h[idx]))] for idx in by_class]  # each class in hash order
    sizes = np.array([len(i) for i in by_class], dtype=np.int64)
    if train_limit is None:
        used = sizes
        held = np.where(sizes > 0, np.maximum(1, np.floor(fraction * sizes + 0.5)), 0).astype(np.int64)
        held = np.minimum(held, sizes) if fraction else np.zeros_like(sizes)
    else:
        m = minival_limit or 0
        if train_limit + m > n:
            key = "data.train_limit" if not m else "data.train_limit + data.minival_limit"
            raise DataError(f"{key}: {train_limit + m} examples asked of {where or 'the split'}, which has {n}")
        used = largest_remainder(train_limit + m, sizes)
        held = largest_remainder(m, used)
    train = np.concatenate([i[k:u] for i, k, u in zip(by_class, held, used)] + [np.zeros(0, np.int64)])
    mini = np.concatenate([i[:k] for i, k in zip(by_class, held)] + [np.zeros(0, np.int64)])
    return Selection(tuple(np.sort(train).tolist()), tuple(np.sort(mini).tolist()))


@functools.lru_cache(maxsize=8)
def _labels(sp: SplitInfo, num_classes: int, policy: ReadPolicy) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """(keys, primary labels) of every position of ``sp``, read from the ``.cls`` members only."""
    keys, labels = [], []
    for s, url in enumerate(sp.urls):
        got = shard_labels(url, num_classes, policy)
        for key, label in got if sp.keep is None else [got[i] for i in sp.keep[s] if i < len(got)]:
            keys.append(key)
            labels.append(label)
    if len(keys) != sp.num_samples:
        raise DataError(f"{sp.name}: {len(keys)} readable samples, _info.json says {sp.num_samples}; a minival "
                        "needs every label (run vitp verify on the dataset)")
    return tuple(keys), tuple(labels)


def selection(cfg_data, info) -> Selection:
    """The minival of ``cfg_data``'s training split of the dataset ``info`` describes."""
    sp = info.split(cfg_data.train_split)
    if cfg_data.train_limit is not None and cfg_data.train_limit + (cfg_data.minival_limit or 0) > sp.num_samples:
        select([""] * sp.num_samples, [0] * sp.num_samples, 1, train_limit=cfg_data.train_limit,
               minival_limit=cfg_data.minival_limit, where=f"split {sp.name!r} of {info.path}")
    keys, labels = _labels(sp, info.num_classes, ReadPolicy.of(cfg_data))
    return _selected(keys, labels, info.num_classes, cfg_data.minival_fraction, cfg_data.minival_seed,
                     cfg_data.train_limit, cfg_data.minival_limit, f"split {sp.name!r} of {info.path}")


@functools.lru_cache(maxsize=8)
def _selected(keys, labels, num_classes, fraction, seed, train_limit, minival_limit, where) -> Selection:
    return select(list(keys), labels, num_classes, fraction=fraction, seed=seed, train_limit=train_limit,
                  minival_limit=minival_limit, where=where)


def restricted(sp: SplitInfo, positions) -> SplitInfo:
    """``sp`` cut to the sorted ``positions``: the same shards, each holding only its kept samples
    (``keep``: per shard, the kept indices within it; ``lengths``: their counts). A split cut already
    is cut further (its positions are of its kept samples)."""
    cum = np.cumsum([0, *sp.lengths])
    pos = np.asarray(positions, dtype=np.int64)
    shard = np.searchsorted(cum, pos, side="right") - 1
    keep = tuple(tuple((pos[shard == s] - cum[s]).tolist()) for s in range(len(sp.urls)))
    excluded = None
    if sp.keep is not None:  # already cut (`vitp decontam`'s exclusions): positions count its kept samples
        if sp.excluded is not None:  # each left-out sample still counted with the kept one it stood with
            excluded = tuple(tuple(sp.excluded[s][j] for j in k) for s, k in enumerate(keep))
        keep = tuple(tuple(sp.keep[s][j] for j in k) for s, k in enumerate(keep))
    return dataclasses.replace(sp, num_samples=len(pos), lengths=tuple(len(k) for k in keep), keep=keep,
                               excluded=excluded)


def training_split(cfg_data, info, name: str) -> SplitInfo:
    """The split a training stream reads: ``name``, less its minival when it is data.train_split."""
    sp = info.split(name)
    if not active(cfg_data) or name != cfg_data.train_split:
        return sp
    sel = selection(cfg_data, info)
    if not sel.train:
        raise DataError(f"data.minival_fraction: {cfg_data.minival_fraction} leaves nothing of split {name!r} "
                        f"of {info.path} to train on")
    return restricted(sp, sel.train)


def evaluated_split(cfg_data, info, name: str) -> tuple[SplitInfo, tuple[int, ...] | None]:
    """(split, positions or None for all of it) that an evaluation of split ``name`` reads: ``minival``
    is positions of data.train_split when the data section holds one out."""
    if name == MINIVAL and active(cfg_data):
        sel = selection(cfg_data, info)
        if not sel.minival:
            raise DataError(f"data.minival_limit: 0 holds nothing out of split {cfg_data.train_split!r} of "
                            f"{info.path}; there is no minival to evaluate")
        return info.split(cfg_data.train_split), sel.minival
    return info.split(name), None
