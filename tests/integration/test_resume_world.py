"""Resume at another world size inside the epoch (DeepSpeed over gloo, prep's shards): 2 ranks with 2
loader workers, killed mid-epoch → 1 rank with 1 worker, killed → 2 ranks with 1 worker. Every sample
of the epoch is read exactly once (the loaders' read records), the losses follow the uninterrupted
2-rank run within fp32 tolerance, and at each resume the fp32 master weights and Adam's moments equal
the ones saved, at ZeRO-1, 2 and 3 (the universal conversion restores the optimizer, not only weights).
The EMA and a periodic few-shot evaluator go on across 2 ranks → 1 from where the 2 ranks left them.

The shards: 160 train images, 5 optimizer steps of 32 an epoch; checkpoints every 2 steps."""

from __future__ import annotations

import collections
import json
from pathlib import Path

import pytest
import torch

from data_prep import prep
from pipeline.checkpoint_layout import complete_checkpoints
from pipeline.data.loader import read_info, shard_labels
from tests.integration.test_pretrain import losses, metrics, pretrain, shards, weights  # noqa: F401 (a fixture)
from tests.multilabel_data import blobs_manifest

pytestmark = pytest.mark.distributed
EPOCH_STEPS = 5


def reads(log: Path, world: int, accum: int) -> dict[int, list[str]]:
    """Optimizer step (1-based, over epochs) → the keys the ranks' loaders handed out for it."""
    out = collections.defaultdict(list)
    for r in range(world):
        for line in Path(f"{log}.{r}").read_text().splitlines():
            rec = json.loads(line)
            out[rec["epoch"] * EPOCH_STEPS + rec["step"] // accum + 1] += rec["keys"]
    return out


def assert_same_state(saved: dict, resumed: dict, step: int):
    what = f"step {step}"
    assert saved.keys() == resumed.keys(), what
    assert saved["_steps"] == [step], what  # Adam counted each optimizer step once (fp32: none skipped)
    assert saved["_steps"] == resumed["_steps"] and saved["_lr"] == resumed["_lr"], what
    for name in saved:
        if name.startswith("_"):
            continue
        assert saved[name].keys() == resumed[name].keys() == {"fp32", "exp_avg", "exp_avg_sq"}, (what, name)
        for k in saved[name]:
            assert torch.equal(saved[name][k], resumed[name][k]), (what, name, k)
        assert saved[name]["exp_avg_sq"].abs().sum() > 0, (what, name)  # a real state, not a fresh one


@pytest.mark.parametrize("stage", [2, pytest.param(1, marks=pytest.mark.slow),
                                   pytest.param(3, marks=pytest.mark.slow)])
def test_two_ranks_one_rank_two_ranks_inside_the_epoch(tiny_reference, shards, tmp_path, stage):  # noqa: F811
    data = [d for d in shards if not d.startswith("data.workers")]
    ref = tiny_reference(stage, shards)
    run, optim = tmp_path / "run", tmp_path / "optim"
    # inline saves: each kill below must find the checkpoint just before it published (a background
    # write still in flight at the kill would make the one before it the resume point)
    zero, inline = f"engine.zero_stage={stage}", "checkpoint.async=false"
    env = {"VITP_TEST_OPTIM_DUMP": str(optim)}
    # 1: 2 ranks x 2 workers, rank 1 killed before step 3 (resumes from step 2)
    assert pretrain(run, zero, inline, "data.workers=2", data=data,
                    env={**env, "VITP_TEST_READ_LOG": str(tmp_path / "a1"), "VITP_TEST_KILL_AT_STEP": "3"}) != 0
    # 2: 1 rank x 1 worker (accumulation 2), killed before step 5 (resumes from step 4)
    assert pretrain(run, zero, inline, "data.workers=1", data=data, nprocs=1,
                    env={**env, "VITP_TEST_READ_LOG": str(tmp_path / "a2"), "VITP_TEST_KILL_AT_STEP": "5",
                         "VITP_TEST_KILL_RANK": "0"}) != 0
    # 3: 2 ranks x 1 worker, to the end (step 6 is the next epoch's first)
    assert pretrain(run, zero, inline, "data.workers=1", data=data,
                    env={**env, "VITP_TEST_READ_LOG": str(tmp_path / "a3")}) == 0

    read = {s: ks for log, world, accum, steps in ((tmp_path / "a1", 2, 1, (1, 2)), (tmp_path / "a2", 1, 2, (3, 4)),
                                                   (tmp_path / "a3", 2, 1, (5, 6)))
            for s, ks in reads(log, world, accum).items() if s in steps}
    assert sorted(read) == [1, 2, 3, 4, 5, 6] and all(len(ks) == 32 for ks in read.values())
    info = read_info(Path(data[0].split("=", 1)[1]))
    epoch_keys = [k for u in info.split("train").urls for k, _ in shard_labels(u, info.num_classes)]
    seen = [k for s in range(1, EPOCH_STEPS + 1) for k in read[s]]
    assert collections.Counter(seen) == collections.Counter(epoch_keys)  # each sample of epoch 0 once

    assert [r["step"] for r in metrics(run) if "loss" in r] == [1, 2, 3, 4, 5, 6]
    got, want = losses(run), losses(ref)
    assert got[1] == want[1] and got[2] == want[2]  # before any resume: the reference run itself
    for s in (3, 4, 5, 6):
        assert got[s] == pytest.approx(want[s], rel=1e-4), s
    lr = {r["step"]: r["lr"] for r in metrics(run) if "lr" in r}
    assert lr == {r["step"]: r["lr"] for r in metrics(ref) if "lr" in r}  # the schedule continues
    for step in (2, 4):  # 2 ranks → 1, 1 → 2
        assert_same_state(torch.load(optim / f"saved-{step}.pt", weights_only=True),
                          torch.load(optim / f"resumed-{step}.pt", weights_only=True), step)


@pytest.mark.slow
def test_ema_and_fewshot_continue_at_another_world_size(shards, tmp_path):  # noqa: F811
    """optim.ema and a periodic few-shot evaluator across 2 ranks → 1. The average the 1-rank attempt
    goes on from is the one the 2 ranks saved (once, read by every rank, whatever their number), so
    the exported average follows the uninterrupted run's; one restarted from the weights at the
    resume would be off by a quarter of the gap between the saved average and those weights (decay
    0.5, 2 steps after it). The few-shot evaluator (every 2 steps, after the checkpoint) scores steps
    2, 4 and 6 once each: step 4, evaluated before the kill, is not evaluated again."""
    few = tmp_path / "blobs/shards"
    prep(blobs_manifest(tmp_path / "blobs", 8, 6, shuffle=True), few, split_column="split",
         max_samples_per_shard=10, progress=False)
    data = [d for d in shards if not d.startswith("data.workers")]
    runs = ["optim.ema=0.5", "engine.zero_stage=2", "checkpoint.async=false", "data.workers=1", "checkpoint.keep=5",
            f"eval.fewshot_data=[blobs={few}]", "eval.fewshot_shots=[1,3]", "eval.fewshot_seeds=2",
            "train.fewshot_every=2"]
    whole, moved = tmp_path / "whole", tmp_path / "moved"
    assert pretrain(whole, *runs, data=data) == 0
    assert pretrain(moved, *runs, data=data, env={"VITP_TEST_KILL_AT_STEP": "5"}) != 0  # resumes from step 4
    assert pretrain(moved, *runs, data=data, nprocs=1) == 0
    assert [r["step"] for r in metrics(moved) if "loss" in r] == [1, 2, 3, 4, 5, 6]
    for run in (whole, moved):
        assert [r["step"] for r in metrics(run) if "fewshot/seconds" in r] == [2, 4, 6], run.name

    ckpt4 = next(c for c in complete_checkpoints(moved) if c.name == "step-00000004")
    saved = torch.load(ckpt4 / "vitp_shared.pt", weights_only=True)["states"]["ema"]
    module = next(torch.load(f, weights_only=False)["module"] for f in ckpt4.rglob("mp_rank_00_model_states.pt"))
    restart_gap = max(0.25 * (saved[k].float() - module[k].float()).abs().max().item() for k in saved)
    a, b = weights(whole), weights(moved)
    assert a.keys() == b.keys() and set(saved) <= set(a)
    off = max((a[k].float() - b[k].float()).abs().max().item() for k in a)
    assert off < restart_gap / 10, (off, restart_gap)
