"""The global sample order (pipeline/data/order.py): one order per (seed, epoch, dataset), cut into
global batches the same way at any world size, worker count or micro batch, so a resume at another
layout continues inside the epoch; in-process ranks over tiny real shards."""

from __future__ import annotations

import collections
import itertools

import numpy as np
import pytest
import torch

from pipeline.config import DataCfg
from pipeline.data.loader import TrainLoader
from pipeline.data.order import GlobalOrder
from tests.unit.test_data_shards import write_dataset

SIZES = [3, 9, 5, 12, 11, 8]  # 48 samples in 6 uneven shards: 6 global batches of 8


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    root = tmp_path_factory.mktemp("global_order")
    keys = write_dataset(root, {"train": SIZES})["train"]
    return DataCfg(path=str(root), workers=0, shuffle_buffer=6, lanes=4, randaugment="rand-m9-mstd0.5"), keys


def ranks(cfg, world, micro, workers=0, seed=5):
    return [TrainLoader(cfg, img_size=16, micro_batch=micro, global_batch=8, rank=r, world_size=world, seed=seed,
                        num_workers=workers, return_keys=True) for r in range(world)]


def steps(lds, n):
    """The next ``n`` optimizer steps of ranks ``lds``: per step, key → pixels (uint8 [3, S, S])."""
    its = [ld.forever() for ld in lds]
    out = []
    for _ in range(n):
        got = {}
        for it, ld in zip(its, lds):
            for x, _, ks in itertools.islice(it, ld.accum_steps):
                got.update({k: x[i].clone() for i, k in enumerate(ks)})
        out.append(got)
    return out


def test_order_is_a_permutation_and_depends_on_seed_and_epoch_only():
    o = GlobalOrder(1, 0, SIZES, lanes=4, window=6)
    p = o.positions(0, 48)
    assert sorted(p.tolist()) == list(range(48))
    assert np.array_equal(o.positions(13, 29), p[13:29])  # any slice, the same order
    assert not np.array_equal(GlobalOrder(1, 1, SIZES, 4, 6).positions(0, 48), p)
    assert not np.array_equal(GlobalOrder(2, 0, SIZES, 4, 6).positions(0, 48), p)
    # lanes interleave: the first C samples come from C different lanes (places in the sequence)
    assert (o.lanes, o.lane_len, o.window) == (4, 12, 6)
    assert len(set((o.sequence_index(np.arange(4)) // 12).tolist())) == 4


def test_global_batches_are_the_same_at_any_layout(shards):
    cfg, keys = shards
    a = steps(ranks(cfg, 2, 4), 6)  # 2 ranks x 1 micro-batch of 4
    b = steps(ranks(cfg, 1, 2, workers=2), 6)  # 1 rank x 4 micro-batches of 2, 2 workers
    c = steps(ranks(cfg, 4, 1), 6)  # 4 ranks x 2 micro-batches of 1
    assert [sorted(s) for s in a] == [sorted(s) for s in b] == [sorted(s) for s in c]
    assert collections.Counter(k for s in a for k in s) == collections.Counter(keys)  # each once
    for sa, sb in zip(a, c):  # a sample's pixels do not depend on who augments it
        assert all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("before,after", [((2, 4, 0), (1, 2, 2)), ((1, 4, 2), (4, 1, 0))])
def test_resume_at_another_layout_continues_inside_the_epoch(shards, before, after):
    """Killed after 2 of 6 steps at layout ``before`` (world, micro, workers), resumed at ``after``:
    the rest of the epoch is the uninterrupted run's, sample for sample and pixel for pixel."""
    cfg, keys = shards
    ref = steps(ranks(cfg, *before), 6)
    first = ranks(cfg, *before)
    steps(first, 2)
    state = first[0].state_dict()
    again = ranks(cfg, *after, seed=0)  # the state's seed wins
    for ld in again:
        ld.load_state_dict(state)
    assert (again[0].epoch, again[0].step) == (0, 2 * again[0].accum_steps)
    rest = steps(again, 4)
    assert [sorted(s) for s in rest] == [sorted(s) for s in ref[2:]]
    assert all(torch.equal(s[k], r[k]) for s, r in zip(rest, ref[2:]) for k in s)
    seen = [k for s in ref[:2] + rest for k in s]
    assert sorted(seen) == sorted(keys)  # none twice, none skipped


def test_changed_global_batch_or_order_settings_start_the_next_epoch(shards):
    cfg, _ = shards
    ld = ranks(cfg, 2, 4)[0]
    steps([ld], 1)
    sd = ld.state_dict()
    for changed in (dict(global_batch=16), dict(lanes=2), dict(order="rank")):
        kw = dict(img_size=16, micro_batch=4, global_batch=8, rank=0, world_size=2)
        c = type(cfg).model_validate({**cfg.model_dump(), **{k: v for k, v in changed.items() if k != "global_batch"}})
        other = TrainLoader(c, **{**kw, **{k: v for k, v in changed.items() if k == "global_batch"}})
        with pytest.warns(UserWarning, match="different layout"):
            other.load_state_dict(sd)
        assert (other.epoch, other.step) == (1, 0), changed


def test_mid_step_state_at_another_layout_starts_the_next_epoch(shards):
    """Checkpoints fall on optimizer steps; a state between two (accumulation half done) cannot be
    shared anew, so it continues at the next epoch like any other layout change."""
    cfg, _ = shards
    ld = ranks(cfg, 1, 2)[0]  # accumulation 4
    list(itertools.islice(ld.forever(), 3))
    other = ranks(cfg, 2, 4)[0]
    with pytest.warns(UserWarning, match="different layout"):
        other.load_state_dict(ld.state_dict())
    assert (other.epoch, other.step) == (1, 0)
    same = ranks(cfg, 1, 2, workers=2)[0]  # only the worker count differs: continues where it was
    same.load_state_dict(ld.state_dict())
    assert (same.epoch, same.step) == (0, 3)
