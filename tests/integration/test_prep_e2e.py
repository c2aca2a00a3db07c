"""prep end to end on the bad-input corpus: nothing lost, readers agree, reruns/workers/kills give the same bytes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from data_prep import finalize, prep, verify
from pipeline.faults import PREP_KILL_AT as KILL_ENV
from tests.data_prep_fixtures import bad_corpus, tree_bytes  # noqa: F401

REPO = Path(__file__).resolve().parents[2]
ARGS = ["--max-samples-per-shard", "5", "--resize-shorter", "48", "--no-progress", "--seed", "7"]
KW = dict(max_samples_per_shard=5, resize_shorter=48, progress=False, seed=7)


def _cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "launch.cli", *args], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=300)


@pytest.fixture(scope="module")
def reference(bad_corpus, tmp_path_factory):  # noqa: F811
    """One uninterrupted single-worker run: the bytes every other run must reproduce."""
    root, _ = bad_corpus
    out = tmp_path_factory.mktemp("ref") / "out"
    summary = prep(root, out, **KW)
    return out, summary


def test_every_input_is_stored_once_or_rejected_with_its_reason(bad_corpus, reference):  # noqa: F811
    root, expected = bad_corpus
    out, summary = reference
    info = json.loads((out / "_info.json").read_text())
    sources = []
    for fname in info["splits"]["train"]["filenames"]:
        with tarfile.open(out / fname) as tar:
            names = tar.getnames()
            assert names == sorted(names)  # deterministic member order
            for m in tar.getmembers():
                assert (m.mtime, m.uid, m.gid, m.mode, m.uname) == (0, 0, 0, 0o644, "")
                if m.name.endswith(".json"):
                    sources.append(json.loads(tar.extractfile(m).read())["source"])
    good = sorted(rel for rel, reason in expected.items() if reason is None)
    assert sorted(sources) == good  # each good image exactly once
    rejects = [json.loads(ln) for ln in (out / "rejects.jsonl").read_text().splitlines()]
    assert {r["path"]: r["reason"] for r in rejects} == {k: v for k, v in expected.items() if v is not None}
    assert info["num_inputs"] == len(expected) == info["splits"]["train"]["num_samples"] + info["num_rejects"]
    assert summary["complete"] and summary["num_samples"] == {"train": len(good)}


def test_info_json_has_the_timm_schema(reference):
    out, _ = reference
    info = json.loads((out / "_info.json").read_text())
    assert info["num_classes"] == 3 and info["classes"] == json.loads((out / "classes.json").read_text())
    split = info["splits"]["train"]
    assert set(split) >= {"name", "num_samples", "filenames", "shard_lengths"} and split["name"] == "train"
    assert split["filenames"] == [f"train-{i:06d}.tar" for i in range(len(split["filenames"]))]
    assert sum(split["shard_lengths"]) == split["num_samples"] and max(split["shard_lengths"]) <= 5
    for f, n in zip(split["filenames"], split["shard_lengths"]):
        stats = json.loads((out / f.replace(".tar", "_stats.json")).read_text())
        assert stats["count"] == n and stats["bytes"] == (out / f).stat().st_size and stats["seconds"] >= 0
    assert "seconds" not in json.dumps(info)


def test_shards_read_by_webdataset_and_timm(reference):
    import webdataset as wds

    out, _ = reference
    info = json.loads((out / "_info.json").read_text())
    urls = [str(out / f) for f in info["splits"]["train"]["filenames"]]
    samples = list(wds.WebDataset(urls, shardshuffle=False).decode("pil"))
    assert len(samples) == info["splits"]["train"]["num_samples"]
    for s in samples:
        img = s.get("jpg") or s.get("png") or s.get("webp")
        assert img.mode == "RGB" and min(img.size) <= 48 and int(s["cls"]) == s["json"]["cls"]
    from timm.data.readers.reader_wds import ReaderWds

    reader = ReaderWds(str(out), split="train")
    got = list(reader)
    assert len(got) == len(samples) and {t for _, t in got} == {0, 1, 2}


def test_workers_2_equals_workers_1_and_rerun_is_a_no_op(bad_corpus, reference, tmp_path):  # noqa: F811
    root, _ = bad_corpus
    ref, _ = reference
    s = prep(root, tmp_path / "w2", workers=2, **KW)
    assert tree_bytes(tmp_path / "w2") == tree_bytes(ref)
    again = prep(root, tmp_path / "w2", workers=2, **KW)
    assert (again["shards_written"], again["shards_skipped"]) == (0, s["shards_total"])
    assert tree_bytes(tmp_path / "w2") == tree_bytes(ref)


@pytest.mark.parametrize("workers", ["1", "2"])
def test_killed_mid_shard_then_rerun_gives_identical_bytes(bad_corpus, tmp_path, workers):  # noqa: F811
    root, _ = bad_corpus
    # 12 samples per shard = two worker chunks, so the kill lands after part of the shard was written
    args = [*ARGS, "--max-samples-per-shard", "12"]
    prep(root, tmp_path / "ref", **{**KW, "max_samples_per_shard": 12})
    out = tmp_path / "out"
    r = _cli("prep", str(root), str(out), *args, "--workers", workers, env={KILL_ENV: "train-000001:10"})
    if workers == "1":
        assert r.returncode == -signal.SIGKILL  # the process itself died mid-shard
        assert (out / "train-000001.tar.partial").stat().st_size > 0
    else:
        # a pool worker died; main reports it (chunks in flight in the other worker are lost too)
        assert r.returncode == 1 and "worker process died" in r.stderr
    assert not (out / "train-000001_stats.json").exists() and not (out / "train-000001.tar").exists()
    assert not (out / "_info.json").exists()
    complete = len(list(out.glob("*_stats.json")))
    assert complete == 1 or workers == "2"
    r = _cli("prep", str(root), str(out), *args, "--workers", workers)
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    assert summary["shards_skipped"] == complete and summary["complete"]
    assert not list(out.glob("*.partial"))
    assert tree_bytes(out) == tree_bytes(tmp_path / "ref")


def test_job_array_shard_ranges_finalize_once_all_done(bad_corpus, reference, tmp_path):  # noqa: F811
    root, _ = bad_corpus
    ref, _ = reference
    out = tmp_path / "out"
    n = prep(root, out, shard_range=(0, 0), **KW)["shards_total"]
    first = prep(root, out, shard_range=(0, n // 2), **KW)
    assert not first["complete"] and not (out / "_info.json").exists() and finalize(out) is None
    second = prep(root, out, shard_range=(n // 2, n), **KW)
    assert second["complete"] and tree_bytes(out) == tree_bytes(ref)
    with pytest.raises(ValueError, match="different plan"):
        prep(root, out, **{**KW, "seed": 8})


def test_dedup_rejects_the_second_copy(bad_corpus, tmp_path):  # noqa: F811
    root, _ = bad_corpus
    prep(root, tmp_path / "d", dedup=True, workers=2, **KW)
    rejects = [json.loads(ln) for ln in (tmp_path / "d/rejects.jsonl").read_text().splitlines()]
    dups = [r for r in rejects if r["reason"] == "duplicate"]
    assert dups == [{"path": "cat/img_0.jpg", "reason": "duplicate", "detail": "same bytes as cat/dup of img_0.jpg"}]
    assert verify(tmp_path / "d") == []


def test_verify_catches_corruption(bad_corpus, reference, tmp_path):  # noqa: F811
    import shutil

    out = tmp_path / "c"
    shutil.copytree(reference[0], out)
    assert _cli("verify", str(out)).returncode == 0
    shard = out / "train-000001.tar"
    data = bytearray(shard.read_bytes())
    with tarfile.open(shard) as tar:
        m = next(m for m in tar.getmembers() if m.name.endswith((".jpg", ".png", ".webp")))
    data[m.offset_data + m.size // 2] ^= 0xFF  # one flipped byte inside an image
    shard.write_bytes(bytes(data))
    (out / "train-000002.tar").write_bytes((out / "train-000002.tar").read_bytes()[:700])  # truncated shard
    r = _cli("verify", str(out))
    assert r.returncode == 1
    assert f"train-000001.tar: sample {m.name.split('.')[0]}: sha256" in r.stdout
    assert "train-000002.tar" in r.stdout and "problem(s)" in r.stderr


def test_memory_stays_bounded(bad_corpus, tmp_path):  # noqa: F811
    """Under an address-space cap of (after imports) + 250 MiB, the 100/200 MP bombs are rejected, not decoded."""
    root, _ = bad_corpus
    code = """
import json, resource, sys
import data_prep.images, data_prep.build
vm = int([l for l in open('/proc/self/status') if l.startswith('VmSize')][0].split()[1]) * 1024
cap = vm + (250 << 20)
resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
s = data_prep.build.prep(sys.argv[1], sys.argv[2], max_pixels=int(sys.argv[3]), max_samples_per_shard=5,
                        progress=False, workers=2)
print(json.dumps(s["rejects_by_reason"]))
"""
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}

    def run(max_pixels: int, out: str) -> dict:
        r = subprocess.run([sys.executable, "-c", code, str(root), str(tmp_path / out), str(max_pixels)], cwd=REPO,
                           capture_output=True, text=True, env=env, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        return json.loads(r.stdout.strip().splitlines()[-1])

    assert run(89_478_485, "capped")["too_large"] == 2
    # control: let the 100 MP bomb through the header check and the cap makes its decoding fail
    # (the 200 MP one still hits Pillow's own hard limit of 2 × 89 MP)
    uncapped = run(150_000_000, "control")
    assert uncapped["too_large"] == 1 and uncapped["decode_error"] == 1


def test_workers_do_not_hang_after_the_caller_used_opencv_threads(bad_corpus, tmp_path):  # noqa: F811
    """A caller (a notebook, a script) that ran a multi-threaded OpenCV op before prep(workers=2):
    forked workers used to wait forever on OpenCV's pool threads, which only exist in the parent."""
    root, _ = bad_corpus
    code = """
import sys, cv2, numpy as np
cv2.resize(np.zeros((1500, 1500), np.float32), (2500, 2500), interpolation=cv2.INTER_CUBIC)  # starts cv2's pool
from data_prep import prep
s = prep(sys.argv[1], sys.argv[2], max_samples_per_shard=5, progress=False, workers=2)
print(s["samples_written"])
"""
    r = subprocess.run([sys.executable, "-c", code, str(root), str(tmp_path / "out")], cwd=REPO,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert int(r.stdout.split()[-1]) > 0
