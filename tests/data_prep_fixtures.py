"""Fixtures for data_prep tests: a small ImageFolder tree with one of every bad input the issue lists.

`EXPECTED` maps each input's relative path to the reject reason it must get (None = must be stored).
"""

from __future__ import annotations

import io
import json
import os
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image


def natural_image(rng: np.random.Generator, w: int, h: int) -> np.ndarray:
    """Smooth colour gradients + noise: JPEG sizes like photos, not like flat test cards. [h, w, 3] uint8."""
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    ch = []
    for _ in range(3):
        fx, fy, ph = rng.uniform(0.01, 0.08), rng.uniform(0.01, 0.08), rng.uniform(0, 6.3)
        ch.append(128 + 100 * np.sin(x * fx + y * fy + ph))
    img = np.stack(ch, -1) + rng.normal(0, 10, (h, w, 3))
    return np.clip(img, 0, 255).astype(np.uint8)


def jpeg_bytes(a: np.ndarray, quality: int = 90, **kw) -> bytes:
    b = io.BytesIO()
    Image.fromarray(a).save(b, "JPEG", quality=quality, **kw)
    return b.getvalue()


def png_bytes(im: Image.Image, **kw) -> bytes:
    b = io.BytesIO()
    im.save(b, "PNG", **kw)
    return b.getvalue()


def bomb_png(width: int, height: int) -> bytes:
    """A valid 1-bit grayscale PNG of width×height zeros: ~KB on disk, width×height bytes once decoded to L."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    row = b"\x00" * (1 + (width + 7) // 8)  # filter byte + packed bits
    comp = zlib.compressobj(9)
    idat = b"".join(comp.compress(row) for _ in range(height)) + comp.flush()
    ihdr = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def exif_rotated_jpeg(rng: np.random.Generator) -> bytes:
    """Stored 60×40 (landscape), EXIF orientation 6 → shown 40×60 (portrait). Left half red in storage."""
    a = natural_image(rng, 60, 40)
    a[:, :30] = (250, 0, 0)
    exif = Image.Exif()
    exif[0x0112] = 6
    return jpeg_bytes(a, exif=exif.tobytes())


def build_corpus(root: Path, n_good_per_class: int = 6, seed: int = 0) -> dict[str, str | None]:
    """Write the tree; return {relative path: expected reject reason or None}."""
    rng = np.random.default_rng(seed)
    expected: dict[str, str | None] = {}

    def put(rel: str, data: bytes, reason: str | None) -> None:
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
        expected[rel] = reason

    for c in ("cat", "dog", "eel"):
        for i in range(n_good_per_class):
            w, h = int(rng.integers(40, 120)), int(rng.integers(40, 120))
            put(f"{c}/img_{i}.jpg", jpeg_bytes(natural_image(rng, w, h)), None)
    good = (root / "cat/img_0.jpg").read_bytes()
    put("cat/dup of img_0.jpg", good, None)  # stored unless --dedup
    put("cat/truncated.jpg", jpeg_bytes(natural_image(rng, 64, 64))[:900], "truncated")
    put("cat/empty.jpg", b"", "empty")
    put("cat/not_an_image.jpg", b"hello, I am text\n" * 20, "not_image")
    put("cat/tiny.png", png_bytes(Image.new("RGB", (1, 1), (9, 9, 9))), "too_small")
    put("dog/bomb_100mp.png", bomb_png(10_000, 10_000), "too_large")
    put("dog/bomb_200mp.png", bomb_png(20_000, 10_000), "too_large")
    put("dog/cmyk.jpg", _save(Image.fromarray(natural_image(rng, 50, 50)).convert("CMYK"), "JPEG"), None)
    pal = Image.new("P", (48, 48), 0)
    pal.putpalette([255, 0, 0, 0, 0, 255] + [0] * 762)
    pal.paste(1, (0, 0, 24, 48))
    put("dog/palette_transparent.png", png_bytes(pal, transparency=0), None)
    la = Image.fromarray(np.stack([np.full((40, 40), 100, np.uint8), np.full((40, 40), 128, np.uint8)], -1), "LA")
    put("dog/la.png", png_bytes(la), None)
    rgba = np.zeros((40, 50, 4), np.uint8)
    rgba[..., 0], rgba[:, :25, 3], rgba[:, 25:, 3] = 200, 0, 255
    put("eel/rgba.png", png_bytes(Image.fromarray(rgba, "RGBA")), None)
    g16 = (np.arange(64 * 64, dtype=np.uint32).reshape(64, 64) * 16).astype(np.uint16)
    put("eel/gray16.png", png_bytes(Image.fromarray(g16)), None)
    put("eel/exif_rotated.jpg", exif_rotated_jpeg(rng), None)
    put("eel/gray.jpg", jpeg_bytes(natural_image(rng, 50, 40)[..., 0]), None)
    put("eel/rgb.png", png_bytes(Image.fromarray(natural_image(rng, 45, 35))), None)
    put("eel/photo.webp", _save(Image.fromarray(natural_image(rng, 45, 35)), "WEBP", quality=80), None)
    put("eel/my photo.v2.final.jpg", jpeg_bytes(natural_image(rng, 50, 50)), None)
    put("eel/café ☕ 写真.png", png_bytes(Image.fromarray(natural_image(rng, 30, 30))), None)
    put("eel/notes.txt", b"not an image extension\n", "extension")
    put("README.md", b"top-level file, in no class\n", "no_class")
    # unreadable without permissions (tests run as root): a directory and a dangling symlink
    (root / "dog/directory.jpg").mkdir()
    (root / "dog/directory.jpg/inner.jpg").write_bytes(jpeg_bytes(natural_image(rng, 40, 40)))
    expected["dog/directory.jpg/inner.jpg"] = None  # a directory is walked, its files are inputs
    os.symlink("does_not_exist.jpg", root / "dog/dangling.jpg")
    expected["dog/dangling.jpg"] = "missing"
    os.symlink("loop.jpg", root / "dog/loop.jpg")  # a link to itself: ELOOP on open
    expected["dog/loop.jpg"] = "symlink_loop"
    os.symlink("..", root / "eel/up")  # a directory link to its ancestor
    expected["eel/up"] = "symlink_loop"
    return expected


def _save(im: Image.Image, fmt: str, **kw) -> bytes:
    b = io.BytesIO()
    im.save(b, fmt, **kw)
    return b.getvalue()


@pytest.fixture(scope="session")
def bad_corpus(tmp_path_factory) -> tuple[Path, dict[str, str | None]]:
    root = tmp_path_factory.mktemp("corpus") / "images"
    root.mkdir()
    return root, build_corpus(root)


def tree_bytes(out: Path) -> dict[str, bytes]:
    """Every file that must be byte-identical between equivalent runs (timings live only in *_stats.json),
    the plan's pieces (``_plan/``) included, by path under ``out``."""
    return {p.relative_to(out).as_posix(): p.read_bytes() for p in sorted(out.rglob("*"))
            if p.is_file() and not p.name.endswith("_stats.json")}


def vitp_prep(images: Path, out: Path, *args: str) -> dict:
    """`vitp prep IMAGES OUT ARGS` run as a user runs it; returns the _info.json it wrote."""
    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, "-m", "launch.cli", "prep", str(images), str(out), "--no-progress", *args],
                       cwd=root, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads((Path(out) / "_info.json").read_text())
