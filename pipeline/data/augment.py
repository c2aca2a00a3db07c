"""Per-sample image transforms (bytes → uint8 [3, H, W]) and on-device batch ops (normalize); mixup lives in mixing.py.

Every random choice a train transform makes is drawn from the integer ``seed`` it is called with, so
a sample's augmentation depends only on (run seed, epoch, rank, stream, position) and not on what the
process did before; the loader can then resume by skipping raw samples without decoding them.

Decode and resize (bench/loader.py): the crop box is chosen from the header alone, then
libjpeg-turbo (simplejpeg) decodes at one of its n/8 DCT scales that still leaves the crop a 2x
reduction to the output size, and Pillow's antialiased bilinear resize finishes it from the exact
(fractional) box; when no scale leaves 2x, a full decode and OpenCV's area average (bilinear when
enlarging). data_prep.images.dct_numerator says why: the DCT scales alone alias fine texture.
tests/unit/test_image_quality.py holds the crops to a full decode + area resize. Anything that is not
a plain YCbCr/grey/RGB JPEG (PNG, WebP, CMYK, ...) is decoded by Pillow at full size.
"""

from __future__ import annotations

import io
import math
import random
from collections.abc import Iterator

import cv2
import numpy as np
import simplejpeg
import torch
from PIL import Image
from torch.utils.data import default_collate

from data_prep.images import dct_numerator, decode_jpeg_scaled, resize_region

cv2.setNumThreads(1)  # per-sample work in loader workers: OpenCV's own threads only fight them


class DecodeError(ValueError):
    """An image member that cannot be decoded (the loader counts and skips it)."""


class EncodedImage:
    """An encoded image: its size from the header, and a decode to RGB uint8 [H, W, 3], at a DCT
    scale n/8 (``scalable``: plain JPEGs) or at full size (other formats; n is then ignored)."""

    __slots__ = ("data", "w", "h", "_pil")

    def __init__(self, data: bytes):
        self.data, self._pil = data, None
        if data[:2] == b"\xff\xd8":
            try:
                h, w, colorspace, _ = simplejpeg.decode_jpeg_header(data)
            except ValueError:
                colorspace = ""
            if colorspace in ("YCbCr", "Gray", "RGB"):
                self.w, self.h = w, h
                return
        try:
            self._pil = Image.open(io.BytesIO(data))
        except Exception as e:  # PIL raises UnidentifiedImageError, OSError, SyntaxError, ...
            raise DecodeError(f"cannot identify image: {e}") from None
        self.w, self.h = self._pil.size

    @property
    def scalable(self) -> bool:
        return self._pil is None

    def scale_for(self, box_w: int, box_h: int, out_w: int, out_h: int) -> int:
        """n of the n/8 decode scale for resizing a box_w x box_h region to out_w x out_h."""
        return dct_numerator(box_w, box_h, out_w, out_h, self.w, self.h) if self.scalable else 8

    def decode(self, n: int = 8) -> np.ndarray:
        if self._pil is None:
            try:
                return decode_jpeg_scaled(self.data, self.w, self.h, n)
            except ValueError as e:  # corrupt or truncated (strict: libjpeg warnings are errors too)
                raise DecodeError(f"cannot decode image: {e}") from None
        im = self._pil
        try:
            im.load()  # forces the (possibly truncated) decode
            return np.asarray(im if im.mode == "RGB" else im.convert("RGB"))
        except Exception as e:
            raise DecodeError(f"cannot decode image: {e}") from None


def decode_crop(src: EncodedImage, box: tuple[int, int, int, int], out_w: int, out_h: int,
                cubic: bool = False) -> np.ndarray:
    """The crop ``box`` = (left, top, width, height) of ``src`` → uint8 [out_h, out_w, 3], decoded at
    the DCT scale that leaves the crop a >= 2x reduction (full size when none does)."""
    x, y, cw, ch = box
    n = src.scale_for(cw, ch, out_w, out_h)
    return resize_region(src.decode(n), n, (x, y, x + cw, y + ch), (out_w, out_h), cubic)


def _chw(a: np.ndarray) -> torch.Tensor:
    """uint8 [H, W, 3] (any strides) → contiguous uint8 [3, H, W]."""
    return torch.from_numpy(np.ascontiguousarray(a.transpose(2, 0, 1)))


def to_tensor(im: Image.Image) -> torch.Tensor:
    """PIL RGB → uint8 [3, H, W]."""
    return _chw(np.asarray(im, dtype=np.uint8))


def inception_crop_box(w: int, h: int, rng: random.Random, scale=(0.08, 1.0),
                       ratio=(3 / 4, 4 / 3)) -> tuple[int, int, int, int]:
    """Random area/aspect crop ("Inception crop", Szegedy et al.): (left, top, width, height).

    Area fraction uniform in ``scale``, log-aspect uniform in ``ratio``; ten tries, then the largest
    centred crop whose aspect ratio lies within ``ratio``.
    """
    area = w * h
    log_lo, log_hi = math.log(ratio[0]), math.log(ratio[1])
    for _ in range(10):
        target = area * rng.uniform(scale[0], scale[1])
        aspect = math.exp(rng.uniform(log_lo, log_hi))
        cw = int(round(math.sqrt(target * aspect)))
        ch = int(round(math.sqrt(target / aspect)))
        if 0 < cw <= w and 0 < ch <= h:
            return rng.randint(0, w - cw), rng.randint(0, h - ch), cw, ch
    aspect = w / h
    if aspect < ratio[0]:
        cw, ch = w, int(round(w / ratio[0]))
    elif aspect > ratio[1]:
        cw, ch = int(round(h * ratio[1])), h
    else:
        cw, ch = w, h
    return (w - cw) // 2, (h - ch) // 2, cw, ch


class TrainTransform:
    """bytes → uint8 [3, S, S]: inception crop (area in ``crop_scale``) + resize, flip, RandAugment.
    ``random_crop=False``: the whole image resized to S × S instead (BiT's VTAB tasks where a crop
    changes the label: a count, a distance, a location).

    ``randaugment`` is a timm config string ("rand-m9-mstd0.5"); timm's ops draw from the global
    ``random``/``numpy`` generators, so those are seeded per sample and restored afterwards.
    """

    def __init__(self, img_size: int, crop_scale=(0.08, 1.0), hflip: bool = True,
                 randaugment: str | None = None, fill=(128, 128, 128), *, random_crop: bool = True):
        self.size = int(img_size)
        self.random_crop = random_crop
        self.scale = (float(crop_scale[0]), float(crop_scale[1]))
        self.hflip = hflip
        self.ra = None
        if randaugment:
            from timm.data import rand_augment_transform

            hp = {"translate_const": int(self.size * 0.45), "img_mean": tuple(fill)}
            try:
                self.ra = rand_augment_transform(randaugment, hp)
            except Exception as e:
                raise ValueError(f"data.randaugment: invalid timm RandAugment string {randaugment!r} ({e})") from None

    def __call__(self, data: bytes, seed: int) -> torch.Tensor:
        rng = random.Random(seed)
        src = EncodedImage(data)
        w, h, s = src.w, src.h, self.size
        # the crop box is known before decoding, so the decode can be reduced to what the crop needs
        box = inception_crop_box(w, h, rng, self.scale) if self.random_crop else (0, 0, w, h)
        a = decode_crop(src, box, s, s)
        if self.hflip and rng.random() < 0.5:
            a = a[:, ::-1]
        if self.ra is not None:
            return to_tensor(self._randaugment(Image.fromarray(np.ascontiguousarray(a)), rng.getrandbits(32)))
        return _chw(a)

    def _randaugment(self, im: Image.Image, seed: int) -> Image.Image:
        py_state, np_state = random.getstate(), np.random.get_state()
        random.seed(seed)
        np.random.seed(seed)
        try:
            return self.ra(im)
        finally:
            random.setstate(py_state)
            np.random.set_state(np_state)


class EvalTransform:
    """bytes → uint8 [3, S, S]. ``crop_pct < 1``: shorter side to S / crop_pct (bicubic), centre crop S.
    ``crop_pct == 1``: resize straight to S × S (as big_vision's ViT evaluation does)."""

    def __init__(self, img_size: int, crop_pct: float = 1.0):
        self.size = int(img_size)
        self.crop_pct = float(crop_pct)

    def __call__(self, data: bytes, seed: int = 0) -> torch.Tensor:
        src = EncodedImage(data)
        w, h, s = src.w, src.h, self.size
        if self.crop_pct >= 1.0:
            return _chw(decode_crop(src, (0, 0, w, h), s, s, cubic=True))
        short = int(math.floor(s / self.crop_pct))
        tw, th = (short, max(short, round(h * short / w))) if w <= h else (max(short, round(w * short / h)), short)
        a = decode_crop(src, (0, 0, w, h), tw, th, cubic=True)
        left, top = (tw - s) // 2, (th - s) // 2
        return _chw(a[top:top + s, left:left + s])


def label_batch(labels: list, classes: int | None = None) -> torch.Tensor:
    """Labels of a batch → int64 [B]; with ``classes`` (multi-label: each label a tuple of class
    indices) → multi-hot bool [B, classes]."""
    if classes is None:
        return torch.tensor(labels, dtype=torch.int64)
    out = torch.zeros(len(labels), classes, dtype=torch.bool)
    for i, ls in enumerate(labels):
        out[i, list(ls)] = True
    return out


def augment_batch(items, transform, seeds, fill_seed, on_error, classes: int | None = None):
    """[(key, bytes, label)] × B → (images uint8 [B, 3, S, S], labels, keys), or None if no image
    decodes; labels int64 [B], or multi-hot bool [B, classes] when ``classes`` is given (multi-label).
    An undecodable sample (``on_error(key, err)`` is told) is replaced by another of the same batch
    re-augmented with seed ``fill_seed(i)``, so the batch keeps its raw samples."""
    imgs, good = [], []
    for i, ((key, data, _), s) in enumerate(zip(items, seeds)):
        try:
            imgs.append(transform(data, s))
            good.append(i)
        except DecodeError as e:
            on_error(key, e)
            imgs.append(None)
    if not good:
        return None
    keys, labels = [], []
    for i in range(len(items)):
        j = i if imgs[i] is not None else good[i % len(good)]
        if j != i:
            imgs[i] = transform(items[j][1], fill_seed(i))
        keys.append(items[j][0])
        labels.append(items[j][2])
    return stack(imgs), label_batch(labels, classes), keys


def stack(images: list[torch.Tensor]) -> torch.Tensor:
    """torch.stack; inside a DataLoader worker, straight into shared memory (torch's default_collate
    does that), which saves the copy into shared memory when the batch is sent to the main process."""
    return default_collate(images)


def eval_batch(items, transform, batch: int, on_error, classes: int | None = None):
    """[(key, bytes, label)] × n ≤ batch → (images uint8 [batch, 3, S, S], labels int64 [batch]
    (multi-label, ``classes`` given: multi-hot bool [batch, classes]), valid bool [batch], keys);
    rows past n and undecodable ones are invalid (zeros, label -1 or no class)."""
    blank = torch.zeros(3, transform.size, transform.size, dtype=torch.uint8)
    images = [blank] * batch
    labels = [-1 if classes is None else ()] * batch
    valid = torch.zeros(batch, dtype=torch.bool)
    keys = [""] * batch
    for i, (key, data, label) in enumerate(items):
        try:
            images[i] = transform(data)
        except DecodeError as e:
            on_error(key, e)
            continue
        labels[i], valid[i], keys[i] = label, True, key
    return stack(images), label_batch(labels, classes), valid, keys


def shuffle_buffer(items: Iterator, size: int, rng: np.random.Generator, buf: list | None = None) -> Iterator:
    """Shuffle buffer: keep ``size`` items, emit a random one as each new one arrives, then drain.
    ``buf``: the buffer to start from (a resumed stream's, see :func:`replay_shuffle`)."""
    if size <= 1:
        yield from items
        return
    buf = [] if buf is None else buf
    for x in items:
        if len(buf) < size:
            buf.append(x)
            continue
        i = int(rng.integers(size))
        buf[i], x = x, buf[i]
        yield x
    rng.shuffle(buf)
    yield from buf


def replay_shuffle(n: int, size: int, rng: np.random.Generator, skip: int) -> tuple[list[int], int, bool]:
    """What :func:`shuffle_buffer` over ``n`` items holds after emitting ``skip`` of them, without the
    items: (buffer as item positions, position of the next input, drained). ``rng`` is left as the
    shuffle would leave it, so ``shuffle_buffer(items[next:], size, rng, buf=<those items>)`` continues
    it exactly; when ``drained`` (the inputs ran out first) the buffer is the rest of the output, in order.
    Needs ``size > 1``; costs one draw per emitted item."""
    buf = list(range(min(size, n)))
    nxt, emitted = len(buf), 0
    while emitted < skip and nxt < n:
        buf[int(rng.integers(size))] = nxt  # the slot's old item is the one emitted
        nxt, emitted = nxt + 1, emitted + 1
    if emitted < skip:  # the inputs ran out: the drain emits the rest
        rng.shuffle(buf)
        return buf[skip - emitted:], nxt, True
    return buf, nxt, False


def sample_seed(*parts: int) -> int:
    """A 32-bit seed from non-negative ints (numpy SeedSequence: well mixed, order-sensitive)."""
    return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(1)[0])


_NORM_CONSTANTS: dict = {}


def _norm_constants(mean: tuple, std: tuple, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, std) x 255 as [1, C, 1, 1] float32 on ``device``, made once per device: building them
    per call would copy host->device (and wait for it) every step."""
    key = (mean, std, device)
    if key not in _NORM_CONSTANTS:
        m = torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1).mul_(255.0).to(device)
        s = torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1).mul_(255.0).to(device)
        _NORM_CONSTANTS[key] = (m, s)
    return _NORM_CONSTANTS[key]


def normalize(images: torch.Tensor, mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5),
              dtype: torch.dtype = torch.float32, out: torch.Tensor | None = None) -> torch.Tensor:
    """uint8 [B, 3, H, W] → ``dtype`` [B, 3, H, W] on the same device; the default maps to [-1, 1]
    (the ViT paper's / big_vision's input range). Call it after moving the batch to the device, so
    only uint8 crosses the host→device link.

    ``out``: a float32 tensor of the same shape and device to write into and return (same values).
    On the CPU a fresh float batch is ~4,700 first-touch page faults each step (glibc maps a new
    block for it while the previous batch is still alive); reusing one buffer avoids them, as the
    CUDA caching allocator does on its own. Only reuse it once the previous step's backward is done."""
    m, s = _norm_constants(tuple(mean), tuple(std), images.device)
    if out is not None:
        if out.shape != images.shape or out.dtype != torch.float32 or out.device != images.device:
            raise ValueError(f"normalize: out is {out.dtype} {tuple(out.shape)} on {out.device}; expected "
                             f"float32 {tuple(images.shape)} on {images.device}")
        return out.copy_(images).sub_(m).div_(s).to(dtype)
    # in place on the one float copy: ~15x less time than three out-of-place ops (fresh 4-byte
    # buffers and their page faults dominate on the CPU), and the same numbers; a cast fused into
    # sub (torch.sub(uint8, float, out=)) takes the slow type-promoting path, ~2.7x slower
    return images.to(torch.float32).sub_(m).div_(s).to(dtype)
