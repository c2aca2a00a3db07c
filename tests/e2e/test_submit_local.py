"""`vitp submit` on this machine (submitit's local and debug executors), over shards written by
`vitp prep`: the natural path of a new user, including the ways it used to go wrong (a recipe that
reads a split prep did not write, a one-shard dataset on two ranks, a job that fails after submission)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.data_prep_fixtures import build_corpus, vitp_prep

ROOT = Path(__file__).resolve().parents[2]
TINY = "configs/pretrain/tiny_cpu.yaml"  # 1 node x 2 tasks, data.workers 1, data.val_split: val
SMALL = ["model.depth=1", "train.log_every=2", "checkpoint.every=0", "tracking.enabled=false"]


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("shards")
    build_corpus(d / "images", n_good_per_class=12)
    out = {"noval": d / "noval", "one": d / "one"}
    assert list(vitp_prep(d / "images", out["noval"])["splits"]) == ["train"]  # prep's defaults: no val
    info = vitp_prep(d / "images", out["one"], "--val-fraction", "0.2")
    assert [len(s["filenames"]) for s in info["splits"].values()] == [1, 1]  # one train shard, one val shard
    return out


def vitp(*args: str, env: dict | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "launch.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=timeout, stdin=subprocess.DEVNULL)


def submit_args(tmp_path: Path, data: Path | str, *extra: str) -> list[str]:
    return ["submit", "pretrain", "--cluster", "local", "--config", TINY, f"data.path={data}", *SMALL,
            f"run.dir={tmp_path / 'run'}", f"cluster.log_dir={tmp_path / 'jobs'}", *extra]


def test_submit_refuses_a_split_the_recipe_reads_but_prep_did_not_write(shards, tmp_path):
    r = vitp(*submit_args(tmp_path, shards["noval"]))
    assert r.returncode == 2
    assert r.stderr.splitlines() == [
        f"error: data.val_split: 'val' not in {shards['noval']}/_info.json (has: train); re-run vitp prep with "
        "--val-fraction or set data.val_split= (no evaluation)"]
    assert not (tmp_path / "jobs").exists()
    assert vitp(*submit_args(tmp_path, shards["noval"], "data.val_split=", "--dry-run")).returncode == 0


@pytest.mark.slow
@pytest.mark.distributed
def test_one_shard_trains_on_two_ranks_with_two_loader_workers(shards, tmp_path):
    r = vitp(*submit_args(tmp_path, shards["one"], "data.workers=2", "train.steps=4", "--wait"))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "warning" not in r.stderr  # local shards: streams seek to their range, nothing to warn about
    jid = r.stdout.splitlines()[0].split()[1]
    *_, done, tracked = r.stdout.splitlines()  # the outcome, then what tracking did
    assert done == f"job {jid} COMPLETED status=completed step=4 (logs: vitp logs {jid})"
    assert tracked == f"job {jid} tracking: delivered"
    res = json.loads((tmp_path / "jobs" / jid / "result.json").read_text())
    assert (res["status"], res["step"], res["world_size"]) == ("completed", 4, 2)
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [2, 4]
    assert all(0 < r["loss"] < 5 for r in rows if "loss" in r)
    val = [r for r in rows if "val_top1" in r]
    assert len(val) == 1 and val[0]["val_n"] == json.loads((shards["one"] / "_info.json").read_text())[
        "splits"]["val"]["num_samples"]  # the final evaluation read every val sample once
    assert (tmp_path / "run" / "model.safetensors").is_file()


@pytest.mark.slow
@pytest.mark.distributed
def test_wait_ends_when_the_dataset_vanished_after_submission(shards, tmp_path):
    """Every rank is held before the stage starts (test gate), the dataset is removed, the ranks go on:
    the stage raises, and `--wait` ends with exit 1 and the error's last line."""
    data = tmp_path / "data"
    shutil.copytree(shards["one"], data)
    gate = tmp_path / "gate"
    env = {"VITP_TEST_PAUSE_AT_STEP": "0", "VITP_TEST_PAUSE_FILE": str(gate)}
    proc = subprocess.Popen([sys.executable, "-m", "launch.cli", *submit_args(tmp_path, data, "--wait")], cwd=ROOT,
                            env={**os.environ, **env}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while not all(Path(f"{gate}.0.reached.{r}").exists() for r in (0, 1)):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the ranks never reached the gate"
            time.sleep(0.1)
        shutil.rmtree(data)
        Path(f"{gate}.0").touch()
        t0 = time.monotonic()
        out, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 1, out + err
    jid = out.splitlines()[0].split()[1]
    assert re.fullmatch(rf"job {jid} FAILED: DataError: {data}/_info.json: not found \(is data.path a `vitp prep` "
                        rf"output folder, and did prep finish\?\) \(rank ([01]); logs: vitp logs {jid} --rank \1\)",
                        err.splitlines()[-1]), err[-2000:]
    assert time.monotonic() - t0 < 120
    assert sorted(p.name for p in (tmp_path / "jobs" / jid).glob("error.*.json")) == ["error.0.json", "error.1.json"]


@pytest.mark.slow
def test_debug_executor_runs_in_this_process_and_reports_failure(shards, tmp_path):
    common = ["submit", "pretrain", "--cluster", "debug", "--config", TINY, *SMALL, "train.steps=2",
              f"cluster.log_dir={tmp_path / 'jobs'}", "--wait"]
    r = vitp(*common, "data.path=synthetic:classes=3,val=16", f"run.dir={tmp_path / 'run'}")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert re.search(r"^job DEBUG_\d+ COMPLETED status=completed step=2 ", r.stdout, flags=re.M)
    assert (tmp_path / "run" / "model.safetensors").is_file()
    # _info.json is intact (submit's check passes) but a shard is gone: the stage raises at its start
    data = tmp_path / "data"
    shutil.copytree(shards["one"], data)
    (data / "train-000000.tar").unlink()
    r = vitp(*common, f"data.path={data}", f"run.dir={tmp_path / 'run2'}")
    assert r.returncode == 1
    assert re.fullmatch(rf"job DEBUG_\d+ FAILED: DataError: {data}/_info.json: split 'train' names shard "
                        rf"{data}/train-000000.tar which does not exist \(rank 0; logs: vitp logs DEBUG_\d+ --rank 0\)",
                        r.stderr.splitlines()[-1]), r.stderr[-2000:]
