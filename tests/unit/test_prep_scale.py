"""Planning at scale: hash shuffle, streamed stratified split, plan pieces, chunked manifests, bounded memory."""

from __future__ import annotations

import json
import random
import shutil
import tracemalloc
from collections import Counter

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data_prep import build, plan, spill
from data_prep.plan import assign_splits, build_plan, make_plan, order_key, quotas
from data_prep.sources import Item, Listing, Source, open_source
from tests.data_prep_fixtures import bad_corpus, tree_bytes  # noqa: F401

KW = dict(max_samples_per_shard=7, shard_size_bytes=None, image_options={}, do_dedup=False)


def _items(n_per_class: dict[int, int]) -> list[Item]:
    return [Item(f"c{c}/{i}.jpg", f"c{c}", c, size=100) for c, n in n_per_class.items() for i in range(n)]


def _samples(p: dict) -> list[list]:
    return [smp for s in p["shards"] for smp in s["samples"]]


def test_spill_orders_any_number_of_records_in_small_buckets(tmp_path):
    rng = random.Random(0)
    recs = [(rng.getrandbits(64), i) for i in range(20_000)]
    recs += [(recs[5][0], -1), (recs[5][0], 10**6)]  # equal keys: ordered by the rest of the record
    s = spill.Spill(tmp_path, flush_records=1000, max_sort_records=50)  # 20k / 256 > 50: buckets split again
    for i in range(0, len(recs), 777):
        s.add_many(recs[i:i + 777])
    runs = list(s.sorted_runs())
    assert max(len(r) for r in runs) <= 50 and [x for r in runs for x in r] == sorted(recs)
    assert not list(tmp_path.rglob("*.bin"))  # each bucket file is gone once read


def test_hash_shuffle_is_a_deterministic_permutation(monkeypatch):
    monkeypatch.setattr(spill, "FLUSH_RECORDS", 100)
    monkeypatch.setattr(spill, "MAX_SORT_RECORDS", 8)  # force nested buckets
    items = _items({0: 700, 1: 500, 2: 300})
    src = Source("/r", ["c0", "c1", "c2"], items)
    p1 = build_plan(src, seed=3, val_fraction=0.0, **KW)
    shuffled = items[:]
    random.Random(1).shuffle(shuffled)
    p2 = build_plan(Listing(src.root, src.classes, False, lambda: iter([(shuffled[:700], []), (shuffled[700:], [])])),
                    seed=3, val_fraction=0.0, **KW)
    assert p1 == p2  # listing order and chunking do not matter
    got = [s[1] for s in _samples(p1)]
    assert Counter(got) == Counter(it.rel for it in items) and len(got) == 1500  # no loss, no duplicate
    seed_key = plan._seed_key(3)
    want = sorted(items, key=lambda it: (order_key(seed_key, it.rel, it.cls, "", ()), it.rel))
    assert got == [it.rel for it in want]  # the global order is the hash order
    other = [s[1] for s in _samples(build_plan(src, seed=4, val_fraction=0.0, **KW))]
    assert other != got and sorted(other) == sorted(got)
    # first positions are spread over the classes, not grouped by listing order
    assert Counter(int(r[1]) for r in got[:300]) == pytest.approx({0: 140, 1: 100, 2: 60}, abs=30)
    assert [s["samples"][0][0] for s in p1["shards"]][:3] == ["train_00000000", "train_00000007", "train_00000014"]


@pytest.mark.parametrize("fraction", [0.01, 0.1, 0.25])
def test_streamed_stratified_split_matches_the_in_memory_rule(fraction):
    counts = {0: 10, 1: 20, 2: 3, 3: 1, 4: 149, 5: 55}
    items = _items(counts)
    p = build_plan(Source("/r", [f"c{c}" for c in counts], items), seed=5, val_fraction=fraction, **KW)
    val = [s for sh in p["shards"] if sh["split"] == "val" for s in sh["samples"]]
    per_class = Counter(s[2] for s in val)
    want = {c: int(n * fraction + 0.5) for c, n in counts.items()}  # the old rule's rounding, half up
    assert {c: per_class.get(c, 0) for c in counts} == want == quotas(counts, fraction)
    # and the same members as the in-memory rule applied to the same global order
    seed_key = plan._seed_key(5)
    order = sorted(items, key=lambda it: (order_key(seed_key, it.rel, it.cls, "", ()), it.rel))
    ref = assign_splits(order, fraction)
    assert [s[1] for s in val] == [it.rel for it in ref["val"]]
    train = [s[1] for sh in p["shards"] if sh["split"] == "train" for s in sh["samples"]]
    assert train == [it.rel for it in ref["train"]]
    assert p["splits"]["val"]["samples"] + p["splits"]["train"]["samples"] == sum(counts.values())


PREP = dict(max_samples_per_shard=2, resize_shorter=32, progress=False, seed=7, val_fraction=0.2)


def test_an_array_task_reads_only_its_own_plan_pieces(bad_corpus, tmp_path, monkeypatch):  # noqa: F811
    root, _ = bad_corpus
    monkeypatch.setattr(plan, "PIECE_SAMPLES", 3)  # two shards of 2 samples a piece
    ref = tmp_path / "ref"
    build.prep(root, ref, **PREP)
    out = tmp_path / "out"
    n = build.prep(root, out, shard_range=(0, 0), **PREP)["shards_total"]
    index = json.loads((out / "_plan.json").read_text())
    assert n == sum(sp["shards"] for sp in index["splits"].values()) and n >= 10
    train_pieces = index["splits"]["train"]["pieces"]
    assert [p["first"] for p in train_pieces] == list(range(0, index["splits"]["train"]["shards"], 2))
    # the task for shards 2:4 needs train's second piece only: delete every other piece and the source listing
    keep = train_pieces[1]["file"]
    for p in (out / "_plan").iterdir():
        if f"_plan/{p.name}" != keep:
            p.unlink()
    opened = []
    real = plan.read_piece
    monkeypatch.setattr(plan, "read_piece", lambda o, name: opened.append(name) or real(o, name))
    real_open = build.open_source
    monkeypatch.setattr(build, "open_source", lambda *a, **k: pytest.fail("an array task listed the source"))
    s = build.prep(root, out, shard_range=(2, 4), **PREP)
    assert s["shards_written"] == 2 and set(opened) == {"_plan.json", keep}  # the index (again in finalize)
    for name in ("train-000002.tar", "train-000003.tar"):
        assert (out / name).read_bytes() == (ref / name).read_bytes()
    # a piece it needs is gone: one line naming it, nothing written
    with pytest.raises(ValueError, match=r"_plan/train-000000\.jsonl: plan piece missing"):
        build.prep(root, out, shard_range=(0, 1), **PREP)
    # a whole run plans again and puts back the pieces deleted: the dataset comes out as the reference's
    monkeypatch.setattr(build, "open_source", real_open)
    s = build.prep(root, out, **PREP)
    assert s["complete"] and s["shards_skipped"] == 2 and tree_bytes(out) == tree_bytes(ref)
    piece = out / keep
    piece.write_bytes(piece.read_bytes().replace(b"train_", b"trainX", 1))
    with pytest.raises(ValueError, match=r"train-000001\.jsonl: plan piece damaged"):
        build.prep(root, out, shard_range=(2, 4), **PREP)


def test_array_task_with_other_options_refuses_and_keeps_the_plan(bad_corpus, tmp_path):  # noqa: F811
    root, _ = bad_corpus
    out = tmp_path / "out"
    build.prep(root, out, shard_range=(0, 0), **PREP)
    before = tree_bytes(out), sorted((out / "_plan").iterdir())
    with pytest.raises(ValueError, match="different plan"):
        build.prep(root, out, shard_range=(0, 2), **{**PREP, "seed": 8})
    assert (tree_bytes(out), sorted((out / "_plan").iterdir())) == before


def _write_manifest(path, rows: list[dict], fmt: str) -> None:
    if fmt == "csv":
        path.write_text("path,label\n" + "".join(f"{r['path']},{r['label']}\n" for r in rows))
    elif fmt == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=4)


@pytest.mark.parametrize("fmt", ["csv", "jsonl", "parquet"])
def test_chunked_manifest_readers_give_the_same_items(tmp_path, fmt):
    rows = [{"path": f"d/{i}.jpg", "label": ["ant", "bee", "", "cat"][i % 4]} for i in range(23)]
    m = tmp_path / f"m.{fmt}"
    _write_manifest(m, rows, fmt)
    if fmt == "parquet":
        assert pq.ParquetFile(m).num_row_groups == 6  # read group by group
    whole = open_source(m, chunk_rows=1000).collect()
    chunks = list(open_source(m, chunk_rows=3).chunks())
    assert len(chunks) == 8 and max(len(i) + len(r) for i, r in chunks) == 3
    assert [it for i, _ in chunks for it in i] == whole.items and len(whole.items) == 17
    assert [r for _, r in chunks for r in r] == whole.rejects
    assert [r["path"] for r in whole.rejects] == [f"d/{i}.jpg" for i in range(2, 23, 4)]
    assert whole.classes == ["ant", "bee", "cat"]
    assert {fmt: [(it.rel, it.cls) for it in whole.items]} == {fmt: [
        (f"d/{i}.jpg", {0: 0, 1: 1, 3: 2}[i % 4]) for i in range(23) if i % 4 != 2]}


def test_planning_memory_is_bounded_by_a_chunk_not_the_manifest(tmp_path, monkeypatch):
    n = 200_000
    m = tmp_path / "big.csv"
    with open(m, "w") as f:
        f.write("path,label\n" + "".join(f"images/{i % 5000:05d}.jpg,n{i % 1000:08d}\n" for i in range(n)))
    monkeypatch.setattr(spill, "FLUSH_RECORDS", 4000)
    monkeypatch.setattr(spill, "MAX_SORT_RECORDS", 2000)
    monkeypatch.setattr(plan, "PIECE_SAMPLES", 2000)
    listing = open_source(m, sizes=False, chunk_rows=2000)
    tracemalloc.start()
    try:
        one = tracemalloc.get_traced_memory()[0]
        index = make_plan(listing, str(tmp_path / "scratch"), seed=0, val_fraction=0.01, max_samples_per_shard=500,
                          shard_size_bytes=None, image_options={}, do_dedup=False)
        peak = tracemalloc.get_traced_memory()[1] - one
    finally:
        tracemalloc.stop()
    splits = index["splits"]
    assert splits["train"]["samples"] == n - 2000 and splits["val"]["samples"] == 2000  # 2 of 200 a class
    assert len(index["splits"]["train"]["pieces"]) == 99  # 2000 samples a piece
    # the items alone, held as a list, would take ~200 bytes each (40 MB); planning peaks at a few MB
    assert peak < 4 * 2**20, f"planning peaked at {peak / 2**20:.1f} MiB"
    shutil.rmtree(tmp_path / "scratch")


def test_dedup_through_spill_files_keeps_the_first_path_of_each_content(tmp_path, monkeypatch):
    monkeypatch.setattr(spill, "MAX_SORT_RECORDS", 2)  # every group of equal hashes meets across nested buckets
    items = []
    for i in range(30):
        (tmp_path / f"{i:02d}.jpg").write_bytes(b"content %d" % (i % 10))
        items.append(Item(f"{i:02d}.jpg", "a", 0))
    for name in ("e1.jpg", "e2.jpg"):  # empty files are "empty", not duplicates of each other
        (tmp_path / name).write_bytes(b"")
        items.append(Item(name, "a", 0))
    p = build_plan(Source(str(tmp_path), ["a"], items[::-1]), seed=0, val_fraction=0.0, do_dedup=True,
                   max_samples_per_shard=4, shard_size_bytes=None, image_options={})
    assert sorted(s[1] for s in _samples(p)) == [f"{i:02d}.jpg" for i in range(10)] + ["e1.jpg", "e2.jpg"]
    assert p["rejects"] == [{"path": f"{i:02d}.jpg", "reason": "duplicate", "detail": f"same bytes as {i % 10:02d}.jpg"}
                            for i in range(10, 30)]
