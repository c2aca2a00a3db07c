"""Checkpoint pieces that need no training run: RNG round trip, publishing rules, run-dir guard."""

import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline import checkpoint_layout as layout
from pipeline.train import checkpoint as ck

ROOT = Path(__file__).resolve().parents[2]


def test_rng_state_round_trips_through_weights_only_load(tmp_path):
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    state = ck.rng_state()
    torch.save(state, tmp_path / "s.pt")
    expect = (random.random(), np.random.rand(), torch.rand(1).item())
    random.seed(9)
    np.random.seed(9)
    torch.manual_seed(9)
    ck.set_rng_state(torch.load(tmp_path / "s.pt", weights_only=True))
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expect


def test_only_published_checkpoints_count(tmp_path):
    root = layout.root(tmp_path)
    (root / "tmp-step-00000009").mkdir(parents=True)  # torn save
    (root / "step-00000008").mkdir()  # no manifest: never published
    for s in (2, 4):
        (root / layout.tag_for(s)).mkdir()
        (root / layout.tag_for(s) / layout.MANIFEST).write_text(json.dumps({"step": s, "world_size": 2}))
    assert [p.name for p in layout.complete_checkpoints(tmp_path)] == ["step-00000002", "step-00000004"]
    assert layout.latest_checkpoint(tmp_path).name == "step-00000004"
    assert layout.latest_checkpoint(tmp_path / "nothing") is None


def test_run_dir_guard(tmp_path):
    from pipeline.config import load_config, to_yaml, write_resolved
    from pipeline.train.build import RunDirError, prepare_run_dir

    cfg = load_config("configs/pretrain/tiny_cpu.yaml", ["data.path=synthetic", f"run.dir={tmp_path}"],
                      world_size=1)
    assert prepare_run_dir(cfg.run, to_yaml(cfg), 0) is None  # empty: start
    (tmp_path / ".suite_identity.json").write_text("{}")  # a launcher's dot file: still empty
    assert prepare_run_dir(cfg.run, to_yaml(cfg), 0) is None
    write_resolved(cfg, tmp_path)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    assert prepare_run_dir(cfg.run, to_yaml(cfg), 0) is None  # this very run, died before its first checkpoint
    cfg.train.micro_batch //= 2  # an out-of-memory retry of it: the same run, split in smaller micro batches
    assert prepare_run_dir(cfg.run, to_yaml(cfg), 0) is None
    cfg.optim.lr = 0.5
    with pytest.raises(RunDirError, match="run.fresh=true"):
        prepare_run_dir(cfg.run, to_yaml(cfg), 0)


def test_metrics_file_drops_records_past_the_resumed_step(tmp_path):
    from pipeline.tracking import JsonlSink

    p = tmp_path / "metrics.jsonl"
    p.write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(1, 8)))
    kept = JsonlSink(p, keep_up_to=4).records
    assert [r["step"] for r in kept] == [1, 2, 3, 4]
    assert len(p.read_text().splitlines()) == 4


FAULTS = """
import sys
from pipeline import faults
for event, step in [("step", 1), ("step", 2), ("save", 3), ("step", 3)]:
    faults.hit(event, step)
    print(event, step, "passed", flush=True)
"""


def _faults(env: dict, script: str = FAULTS) -> subprocess.Popen:
    keep = {k: v for k, v in os.environ.items() if not k.startswith(("VITP_TEST_", "RANK"))}
    return subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, env={**keep, "PYTHONPATH": str(ROOT), **env},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _passed(out: str) -> list[str]:
    return [ln.rsplit(" ", 1)[0] for ln in out.splitlines() if ln.endswith("passed")]


def test_fault_hook_kills_only_the_chosen_rank_at_the_chosen_step():
    everything = ["step 1", "step 2", "save 3", "step 3"]
    inert = _faults({})
    out, err = inert.communicate(timeout=120)
    assert (inert.returncode, _passed(out)) == (0, everything), err[-2000:]
    other_rank = _faults({"VITP_TEST_KILL_AT_STEP": "3", "RANK": "0"})  # the kill rank is 1 by default
    out, err = other_rank.communicate(timeout=120)
    assert (other_rank.returncode, _passed(out)) == (0, everything), err[-2000:]
    at_step = _faults({"VITP_TEST_KILL_AT_STEP": "3", "RANK": "1"})  # "save 3" is not a step: passes
    out, _ = at_step.communicate(timeout=120)
    assert (at_step.returncode, _passed(out)) == (-signal.SIGKILL, ["step 1", "step 2", "save 3"])
    in_save = _faults({"VITP_TEST_KILL_DURING_SAVE": "3", "RANK": "2", "VITP_TEST_KILL_RANK": "2"})
    out, _ = in_save.communicate(timeout=120)
    assert (in_save.returncode, _passed(out)) == (-signal.SIGKILL, ["step 1", "step 2"])
