"""cluster.min_nodes without a cluster: the config's checks, which nodes sinfo counts up, how many nodes
the next attempt asks for, the scontrol update that asks for them (a recorded fake of scontrol, as in
test_nodes.py), the batch script's task count from the nodes it got, and the attempt's record and
`vitp jobs` line. The real thing, on the local cluster: tests/e2e/test_fewer_nodes_slurm.py."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from launch.attempts import ATTEMPT_MARK, Elastic, batch_lines, describe, end_of_attempt, read_events
from launch.nodes import nodes_up
from launch.submit import load_submit_config
from pipeline import slurm
from pipeline.config import ConfigError

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs/pretrain/tiny_cpu.yaml")  # global batch 32, micro batch 16
ONE = "cluster.tasks_per_node=1"
SINFO = ("node1 idle faults\nnode2 mix faults\nnode3 drain faults\nnode4 down* faults\nnode5 idle* faults\n"
         "node6 alloc faults\nnode1 idle debug*\nnode2 mix debug*\n")


def _sinfo(argv, **kw):
    return subprocess.CompletedProcess(argv, 0, SINFO, "")


def test_config_min_nodes_checks():
    c = load_submit_config(TINY, [ONE, "cluster.nodes=2"]).cluster
    assert (c.min_nodes, c.fewest_nodes, Elastic.of(c)) == (None, 2, None)  # a fixed node count by default
    c = load_submit_config(TINY, [ONE, "cluster.nodes=2", "cluster.min_nodes=1"]).cluster
    assert Elastic.of(c) == Elastic(1, 2, 1) == Elastic.parse("1:2:1") and str(Elastic.of(c)) == "1:2:1"
    with pytest.raises(ConfigError, match="cluster.min_nodes: 3 is more than cluster.nodes 2"):
        load_submit_config(TINY, [ONE, "cluster.nodes=2", "cluster.min_nodes=3"])
    # every count in the range must split the global batch: 32 over 3 ranks does not
    with pytest.raises(ConfigError, match=r"cluster.min_nodes: 1 lets an attempt run on 3 nodes \(3 ranks\), "
                                          "where train.global_batch: 32 is not divisible by world size 3"):
        load_submit_config(TINY, [ONE, "cluster.nodes=4", "cluster.min_nodes=1", "train.micro_batch=8"])


def test_nodes_up_counts_busy_nodes_not_drained_down_or_unresponsive_ones():
    assert nodes_up("faults", run=_sinfo) == ["node1", "node2", "node6"]
    assert nodes_up(None, run=_sinfo) == ["node1", "node2"]  # the default partition
    assert nodes_up("faults", run=lambda argv, **kw: subprocess.CompletedProcess(argv, 1, "", "down")) is None


def test_the_next_attempt_asks_for_what_is_up_within_the_range():
    e = Elastic(2, 4, 8)
    up = lambda part: {"faults": ["node1", "node2", "node6"], "none": []}.get(part)  # noqa: E731
    assert e.size([], "faults", up=up) == 3
    assert e.size(["node6"], "faults", up=up) == 2  # the nodes the job leaves out are not counted
    assert e.size(["node1", "node6"], "faults", up=up) == 2  # never below min_nodes: it waits for them
    assert e.size([], "none", up=up) == 2
    assert e.size([], "gpu", up=up) == 4  # sinfo could not say: all of them
    assert Elastic(1, 2).size([], "faults", up=up) == 2  # never above nodes

    calls = []

    def run(argv, check=False, **kw):
        calls.append(argv[1:])
        return subprocess.CompletedProcess(argv, 0, "", "")

    assert slurm.requeue_as("12", nodes=3, tasks_per_node=8, run=run) is True
    assert calls == [["requeuehold", "12"], ["update", "JobId=12", "NumNodes=3", "NumTasks=24"], ["release", "12"]]
    calls.clear()
    assert slurm.requeue_as("12", exclude=["node6"], nodes=2, tasks_per_node=8, run=run) is True
    assert calls[1] == ["update", "JobId=12", "ExcNodeList=node6", "NumNodes=2", "NumTasks=16"]


def test_a_failed_attempt_records_its_nodes_and_requeues_for_what_is_up(tmp_path, monkeypatch):
    folder = tmp_path / "12"
    folder.mkdir()
    (folder / "12_0_log.err").write_text(ATTEMPT_MARK.format(restart=1, job=12) + "\n"
                                         "srun: error: node2: task 0: Killed\n")
    asked = []
    monkeypatch.setattr(Elastic, "requeue", lambda self, *a, **kw: asked.append((self, a, kw)))
    env = {"SLURM_JOB_ID": "12", "SLURM_JOB_NUM_NODES": "1", "SLURM_JOB_PARTITION": "faults",
           "SLURM_RESTART_COUNT": "1"}
    assert end_of_attempt(tmp_path, 137, 3, environ=env, exclude=["node1"], elastic=Elastic(1, 2)) == 0
    assert asked == [(Elastic(1, 2), ("12", ["node1"], "faults"), {"exclude_changed": False})]
    ev = read_events(folder)
    assert (ev[-1]["nodes"], ev[-1]["of_nodes"]) == (1, 2)
    assert describe(ev[-1]) == "attempt 1 on 1 of 2 nodes: failed: rank 0: killed by SIGKILL; requeued"
    assert describe({"event": "completed", "restart": 2, "step": 6}) == "attempt 2: completed at step 6"


def test_the_batch_script_runs_as_many_tasks_as_it_got_nodes(tmp_path):
    setup, teardown = batch_lines("jobs", 2, python="true", elastic=Elastic(1, 4, 8))
    assert teardown[1].endswith(" --elastic 1:4:8 --rc $vitp_rc")
    script = "\n".join([*setup, 'echo "$SLURM_NTASKS $SLURM_NPROCS"'])
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True,
                         env={"SLURM_JOB_NUM_NODES": "3", "SLURM_NTASKS": "32", "SLURM_JOB_ID": "12"})
    assert out.stdout.split() == ["24", "24"]  # not the 32 sbatch exported for the 4 nodes it was submitted on
    plain, _ = batch_lines("jobs", 2, python="true")
    assert not any("SLURM_NTASKS" in line for line in plain)
