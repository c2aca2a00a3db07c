"""Which patches each training image keeps (model.patch_drop, train.patch_drop_until).

Every micro batch of every step draws its own kept patches, per image, from a generator seeded by
(seed, rank, step, micro batch): the draw depends on nothing but those four numbers, so a resumed run
draws exactly what the uninterrupted run drew, with no state to checkpoint, and the run's other
randomness (dropout, stochastic depth, augmentation) is untouched. The generator lives on the training
device: the indices never cross host <-> device.

Only the training forward asks for it; evaluation, few-shot evaluators, export and transfer call the
model without ``keep`` and see every patch.
"""

from __future__ import annotations

import hashlib

import torch

from pipeline.model.vit import draw_keep, kept_patches


class PatchDrop:
    """``keep(step, micro, batch)`` -> [batch, K] patch indices for the training forward, or None
    (off, or past train.patch_drop_until). ``step`` counts completed optimizer steps (0 for the first)."""

    def __init__(self, model: torch.nn.Module, *, drop: float, until: int | None, seed: int, rank: int,
                 device: torch.device):
        """``drop``: model.patch_drop; ``until``: train.patch_drop_until; ``seed``: the run's seed."""
        self.drop = float(drop)
        self.until = until
        self.seed, self.rank = int(seed), rank
        gh, gw = model.patch_grid if self.drop else (0, 0)  # any model trains with patch dropping off
        self.num_patches = gh * gw
        self.kept = kept_patches(self.num_patches, self.drop) if self.drop else self.num_patches
        self.generator = torch.Generator(device=device) if self.drop else None

    def active(self, step: int) -> bool:
        """Whether the step after ``step`` completed ones drops patches."""
        return self.drop > 0 and (self.until is None or step < self.until)

    def keep(self, step: int, micro: int, batch: int) -> torch.Tensor | None:
        if not self.active(step):
            return None
        key = f"patch_drop/{self.seed}/{self.rank}/{step}/{micro}".encode()
        self.generator.manual_seed(int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little"))
        return draw_keep(batch, self.num_patches, self.drop, self.generator)

    def describe(self) -> str:
        """One line for the run's start, e.g. 'patch drop 0.5: 98 of 196 patches until step 9500'."""
        if not self.drop:
            return "patch drop off"
        until = f" until step {self.until}" if self.until is not None else ""
        return f"patch drop {self.drop:g}: {self.kept} of {self.num_patches} patches{until}"
