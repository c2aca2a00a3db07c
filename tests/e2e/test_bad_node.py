"""A bad node left out, for real on the local cluster's partition `faults` (node1-node3, 2 nodes x 1 task):
the rank on node2 dies with a CUDA error's record (the test fault; a real GPU fault cannot be caused
here), the batch script requeues the job held, sets ExcNodeList=node2 and releases it (SLURM 22.05 refuses
the update for a running job), the second attempt runs on node1 and node3 and the run ends bit-identical
to an undisturbed one; a resubmission of the run dir leaves node2 out again, and nodes left out that
leave the partition too few for the job are refused before anything is queued.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from launch.attempts import read_events
from launch.jobs import outcome, read_index, wait
from tests.e2e.test_cluster_faults import COMMON, STEPS, Reference, jobs_listing, same_run
from tests.e2e.test_submit_slurm import Gate, cli, job_id, poll

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

BAD = "node2"


@pytest.fixture(scope="module")
def reference(slurm_cluster, tmp_path_factory) -> Reference:
    return Reference(tmp_path_factory.mktemp("reference"))


def job_nodes(jid: str) -> tuple[list[str], str]:
    """(the nodes the job's last attempt ran on, its ExcNodeList), from slurmctld (MinJobAge keeps it)."""
    r = subprocess.run(["scontrol", "show", "job", "-o", jid], capture_output=True, text=True, check=True)
    fields = dict(kv.split("=", 1) for kv in r.stdout.split() if "=" in kv)
    hosts = subprocess.run(["scontrol", "show", "hostnames", fields["NodeList"]], capture_output=True, text=True,
                           check=True).stdout.split()
    return hosts, fields.get("ExcNodeList", "")


def test_a_rank_dead_of_a_gpu_fault_leaves_its_node_out_and_the_run_ends_like_an_undisturbed_one(
        reference, slurm_cluster, tmp_path):
    jobs, run = tmp_path / "jobs", tmp_path / "run"
    ref = reference.finished()  # idle nodes: the first attempt takes node1 and node2, SLURM's first fit
    where = [f"run.dir={run}", f"cluster.log_dir={jobs}", f"cluster.partition={slurm_cluster.faults}"]
    r = cli([*COMMON, *where, "--wait"], {"VITP_TEST_CUDA_ERROR_AT_STEP": "6", "VITP_TEST_FAULT_NODE": BAD},
            timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    jid = job_id(r.stdout)
    ev = read_events(jobs / jid)
    assert [(e["event"], e["restart"]) for e in ev] == [("failed", 0), ("completed", 1)], ev
    assert (ev[0]["node"], ev[0]["fault"], ev[0]["excluded"], ev[0]["requeued"]) == (BAD, "CUDA error", [BAD], True)
    assert ev[0]["error"].startswith("RuntimeError: CUDA error: uncorrectable ECC error encountered")
    ran_on, excluded = job_nodes(jid)
    assert sorted(ran_on) == [n for n in slurm_cluster.faults_nodes if n != BAD] and excluded == BAD
    same_run(run, ref)
    listing = jobs_listing(jobs)
    assert listing[2:] == [f"  attempt 0: failed: rank {ev[0]['rank']} on {BAD}: CUDA error; {BAD} excluded; requeued",
                           f"  attempt 1: completed at step {STEPS}"]

    # the run dir's next job leaves node2 out too, unless cluster.exclude_nodes says otherwise
    again = cli([*COMMON, *where, "--dry-run"])
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["slurm_exclude"] == BAD
    assert again.stderr.splitlines() == [f"run.dir {run}: leaving out {BAD} as job {jid} did "
                                         "(cluster.exclude_nodes=[] to use every node)"]
    cleared = cli([*COMMON, *where, "cluster.exclude_nodes=[]", "--dry-run"])
    assert cleared.returncode == 0 and "slurm_exclude" not in json.loads(cleared.stdout), cleared.stderr
    # nodes left out that leave fewer than the job needs: one line, nothing queued (not pending for good)
    few = cli([*COMMON, *where, "cluster.exclude_nodes=[node1,node3]"])
    assert few.returncode == 2 and few.stderr.strip().splitlines() == [
        f"error: cluster.exclude_nodes: without node1, node3 partition {slurm_cluster.faults} keeps 1 of its 3 nodes, "
        "fewer than cluster.nodes=2"]
    assert [e["job_id"] for e in read_index(jobs)] == [jid]


def node_down(node: str) -> None:
    subprocess.run(["scontrol", "update", f"NodeName={node}", "State=DOWN", "Reason=vitp test: node lost"],
                   check=True, capture_output=True, text=True)


def node_back(node: str) -> None:
    """``node`` up again: RESUME while slurmctld still holds it down (its slurmd, alive, may re-register
    it first under ReturnToService=2, and then RESUME is refused as a state change it cannot make)."""
    def up() -> bool:
        state = subprocess.run(["sinfo", "-h", "-N", "-n", node, "-o", "%t"], capture_output=True, text=True,
                               check=True).stdout.split()
        if state and not state[0].startswith(("down", "drain", "fail")):
            return True
        subprocess.run(["scontrol", "update", f"NodeName={node}", "State=RESUME"], capture_output=True)
        return False

    poll(up, 60, f"{node} back up")


def test_a_node_lost_mid_run_is_left_out_of_the_requeued_attempts(reference, slurm_cluster, tmp_path):
    """node2 goes DOWN under a running job (slurmctld's NODE_FAIL: it kills the job, batch script
    included, and requeues it itself, so no teardown runs): the next attempt finds srun's "Node failure
    on node2" line in the log, records the lost attempt, and runs without node2. node2 comes back at
    once (as a rebooted node does), so the requeued job may be given it again: then it requeues itself
    without it before running anything."""
    jobs, run = tmp_path / "jobs", tmp_path / "run"
    ref = reference.finished()
    gate = Gate(tmp_path / "gate", 6)
    where = [f"run.dir={run}", f"cluster.log_dir={jobs}", f"cluster.partition={slurm_cluster.faults}"]
    r = cli([*COMMON, *where], gate.env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    jid = job_id(r.stdout)
    folder = jobs / jid
    gate.held(6, folder)
    try:
        node_down(BAD)
    finally:
        node_back(BAD)
    Path(f"{gate.path}.6").touch()
    entries = read_index(jobs)
    ok, line = outcome(entries[0], wait(entries, timeout_s=600)[jid])
    assert ok, line
    ev = read_events(folder)  # no "cancelled" from the ranks' TERM: SLURM had requeued the job already
    assert [(e["event"], e["restart"]) for e in ev] in ([("failed", 0), ("completed", 1)],
                                                         [("failed", 0), ("moved", 1), ("completed", 2)]), ev
    assert (ev[0]["node"], ev[0]["fault"], ev[0]["excluded"], ev[0]["requeued"]) == (BAD, "node failure", [BAD], True)
    ran_on, excluded = job_nodes(jid)
    assert sorted(ran_on) == [n for n in slurm_cluster.faults_nodes if n != BAD] and excluded == BAD
    same_run(run, ref)
    listing = jobs_listing(jobs)
    assert listing[2] == f"  attempt 0: failed: rank 1 on {BAD}: node failure; {BAD} excluded; requeued"
    assert listing[3:-1] == ([f"  attempt 1: started on {BAD}, which the job leaves out: requeued without it"]
                             if len(ev) == 3 else [])
