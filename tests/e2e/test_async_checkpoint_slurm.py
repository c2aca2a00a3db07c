"""USR2 while a checkpoint is written in the background, on the real local SLURM cluster (2 nodes x 1
task, CPU, gloo): the job finishes the write in flight, saves the stop's step inline, requeues, and
the run ends as the uninterrupted one.

Both gates are pipeline.faults': every rank's background write of checkpoint 4 is held before it
writes a byte (VITP_TEST_HOLD_WRITE) while the ranks train on to the gate before step 6
(VITP_TEST_PAUSE_AT_STEP); the test signals there, and releases the write only once the ranks stop.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file

from launch.jobs import outcome, read_index, wait
from pipeline.checkpoint_layout import complete_checkpoints, tag_for
from tests.e2e.test_submit_slurm import RES, SYNTH, TINY, Gate, cli, job_id, losses, n_lines, poll, usr2

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


def test_usr2_during_a_background_write_finishes_it_then_saves_and_requeues(slurm_cluster, tmp_path):
    steps, held, k = 10, 4, 6
    jobs = tmp_path / "jobs"
    common = ["submit", "pretrain", "--config", TINY, "--resources", RES, SYNTH, f"train.steps={steps}",
              "train.log_every=1", "checkpoint.every=4", "checkpoint.keep=10", "tracking.enabled=false",
              f"cluster.log_dir={jobs}"]
    gate = Gate(tmp_path / "gate", k)
    ref = cli([*common, f"run.dir={tmp_path / 'ref'}"])
    pre = cli([*common, f"run.dir={tmp_path / 'pre'}"], {**gate.env, "VITP_TEST_HOLD_WRITE": str(held)})
    assert ref.returncode == 0 and pre.returncode == 0, ref.stderr + pre.stderr
    jid = job_id(pre.stdout)
    folder, run = jobs / jid, tmp_path / "pre"
    write = Gate(tmp_path / "gate.write", held)  # the writers' gate: gate.write.4
    write.held(held, folder)
    gate.held(k, folder)  # the ranks trained step 5 with checkpoint 4 still being written
    assert complete_checkpoints(run) == []
    gate.signal_and_open(k, jid, folder, usr2(jid), "requeue")
    # the ranks stop after step 6 and wait for the write in flight; let it go on
    Path(f"{write.path}.{held}").touch()
    poll(lambda: n_lines(folder / "events.jsonl") > 0, 300, "the requeue", folder)
    entries = read_index(jobs)
    states = wait(entries, timeout_s=900)
    for e in entries:
        ok, line = outcome(e, states[e["job_id"]])
        assert ok, line
    ev = [json.loads(x) for x in (folder / "events.jsonl").read_text().splitlines()]
    assert [(e["event"], e["restart"], e["step"]) for e in ev] == [("requeued", 0, k), ("completed", 1, steps)]
    # the held write was published, then the stop's own checkpoint; the next attempt went on from step 6
    assert [p.name for p in complete_checkpoints(run)] == [tag_for(s) for s in (4, 6, 8, 10)]
    assert [s for s, _ in losses(run)] == list(range(1, steps + 1))
    assert losses(run) == losses(tmp_path / "ref")
    a, b = load_file(run / "model.safetensors"), load_file(tmp_path / "ref" / "model.safetensors")
    assert a.keys() == b.keys() and all(a[x].equal(b[x]) for x in a)
