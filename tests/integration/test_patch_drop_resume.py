"""Patch dropping on 2 CPU ranks (DeepSpeed ZeRO-3 over gloo, activation checkpointing, 2 micro batches
a step): a run killed at step 5 and resumed from step 4 equals the uninterrupted run bit for bit,
across the switch to every patch after train.patch_drop_until; MFU counts the tokens computed."""

import pytest
import torch

from pipeline.model import train_step_flops
from pipeline.weights import load_model
from tests.integration.test_pretrain import assert_same_weights, losses, metrics, pretrain

pytestmark = pytest.mark.distributed
SETUP = ["engine.zero_stage=3", "model.grad_checkpointing=true", "train.micro_batch=8"]  # 2 micro batches a step
DROP = ["model.patch_drop=0.5", "train.patch_drop_until=5"]  # steps 1-5 on 32 of 64 patches, step 6 on all


def test_kill_and_resume_with_patch_drop_is_bit_exact(tmp_path):
    ref, run, plain = tmp_path / "ref", tmp_path / "killed", tmp_path / "plain"
    assert pretrain(ref, *SETUP, *DROP) == 0
    assert pretrain(run, *SETUP, *DROP, env={"VITP_TEST_KILL_AT_STEP": "5"}) != 0
    assert losses(run).keys() == {1, 2, 3, 4}
    assert pretrain(run, *SETUP, *DROP) == 0
    assert [r["step"] for r in metrics(run) if "loss" in r] == [1, 2, 3, 4, 5, 6]
    assert losses(run) == losses(ref)
    assert_same_weights(run, ref)

    # the training log says what ran: 0.5 until step 5, then every patch; MFU's FLOPs are those tokens'
    recs = [r for r in metrics(ref) if "loss" in r]
    assert [r["patch_drop"] for r in recs] == [0.5] * 5 + [0.0]
    config = load_model(ref / "model.safetensors").config
    per_rank = 16  # 32 images over 2 ranks
    for r in recs:
        want = train_step_flops(config, batch=per_rank, grad_checkpointing=False, patch_drop=r["patch_drop"])
        assert r["mfu"] * r["step_s"] * 1e12 == pytest.approx(want, rel=1e-9)  # tiny_cpu: peak_tflops 1.0
    assert train_step_flops(config, batch=per_rank, patch_drop=0.5) < 0.55 * train_step_flops(config, batch=per_rank)

    # the same run without dropping learns otherwise (step 1 is ln K in both: the head starts at zero)
    assert pretrain(plain, *SETUP, "train.steps=3") == 0
    a, b = losses(plain), losses(ref)
    assert a[1] == pytest.approx(b[1], rel=1e-6)
    assert abs(a[2] - b[2]) > 1e-5 and abs(a[3] - b[3]) > 1e-5
    assert torch.isfinite(torch.tensor(list(b.values()))).all()
