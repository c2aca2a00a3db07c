"""A bad node left out, without a cluster: which failures point at a node, the cap, too few nodes left,
the nodes kept across attempts, the carry-over to a resubmission, the `vitp jobs` line, and the scontrol
calls that requeue a job without a node (a recorded fake of scontrol: the only one; the real order is
checked on the local cluster by tests/e2e/test_bad_node.py)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from launch.attempts import (
    ATTEMPT_MARK,
    MOVED_RC,
    NODES_MARK,
    append_event,
    batch_lines,
    describe,
    end_of_attempt,
    read_events,
    start_of_attempt,
)
from launch.jobs import append_index, read_index
from launch.nodes import Fault, carry_over, error_fault, find_fault, leave_out, nodes_left_problem, partition_nodes
from launch.submit import load_submit_config, slurm_parameters
from pipeline import faults, slurm, stops
from pipeline.config import ConfigError
from pipeline.error_record import error_line

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs/pretrain/tiny_cpu.yaml")
RES = str(ROOT / "configs/cluster/local_debug.yaml")  # 2 nodes x 1 task
POOL = ["node1", "node2", "node3"]
ENV = {"SLURM_JOB_ID": "12", "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_PARTITION": "faults"}


def test_which_errors_point_at_the_node():
    assert error_fault("RuntimeError: CUDA error: an illegal memory access was encountered") == "CUDA error"
    assert error_fault("RuntimeError: CUDA error: uncorrectable ECC error encountered") == "CUDA error"
    assert error_fault("DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled cuda error "
                       "(run with NCCL_DEBUG=INFO for details)") == "NCCL error"
    # the run's own doing: CUDA's out-of-memory, a SIGKILL (the OOM killer), a config error, a non-finite loss
    assert error_fault("OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB") is None
    assert error_fault("killed by SIGKILL") is None
    assert error_fault("ConfigError: optim.lr: must be > 0") is None
    assert error_fault("NonFiniteLossError: loss is nan at step 7") is None
    assert error_fault(None) is None


def test_find_fault_names_the_node_of_the_dead_rank_or_the_lost_node():
    srun = "srun: error: node1: task 0: Killed\nsrun: error: node2: tasks 1-3: Exited with exit code 1\n"
    why = {"rank": 2, "error": "RuntimeError: CUDA error: unspecified launch failure", "retry": True}
    assert find_fault(srun, why) == Fault("node2", "CUDA error")  # rank 2 is in node2's tasks 1-3
    killed = {"rank": 1, "error": "killed by SIGKILL", "retry": True}
    assert find_fault(srun, killed) is None  # the OOM killer's SIGKILL blames no node
    xid = "NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, GPU has fallen off the bus.\n"
    assert find_fault(srun, killed, rank_log=xid) == Fault("node2", "Xid 79")
    app_xid = "NVRM: Xid (PCI:0000:3b:00): 13, Graphics Exception: ESR 0x404490=0x80000001\n"
    assert find_fault(srun, killed, rank_log=app_xid) is None  # Xid 13: the application's, not the GPU's
    assert find_fault(srun + xid, killed) is None  # the batch log's lines say no node
    lost = "srun: error: Node failure on node3\nsrun: error: node1: task 0: Exited with exit code 3\n"
    assert find_fault(lost, {"rank": 0, "error": "exit code 3", "retry": True}) == Fault("node3", "node failure")
    hung = {"rank": 1, "error": "hung: no progress for 600s, stuck in NCCL error (x.py:1)", "retry": True}
    assert find_fault(srun, hung) is None  # a stuck rank is pipeline/hang.py's


def test_the_fault_seam_raises_a_cuda_error_on_the_chosen_node_on_the_first_attempt(monkeypatch):
    monkeypatch.setenv(faults.CUDA_ERROR_AT_STEP, "3")
    monkeypatch.setenv(faults.FAULT_NODE, "node2")
    monkeypatch.setenv("SLURMD_NODENAME", "node1")
    faults.hit("step", 3)  # another node: nothing
    monkeypatch.setenv("SLURMD_NODENAME", "node2")
    faults.hit("step", 2)  # another step: nothing
    with pytest.raises(RuntimeError) as e:
        faults.hit("step", 3)
    assert error_fault(error_line(e.value)) == "CUDA error"  # the record launch/job_body.py writes of it
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    faults.hit("step", 3)  # the requeued attempt runs through


def test_leave_out_the_cap_and_too_few_nodes():
    assert leave_out("node2", [], 2, 2, POOL, "faults") == (["node2"], None, None)
    assert leave_out("node3", ["node1", "node2"], 2, 1, POOL, "faults") == (
        [], "cluster.max_excluded_nodes=2 reached", None)
    assert leave_out("node3", ["node2"], 2, 1, None, None) == (["node3"], None, None)  # sinfo could not say
    add, kept, fails = leave_out("node3", ["node2"], 2, 2, POOL, "faults")
    assert (add, kept) == ([], None)
    assert fails == ("cluster.exclude_nodes: without node3 partition faults keeps 1 of its 3 nodes (node1), "
                     "fewer than the job's 2")


def _attempt(tmp_path: Path, restart: int, node: str, error: str | None, rank: int = 1) -> dict:
    folder = tmp_path / "12"
    folder.mkdir(exist_ok=True)
    with open(folder / "12_0_log.err", "a") as f:
        f.write(ATTEMPT_MARK.format(restart=restart, job=12) + "\n"
                f"srun: error: {node}: task {rank}: {'Exited with exit code 1' if error else 'Killed'}\n")
    if error:
        (folder / f"error.{rank}.json").write_text(json.dumps({"rank": rank, "restart": restart, "error": error,
                                                               "retry": True}))
    return {**ENV, "SLURM_RESTART_COUNT": str(restart)}


def test_failures_on_bad_nodes_requeue_without_them_up_to_the_cap(tmp_path):
    calls = []
    cuda = "RuntimeError: CUDA error: an illegal memory access was encountered"
    nccl = "DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled system error"
    # submitted without node4: the cap (3) counts it, so the third node to blame is over it
    job = {"requeue": lambda *a: calls.append(a), "pool": [*POOL, "node4", "node5"], "exclude": ["node4"],
           "max_excluded": 3}
    assert end_of_attempt(tmp_path, 1, 5, environ=_attempt(tmp_path, 0, "node2", nccl), **job) == 0
    assert end_of_attempt(tmp_path, 1, 5, environ=_attempt(tmp_path, 1, "node3", cuda), **job) == 0
    assert end_of_attempt(tmp_path, 1, 5, environ=_attempt(tmp_path, 2, "node1", cuda), **job) == 0
    # the OOM killer: no node blamed
    assert end_of_attempt(tmp_path, 137, 5, environ=_attempt(tmp_path, 3, "node1", None, rank=0), **job) == 0
    # each exclusion sets every node left out so far; past the cap, and after a SIGKILL, a plain requeue
    assert calls == [("12", ["node4", "node2"]), ("12", ["node4", "node2", "node3"]), ("12",), ("12",)]
    ev = read_events(tmp_path / "12")
    assert [(e["node"], e["fault"], e.get("excluded")) for e in ev[:3]] == [
        ("node2", "NCCL error", ["node2"]), ("node3", "CUDA error", ["node3"]), ("node1", "CUDA error", None)]
    assert ev[1]["error"] == cuda and "node" not in ev[3]
    assert [describe(e) for e in ev] == [
        "attempt 0: failed: rank 1 on node2: NCCL error; node2 excluded; requeued",
        "attempt 1: failed: rank 1 on node3: CUDA error; node3 excluded; requeued",
        "attempt 2: failed: rank 1 on node1: CUDA error; node1 not excluded (cluster.max_excluded_nodes=3 "
        "reached); requeued",
        "attempt 3: failed: rank 0: killed by SIGKILL; requeued"]


def test_too_few_nodes_left_fails_the_job_with_one_line(tmp_path, capsys):
    calls = []
    env = _attempt(tmp_path, 1, "node3", "RuntimeError: CUDA error: misaligned address")
    append_event(tmp_path / "12", {"event": "failed", "restart": 0, "rank": 1, "node": "node2",
                                   "fault": "CUDA error", "excluded": ["node2"], "requeued": True})
    assert end_of_attempt(tmp_path, 1, 5, environ=env, requeue=lambda *a: calls.append(a),
                          pool=lambda partition: POOL if partition == "faults" else []) == 1
    assert calls == []
    last = read_events(tmp_path / "12")[-1]
    assert (last["requeued"], "excluded" in last) == (False, False)
    line = ("attempt 1: failed: rank 1 on node3: CUDA error; not requeued (cluster.exclude_nodes: without node3 "
            "partition faults keeps 1 of its 3 nodes (node1), fewer than the job's 2)")
    assert describe(last) == line
    assert capsys.readouterr().err.splitlines() == [f"vitp: {line}"]


def test_requeue_excluding_holds_updates_and_releases():
    calls = []

    def scontrol(answers):
        def run(argv, check=False, **kw):
            calls.append(argv[1:])
            rc, err = answers.get(argv[1], (0, ""))
            if check and rc:
                raise subprocess.CalledProcessError(rc, argv)
            return subprocess.CompletedProcess(argv, rc, "", err)
        return run

    assert slurm.requeue_excluding("12", ["node2", "node3"], run=scontrol({})) is True
    assert calls == [["requeuehold", "12"], ["update", "JobId=12", "ExcNodeList=node2,node3"], ["release", "12"]]
    calls.clear()  # SLURM requeued it itself (its node failed): pending already, so held instead
    pending = {"requeuehold": (1, "Job is pending execution for job 12\n"),  # scontrol 22.05's words
               "update": (1, "Job is no longer pending execution for JobId=12\n")}
    assert slurm.requeue_excluding("12", ["node2"], run=scontrol(pending)) is False  # refused: released anyway
    assert calls == [["requeuehold", "12"], ["hold", "12"], ["update", "JobId=12", "ExcNodeList=node2"],
                     ["release", "12"]]
    with pytest.raises(subprocess.CalledProcessError):  # not requeueable: nothing else is tried
        slurm.requeue_excluding("12", ["node2"], run=scontrol({"requeuehold": (1, "Access/permission denied")}))


def test_a_resubmission_carries_the_nodes_left_out_unless_the_config_says(tmp_path):
    jobs, run = tmp_path / "jobs", tmp_path / "run"
    folder = jobs / "12"
    folder.mkdir(parents=True)
    append_index(jobs, {"job_id": "12", "stage": "pretrain", "folder": str(folder), "run_dir": str(run),
                        "exclude_nodes": ["node4"]})
    append_event(folder, {"event": "failed", "restart": 0, "node": "node2", "excluded": ["node2"]})
    append_index(jobs, {"job_id": "13", "stage": "eval", "folder": str(jobs / "13"), "run_dir": str(run)})
    common = [f"run.dir={run}", f"cluster.log_dir={jobs}", "cluster.partition=faults"]

    def carry(cfg):
        return carry_over(cfg, "pretrain", read_index(jobs), read_events)

    cfg = load_submit_config(TINY, common, RES)
    assert carry(cfg) == f"run.dir {run}: leaving out node4, node2 as job 12 did (cluster.exclude_nodes=[] to use " \
                         "every node)"
    assert cfg.cluster.exclude_nodes == ["node4", "node2"]
    assert slurm_parameters(cfg)["slurm_exclude"] == "node4,node2"
    assert slurm_parameters(cfg)["slurm_teardown"][1].endswith(" --exclude node4 --exclude node2 --rc $vitp_rc")
    assert nodes_left_problem(cfg, POOL) is None  # node1 and node3 are left
    assert nodes_left_problem(cfg, ["node1", "node2", "node4"]) == (
        "cluster.exclude_nodes: without node4, node2 partition faults keeps 1 of its 3 nodes, fewer than "
        "cluster.nodes=2")
    cleared = load_submit_config(TINY, [*common, "cluster.exclude_nodes=[]"], RES)
    assert carry(cleared) is None and cleared.cluster.exclude_nodes == []
    assert "slurm_exclude" not in slurm_parameters(cleared)
    own = load_submit_config(TINY, [*common, "cluster.exclude_nodes=[node3]"], RES)
    assert carry(own) is None and slurm_parameters(own)["slurm_exclude"] == "node3"
    other = load_submit_config(TINY, [f"run.dir={tmp_path / 'other'}", f"cluster.log_dir={jobs}"])
    assert carry(other) is None and other.cluster.exclude_nodes == []


def test_config_and_teardown_lines():
    with pytest.raises(ConfigError, match=r"cluster.exclude_nodes: 'node\[1-2\]': one node name per entry"):
        load_submit_config(TINY, ["cluster.exclude_nodes=['node[1-2]']"])
    assert load_submit_config(TINY, []).cluster.max_excluded_nodes == 2
    _, teardown = batch_lines("jobs", 2, python="py", exclude=["node2"], max_excluded=1)
    assert teardown[1].endswith(" --max-failures 2 --max-excluded 1 --exclude node2 --rc $vitp_rc")


def test_partition_nodes_from_sinfo():
    out = "node1 debug*\nnode2 debug*\nnode1 faults\nnode2 faults\nnode3 faults\nnode1 urgent\n"

    def sinfo(argv, **kw):
        return subprocess.CompletedProcess(argv, 0, out, "")

    assert partition_nodes("faults", run=sinfo) == POOL
    assert partition_nodes(None, run=sinfo) == ["node1", "node2"]  # the default partition
    assert partition_nodes("gpu", run=sinfo) is None
    assert partition_nodes("faults", run=lambda argv, **kw: subprocess.CompletedProcess(argv, 1, "", "down")) is None


def test_vitp_submit_adds_the_carried_nodes_and_refuses_too_few_left(tmp_path, capsys, monkeypatch):
    from launch import nodes
    from launch.submit import SubmitError, check_nodes, submit_main

    jobs, run = tmp_path / "jobs", tmp_path / "run"
    (jobs / "12").mkdir(parents=True)
    append_index(jobs, {"job_id": "12", "stage": "pretrain", "folder": str(jobs / "12"), "run_dir": str(run)})
    append_event(jobs / "12", {"event": "failed", "restart": 0, "node": "node2", "excluded": ["node2"]})
    where = ["pretrain", "--config", TINY, "--resources", RES, "--cluster", "local", "data.path=synthetic",
             f"cluster.log_dir={jobs}", f"run.dir={run}"]
    assert submit_main([*where, "--dry-run"]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["slurm_exclude"] == "node2"
    assert out.err.splitlines() == [f"run.dir {run}: leaving out node2 as job 12 did (cluster.exclude_nodes=[] to "
                                    "use every node)"]
    monkeypatch.setattr(nodes, "partition_nodes", lambda part: ["node1", "node2"] if part == "debug" else None)
    cfg = load_submit_config(TINY, [f"cluster.log_dir={jobs}", f"run.dir={run}"], RES)
    with pytest.raises(SubmitError) as e:
        check_nodes(cfg, "pretrain", "slurm")
    assert str(e.value) == ("cluster.exclude_nodes: without node2 partition debug keeps 1 of its 2 nodes, fewer "
                            "than cluster.nodes=2")


def test_a_job_out_of_failures_still_records_the_node_for_its_resubmission(tmp_path):
    calls = []
    env = _attempt(tmp_path, 0, "node2", "RuntimeError: CUDA error: an illegal memory access was encountered")
    assert end_of_attempt(tmp_path, 1, 0, environ=env, requeue=lambda *a: calls.append(a), pool=POOL) == 1
    assert calls == []
    last = read_events(tmp_path / "12")[-1]
    assert (last["excluded"], last["requeued"]) == (["node2"], False)
    assert describe(last) == ("attempt 0: failed: rank 1 on node2: CUDA error; node2 excluded; not requeued "
                              "(cluster.max_failures=0 used up)")
    # the same with too few nodes left: the job's own reason stays
    env = _attempt(tmp_path, 1, "node3", "RuntimeError: CUDA error: an illegal memory access was encountered")
    assert end_of_attempt(tmp_path, 1, 0, environ=env, requeue=lambda *a: calls.append(a), pool=POOL) == 1
    assert describe(read_events(tmp_path / "12")[-1]) == ("attempt 1: failed: rank 1 on node3: CUDA error; not "
                                                          "requeued (cluster.max_failures=0 used up)")


def test_an_xid_in_the_dead_ranks_log_of_this_attempt_blames_its_node(tmp_path):
    calls = []
    start = "vitp: pretrain rank 1/2 local 0/1 master node1:29500 restart {}\n"
    xid = "NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, GPU has fallen off the bus.\n"
    env = _attempt(tmp_path, 1, "node2", None)  # srun: node2: task 1: Killed, no error record
    (tmp_path / "12" / "12_1_log.err").write_text(start.format(0) + xid + start.format(1) + "step 5\n")
    assert end_of_attempt(tmp_path, 137, 5, environ=env, requeue=lambda *a: calls.append(a), pool=POOL) == 0
    assert calls == [("12",)]  # attempt 0's Xid is not this attempt's
    env = _attempt(tmp_path, 2, "node2", None)
    with open(tmp_path / "12" / "12_1_log.err", "a") as f:
        f.write(start.format(2) + xid)
    assert end_of_attempt(tmp_path, 137, 5, environ=env, requeue=lambda *a: calls.append(a), pool=POOL) == 0
    assert calls[-1] == ("12", ["node2"])
    assert describe(read_events(tmp_path / "12")[-1]) == ("attempt 2: failed: rank 1 on node2: Xid 79; node2 "
                                                          "excluded; requeued")


HOSTS = {"node[1-2]": ["node1", "node2"], "node[1,3]": ["node1", "node3"], "node[2-3]": ["node2", "node3"]}


def _lost_attempt(tmp_path: Path, restart: int, nodes: str, *lines: str) -> dict:
    """An attempt NODE_FAIL ended (no teardown ran), then the next attempt's start on ``NODELIST``."""
    folder = tmp_path / "12"
    folder.mkdir(exist_ok=True)
    with open(folder / "12_0_log.err", "a") as f:
        f.write("".join(f"{x}\n" for x in (ATTEMPT_MARK.format(restart=restart, job=12),
                                           NODES_MARK.format(nodes=nodes), *lines)))
    return {**ENV, "SLURM_RESTART_COUNT": str(restart + 1), "SLURM_NTASKS_PER_NODE": "1"}


def test_the_next_attempt_records_a_node_slurm_lost_and_moves_off_it(tmp_path, capsys):
    calls = []
    job = {"requeue": lambda *a: calls.append(a), "pool": POOL, "hostnames": HOSTS.get, "down": lambda names: []}
    assert start_of_attempt(tmp_path, 5, environ={**ENV, "SLURM_JOB_NODELIST": "node[1-2]"}, **job) == 0  # restart 0
    env = _lost_attempt(tmp_path, 0, "node[1-2]", "srun: error: Node failure on node2", "srun: forcing job termination")
    # SLURM requeued the job and gave it node2 again (a node that rebooted comes back): it moves off it, once
    assert start_of_attempt(tmp_path, 5, environ={**env, "SLURM_JOB_NODELIST": "node[1-2]"}, **job) == MOVED_RC
    assert calls == [("12", ["node2"])]
    ev = read_events(tmp_path / "12")
    assert [describe(e) for e in ev] == [
        "attempt 0: failed: rank 1 on node2: node failure; node2 excluded; requeued",  # srun said no task: node 2 of 2
        "attempt 1: started on node2, which the job leaves out: requeued without it"]
    assert ev[0]["error"] == "node failure: node2 (NODE_FAIL)"
    assert capsys.readouterr().err.splitlines() == [f"vitp: {describe(e)}" for e in ev]
    again = {**env, "SLURM_RESTART_COUNT": "2"}  # the update did not take: run where SLURM put it
    assert start_of_attempt(tmp_path, 5, environ={**again, "SLURM_JOB_NODELIST": "node[1-2]"}, **job) == 0
    assert start_of_attempt(tmp_path, 5, environ={**again, "SLURM_JOB_NODELIST": "node[1,3]"}, **job) == 0
    assert len(read_events(tmp_path / "12")) == 2 and len(calls) == 1
    # the end of a later attempt that fails on another node leaves out both
    end = _attempt(tmp_path, 2, "node3", "RuntimeError: CUDA error: an illegal memory access was encountered")
    assert end_of_attempt(tmp_path, 1, 5, environ=end, requeue=lambda *a: calls.append(a), pool=[*POOL, "node4"]) == 0
    assert calls[-1] == ("12", ["node2", "node3"])


def test_a_lost_batch_host_an_unexplained_requeue_and_failures_used_up(tmp_path):
    calls = []
    job = {"requeue": lambda *a: calls.append(a), "pool": POOL, "hostnames": HOSTS.get}
    # the batch host's log ends without srun's word: the node of that attempt slurmctld holds down now
    env = _lost_attempt(tmp_path, 0, "node[2-3]", "step 5")
    assert start_of_attempt(tmp_path, 5, environ={**env, "SLURM_JOB_NODELIST": "node[1,3]"},
                            down=lambda names: ["node2"] if names == ["node2", "node3"] else [], **job) == 0
    assert describe(read_events(tmp_path / "12")[-1]) == (
        "attempt 0: failed: rank 0 on node2: node failure; node2 excluded; requeued")
    # no node lost (an admin's scontrol requeue): recorded as such, nothing left out
    env = _lost_attempt(tmp_path, 1, "node[1,3]", "step 7")
    assert start_of_attempt(tmp_path, 5, environ={**env, "SLURM_JOB_NODELIST": "node[1,3]"},
                            down=lambda names: [], **job) == 0
    assert describe(read_events(tmp_path / "12")[-1]) == ("attempt 1: ended and requeued by SLURM itself (no node "
                                                          "failure seen)")
    # an attempt the ranks recorded themselves (a preemption) adds nothing
    _lost_attempt(tmp_path, 2, "node[1,3]")
    append_event(tmp_path / "12", {"event": "preempted", "restart": 2, "step": 8})
    assert start_of_attempt(tmp_path, 5, environ={**env, "SLURM_RESTART_COUNT": "3", "SLURM_JOB_NODELIST": "node[1,3]"},
                            down=lambda names: [], **job) == 0
    assert len(read_events(tmp_path / "12")) == 3 and calls == []
    # cluster.max_failures used up: the requeued attempt ends at once, the job fails (node3 is not left out:
    # with node2 out too, partition faults would keep one node for a job of two)
    env = _lost_attempt(tmp_path, 3, "node[1,3]", "srun: error: Node failure on node3")
    assert start_of_attempt(tmp_path, 1, environ={**env, "SLURM_JOB_NODELIST": "node[1-2]"},
                            down=lambda names: [], **job) == 1
    assert describe(read_events(tmp_path / "12")[-1]) == (
        "attempt 3: failed: rank 1 on node3: node failure; not requeued (cluster.max_failures=1 used up)")
    assert calls == []


def test_a_term_after_slurm_requeued_the_job_is_no_cancel():
    """Measured on the local cluster: a job whose node went DOWN is COMPLETING with Restarts=1 when
    attempt 0's ranks get TERM; a scancel'd one keeps Restarts=0."""
    lost = "JobId=415 JobState=COMPLETING Reason=None Restarts=1 PreemptTime=None NodeList=node1"
    assert slurm.parse_term_cause(lost, restart=0) == stops.Stop.LOST
    assert slurm.parse_term_cause(lost, restart=1) == stops.Stop.CANCEL
    assert stops.after_stop(stops.Stop.CANCEL, stops.Stop.LOST, 0, 3) == (None, stops.Next.REQUEUE)


@pytest.mark.parametrize("rc", [0, MOVED_RC, 1])
def test_the_setup_lines_run_the_start_check_on_a_requeued_attempt(tmp_path, rc):
    fake = tmp_path / "py"
    fake.write_text(f"#!/bin/sh\necho \"$@\" > {tmp_path}/args\nexit {rc}\n")
    fake.chmod(0o755)
    setup, _ = batch_lines("jobs", 2, python=str(fake), exclude=["node2"])
    script = "\n".join(["f() {", *setup, "echo srun ran", "}", "f; echo \"exit $?\""])
    script = script.replace("|| exit ", "|| return ")  # a function stands for the batch script
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True,
                         env={"SLURM_RESTART_COUNT": "1", "SLURM_JOB_ID": "12", "SLURM_JOB_NODELIST": "node[1-2]"})
    assert out.stderr.splitlines() == ["vitp: attempt 1 of job 12 starts", "vitp: attempt nodes node[1-2]"]
    lines = out.stdout.splitlines()
    assert ("srun ran" in lines, lines[-1]) == (rc == 0, f"exit {0 if rc == MOVED_RC else rc}")
    assert (tmp_path / "args").read_text().split()[-3:] == ["--exclude", "node2", "--start"]
