"""`vitp prep --exclude-near`: training images that are near-duplicates of a test set's images are not
written; rejects.jsonl and _info.json say which and why; the plan id covers the test sets, so a rerun
with another one remakes the shards; test sets as folders, prep outputs, manifests, over S3 and HTTP."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageOps

from data_prep import prep
from tests.data_prep_fixtures import jpeg_bytes, natural_image, tree_bytes

REPO = Path(__file__).resolve().parents[2]
KW = dict(max_samples_per_shard=4, progress=False)


def _photos() -> tuple[Image.Image, Image.Image]:
    from sklearn.datasets import load_sample_images

    out = []
    for a in load_sample_images().images:
        im = Image.fromarray(a)
        im.thumbnail((192, 192))
        out.append(im)
    return out[0], out[1]


@pytest.fixture
def sets(tmp_path) -> dict[str, Path]:
    """train/: 8 unrelated pictures in two classes plus a mirrored, resized JPEG copy of china and a
    bordered copy of flower; china/ and flower/: one test photo each (flower as a grey PNG)."""
    china, flower = _photos()
    rng = np.random.default_rng(0)
    train = tmp_path / "train"
    for i in range(8):
        (train / f"c{i % 2}").mkdir(parents=True, exist_ok=True)
        (train / f"c{i % 2}" / f"n{i}.jpg").write_bytes(jpeg_bytes(natural_image(rng, 64, 48)))
    ImageOps.mirror(china).resize((96, 64)).save(train / "c0" / "china_copy.jpg", quality=60)
    ImageOps.expand(flower, 10, fill=(0, 0, 0)).save(train / "c1" / "flower_copy.png")
    (tmp_path / "china").mkdir()
    china.save(tmp_path / "china" / "china.jpg", quality=95)
    (tmp_path / "flower" / "sub").mkdir(parents=True)
    flower.convert("L").save(tmp_path / "flower" / "sub" / "flower.png")
    return {"train": train, "china": tmp_path / "china", "flower": tmp_path / "flower"}


def _rejects(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "rejects.jsonl").read_text().splitlines()]


def test_rejects_and_info_name_each_near_duplicate(sets, tmp_path):
    out = tmp_path / "out"
    s = prep(sets["train"], out, exclude_near=[str(sets["china"]), str(sets["flower"])], **KW)
    assert s["samples_written"] == 8 and s["rejects_by_reason"] == {"near_duplicate": 2}
    got = {r["path"]: r for r in _rejects(out)}
    assert set(got) == {"c0/china_copy.jpg", "c1/flower_copy.png"}
    china, flower = got["c0/china_copy.jpg"], got["c1/flower_copy.png"]
    assert china["of"] == f"{sets['china']}/china.jpg" and flower["of"] == f"{sets['flower']}/sub/flower.png"
    assert 0 <= china["distance"] <= 12 and 0 <= flower["distance"] <= 12
    assert china["reason"] == "near_duplicate" and "bits apart" in china["detail"]
    info = json.loads((out / "_info.json").read_text())
    block = info["decontaminated"]
    assert block["signature"] == "phash-dct-64+thumbs-448" and block["version"] == 5 and block["threshold"] == 12
    assert [(a["address"], a["images"], a["rejected"], a["duplicated"]) for a in block["against"]] == [
        (str(sets["china"]), 1, 1, 1), (str(sets["flower"]), 1, 1, 1)]
    assert block["rejected"] == 2 and all(len(a["digest"]) == 16 for a in block["against"])
    # without the exclusion every image is written
    assert prep(sets["train"], tmp_path / "plain", **KW)["samples_written"] == 10


def test_a_rerun_with_another_test_set_remakes_the_shards(sets, tmp_path):
    out = tmp_path / "out"
    first = prep(sets["train"], out, exclude_near=[str(sets["china"])], **KW)
    again = prep(sets["train"], out, exclude_near=[str(sets["china"])], **KW)
    assert again["shards_written"] == 0 and again["plan_id"] == first["plan_id"]
    other = prep(sets["train"], out, exclude_near=[str(sets["flower"])], **KW)
    assert other["plan_id"] != first["plan_id"] and other["shards_written"] == other["shards_total"]
    assert [r["path"] for r in _rejects(out)] == ["c1/flower_copy.png"]
    # the same bytes as a fresh prep against that test set
    prep(sets["train"], tmp_path / "fresh", exclude_near=[str(sets["flower"])], **KW)
    assert tree_bytes(out) == tree_bytes(tmp_path / "fresh")
    tighter = prep(sets["train"], out, exclude_near=[str(sets["flower"])], near_threshold=3, **KW)
    assert tighter["plan_id"] != other["plan_id"] and tighter["shards_written"] == tighter["shards_total"]
    assert json.loads((out / "_info.json").read_text())["decontaminated"]["threshold"] == 3


def test_prep_outputs_and_manifests_as_test_sets(sets, tmp_path):
    china, flower = _photos()
    imgs = tmp_path / "bench"
    for split, im in (("test", china), ("val", flower)):
        (imgs / split).mkdir(parents=True)
        im.save(imgs / split / f"{split}.jpg", quality=95)
    (imgs / "labels.csv").write_text("path,label,split\ntest/test.jpg,a,test\nval/val.jpg,b,val\n")
    bench = tmp_path / "bench_prep"
    prep(imgs / "labels.csv", bench, split_column="split", **KW)
    # a prep output: its test split by default, the chosen ones with exclude_near_splits
    prep(sets["train"], tmp_path / "o1", exclude_near=[str(bench)], **KW)
    assert [r["path"] for r in _rejects(tmp_path / "o1")] == ["c0/china_copy.jpg"]
    assert _rejects(tmp_path / "o1")[0]["of"].startswith(f"{bench}/")
    prep(sets["train"], tmp_path / "o2", exclude_near=[str(bench)], exclude_near_splits="test,val", **KW)
    assert sorted(r["path"] for r in _rejects(tmp_path / "o2")) == ["c0/china_copy.jpg", "c1/flower_copy.png"]
    # a manifest: its path column
    prep(sets["train"], tmp_path / "o3", exclude_near=[str(imgs / "labels.csv")], **KW)
    assert {r["of"] for r in _rejects(tmp_path / "o3")} == {f"{imgs}/labels.csv/test/test.jpg",
                                                            f"{imgs}/labels.csv/val/val.jpg"}


def run_vitp(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "launch.cli", *map(str, args)], cwd=REPO, capture_output=True,
                          text=True, timeout=300)


def test_bad_test_sets_are_one_line_before_any_work(sets, tmp_path):
    (tmp_path / "empty").mkdir()
    out = tmp_path / "out"
    cases = [
        (["--exclude-near", tmp_path / "nope"], f"error: --exclude-near {tmp_path / 'nope'}: not found"),
        (["--exclude-near", tmp_path / "empty"], f"error: --exclude-near {tmp_path / 'empty'}: no test images found"),
        (["--exclude-near", sets["china"], "--near-threshold", "25"], "error: --near-threshold: must be <= 24; got 25"),
        (["--exclude-near-splits", "test"], "error: --exclude-near-splits: given without --exclude-near"),
    ]
    for args, line in cases:
        r = run_vitp("prep", sets["train"], out, "--no-progress", *args)
        assert (r.returncode, r.stderr.strip()) == (2, line), r.stderr
        assert not out.exists()


def test_test_sets_at_s3_and_http_addresses(sets, s3_bucket, http_folder, tmp_path):
    """A folder in a bucket; over HTTP (where a folder cannot be listed) a prep output and a manifest."""
    import boto3

    bucket = s3_bucket.removeprefix("s3://")
    s3 = boto3.client("s3")
    s3.upload_file(str(sets["china"] / "china.jpg"), bucket, "tests/china/china.jpg")
    prep(sets["train"], tmp_path / "o_s3", exclude_near=[f"{s3_bucket}/tests/china"], **KW)
    rejects = _rejects(tmp_path / "o_s3")
    assert [(r["path"], r["of"]) for r in rejects] == [("c0/china_copy.jpg", f"{s3_bucket}/tests/china/china.jpg")]

    site = tmp_path / "site"
    (site / "flower" / "b").mkdir(parents=True)
    (sets["flower"] / "sub" / "flower.png").rename(site / "flower" / "b" / "flower.png")
    (site / "flower" / "list.csv").write_text("path,label\nb/flower.png,b\n")
    prep(site / "flower" / "list.csv", site / "flower_prep", split_column=None, **KW)
    base = http_folder(site)
    for test, of in ((f"{base}/flower_prep", f"{base}/flower_prep/"), (f"{base}/flower/list.csv",
                                                                       f"{base}/flower/list.csv/b/flower.png")):
        out = tmp_path / f"o_http{len(of)}"
        prep(sets["train"], out, exclude_near=[test], **KW)
        assert [r["path"] for r in _rejects(out)] == ["c1/flower_copy.png"]
        assert _rejects(out)[0]["of"].startswith(of)


def test_contact_sheet_and_the_dataset_profile(sets, tmp_path):
    """near_duplicates.png shows each dropped image beside its test image; a run's MLflow dataset
    input carries the decontaminated block in its profile."""
    from pipeline.data import dataset_inputs

    out = tmp_path / "out"
    prep(sets["train"], out, exclude_near=[str(sets["china"]), str(sets["flower"])], **KW)
    sheet = Image.open(out / "near_duplicates.png")
    assert sheet.height >= 2 * 112  # two rows
    a = np.asarray(sheet.convert("RGB"))
    right = a[20:132, 128:240]  # row 1's test image: a picture, not the grey square of a missing one
    assert right.std() > 10
    profile = json.loads(dataset_inputs(str(out), {"train": "training"})[0]["profile"])
    assert profile["decontaminated"]["rejected"] == 2
    assert [x["rejected"] for x in profile["decontaminated"]["against"]] == [1, 1]
    prep(sets["train"], tmp_path / "plain", **KW)
    assert not (tmp_path / "plain" / "near_duplicates.png").exists()
    assert "decontaminated" not in json.loads(dataset_inputs(str(tmp_path / "plain"), {"train": "x"})[0]["profile"])


def test_distinct_test_images_with_a_duplicate_are_counted_apart(sets, tmp_path):
    """Two training copies of one test image: two training images rejected, one test image duplicated
    (the count BiT reports per test set)."""
    china, _ = _photos()
    ImageOps.mirror(china).save(sets["train"] / "c1" / "china_again.png")
    s = prep(sets["train"], tmp_path / "out", exclude_near=[str(sets["china"])], **KW)
    (block,) = s["decontaminated"]["against"]
    assert (block["rejected"], block["duplicated"], s["decontaminated"]["rejected"]) == (2, 1, 2)
