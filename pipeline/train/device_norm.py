"""DeepSpeed's gradient norm and clip without host reads: replacements that engine.py installs (the
only deepspeed importer); plain torch here.

In a bf16 ZeRO-1/2 step deepspeed 0.19.8 waits on the GPU four times for the norm and the clip (two
parameter groups, pre-training's decay / no-decay), where nothing needs the host:

- ``runtime/utils.py`` ``mask_nan_or_inf_with_val_inplace`` (ZeRO-1/2's ``get_grad_norm_direct``, once
  per group; ZeRO-3; BF16_Optimizer through ``get_global_norm_of_tensors``) builds its fill value as
  ``torch.tensor(-1.0, device=...)``: a host-to-device copy from pageable memory, which waits for the
  stream's earlier work. :func:`mask_nonfinite` fills with the Python number instead.
- ``stage_1_and_2.py`` ``unscale_and_clip_grads`` (once per group) asks ``is_invalid_grad_norm``, a
  ``bool()`` of a device tensor, to replace an invalid norm by inf (then by ``torch.tensor(inf,
  device=...)``, another copy). :func:`clip_on_device` makes that replacement on the device first and
  runs DeepSpeed's method with a check that no longer needs to read: what it would have replaced is inf.
- ``stage3.py`` ``get_grad_norm_direct`` (ZeRO-3) builds the same fill inline, ``torch.tensor(-1.0,
  device=self.device)``: :func:`fill_on_device` runs it with ``torch.tensor`` of a number on a device made
  a fill kernel (``torch.full``), which copies nothing.
- ``runtime/utils.py`` ``clip_tensors_by_global_norm`` (BF16_Optimizer, ZeRO-1 under bf16) multiplies
  only ``if clip_coef < 1``, a ``bool()``; :func:`clip_by_global_norm` multiplies by ``min(coef, 1)``:
  the same numbers (x * 1.0 is x), no read.

What stays: ZeRO-3's ``is_invalid_grad_norm`` in its step and BF16_Optimizer's skip, both of a step whose
norm is not finite (the host must know to skip), ZeRO-3's synchronous all-gather of its persistent
(small) parameters after the step, the overflow check of fp32/fp16 models (``stage_1_and_2.py`` step: it
skips the step too), and ZeRO-2/3's ``synchronize()`` after each micro batch's backward under
``overlap_comm`` (DeepSpeed frees the reduced gradients only once the side stream is done with them).
"""

from __future__ import annotations

import contextlib
import functools
import math
import numbers

import torch


def mask_nonfinite(input: torch.Tensor, device=None, val: float = -1.0) -> None:
    """``input``'s inf/NaN entries set to ``val`` in place (DeepSpeed's -1 sentinel), a kernel with a
    number argument: no tensor made on the host. ``device`` is DeepSpeed's argument, unused."""
    del device
    input.masked_fill_(~torch.isfinite(input), val)


def clip_by_global_norm(input_tensors, max_norm: float = 1.0, global_norm=None, mpu=None, eps: float = 1e-6,
                        *, norm_of=None):
    """Scale ``input_tensors`` in place by min(max_norm / (norm + eps), 1) on the device; returns the norm
    (DeepSpeed's ``clip_tensors_by_global_norm`` contract). ``norm_of``: DeepSpeed's
    ``get_global_norm_of_tensors``, for callers that pass no norm."""
    if global_norm is None:
        global_norm = norm_of(input_tensors, mpu=mpu)
    coef = max_norm / (global_norm + eps)
    if not torch.is_tensor(coef):  # a Python number: comparing it reads nothing
        coef = min(coef, 1.0)
    else:
        coef = coef.clamp(max=1.0)
    for t in input_tensors:
        t.detach().mul_(coef)
    return global_norm


def _valid(norm) -> bool:
    return False  # made finite and >= 0, or inf, on the device before DeepSpeed looks


def clip_on_device(unscale_and_clip_grads, module):
    """DeepSpeed's ``unscale_and_clip_grads(self, grad_groups_flat, total_norm)`` with an invalid
    (non-finite or negative) ``total_norm`` replaced by inf on the device, and ``module``'s
    ``is_invalid_grad_norm`` (which would read it on the host to do the same) told it is valid."""

    @functools.wraps(unscale_and_clip_grads)
    def wrapper(self, grad_groups_flat, total_norm):
        if not torch.is_tensor(total_norm):
            return unscale_and_clip_grads(self, grad_groups_flat, total_norm)
        total_norm = torch.where(torch.isfinite(total_norm) & (total_norm >= 0), total_norm, math.inf)
        with _checked(module):
            return unscale_and_clip_grads(self, grad_groups_flat, total_norm)

    return wrapper


@contextlib.contextmanager
def _checked(module):
    """Within the block ``module.is_invalid_grad_norm`` answers without reading (see clip_on_device)."""
    check = module.is_invalid_grad_norm
    module.is_invalid_grad_norm = _valid
    try:
        yield
    finally:
        module.is_invalid_grad_norm = check


class _NumbersFilled:
    """``torch`` as a DeepSpeed module sees it, except ``tensor(number, device=...)``: a 0-d fill on the
    device (a kernel with the number as its argument) instead of a copy from pageable host memory."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def tensor(data, *args, device=None, dtype=None, **kwargs):
        if device is not None and isinstance(data, numbers.Number) and not args and not kwargs:
            return torch.full((), data, device=device, dtype=dtype)
        return torch.tensor(data, *args, device=device, dtype=dtype, **kwargs)


def fill_on_device(method, module):
    """DeepSpeed's ``method`` run with ``module``'s ``torch`` answering ``tensor(number, device=...)`` by a
    fill (:class:`_NumbersFilled`): ZeRO-3's ``get_grad_norm_direct`` and its inline -1 sentinel."""

    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        seen = module.torch
        module.torch = _NumbersFilled()
        try:
            return method(*args, **kwargs)
        finally:
            module.torch = seen

    wrapper.fills_on_device = True
    return wrapper
