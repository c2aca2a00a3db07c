"""How a SLURM attempt ended, without a cluster: srun's report of a dead task, the batch script's
decision to requeue (bounded by cluster.max_failures, not for errors a retry repeats), SIGTERM's cause
from scontrol's real output, NCCL's flight-recorder environment and the sbatch script submitit renders."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from launch.attempts import (
    ATTEMPT_MARK,
    append_event,
    describe,
    end_of_attempt,
    first_dead_task,
    read_events,
)
from launch.job_body import nccl_debug_env, term_cause
from launch.submit import load_submit_config, slurm_parameters
from pipeline.errors import retried
from pipeline.slurm import parse_term_cause

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs/pretrain/tiny_cpu.yaml")

# srun's stderr on SLURM 22.05 after `kill -9` of task 1 with --kill-on-bad-exit=1 (recorded)
SRUN_KILLED = """vitp: attempt 0 of job 12 starts
srun: error: node2: task 1: Killed
srun: launch/slurm: _step_signal: Terminating StepId=12.0
slurmstepd-node1: error: *** STEP 12.0 ON node1 CANCELLED AT 2026-11-24T19:25:02 ***
srun: error: node1: task 0: Killed
"""
# `scontrol show job -o` seen by a task at SIGTERM time (recorded, trimmed to the fields that matter)
PREEMPTED = ("JobId=5 JobName=batch.sh UserId=root(0) JobState=RUNNING Reason=None Requeue=1 Restarts=0 "
             "PreemptEligibleTime=2026-11-24T19:22:57 PreemptTime=2026-11-24T19:23:01 Partition=debug")
SCANCELLED = ("JobId=7 JobName=batch.sh UserId=root(0) JobState=COMPLETING Reason=None Requeue=1 Restarts=0 "
              "PreemptEligibleTime=2026-11-24T19:23:39 PreemptTime=None Partition=debug")


def test_first_dead_task_from_srun_lines():
    assert first_dead_task(SRUN_KILLED) == (1, "killed by SIGKILL")
    assert first_dead_task("srun: error: node1: task 0: Exited with exit code 1\n") == (0, "exit code 1")
    segv = "srun: error: node3: tasks 4-7: Segmentation fault (core dumped)\n"
    assert first_dead_task(segv) == (4, "killed by SIGSEGV")
    assert first_dead_task("srun: error: node1: task 2: Bus error\n") == (2, "killed by SIGBUS")
    assert first_dead_task("step 3 loss 1.0\n") is None


def test_term_cause_from_scontrol():
    assert parse_term_cause(PREEMPTED) == "preempt"
    assert parse_term_cause(SCANCELLED) == "cancel"
    assert parse_term_cause(SCANCELLED.replace("COMPLETING", "TIMEOUT")) == "time_limit"
    assert parse_term_cause("") == "cancel"  # SLURM cannot be asked: never requeue against a user's scancel


def test_vitp_cancel_mark_wins_over_scontrol(tmp_path):
    (tmp_path / "cancel-requested").write_text("1\n")
    assert term_cause("999999", tmp_path) == "cancel"


def test_nccl_flight_recorder_env(tmp_path):
    env = nccl_debug_env(tmp_path, environ={})
    prefix = str(tmp_path.resolve() / "nccl_trace_rank_")
    assert env == {"TORCH_NCCL_TRACE_BUFFER_SIZE": "2000", "TORCH_FR_BUFFER_SIZE": "2000",
                   "TORCH_NCCL_DUMP_ON_TIMEOUT": "1", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": prefix,
                   "TORCH_FR_DUMP_TEMP_FILE": prefix}
    mine = nccl_debug_env(tmp_path, environ={"TORCH_NCCL_TRACE_BUFFER_SIZE": "20000"})
    assert "TORCH_NCCL_TRACE_BUFFER_SIZE" not in mine and mine["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"


def _job(tmp_path: Path, log: str, restart: int = 0) -> tuple[Path, dict]:
    folder = tmp_path / "12"
    folder.mkdir(exist_ok=True)
    with open(folder / "12_0_log.err", "a") as f:
        f.write(log)
    return folder, {"SLURM_JOB_ID": "12", "SLURM_RESTART_COUNT": str(restart)}


def test_end_of_attempt_requeues_until_max_failures(tmp_path):
    requeued = []
    folder, env = _job(tmp_path, SRUN_KILLED)
    assert end_of_attempt(tmp_path, 137, max_failures=1, environ=env, requeue=requeued.append) == 0
    assert requeued == ["12"]
    ev = read_events(folder)
    assert [(e["event"], e["rank"], e["error"], e["requeued"]) for e in ev] == [
        ("failed", 1, "killed by SIGKILL", True)]
    # the next attempt: rank 0 raised an error a retry could get past; its record names the cause
    folder, env = _job(tmp_path, ATTEMPT_MARK.format(restart=1, job=12) + "\n"
                       "srun: error: node1: task 0: Exited with exit code 1\n", restart=1)
    (folder / "error.0.json").write_text(json.dumps({"rank": 0, "restart": 1, "error": "DistBackendError: reset",
                                                     "retry": True}))
    assert end_of_attempt(tmp_path, 1, max_failures=1, environ=env, requeue=requeued.append) == 1
    assert requeued == ["12"]  # max_failures=1 used up
    last = read_events(folder)[-1]
    assert (last["rank"], last["error"], last["requeued"], last["why"]) == (
        0, "DistBackendError: reset", False, "cluster.max_failures=1 used up")
    assert describe(last) == ("attempt 1: failed: rank 0: DistBackendError: reset; not requeued "
                              "(cluster.max_failures=1 used up)")


def test_end_of_attempt_leaves_what_the_ranks_recorded_and_skips_hopeless_retries(tmp_path):
    requeued = []
    folder, env = _job(tmp_path, "srun: error: node1: task 0: Exited with exit code 1\n")
    append_event(folder, {"event": "preempted", "restart": 0, "step": 6})
    assert end_of_attempt(tmp_path, 0, max_failures=3, environ=env, requeue=requeued.append) == 0
    assert len(read_events(folder)) == 1 and requeued == []
    folder, env = _job(tmp_path, "srun: error: node1: task 0: Exited with exit code 1\n", restart=1)
    (folder / "error.0.json").write_text(json.dumps({"rank": 0, "restart": 1, "error": "DataError: gone",
                                                     "retry": False}))
    assert end_of_attempt(tmp_path, 1, max_failures=3, environ=env, requeue=requeued.append) == 1
    assert requeued == [] and read_events(folder)[-1]["why"] == "a retry would fail the same way"


def test_an_out_of_memory_rank_is_requeued_with_half_the_micro_batch_until_it_cannot_be_halved(tmp_path, monkeypatch):
    """The OOM rank's record carries the micro batch it ran at: the teardown requeues with half of it (not
    spending cluster.max_failures=0), the next attempt's job body reads it back; at 1 the job fails."""
    import torch

    from pipeline.error_record import write_error
    from pipeline.stops import after_oom, micro_batch_now, out_of_memory

    assert out_of_memory(torch.OutOfMemoryError("x")) and out_of_memory(torch.cuda.OutOfMemoryError("x"))
    assert not out_of_memory(RuntimeError("CUDA error: out of memory in a message only"))
    assert after_oom(16) == ("requeue", 8, None)
    assert after_oom(1) == ("fail", None, "train.micro_batch 1 cannot be halved")
    assert after_oom(3)[0] == "fail"
    requeued, lines = [], []
    for restart, micro in ((0, 16), (1, 8)):
        folder, env = _job(tmp_path, ATTEMPT_MARK.format(restart=restart, job=12) + "\n"
                           "srun: error: node2: task 1: Exited with exit code 1\n", restart=restart)
        monkeypatch.setenv("SLURM_RESTART_COUNT", str(restart))  # write_error stamps the attempt it ran in
        write_error(folder, 1, torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), micro)
        assert end_of_attempt(tmp_path, 1, max_failures=0, environ=env, requeue=requeued.append) == 0
        lines.append(describe(read_events(folder)[-1]))
    assert requeued == ["12", "12"] and micro_batch_now(read_events(folder), 16) == 4
    assert lines == ["attempt 0: out of memory on rank 1 at train.micro_batch 16; requeued with train.micro_batch 8 "
                     "(train.global_batch kept)",
                     "attempt 1: out of memory on rank 1 at train.micro_batch 8; requeued with train.micro_batch 4 "
                     "(train.global_batch kept)"]
    (tmp_path / "one").mkdir()
    folder, env = _job(tmp_path / "one", "srun: error: node2: task 1: Exited with exit code 1\n")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")
    write_error(folder, 1, torch.OutOfMemoryError("CUDA out of memory."), 1)
    assert end_of_attempt(tmp_path / "one", 1, max_failures=3, environ=env, requeue=requeued.append) == 1
    last = read_events(folder)[-1]
    assert (last["requeued"], last["micro_batch"], last["error"]) == (
        False, [1, None], "OutOfMemoryError: CUDA out of memory. at train.micro_batch 1, which cannot be halved")
    assert describe(last) == ("attempt 0: out of memory on rank 1 at train.micro_batch 1; not requeued "
                              "(train.micro_batch 1 cannot be halved)")


def test_retried_errors():
    from pipeline.config import ConfigError
    from pipeline.rundir import RunDirBusy

    assert not retried(ConfigError("x")) and not retried(RunDirBusy("x")) and not retried(FileNotFoundError("x"))
    assert retried(RuntimeError("Connection reset by peer")) and retried(OSError("stale file handle"))


def test_sbatch_script_kills_the_step_on_a_bad_exit_and_ends_with_the_supervisor(tmp_path):
    if shutil.which("srun") is None:
        pytest.skip("submitit's SLURM executor needs srun on PATH")
    from launch.submit import make_executor

    cfg = load_submit_config(TINY, ["cluster.nodes=2", "cluster.tasks_per_node=1", f"cluster.log_dir={tmp_path}",
                                    "cluster.max_failures=3", "cluster.cpus_per_task=2"])
    assert slurm_parameters(cfg)["slurm_srun_args"] == ["--kill-on-bad-exit=1"]
    lines = make_executor(cfg, "slurm")._executor._make_submission_file_text("python -m x", "u").splitlines()
    srun = next(i for i, line in enumerate(lines) if line.startswith("srun "))
    assert "--kill-on-bad-exit=1" in lines[srun] and lines[srun].endswith("python -m x")
    after = [line for line in lines[srun + 1:] if line.strip() and not line.startswith("#")]
    assert after[0] == "vitp_rc=$?"  # srun's status, before any other command runs
    assert after[1].endswith(f"-m launch.attempts --log-dir {tmp_path.resolve()} --max-failures 3 --rc $vitp_rc")
    assert after[2] == "exit $?"
    before = lines[:srun]
    assert 'echo "vitp: attempt ${SLURM_RESTART_COUNT:-0} of job $SLURM_JOB_ID starts" >&2' in before
    assert "export SRUN_CPUS_PER_TASK=2" in before


def test_vitp_cancel_marks_the_job_before_scancel(tmp_path, monkeypatch, capsys):
    from launch.jobs import append_index, cancel_main

    bin_dir, folder = tmp_path / "bin", tmp_path / "jobs" / "77"
    bin_dir.mkdir()
    folder.mkdir(parents=True)
    seen = tmp_path / "seen"
    (bin_dir / "scancel").write_text(f"#!/bin/sh\nls {folder} > {seen}\n")  # what the job sees at TERM time
    (bin_dir / "scancel").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    append_index(tmp_path / "jobs", {"job_id": "77", "folder": str(folder), "executor": "slurm"})
    assert cancel_main(["77", "--log-dir", str(tmp_path / "jobs")]) == 0
    assert seen.read_text().split() == ["cancel-requested"] and capsys.readouterr().out == "cancelled 77\n"
    assert term_cause("77", folder) == "cancel"
