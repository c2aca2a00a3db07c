"""A fine-tuning run and `vitp eval` straight from a class-per-folder tree (no `vitp prep`), on 2 DeepSpeed
ranks over gloo: killed mid-epoch and resumed, it ends bit-identical to the uninterrupted run; `vitp eval`
of its checkpoint on the tree's test split scores each test image once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from launch.local import run_local
from pipeline.model import build_vit
from pipeline.weights import save_model
from tests.integration.test_pretrain import assert_same_weights, loader_state, losses
from tests.unit.test_image_folder import make_tree

ROOT = Path(__file__).resolve().parents[2]
FT = str(ROOT / "configs/transfer/tiny_cpu.yaml")
# 24 train images, global batch 8: 3 steps an epoch, so step 4 is the next epoch's first
ARGS = ["model.img_size=16", "train.steps=4", "train.global_batch=8", "train.micro_batch=2", "train.log_every=1",
        "checkpoint.every=2", "checkpoint.keep=3", "schedule.warmup_steps=1", "tracking.enabled=false"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("imagefolder_runs")
    torch.manual_seed(0)
    model = build_vit(width=64, depth=4, heads=4, mlp_dim=128, patch=4, img_size=16, num_classes=5)
    return make_tree(d / "pets"), save_model(model, d / "init.safetensors")


def transfer(run: Path, tree: Path, init: Path, env: dict | None = None, *extra: str) -> int:
    argv = ["transfer", "--config", FT, f"run.dir={run}", f"init.from={init}", f"data.path={tree}", *ARGS, *extra]
    return run_local(argv, 2, env={"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", **(env or {})}, timeout=900)


@pytest.mark.slow
def test_transfer_from_a_folder_killed_and_resumed_is_bit_exact_then_evaluated(setup, tmp_path):
    tree, init = setup
    ref, killed = tmp_path / "ref", tmp_path / "killed"
    assert transfer(ref, tree, init) == 0
    # inline saves: the kill before step 3 must find step 2's checkpoint published, not still being written
    assert transfer(killed, tree, init, {"VITP_TEST_KILL_AT_STEP": "3"}, "checkpoint.async=false") != 0
    assert losses(killed).keys() == {1, 2}
    assert loader_state(killed / "checkpoints/step-00000002", 1) == {"steps": 2, "seed": 0}
    assert transfer(killed, tree, init) == 0
    assert losses(killed) == losses(ref) and sorted(losses(ref)) == [1, 2, 3, 4]
    assert_same_weights(killed, ref)
    res = json.loads((ref / "results.json").read_text())
    assert res["num_classes"] == 3 and res["val/n"] == 6
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    flags = ["--split", "test", "--fewshot", "--shots", "1,2", "--seeds", "1", "--out", str(tmp_path / "eval")]
    r = subprocess.run([sys.executable, "-m", "launch.cli", "eval", "--checkpoint", str(ref), "--data", str(tree),
                        *flags], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads((tmp_path / "eval/results.json").read_text())
    assert got["eval/test/n"] == 6 and 0 <= got["eval/test/top1"] <= 1, got
    assert 0 <= got["eval/fewshot/2shot"] <= 1, got  # few-shot fitted on the folder's train split
