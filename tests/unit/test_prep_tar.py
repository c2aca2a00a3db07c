"""data_prep.shards.TarSink writes exactly what tarfile writes for the same fixed-metadata members."""

from __future__ import annotations

import io
import tarfile

import pytest

from data_prep.shards import TarSink, tar_header


def test_tar_sink_is_byte_identical_to_tarfile_ustar(tmp_path):
    members = [("k_00000001.cls", b"3"), ("k_00000001.jpg", bytes(range(256)) * 7), ("k_00000001.json", b"{}")]
    sink = TarSink(tmp_path / "a.tar")
    for name, data in members:
        sink.add(name, data)
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
