"""data_prep.sources + data_prep.plan: listing, manifests, deterministic shuffle, stratified split, shard cuts."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data_prep.cli import parse_range, parse_size, prep_main, verify_main
from data_prep.plan import assign_splits, build_plan, plan_shards
from data_prep.sources import Item, Source, list_image_folder, list_source
from tests.data_prep_fixtures import bad_corpus  # noqa: F401

OPTS = dict(image_options={}, do_dedup=False)


def _items(n_per_class: dict[int, int]) -> list[Item]:
    return [Item(rel=f"c{c}/{i}.jpg", label=f"c{c}", cls=c, size=100) for c, n in n_per_class.items() for i in range(n)]


def test_image_folder_listing(bad_corpus):  # noqa: F811
    root, expected = bad_corpus
    src = list_image_folder(root)
    assert src.classes == ["cat", "dog", "eel"]
    listed = {it.rel for it in src.items} | {r["path"] for r in src.rejects}
    assert listed == set(expected)  # nothing lost, nothing invented (the loop dir is listed once)
    assert {r["path"]: r["reason"] for r in src.rejects} == {
        "README.md": "no_class", "eel/notes.txt": "extension", "eel/up": "symlink_loop"}
    assert all(it.label == it.rel.split("/")[0] and src.classes[it.cls] == it.label for it in src.items)


def test_given_classes_fix_the_index_and_reject_others(bad_corpus, tmp_path):  # noqa: F811
    root, _ = bad_corpus
    (tmp_path / "classes.txt").write_text("eel\ncat\n")
    src = list_source(root, classes=str(tmp_path / "classes.txt"))
    assert src.classes == ["eel", "cat"]
    assert {it.cls for it in src.items if it.label == "eel"} == {0}
    assert {r["reason"] for r in src.rejects if r["path"].startswith("dog/")} == {"bad_label"}


@pytest.mark.parametrize("fmt", ["csv", "jsonl", "parquet"])
def test_manifests_with_names_ints_and_splits(tmp_path, fmt):
    rows = [{"path": "a/1.jpg", "label": "zebra", "split": "train"},
            {"path": "b/2.jpg", "label": "ant", "split": "val"},
            {"path": "b/3.jpg", "label": "", "split": "train"},
            {"path": "b/4.jpg", "label": "ant", "split": "bad-split"}]
    m = tmp_path / f"m.{fmt}"
    if fmt == "csv":
        m.write_text("path,label,split\n" + "".join(f"{r['path']},{r['label']},{r['split']}\n" for r in rows))
    elif fmt == "jsonl":
        m.write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        pq.write_table(pa.Table.from_pylist(rows), m)
    src = list_source(m, split_column="split")
    assert src.classes == ["ant", "zebra"] and src.root == str(tmp_path)
    assert [(it.rel, it.cls, it.split) for it in src.items] == [("a/1.jpg", 1, "train"), ("b/2.jpg", 0, "val")]
    assert sorted(r["reason"] for r in src.rejects) == ["bad_label", "bad_split"]


def test_integer_labels_are_indices(tmp_path):
    m = tmp_path / "m.jsonl"
    m.write_text('{"path": "x.jpg", "label": 2}\n{"path": "y.jpg", "label": "0"}\n{"path": "z.jpg", "label": 7}\n')
    src = list_source(m, classes=["a", "b", "c"])
    assert [(it.cls, it.label) for it in src.items] == [(2, "c"), (0, "a")]
    assert src.rejects[0]["reason"] == "bad_label" and "7" in src.rejects[0]["detail"]
    assert list_source(m).classes == [str(i) for i in range(8)]


def test_manifest_errors_name_the_file_and_column(tmp_path):
    m = tmp_path / "m.csv"
    m.write_text("file,label\nx.jpg,a\n")
    with pytest.raises(ValueError, match=r"m\.csv: manifest has no column 'path'"):
        list_source(m)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"path": "x.jpg", "label": "a"}\n{oops\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: not valid JSON"):
        list_source(bad)


def test_stratified_split_counts():
    items = _items({0: 10, 1: 20, 2: 3})
    s = assign_splits(items, 0.2)
    per = {c: sum(it.cls == c for it in s["val"]) for c in range(3)}
    assert per == {0: 2, 1: 4, 2: 1} and len(s["train"]) == 33 - 7


def test_plan_is_deterministic_and_seed_dependent():
    src = Source(root="/r", classes=["c0", "c1"], items=_items({0: 30, 1: 30}))
    kw = dict(val_fraction=0.1, max_samples_per_shard=7, shard_size_bytes=None, **OPTS)
    p1, p2 = build_plan(src, seed=3, **kw), build_plan(Source("/r", ["c0", "c1"], src.items[::-1]), seed=3, **kw)
    assert p1 == p2  # listing order does not matter
    assert p1["shards"] != build_plan(src, seed=4, **kw)["shards"]
    names = [s["name"] for s in p1["shards"]]
    assert names == [f"train-{i:06d}" for i in range(8)] + ["val-000000"]
    keys = [smp[0] for s in p1["shards"] for smp in s["samples"]]
    assert len(set(keys)) == 60 and not any("." in k for k in keys)


def test_shards_cut_by_count_and_bytes():
    items = [Item(rel=str(i), label="a", cls=0, size=s) for i, s in enumerate([40, 40, 40, 100, 10, 10])]
    assert [len(s["samples"]) for s in plan_shards(items, "train", None, 100)] == [2, 1, 1, 2]
    assert [len(s["samples"]) for s in plan_shards(items, "train", 2, 100)] == [2, 1, 1, 2]
    assert [len(s["samples"]) for s in plan_shards(items, "train", 4, None)] == [4, 2]


def test_cli_parsers_and_help(capsys):
    assert parse_size("500MB") == 500_000_000 and parse_size("64MiB") == 64 << 20 and parse_size("7") == 7
    assert parse_range("3:9") == (3, 9)
    with pytest.raises(SystemExit) as e:
        prep_main(["--help"])
    assert e.value.code == 0 and "vitp prep" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        prep_main(["src", "out", "--shard-size", "lots"])
    assert "--shard-size 'lots'" in capsys.readouterr().err
    assert verify_main(["/nonexistent-dir"]) == 1


def test_no_torch_in_data_prep():
    import subprocess
    import sys

    code = "import sys, data_prep.build, data_prep.checks, data_prep.cli; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
