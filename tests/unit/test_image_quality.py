"""Image quality of the reduced JPEG decodes: `vitp prep`'s stored images and the train loader's crops
against what img2dataset-style tools store (full decode + area resize), on textured images (fine
stripes, noise, text) where a decode that aliases shows. Both are scored by PSNR against a Lanczos
resize, of the image before JPEG coding (the truth) and of its full decode (what a user can compute);
goal: the 90th percentile of the PSNR shortfall is <= 0.3 dB against each.
"""

from __future__ import annotations

import io
import random

import cv2
import numpy as np
import pytest
import simplejpeg
from PIL import Image, ImageDraw, ImageFont

from data_prep.images import ImageOptions, dct_numerator, encode_jpeg, process_image, target_size
from pipeline.data.augment import EncodedImage, TrainTransform, decode_crop, inception_crop_box

KINDS = ("stripes", "noise", "text")
# (w, h), all >= 512 px as photos are: landscape, portrait, odd sizes (scaled extents are fractional)
SIZES = [(1024, 768), (768, 1024), (1201, 907), (640, 512), (1600, 1200), (905, 600), (600, 1003), (2047, 1365)]
SHORTER, CROP = 256, 224


def textured(kind: str, rng: np.random.Generator, w: int, h: int) -> np.ndarray:
    """[h, w, 3] uint8 with detail near full-size Nyquist over a smooth colour field."""
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    base = np.stack([60 + 40 * np.sin(x / rng.uniform(80, 300) + rng.uniform(0, 6))
                     + 30 * np.cos(y / rng.uniform(80, 300)) for _ in range(3)], -1)
    if kind == "stripes":  # two square-ish gratings, periods 2.2-7 px, any angle: harmonics beyond Nyquist
        img = base + 60
        for _ in range(2):
            period, angle = rng.uniform(2.2, 7.0), rng.uniform(0, np.pi)
            wave = np.tanh(2.5 * np.sin((x * np.cos(angle) + y * np.sin(angle)) * 2 * np.pi / period))
            img = img + wave[..., None] * rng.uniform(25, 55, 3)
    elif kind == "noise":  # uniform noise at 1, 2 and 3 px grain
        img = base + 60
        for s in (1, 2, 3):
            img = img + 35 * rng.uniform(-1, 1, (h // s + 1, w // s + 1, 3)).repeat(s, 0).repeat(s, 1)[:h, :w]
    else:  # lines of random characters, 9-25 px high
        im = Image.fromarray(np.clip(base + 120, 0, 255).astype(np.uint8))
        d, top = ImageDraw.Draw(im), 0
        while top < h:
            size = int(rng.integers(9, 26))
            text = "".join(chr(int(c)) for c in rng.integers(33, 127, max(4, w // (size // 2))))
            d.text((int(rng.integers(-20, 5)), top), text, font=ImageFont.load_default(size=size),
                   fill=tuple(int(v) for v in rng.integers(0, 90, 3)))
            top += size + int(rng.integers(0, 6))
        return np.asarray(im)
    return np.clip(img, 0, 255).astype(np.uint8)


def psnr(a: np.ndarray, ref: np.ndarray) -> float:
    mse = np.mean((a.astype(np.float64) - ref.astype(np.float64)) ** 2)
    return float(10 * np.log10(255.0 ** 2 / mse))


def encoded(a: np.ndarray) -> np.ndarray:
    """Through the encoder prep and img2dataset store with (OpenCV's, q90, 4:2:0) and back: stored
    images are compared as stored."""
    return simplejpeg.decode_jpeg(encode_jpeg(a, 90))


@pytest.fixture(scope="module")
def photos() -> list[tuple[np.ndarray, bytes]]:
    """(pixels before coding [h, w, 3], JPEG q90 4:2:0 as cameras write) for each kind and size."""
    rng = np.random.default_rng(18)
    out = []
    for kind in KINDS:
        for w, h in SIZES:
            a = textured(kind, rng, w, h)
            b = io.BytesIO()
            Image.fromarray(a).save(b, "JPEG", quality=90)
            out.append((a, b.getvalue()))
    return out


def full(data: bytes) -> np.ndarray:
    return simplejpeg.decode_jpeg(data, colorspace="RGB")


def lanczos(a: np.ndarray, size, box=None) -> np.ndarray:
    return np.asarray(Image.fromarray(a).resize(size, Image.Resampling.LANCZOS, box=box))


def summary(gaps) -> tuple[float, float, float]:
    g = np.asarray(gaps)
    return float(np.median(g)), float(np.percentile(g, 90)), float(g.max())


def report(what: str, gaps: np.ndarray) -> None:
    for j, ref in enumerate(("original", "full decode")):
        print(f"{what}: PSNR shortfall vs full decode + area, Lanczos of the {ref} as reference, dB: "
              "median {:.3f} p90 {:.3f} max {:.3f}".format(*summary(gaps[:, j])))


def test_prep_stores_images_as_good_as_full_decode_and_area_resize(photos, tmp_path):
    gaps, naive, reduced = [], [], 0
    for i, (orig, data) in enumerate(photos):
        p = tmp_path / f"{i}.jpg"
        p.write_bytes(data)
        s = process_image(str(p), ImageOptions(resize_shorter=SHORTER, quality=90))
        ours = simplejpeg.decode_jpeg(s.data)
        f = full(data)
        h, w = f.shape[:2]
        size = target_size(w, h, ImageOptions(resize_shorter=SHORTER))
        assert (s.width, s.height) == size
        reduced += dct_numerator(w, h, *size, w, h) < 8
        peer = encoded(cv2.resize(f, size, interpolation=cv2.INTER_AREA))
        # the old fast path: DCT-scaled straight to >= the target, then bilinear
        old = simplejpeg.decode_jpeg(data, colorspace="RGB", min_width=size[0], min_height=size[1])
        old = encoded(cv2.resize(old, size, interpolation=cv2.INTER_LINEAR))
        refs = (lanczos(orig, size), lanczos(f, size))
        gaps.append([psnr(peer, r) - psnr(ours, r) for r in refs])
        naive.append([psnr(peer, r) - psnr(old, r) for r in refs])
    gaps, naive = np.array(gaps), np.array(naive)
    report("prep", gaps)
    report("prep, old path", naive)
    for j in range(2):
        med, p90, _ = summary(gaps[:, j])
        assert p90 <= 0.3 and med <= 0.1, gaps
        assert summary(naive[:, j])[1] > 1.0  # the images are textured enough to tell an aliasing decode
    assert reduced >= 0.8 * len(photos)  # the cheap reduced decode is what was measured


def test_loader_crops_are_as_good_as_full_decode_and_area_resize(photos):
    gaps, reduced, rng = [], [], random.Random(0)
    for orig, data in photos:
        src, f = EncodedImage(data), full(data)
        for _ in range(3):
            x, y, cw, ch = box = inception_crop_box(src.w, src.h, rng, (0.08, 1.0))
            ours = decode_crop(src, box, CROP, CROP)
            reduced.append(src.scale_for(cw, ch, CROP, CROP) < 8)
            peer = cv2.resize(f[y:y + ch, x:x + cw], (CROP, CROP), interpolation=cv2.INTER_AREA)
            refs = [lanczos(a, (CROP, CROP), (x, y, x + cw, y + ch)) for a in (orig, f)]
            gaps.append([psnr(peer, r) - psnr(ours, r) for r in refs])
    gaps, reduced = np.array(gaps), np.array(reduced)
    report(f"loader crops, all {len(gaps)}", gaps)
    report(f"loader crops, the {reduced.sum()} decoded reduced", gaps[reduced])
    assert reduced.sum() >= len(gaps) // 3
    for j in range(2):  # over all crops, and over the reduced decodes alone (the rest equal the peer)
        for g in (gaps[:, j], gaps[reduced, j]):
            med, p90, _ = summary(g)
            assert p90 <= 0.3 and med <= 0.1, g
    assert np.all(np.abs(gaps[~reduced]) < 1e-9)  # full decodes: the same pixels as the peer


def test_train_transform_is_decode_crop_then_flip(photos):
    """TrainTransform's pixels are exactly decode_crop's for its box, flipped when it draws a flip."""
    data = photos[0][1]
    tf = TrainTransform(CROP, (0.08, 1.0), hflip=True)
    src = EncodedImage(data)
    for seed in range(6):
        rng = random.Random(seed)
        a = decode_crop(src, inception_crop_box(src.w, src.h, rng, tf.scale), CROP, CROP)
        if rng.random() < 0.5:
            a = a[:, ::-1]
        assert np.array_equal(tf(data, seed).numpy().transpose(1, 2, 0), a)
