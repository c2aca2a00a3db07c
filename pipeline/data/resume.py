"""A training stream resumed mid-epoch without re-reading what it already consumed.

A stream's samples go through a seeded shuffle buffer, so the samples after a checkpoint depend on
what the buffer held then. :func:`resumed` replays the shuffle on positions alone (one draw per
consumed sample, no I/O), reads the samples still in the buffer by position, and reads the rest of
the stream's range from its first unread sample, at that sample's byte offset (prep records
offsets in the shard stats). :func:`dropping` is the fallback: read again and drop.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from .augment import replay_shuffle, shuffle_buffer
from .shards import SkipCounts, read_segments, read_slices


def dropping(items: Iterator, skip: int, counts: SkipCounts) -> Iterator:
    """``items`` after the first ``skip`` (read again, not counted again: counted before the checkpoint)."""
    counts.active = skip == 0
    for x in items:
        if skip:
            skip -= 1
            counts.active = skip == 0
            continue
        yield x


def resumed(p, segs: list, counts: SkipCounts, rng: np.random.Generator, skip: int) -> Iterator:
    """The shuffled samples of a stream (``p``: its StreamSpec, ``segs``: its slices) after the first
    ``skip``, without reading those: the shuffle is replayed on positions (``rng`` ends where the
    first run's was), the samples still in its buffer are read by position, and the rest of the
    range is read from its byte offset on. Exact when every position of the prefix was readable
    (the loader falls back to re-reading otherwise)."""
    sp = p.split
    kw = dict(num_classes=p.num_classes, multi_label=p.multi_label, policy=p.policy, keep=sp.keep,
              excluded=sp.excluded)
    urls, lengths = sp.urls, list(sp.lengths)
    n = sum(hi - lo for _, lo, hi in segs)
    if p.shuffle_buffer <= 1:
        yield from read_segments(urls, lengths, from_position(segs, skip), counts, **kw)
        return
    buf_pos, nxt, drained = replay_shuffle(n, p.shuffle_buffer, rng, skip)
    counts.active = False  # the buffer's samples were read (and counted) before the checkpoint
    held = dict(zip(sorted(buf_pos), read_stream_positions(urls, segs, sorted(buf_pos), counts, **kw)))
    counts.active = True
    buf = [held[q] for q in buf_pos if q in held]
    if drained:
        yield from buf
        return
    rest = read_segments(urls, lengths, from_position(segs, nxt), counts, **kw)
    yield from shuffle_buffer(rest, p.shuffle_buffer, rng, buf=buf)


def from_position(segs: list, q: int) -> list:
    """The slices [(shard, lo, hi)] of a stream from its position ``q`` on."""
    out, at = [], 0
    for s, lo, hi in segs:
        if at + hi - lo > q:
            out.append((s, lo + max(0, q - at), hi))
        at += hi - lo
    return out


def read_stream_positions(urls, segs: list, positions: list[int], counts: SkipCounts, **kw) -> Iterator:
    """Samples at the sorted stream ``positions`` (a resumed shuffle buffer's): per slice, one read
    from its first wanted sample's offset to its last, image bytes of wanted samples only."""
    at, i, slices = 0, 0, []
    for s, lo, hi in segs:
        wanted = []
        while i < len(positions) and positions[i] < at + hi - lo:
            wanted.append(lo + positions[i] - at)
            i += 1
        at += hi - lo
        if wanted:
            slices.append((s, wanted[0], wanted[-1] + 1, set(wanted)))
    yield from read_slices(urls, slices, counts, **kw)
