"""data_prep.schema: the one `_info.json` schema (round trip, old and foreign layouts, one-line errors
naming the file and key, the same message through every reader), the one IMAGE_EXTS, and
pipeline.files.atomic_write under concurrent writers."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from PIL import Image

from data_prep.schema import IMAGE_EXTS, DatasetInfo, SchemaError, SplitShards
from pipeline.files import atomic_write

ROOT = Path(__file__).resolve().parents[2]

# what `vitp prep` wrote before the schema class existed (format_version 1), byte for byte
PREP_V1 = {
    "classes": ["cat", "dog"], "format_version": 1, "image_options": {"quality": 90}, "multi_label": False,
    "num_classes": 2, "num_inputs": 7, "num_rejects": 1, "plan_id": "0123456789abcdef",
    "rejects_by_reason": {"too_small": 1}, "seed": 0,
    "splits": {"train": {"filenames": ["train-000000.tar", "train-000001.tar"], "name": "train", "num_samples": 5,
                         "shard_lengths": [3, 2]},
               "val": {"filenames": ["val-000000.tar"], "name": "val", "num_samples": 1, "shard_lengths": [1]}},
}


def test_prep_layout_round_trips_byte_for_byte():
    text = json.dumps(PREP_V1, indent=1, sort_keys=True, ensure_ascii=False) + "\n"
    info = DatasetInfo.from_json(text, "x/_info.json")
    assert info.splits["train"] == SplitShards("train", ("train-000000.tar", "train-000001.tar"), (3, 2), 5)
    assert info.num_classes == 2 and info.classes == ("cat", "dog") and info.num_rejects == 1
    assert info.digest == "0123456789abcdef"  # the plan id names the content
    assert info.to_json() == text
    assert DatasetInfo.from_json(info.to_json()) == info


def test_foreign_and_partial_descriptions_still_read(tmp_path):
    # timm-style, no classes, no lengths: classes come from classes.json, lengths stay unknown
    (tmp_path / "_info.json").write_text(json.dumps({"splits": {"train": {"filenames": ["a.tar", "b.tar"]}}}))
    (tmp_path / "classes.json").write_text(json.dumps(["a", "b", "c"]))
    info = DatasetInfo.read(tmp_path)
    sp = info.splits["train"]
    assert sp.shard_lengths is None and sp.num_samples is None and sp.filenames == ("a.tar", "b.tar")
    assert info.classes is None and info.class_names(tmp_path) == ("a", "b", "c")
    assert info.count_of_classes(tmp_path) == 3 and not info.multi_label
    assert len(info.digest) == 16  # no plan id: a hash of the text
    # lengths without num_samples: their sum
    info = DatasetInfo.from_dict({"num_classes": 4, "splits": {"t": {"filenames": ["a"], "shard_lengths": [9]}}})
    assert info.splits["t"].num_samples == 9 and info.count_of_classes(tmp_path) == 4


@pytest.mark.parametrize("doc, key", [
    ({"splits": {"train": {"filenames": ["a.tar"], "shard_lengths": [3, "x"]}}}, "splits.train.shard_lengths[1]"),
    ({"splits": {"train": {"filenames": "a.tar"}}}, "splits.train.filenames"),
    ({"splits": {"train": {"filenames": [7]}}}, "splits.train.filenames[0]"),
    ({"splits": {"train": {"num_samples": -1}}}, "splits.train.num_samples"),
    ({"splits": {"train": []}}, "splits.train"),
    ({"splits": ["train"]}, "splits"),
    ({"splits": {}, "num_classes": "10"}, "num_classes"),
    ({"splits": {}, "multi_label": "yes"}, "multi_label"),
    ({"splits": {}, "classes": "cat,dog"}, "classes"),
    ({"splits": {}, "rejects_by_reason": {"too_small": 1.5}}, "rejects_by_reason.too_small"),
    ([1, 2], "top level"),
])
def test_a_wrong_type_is_one_line_naming_file_and_key(tmp_path, doc, key):
    (tmp_path / "_info.json").write_text(json.dumps(doc))
    with pytest.raises(SchemaError) as e:
        DatasetInfo.read(tmp_path)
    msg = str(e.value)
    assert msg.startswith(f"{tmp_path}/_info.json: {key}: expected ") and "\n" not in msg


def test_every_reader_reports_a_malformed_info_the_same_way(tmp_path):
    from data_prep.checks import verify
    from pipeline.data import DataError, check_splits
    from pipeline.data.shards import read_info

    (tmp_path / "_info.json").write_text(json.dumps({"splits": {"train": {"filenames": ["a.tar"],
                                                                          "shard_lengths": ["3"]}}}))
    (tmp_path / "classes.json").write_text("[]")
    line = f"{tmp_path}/_info.json: splits.train.shard_lengths[0]: expected an integer >= 0, got '3'"
    with pytest.raises(DataError) as e:
        read_info(tmp_path)
    assert str(e.value) == line
    with pytest.raises(DataError) as e:
        check_splits(tmp_path, {"data.train_split": "train"})
    assert str(e.value) == f"data.path: {line}"
    assert verify(tmp_path) == [line]
    (tmp_path / "_info.json").write_text('{"splits": {')
    with pytest.raises(DataError, match=r"_info.json: not valid JSON \(Expecting"):
        read_info(tmp_path)
    r = subprocess.run([sys.executable, "-m", "launch.cli", "verify", str(tmp_path)], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and r.stdout.startswith(f"{tmp_path}/_info.json: not valid JSON (Expecting")


def test_image_exts_are_one_set_that_pillow_decodes(tmp_path):
    """Prep's inputs, the loader's image members and verify's all use this set: each extension is one
    Pillow opens (the loader decodes every non-JPEG with Pillow), shown by a round trip."""
    from data_prep import checks, sources
    from pipeline.data import shards

    assert sources.IMAGE_EXTS is checks.IMAGE_EXTS is shards.IMAGE_EXTS is IMAGE_EXTS
    registered = Image.registered_extensions()
    for ext in sorted(IMAGE_EXTS):
        fmt = registered[f".{ext}"]
        assert fmt in Image.OPEN, ext
        p = tmp_path / f"im.{ext}"
        Image.new("RGB", (9, 7), (200, 30, 60)).convert("1" if ext == "pbm" else "L" if ext == "pgm" else "RGB").save(p)
        with Image.open(p) as im:
            assert im.convert("RGB").size == (9, 7), ext


WRITER = """
import sys
from pipeline.files import atomic_write
who, n = sys.argv[1], int(sys.argv[2])
for i in range(n):
    atomic_write(sys.argv[3], (who + ":" + str(i) + ":").encode() * 20000)
"""


def _whole(data: bytes) -> bool:
    """One writer's complete version: the same 'who:i:' piece 20000 times."""
    piece = data[: data.index(b":", data.index(b":") + 1) + 1]
    return len(data) == 20000 * len(piece) and data == piece * 20000


def test_atomic_write_with_concurrent_writers_leaves_one_whole_version(tmp_path):
    target = tmp_path / "out.json"
    # threads of one process (two ranks' helper threads, a tracker thread) ...
    errors = []

    def write(w: int) -> None:
        try:
            for i in range(40):
                atomic_write(target, (f"t{w}:{i}:" * 20000).encode())
        except Exception as e:  # a writer that fails is a failure of the test, not a silent thread death
            errors.append(e)

    threads = [threading.Thread(target=write, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    seen = []
    while any(t.is_alive() for t in threads):
        if target.exists():
            seen.append(target.read_bytes())
    for t in threads:
        t.join()
    assert errors == []
    assert all(_whole(d) for d in seen + [target.read_bytes()])
    # ... and processes (SLURM array tasks finalizing one prep, ranks of one run)
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, f"p{w}", "40", str(target)], cwd=ROOT,
                              stderr=subprocess.PIPE, text=True) for w in range(3)]
    while any(p.poll() is None for p in procs):
        if target.exists():
            seen.append(target.read_bytes())
    assert [p.wait() for p in procs] == [0, 0, 0], [p.stderr.read() for p in procs]
    assert all(_whole(d) for d in seen) and target.read_bytes()[:1] == b"p" and _whole(target.read_bytes())
    assert [p.name for p in tmp_path.iterdir()] == ["out.json"]  # no temporary file left behind
