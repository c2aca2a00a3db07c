"""`vitp submit eval` takes `vitp eval`'s flags, queues a job whose entry point exists, and the job
scores the checkpoint: submitted to submitit's local executor, waited for, and its results read."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DATA = "synthetic:classes=4,train=64,val=40,noise=40"


def _vitp(*args, cwd=ROOT):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "launch.cli", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=600)


def test_submit_eval_runs_the_evaluation_stage_and_writes_its_results(tmp_path):
    run = tmp_path / "pre"
    r = _vitp("pretrain", "--config", "configs/pretrain/tiny_cpu.yaml", f"run.dir={run}", f"data.path={DATA}",
              "model.img_size=16", "train.steps=4", "checkpoint.every=0", "tracking.enabled=false",
              "cluster.tasks_per_node=1", "data.workers=0")
    assert r.returncode == 0, r.stderr[-2000:]
    out = tmp_path / "eval"
    r = _vitp("submit", "eval", "--checkpoint", str(run), "--data", DATA, "--split", "val", "--out", str(out),
              "--batch", "16", "--cluster", "local", "--wait", f"cluster.log_dir={tmp_path / 'jobs'}",
              "engine.backend=gloo")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert r.stdout.startswith("job ")
    results = json.loads((out / "results.json").read_text())
    assert results["eval/val/n"] == 40.0 and 0.0 <= results["eval/val/top1"] <= 1.0
    assert (out / "confusion_val.png").is_file() and (out / "per_class_val.json").is_file()
    # the same numbers as `vitp eval` in this process: one evaluation, two front doors
    r = _vitp("eval", "--checkpoint", str(run), "--data", DATA, "--split", "val", "--out", str(tmp_path / "direct"),
              "--batch", "16")
    assert r.returncode == 0, r.stderr[-2000:]
    direct = json.loads((tmp_path / "direct" / "results.json").read_text())
    assert direct["eval/val/top1"] == results["eval/val/top1"] and direct["eval/val/n"] == 40.0


def test_submit_eval_refuses_what_cannot_run(tmp_path):
    r = _vitp("submit", "eval", "--checkpoint", "nope", "--data", str(tmp_path / "missing"), "--cluster", "local",
              "--dry-run")
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1] == \
        f"error: --data {tmp_path / 'missing'}: no such dataset folder"
    r = _vitp("submit", "eval", "--checkpoint", "x", "--data", DATA, "--cluster", "local", "--dry-run",
              "optim.lr=1")
    assert r.returncode == 2 and "takes its flags and cluster." in r.stderr
