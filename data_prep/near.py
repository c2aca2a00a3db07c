"""Near-duplicates of test images: a perceptual hash of each image and an index of the test sets' hashes.

The signature is a DCT pHash: the image in grey, area-resized to 32x32, its 2D DCT, and of the 8x8
lowest frequencies one bit each, set where the coefficient exceeds their median (the DC term left out
of the median). Resizing, recompression and a uniform brightness change move few of these bits. A
frame around a picture (flat bands of one colour at both ends of an axis: a border, a letterbox) is
trimmed before hashing; a picture's own flat edge (a sky) is not (see trim_box). A horizontal flip moves
many bits, and so does a crop (it rescales the picture): each test image is indexed with four hashes,
its own, its mirror's (which the DCT gives for free: mirroring x multiplies horizontal frequency k by
(-1)^k), its centre's (the 95% a small crop leaves) and that one's mirror's. Two images are
near-duplicates when their hashes differ in at most D bits (Hamming distance) and their colour
thumbnails agree (below).

The hash alone matches unrelated pictures by chance (a per-pair rate near 1e-4 on textured crops of
real photos: two crops that each hold one edge between two flat regions hash alike), which against a
few hundred thousand test images would reject most clean training images. So the hash only finds
candidates, and each is checked with a second signature of the trimmed picture (448 bytes): its 8x8
RGB thumbnail, and its 16x16 grey thumbnail less a Gaussian blur of it (sigma 1.5 px: the detail, where
the edge's two flat sides leave nothing and a texture shows). Each is compared by correlation, with
its mean taken out (a brightness or contrast change, JPEG noise and resizing move it little; another
picture, the same edge in other colours or over another texture, far). A test image keeps two, its
own and its centre's; their mirrors are column flips. Near-duplicates: within D bits on the hash, and
for one of the four, a colour correlation of at least MIN_COLOUR and a detail one of at least
MIN_DETAIL (``margin``: the smaller of the two excesses, >= 0; where either is grey, MIN_GREY on the
luma, the detail and the detail less its strongest row x column pattern, the one edge that two unrelated
crops of two regions share).

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

# the version covers the decision (MIN_* below) too: it is part of a prep plan's identity, so an output
# decontaminated under another rule is planned again, not reused (3: MIN_DETAIL 0.85 -> 0.87; 4: the trim
# takes off frames only, not a picture's own flat edge; 5: a grey pair's detail must agree past its
# strongest separable component too, MIN_GREY[2])
SIGNATURE, SIGNATURE_VERSION = "phash-dct-64+thumbs-448", 5
BANDS, BAND_BITS = 4, 16
_SIDE, _LOW = 32, 8
# mirroring the 32 columns multiplies the DCT's horizontal frequency k by (-1)^k
_FLIP = np.array([(-1.0) ** k for k in range(_LOW)], np.float32)[None, :]
_FLAT = 16  # grey levels: a row or column spanning fewer is flat (a frame's, where of one colour)
CENTRE = 0.95
_WORK = 128
VARIANTS = 4  # hashes per test image (reference_hashes)
# the second signature, uint8: the colour thumbnail [COLOUR, COLOUR, 3] then the grey one [DETAIL, DETAIL]
COLOUR, DETAIL, BLUR_SIGMA = 8, 16, 1.5
THUMB_BYTES = COLOUR * COLOUR * 3 + DETAIL * DETAIL
# set on bench/decontam.py's textured crops of real photos (the README's table): of 3.3e8 unrelated
# pairs, ~2.6e4 lie within 12 bits and none passes (at 0.85 one did, with the old trim); each transform
# keeps a recall of >= 0.989 over seeds 0 and 1 (the old trim, which framed small copies apart from their
# originals, left the quarter-size ones at 0.943-0.961)
MIN_COLOUR, MIN_DETAIL = 0.95, 0.87
# (luma, detail, the detail's rest) where either image is grey: the rest is the detail less its first
# singular component (the one edge or line along a row or column that two unrelated two-region crops
# share); on the same crops, the one grey pair that passed luma and detail (seed 1) reaches 0.84 on it,
# and every transform keeps a recall of >= 0.979 at 0.90 (a greyscale copy of a colour image 0.990)
MIN_GREY = 0.97, 0.90, 0.90


def grey(a: np.ndarray) -> np.ndarray:
    """RGB [H, W, 3] or grey [H, W] uint8 -> grey [H, W] uint8."""
    return a if a.ndim == 2 else cv2.cvtColor(a, cv2.COLOR_RGB2GRAY)


def _band(hi: np.ndarray, lo: np.ndarray) -> tuple[int, int]:
    """The brightest and darkest level of each row or column [n] uint8 -> (a, b): lines [0, a) and [b, n)
    are a frame's, the outer runs of flat lines (spanning at most _FLAT grey levels) each within _FLAT of
    its end's outermost line, the two ends alike within _FLAT; (0, n) where the axis has none (at most
    one end flat, the two unlike, or every line one flat colour)."""
    n = len(hi)
    flat = hi - lo <= _FLAT  # uint8: hi >= lo
    mid = hi.astype(np.int16) + lo  # twice each line's middle level
    if not n or not (flat[0] and flat[-1]) or abs(int(mid[0]) - int(mid[-1])) > 2 * _FLAT:
        return 0, n
    top = flat & (np.abs(mid - mid[0]) <= 2 * _FLAT)
    a = int(np.argmin(top)) if not top.all() else n
    if a == n:
        return 0, n
    bottom = flat & (np.abs(mid - mid[-1]) <= 2 * _FLAT)
    return a, n - int(np.argmin(bottom[::-1]))


def trim_box(g: np.ndarray) -> tuple[int, int, int, int]:
    """g: [H, W] grey -> (y0, y1, x0, x1) without a frame put around the picture: bands of flat lines of
    one colour at both ends of an axis, the two of the same colour (a border, a letter- or pillarbox),
    unless trimming them would leave less than half of the side. A band at one end only is the
    picture's own (a flat sky, a plain wall) and stays: how much of it reads as flat hangs on its
    noise, and so on the picture's size, which would frame a resized copy differently from its
    original. Repeated: a frame's rows are flat only once its columns are off. A trimmed side loses one
    line more: where the area resize cut a frame's edge, the line it shares with the picture is neither
    flat nor the picture's, and its step would read as detail."""
    y0, y1, x0, x1 = 0, g.shape[0], 0, g.shape[1]
    for _ in range(3):
        inner = g[y0:y1, x0:x1]
        h, w = inner.shape
        (a, b), (c, d) = _band(inner.max(axis=1), inner.min(axis=1)), _band(inner.max(axis=0), inner.min(axis=0))
        a, b, c, d = a + (a > 0), b - (b < h), c + (c > 0), d - (d < w)
        if (a, b, c, d) == (0, h, 0, w) or 2 * (b - a) < g.shape[0] or 2 * (d - c) < g.shape[1]:
            break
        y0, y1, x0, x1 = y0 + a, y0 + b, x0 + c, x0 + d
    return y0, y1, x0, x1


def trim(g: np.ndarray) -> np.ndarray:
    """g: [H, W] grey -> g inside trim_box."""
    y0, y1, x0, x1 = trim_box(g)
    return g[y0:y1, x0:x1]


def _low_dct(g: np.ndarray) -> np.ndarray:
    """g: [H, W] grey uint8 -> the 8x8 lowest DCT frequencies of its 32x32 thumbnail."""
    small = cv2.resize(g, (_SIDE, _SIDE), interpolation=cv2.INTER_AREA).astype(np.float32)
    return cv2.dct(small)[:_LOW, :_LOW]


def _centre(g: np.ndarray, keep: float) -> np.ndarray:
    h, w = g.shape[:2]
    dy, dx = round(h * (1 - keep) / 2), round(w * (1 - keep) / 2)
    return g[dy:h - dy, dx:w - dx]


def _bits(d: np.ndarray) -> int:
    flat = d.ravel()
    median = np.partition(flat[1:], 31)[31]  # of the 63 AC terms: np.median's answer, at a tenth of its cost
    return int.from_bytes(np.packbits(flat > median).tobytes(), "big")


def _small(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """a: [H, W(, 3)] -> (grey [h, w], colour [h, w(, 3)]), area-reduced by a whole factor to a longer
    side of 128-255 px (OpenCV's fast path: a fractional area resize costs 20x more), the frame trimmed
    at that size, where JPEG noise on a flat frame is averaged away."""
    f = max(a.shape[:2]) // _WORK
    if f > 1:  # before the grey conversion: it then converts f^2 times fewer pixels
        a = cv2.resize(a, None, fx=1 / f, fy=1 / f, interpolation=cv2.INTER_AREA)
    y0, y1, x0, x1 = trim_box(g := grey(a))
    return g[y0:y1, x0:x1], a[y0:y1, x0:x1]


def thumb(c: np.ndarray) -> np.ndarray:
    """c: [h, w, 3] RGB or [h, w] grey uint8 -> its second signature [THUMB_BYTES] uint8 (area-resized)."""
    t = cv2.resize(c, (COLOUR, COLOUR), interpolation=cv2.INTER_AREA)
    t = np.repeat(t[..., None], 3, axis=2) if t.ndim == 2 else t
    return np.concatenate([t.ravel(), cv2.resize(grey(c), (DETAIL, DETAIL), interpolation=cv2.INTER_AREA).ravel()])


def phash(a: np.ndarray) -> int:
    """a: [H, W, 3] RGB or [H, W] grey uint8 -> its 64-bit perceptual hash."""
    return _bits(_low_dct(_small(a)[0]))


def signature(a: np.ndarray) -> tuple[int, np.ndarray]:
    """A training image [H, W(, 3)] uint8 -> (its hash, its second signature [THUMB_BYTES] uint8)."""
    g, c = _small(a)
    return _bits(_low_dct(g)), thumb(c)


def reference(a: np.ndarray) -> tuple[tuple[int, ...], np.ndarray]:
    """A test image's signatures: (its VARIANTS hashes: the image's, its mirror's, and its centre's (the
    95% a small crop leaves; a crop shrinks the picture's scale, which moves the low frequencies) and
    that one's mirror's; second signatures [2, THUMB_BYTES] uint8 of the image and of its centre)."""
    g, c = _small(a)
    whole, centre = _low_dct(g), _low_dct(_centre(g, CENTRE))
    hashes = _bits(whole), _bits(whole * _FLIP), _bits(centre), _bits(centre * _FLIP)
    return hashes, np.stack([thumb(c), thumb(_centre(c, CENTRE))])


def reference_hashes(a: np.ndarray) -> tuple[int, ...]:
    """reference()'s hashes alone."""
    return reference(a)[0]


def _unit(v: np.ndarray) -> np.ndarray:
    """[..., K] -> float32 [..., K], mean 0, norm 1 (a flat one: all 0, so it correlates with nothing)."""
    v = v.astype(np.float32)
    v -= v.mean(axis=-1, keepdims=True)
    n = np.linalg.norm(v, axis=-1, keepdims=True)
    return np.divide(v, n, out=np.zeros_like(v), where=n > 1e-3)


def _blur_matrix() -> np.ndarray:
    """[DETAIL, DETAIL]: K with K @ g @ K.T == cv2.GaussianBlur(g, sigma=BLUR_SIGMA) for a [DETAIL, DETAIL] g
    (the blur is separable; a row of ones stays ones, so blurring the one-row image e_j 1^T gives
    column j of K): one batched product blurs thousands of thumbnails."""
    cols = []
    for j in range(DETAIL):
        e = np.zeros((DETAIL, DETAIL), np.float32)
        e[j] = 1.0
        cols.append(cv2.GaussianBlur(e, (0, 0), BLUR_SIGMA)[:, 0])
    return np.stack(cols, axis=1)


BLUR_MATRIX = _blur_matrix()


def _detail(t: np.ndarray) -> np.ndarray:
    """thumbs [..., THUMB_BYTES] -> the detail [..., DETAIL, DETAIL] float32: the grey thumbnail less its blur."""
    g = t[..., COLOUR * COLOUR * 3:].reshape(*t.shape[:-1], DETAIL, DETAIL).astype(np.float32)
    return g - BLUR_MATRIX @ g @ BLUR_MATRIX.T


def _parts(t: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """thumbs [..., THUMB_BYTES] -> (colour [..., 192], its luma [..., 64], detail [..., 256]: unit vectors;
    is it grey [...]: bool)."""
    colour = t[..., :COLOUR * COLOUR * 3].reshape(*t.shape[:-1], COLOUR, COLOUR, 3).astype(np.float32)
    detail = _detail(t).reshape(*t.shape[:-1], DETAIL * DETAIL)
    luma = colour @ np.array([0.299, 0.587, 0.114], np.float32)
    is_grey = np.ptp(colour, axis=-1).max(axis=(-2, -1)) <= 2
    flat = colour.reshape(*t.shape[:-1], COLOUR * COLOUR * 3)
    return _unit(flat), _unit(luma.reshape(*t.shape[:-1], COLOUR * COLOUR)), _unit(detail), is_grey


def _rest(t: np.ndarray) -> np.ndarray:
    """thumbs [..., THUMB_BYTES] -> the detail less its first singular component (its strongest pattern
    of the form row profile x column profile: an edge or line along a row or column, a bar), a unit
    vector [..., 256]. A crop of one edge between two flat or unlike regions has little else, and
    what is left of two such crops does not agree; a copy's texture is left whole."""
    d = _detail(t)
    u, s, vt = np.linalg.svd(d)
    rest = d - s[..., :1, None] * u[..., :, :1] * vt[..., :1, :]
    return _unit(rest.reshape(*t.shape[:-1], DETAIL * DETAIL))


def _mirrored(t: np.ndarray) -> np.ndarray:
    """A second signature [THUMB_BYTES] -> its mirror's (both thumbnails' columns flipped)."""
    colour = t[:COLOUR * COLOUR * 3].reshape(COLOUR, COLOUR, 3)[:, ::-1]
    return np.concatenate([colour.ravel(), t[COLOUR * COLOUR * 3:].reshape(DETAIL, DETAIL)[:, ::-1].ravel()])


def margin(train: np.ndarray, refs: np.ndarray) -> np.ndarray:
    """train: [THUMB_BYTES]; refs: [N, 2, THUMB_BYTES] (reference()'s) -> [N] float32: for the best of
    each test image's own, its centre's and their mirrors, min(colour - MIN_COLOUR, detail - MIN_DETAIL)
    of the correlations with the training image's (>= 0: a near-duplicate). Where either is grey (a
    greyscale copy of a colour test image, a grey test set and a colour copy on the web), the colour
    correlation is of their luma, and it, the detail's and that of the detail's rest (``_rest``: less
    its strongest row x column pattern) must reach MIN_GREY: without colour, two crops that share one
    dominant edge or line over unlike, or flat, content agree on luma and detail, not on the rest. A
    test image's mirror against the training image is the test image against the training image's
    mirror."""
    rc, rl, rd, r_grey = _parts(refs)  # [N, 2, K]
    out, rr = [], None
    for t in (train, _mirrored(train)):
        tc, tl, td, t_grey = _parts(t)
        grey_pair = r_grey | t_grey
        colour = np.where(grey_pair, rl @ tl - MIN_GREY[0], rc @ tc - MIN_COLOUR)
        m = np.minimum(colour, rd @ td - np.where(grey_pair, MIN_GREY[1], MIN_DETAIL))
        if grey_pair.any():  # the rest costs an SVD per thumbnail: only where a pair is grey
            rr = _rest(refs) if rr is None else rr
            m = np.where(grey_pair, np.minimum(m, rr @ _rest(t) - MIN_GREY[2]), m)
        out.append(m)
    return np.concatenate(out, axis=1).max(axis=1)


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
    margin: float | None = None  # of the second signature (see margin(); None: an index of hashes alone)


class NearIndex:
    """Signatures of test images -> the nearest within ``threshold`` bits whose second signature agrees
    (see the module's docstring).

    hashes: [N] uint64 (VARIANTS rows per test image, see reference); owner: [N] int32, the test image
    of each row; thumbs: [n, 2, THUMB_BYTES] uint8 per test image, or None (hashes alone: the
    benchmark's baseline). The four bands' tables are one: key = band << 16 | the band's 16 bits;
    rows [4N] int32 and their hashes [4N] uint64 sorted by key; start [4 x 65536 + 1], where each key's
    rows begin (so one lookup probes all four bands in one vectorised step).
    """

    def __init__(self, hashes: np.ndarray, owner: np.ndarray, threshold: int, thumbs: np.ndarray | None = None):
        self.hashes, self.owner, self.threshold = hashes.astype(np.uint64), owner.astype(np.int32), threshold
        self.thumbs = thumbs
        self.masks = _masks(threshold // BANDS)
        keys = np.concatenate([self._band(self.hashes, b) + (b << BAND_BITS) for b in range(BANDS)])
        order = np.argsort(keys, kind="stable")
        self.rows = (order % max(len(self.hashes), 1)).astype(np.int32)
        self.sorted_hashes = self.hashes[self.rows]
        self.start = np.searchsorted(keys[order], np.arange(BANDS * 2**BAND_BITS + 1)).astype(np.int64)

    @classmethod
    def build(cls, hashes: list[tuple[int, ...]], threshold: int, thumbs: np.ndarray | None = None) -> NearIndex:
        """``hashes``: reference() hashes of each test image, in the caller's order; ``thumbs``: their
        second signatures [n, 2, THUMB_BYTES] (None: hashes alone)."""
        owner = np.array([i for i, hs in enumerate(hashes) for _ in hs], np.int32)
        return cls(np.array([x for hs in hashes for x in hs], np.uint64), owner, threshold, thumbs)

    @staticmethod
    def _band(h, b: int):
        return ((h >> np.uint64(b * BAND_BITS)) & np.uint64(2**BAND_BITS - 1)).astype(np.int64)

    def __len__(self) -> int:
        return int(self.owner.max()) + 1 if len(self.owner) else 0

    def nearest(self, h: int, t: np.ndarray | None = None) -> Match | None:
        """The closest test image within the threshold whose thumbnail agrees with ``t`` (the lowest
        number among equals), or None. h, t: signature() of the training image (t: only for an index
        with second signatures)."""
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
        return self._verified(d[ok], self.owner[self.rows[at[ok]]], t)

    def _verified(self, d: np.ndarray, who: np.ndarray, t: np.ndarray | None) -> Match | None:
        """Candidates (distance [k], test image [k]) -> the best whose second signature agrees with t."""
        sim = None
        if self.thumbs is not None:
            if t is None:
                raise ValueError("this index checks a second signature: give the training image's (signature())")
            tests, back = np.unique(who, return_inverse=True)
            sim = margin(t, self.thumbs[tests])[back]
            keep = np.flatnonzero(sim >= 0)
            d, who, sim = d[keep], who[keep], sim[keep]
            if not len(keep):
                return None
        best = np.lexsort((who, d))[0]
        return Match(int(d[best]), int(who[best]), None if sim is None else round(float(sim[best]), 4))

    def nearest_brute(self, h: int, t: np.ndarray | None = None) -> Match | None:
        """The same answer by scanning every hash (tests, and the bench's baseline)."""
        d = np.bitwise_count(self.hashes ^ np.uint64(h))
        ok = np.flatnonzero(d <= self.threshold)
        if not len(ok):
            return None
        return self._verified(d[ok], self.owner[ok], t)

    def to_bytes(self) -> bytes:
        buf = io.BytesIO()
        extra = {} if self.thumbs is None else {"thumbs": self.thumbs}
        np.savez(buf, hashes=self.hashes, owner=self.owner, threshold=np.int64(self.threshold), **extra)
        return buf.getvalue()

    @classmethod
    def from_bytes(cls, data: bytes) -> NearIndex:
        z = np.load(io.BytesIO(data), allow_pickle=False)
        return cls(z["hashes"], z["owner"], int(z["threshold"]), z["thumbs"] if "thumbs" in z.files else None)
