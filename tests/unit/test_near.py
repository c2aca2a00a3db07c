"""data_prep/near.py: the perceptual hash and the second signature find transformed copies of real
photographs (scikit-learn's sample images; crops of Debian's wallpapers) and not unrelated ones; the
index answers as a brute-force scan does."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image, ImageEnhance, ImageOps

from bench.photos import load, photo_files, textured_crops
from data_prep.near import NearIndex, distance, margin, phash, reference, reference_hashes, signature
from data_prep.testsets import image_signatures
from pipeline.config.prep import DEFAULT_NEAR_THRESHOLD as D


@pytest.fixture(scope="module")
def photos() -> list[Image.Image]:
    from sklearn.datasets import load_sample_images

    out = []
    for a in load_sample_images().images:
        im = Image.fromarray(a)
        im.thumbnail((384, 384))
        out.append(im)
    return out


def _jpeg(im: Image.Image, q: int) -> Image.Image:
    b = io.BytesIO()
    im.save(b, "JPEG", quality=q)
    return Image.open(io.BytesIO(b.getvalue())).convert("RGB")


COPIES = {
    "half": lambda im: im.resize((im.width // 2, im.height // 2)),
    "quarter": lambda im: im.resize((im.width // 4, im.height // 4)),
    "jpeg30": lambda im: _jpeg(im, 30),
    "crop5": lambda im: ImageOps.crop(im, (im.width // 40, im.height // 40) * 2),
    "border10": lambda im: ImageOps.expand(im, 10, fill=(0, 0, 0)),
    "mirror": ImageOps.mirror,
    "brighter": lambda im: ImageEnhance.Brightness(im).enhance(1.1),
    "darker": lambda im: ImageEnhance.Brightness(im).enhance(0.9),
    "greyscale": lambda im: im.convert("L"),  # of a colour test image: what the grey rule is for
}


@pytest.mark.parametrize("name", COPIES)
def test_each_transform_is_found_and_the_other_photo_is_not(photos, name):
    refs = [reference(np.asarray(im)) for im in photos]
    index = NearIndex.build([r[0] for r in refs], D, np.stack([r[1] for r in refs]))
    for i, im in enumerate(photos):
        m = index.nearest(*signature(np.asarray(COPIES[name](im))))
        assert m is not None and m.test == i and m.distance <= D and m.margin >= 0, (name, i, m)


def test_unrelated_photos_are_far_apart(photos):
    a, b = (reference_hashes(np.asarray(im)) for im in photos)
    assert min(distance(x, y) for x in a for y in b) > D + 4
    index = NearIndex.build([a], D)
    assert index.nearest(phash(np.asarray(photos[1]))) is None
    assert index.nearest(phash(np.asarray(ImageOps.mirror(photos[1])))) is None


def test_mirror_hash_is_the_mirrored_image_hash(photos):
    im = photos[0]
    assert reference_hashes(np.asarray(im))[1] == phash(np.asarray(ImageOps.mirror(im)))
    assert reference_hashes(np.asarray(im))[0] != reference_hashes(np.asarray(im))[1]


def _encoded(im: Image.Image, fmt: str, **kw) -> bytes:
    b = io.BytesIO()
    im.save(b, fmt, **kw)
    return b.getvalue()


def test_exif_rotated_grey_and_cmyk_test_images(photos):
    """A test file stored sideways with an EXIF orientation, in grey, or in CMYK: its hashes are those of
    the picture as shown, so the training copy (upright RGB, as prep stores it) is found."""
    im = photos[0]
    exif = Image.Exif()
    exif[0x0112] = 6  # shown rotated 90 degrees clockwise from storage
    sideways = _encoded(im.transpose(Image.Transpose.ROTATE_90), "JPEG", quality=95, exif=exif.tobytes())
    files = {"exif": sideways, "grey": _encoded(im.convert("L"), "PNG"),
             "cmyk": _encoded(im.convert("CMYK"), "JPEG", quality=95)}
    train = phash(np.asarray(im))
    for name, data in files.items():
        hs, _ = image_signatures(data)
        assert min(distance(train, h) for h in hs) <= 4, name
    # the same file without its orientation tag would not match: the test is of the orientation
    plain, _ = image_signatures(_encoded(im.transpose(Image.Transpose.ROTATE_90), "JPEG", quality=95))
    assert min(distance(train, h) for h in plain) > D


@pytest.mark.parametrize("threshold", [0, 3, 8, 12, 17, 24])
def test_index_lookups_equal_a_brute_force_scan(threshold):
    rng = np.random.default_rng(threshold)
    hashes = [tuple(int(x) for x in rng.integers(0, 2**64, 4, dtype=np.uint64)) for _ in range(3000)]
    index = NearIndex.from_bytes(NearIndex.build(hashes, threshold).to_bytes())
    queries = [int(x) for x in rng.integers(0, 2**64, 300, dtype=np.uint64)]
    flips = []
    for _ in range(300):  # and copies at every distance up to the threshold and a little beyond
        i = int(rng.integers(len(hashes)))
        flips.append(int(rng.integers(0, threshold + 3)))
        bits = rng.choice(64, size=flips[-1], replace=False)
        queries.append(hashes[i][int(rng.integers(4))] ^ int(sum(1 << int(b) for b in bits)))
    found = [index.nearest(q) for q in queries]
    assert found == [index.nearest_brute(q) for q in queries]
    for k, m in zip(flips, found[300:]):  # every copy within the threshold found
        assert k > threshold or (m is not None and m.distance <= k)


@pytest.fixture(scope="module")
def wallpaper_crops() -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Textured crops of Debian's mate-backgrounds photos: (test crops of every other photo, clean crops
    of the rest)."""
    files, why = photo_files(("mate-backgrounds",))
    if not files:
        pytest.skip(why)
    rng = np.random.default_rng(0)
    test, clean = [], []
    for k, (_, path) in enumerate(files):
        (test if k % 2 else clean).extend(textured_crops(load(path, 768), 150, rng, (96, 256)))
    return test, clean


def test_chance_hash_matches_of_real_photos_fail_the_second_signature(wallpaper_crops):
    """Clean crops of other photos whose hashes lie within D of a test crop's (there are dozens) are not
    near-duplicates once the thumbnails are compared; transformed copies of test crops still are."""
    test, clean = wallpaper_crops
    refs = [reference(a) for a in test]
    hashes, thumbs = np.array([r[0] for r in refs], np.uint64), np.stack([r[1] for r in refs])
    chance, rejected = 0, 0
    index = NearIndex.build([r[0] for r in refs], D, thumbs)
    for a in clean:
        h, t = signature(a)
        near = np.flatnonzero(np.bitwise_count(hashes ^ np.uint64(h)).min(axis=1) <= D)
        chance += len(near)
        rejected += index.nearest(h, t) is not None
        assert (margin(t, thumbs[near]) < 0).all()
    assert chance >= 10 and rejected == 0, (chance, rejected)
    found = sum(index.nearest(*signature(np.asarray(COPIES[name](Image.fromarray(a))))) is not None
                for a in test[:: max(1, len(test) // 40)] for name in COPIES)
    assert found >= 0.95 * len(COPIES) * len(test[:: max(1, len(test) // 40)])


def test_the_batched_blur_is_opencvs():
    """margin() blurs thousands of detail thumbnails in one product; it is cv2.GaussianBlur's answer."""
    import cv2

    from data_prep.near import BLUR_MATRIX, BLUR_SIGMA

    g = np.random.default_rng(0).integers(0, 256, (16, 16)).astype(np.float32)
    assert np.abs(BLUR_MATRIX @ g @ BLUR_MATRIX.T - cv2.GaussianBlur(g, (0, 0), BLUR_SIGMA)).max() < 1e-3


def _half_sky(photo: Image.Image, seed: int) -> np.ndarray:
    """A 192 px square: a noisy sky (a slow gradient, noise sigma 5; 80 rows) above a textured part of the photo.
    At full size the sky's rows span ~30 grey levels; a quarter-size copy averages the noise away and
    reads them as flat (<= 16), which must not frame the copy differently from its original."""
    rng = np.random.default_rng(seed)
    pic = np.asarray(photo.convert("RGB"))[-112:, :192].astype(np.float32)
    sky = np.linspace(150, 190, 80, dtype=np.float32)[:, None, None] * np.array([0.75, 0.85, 1.0], np.float32)
    sky = np.broadcast_to(sky, (80, 192, 3)) + rng.normal(0, 5, (80, 192, 1))
    return np.clip(np.concatenate([sky, pic]), 0, 255).astype(np.uint8)


def test_a_quarter_size_copy_of_a_half_flat_picture_is_found(photos):
    """The trim takes off a frame only (flat bands of one colour at both ends of an axis), not a picture's
    own flat sky: at full size the sky is noisy and stays, at a quarter it is flat, so a trim of flat
    lines as such cut the sky off the copy alone (its hash 32 bits off). The quarter-size copy is found,
    the sky kept by both; the same sky over the other photo is not."""
    from data_prep.near import grey, trim_box

    a, other = _half_sky(photos[0], 0), _half_sky(photos[1], 1)
    quarter = np.asarray(Image.fromarray(a).resize((48, 48), Image.Resampling.BILINEAR))
    assert trim_box(grey(a)) == (0, 192, 0, 192) and trim_box(grey(quarter)) == (0, 48, 0, 48)
    refs = [reference(a), reference(other)]
    index = NearIndex.build([r[0] for r in refs], D, np.stack([r[1] for r in refs]))
    m = index.nearest(*signature(quarter))
    assert m is not None and m.test == 0 and m.distance <= 6 and m.margin >= 0.02, m
    index = NearIndex.build([refs[1][0]], D, refs[1][1][None])
    assert index.nearest(*signature(quarter)) is None and index.nearest(*signature(a)) is None
    # a frame is still trimmed whole: a 10 px border, and a letterbox (top and bottom only)
    framed = np.asarray(ImageOps.expand(Image.fromarray(a), 10, fill=(0, 0, 0)))
    boxed = np.pad(a, ((24, 24), (0, 0), (0, 0)), constant_values=20)
    assert trim_box(grey(framed)) == (11, 201, 11, 201) and trim_box(grey(boxed)) == (25, 215, 0, 192)
    assert index.nearest(*signature(framed)) is None
    assert NearIndex.build([refs[0][0]], D, refs[0][1][None]).nearest(*signature(framed)).distance <= 4


def _one_line(seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Two 192 px squares that share one dark horizontal line and little else: (a pink dusk sky over a
    thin dark shore, calm water below, in colour; a grey picture of fog with its own coarse texture over
    and under a dark line at the same height)."""
    rng = np.random.default_rng(seed)
    y = np.arange(192, dtype=np.float32)[:, None]
    field = np.where(y < 120, 200 + 20 * y / 120, 170.0)
    sky = field + rng.normal(0, 2, (192, 192))
    sky[120:128] = 40
    fog = 0.8 * field + np.kron(rng.normal(0, 8, (24, 24)), np.ones((8, 8)))
    fog[120:128] = 30
    return (np.clip(np.stack([sky, 0.7 * sky, 0.8 * sky], -1), 0, 255).astype(np.uint8),
            np.clip(fog, 0, 255).astype(np.uint8))


def test_one_shared_line_does_not_make_a_grey_picture_a_copy(monkeypatch):
    """A grey picture against a colour one is compared without colour (luma, detail): a line both share
    over unlike content passes those, not the detail less its strongest row x column pattern (the
    line); a greyscale copy of the colour picture passes all three."""
    import data_prep.near as near

    colour, fog = _one_line(0)
    hashes, refs = reference(colour)
    h, t = signature(fog)
    assert margin(t, refs[None])[0] < -0.5
    monkeypatch.setattr(near, "MIN_GREY", near.MIN_GREY[:2] + (-1.0,))  # luma and detail alone: passed
    assert margin(t, refs[None])[0] >= 0
    monkeypatch.undo()
    index = NearIndex.build([hashes], D, refs[None])
    m = index.nearest(*signature(np.asarray(Image.fromarray(colour).convert("L"))))
    assert m is not None and m.test == 0 and m.distance <= 2 and m.margin >= 0.02, m
