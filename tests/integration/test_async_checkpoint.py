"""Checkpoints written in the background (checkpoint.async, the default) on 2 CPU ranks (DeepSpeed
over gloo): a SIGKILL at any point of a background write leaves the previous checkpoint as the resume
point and the same command resumes bit-exactly; pruning never takes the newest complete checkpoint; a
full disk during a background write stops the run in one line, the last complete checkpoint intact;
the minutes cadence saves at one step on every rank and after a resume.

The kill at "save" (a rank's files written, the checkpoint not yet published) is
tests/integration/test_pretrain.py::test_kill_during_save_resumes_from_previous, asynchronous too.
"""

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from pipeline.checkpoint_layout import complete_checkpoints, tag_for
from tests.integration.test_pretrain import assert_same_weights, losses, metrics, pretrain

pytestmark = pytest.mark.distributed


@pytest.fixture
def reference(tiny_reference):
    return tiny_reference


def names(run_dir) -> list[str]:
    return [p.name for p in complete_checkpoints(run_dir)]


@pytest.mark.parametrize("fault,rank", [
    # rank 1 dies as its write of checkpoint 4 begins, while rank 0 writes its own: between the two ranks' writes
    ("VITP_TEST_KILL_BEFORE_WRITE", 1),
    # rank 0 dies after writing checkpoint 4's manifest into its folder, before the rename that publishes it
    ("VITP_TEST_KILL_AT_PUBLISH", 0),
])
def test_a_kill_during_a_background_write_resumes_from_the_previous_checkpoint(reference, tmp_path, fault, rank):
    """keep=1: checkpoint 2 is the only complete one while 4 is written; the kill leaves it the resume
    point (pruning comes after publishing), and the same command ends as the uninterrupted run."""
    args = ["engine.zero_stage=2", "checkpoint.keep=1"]
    assert pretrain(tmp_path, *args, env={fault: "4", "VITP_TEST_KILL_RANK": str(rank)}) != 0
    ck = tmp_path / "checkpoints"
    assert names(tmp_path) == [tag_for(2)] and (ck / "LATEST").read_text().strip() == tag_for(2)
    tmp = ck / "tmp-step-00000004"
    if rank == 1:
        assert not (tmp / "vitp_rank1.pt").exists()
    else:
        assert (tmp / "manifest.json").is_file() and (tmp / "vitp_rank1.pt").is_file()  # whole, never renamed
    assert pretrain(tmp_path, *args) == 0
    assert [r["step"] for r in metrics(tmp_path) if "loss" in r] == [1, 2, 3, 4, 5, 6]  # none twice
    assert losses(tmp_path) == losses(reference(2))
    assert_same_weights(tmp_path, reference(2))
    assert names(tmp_path) == [tag_for(6)] and not list(ck.glob("tmp-*"))


def test_a_full_disk_during_a_background_write_stops_in_one_line(reference, tmp_path, capfd):
    """The run dir on a tmpfs with room for checkpoint 2 and not for 4 (keep=2: nothing to prune): the
    write of 4 fails in the background, the run stops with one line naming the file, checkpoint 2 stays
    the resume point; once space is freed the same command ends as the uninterrupted run."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4M", "tmpfs", str(disk)], capture_output=True,
                             text=True)
    if mounted.returncode:
        pytest.skip(f"cannot mount a tmpfs: {mounted.stderr.strip()}")
    try:
        run = disk / "run"
        assert pretrain(run, "engine.zero_stage=2") != 0
        err = capfd.readouterr().err
        # torch's zip writer reports ENOSPC as "unexpected pos"; the line says how much space was left
        pattern = (r"^error: checkpoint step-00000004: writing \S+/tmp-step-00000004/\S+\.pt failed \((OSError|"
                   r"RuntimeError): .*; 0\.\d MiB free there\); not published; last complete checkpoint: "
                   r"\S+/step-00000002$")
        assert [x for x in err.splitlines() if re.search(pattern, x)], err[-3000:]
        assert names(run) == [tag_for(2)]
        assert not (run / "checkpoints/tmp-step-00000004").exists()  # its space given back
        subprocess.run(["mount", "-o", "remount,size=64M", str(disk)], check=True)
        assert pretrain(run, "engine.zero_stage=2") == 0
        assert [r["step"] for r in metrics(run) if "loss" in r] == [1, 2, 3, 4, 5, 6]
        assert losses(run) == losses(reference(2))
        assert_same_weights(run, reference(2))
    finally:
        subprocess.run(["umount", str(disk)], check=True)


def cadence(ckpt: Path) -> int | None:
    return torch.load(ckpt / "vitp_shared.pt", weights_only=True)["cadence"]["next_at"]


def test_the_minutes_cadence_saves_one_step_on_every_rank_and_after_a_resume(tmp_path):
    """checkpoint.every_minutes with steps held ~0.25 s each (a slow loader): rank 0 picks each save's
    step; every rank saved that step (each rank's file says it), each save is at the step the one
    before picked; a run resumed from the first of them saves next at the step it had picked."""
    args = ["engine.zero_stage=2", "checkpoint.every=0", "checkpoint.every_minutes=0.015", "checkpoint.keep=50",
            "train.steps=14"]
    slow = {"VITP_TEST_SLOW_BATCH_S": "0.25"}
    whole = tmp_path / "whole"
    assert pretrain(whole, *args, env=slow) == 0
    saved = [int(p.name.split("-")[1]) for p in complete_checkpoints(whole)]
    assert len(saved) >= 2 and saved[-1] == 14, saved
    for s in saved:
        ckpt = whole / "checkpoints" / tag_for(s)
        assert [torch.load(ckpt / f"vitp_rank{r}.pt", weights_only=True)["step"] for r in (0, 1)] == [s, s]
    picked = {s: cadence(whole / "checkpoints" / tag_for(s)) for s in saved}
    assert all(picked[a] == b for a, b in zip(saved, saved[1:]) if b != 14), picked  # 14: the end
    first = saved[0]
    assert first > 1 + 4 and picked[first] > first  # timed from step 1 (PLAN_AFTER = 4 steps), then picked

    resumed = tmp_path / "resumed"
    shutil.copytree(whole / "checkpoints" / tag_for(first), resumed / "checkpoints" / tag_for(first))
    assert pretrain(resumed, *args, env=slow) == 0
    after = [int(p.name.split("-")[1]) for p in complete_checkpoints(resumed)]
    assert after[:2] == [first, picked[first]] if picked[first] < 14 else after == [first, 14]
