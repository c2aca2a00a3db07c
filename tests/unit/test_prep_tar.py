"""data_prep.tar against Python's tarfile, both ways: what tarfile writes (ustar, pax, GNU long names,
sizes at 512-byte boundaries, empty members, non-files) our reader reads identically, and what our
writer writes tarfile reads identically (and byte for byte as tarfile would write it)."""

from __future__ import annotations

import io
import tarfile

import pytest

from data_prep.tar import TarError, TarSink, iter_tar, tar_header, tar_member

SIZES = [0, 1, 511, 512, 513, 1023, 1024, 1025, 5000]
NAMES = [
    "k_00000001.cls",
    "dir/sub/k_00000002.jpg",
    "ünïcödé/键_3.png",  # non-ASCII: pax path record in PAX format, raw UTF-8 bytes in GNU/ustar
    "d" * 120 + "/long_prefix_split.webp",  # > 100 bytes, splittable at '/': ustar prefix field
    "n" * 150 + ".json",  # > 100 bytes, no '/': pax path or GNU ././@LongLink only
    "x" * 99 + ".j",  # 101 bytes
]


def _payload(i: int, size: int) -> bytes:
    return bytes((i * 31 + j) % 251 for j in range(size))


class _Stream(io.RawIOBase):
    """A non-seekable stream (a pipe or an HTTP body)."""

    def __init__(self, data: bytes):
        self._b = io.BytesIO(data)

    def readable(self) -> bool:
        return True

    def readinto(self, buf) -> int:
        chunk = self._b.read(min(len(buf), 700))  # short reads, as a pipe gives
        buf[:len(chunk)] = chunk
        return len(chunk)


def _tarfile_archive(fmt: int, names: list[str], **kw) -> bytes:
    """Regular files of every size under every name, plus a directory, a symlink with a long target and a
    hard link, which a reader of regular files skips."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=fmt, **kw) as tf:
        d = tarfile.TarInfo("a_dir")
        d.type = tarfile.DIRTYPE
        tf.addfile(d)
        for i, (name, size) in enumerate((n, s) for n in names for s in SIZES):
            ti = tarfile.TarInfo(f"{i:03d}_{name}")
            ti.size, ti.mtime = size, 1_700_000_000 + i
            tf.addfile(ti, io.BytesIO(_payload(i, size)))
            if i == 3:
                ln = tarfile.TarInfo("link_to_first")
                # a long target: GNU writes a ././@LongLink of type K, pax a linkpath record
                ln.type, ln.linkname = tarfile.SYMTYPE, "t" * (150 if fmt != tarfile.USTAR_FORMAT else 90)
                tf.addfile(ln)
                hl = tarfile.TarInfo("hard_link")
                hl.type, hl.linkname = tarfile.LNKTYPE, ti.name
                tf.addfile(hl)
    return out.getvalue()


def _tarfile_read(data: bytes) -> list[tuple[str, int, bytes]]:
    with tarfile.open(fileobj=io.BytesIO(data)) as tf:
        return [(m.name, m.size, tf.extractfile(m).read()) for m in tf if m.isreg()]


def _ours(data: bytes, seekable: bool, read_every: int = 1) -> list[tuple[str, int, bytes | None]]:
    f = io.BytesIO(data) if seekable else io.BufferedReader(_Stream(data), 512)
    return [(n, s, r() if i % read_every == 0 else None) for i, (n, s, r) in enumerate(iter_tar(f, seekable))]


@pytest.mark.parametrize("fmt", [tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT],
                         ids=["ustar", "gnu", "pax"])
@pytest.mark.parametrize("seekable", [True, False], ids=["file", "stream"])
def test_reader_reads_what_tarfile_writes(fmt, seekable):
    names = NAMES if fmt != tarfile.USTAR_FORMAT else [n for n in NAMES if "/" in n or len(n.encode()) <= 100]
    data = _tarfile_archive(fmt, names)
    ref = _tarfile_read(data)
    assert len(ref) == len(names) * len(SIZES)
    assert _ours(data, seekable) == ref
    # members whose data is skipped (seeked over or discarded) do not shift the ones after them
    assert _ours(data, seekable, read_every=3) == [(n, s, b if i % 3 == 0 else None) for i, (n, s, b) in enumerate(ref)]


def test_reader_ignores_pax_global_headers_and_honours_pax_size():
    data = _tarfile_archive(tarfile.PAX_FORMAT, NAMES[:2], pax_headers={"comment": "global record"})
    assert data[156:157] == b"g" and b"comment=global record" in data  # the archive starts with a global header
    assert _ours(data, True) == _tarfile_read(data)
    # a member with a pax "size" record (tarfile writes one for sizes of 8 GiB and more)
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tf:
        ti = tarfile.TarInfo("big.jpg")
        ti.size, ti.pax_headers = 700, {"size": "700"}
        tf.addfile(ti, io.BytesIO(_payload(1, 700)))
    assert _ours(out.getvalue(), True) == [("big.jpg", 700, _payload(1, 700))] == _tarfile_read(out.getvalue())


def test_writer_output_reads_identically_in_tarfile(tmp_path):
    names = [n for n in NAMES if len(n.encode()) <= 97]  # + a 3-digit index: at most 100 bytes
    members = [(f"{i:03d}{n}", _payload(i, s)) for i, (n, s) in enumerate((n, s) for n in names for s in SIZES)]
    sink = TarSink(tmp_path / "a.tar")
    for k in range(0, len(members), 4):  # prep appends a sample's serialised members at once
        sink.add_members(b"".join(tar_member(n, d) for n, d in members[k:k + 4]))
    sink.close()
    data = (tmp_path / "a.tar").read_bytes()
    assert len(data) % 10240 == 0
    with tarfile.open(tmp_path / "a.tar") as tf:
        got = [(m.name, m.size, m.mode, m.mtime, m.uid, m.uname, tf.extractfile(m).read()) for m in tf]
    assert got == [(n, len(d), 0o644, 0, 0, "", d) for n, d in members]
    assert _ours(data, False) == [(n, len(d), d) for n, d in members]


def test_writer_is_byte_identical_to_tarfile_ustar(tmp_path):
    members = [("k_00000001.cls", b"3"), ("k_00000001.jpg", bytes(range(256)) * 7), ("k_00000001.json", b"{}"),
               ("k_00000002.cls", b""), ("k_00000002.png", bytes(512))]
    sink = TarSink(tmp_path / "a.tar")
    for name, data in members:
        sink.add_members(tar_member(name, data))
    sink.close()
    ref = io.BytesIO()
    with tarfile.open(fileobj=ref, mode="w", format=tarfile.USTAR_FORMAT) as tf:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode, info.uname, info.gname = len(data), 0, 0o644, "", ""
            tf.addfile(info, io.BytesIO(data))
    got = (tmp_path / "a.tar").read_bytes()
    assert got == ref.getvalue() and len(got) % 10240 == 0
    with tarfile.open(tmp_path / "a.tar") as tf:
        assert [(m.name, tf.extractfile(m).read()) for m in tf] == members


def test_long_member_names_are_refused():
    with pytest.raises(ValueError, match="longer than 100 bytes"):
        tar_header("x" * 101, 1)
    tar_header("é" * 50, 1)  # 100 bytes of UTF-8
    with pytest.raises(ValueError, match="longer than 100 bytes"):
        tar_header("é" * 50 + "x", 1)


def test_cut_and_corrupt_archives_raise_tar_error():
    data = tar_member("a.jpg", b"x" * 600) + bytes(1024)
    for cut in (0, 100, 512, 700, len(data) - 512):
        with pytest.raises(TarError, match="cut off"):
            _ours(data[:cut], True)
    bad = bytearray(data)
    bad[0] ^= 1
    with pytest.raises(TarError, match="checksum"):
        _ours(bytes(bad), False)
