"""`vitp prep` into an object store and `vitp verify` from one, against real servers on loopback
(moto's S3 server, nginx over HTTP): the objects equal a local prep's files byte for byte, appear
whole or not at all, a rerun re-makes only what is incomplete, and bad addresses are one line."""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import boto3
import numpy as np
import pytest
from PIL import Image

from data_prep import prep
from pipeline.faults import PREP_KILL_AT as KILL_ENV
from tests.data_prep_fixtures import build_corpus, tree_bytes

REPO = Path(__file__).resolve().parents[2]
ARGS = ["--max-samples-per-shard", "4", "--no-progress", "--seed", "3"]
KW = dict(max_samples_per_shard=4, progress=False, seed=3)


def cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "launch.cli", *map(str, args)], cwd=REPO, capture_output=True,
                          text=True, env={**os.environ, **(env or {})}, timeout=300)


def s3():
    return boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"])


def objects(url: str) -> dict[str, dict]:
    """{name under the prefix: head of the object} for ``s3://bucket/prefix``."""
    bucket, _, prefix = url.removeprefix("s3://").partition("/")
    out = {}
    for page in s3().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/"):
        for o in page.get("Contents", []):
            out[o["Key"][len(prefix) + 1:]] = s3().head_object(Bucket=bucket, Key=o["Key"])
    return out


def body(url: str, name: str) -> bytes:
    bucket, _, prefix = url.removeprefix("s3://").partition("/")
    return s3().get_object(Bucket=bucket, Key=f"{prefix}/{name}")["Body"].read()


def put(url: str, name: str, data: bytes, **kw) -> None:
    bucket, _, prefix = url.removeprefix("s3://").partition("/")
    s3().put_object(Bucket=bucket, Key=f"{prefix}/{name}", Body=data, **kw)


@pytest.fixture
def corpus(tmp_path) -> tuple[Path, Path]:
    """(images, local prep of them): the bytes every object store prep must reproduce."""
    build_corpus(tmp_path / "images", n_good_per_class=3)
    prep(tmp_path / "images", tmp_path / "local", **KW)
    return tmp_path / "images", tmp_path / "local"


def test_prep_to_s3_equals_local_and_rerun_remakes_only_incomplete_shards(s3_bucket, corpus, tmp_path):
    images, local = corpus
    url = f"{s3_bucket}/ds"
    r = cli("prep", images, url, *ARGS, "--staging-dir", tmp_path / "staging")
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    n = summary["shards_total"]
    assert summary["complete"] and summary["shards_written"] == n >= 5
    objs = objects(url)
    ref = tree_bytes(local)
    shards = [f"train-{i:06d}" for i in range(n)]
    assert set(objs) == set(ref) | {f"{s}_stats.json" for s in shards}  # nothing else: no temporary names
    assert {k: body(url, k) for k in ref} == ref  # byte-identical to the local prep, _info.json included
    for s in shards:
        stats = json.loads(body(url, f"{s}_stats.json"))
        tar = (local / f"{s}.tar").read_bytes()
        assert (stats["bytes"], stats["sha256"]) == (len(tar), hashlib.sha256(tar).hexdigest())
    assert list((tmp_path / "staging").iterdir()) == []  # staged shards are gone once uploaded

    # mark every tar object (a copy onto itself with metadata): a re-upload would drop the mark
    bucket, _, prefix = url.removeprefix("s3://").partition("/")
    for s in shards:
        key = f"{prefix}/{s}.tar"
        s3().copy_object(Bucket=bucket, Key=key, CopySource={"Bucket": bucket, "Key": key},
                         Metadata={"mark": "first"}, MetadataDirective="REPLACE")
    s3().delete_object(Bucket=bucket, Key=f"{prefix}/{shards[2]}_stats.json")  # incomplete: no marker
    put(url, f"{shards[3]}.tar", body(url, f"{shards[3]}.tar")[:1024])  # wrong size for its stats
    r = cli("prep", images, url, *ARGS, "--staging-dir", tmp_path / "staging")
    assert r.returncode == 0, r.stderr
    again = json.loads(r.stdout)
    assert (again["shards_written"], again["shards_skipped"]) == (2, n - 2)
    marks = {s: objects(url)[f"{s}.tar"]["Metadata"].get("mark") for s in shards}
    assert marks == {s: (None if s in shards[2:4] else "first") for s in shards}
    assert {k: body(url, k) for k in ref} == ref


def noise_png(path: Path, side: int, seed: int) -> None:
    """An incompressible RGB PNG (~3 bytes a pixel), kept by prep as it is."""
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (side, side, 3), dtype=np.uint8)).save(path)


def test_a_shard_larger_than_two_parts_arrives_whole(s3_bucket, tmp_path):
    for i in range(10):  # ~1.2 MB each: one 12 MB shard, three 5 MiB parts
        noise_png(tmp_path / "big" / "a" / f"{i}.png", 640, i)
    prep(tmp_path / "big", tmp_path / "local", max_samples_per_shard=100, progress=False)
    url = f"{s3_bucket}/big"
    r = cli("prep", tmp_path / "big", url, "--max-samples-per-shard", "100", "--no-progress", "--part-size", "5MiB")
    assert r.returncode == 0, r.stderr
    tar = (tmp_path / "local" / "train-000000.tar").read_bytes()
    assert len(tar) > 10 * 2**20
    head = objects(url)["train-000000.tar"]
    assert head["ETag"].strip('"').endswith("-3")  # a multipart upload of three parts
    assert body(url, "train-000000.tar") == tar
    r = cli("prep", tmp_path / "big", f"{s3_bucket}/x", "--part-size", "1MiB")
    assert r.returncode == 2 and "at least 5242880" in r.stderr


def test_killed_prep_leaves_only_whole_objects_and_rerun_completes(s3_bucket, corpus, tmp_path):
    images, local = corpus
    url = f"{s3_bucket}/ds"
    r = cli("prep", images, url, *ARGS, "--staging-dir", tmp_path / "staging", env={KILL_ENV: "train-000002:2"})
    assert r.returncode == -signal.SIGKILL
    objs = objects(url)
    assert "_info.json" not in objs and "rejects.jsonl" not in objs
    assert not any(k.startswith("train-000002") for k in objs)  # the shard being made was never uploaded
    ref = tree_bytes(local)
    for k in objs:
        if k.endswith(".tar"):  # whatever was uploaded is whole: the final shard's bytes
            assert body(url, k) == ref[k]
        else:
            assert k in ref or (k.endswith("_stats.json") and k.replace("_stats.json", ".tar") in objs)
    r = cli("prep", images, url, *ARGS, "--staging-dir", tmp_path / "staging")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["complete"]
    assert {k: body(url, k) for k in ref} == ref


def test_verify_reads_s3_and_http_like_a_folder_and_finds_remote_corruption(s3_bucket, http_folder, corpus, tmp_path):
    images, local = corpus
    url = f"{s3_bucket}/ds"
    assert cli("prep", images, url, *ARGS).returncode == 0
    base = http_folder(tmp_path)
    ok = cli("verify", local)
    assert ok.returncode == 0, ok.stdout
    line = ok.stdout.strip().replace(str(local), "ADDRESS")
    for address in (url, f"{base}/local", f"{base}/local?X-Amz-Signature=SECRET"):
        r = cli("verify", address, "--workers", "2")
        assert r.returncode == 0, r.stdout + r.stderr
        assert r.stdout.strip().replace(address.split("?")[0], "ADDRESS") == line
        assert "SECRET" not in r.stdout + r.stderr

    # the same damage locally and in the bucket: a flipped byte inside an image, a truncated shard
    tar = bytearray((local / "train-000001.tar").read_bytes())
    tar[1536 + 200] ^= 0xFF  # inside the first sample's image (after its .cls member's header + data block)
    cut = (local / "train-000002.tar").read_bytes()[:700]
    (local / "train-000001.tar").write_bytes(bytes(tar))
    (local / "train-000002.tar").write_bytes(cut)
    put(url, "train-000001.tar", bytes(tar))
    put(url, "train-000002.tar", cut)
    bad_local, bad_s3 = cli("verify", local), cli("verify", url)
    assert bad_local.returncode == bad_s3.returncode == 1
    assert "train-000001.tar: sample" in bad_s3.stdout and "train-000002.tar: unreadable tar" in bad_s3.stdout
    assert re.search(r"train-000001.tar: \d+ bytes with sha256", bad_s3.stdout)  # the whole tar vs its stats
    assert bad_s3.stdout == bad_local.stdout


def test_bad_addresses_are_one_line_before_anything_starts(s3_bucket, http_folder, corpus, tmp_path):
    images, _ = corpus
    (tmp_path / "site" / "forbidden").mkdir(parents=True)
    base = http_folder(tmp_path / "site")
    run = tmp_path / "run"
    cases = [
        (["verify", "s3://no-such-bucket-vitp/ds"], "vitp verify: s3://no-such-bucket-vitp/ds/_info.json: not found"),
        (["verify", f"{base}/nope?X-Amz-Signature=SECRET"], f"vitp verify: {base}/nope/_info.json: HTTP 404 Not Found"),
        (["verify", f"{base}/forbidden/ds"], f"vitp verify: {base}/forbidden/ds/_info.json: HTTP 403 Forbidden"),
        (["prep", images, "s3://no-such-bucket-vitp/ds"], "OUT: s3://no-such-bucket-vitp/ds: no such bucket"),
        (["prep", images, f"{base}/ds?sig=SECRET"], f"OUT: {base}/ds: http(s) addresses are read-only"),
        (["pretrain", "--config", "configs/pretrain/tiny_cpu.yaml", f"run.dir={run}",
          "data.path=s3://no-such-bucket-vitp/ds"], "data.path: s3://no-such-bucket-vitp/ds/_info.json: not found"),
        (["pretrain", "--config", "configs/pretrain/tiny_cpu.yaml", f"run.dir={run}",
          f"data.path={base}/forbidden/ds?X-Amz-Signature=SECRET"],
         f"data.path: {base}/forbidden/ds/_info.json: HTTP 403 Forbidden"),
        (["pretrain", "--config", "configs/pretrain/tiny_cpu.yaml", f"run.dir={run}", "data.path=synthetic:classes=4",
          f"eval.fewshot_data=[{base}/pets]"], f"eval.fewshot_data: {base}/pets/_info.json: HTTP 404 Not Found"),
    ]
    for args, expect in cases:
        r = cli(*args)
        err = r.stderr.strip().splitlines()
        assert r.returncode == 2, (args, r.stderr)
        assert len(err) == 1 and err[0].startswith(f"error: {expect}"), (args, err)
        assert "SECRET" not in r.stderr + r.stdout
    assert not run.exists()
    assert objects(f"{s3_bucket}/ds") == {}


def test_credentials_reach_no_object_log_or_output(s3_bucket, corpus, tmp_path):
    """The secret key botocore signs with is used, never written: not in an object, the staging
    folder or what prep prints."""
    images, _ = corpus
    secret = "vitp-test-secret-key-7f3a"
    url = f"{s3_bucket}/ds"
    r = cli("prep", images, url, *ARGS, "--staging-dir", tmp_path / "staging", env={"AWS_SECRET_ACCESS_KEY": secret})
    assert r.returncode == 0, r.stderr
    assert secret not in r.stdout + r.stderr
    assert all(secret.encode() not in body(url, k) for k in objects(url))
    assert not [p for p in (tmp_path / "staging").rglob("*") if p.is_file()]


def test_a_failed_upload_stops_prep_with_one_line(s3_bucket, tmp_path):
    """The store refuses an upload (here: the bucket is gone): the first failure is raised once,
    naming the object, and the shard's stats, the completion marker, are never sent."""
    from data_prep import upload

    folder = tmp_path / "staged"
    folder.mkdir()
    (folder / "train-000000.tar").write_bytes(b"\0" * 10240)
    (folder / "train-000000_stats.json").write_text("{}")
    with pytest.raises(upload.UploadFailed) as e:
        with upload._Uploader(folder, "s3://no-such-bucket-vitp/ds", upload.store.MIN_PART_SIZE) as up:
            up.submit({"shard": "train-000000.tar"})
    assert str(e.value).startswith("s3://no-such-bucket-vitp/ds/train-000000.tar: upload failed: ")
    assert "\n" not in str(e.value) and "rerun the same command" in str(e.value)
    assert (folder / "train-000000_stats.json").exists()  # kept back: the tar never arrived
