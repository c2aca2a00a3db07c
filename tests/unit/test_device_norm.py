"""DeepSpeed's gradient norm and clip without host reads (pipeline/train/device_norm.py, installed by
engine.py): the same numbers as DeepSpeed's own functions, with no ``bool()`` of a tensor and no
``torch.tensor(number, device=...)`` on the way."""

from __future__ import annotations

import importlib
import math
from types import SimpleNamespace

import pytest
import torch

from pipeline.train import device_norm
from pipeline.train import engine as eng


@pytest.fixture
def no_host_reads(monkeypatch):
    """Inside the test body a bool() of a tensor or a scalar made with a device raises."""
    def refuse_bool(self):
        raise AssertionError("bool() of a tensor: a host read")

    tensor = torch.tensor

    def refuse_scalar(data, *args, **kwargs):
        if kwargs.get("device") is not None and isinstance(data, (int, float)):
            raise AssertionError("torch.tensor(number, device=...): a host-to-device copy")
        return tensor(data, *args, **kwargs)

    def arm():
        monkeypatch.setattr(torch.Tensor, "__bool__", refuse_bool)
        monkeypatch.setattr(torch, "tensor", refuse_scalar)
    return arm


def test_mask_nonfinite_fills_with_the_number(no_host_reads):
    x = torch.tensor([2.0, math.inf, -math.inf, math.nan])
    no_host_reads()
    for i in range(4):
        v = x[i].clone()
        device_norm.mask_nonfinite(v, device="cpu")
        assert v.item() == [2.0, -1.0, -1.0, -1.0][i]


@pytest.mark.parametrize("norm", [0.5, 3.0, math.inf])
def test_clip_by_global_norm_scales_as_deepspeed_does(no_host_reads, norm):
    utils = importlib.import_module("deepspeed.runtime.utils")
    grads = [torch.randn(5, 3, generator=torch.Generator().manual_seed(i)).to(torch.bfloat16) for i in range(2)]
    theirs, ours = [g.clone() for g in grads], [g.clone() for g in grads]
    utils.clip_tensors_by_global_norm(theirs, max_norm=1.0, global_norm=torch.tensor(norm))
    n = torch.tensor(norm)
    no_host_reads()
    assert device_norm.clip_by_global_norm(ours, max_norm=1.0, global_norm=n) is n
    assert all(torch.equal(a, b) for a, b in zip(theirs, ours))  # x * 1.0 is x: bit for bit below the bound


@pytest.mark.parametrize("norm", [0.25, 4.0, -1.0, math.nan, math.inf])
def test_zero_clip_on_the_device_equals_deepspeeds_clip(no_host_reads, norm):
    """ZeRO-1/2's unscale_and_clip_grads as installed: the same gradients for a valid norm, DeepSpeed's
    -1 sentinel, NaN and inf, and the module's check put back afterwards."""
    eng._deepspeed()
    zero12 = importlib.import_module("deepspeed.runtime.zero.stage_1_and_2")
    clip = zero12.DeepSpeedZeroOptimizer.unscale_and_clip_grads
    original = clip.__wrapped__
    opt = SimpleNamespace(clip_grad=1.0, loss_scale=1.0, device="cpu")
    grad = torch.randn(7, generator=torch.Generator().manual_seed(0))
    theirs, ours = grad.clone(), grad.clone()
    original(opt, [theirs], torch.tensor(norm))
    check = zero12.is_invalid_grad_norm
    n = torch.tensor(norm)
    no_host_reads()
    clip(opt, [ours], n)
    assert torch.equal(theirs, ours), (theirs, ours)
    assert zero12.is_invalid_grad_norm is check


def test_engine_installs_them_where_deepspeed_looks():
    eng._deepspeed()
    utils = importlib.import_module("deepspeed.runtime.utils")
    zero12 = importlib.import_module("deepspeed.runtime.zero.stage_1_and_2")
    zero3 = importlib.import_module("deepspeed.runtime.zero.stage3")
    bf16 = importlib.import_module("deepspeed.runtime.bf16_optimizer")
    assert utils.mask_nan_or_inf_with_val_inplace is zero12.mask_nan_or_inf_with_val_inplace \
        is zero3.mask_nan_or_inf_with_val_inplace is device_norm.mask_nonfinite
    assert bf16.clip_tensors_by_global_norm.func is device_norm.clip_by_global_norm
    assert zero12.DeepSpeedZeroOptimizer.unscale_and_clip_grads.__wrapped__.__module__ == zero12.__name__


def test_zero3_norm_fill_is_made_on_the_device(no_host_reads):
    """ZeRO-3's get_grad_norm_direct runs with its module's torch.tensor(number, device=...) made a fill:
    the same value and dtype, other calls of torch.tensor as they were, the module's torch put back."""
    eng._deepspeed()
    zero3 = importlib.import_module("deepspeed.runtime.zero.stage3")
    assert zero3.DeepSpeedZeroOptimizer_Stage3.get_grad_norm_direct.fills_on_device
    module = SimpleNamespace(torch=torch)

    def sentinel_and_list():
        return module.torch.tensor(-1.0, device="cpu", dtype=torch.float), module.torch.tensor([1.0, 2.0])
    filled = device_norm.fill_on_device(sentinel_and_list, module)
    no_host_reads()
    fill, listed = filled()
    assert fill.dtype == torch.float and fill.shape == () and torch.equal(fill, torch.tensor(-1.0))
    assert torch.equal(listed, torch.tensor([1.0, 2.0]))
    assert module.torch is torch
