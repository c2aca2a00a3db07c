"""data_prep.store: one address API for local folders, S3 (moto on loopback) and HTTP (nginx)."""

from __future__ import annotations

import pytest

from data_prep import store


def test_public_drops_secrets_and_join_resolves():
    assert store.public("https://user:pw@h.example:8443/d/x?X-Amz-Signature=abc#f") == "https://h.example:8443/d/x"
    assert store.public("s3://bucket/prefix") == "s3://bucket/prefix"
    assert store.public("/data/x") == "/data/x"
    assert store.join("s3://b/p/", "train-000000.tar") == "s3://b/p/train-000000.tar"
    assert store.join("https://h/d?sig=1", "a.tar") == "https://h/d/a.tar"
    assert store.join("/data/x", "a.tar") == "/data/x/a.tar"
    assert store.join("s3://b/p", "https://other/a.tar") == "https://other/a.tar"
    assert store.join("s3://b/p", "/abs/a.tar") == "/abs/a.tar"
    assert [store.scheme(a) for a in ("s3://b", "gs://b", "HTTPS://h", "/x", "file:///x", "rel")] == \
        ["s3", "gs", "https", "file", "file", "file"]


def test_s3_read_ranges_and_errors(s3_bucket):
    fs, path = store.filesystem(s3_bucket)
    data = bytes(range(256)) * 4096  # 1 MiB
    fs.pipe(f"{path}/d/x.bin", data)
    url = f"{s3_bucket}/d/x.bin"
    assert store.size(url) == len(data) and store.exists(url) and not store.exists(f"{s3_bucket}/d/y")
    assert store.read_bytes(url) == data
    with store.open_read(url, start=300_001) as f:
        assert f.read(1000) == data[300_001:301_001]
    got = []
    assert store.read_range(url, 300_001, len(data) + 99, 5, got) == len(data)  # the reply states the size
    assert b"".join(got) == data[300_001:] and all(got)  # one GET, its body in the chunks that arrived
    assert store.read_range(url, len(data), len(data) + 10, 5, got) == len(data)  # nothing past the end
    with pytest.raises(FileNotFoundError):
        store.read_range(f"{s3_bucket}/d/y", 0, 10, 5, [])
    with pytest.raises(store.AddressError, match=r"^data.path: s3://no-such-bucket-x/y/_info.json: not found"):
        store.check_readable("s3://no-such-bucket-x/y/_info.json", "data.path")


def test_http_read_ranges_and_errors(tmp_path, http_folder):
    (tmp_path / "site" / "forbidden").mkdir(parents=True)
    data = bytes(range(256)) * 1000
    (tmp_path / "site" / "x.bin").write_bytes(data)
    base = http_folder(tmp_path / "site")
    assert store.read_bytes(f"{base}/x.bin") == data
    with store.open_read(f"{base}/x.bin", start=12345) as f:
        assert f.read(100) == data[12345:12445]
    got = []
    assert store.read_range(f"{base}/x.bin", 12345, 12445, 5, got) == len(data)
    assert b"".join(got) == data[12345:12445]
    assert store.read_range(f"{base}/x.bin", len(data), len(data) + 10, 5, got) == len(data)
    assert b"".join(got) == data[12345:12445]  # nothing past the end
    with pytest.raises(FileNotFoundError):
        store.read_range(f"{base}/nope.bin", 0, 10, 5, [])
    with pytest.raises(PermissionError):
        store.read_range(f"{base}/forbidden/x.bin", 0, 10, 5, [])
    with pytest.raises(store.AddressError, match=r"^eval: http://127.0.0.1:\d+/nope.json: HTTP 404 Not Found$"):
        store.check_readable(f"{base}/nope.json?token=secret", "eval")
    with pytest.raises(store.AddressError, match=r"HTTP 403 Forbidden$") as e:
        store.check_readable(f"{base}/forbidden/x.bin?token=secret", "eval")
    assert "secret" not in str(e.value)


def test_local_read(tmp_path):
    (tmp_path / "a").write_bytes(b"0123456789")
    with store.open_read(str(tmp_path / "a"), start=4) as f:
        assert f.read() == b"456789"
    with pytest.raises(store.AddressError, match="not found"):
        store.check_readable(str(tmp_path / "b"), "data.path")
