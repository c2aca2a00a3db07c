"""Real photographs for the decontamination benchmark and tests: Debian's wallpaper and background
packages and scikit-image's sample photographs (and, kept apart, ``HELD_OUT``'s), fetched with
`apt-get download` and unpacked with `dpkg-deb -x` into a cache folder (``$VITP_PHOTO_CACHE``, else
``~/.cache/vitp-photos``) once per machine. Fetching needs root and apt; without them ``photo_files``
says why in one line (a test skips with it) unless the cache already holds the packages.

Each photo is named ``<package>/<its path in the package>``; photos of the same picture at several
sizes (mate's Elephants, Plasma's) count once. ``textured_crops`` cuts a photo into square crops of
random size and place and keeps those whose grey standard deviation shows a picture (a crop of plain
sky is not a test image).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps

# package -> the photographs in it (the rest are drawings, patterns and logos)
PACKAGES = {
    "mate-backgrounds": ["usr/share/backgrounds/mate/nature/*.jpg",
                         "usr/share/backgrounds/mate/abstract/Elephants.jpg"],
    "lomiri-wallpapers-16.04": ["usr/share/backgrounds/*_by_*.jpg"],
    "lomiri-wallpapers-20.04": ["usr/share/backgrounds/*_by_*.jpg"],
    "ukui-wallpapers": [f"usr/share/backgrounds/{n}" for n in
                        ("calla.png", "city.png", "desert.png", "goldfish.png", "the-mouse.jpg", "string.jpg")],
    "python3-skimage": [f"usr/lib/python3/dist-packages/skimage/data/{n}" for n in
                        ("astronaut.png", "camera.png", "coffee.png", "chelsea.png", "rocket.jpg", "retina.jpg",
                         "hubble_deep_field.jpg", "coins.png", "moon.png", "page.png", "motorcycle_left.png",
                         "brick.png", "grass.png", "gravel.png", "ihc.png", "text.png", "clock_motion.png",
                         "cell.png", "microaneurysms.png")],
}
# photos kept apart: the thresholds were never set on them (bench/decontam.py --held-out); KDE Plasma's
# photographs, each at one size (the package ships every one at twelve)
HELD_OUT = {
    "plasma-workspace-wallpapers": [f"usr/share/wallpapers/{n}/contents/images/2560x1600.jpg" for n in
                                    ("Autumn", "BytheWater", "ColdRipple", "ColorfulCups", "DarkestHour",
                                     "EveningGlow", "FallenLeaf", "Grey", "Kite", "OneStandsOut", "Path",
                                     "summer_1am")],
}
_PATTERNS = PACKAGES | HELD_OUT


def cache_dir() -> Path:
    return Path(os.environ.get("VITP_PHOTO_CACHE") or Path.home() / ".cache" / "vitp-photos")


def _fetch(package: str, into: Path) -> str | None:
    """Download and unpack one package under ``into/package``; None, or why it could not."""
    if os.geteuid() != 0 or not shutil.which("apt-get") or not shutil.which("dpkg-deb"):
        return f"real photos need Debian's {package}: run as root with apt-get, or fill {into}"
    debs = into / "debs"
    debs.mkdir(parents=True, exist_ok=True)
    got = subprocess.run(["apt-get", "download", package], cwd=debs, capture_output=True, text=True)
    if got.returncode != 0:  # an old package list: update once, then try again
        subprocess.run(["apt-get", "update", "-qq"], capture_output=True)
        got = subprocess.run(["apt-get", "download", package], cwd=debs, capture_output=True, text=True)
    deb = sorted(debs.glob(f"{package}_*.deb"))
    if got.returncode != 0 or not deb:
        return f"apt-get download {package} failed: {(got.stderr or got.stdout).strip().splitlines()[-1:]}"
    tmp = into / f".{package}.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    subprocess.run(["dpkg-deb", "-x", str(deb[-1]), str(tmp)], check=True)
    keep = tmp.with_name(f".{package}.photos")
    shutil.rmtree(keep, ignore_errors=True)
    for pattern in _PATTERNS[package]:  # only the photos stay (skimage's package is mostly code)
        for f in tmp.glob(pattern):
            (keep / f.relative_to(tmp)).parent.mkdir(parents=True, exist_ok=True)
            f.rename(keep / f.relative_to(tmp))
    shutil.rmtree(tmp)
    keep.rename(into / package)  # whole or absent: a killed unpack is redone
    deb[-1].unlink()
    return None


def photo_files(packages: tuple[str, ...] = tuple(PACKAGES)) -> tuple[list[tuple[str, Path]], str | None]:
    """([(name, path)] of every photo, sorted), and why some package is missing (None: all there)."""
    root, why = cache_dir(), None
    out = []
    for package in packages:
        if not (root / package).is_dir():
            why = why or _fetch(package, root)
            if not (root / package).is_dir():
                continue
        for pattern in _PATTERNS[package]:
            out += [(f"{package}/{p.relative_to(root / package)}", p) for p in sorted((root / package).glob(pattern))]
    return out, why


def load(path: Path, longest: int | None = None) -> np.ndarray:
    """A photo upright, as RGB [H, W, 3] uint8, shrunk to a longer side of ``longest`` px if larger."""
    im = ImageOps.exif_transpose(Image.open(path)).convert("RGB")
    if longest:
        im.thumbnail((longest, longest), Image.Resampling.LANCZOS)
    return np.asarray(im)


def textured_crops(a: np.ndarray, n: int, rng: np.random.Generator, sides: tuple[int, int] = (64, 256),
                   min_std: float = 24.0, tries: int = 8) -> list[np.ndarray]:
    """Up to ``n`` square crops [s, s, 3] of ``a`` [H, W, 3], s drawn from ``sides`` (and at most the
    photo's shorter side), each with a grey standard deviation of at least ``min_std``."""
    h, w = a.shape[:2]
    out = []
    for _ in range(n * tries):
        if len(out) == n:
            break
        s = int(rng.integers(sides[0], min(sides[1], h, w) + 1))
        y, x = int(rng.integers(0, h - s + 1)), int(rng.integers(0, w - s + 1))
        c = a[y:y + s, x:x + s]
        if (c @ np.array([0.299, 0.587, 0.114])).std() >= min_std:
            out.append(c)
    return out
