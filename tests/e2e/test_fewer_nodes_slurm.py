"""A job of cluster.nodes=2 cluster.min_nodes=1 on the local cluster's partition `faults`, left without node1
(so its nodes are node2 and node3): attempt 0 runs on both; node3 is drained (it takes no new job, as a node
an admin takes out or a node that went down), the job is requeued at its time limit (USR2) and attempt 1
runs on node2 alone (1 rank, accumulation 2, the universal checkpoint); node3 comes back, the next requeue
asks for both again and attempt 2 runs on two. Every sample of the epoch is read once across the attempts
(the loaders' read records), the losses follow the uninterrupted 2-rank run within fp32 tolerance, and
events.jsonl and `vitp jobs` say how many nodes each attempt had. node3 is back up whatever happens.

The shards: 160 train images, 5 optimizer steps of 32 an epoch; steps 1-3 on 2 nodes, 4-5 on 1, 6 on 2."""

from __future__ import annotations

import collections
import json
import subprocess
from pathlib import Path

import pytest

from launch.attempts import read_events
from launch.jobs import outcome, read_index, wait
from launch.nodes import nodes_up
from pipeline.data.loader import read_info, shard_labels
from tests.e2e.test_bad_node import node_back
from tests.e2e.test_cluster_faults import jobs_listing
from tests.e2e.test_submit_slurm import RES, TINY, Gate, cli, job_id, poll, usr2
from tests.integration.test_pretrain import COMMON, losses, metrics, shards  # noqa: F401 (a fixture)

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

SPARE, LEFT_OUT = "node3", "node1"
EPOCH_STEPS, STEPS = 5, 6


def drain(node: str) -> None:
    """``node`` takes no new job; the one running there goes on (an admin's drain, a node on its way out)."""
    subprocess.run(["scontrol", "update", f"NodeName={node}", "State=DRAIN", "Reason=vitp test: fewer nodes"],
                   check=True, capture_output=True, text=True)


def reads(log: Path, events: list[dict]) -> dict[int, list[str]]:
    """Optimizer step (1-based, over epochs) -> the keys the loaders handed out for it, each attempt's
    records kept to the steps that attempt trained (a loader reads ahead of the step that stopped it)."""
    first, out = 1, collections.defaultdict(list)
    for ev in events:
        world = ev["nodes"]  # one task per node
        accum = 32 // (16 * world)
        for r in range(world):
            for line in Path(f"{log}.{r}").read_text().splitlines():
                rec = json.loads(line)
                step = rec["epoch"] * EPOCH_STEPS + rec["step"] // accum + 1
                if rec["restart"] == ev["restart"] and first <= step <= ev["step"]:
                    out[step] += rec["keys"]
        first = ev["step"] + 1
    return out


def test_a_requeue_on_fewer_nodes_continues_the_epoch_and_grows_back(slurm_cluster, shards, tiny_reference,  # noqa: F811
                                                                      tmp_path):
    data = [d for d in shards if not d.startswith("data.workers")]
    jobs, run, log = tmp_path / "jobs", tmp_path / "run", tmp_path / "reads"
    gate = Gate(tmp_path / "gate", 3, 5)
    r = cli(["submit", "pretrain", "--config", TINY, "--resources", RES, *COMMON, *data, "checkpoint.async=false",
             f"run.dir={run}", f"cluster.log_dir={jobs}", f"cluster.partition={slurm_cluster.faults}",
             f"cluster.exclude_nodes=[{LEFT_OUT}]", "cluster.min_nodes=1"],
            {**gate.env, "VITP_TEST_READ_LOG": str(log)})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    jid = job_id(r.stdout)
    folder = jobs / jid
    ref = tiny_reference(2, data)  # the same training on 2 local ranks, while attempt 0 starts
    try:
        gate.held(3, folder)  # attempt 0: 2 ranks, node2 and node3
        drain(SPARE)
        gate.signal_and_open(3, jid, folder, usr2(jid), "requeue")
        gate.ranks = 1
        gate.held(5, folder)  # attempt 1: 1 rank on node2
    finally:
        node_back(SPARE)
    # RESUME sets the node IDLE; slurmctld calls it responding only once its next ping answers (idle*
    # in between, ~1 s here): a requeue in that window would rightly ask for one node
    poll(lambda: SPARE in (nodes_up(slurm_cluster.faults) or []), 60, f"{SPARE} up and responding")
    gate.signal_and_open(5, jid, folder, usr2(jid), "requeue")
    entries = read_index(jobs)
    ok, line = outcome(entries[0], wait(entries, timeout_s=600)[jid])
    assert ok, line

    ev = read_events(folder)
    assert [(e["event"], e["restart"], e["step"], e["nodes"], e["of_nodes"]) for e in ev] == [
        ("requeued", 0, 3, 2, 2), ("requeued", 1, 5, 1, 2), ("completed", 2, STEPS, 2, 2)], ev
    assert jobs_listing(jobs)[2:] == ["  attempt 0 on 2 of 2 nodes: time limit near at step 3: saved, requeued",
                                      "  attempt 1 on 1 of 2 nodes: time limit near at step 5: saved, requeued",
                                      f"  attempt 2 on 2 of 2 nodes: completed at step {STEPS}"]

    read = reads(log, ev)
    assert sorted(read) == list(range(1, STEPS + 1)) and all(len(ks) == 32 for ks in read.values())
    info = read_info(Path(data[0].split("=", 1)[1]))
    epoch_keys = [k for u in info.split("train").urls for k, _ in shard_labels(u, info.num_classes)]
    seen = [k for s in range(1, EPOCH_STEPS + 1) for k in read[s]]
    assert collections.Counter(seen) == collections.Counter(epoch_keys)  # each sample of epoch 0 once

    assert [r["step"] for r in metrics(run) if "loss" in r] == list(range(1, STEPS + 1))
    got, want = losses(run), losses(ref)
    for s in range(1, STEPS + 1):
        assert got[s] == pytest.approx(want[s], rel=1e-4), s
