"""Datasets read from an object store through real servers on loopback (moto's S3, nginx), and
through a fault proxy between the loader and the server: resets, 503s, a stalled read.

The dataset is a real `vitp prep` output (its shard stats record per-sample byte offsets), uploaded
to a fresh bucket with fsspec; every test compares what the loader reads remotely with what it reads
from the local folder.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import fsspec
import numpy as np
import pytest
import torch

from pipeline.config import DataCfg
from pipeline.data import stream
from pipeline.data.loader import TrainLoader
from pipeline.data.shards import (
    DataError,
    SkipCounts,
    open_shard,
    read_info,
    read_positions,
    read_shard,
    shard_offsets,
)
from pipeline.data.stream import ReadPolicy
from tests.data_prep_fixtures import jpeg_bytes, natural_image
from tests.fault_proxy import FaultProxy, Faults

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs/pretrain/tiny_cpu.yaml")
FAST = ReadPolicy(timeout_s=1.0, retries=4, backoff_s=0.01)  # the tests' faults come often and go at once


@pytest.fixture(scope="module")
def prepped(tmp_path_factory) -> Path:
    """`vitp prep` over 48 noisy 96-px JPEGs (~10 KiB each, 3 classes): train 39 in 4 shards, val 9."""
    from data_prep import prep

    root = tmp_path_factory.mktemp("remote")
    rng = np.random.default_rng(0)
    for i in range(48):
        img = natural_image(rng, 96, 96)
        img ^= rng.integers(0, 48, img.shape, dtype=np.uint8)  # noise: bytes that do not compress
        (root / "images" / f"c{i % 3}").mkdir(parents=True, exist_ok=True)
        (root / "images" / f"c{i % 3}" / f"{i:03d}.jpg").write_bytes(jpeg_bytes(img))
    out = root / "shards"
    prep(root / "images", out, val_fraction=1 / 6, seed=0, max_samples_per_shard=10, progress=False)
    return out


@pytest.fixture
def remote(prepped, s3_bucket) -> str:
    """The prep output uploaded to ``s3://<fresh bucket>/ds``."""
    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    fs.put(str(prepped) + "/", s3_bucket.removeprefix("s3://") + "/ds", recursive=True)
    return f"{s3_bucket}/ds"


@pytest.fixture
def small_blocks(monkeypatch):
    """16 KiB ranged reads: a shard of ~100 KiB takes several, so faults land between and inside them."""
    monkeypatch.setattr(stream, "BLOCK", 16 << 10)


def through(monkeypatch, s3_server, faults: Faults) -> FaultProxy:
    """A fault proxy in front of the S3 server; this process's S3 clients go through it from now on."""
    proxy = FaultProxy(s3_server.endpoint, faults)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    return proxy


def every_sample(path: str, policy=FAST) -> tuple[list, SkipCounts]:
    info, counts = read_info(path), SkipCounts()
    out = []
    for name in sorted(info.splits):
        sp = info.splits[name]
        out += list(read_positions(sp, range(sp.num_samples), counts, num_classes=info.num_classes, policy=policy))
    return out, counts


def test_dataset_reads_the_same_from_s3_as_from_its_folder(prepped, remote):
    info, local = read_info(remote), read_info(prepped)
    assert (info.num_classes, info.classes, info.digest) == (local.num_classes, local.classes, local.digest)
    assert info.splits["train"].urls[0] == f"{remote}/train-000000.tar"
    assert info.splits["train"].lengths == local.splits["train"].lengths == (10, 10, 10, 9)
    got, counts = every_sample(remote)
    want, _ = every_sample(str(prepped))
    assert len(got) == 48 and got == want and counts == {}


@pytest.mark.timeout(300)
def test_resets_503s_and_a_stall_lose_double_or_reorder_nothing(prepped, remote, s3_server, monkeypatch,
                                                                 small_blocks):
    """Connections reset every 40 KiB, every 5th request a 503, the 4th request stalls past the read
    timeout: every (key, bytes, label) arrives once, in order, as from the local folder."""
    want, _ = every_sample(str(prepped))
    proxy = through(monkeypatch, s3_server, Faults(reset_every=40 << 10, fail_every=5, stall={4}, stall_s=5))
    try:
        got, counts = every_sample(remote)
    finally:
        proxy.close()
    assert got == want and counts == {}
    assert proxy.resets >= 5 and proxy.failed >= 5 and proxy.stalled == 1
    assert proxy.bytes_down > sum(Path(prepped, f).stat().st_size for f in read_info(prepped).splits["train"].urls)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("where", ["s3", "http"])
def test_a_link_that_resets_every_few_kib_inside_a_block_loses_nothing(where, prepped, request, monkeypatch,
                                                                        small_blocks):
    """Connections reset every 3 KiB, well under a 16 KiB block: each try keeps what it received and
    the next ranged GET starts after it, so every sample arrives once, in order, and no byte of a
    shard is fetched twice (the ranges of one object only move forward; ranged GETs are all it asks)."""
    want, _ = every_sample(str(prepped))
    if where == "s3":
        remote = request.getfixturevalue("remote")
        proxy = through(monkeypatch, request.getfixturevalue("s3_server"), Faults())
    else:
        served = request.getfixturevalue("http_folder")(prepped.parent)
        proxy = FaultProxy(served)
        remote = f"{proxy.url}/{prepped.name}"
    try:
        info = read_info(remote)  # the small files arrive whole; the shards come through the faults
        proxy.faults = Faults(reset_every=3 << 10)
        got, counts = [], SkipCounts()
        for name in sorted(info.splits):
            sp = info.splits[name]
            got += list(read_positions(sp, range(sp.num_samples), counts, num_classes=info.num_classes,
                                       policy=FAST))
    finally:
        proxy.close()
    assert got == want and counts == {}
    shard_bytes = sum(Path(prepped, u).stat().st_size for s in info.splits.values()
                      for u in read_info(prepped).splits[s.name].urls)
    assert proxy.resets >= shard_bytes // (3 << 10) - 1
    for shard in {t.split("?")[0] for m, t, _ in proxy.requests if t.endswith(".tar") or ".tar?" in t}:
        asked = [(m, r) for m, t, r in proxy.requests if t.split("?")[0] == shard]
        starts = [int(r.removeprefix("bytes=").split("-")[0]) for m, r in asked]
        assert {m for m, _ in asked} == {"GET"} and starts == sorted(starts) and len(starts) > 1, shard


@pytest.mark.timeout(300)
def test_a_training_epoch_through_faults_equals_the_local_one(prepped, remote, s3_server, monkeypatch,
                                                              small_blocks):
    def batches(path):
        cfg = DataCfg(path=str(path), workers=0, shuffle_buffer=6, read_timeout_s=1, read_retries=8)
        ld = TrainLoader(cfg, img_size=32, micro_batch=4, global_batch=8, rank=1, world_size=2, seed=1,
                         return_keys=True)
        return [(x.clone(), y.clone(), list(k)) for x, y, k in ld], ld

    want, _ = batches(prepped)
    proxy = through(monkeypatch, s3_server, Faults(reset_every=48 << 10, fail_every=6))
    try:
        got, ld = batches(remote)
    finally:
        proxy.close()
    assert [k for *_, k in got] == [k for *_, k in want]
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(got, want))
    assert proxy.resets >= 2 and proxy.failed >= 2 and ld.skipped == {}
    assert ld.read_stats()["read_mb_s_per_worker"] > 0


def test_a_shard_that_never_answers_is_skipped_and_counted_or_stops_the_run(prepped, remote, s3_server,
                                                                            monkeypatch):
    proxy = through(monkeypatch, s3_server, Faults(fail_matching="train-000002.tar"))
    info = read_info(remote)  # _info.json and classes.json still come through
    sp = info.splits["train"]
    try:
        counts = SkipCounts()
        with pytest.warns(UserWarning, match=re.escape(f"{remote}/train-000002.tar: unreadable after 3 tries")):
            got = list(read_positions(sp, range(sp.num_samples), counts, num_classes=3,
                                      policy=ReadPolicy(1, 2, backoff_s=0.01)))
        lost = [x for x in every_sample(str(prepped))[0][:39] if x not in got]
        assert len(got) == 29 and counts == {"unreadable_shard": 1}
        assert lost == list(read_shard(str(prepped / "train-000002.tar"), SkipCounts(), 0, None, num_classes=3))

        stop = ReadPolicy(1, 1, "stop", backoff_s=0.01)
        with pytest.raises(DataError) as e:
            list(read_positions(sp, range(sp.num_samples), SkipCounts(), num_classes=3, policy=stop))
        msg = str(e.value)
        assert "\n" not in msg and msg.startswith(f"{remote}/train-000002.tar: unreadable after 2 tries at byte 0")
        assert msg.endswith("(data.on_read_error: stop)")

        # a training run's loader workers: the run stops with the same one line
        cfg = DataCfg(path=remote, workers=2, read_timeout_s=1, read_retries=0, on_read_error="stop")
        ld = TrainLoader(cfg, img_size=32, micro_batch=4, global_batch=8, rank=0, world_size=1, seed=0)
        with pytest.raises(DataError) as e:
            list(ld)
        msg = str(e.value)
        assert "\n" not in msg and msg.startswith(f"{remote}/train-000002.tar: unreadable after 1 tries at byte")
        # its workers, maybe inside a fetch still, ended with the error (not whenever the loader is collected)
        assert [p for p in multiprocessing.active_children() if p.daemon] == []
    finally:
        proxy.close()


def test_a_mid_shard_read_starts_at_the_samples_byte_offset(prepped, remote, s3_server, monkeypatch):
    """Prep records each sample's offset; a read from sample 7 asks the server for bytes from there
    on (one ranged GET of the rest, nothing before it) and yields what a scan from the start does."""
    url = f"{remote}/train-000001.tar"
    local = str(prepped / "train-000001.tar")
    offsets = shard_offsets(local)
    stats = json.loads((prepped / "train-000001_stats.json").read_text())
    assert offsets == tuple(stats["offsets"]) and len(offsets) == stats["count"] == 10 and offsets[0] == 0
    scan = list(read_shard(local, SkipCounts(), 0, None, num_classes=3))
    opened = open_shard(local, 7)  # a local file seeks there too
    assert (opened.index, opened.f.tell()) == (7, offsets[7])
    opened.f.close()
    assert list(read_shard(local, SkipCounts(), 7, None, num_classes=3)) == scan[7:]
    proxy = through(monkeypatch, s3_server, Faults())
    try:
        got = list(read_shard(url, SkipCounts(), 7, None, num_classes=3, policy=FAST))
    finally:
        proxy.close()
    assert got == scan[7:]
    gets = [r for m, t, r in proxy.requests if m == "GET" and t.split("?")[0].endswith("train-000001.tar")]
    assert gets and gets[0].startswith(f"bytes={offsets[7]}-")
    assert proxy.bytes_down < Path(local).stat().st_size - offsets[7] + 8192  # + headers of the replies


def test_a_resumed_loader_over_s3_reads_only_what_it_needs_and_continues_exactly(prepped, remote, s3_server,
                                                                                 monkeypatch):
    """Resume at micro-batch 3 of an epoch: the same batches as the uninterrupted run, with fewer bytes
    fetched than re-reading the stream's prefix would take."""
    cfg = DataCfg(path=remote, workers=0, shuffle_buffer=4, read_timeout_s=5)
    args = dict(img_size=32, micro_batch=4, global_batch=4, rank=0, world_size=1, seed=5, return_keys=True)
    whole = [list(k) for _, _, k in TrainLoader(cfg, **args)]
    sd = {**TrainLoader(cfg, **args).state_dict(), "step": 7}
    proxy = through(monkeypatch, s3_server, Faults())
    try:
        again = TrainLoader(cfg, **args)
        again.load_state_dict(sd)
        rest = [list(k) for _, _, k in again]
        resumed_bytes = proxy.bytes_down
    finally:
        proxy.close()
    assert rest == whole[7:] and len(whole) == 9
    total = sum(int(json.loads((prepped / f"train-{i:06d}_stats.json").read_text())["bytes"]) for i in range(4))
    assert resumed_bytes < 0.8 * total  # 28 of 39 samples consumed: the prefix is not read again


@pytest.mark.timeout(300)
def test_http_dataset_evaluates_as_its_folder(prepped, http_folder):
    """nginx serving the prep output: eval batches over HTTP equal those over the folder."""
    from pipeline.data.loader import EvalLoader

    base = http_folder(prepped.parent) + "/" + prepped.name

    def evaluate(path):
        ld = EvalLoader(DataCfg(path=path, workers=2), img_size=32, batch=5, rank=0, world_size=1, split="val",
                        return_keys=True)
        return [(x, y, m, list(k)) for x, y, m, k in ld]

    got, want = evaluate(base), evaluate(str(prepped))
    assert [k for *_, k in got] == [k for *_, k in want] and len(got) == 2
    assert all(torch.equal(a, b) for g, w in zip(got, want) for a, b in zip(g[:3], w[:3]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert read_info(base).splits["val"].num_samples == 9


@pytest.fixture(scope="module")
def weights(tmp_path_factory) -> Path:
    """A small random ViT (3 classes, 32 px) as vitp safetensors: enough to compare numbers."""
    from pipeline.model import build_vit
    from pipeline.weights import save_model

    torch.manual_seed(0)
    m = build_vit(width=32, depth=2, heads=2, mlp_dim=64, patch=8, img_size=32, num_classes=3)
    return save_model(m, tmp_path_factory.mktemp("w") / "model.safetensors")


def vitp(*args) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "launch.cli", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)


@pytest.mark.timeout(600)
def test_vitp_eval_over_http_scores_as_over_the_folder(prepped, weights, http_folder, tmp_path):
    """`vitp eval --data http://...` (nginx serving the prep output): top-1 and few-shot numbers equal
    those of `--data FOLDER`."""
    base = http_folder(prepped.parent) + "/" + prepped.name
    results = {}
    for name, data in (("folder", str(prepped)), ("http", base)):
        r = vitp("eval", "--checkpoint", str(weights), "--data", data, "--split", "val", "--fewshot", "--shots", "1,2",
                 "--seeds", "2", "--batch", "8", "--out", str(tmp_path / name))
        assert r.returncode == 0, r.stderr[-2000:]
        res = json.loads((tmp_path / name / "results.json").read_text())
        results[name] = {k: v for k, v in res.items() if not k.endswith(("_per_s", "seconds", "artifacts"))}
    assert results["http"] == results["folder"]
    assert results["http"]["eval/val/n"] == 9.0 and any(k.startswith("eval/fewshot") for k in results["http"])


def test_fewshot_evaluators_over_http_match_the_folder(prepped, weights, http_folder, tmp_path):
    """`eval.fewshot_data` entries that are https:// addresses: the periodic few-shot evaluators of a
    run give the numbers they give over the same folder (its val split serving as `test`)."""
    from pipeline.config import load_config
    from pipeline.eval import evaluators as evals
    from pipeline.eval.task import Task
    from pipeline.model import build_vit

    few = tmp_path / "few"
    shutil.copytree(prepped, few)
    info = json.loads((few / "_info.json").read_text())
    info["splits"]["test"] = {**info["splits"].pop("val"), "name": "test"}
    (few / "_info.json").write_text(json.dumps(info))
    base = http_folder(tmp_path) + "/few"
    net = build_vit(width=32, depth=2, heads=2, mlp_dim=64, patch=8, img_size=32, num_classes=3)
    from safetensors.torch import load_file

    net.load_state_dict(load_file(str(weights)))
    net.eval()
    got = {}
    for name, path in (("folder", str(few)), ("http", base)):
        cfg = load_config(TINY, ["data.path=synthetic:train=8", f"eval.fewshot_data=[few={path}]",
                                 "eval.fewshot_shots=[1,2]", "eval.fewshot_seeds=2", "model.width=32", "model.depth=2",
                                 "model.heads=2", "model.mlp_dim=64", "model.patch=8"], world_size=1)
        ctx = evals.Context(cfg.data, Task(False), img_size=cfg.model.img_size, batch=cfg.eval.batch,
                            device=torch.device("cpu"), rank=0, world=1)
        (few,) = [d.build(ctx) for d in evals.declare(evals.run_entries(cfg)) if d.entry.type == "fewshot"]
        got[name] = few.run(net, 1)  # the run's few-shot evaluator of eval.fewshot_data
    assert got["http"] == got["folder"] and len(got["http"]) >= 2
