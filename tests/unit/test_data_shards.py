"""A tiny `vitp prep`-layout dataset writer (tarfile only) shared by the loader tests, and tests of
the raw shard reader and `read_info`."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from pipeline.data.shards import (
    DataError,
    SkipCounts,
    TarError,
    iter_tar,
    read_info,
    read_shard,
    segments,
)


def image_bytes(i: int, fmt: str = "jpg", size=(40, 30)) -> bytes:
    """A small deterministic image whose colours encode ``i``."""
    rng = np.random.default_rng(i)
    w, h = size
    a = (np.linspace(0, 255, w)[None, :, None] + rng.integers(0, 255, (1, 1, 3))) % 256
    a = np.broadcast_to(a, (h, w, 3)).astype(np.uint8) ^ rng.integers(0, 32, (h, w, 3), dtype=np.uint8)
    b = io.BytesIO()
    Image.fromarray(a).save(b, {"jpg": "JPEG", "png": "PNG", "webp": "WEBP"}[fmt])
    return b.getvalue()


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    ti = tarfile.TarInfo(name)
    ti.size = len(data)
    tar.addfile(ti, io.BytesIO(data))


def write_dataset(root: Path, splits: dict[str, list[int]], num_classes: int = 3, size=(40, 30),
                  missing_cls: set[str] = frozenset(), bad_image: set[str] = frozenset()) -> dict:
    """Write ``<split>-NNNNNN.tar`` shards with the given sample counts + ``_info.json`` and
    ``classes.json``; returns {split: [keys in order]}. Every 3rd sample is a PNG. Samples named in
    ``missing_cls`` get no .cls, those in ``bad_image`` get garbage image bytes (both still count in
    shard_lengths, as if the data rotted after prep)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    info_splits, keys, n = {}, {}, 0
    for split, sizes in splits.items():
        files, keys[split] = [], []
        for s, count in enumerate(sizes):
            fname = f"{split}-{s:06d}.tar"
            with tarfile.open(root / fname, "w", format=tarfile.USTAR_FORMAT) as tar:
                for _ in range(count):
                    key, fmt = f"{split}_{n:05d}", "png" if n % 3 == 2 else "jpg"
                    if key not in missing_cls:
                        _add(tar, f"{key}.cls", str(n % num_classes).encode())
                    img = b"\xff\xd8 not a jpeg" if key in bad_image else image_bytes(n, fmt, size)
                    _add(tar, f"{key}.{fmt}", img)
                    _add(tar, f"{key}.json", json.dumps({"key": key}).encode())
                    keys[split].append(key)
                    n += 1
            files.append(fname)
        info_splits[split] = {"name": split, "num_samples": sum(sizes), "filenames": files, "shard_lengths": sizes}
    classes = [f"class_{c}" for c in range(num_classes)]
    (root / "classes.json").write_text(json.dumps(classes))
    (root / "_info.json").write_text(json.dumps({"splits": info_splits, "num_classes": num_classes}))
    return keys


def label_of(key: str, num_classes: int = 3) -> int:
    return int(key.rsplit("_", 1)[1]) % num_classes


# --------------------------------------------------------------------------------------------------
def test_read_info(tmp_path):
    write_dataset(tmp_path, {"train": [3, 5], "val": [4]})
    info = read_info(tmp_path)
    assert info.num_classes == 3 and info.classes == ("class_0", "class_1", "class_2")
    assert info.split("train").num_samples == 8 and info.split("train").lengths == (3, 5)
    assert info.split("val").urls == (str(tmp_path / "val-000000.tar"),)


def test_read_info_errors(tmp_path):
    with pytest.raises(DataError, match="_info.json: not found"):
        read_info(tmp_path)
    write_dataset(tmp_path, {"train": [2, 2], "val": [0]})
    with pytest.raises(DataError, match="no split 'test'"):
        read_info(tmp_path).split("test")
    with pytest.raises(DataError, match="split 'val' is empty"):
        read_info(tmp_path).split("val")
    (tmp_path / "train-000001.tar").unlink()
    with pytest.raises(DataError, match="train-000001.tar which does not exist"):
        read_info(tmp_path)


def test_check_splits_names_key_file_and_remedy(tmp_path):
    from pipeline.data import check_splits

    write_dataset(tmp_path, {"train": [3, 2]})  # `vitp prep` without --val-fraction: no val split
    check_splits(tmp_path, {"data.train_split": "train", "data.val_split": None})  # no evaluation: fine
    with pytest.raises(DataError) as e:
        check_splits(tmp_path, {"data.train_split": "train", "data.val_split": "val"})
    assert str(e.value) == (f"data.val_split: 'val' not in {tmp_path}/_info.json (has: train); re-run vitp prep "
                            "with --val-fraction or set data.val_split= (no evaluation)")
    with pytest.raises(DataError, match=r"^data.train_split: 'big' not in .*\(has: train\); set data.train_split"):
        check_splits(tmp_path, {"data.train_split": "big"})
    info = json.loads((tmp_path / "_info.json").read_text())
    info["splits"]["val"] = {"filenames": []}
    (tmp_path / "_info.json").write_text(json.dumps(info))
    with pytest.raises(DataError, match="^data.val_split: 'val' in .*_info.json is empty; re-run vitp prep"):
        check_splits(tmp_path, {"data.val_split": "val"})
    with pytest.raises(DataError, match=r"^.*nowhere/_info.json: not found \(is data.path a `vitp prep` output folder"):
        check_splits(tmp_path / "nowhere", {"data.train_split": "train"})
    check_splits("synthetic:val=4", {"data.train_split": "train", "data.val_split": "val"})
    with pytest.raises(DataError, match=r"^data.val_split: 'val' not in data.path synthetic:val=0 \(has: train\)"):
        check_splits("synthetic:val=0", {"data.val_split": "val"})


def test_read_shard_ranges_and_bad_samples(tmp_path):
    keys = write_dataset(tmp_path, {"train": [6]}, missing_cls={"train_00001"}, bad_image={"train_00004"})["train"]
    url = str(tmp_path / "train-000000.tar")
    c = SkipCounts()
    got = [(k, lab) for k, _, lab in read_shard(url, c, 0, None, num_classes=3)]
    assert [k for k, _ in got] == [k for k in keys if k != "train_00001"]
    assert all(lab == label_of(k) for k, lab in got) and c == {"missing_cls": 1}
    # indices count valid samples only: [1, 3) → 3rd and 4th valid sample
    assert [k for k, _, _ in read_shard(url, SkipCounts(), 1, 3, num_classes=3)] == ["train_00002", "train_00003"]
    # label outside num_classes
    c = SkipCounts()
    assert len(list(read_shard(url, c, 0, None, num_classes=2))) == 3 and c["bad_cls"] == 2


def test_read_shard_cut_off(tmp_path):
    write_dataset(tmp_path, {"train": [8]})
    url = tmp_path / "train-000000.tar"
    data = url.read_bytes()
    for cut in (len(data) // 2, len(data) - 10240 + 512 * 3, 700):
        url.write_bytes(data[:cut])
        c = SkipCounts()
        with pytest.warns(UserWarning, match="shard"):
            n = len(list(read_shard(str(url), c, 0, None, num_classes=3)))
        assert n < 8 and c == {"corrupt_tar": 1}, (cut, n, c)


def test_segments_cover_cyclic_sequence():
    lengths, order = [3, 5, 2], [2, 0, 1]  # sequence: s2[0:2] s0[0:3] s1[0:5]
    assert segments(lengths, order, 1, 5) == [(2, 1, 2), (0, 0, 3), (1, 0, 1)]
    assert segments(lengths, order, 8, 4) == [(1, 3, 5), (2, 0, 2)]  # wraps around


@pytest.mark.parametrize("fmt", [tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])
@pytest.mark.parametrize("seekable", [True, False])
def test_tar_reader_agrees_with_tarfile(tmp_path, fmt, seekable):
    """The loader's own tar parser sees the same regular files as tarfile, whatever wrote the tar:
    long names (ustar prefix, GNU ././@LongLink, pax path), unicode, directories and links skipped,
    empty and 512-multiple sizes; it is a stream reader when not seekable (remote shards)."""
    members = {"a.cls": b"3", "a.jpg": bytes(range(256)) * 7, "empty.txt": b"",
               "x" * 60 + "/" + "y" * 80 + ".jpg": b"z", "dír/ünï.cls": b"1", "b.bin": b"\x01" * 1024}
    if fmt != tarfile.USTAR_FORMAT:
        members["l" * 150 + ".jpg"] = b"long"
    path = tmp_path / "t.tar"
    with tarfile.open(path, "w", format=fmt) as tar:
        tar.addfile(_dir("somedir"))
        for name, data in members.items():
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            tar.addfile(ti, io.BytesIO(data))
        link = tarfile.TarInfo("link.jpg")
        link.type, link.linkname = tarfile.SYMTYPE, "a.jpg"
        tar.addfile(link)
    with open(path, "rb") as f:
        src = f if seekable else io.BufferedReader(_Unseekable(f.read()))
        got = {}
        for i, (name, size, read) in enumerate(iter_tar(src, seekable)):
            if i % 2 == 0 or name == "a.jpg":  # skipping some checks the skip path too
                got[name] = read()
                assert len(got[name]) == size
    want = {k: v for i, (k, v) in enumerate(members.items()) if k in got}
    assert got == want and "a.jpg" in got


def _dir(name):
    ti = tarfile.TarInfo(name)
    ti.type = tarfile.DIRTYPE
    return ti


class _Unseekable(io.RawIOBase):
    def __init__(self, data):
        self.buf, self.pos = data, 0

    def readable(self):
        return True

    def readinto(self, b):
        n = min(len(b), len(self.buf) - self.pos)
        b[:n] = self.buf[self.pos:self.pos + n]
        self.pos += n
        return n


def test_tar_reader_errors(tmp_path):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        ti = tarfile.TarInfo("a.jpg")
        ti.size = 1000
        tar.addfile(ti, io.BytesIO(b"q" * 1000))
    data = buf.getvalue()
    assert [n for n, _, _ in iter_tar(io.BytesIO(data), True)] == ["a.jpg"]
    for cut in (100, 700, 1536):  # in the header, in the data, before the end marker
        with pytest.raises(TarError, match="cut off"):
            list((n, r()) for n, _, r in iter_tar(io.BytesIO(data[:cut]), True))
    bad = bytearray(data)
    bad[10] ^= 0xFF
    with pytest.raises(TarError, match="checksum"):
        list(iter_tar(io.BytesIO(bytes(bad)), True))
    # a pax record whose length is not a number: a TarError naming it, not a stray ValueError
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        ti = tarfile.TarInfo("a.jpg")
        ti.size, ti.pax_headers = 3, {"comment": "hello"}
        tar.addfile(ti, io.BytesIO(b"abc"))
    data = buf.getvalue()
    at = data.index(b" comment=hello")
    data = data[:at - 2] + b"zz" + data[at:]
    with pytest.raises(TarError, match="bad pax record length b'zz'"):
        list(iter_tar(io.BytesIO(data), True))
