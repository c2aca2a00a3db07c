"""Training over a prep output that `vitp decontam` checked after the fact: the run's epochs are the cut
split's (the listed samples are never read), and SIGKILL of a rank mid-epoch then resume gives the
uninterrupted run's losses, weights and `excluded` counts exactly (2 ranks, 2 loader workers each)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest

from tests.data_prep_fixtures import jpeg_bytes, natural_image
from tests.integration.test_pretrain import (
    CLASSES,
    ROOT,
    assert_same_weights,
    loader_state,
    losses,
    metrics,
    pretrain,
)


@pytest.fixture(scope="module")
def cut_shards(tmp_path_factory) -> list[str]:
    """test_pretrain's 200 images (160 train in 5 shards of 32), then `vitp decontam` against a test set
    holding copies of 8 of the training images: 152 left, 4 steps of 32 an epoch."""
    root = tmp_path_factory.mktemp("decontam_train")
    rng = np.random.default_rng(0)
    for i in range(200):
        c = i % len(CLASSES)
        img = natural_image(rng, int(rng.integers(36, 56)), int(rng.integers(36, 56)))
        img[..., c % 3] = np.maximum(img[..., c % 3], 60 * (c + 1))
        (root / "images" / CLASSES[c]).mkdir(parents=True, exist_ok=True)
        (root / "images" / CLASSES[c] / f"{i:03d}.jpg").write_bytes(jpeg_bytes(img))
    out = root / "shards"
    run = [sys.executable, "-m", "launch.cli"]
    r = subprocess.run([*run, "prep", str(root / "images"), str(out), "--val-fraction", "0.2",
                        "--max-samples-per-shard", "32", "--no-progress"], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    (root / "test").mkdir()
    picked = sorted((root / "images").rglob("*.jpg"))[::25]  # 8 images, of train or val
    for p in picked:
        shutil.copy(p, root / "test" / f"{p.parent.name}_{p.name}")
    r = subprocess.run([*run, "decontam", str(out), "--exclude-near", str(root / "test")], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads((out / "_exclude.json").read_text())
    assert doc["excluded"] == len(picked) == doc["against"][0]["duplicated"]
    kept = 160 - sum(s["split"] == "train" for s in doc["samples"])
    assert kept // 32 == 4, kept  # an epoch is 4 steps, not 5
    return [f"data.path={out}", "data.workers=2"]


@pytest.mark.slow  # three tiny 2-rank runs: ~90 s
def test_kill_and_resume_over_the_cut_split_is_bit_exact(tiny_reference, cut_shards, tmp_path):
    ref = tiny_reference(2, cut_shards)  # the uninterrupted 6-step run over the same data
    st = loader_state(ref / "checkpoints/step-00000004", 0)
    assert (st["epoch"], st["step"]) in {(1, 0), (0, 4)}  # 4 steps an epoch: the cut one
    # inline saves: the kill before step 3 must find step 2's checkpoint published, not still being written
    rc = pretrain(tmp_path, "engine.zero_stage=2", "checkpoint.async=false", env={"VITP_TEST_KILL_AT_STEP": "3"},
                  data=cut_shards)
    assert rc != 0 and losses(tmp_path).keys() == {1, 2}
    st = loader_state(tmp_path / "checkpoints/step-00000002", 1)
    assert (st["epoch"], st["step"], st["workers"], st["world_size"]) == (0, 2, 2, 2)  # mid-epoch
    assert pretrain(tmp_path, "engine.zero_stage=2", data=cut_shards) == 0
    assert [r["step"] for r in metrics(tmp_path) if "loss" in r] == [1, 2, 3, 4, 5, 6]
    assert losses(tmp_path) == losses(ref)
    assert_same_weights(tmp_path, ref)
    # the records count rank 0's left-out samples beside the bad ones: the resumed run carries the count
    # on from its checkpoint, step for step as the uninterrupted run counted them
    counted = [(r["step"], r["skipped"], r["excluded"]) for r in metrics(ref) if "loss" in r]
    assert [(r["step"], r["skipped"], r["excluded"]) for r in metrics(tmp_path) if "loss" in r] == counted
    assert counted[-1][1] == 0 and 0 < counted[-1][2] <= 16  # 8 listed, 1.5 epochs
