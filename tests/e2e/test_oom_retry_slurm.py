"""An out-of-memory rank on the local SLURM cluster (2 nodes x 1 task): the fault injection raises
torch.OutOfMemoryError, the class a CUDA OOM raises, on rank 1 before step 3. The batch script requeues
the job once with half the micro batch and twice the accumulation (the global batch kept), which
`vitp jobs` shows; the run then ends bit-identical to the same checkpoint resumed by hand with
train.micro_batch halved. A micro batch of 1 cannot be halved: the job fails with one line."""

from __future__ import annotations

import pytest
from safetensors.torch import load_file

from launch.attempts import read_events
from launch.jobs import read_index
from tests.e2e.test_submit_slurm import RES, SYNTH, TINY, cli, losses

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

# tiny_cpu: global batch 32 = micro 16 x accumulation 1 x 2 ranks; halved: 8 x 2 x 2
COMMON = ["submit", "pretrain", "--config", TINY, "--resources", RES, SYNTH, "train.steps=5", "train.log_every=1",
          "checkpoint.every=2", "checkpoint.keep=5", "tracking.enabled=false", "cluster.max_failures=0", "--wait",
          "checkpoint.async=false"]  # inline: the fault before step 3 finds step 2's checkpoint published


def test_oom_requeued_with_half_the_micro_batch_equals_a_hand_resume(slurm_cluster, tmp_path):
    run, jobs = tmp_path / "oom", tmp_path / "oom_jobs"
    r = cli([*COMMON, f"run.dir={run}", f"cluster.log_dir={jobs}"], env={"VITP_TEST_OOM_AT_STEP": "3"})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]  # the retry spends no cluster.max_failures
    jid = read_index(jobs)[0]["job_id"]
    ev = read_events(jobs / jid)
    assert [(e["event"], e.get("oom"), e.get("micro_batch"), e.get("requeued")) for e in ev] == [
        ("failed", True, [16, 8], True), ("completed", None, None, None)]
    listing = cli(["jobs", "--log-dir", str(jobs)]).stdout.splitlines()
    assert "  attempt 0: out of memory on rank 1 at train.micro_batch 16; requeued with train.micro_batch 8 " \
           "(train.global_batch kept)" in listing
    assert "vitp: train.micro_batch 16 -> 8" in (jobs / jid / f"{jid}_0_log.err").read_text()
    # by hand: the same run killed before step 3, then resubmitted with train.micro_batch=8
    hand, hand_jobs = tmp_path / "hand", tmp_path / "hand_jobs"
    r = cli([*COMMON, f"run.dir={hand}", f"cluster.log_dir={hand_jobs}"], env={"VITP_TEST_KILL_AT_STEP": "3"})
    assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-2000:]
    r = cli([*COMMON, f"run.dir={hand}", f"cluster.log_dir={hand_jobs}", "train.micro_batch=8"])
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert [s for s, _ in losses(run)] == [1, 2, 3, 4, 5] and losses(run) == losses(hand)
    a, b = load_file(run / "model.safetensors"), load_file(hand / "model.safetensors")
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)


def test_oom_before_the_first_checkpoint_starts_over_in_the_same_run_dir(slurm_cluster, tmp_path):
    """No checkpoint yet (the first is due at step 4): the requeued attempt's config differs from the
    run dir's config.yaml only in train.micro_batch, so it starts over there from step 1, not refused as
    a foreign run dir; step 1 logged by the first attempt is not left twice in metrics.jsonl."""
    run, jobs = tmp_path / "run", tmp_path / "jobs"
    r = cli([*COMMON, f"run.dir={run}", f"cluster.log_dir={jobs}", "checkpoint.every=4"],
            env={"VITP_TEST_OOM_AT_STEP": "2"})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    ev = read_events(jobs / read_index(jobs)[0]["job_id"])
    assert [(e["event"], e.get("micro_batch")) for e in ev] == [("failed", [16, 8]), ("completed", None)]
    assert [s for s, _ in losses(run)] == [1, 2, 3, 4, 5]
    assert "  micro_batch: 8\n" in (run / "config.yaml").read_text()
    assert [p.name for p in sorted((run / "checkpoints").glob("step-*"))] == ["step-00000004", "step-00000005"]


def test_oom_at_micro_batch_one_fails_in_one_line(slurm_cluster, tmp_path):
    jobs = tmp_path / "jobs"
    r = cli([*COMMON, f"run.dir={tmp_path / 'run'}", f"cluster.log_dir={jobs}", "train.global_batch=2",
             "train.micro_batch=1"], env={"VITP_TEST_OOM_AT_STEP": "1"})
    assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-2000:]
    jid = read_index(jobs)[0]["job_id"]
    assert r.stderr.splitlines()[-1] == (
        f"job {jid} FAILED: OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB (test fault) at "
        f"train.micro_batch 1, which cannot be halved (rank 1; logs: vitp logs {jid} --rank 1)")
