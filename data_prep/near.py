"""Near-duplicates of test images: a perceptual hash of each image and an index of the test sets' hashes.

The signature is a DCT pHash: the image in grey, area-resized to 32x32, its 2D DCT, and of the 8x8
lowest frequencies one bit each, set where the coefficient exceeds their median (the DC term left out
of the median). Resizing, recompression and a uniform brightness change move few of these bits. A
frame around a picture (flat outer rows and columns) is trimmed before hashing. A horizontal flip moves
many bits, and so does a crop (it rescales the picture): each test image is indexed with four hashes,
its own, its mirror's (which the DCT gives for free: mirroring x multiplies horizontal frequency k by
(-1)^k), its centre's (the 95% a small crop leaves) and that one's mirror's. Two images are
near-duplicates when their hashes differ in at most D bits (Hamming distance).

The index is multi-index hashing (Norouzi et al., 2012): the 64 bits cut into 4 bands of 16; if two
hashes lie within D bits, one band differs in at most D // 4 of them (pigeonhole), so a lookup probes,
in each band, the values within D // 4 bits of the query's band (137 for D < 12, 697 for D < 16)
through a table of offsets, and checks the candidates found with the whole hash. Cost per lookup: the
probes plus ~4n/65536 candidates per probe, for n test images; memory 4 x (8 + 4 + 4 x 12) bytes per
test image.
"""

from __future__ import annotations

import io
import itertools
from dataclasses import dataclass

import cv2
import numpy as np

SIGNATURE, SIGNATURE_VERSION = "phash-dct-64", 1
BANDS, BAND_BITS = 4, 16
_SIDE, _LOW = 32, 8
# mirroring the 32 columns multiplies the DCT's horizontal frequency k by (-1)^k
_FLIP = np.array([(-1.0) ** k for k in range(_LOW)], np.float32)[None, :]
_FLAT = 16  # grey levels: a row or column spanning fewer is part of a frame
CENTRE = 0.95
_WORK = 128
VARIANTS = 4  # hashes per test image (reference_hashes)


def grey(a: np.ndarray) -> np.ndarray:
    """RGB [H, W, 3] or grey [H, W] uint8 -> grey [H, W] uint8."""
    return a if a.ndim == 2 else cv2.cvtColor(a, cv2.COLOR_RGB2GRAY)


def trim(g: np.ndarray) -> np.ndarray:
    """g: [H, W] grey -> without its flat outer rows and columns (a frame or border put around a
    picture), unless that would leave less than half of either side (a mostly flat image)."""
    def span(flat: np.ndarray) -> tuple[int, int]:
        busy = np.flatnonzero(~flat)
        return (int(busy[0]), int(busy[-1]) + 1) if len(busy) else (0, len(flat))

    y0, y1 = span(np.ptp(g, axis=1) <= _FLAT)
    x0, x1 = span(np.ptp(g, axis=0) <= _FLAT)
    if 2 * (y1 - y0) < g.shape[0] or 2 * (x1 - x0) < g.shape[1]:
        return g
    return g[y0:y1, x0:x1]


def _low_dct(g: np.ndarray) -> np.ndarray:
    """g: [H, W] grey uint8 -> the 8x8 lowest DCT frequencies of its 32x32 thumbnail."""
    small = cv2.resize(g, (_SIDE, _SIDE), interpolation=cv2.INTER_AREA).astype(np.float32)
    return cv2.dct(small)[:_LOW, :_LOW]


def _centre(g: np.ndarray, keep: float) -> np.ndarray:
    h, w = g.shape
    dy, dx = round(h * (1 - keep) / 2), round(w * (1 - keep) / 2)
    return g[dy:h - dy, dx:w - dx]


def _bits(d: np.ndarray) -> int:
    flat = d.ravel()
    median = np.partition(flat[1:], 31)[31]  # of the 63 AC terms: np.median's answer, at a tenth of its cost
    return int.from_bytes(np.packbits(flat > median).tobytes(), "big")


def _small_grey(a: np.ndarray) -> np.ndarray:
    """a: [H, W(, 3)] -> grey, area-reduced by a whole factor to a longer side of 128-255 px (OpenCV's
    fast path: a fractional area resize costs 20x more), its frame trimmed at that size, where JPEG
    noise on a flat frame is averaged away."""
    f = max(a.shape[:2]) // _WORK
    if f > 1:  # before the grey conversion: it then converts f^2 times fewer pixels
        a = cv2.resize(a, None, fx=1 / f, fy=1 / f, interpolation=cv2.INTER_AREA)
    return trim(grey(a))


def phash(a: np.ndarray) -> int:
    """a: [H, W, 3] RGB or [H, W] grey uint8 -> its 64-bit perceptual hash (a training image's)."""
    return _bits(_low_dct(_small_grey(a)))


def reference_hashes(a: np.ndarray) -> tuple[int, ...]:
    """A test image's hashes: the image's, its mirror's, and its centre's (the 95% a small crop leaves;
    a crop shrinks the picture's scale, which moves the low frequencies) and that one's mirror's."""
    g = _small_grey(a)
    whole, centre = _low_dct(g), _low_dct(_centre(g, CENTRE))
    return _bits(whole), _bits(whole * _FLIP), _bits(centre), _bits(centre * _FLIP)


def distance(a: int, b: int) -> int:
    return (a ^ b).bit_count()


def _masks(radius: int) -> np.ndarray:
    """Every 16-bit value with at most ``radius`` bits set: the XOR masks one band's probes use."""
    out = [0]
    for r in range(1, radius + 1):
        out += [sum(1 << i for i in c) for c in itertools.combinations(range(BAND_BITS), r)]
    return np.array(out, np.int64)


@dataclass
class Match:
    distance: int
    test: int  # the test image's number in the index (names: the caller's list)


class NearIndex:
    """Hashes of test images (each with its variants) -> the nearest within ``threshold`` bits.

    hashes: [N] uint64 (VARIANTS rows per test image, see reference_hashes); owner: [N] int32, the
    test image of each row. The four bands' tables are one: key = band << 16 | the band's 16 bits;
    rows [4N] int32 and their hashes [4N] uint64 sorted by key; start [4 x 65536 + 1], where each key's
    rows begin (so one lookup probes all four bands in one vectorised step).
    """

    def __init__(self, hashes: np.ndarray, owner: np.ndarray, threshold: int):
        self.hashes, self.owner, self.threshold = hashes.astype(np.uint64), owner.astype(np.int32), threshold
        self.masks = _masks(threshold // BANDS)
        keys = np.concatenate([self._band(self.hashes, b) + (b << BAND_BITS) for b in range(BANDS)])
        order = np.argsort(keys, kind="stable")
        self.rows = (order % max(len(self.hashes), 1)).astype(np.int32)
        self.sorted_hashes = self.hashes[self.rows]
        self.start = np.searchsorted(keys[order], np.arange(BANDS * 2**BAND_BITS + 1)).astype(np.int64)

    @classmethod
    def build(cls, hashes: list[tuple[int, ...]], threshold: int) -> NearIndex:
        """``hashes``: reference_hashes() of each test image, in the caller's order."""
        owner = np.array([i for i, hs in enumerate(hashes) for _ in hs], np.int32)
        return cls(np.array([x for hs in hashes for x in hs], np.uint64), owner, threshold)

    @staticmethod
    def _band(h, b: int):
        return ((h >> np.uint64(b * BAND_BITS)) & np.uint64(2**BAND_BITS - 1)).astype(np.int64)

    def __len__(self) -> int:
        return int(self.owner.max()) + 1 if len(self.owner) else 0

    def nearest(self, h: int) -> Match | None:
        """The closest test image within the threshold (the lowest number among equals), or None."""
        keys = np.array([(b << BAND_BITS) | ((h >> (b * BAND_BITS)) & 0xFFFF) for b in range(BANDS)], np.int64)
        probes = (keys[:, None] ^ self.masks[None, :]).ravel()
        lo, n = self.start[probes], self.start[probes + 1] - self.start[probes]
        total = int(n.sum())
        if not total:
            return None
        at = np.repeat(lo - np.cumsum(n) + n, n) + np.arange(total)  # the probes' ranges, concatenated
        d = np.bitwise_count(self.sorted_hashes[at] ^ np.uint64(h))
        ok = np.flatnonzero(d <= self.threshold)
        if not len(ok):
            return None
        d, who = d[ok], self.owner[self.rows[at[ok]]]
        best = np.lexsort((who, d))[0]
        return Match(int(d[best]), int(who[best]))

    def nearest_brute(self, h: int) -> Match | None:
        """The same answer by scanning every hash (tests, and the bench's baseline)."""
        d = np.bitwise_count(self.hashes ^ np.uint64(h))
        ok = np.flatnonzero(d <= self.threshold)
        if not len(ok):
            return None
        best = ok[np.lexsort((self.owner[ok], d[ok]))[0]]
        return Match(int(d[best]), int(self.owner[best]))

    def to_bytes(self) -> bytes:
        buf = io.BytesIO()
        np.savez(buf, hashes=self.hashes, owner=self.owner, threshold=np.int64(self.threshold))
        return buf.getvalue()

    @classmethod
    def from_bytes(cls, data: bytes) -> NearIndex:
        z = np.load(io.BytesIO(data), allow_pickle=False)
        return cls(z["hashes"], z["owner"], int(z["threshold"]))
