"""A dataset's `_exclude.json` (`vitp decontam`): every loader leaves exactly its samples out, 2 ranks x
2 workers still see every other sample once an epoch and count each left-out one once (as ``excluded``,
not as a bad sample), a resumed loader reads on bit-exactly across the cut and carries that count on
without counting again, and a minival is cut from what is left."""

from __future__ import annotations

import collections
import itertools
import json
from pathlib import Path

import pytest
import torch

from pipeline.config import DataCfg
from pipeline.data import DataError
from pipeline.data.shards import read_info, skip_record
from tests.unit.test_data_loader import epoch, loader, replace
from tests.unit.test_data_shards import write_dataset

SIZES = [3, 9, 5, 12, 11, 8]  # 48 samples; 8 excluded leaves 40 = 5 steps of 8


def _exclude(root, keys: list[str], gone: list[int]) -> None:
    """Write root/_exclude.json listing samples ``gone`` (positions in the split's key list)."""
    cum = list(itertools.accumulate([0, *SIZES]))
    samples = []
    for p in gone:
        s = max(i for i, c in enumerate(cum[:-1]) if c <= p)
        samples.append({"split": "train", "shard": f"train-{s:06d}.tar", "index": p - cum[s], "key": keys[p],
                        "of": "t/x.jpg", "distance": 3, "margin": 0.02})
    (root / "_exclude.json").write_text(json.dumps({"version": 1, "excluded": len(samples), "against": [],
                                                    "samples": samples}))


@pytest.fixture
def cut(tmp_path):
    keys = write_dataset(tmp_path, {"train": SIZES, "val": [4]})["train"]
    gone = [0, 2, 3, 11, 12, 20, 29, 47]  # first, last, shard edges, a whole run
    _exclude(tmp_path, keys, gone)
    return DataCfg(path=str(tmp_path), workers=2, shuffle_buffer=8), [k for i, k in enumerate(keys) if i not in gone]


def test_two_ranks_two_workers_see_every_kept_sample_once(cut):
    cfg, kept = cut
    info = read_info(cfg.path)
    assert info.splits["train"].num_samples == 40 and info.excluded["excluded"] == 8
    lds = [loader(cfg, r) for r in (0, 1)]
    b = [epoch(ld) for ld in lds]
    seen = [k for bs in b for _, _, ks in bs for k in ks]
    assert collections.Counter(seen) == collections.Counter(kept)
    # each listed sample counted once an epoch, on the rank that read the kept one beside it; not as bad
    recs = [skip_record(ld.skipped) for ld in lds]
    assert [r["skipped"] for r in recs] == [0, 0] and sum(r["excluded"] for r in recs) == 8
    [epoch(ld) for ld in lds]
    assert sum(skip_record(ld.skipped)["excluded"] for ld in lds) == 16


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("k", "order"), [(3, "global"), (6, "global"), (3, "rank")])
def test_resume_across_the_cut_is_bit_exact(cut, k, order):
    cfg = replace(cut[0], order=order)  # k = 3: a worker's turns regrouped (it reads 2 micro-batches at once)
    ref = loader(cfg, 1)
    want = epoch(ref) + epoch(ref)
    first = loader(cfg, 1)
    list(itertools.islice(first.forever(), k))
    again = loader(cfg, 1)
    again.load_state_dict(first.state_dict())
    rest = list(itertools.islice(again.forever(), 10 - k))
    for (x1, y1, k1), (x2, y2, k2) in zip(want[k:], rest):
        assert k1 == k2 and torch.equal(y1, y2) and torch.equal(x1, x2)
    # the resumed loader carries the count on and does not count again what it counted before the
    # checkpoint (its shuffle buffer's samples read again, the run before them not read at all)
    assert first.state_dict()["skipped"].get("excluded", 0) > 0
    assert again.skipped == ref.skipped and ref.skipped["excluded"] > 0


def test_a_minival_is_cut_from_what_is_left(cut):
    cfg, kept = cut
    cfg = replace(cfg, minival_fraction=0.25)
    b = [epoch(loader(cfg, r, global_batch=6, micro_batch=3)) for r in (0, 1)]
    seen = {k for bs in b for _, _, ks in bs for k in ks}
    assert seen < set(kept) and len(seen) == 30  # 40 kept, a quarter held out for the minival


def test_a_bad_list_is_one_line(cut):
    cfg, _ = cut
    (Path(cfg.path) / "_exclude.json").write_text('{"version": 9, "samples": []}')
    with pytest.raises(DataError, match=r"_exclude.json: version 9; this vitp reads version 1$"):
        read_info(cfg.path)
