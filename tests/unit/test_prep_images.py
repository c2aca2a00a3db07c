"""data_prep.images: every bad input gets its reason; every good one comes out RGB 8-bit, upright, EXIF-free."""

from __future__ import annotations

import builtins
import hashlib
import io

import numpy as np
import pytest
from PIL import Image, ImageOps

from data_prep.images import ImageOptions, Reject, orient, process_image, target_size, to_rgb_array
from tests.data_prep_fixtures import bad_corpus, exif_rotated_jpeg, jpeg_bytes, natural_image  # noqa: F401


def _decode(s) -> Image.Image:
    im = Image.open(io.BytesIO(s.data))
    im.load()
    return im


def test_every_corpus_file_gets_its_expected_outcome(bad_corpus):  # noqa: F811
    root, expected = bad_corpus
    opts = ImageOptions()
    for rel, reason in expected.items():
        if reason in ("extension", "no_class") or rel == "eel/up":
            continue  # judged by the listing, not by the image worker
        if reason is None:
            s = process_image(str(root / rel), opts)
            im = _decode(s)
            assert im.mode == "RGB" and im.size == (s.width, s.height), rel
            assert s.sha256 == hashlib.sha256(s.data).hexdigest()
            assert not im.getexif(), f"{rel}: EXIF must be stripped"
        else:
            with pytest.raises(Reject) as e:
                process_image(str(root / rel), opts)
            assert e.value.reason == reason, (rel, e.value.detail)


def test_bombs_are_rejected_from_the_header_with_sizes(bad_corpus):  # noqa: F811
    root, _ = bad_corpus
    assert (root / "dog/bomb_100mp.png").stat().st_size < 100_000  # tiny on disk
    with pytest.raises(Reject, match="10000x10000"):
        process_image(str(root / "dog/bomb_100mp.png"), ImageOptions())


@pytest.mark.parametrize("orientation", range(1, 9))
def test_orient_matches_pil_exif_transpose(orientation):
    a = np.arange(5 * 7 * 3, dtype=np.uint8).reshape(5, 7, 3)
    im = Image.fromarray(a)
    exif = im.getexif()
    exif[0x0112] = orientation
    b = io.BytesIO()
    im.save(b, "PNG", exif=exif.tobytes())
    ref = np.asarray(ImageOps.exif_transpose(Image.open(io.BytesIO(b.getvalue()))))
    np.testing.assert_array_equal(orient(a, orientation), ref)


def test_exif_rotation_is_applied(tmp_path):
    p = tmp_path / "r.jpg"
    p.write_bytes(exif_rotated_jpeg(np.random.default_rng(0)))
    s = process_image(str(p), ImageOptions())
    a = np.asarray(_decode(s)).astype(int)
    # stored 60 wide × 40 high with the left half red; orientation 6 (rotate 90° clockwise) puts red on top
    assert (s.orig_width, s.orig_height, s.width, s.height) == (60, 40, 40, 60)
    assert a[:25, :, 0].mean() > 230 and a[:25, :, 1].mean() < 25
    assert a[35:, :, 1].mean() > 40  # bottom half is the natural image, not red


def test_transparency_composited_on_white_and_16bit_scaled():
    pal = Image.new("P", (4, 2), 0)
    pal.putpalette([255, 0, 0, 0, 0, 255] + [0] * 762)
    pal.paste(1, (0, 0, 2, 2))
    pal.info["transparency"] = 0
    a = to_rgb_array(pal)
    assert a[0, 0].tolist() == [0, 0, 255] and a[0, 3].tolist() == [255, 255, 255]
    la = Image.fromarray(np.array([[[0, 0], [0, 255], [200, 128]]], np.uint8), "LA")
    # alpha 0 → white, alpha 255 → the gray value, alpha 128 → halfway to white
    assert to_rgb_array(la)[0, :, 0].tolist() == [255, 0, round((200 * 128 + 255 * 127) / 255)]
    g16 = Image.fromarray(np.array([[0, 257, 32896, 65535]], np.uint16))
    assert to_rgb_array(g16)[0, :, 1].tolist() == [0, 1, 128, 255]
    cmyk = Image.new("CMYK", (2, 2), (0, 0, 0, 0))
    assert to_rgb_array(cmyk).tolist()[0][0] == [255, 255, 255]


def test_resize_shrinks_only_and_keeps_originals_when_allowed(tmp_path):
    assert target_size(500, 375, ImageOptions(resize_shorter=256)) == (341, 256)
    assert target_size(500, 375, ImageOptions(resize_longer=256)) == (256, 192)
    assert target_size(100, 80, ImageOptions(resize_shorter=256)) == (100, 80)  # never enlarged
    big = tmp_path / "big.jpg"
    big.write_bytes(jpeg_bytes(natural_image(np.random.default_rng(1), 600, 420)))
    s = process_image(str(big), ImageOptions(resize_shorter=100, quality=80))
    assert (s.width, s.height) == (143, 100) and s.ext == "jpg"
    # a kept RGB JPEG is byte-identical; with keep_original=False it is re-encoded
    small = tmp_path / "small.jpg"
    small.write_bytes(jpeg_bytes(natural_image(np.random.default_rng(2), 80, 60)))
    assert process_image(str(small), ImageOptions(resize_shorter=256)).data == small.read_bytes()
    assert process_image(str(small), ImageOptions(keep_original=False, quality=50)).data != small.read_bytes()


def test_reduced_decode_keeps_quality(tmp_path):
    """DCT-domain downscaling then the resize stays close to a full-size decode + Lanczos reference."""
    a = natural_image(np.random.default_rng(3), 1200, 900)
    p = tmp_path / "x.jpg"
    p.write_bytes(jpeg_bytes(a, quality=95))
    s = process_image(str(p), ImageOptions(resize_shorter=200, quality=95))
    ref = np.asarray(Image.open(p).convert("RGB").resize((s.width, s.height), Image.LANCZOS)).astype(float)
    got = np.asarray(_decode(s)).astype(float)
    assert np.abs(got - ref).mean() < 4.0


def test_unreadable_file_by_permission_is_a_reject(tmp_path, monkeypatch):
    # root ignores file modes, so fake the one fault we cannot cause for real
    p = tmp_path / "secret.jpg"
    p.write_bytes(b"\xff\xd8")
    real_open = builtins.open

    def deny(file, *a, **k):
        if str(file) == str(p):
            raise PermissionError(13, "Permission denied")
        return real_open(file, *a, **k)

    monkeypatch.setattr(builtins, "open", deny)
    with pytest.raises(Reject) as e:
        process_image(str(p), ImageOptions())
    assert (e.value.reason, e.value.detail) == ("unreadable", "Permission denied")


def test_directory_path_is_unreadable(tmp_path):
    with pytest.raises(Reject) as e:
        process_image(str(tmp_path), ImageOptions())
    assert e.value.reason == "unreadable"
