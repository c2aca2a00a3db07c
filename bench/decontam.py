"""De-duplication against test sets (data_prep/near.py), measured on real photographs: how often an
unrelated picture is rejected, how well transformed copies are found, and how fast the index answers.

    python bench/decontam.py [--test-crops N] [--train-crops N] [--copies N] [--seed N] [--held-out]

Photos: Debian's wallpaper and background packages and scikit-image's photographs (bench/photos.py
fetches them with apt, as root, into a cache); with --held-out, other photos instead (KDE Plasma's), on
which nothing was tuned. Each photo is cut into square crops of 96-384 px, kept where their grey
standard deviation is at least 24 (a patch of sky is not a picture). The photos are split in two:
crops of three in five are the test set, crops of the others the clean training images, so no training
crop shares a pixel with a test crop; --seed draws other crops. Every (training, test) pair within D
bits of the hash is a chance match; of these, the check of the second signature keeps those it calls
duplicates. The default sample, some 3.3e8 pairs, resolves the goal: one chance pair in it would be
0.0009 of clean images against 300k test images.

Prints the per-pair false-match rate with the hash alone and with the check, and the share of clean
training images each would reject against 300k test images, 1 - (1 - p)^300000 (`ratio
decontam_false_rate_300k_hash_only`, `ratio decontam_false_rate_300k`: goal <= 0.001); then, for copies
of test crops under each transform (resize, JPEG q30, 5% crop, 10 px border, mirror, brightness +-10%,
greyscale), the recall: the share whose lookup among all the test crops finds a crop of its own photo;
then lookups per second per core at 100k test images (random signatures), and the index against a
brute-force scan.
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

from bench.photos import HELD_OUT, PACKAGES, load, photo_files, textured_crops  # noqa: E402
from data_prep.near import THUMB_BYTES, VARIANTS, NearIndex, margin, reference, signature  # noqa: E402
from pipeline.config.prep import DEFAULT_NEAR_THRESHOLD  # noqa: E402

AT_SCALE = 300_000
SIDES, MIN_STD = (96, 384), 24.0


def crops(files: list, n: int, rng: np.random.Generator) -> tuple[list[np.ndarray], list[int]]:
    """About n textured crops of these photos, evenly; and each one's photo (its number in files)."""
    out, owner = [], []
    per = -(-n // len(files))
    for k, (_, path) in enumerate(files):
        got = textured_crops(load(path, 1024), per, rng, SIDES, MIN_STD)
        out += got
        owner += [k] * len(got)
    return out, owner


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
    "greyscale": lambda im: im.convert("L"),  # the copy the grey rule (near.MIN_GREY) is there to find
}


def chance_matches(test_hashes: np.ndarray, test_thumbs: np.ndarray, train: list[tuple[int, np.ndarray]],
                   threshold: int) -> tuple[int, int, int, int]:
    """test_hashes [T, VARIANTS] uint64, test_thumbs [T, 2, THUMB_BYTES]; train: signature() of each clean
    image -> (pairs within the threshold, training images with one; the same two after the check)."""
    pairs = images = pairs2 = images2 = 0
    for h, t in train:
        cand = np.flatnonzero(np.bitwise_count(test_hashes ^ np.uint64(h)).min(axis=1) <= threshold)
        if not len(cand):
            continue
        pairs, images = pairs + len(cand), images + 1
        dup = int((margin(t, test_thumbs[cand]) >= 0).sum())
        pairs2, images2 = pairs2 + dup, images2 + (dup > 0)
    return pairs, images, pairs2, images2


def honest(n_test: int, n_train: int, n_copies: int, threshold: int, seed: int, held_out: bool) -> None:
    packages = tuple(HELD_OUT if held_out else PACKAGES)
    files, why = photo_files(packages)
    if why:
        print(f"some photos are missing: {why}")
    print(f"photos: {len(files)} from {', '.join(packages)}{' (held out)' if held_out else ''}; seed {seed}")
    rng = np.random.default_rng(seed)
    test_files = [f for i, f in enumerate(files) if i % 5 in (0, 1, 3)]
    train_files = [f for i, f in enumerate(files) if i % 5 in (2, 4)]
    test, photo = crops(test_files, n_test, rng)
    train = [signature(a) for a in crops(train_files, n_train, rng)[0]]
    refs = [reference(a) for a in test]
    hashes, thumbs = np.array([r[0] for r in refs], np.uint64), np.stack([r[1] for r in refs])
    print(f"test set: {len(test)} crops of {len(test_files)} photos; clean training images: {len(train)} crops "
          f"of {len(train_files)} other photos; D = {threshold}")
    n_pairs = len(test) * len(train)
    pairs, images, pairs2, images2 = chance_matches(hashes, thumbs, train, threshold)
    for name, p, i in (("hash alone", pairs, images), ("hash + second signature", pairs2, images2)):
        rate = p / n_pairs
        print(f"{name}: {p} of {n_pairs} pairs match ({rate:.2e} per pair), {i} of {len(train)} clean images "
              f"rejected against {len(test)} test images; against {AT_SCALE}: {1 - (1 - rate) ** AT_SCALE:.4f}")
    one = 1 - (1 - 1 / n_pairs) ** AT_SCALE
    print(f"resolution: one pair in {n_pairs} would be {1 / n_pairs:.1e} per pair, {one:.4f} against {AT_SCALE} "
          f"({'within' if one <= 0.001 else 'above'} the goal of 0.001)")
    print(f"ratio decontam_false_rate_300k_hash_only {1 - (1 - pairs / n_pairs) ** AT_SCALE:.4f}")
    print(f"ratio decontam_false_rate_300k {1 - (1 - pairs2 / n_pairs) ** AT_SCALE:.4f}")
    recall_table(test, photo, hashes, thumbs, n_copies, threshold, rng)


def recall_table(test: list[np.ndarray], photo: list[int], hashes: np.ndarray, thumbs: np.ndarray, n_copies: int,
                 threshold: int, rng: np.random.Generator) -> None:
    """Copies of n_copies test crops per transform, looked up among all of them."""
    alone = NearIndex.build([tuple(int(x) for x in h) for h in hashes], threshold)
    full = NearIndex(alone.hashes, alone.owner, threshold, thumbs)
    picked = rng.choice(len(test), min(n_copies, len(test)), replace=False)
    print(f"recall of {len(picked)} copies per transform (found: a crop of its own photo)")
    print("| transform | hash alone | hash + second signature |")
    print("|---|---|---|")
    for t, fn in TRANSFORMS.items():
        found = [0, 0]
        for j in picked:
            h, s = signature(np.asarray(fn(Image.fromarray(test[j]))))
            for k, m in enumerate((alone.nearest(h), full.nearest(h, s))):
                found[k] += m is not None and photo[m.test] == photo[j]
        print(f"| {t} | {found[0] / len(picked):.3f} | {found[1] / len(picked):.3f} |")


def speed(threshold: int, n_test: int, n_query: int, node_cores: int) -> None:
    rng = np.random.default_rng(0)
    pairs = [tuple(int(x) for x in rng.integers(0, 2**64, VARIANTS, dtype=np.uint64)) for _ in range(n_test)]
    thumbs = rng.integers(0, 256, (n_test, 2, THUMB_BYTES), dtype=np.uint8)
    t0 = time.perf_counter()
    index = NearIndex.build(pairs, threshold, thumbs)
    build_s = time.perf_counter() - t0
    queries = [int(x) for x in rng.integers(0, 2**64, n_query, dtype=np.uint64)]
    queries[::10] = [pairs[i][0] ^ 0b1011 for i in range(0, len(queries[::10]))]  # a tenth are near copies
    qthumbs = thumbs[np.arange(n_query) % n_test, 0]  # the near copies' own: they pass the check
    t0 = time.perf_counter()
    fast = [index.nearest(q, t) for q, t in zip(queries, qthumbs)]
    fast_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    brute = [index.nearest_brute(q, t) for q, t in zip(queries[: n_query // 4], qthumbs)]
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
    # ~3.3e8 pairs: one chance pair would still be <= 0.001 of clean images at 300k test images
    p.add_argument("--test-crops", type=int, default=20_000)
    p.add_argument("--train-crops", type=int, default=20_000)
    p.add_argument("--copies", type=int, default=800, help="test crops copied per transform")
    p.add_argument("--seed", type=int, default=0, help="draws the crops and the copied ones")
    p.add_argument("--held-out", action="store_true", help="photos nothing was tuned on (photos.HELD_OUT)")
    p.add_argument("--threshold", type=int, default=DEFAULT_NEAR_THRESHOLD)
    p.add_argument("--test-images", type=int, default=100_000)
    p.add_argument("--queries", type=int, default=20_000)
    p.add_argument("--node-cores", type=int, default=64)
    args = p.parse_args()
    honest(args.test_crops, args.train_crops, args.copies, args.threshold, args.seed, args.held_out)
    speed(args.threshold, args.test_images, args.queries, args.node_cores)


if __name__ == "__main__":
    main()
