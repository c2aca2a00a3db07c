"""The parts of a background checkpoint save that need no ranks: the host copy, the writer thread,
the host-memory check, the minutes cadence's choice of step, the bytes the plan counts."""

import collections
import os
import threading
import time

import pytest
import torch

from pipeline.config import load_config
from pipeline.plan.checkpoint import checkpoint_cost
from pipeline.plan.memory import checkpoint_bytes
from pipeline.train import saving
from pipeline.train.checkpoint import PLAN_AFTER, CheckpointManager
from pipeline.train.saving import Background, HostCopy, host_room

Pair = collections.namedtuple("Pair", "a b")


def test_the_host_copy_is_what_the_step_saved_and_reuses_its_buffers():
    live = torch.arange(6.0)
    view = live[2:5]
    state = collections.OrderedDict(w=live, again=live, nested={"v": view, "pair": Pair(live, 3), "xs": [view, "s"]},
                                    shape=torch.Size([2, 3]), t=(live, 1))
    copy = HostCopy()
    snap = copy(state)
    copy.done()
    live += 100  # the next step updates in place
    assert type(snap) is collections.OrderedDict and snap["w"].tolist() == [0, 1, 2, 3, 4, 5]
    assert snap["again"] is snap["w"]  # one tensor met twice: one copy
    assert snap["nested"]["v"].tolist() == [2, 3, 4] and snap["nested"]["v"].untyped_storage().size() == 3 * 4
    assert isinstance(snap["nested"]["pair"], Pair) and snap["nested"]["pair"].b == 3
    assert snap["nested"]["xs"][1] == "s" and copy.bytes == (6 + 3) * 4
    assert type(snap["shape"]) is torch.Size and snap["t"][0] is snap["w"] and type(snap["t"]) is tuple
    first = [b.data_ptr() for b in copy.buffers]
    again = copy(state)
    copy.done()
    assert [b.data_ptr() for b in copy.buffers] == first  # the next save allocates nothing
    assert again["w"].tolist() == live.tolist()


def test_the_writer_keeps_the_first_failure_as_its_line_and_waits():
    bg, gate, order = Background(), threading.Event(), []

    def job():
        gate.wait(10)
        order.append("written")

    bg.run(job, inline=False)
    assert bg.running
    gate.set()
    bg.wait()
    assert order == ["written"] and not bg.running and bg.error is None
    bg.run(lambda: "checkpoint step-00000004: writing x failed", inline=False)
    bg.run(lambda: 1 / 0, inline=True)  # waits for the one before, then runs here
    assert bg.error == "checkpoint step-00000004: writing x failed"
    other = Background()
    other.run(lambda: 1 / 0, inline=True)
    assert other.error == "checkpoint write failed: ZeroDivisionError: division by zero"


def test_the_writer_counts_the_cpu_its_thread_took_not_its_waits():
    """What bench/checkpoint.py reports as a write's CPU: 0.05 s spent computing after 0.2 s asleep."""
    def job():
        threading.Event().wait(0.2)
        began = time.thread_time()
        while time.thread_time() - began < 0.05:
            pass

    bg = Background()
    bg.run(job, inline=False)
    bg.wait()
    assert 0.05 <= bg.cpu_s < 0.15


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE is Linux's")
def test_the_writer_runs_only_on_a_core_training_leaves_idle():
    """The writer thread's policy is SCHED_IDLE; the thread that started it keeps its own."""
    seen = {}
    before = os.sched_getscheduler(0)
    bg = Background()
    bg.run(lambda: seen.update(policy=os.sched_getscheduler(threading.get_native_id())), inline=False)
    bg.wait()
    assert seen["policy"] == os.SCHED_IDLE
    assert os.sched_getscheduler(0) == before


def test_host_room_counts_every_local_rank(monkeypatch):
    gib = 2**30
    assert host_room(10 * gib, 8, available=100 * gib)  # 80 of 0.8 x 100
    assert not host_room(11 * gib, 8, available=100 * gib)
    assert saving.available_host_bytes() > 0 and not host_room(10**15, 1)  # this machine's MemAvailable
    monkeypatch.setattr(saving, "available_host_bytes", lambda: None)  # not Linux
    assert host_room(10**15, 8)  # unknown: assumed to fit


def test_the_minutes_cadence_picks_the_step_from_rank_0s_pace():
    m = CheckpointManager("unused", None, {}, every=0, every_minutes=0.1, last_step=100, keep=1)
    m._clock = (10, time.monotonic() - 6.0)  # noqa: SLF001 - 6 steps in 6 s, as the loop would have timed
    m._pick(16)  # noqa: SLF001
    assert m._next_at == 22  # noqa: SLF001 - 0.1 min = 6 s = 6 steps ahead
    assert [s for s in range(17, 40) if m.due(s)] == [22]
    fresh = CheckpointManager("unused", None, {}, every=0, every_minutes=1.0, last_step=100, keep=1)
    fresh.maybe_save(3)  # the job's first step: its clock starts, nothing saved or picked
    assert fresh._clock[0] == 3 and fresh._next_at is None and PLAN_AFTER == 4  # noqa: SLF001


def test_the_plan_counts_the_files_each_rank_writes():
    p = 86_000_000
    b = checkpoint_bytes(p, precision="fp32", zero_stage=2, world_size=2)
    assert b == {"total": 4 * p + 12 * p, "rank0": 4 * p + 6 * p}  # module + half the master weights and moments
    assert checkpoint_bytes(p, precision="bf16", zero_stage=0, world_size=8)["rank0"] == 2 * p + 12 * p
    assert checkpoint_bytes(p, precision="bf16", zero_stage=3, world_size=4)["total"] == 2 * p + 12 * p


def test_the_plan_shows_what_a_save_holds_training_and_its_share():
    cfg = load_config("configs/pretrain/vit_b16.yaml", ["checkpoint.every_minutes=10", "cluster.nodes=1",
                                                       "cluster.tasks_per_node=8"], world_size=1)
    ck = checkpoint_cost(cfg, 86e6, step_s=0.5)
    total = 2 * 86e6 + 12 * 86e6  # bf16 module + fp32 master and Adam moments
    assert ck["bytes"] == pytest.approx(total) and ck["write_s"] == pytest.approx(total / 5e9)
    assert ck["blocking_s"] == pytest.approx((2 * 86e6 + 12 * 86e6 / 8) / 20e9)  # rank 0's copy to host
    assert ck["interval_s"] == 600 and ck["share"] == pytest.approx(ck["blocking_s"] / (600 + ck["blocking_s"]))
    inline = checkpoint_cost(load_config("configs/pretrain/vit_b16.yaml", ["checkpoint.async=false",
                                                                           "checkpoint.every_minutes=0",
                                                                           "checkpoint.every=100"], world_size=1),
                             86e6, step_s=0.5)
    assert inline["blocking_s"] == inline["write_s"] and inline["interval_s"] == 50 and inline["snapshot_bytes"] == 0


def test_a_node_without_room_for_the_snapshots_writes_inline_and_says_so(monkeypatch, capsys):
    from pipeline.train import build

    cfg = load_config("configs/pretrain/vit_b16.yaml", [], world_size=1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    monkeypatch.setattr(build, "available_host_bytes", lambda: 8 * 2**30)
    assert build.room_for_snapshots(cfg, 86_000_000, 64)  # 8 x 0.19 GB fit in 8 GiB
    monkeypatch.setattr(build, "available_host_bytes", lambda: 2**30)
    assert not capsys.readouterr().err
    assert build.room_for_snapshots(cfg, 86_000_000, 64) is False
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["warning: checkpoint.async: this node has 1.0 GiB of host memory free, its 8 rank(s) need 1.4 GiB "
                   "for checkpoint snapshots; checkpoints are written inline (training waits for each save)"]


def test_a_writer_whose_process_group_is_gone_publishes_nothing(tmp_path):
    """An error ends the stage and the training thread leaves the process group while rank 0's writer
    still runs: the writer cannot learn whether every rank wrote its files, so it does not publish
    (it once took its own "no failure" for every rank's and published a checkpoint without rank 1's)."""
    m = CheckpointManager(tmp_path, None, {}, every=2, last_step=10, keep=1)
    m._group = object()  # noqa: SLF001 - the writers' gloo group of a process group that no longer exists
    tmp, final = tmp_path / "checkpoints" / "tmp-step-00000004", tmp_path / "checkpoints" / "step-00000004"
    tmp.mkdir(parents=True)
    (tmp / "vitp_rank0.pt").write_bytes(b"rank 0's part")
    m._writer.run(lambda: m._write(4, [], tmp, final, {"step": 4}), inline=True)  # noqa: SLF001
    assert "process group is gone" in m._writer.error and not final.exists()  # noqa: SLF001
