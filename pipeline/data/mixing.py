"""Mixup / CutMix / label smoothing: labels → the training targets, on the device, after normalize.

Not part of any loader: the training step calls it on every micro-batch, whatever the source, with
the loader's :attr:`~pipeline.data.source.TrainBatches.position` as the seed::

    mixer = Mixer(info.num_classes, d.mixup, d.cutmix, d.label_smoothing, multi_label=info.multi_label,
                  seed=cfg.seed, rank=rank)                   # d = cfg.data, info = the dataset's
    for images, labels in loader.forever():
        x = normalize(images.to(dev))                          # [B, 3, S, S] float
        x, targets = mixer(x, labels.to(dev), loader.position)  # [B, K] float, or labels as they are

Randomness comes from ``(seed, epoch, micro-batch, rank)`` only, so a resumed run mixes exactly as
the uninterrupted one and two ranks never draw the same mix.
"""

from __future__ import annotations

import numpy as np
import torch


class Mixer:
    """``__call__(x [B, 3, H, W] float, y, position) -> (x, targets)``.

    ``y``: labels int64 [B], or multi-hot [B, K] (bool or float) when ``multi_label``. With mixup or
    cutmix on (timm's Mixup: per batch one of the two, lam ~ Beta(alpha, alpha), cutmix's lam
    corrected to the pasted box's area) the batch is blended with its mirror (row i with row B-1-i)
    and targets are ``lam·t + (1-lam)·t[flipped]`` of the smoothed one-hot rows t [B, K] float32;
    B must be even. With only smoothing, targets are the smoothed rows. With neither, ``(x, y)``
    come back as they are and the loss takes the labels (no [B, K] tensor per step).

    Multi-label rows are combined the same way; smoothing treats every class as its own binary
    label and moves it towards 0.5 (y·(1-s) + s/2), timm's multi-label convention, made for the
    per-class sigmoid loss (the softmax loss normalises each row into a distribution).
    """

    def __init__(self, num_classes: int, mixup: float = 0.0, cutmix: float = 0.0, label_smoothing: float = 0.0,
                 multi_label: bool = False, *, seed: int = 0, rank: int = 0):
        self.num_classes, self.smoothing = int(num_classes), float(label_smoothing)
        self.multi_label = bool(multi_label)
        self.seed, self.rank = int(seed), int(rank)
        self.mixing = mixup > 0 or cutmix > 0
        self._mix = None
        if self.mixing:
            from timm.data import Mixup

            self._mix = Mixup(mixup_alpha=mixup, cutmix_alpha=cutmix, label_smoothing=label_smoothing,
                              num_classes=self.num_classes, multi_label=self.multi_label)

    @property
    def active(self) -> bool:
        """False when the targets are the labels themselves (no mixing, no smoothing)."""
        return self.mixing or self.smoothing > 0

    def one_hot(self, y: torch.Tensor) -> torch.Tensor:
        """Labels → smoothed target rows [B, K] float32."""
        if self.multi_label:
            return y.float() * (1.0 - self.smoothing) + 0.5 * self.smoothing
        off = self.smoothing / self.num_classes
        t = torch.full((y.shape[0], self.num_classes), off, device=y.device, dtype=torch.float32)
        return t.scatter_(1, y.view(-1, 1).long(), 1.0 - self.smoothing + off)

    def __call__(self, x: torch.Tensor, y: torch.Tensor, position: tuple[int, int]):
        """``position``: (epoch, micro-batch) of this batch, e.g. the loader's ``position``."""
        if self._mix is None:
            return (x, self.one_hot(y)) if self.smoothing > 0 else (x, y)
        if x.shape[0] % 2:
            raise ValueError(f"mixup/cutmix need an even micro batch; got {x.shape[0]}")
        epoch, step = position
        state = np.random.get_state()  # timm's Mixup draws from numpy's global generator
        np.random.seed(np.random.SeedSequence([self.seed, epoch, step, self.rank, 7]).generate_state(1)[0])
        try:
            x, t = self._mix(x, y)
        finally:
            np.random.set_state(state)
        return x, t.float()
