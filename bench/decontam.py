"""De-duplication against test sets (data_prep/near.py): how well the perceptual hash finds transformed
copies of real photographs, how often it matches unrelated ones, and how fast the index answers.

    python bench/decontam.py --photos DIR [--photos DIR ...]

Photos: scikit-learn's two sample images, scikit-image's photographs when it is installed, and every
image under each --photos folder (the README lists the Debian packages the table was measured on).
Each photo, resized to a longer side of 384 px (a test image's size), is a test image; its copies
(0.5x, 0.25x, JPEG q30, 5% crop, 10 px border, mirror, brightness +-10%) are training images.

Prints, per threshold D (Hamming distance of the 64-bit hash): the recall of each transform (its copy's
nearest test image within D is its own photo) and the false matches (unrelated photo pairs within D);
then lookups per second per core at 100k test images (random hashes) and the extrapolation to 300M
training images on one node, and the index's speed against a brute-force scan (`ratio` lines).
"""

from __future__ import annotations

import argparse
import io
import sys
import time
from pathlib import Path

import numpy as np
from PIL import Image, ImageEnhance, ImageOps

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from data_prep.near import VARIANTS, NearIndex, distance, phash, reference_hashes  # noqa: E402
from data_prep.schema import IMAGE_EXTS  # noqa: E402
from pipeline.config.prep import DEFAULT_NEAR_THRESHOLD  # noqa: E402

TEST_SIDE = 384
SKIMAGE_PHOTOS = ("astronaut", "camera", "coffee", "chelsea", "rocket", "hubble_deep_field", "retina", "coins",
                  "moon", "page", "motorcycle_left", "brick", "grass", "gravel", "immunohistochemistry", "text",
                  "clock", "cell", "microaneurysms")
THRESHOLDS = (0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20)


def photos(folders: list[str]) -> list[tuple[str, Image.Image]]:
    from sklearn.datasets import load_sample_images

    out = [(f"sklearn/{Path(n).name}", Image.fromarray(a))
           for n, a in zip(load_sample_images().filenames, load_sample_images().images)]
    try:
        import skimage.data as sd

        out += [(f"skimage/{n}", Image.fromarray(getattr(sd, n)())) for n in SKIMAGE_PHOTOS if hasattr(sd, n)]
    except ImportError:
        pass
    for folder in folders:
        for p in sorted(Path(folder).rglob("*")):
            if p.suffix.lower().lstrip(".") in IMAGE_EXTS:
                out.append((str(p.relative_to(folder)), Image.open(p)))
    seen, unique = set(), []
    for name, im in out:  # the same photo from two sources counts once
        key = Path(name).stem.removeprefix("skimage_")
        if key not in seen:
            seen.add(key)
            im = ImageOps.exif_transpose(im).convert("RGB")
            im.thumbnail((TEST_SIDE, TEST_SIDE), Image.Resampling.LANCZOS)
            unique.append((name, im))
    return unique


def _jpeg(im: Image.Image, q: int) -> Image.Image:
    b = io.BytesIO()
    im.save(b, "JPEG", quality=q)
    return Image.open(io.BytesIO(b.getvalue())).convert("RGB")


def _crop(im: Image.Image, f: float) -> Image.Image:
    w, h = im.size
    dx, dy = round(w * f / 2), round(h * f / 2)
    return im.crop((dx, dy, w - dx, h - dy))


TRANSFORMS = {
    "resize_0.5x": lambda im: im.resize((im.width // 2, im.height // 2), Image.Resampling.BILINEAR),
    "resize_0.25x": lambda im: im.resize((im.width // 4, im.height // 4), Image.Resampling.BILINEAR),
    "jpeg_q30": lambda im: _jpeg(im, 30),
    "crop_5%": lambda im: _crop(im, 0.05),
    "border_10px": lambda im: ImageOps.expand(im, 10, fill=(0, 0, 0)),
    "mirror": ImageOps.mirror,
    "brightness+10%": lambda im: ImageEnhance.Brightness(im).enhance(1.1),
    "brightness-10%": lambda im: ImageEnhance.Brightness(im).enhance(0.9),
}


def quality_table(pics: list[tuple[str, Image.Image]]) -> None:
    pairs = [reference_hashes(np.asarray(im)) for _, im in pics]
    n = len(pics)
    # the nearest test image (the copy's own photo included) per transform: (distance to own, nearest other)
    own = {t: [] for t in TRANSFORMS}
    other = {t: [] for t in TRANSFORMS}
    for t, fn in TRANSFORMS.items():
        for i, (_, im) in enumerate(pics):
            h = phash(np.asarray(fn(im)))
            own[t].append(min(distance(h, x) for x in pairs[i]))
            other[t].append(min(distance(h, x) for j, p in enumerate(pairs) if j != i for x in p))
    # an unrelated photo as a training image against every variant of each other photo
    unrelated = [min(distance(pairs[i][0], x) for x in pairs[j]) for i in range(n) for j in range(n) if i != j]
    print(f"{n} photos; {len(unrelated)} lookups of an unrelated photo (each against the other's {VARIANTS} hashes)")
    print("| D | " + " | ".join(TRANSFORMS) + " | false matches |")
    print("|---|" + "---|" * (len(TRANSFORMS) + 1))
    for d in THRESHOLDS:
        cells = []
        for t in TRANSFORMS:
            hits = sum(o <= d and o <= x for o, x in zip(own[t], other[t]))
            cells.append(f"{hits / n:.2f}")
        print(f"| {d} | " + " | ".join(cells) + f" | {sum(u <= d for u in unrelated)} |")
    print("closest unrelated pair: distance", min(unrelated), "; farthest copy:",
          {t: max(v) for t, v in own.items()})


def speed(threshold: int, n_test: int, n_query: int, node_cores: int) -> None:
    rng = np.random.default_rng(0)
    pairs = [tuple(int(x) for x in rng.integers(0, 2**64, VARIANTS, dtype=np.uint64)) for _ in range(n_test)]
    t0 = time.perf_counter()
    index = NearIndex.build(pairs, threshold)
    build_s = time.perf_counter() - t0
    queries = [int(x) for x in rng.integers(0, 2**64, n_query, dtype=np.uint64)]
    queries[::10] = [pairs[i][0] ^ 0b1011 for i in range(0, len(queries[::10]))]  # a tenth are near copies
    t0 = time.perf_counter()
    fast = [index.nearest(q) for q in queries]
    fast_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    brute = [index.nearest_brute(q) for q in queries[: n_query // 4]]
    brute_s = (time.perf_counter() - t0) * 4
    assert fast[: len(brute)] == brute, "the index disagrees with a brute-force scan"
    rate = n_query / fast_s
    print(f"index of {n_test} test images (D={threshold}): built in {build_s:.2f} s, "
          f"{len(index.to_bytes()) / 2**20:.1f} MiB")
    print(f"lookups per second per core: {rate:.0f}; 300M training images: {3e8 / rate / 3600:.1f} core-hours, "
          f"{3e8 / rate / 3600 / node_cores:.2f} h on one {node_cores}-core node")
    print(f"ratio decontam_index_vs_scan {brute_s / fast_s:.1f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--photos", action="append", default=[], help="a folder of unrelated photographs")
    p.add_argument("--threshold", type=int, default=DEFAULT_NEAR_THRESHOLD)
    p.add_argument("--test-images", type=int, default=100_000)
    p.add_argument("--queries", type=int, default=20_000)
    p.add_argument("--node-cores", type=int, default=64)
    args = p.parse_args()
    quality_table(photos(args.photos))
    speed(args.threshold, args.test_images, args.queries, args.node_cores)


if __name__ == "__main__":
    main()
