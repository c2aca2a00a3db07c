"""One input file → one sanitized stored image (RGB, 8 bit, EXIF applied and stripped) or a Reject.

Fast path: baseline RGB/gray JPEGs are decoded by simplejpeg (libjpeg-turbo) at a DCT scale n/8
that still leaves at least a 2x reduction to the target size, which an antialiased resize finishes
(see `dct_numerator` for which scales and why), then re-encoded; when no scale leaves 2x, a full
decode and an area resize. Every other format goes through Pillow and an area resize at full size.
Both paths are deterministic, so the same input always gives the same bytes.
"""

from __future__ import annotations

import errno
import hashlib
import io
import os
import warnings
from dataclasses import asdict, dataclass

import cv2
import numpy as np
import simplejpeg
from PIL import Image, UnidentifiedImageError

from pipeline.config.prep import PrepCfg

from .near import signature as near_signature

# Reject reasons (the `reason` field of rejects.jsonl).
EMPTY, NOT_IMAGE, TRUNCATED, DECODE_ERROR = "empty", "not_image", "truncated", "decode_error"
TOO_SMALL, TOO_LARGE = "too_small", "too_large"
UNREADABLE, MISSING, SYMLINK_LOOP = "unreadable", "missing", "symlink_loop"
NEAR_DUPLICATE = "near_duplicate"  # of a test image (`vitp prep --exclude-near`; data_prep/near.py)

DEFAULT_MAX_BYTES = 256 * 1024 * 1024
_EXIF_ORIENTATION = 0x0112
_KEEPABLE = {"JPEG": "jpg", "PNG": "png", "WEBP": "webp"}


class Reject(Exception):
    """An input that cannot be stored; `reason` is one of the constants above."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


_PREP = PrepCfg.model_fields  # the defaults are prep's schema's


@dataclass(frozen=True)
class ImageOptions:
    """How prep stores each image: of prep's options (:meth:`of`), plus the byte cap a file is read up to."""

    resize_shorter: int | None = None
    resize_longer: int | None = None
    quality: int = _PREP["quality"].default
    min_size: int = _PREP["min_size"].default
    max_pixels: int = _PREP["max_pixels"].default  # PIL's own limit: larger ones are decompression bombs
    max_bytes: int = DEFAULT_MAX_BYTES
    keep_original: bool = _PREP["keep_original"].default

    @classmethod
    def of(cls, cfg: PrepCfg) -> ImageOptions:
        return cls(resize_shorter=cfg.resize_shorter, resize_longer=cfg.resize_longer, quality=cfg.quality,
                   min_size=cfg.min_size, max_pixels=cfg.max_pixels, keep_original=cfg.keep_original)

    def __post_init__(self):
        if self.resize_shorter and self.resize_longer:
            raise ValueError("resize_shorter and resize_longer are exclusive; give one")
        if not 1 <= self.quality <= 100:
            raise ValueError(f"quality={self.quality}: must be in 1..100")

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class Stored:
    data: bytes
    ext: str  # "jpg", "png" or "webp": the tar member extension
    orig_width: int
    orig_height: int
    width: int
    height: int
    sha256: str
    # data_prep/near.py's signature of the stored pixels (hash, second signature), when asked for
    signature: tuple | None = None


def target_size(w: int, h: int, opts: ImageOptions) -> tuple[int, int]:
    """Size after the optional resize; only ever shrinks (upscaling adds bytes, not information)."""
    if opts.resize_shorter:
        scale = opts.resize_shorter / min(w, h)
    elif opts.resize_longer:
        scale = opts.resize_longer / max(w, h)
    else:
        return w, h
    if scale >= 1.0:
        return w, h
    return max(1, round(w * scale)), max(1, round(h * scale))


def read_bytes(path: str, max_bytes: int) -> bytes:
    """Read a file, mapping every OS failure to a Reject (never raises anything else)."""
    try:
        size = os.stat(path).st_size
        if size > max_bytes:
            raise Reject(TOO_LARGE, f"{size} bytes on disk > max_bytes={max_bytes}")
        with open(path, "rb") as f:
            return f.read()
    except Reject:
        raise
    except IsADirectoryError:
        raise Reject(UNREADABLE, "is a directory") from None
    except FileNotFoundError:
        raise Reject(MISSING, "no such file (or dangling symlink)") from None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise Reject(SYMLINK_LOOP, e.strerror or "too many levels of symbolic links") from None
        raise Reject(UNREADABLE, e.strerror or str(e)) from None


def orient(a: np.ndarray, orientation: int) -> np.ndarray:
    """Apply an EXIF orientation (1..8) to a [H, W, C] array, like PIL.ImageOps.exif_transpose."""
    if orientation == 2:
        a = a[:, ::-1]
    elif orientation == 3:
        a = a[::-1, ::-1]
    elif orientation == 4:
        a = a[::-1]
    elif orientation == 5:
        a = a.transpose(1, 0, 2)
    elif orientation == 6:
        a = np.rot90(a, -1)
    elif orientation == 7:
        a = a.transpose(1, 0, 2)[::-1, ::-1]
    elif orientation == 8:
        a = np.rot90(a, 1)
    return np.ascontiguousarray(a)


def to_rgb_array(im: Image.Image) -> np.ndarray:
    """Any Pillow mode → [H, W, 3] uint8. Transparency is composited on white, 16 bit is scaled, not clipped."""
    mode = im.mode
    if mode == "RGB":
        return np.asarray(im)
    if mode in ("RGBA", "LA", "La", "RGBa", "PA") or (mode == "P" and "transparency" in im.info) or (
        mode in ("L", "RGB") and "transparency" in im.info
    ):
        rgba = np.asarray(im.convert("RGBA")).astype(np.uint32)
        alpha = rgba[..., 3:4]
        rgb = (rgba[..., :3] * alpha + 255 * (255 - alpha) + 127) // 255
        return rgb.astype(np.uint8)
    if mode.startswith("I") or mode == "F":
        g = np.asarray(im)
        if mode == "F":
            g8 = np.clip(g, 0, 255).round().astype(np.uint8)
        else:  # 16-bit range (I;16*, or I from a 16-bit file): 65535 → 255
            g8 = ((np.clip(g.astype(np.int64), 0, 65535) * 255 + 32767) // 65535).astype(np.uint8)
        return np.repeat(g8[..., None], 3, axis=2)
    return np.asarray(im.convert("RGB"))


def _png_is_rgb8(data: bytes) -> bool:
    # IHDR sits at a fixed offset: byte 24 is the bit depth, byte 25 the colour type (2 = truecolour).
    return len(data) > 26 and data[24] == 8 and data[25] == 2


def _decode_error(e: Exception) -> Reject:
    msg = str(e) or type(e).__name__
    low = msg.lower()
    if "truncated" in low or "premature end" in low or "broken data stream" in low:
        return Reject(TRUNCATED, msg)
    return Reject(DECODE_ERROR, msg)


def resize_rgb(a: np.ndarray, size: tuple[int, int], cubic: bool = False) -> np.ndarray:
    """[H, W, C] uint8 → size (w, h): area averaging when reducing (what img2dataset and most
    dataset tools store), bilinear (bicubic) when enlarging."""
    if (a.shape[1], a.shape[0]) == size:
        return a
    if a.shape[1] > size[0] or a.shape[0] > size[1]:
        interp = cv2.INTER_AREA
    else:
        interp = cv2.INTER_CUBIC if cubic else cv2.INTER_LINEAR
    return cv2.resize(a, size, interpolation=interp)


# libjpeg decodes at n/8 of full size (n = 1..8) inside the IDCT, far cheaper than a full decode and
# a resize, but not every scale is a low-pass filter: 1/8 keeps each 8x8 block's mean (a box filter),
# and libjpeg-turbo's 1/4 and 1/2 evaluate the 8-point IDCT at fewer points (point sampling), so fine
# stripes alias into the result by up to 10 dB PSNR whatever resize follows. 3/8, 5/8, 6/8 and 7/8
# truncate the DCT instead; even they leak some energy across block edges, so the decode leaves at
# least a 2x reduction to a resize that suppresses it. Measured on textured images (stripes, noise,
# text) against full decode + area resize, by PSNR to a Lanczos resize, on crops (no re-encoding to
# hide differences): OpenCV's area average let the leak through (90th percentile 0.8 dB behind),
# Pillow's antialiased bilinear left outliers on stripes (up to 7 dB), and antialiased bicubic was
# ahead everywhere (90th percentile 3 dB ahead, worst case 0.3 dB behind) for ~35% more resize time
# than bilinear. tests/unit/test_image_quality.py keeps it so.
_DCT_SCALES, _MIN_LEFTOVER, _MIN_SCALABLE = (3, 5, 6, 7), 2, 64


def dct_numerator(box_w: int, box_h: int, out_w: int, out_h: int, img_w: int, img_h: int) -> int:
    """The n of the n/8 JPEG decode scale for resizing a box_w x box_h region of an img_w x img_h
    JPEG to out_w x out_h: the smallest of 3, 5, 6, 7 that leaves a >= 2x reduction, else 8 (full
    size). Images under 64 px are always decoded in full: nothing to gain."""
    if min(img_w, img_h) >= _MIN_SCALABLE:
        for n in _DCT_SCALES:
            if box_w * n >= 8 * _MIN_LEFTOVER * out_w and box_h * n >= 8 * _MIN_LEFTOVER * out_h:
                return n
    return 8


def decode_jpeg_scaled(data: bytes, w: int, h: int, n: int) -> np.ndarray:
    """A w x h RGB/gray JPEG decoded at scale n/8 → [ceil(h n/8), ceil(w n/8), 3] uint8. Raises ValueError."""
    return simplejpeg.decode_jpeg(data, colorspace="RGB", min_width=-(-w * n // 8), min_height=-(-h * n // 8))


def resize_region(a: np.ndarray, n: int, box: tuple[int, int, int, int], size: tuple[int, int],
                  cubic: bool = False) -> np.ndarray:
    """The region ``box`` = (x0, y0, x1, y1), in full-size pixels, of an image decoded at scale n/8
    (``a``: [ceil(H n/8), ceil(W n/8), C]) → [size[1], size[0], C] uint8.

    n == 8: `resize_rgb` of the crop (``cubic``: bicubic when enlarging). n < 8: Pillow's antialiased
    bicubic resize of the exact region: its edges fall between decoded pixels ((x1 - x0) n/8 is rarely
    whole) and Pillow takes a fractional box, where rounding to whole pixels shifted fine stripes by up
    to half a decoded pixel (2.3 dB)."""
    x0, y0, x1, y1 = box
    if n == 8:
        return resize_rgb(a[y0:y1, x0:x1], size, cubic)
    s = n / 8
    im = Image.fromarray(a).resize(size, Image.Resampling.BICUBIC, box=(x0 * s, y0 * s, x1 * s, y1 * s))
    return np.asarray(im)


@dataclass
class _Header:
    width: int
    height: int
    format: str | None
    mode: str
    orientation: int = 1
    has_exif: bool = False
    keepable_extra: bool = True  # format-specific conditions for storing the original bytes
    im: Image.Image | None = None  # the opened (not decoded) Pillow image; None on the JPEG fast path


def _fast_jpeg_header(data: bytes) -> _Header | None:
    """Plain JPEGs without EXIF: header from libjpeg-turbo, no Pillow (it costs ~5% of the whole sample)."""
    if data[:2] != b"\xff\xd8" or data.find(b"Exif\x00\x00", 0, 65536) >= 0:
        return None
    try:
        h, w, colorspace, _ = simplejpeg.decode_jpeg_header(data)
    except ValueError:
        return None  # let Pillow classify it
    mode = {"YCbCr": "RGB", "RGB": "RGB", "Gray": "L"}.get(colorspace)
    return _Header(w, h, "JPEG", mode) if mode else None


def _pil_header(data: bytes) -> _Header:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            im = Image.open(io.BytesIO(data))  # reads the header only: size is known before any decoding
    except Image.DecompressionBombError as e:
        raise Reject(TOO_LARGE, str(e)) from None
    except UnidentifiedImageError:
        raise Reject(NOT_IMAGE, "not a recognized image format") from None
    except (SyntaxError, ValueError, OSError) as e:
        raise Reject(NOT_IMAGE, str(e) or type(e).__name__) from None
    try:
        exif = im.getexif()
        orientation = int(exif.get(_EXIF_ORIENTATION, 1))
    except Exception:  # malformed EXIF is common and harmless: treat as upright
        exif, orientation = {}, 1
    keepable = ("transparency" not in im.info and getattr(im, "n_frames", 1) == 1
                and (im.format != "PNG" or _png_is_rgb8(data)))
    return _Header(im.size[0], im.size[1], im.format, im.mode, orientation if 1 <= orientation <= 8 else 1,
                   bool(exif), keepable, im)


def process_image(path: str, opts: ImageOptions, signature: bool = False) -> Stored:
    """Read, check and re-encode one image file. Raises Reject (only) for bad inputs. ``signature``:
    also hash the final, oriented pixels (a kept JPEG is decoded anyway, a kept PNG/WebP is loaded:
    the hash costs a grey conversion and a resize, not a decode)."""
    data = read_bytes(path, opts.max_bytes)
    if not data:
        raise Reject(EMPTY, "0 bytes")
    hd = _fast_jpeg_header(data) or _pil_header(data)
    w, h, orientation = hd.width, hd.height, hd.orientation
    if w * h > opts.max_pixels:
        raise Reject(TOO_LARGE, f"{w}x{h} = {w * h} pixels > max_pixels={opts.max_pixels}")
    if min(w, h) < opts.min_size:
        raise Reject(TOO_SMALL, f"{w}x{h} < min_size={opts.min_size}")
    ow, oh = (h, w) if orientation >= 5 else (w, h)
    tw, th = target_size(ow, oh, opts)
    keep = (opts.keep_original and hd.format in _KEEPABLE and (tw, th) == (ow, oh) and orientation == 1
            and not hd.has_exif and hd.mode == "RGB" and hd.keepable_extra)
    rw, rh = (th, tw) if orientation >= 5 else (tw, th)  # the target in the stored (unrotated) frame
    n = 8
    try:
        if hd.format == "JPEG" and hd.mode in ("RGB", "L"):
            n = dct_numerator(w, h, rw, rh, w, h)
            a = decode_jpeg_scaled(data, w, h, n)
        else:  # every other format was opened by Pillow in _pil_header
            hd.im.load()
            a = None if keep else to_rgb_array(hd.im)
    except Exception as e:  # a kept file must decode completely too
        raise _decode_error(e) from None
    if keep:
        sig = near_signature(a if a is not None else to_rgb_array(hd.im)) if signature else None
        return Stored(data, _KEEPABLE[hd.format], w, h, w, h, hashlib.sha256(data).hexdigest(), sig)
    # resize before rotating: the same pixels (both filters are separable and symmetric, so they
    # commute with flips and transposes), fewer of them to move
    a = orient(resize_region(a, n, (0, 0, w, h), (rw, rh)), orientation)
    out = encode_jpeg(a, opts.quality)
    return Stored(out, "jpg", w, h, a.shape[1], a.shape[0], hashlib.sha256(out).hexdigest(),
                  near_signature(a) if signature else None)


def encode_jpeg(a: np.ndarray, quality: int) -> bytes:
    """RGB uint8 [H, W, 3] → baseline JPEG, 4:2:0. OpenCV's libjpeg-turbo rather than simplejpeg's: at
    the same quality tables it stores 0.1 dB more PSNR in 1% fewer bytes (its chroma downsampling),
    in the same time; it is also the encoder img2dataset stores with."""
    ok, buf = cv2.imencode(".jpg", cv2.cvtColor(a, cv2.COLOR_RGB2BGR), [
        cv2.IMWRITE_JPEG_QUALITY, quality, cv2.IMWRITE_JPEG_SAMPLING_FACTOR, cv2.IMWRITE_JPEG_SAMPLING_FACTOR_420])
    if not ok:
        raise ValueError(f"JPEG encoding failed for an image of shape {a.shape}")
    return buf.tobytes()


def init_worker() -> None:
    """Per-process setup: one OpenCV thread, so N workers use N cores and not N × cores."""
    cv2.setNumThreads(1)
