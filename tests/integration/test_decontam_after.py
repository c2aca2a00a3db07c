"""`vitp decontam OUT --exclude-near TEST`: a prep output made without the test sets is checked after the
fact from the signatures prep stored beside each shard; OUT/_exclude.json lists the near-duplicates and
every loader leaves exactly those out and _info.json's decontaminated block names the sets with the
list's counts; the same sets again change nothing; bad input is one line and
writes nothing; on an S3 output too."""

from __future__ import annotations

import json

import numpy as np

from data_prep import prep, store
from data_prep.near import distance
from data_prep.schema import EXCLUDE_FILE, INFO_FILE
from pipeline.data import dataset_inputs, source_for
from pipeline.data.shards import SkipCounts, read_info, read_positions
from tests.integration.test_prep_decontam import (
    KW,
    run_vitp,
    sets,  # noqa: F401 (the fixture)
)


def _sources(out: str, info=None) -> list[str]:
    """The source path of every sample the loader reads from split train, in order."""
    sp = (info or read_info(out)).splits["train"]
    return [json.loads(store.read_bytes(store.join(out, "_keys.json")))[key]
            for key, _, _ in read_positions(sp, range(sp.num_samples), SkipCounts(), num_classes=2)]


def _key_map(out) -> dict[str, str]:
    """{sample key: its source path} from the json members, written beside OUT for _sources."""
    from data_prep.tar import iter_tar

    info = read_info(out)
    m = {}
    for url in info.splits["train"].urls:
        with store.open_read(url) as f:
            for name, _, read in iter_tar(f, seekable=False):
                if name.endswith(".json"):
                    meta = json.loads(read())
                    m[meta["key"]] = meta["source"]
    return m


def _after_block(out, doc: dict) -> dict:
    """OUT/_info.json's decontaminated block, checked against _exclude.json's ``doc``: prep checked
    nothing, and each of the list's sets is there, marked as checked after prep, with the list's counts."""
    block = json.loads(store.read_file(str(out), INFO_FILE))["decontaminated"]
    assert [{k: a[k] for k in ("address", "images", "digest", "excluded", "duplicated", "splits", "threshold",
                                "signature_version", "by", "exclude_version")} for a in block["against"]] == [
        {**{k: a[k] for k in ("address", "images", "digest", "duplicated")}, "excluded": a["rejected"],
         "splits": doc["splits"], "threshold": doc["threshold"], "signature_version": doc["signature_version"],
         "by": "vitp decontam", "exclude_version": doc["version"]} for a in doc["against"]]
    assert (block["rejected"], block["excluded"]) == (0, doc["excluded"])
    assert sum(a["excluded"] for a in block["against"]) == doc["excluded"]
    return block


def test_decontam_lists_the_copies_and_the_loader_skips_exactly_them(sets, tmp_path):  # noqa: F811
    out = tmp_path / "out"
    prep(sets["train"], out, **KW)
    (out / "_keys.json").write_text(json.dumps(_key_map(out)))
    assert len(_sources(str(out))) == 10
    r = run_vitp("decontam", out, "--exclude-near", sets["china"], "--exclude-near", sets["flower"])
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("vitp decontam: 2 samples excluded ("), r.stdout
    doc = json.loads((out / EXCLUDE_FILE).read_text())
    assert doc["version"] == 1 and doc["excluded"] == 2 and doc["threshold"] == 12
    assert [(a["address"], a["images"], a["rejected"], a["duplicated"]) for a in doc["against"]] == [
        (str(sets["china"]), 1, 1, 1), (str(sets["flower"]), 1, 1, 1)]
    keys = json.loads((out / "_keys.json").read_text())
    assert sorted(keys[s["key"]] for s in doc["samples"]) == ["c0/china_copy.jpg", "c1/flower_copy.png"]
    # the loader: the other 8, in their order; the digest names the cut; the profile shows it
    info = read_info(out)
    left = _sources(str(out), info)
    assert len(left) == 8 and not {"c0/china_copy.jpg", "c1/flower_copy.png"} & set(left)
    assert info.digest.startswith(json.loads((out / "_info.json").read_text())["plan_id"] + "-x")
    block = _after_block(out, doc)
    assert info.decontaminated == block and source_for(str(out)).checked_against() == [
        (str(sets["china"]), None), (str(sets["flower"]), None)]
    profile = json.loads(dataset_inputs(str(out), {"train": "training"})[0]["profile"])
    assert profile["num_samples"] == 8 and profile["excluded"]["excluded"] == 2
    assert profile["decontaminated"] == block
    # the same sets again: the same bytes, of both files
    before = {f: (out / f).read_bytes() for f in (EXCLUDE_FILE, INFO_FILE)}
    assert run_vitp("decontam", out, "--exclude-near", sets["china"], "--exclude-near", sets["flower"]).returncode == 0
    assert {f: (out / f).read_bytes() for f in before} == before
    # another set: its entries replace those of the list before, in both files
    assert run_vitp("decontam", out, "--exclude-near", sets["flower"]).returncode == 0
    doc = json.loads((out / EXCLUDE_FILE).read_text())
    assert doc["excluded"] == 1 and [a["address"] for a in _after_block(out, doc)["against"]] == [str(sets["flower"])]
    # the reader takes the list's sets from the list the loader honours: an _info.json left behind by an
    # interrupted run shows what _exclude.json holds, and deleting the list (undoing it) drops them
    (out / INFO_FILE).write_bytes(before[INFO_FILE])  # as if stopped between writing the two
    assert [a["address"] for a in read_info(out).decontaminated["against"]] == [str(sets["flower"])]
    (out / EXCLUDE_FILE).unlink()
    assert read_info(out).decontaminated is None and source_for(str(out)).checked_against() == []


def test_bad_input_is_one_line_and_writes_nothing(sets, tmp_path):  # noqa: F811
    out = tmp_path / "out"
    prep(sets["train"], out, **KW)
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "x.jpg").write_bytes(b"not an image")
    (tmp_path / "m.csv").write_text("path,label\nchina/china.jpg,a\nnope.jpg,a\n")
    cases = [
        (["--exclude-near", tmp_path / "nope"], f"error: --exclude-near {tmp_path / 'nope'}: not found"),
        (["--exclude-near", tmp_path / "bad"],
         f"error: --exclude-near {tmp_path / 'bad'}/x.jpg: not a readable image (not an image format Pillow knows)"),
        (["--exclude-near", tmp_path / "m.csv"], f"error: --exclude-near {tmp_path / 'm.csv'}: nope.jpg: not found "
                                                "(listed there)"),
        (["--exclude-near", sets["china"], "--near-threshold", "25"],
         "error: --near-threshold: must be in 0..24; got 25"),
    ]
    for args, line in cases:
        r = run_vitp("decontam", out, *args)
        assert (r.returncode, r.stderr.strip()) == (2, line), r.stderr
        assert not (out / EXCLUDE_FILE).exists()
    r = run_vitp("decontam", tmp_path / "nothing", "--exclude-near", sets["china"])
    assert (r.returncode, r.stderr.strip()) == (2, f"error: {tmp_path / 'nothing'}: no _info.json (not a finished "
                                                   "`vitp prep` output)")
    first = sorted(out.glob("*_sig.npz"))[0]
    first.unlink()  # as an output from before prep stored signatures
    r = run_vitp("decontam", out, "--exclude-near", sets["china"])
    assert (r.returncode, r.stderr.strip()) == (2, f"error: {first}: not found: this output was prepared before "
                                                   "prep stored signatures; run the same `vitp prep` again (it "
                                                   "remakes the shards without them) or pass --rehash (decodes "
                                                   "each such shard once)"), r.stderr
    assert not (out / EXCLUDE_FILE).exists()
    # as it says: the rerun remakes that shard alone, and then decontam runs
    again = prep(sets["train"], out, **KW)
    assert (again["shards_written"], first.exists()) == (1, True)
    assert run_vitp("decontam", out, "--exclude-near", sets["china"]).returncode == 0


def test_an_s3_output(sets, s3_bucket, tmp_path):  # noqa: F811
    from data_prep.decontam import decontam

    out = f"{s3_bucket}/ds"
    prep(sets["train"], out, staging_dir=str(tmp_path / "staging"), **KW)
    s = decontam(out, [str(sets["china"])], None, 12)
    assert s["excluded"] == 1 and s["against"][0]["duplicated"] == 1
    doc = json.loads(store.read_file(out, EXCLUDE_FILE))
    assert [x["split"] for x in doc["samples"]] == ["train"]
    info = read_info(out)
    assert info.splits["train"].num_samples == 9 and info.decontaminated == _after_block(out, doc)
    before = {f: store.read_file(out, f) for f in (EXCLUDE_FILE, INFO_FILE)}
    decontam(out, [str(sets["china"])], None, 12)
    assert {f: store.read_file(out, f) for f in before} == before


def test_rehash_makes_the_missing_signatures_and_finds_the_same_copies(sets, tmp_path):  # noqa: F811
    out = tmp_path / "out"
    prep(sets["train"], out, **KW)
    near = ["--exclude-near", sets["china"], "--exclude-near", sets["flower"]]
    assert run_vitp("decontam", out, *near).returncode == 0
    stored = {p.name: np.load(p) for p in sorted(out.glob("*_sig.npz"))}
    listed = json.loads((out / EXCLUDE_FILE).read_text())
    for p in out.glob("*_sig.npz"):  # as an output from before prep stored signatures
        p.unlink()
    (out / EXCLUDE_FILE).unlink()
    r = run_vitp("decontam", out, *near, "--rehash")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("vitp decontam: 2 samples excluded ("), r.stdout
    again = json.loads((out / EXCLUDE_FILE).read_text())
    assert [(s["shard"], s["index"], s["key"], s["of"]) for s in again["samples"]] == \
        [(s["shard"], s["index"], s["key"], s["of"]) for s in listed["samples"]]
    # each shard's signatures again, same keys in the same order; the hashes of the stored (decoded
    # JPEG) pixels within a few bits of those prep took before encoding, the thumbnails a few levels
    remade = {p.name: np.load(p) for p in sorted(out.glob("*_sig.npz"))}
    assert remade.keys() == stored.keys() and len(remade) == 3
    for name, z in remade.items():
        assert list(z["key"]) == list(stored[name]["key"])
        assert max(distance(int(a), int(b)) for a, b in zip(z["hash"], stored[name]["hash"])) <= 4
        assert np.abs(z["thumb"].astype(int) - stored[name]["thumb"]).mean() < 2
    # now an output like any other: a rerun without --rehash changes nothing
    before = (out / EXCLUDE_FILE).read_bytes()
    assert run_vitp("decontam", out, *near).returncode == 0
    assert (out / EXCLUDE_FILE).read_bytes() == before


def test_an_http_output_is_one_line_and_nothing_read(sets, tmp_path, http_folder):  # noqa: F811
    out = tmp_path / "out"
    prep(sets["train"], out, **KW)
    base = http_folder(tmp_path)
    r = run_vitp("decontam", f"{base}/out", "--exclude-near", sets["china"])
    assert (r.returncode, r.stderr.strip()) == (2, f"error: vitp decontam: {base}/out: http(s) addresses are "
                                                   "read-only; write to a folder, s3:// or gs:// (and serve that)")
    assert not (out / EXCLUDE_FILE).exists()
