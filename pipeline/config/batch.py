"""The batch layout, once: how a global batch splits over ranks and micro batches (torch-free).

    BatchLayout(global_batch=G, micro_batch=B, world_size=W)
        .accumulation   G / (W x B)  micro batches per rank and optimizer step
        .per_rank       G / W        images per rank and optimizer step
    BatchLayout.of(cfg.train, world_size)
    BatchLayout.planned(cfg.train, world_size)   the same arithmetic, no check: `vitp plan` reports
                                                 layouts that do not split (floored, as DeepSpeed would)

Every place that needs the accumulation or checks the split asks this type (the config's world check,
DeepSpeed's generated config, the data loaders, `vitp plan`), so the arithmetic and its one-line error
live here only. Which world size: :func:`pipeline.config.stages.world_size_from_env` (a launcher's, from
pipeline/world.py, the one reader of rank and world variables; else the planned one) or
``cfg.world_size_planned``.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.config.sections import ConfigError


@dataclass(frozen=True)
class BatchLayout:
    global_batch: int
    micro_batch: int
    world_size: int
    exact: bool = True  # False: a layout that need not split (the plan's what-if); its numbers are floored

    def __post_init__(self):
        if self.world_size < 1:
            raise ConfigError(f"world size must be >= 1; got {self.world_size}")
        if self.micro_batch < 1 or self.exact and self.global_batch % (self.world_size * self.micro_batch):
            raise ConfigError(f"train.global_batch: {self.global_batch} is not divisible by world size "
                              f"{self.world_size} x train.micro_batch {self.micro_batch}")

    @classmethod
    def of(cls, train_cfg, world_size: int) -> BatchLayout:
        """The layout of a ``train`` section on ``world_size`` ranks (ConfigError when it does not split)."""
        return cls(int(train_cfg.global_batch), int(train_cfg.micro_batch), int(world_size))

    @classmethod
    def planned(cls, train_cfg, world_size: int) -> BatchLayout:
        """The layout `vitp plan` weighs: like :meth:`of`, but a global batch that does not split is
        allowed (the plan reports it as invalid beside its numbers instead of refusing to plan)."""
        return cls(int(train_cfg.global_batch), int(train_cfg.micro_batch), int(world_size), exact=False)

    @property
    def accumulation(self) -> int:
        """Micro batches per rank and optimizer step (0 for a plan whose micro batch exceeds the per-rank batch)."""
        return self.global_batch // (self.world_size * self.micro_batch)

    @property
    def per_rank(self) -> int:
        return self.global_batch // self.world_size
