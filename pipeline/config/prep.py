"""Prep's one schema: what `vitp prep` and `vitp submit prep` both parse into (data_prep/cli.py makes
each field its flag, ``--field-name``), what `prep()` takes and what an array task of `vitp submit prep`
is handed in its config (:class:`~pipeline.config.prep.PrepConfig`'s ``prep`` section).

Standard library and pydantic only: data_prep imports it (tests/unit/test_import_rules.py).
"""

from __future__ import annotations

import os
from typing import Annotated, Any

from pydantic import BeforeValidator, Field, ValidationInfo, field_validator, model_validator

from pipeline.config.sections import (
    Bool,
    ClusterCfg,
    ConfigError,
    EngineCfg,
    Float,
    HardwareCfg,
    Int,
    Section,
    Str,
    problem,
)
from pipeline.config.stages import StageConfig

DEFAULT_MAX_SAMPLES_PER_SHARD = 5000  # the cap when no --shard-size is given
DEFAULT_MAX_PIXELS = 89_478_485  # PIL's decompression-bomb limit
DEFAULT_PART_SIZE = 64 * 2**20
# Hamming distance between 64-bit perceptual hashes within which a pair is a candidate, then checked by
# thumbnails (data_prep/near.py; bench/decontam.py measures both on real photographs: the README's tables)
DEFAULT_NEAR_THRESHOLD = 12
HASH_BITS = 64
MAX_NEAR_THRESHOLD = 24  # two random 64-bit hashes lie 32 +- 4 bits apart: beyond this, chance matches




def _path_or_names(v):
    """A classes file (str or a path object) or, from Python, the names themselves."""
    if isinstance(v, os.PathLike):
        return os.fspath(v)
    if isinstance(v, (list, tuple)) and all(isinstance(x, str) for x in v):
        return list(v)
    if isinstance(v, str):
        return v
    raise problem(f"--classes: expected a file or a list of names, got {v!r}")


def _names(v):
    """``"test,val"`` or a list: split names, no empty one."""
    items = v.split(",") if isinstance(v, str) else v
    if not isinstance(items, (list, tuple)):
        raise problem(f"expected names separated by commas, got {v!r}")
    return [str(x).strip() for x in items]


def _addresses(v):
    if isinstance(v, (str, os.PathLike)):
        v = [v]
    if not isinstance(v, (list, tuple)):
        raise problem(f"--exclude-near: expected a list of addresses, got {v!r}")
    return [os.fspath(x) if isinstance(x, os.PathLike) else x for x in v]


Classes = Annotated[str | list[str], BeforeValidator(_path_or_names)]
Names = Annotated[list[str], BeforeValidator(_names)]
Addresses = Annotated[list[Str], BeforeValidator(_addresses)]


class PrepCfg(Section):
    """`vitp prep SRC OUT`'s options (their `--help` says each one); ``shard_size`` in bytes."""

    seed: Int = 0
    val_fraction: Float = Field(0.0, ge=0.0, lt=1.0)
    split_column: Str | None = None
    path_column: Str = "path"
    label_column: Str = "label"
    labels_column: Str = "labels"
    classes: Classes | None = None
    shard_size: Int | None = Field(None, gt=0)
    max_samples_per_shard: Int | None = Field(None, gt=0)
    resize_shorter: Int | None = Field(None, gt=0)
    resize_longer: Int | None = Field(None, gt=0)
    quality: Int = Field(90, ge=1, le=100)
    min_size: Int = Field(16, ge=1)
    max_pixels: Int = Field(DEFAULT_MAX_PIXELS, gt=0)
    keep_original: Bool = True
    dedup: Bool = False
    workers: Int = Field(1, ge=1)
    staging_dir: Str | None = None
    part_size: Int = Field(DEFAULT_PART_SIZE, gt=0)
    exclude_near: Addresses = Field(default_factory=list)
    exclude_near_splits: Names | None = None
    near_threshold: Int = Field(DEFAULT_NEAR_THRESHOLD, ge=0, le=MAX_NEAR_THRESHOLD)

    @field_validator("staging_dir", mode="before")
    @classmethod
    def _fspath(cls, v, info: ValidationInfo):
        return os.fspath(v) if isinstance(v, os.PathLike) else v

    @model_validator(mode="after")
    def _combinations(self):
        if self.resize_shorter is not None and self.resize_longer is not None:
            raise problem("--resize-shorter, --resize-longer: give one of them, not both")
        if self.exclude_near_splits is not None:
            if not self.exclude_near:
                raise problem("--exclude-near-splits: given without --exclude-near")
            if not self.exclude_near_splits or not all(self.exclude_near_splits):
                raise problem(f"--exclude-near-splits: an empty split name in {self.exclude_near_splits}")
        if len(set(self.exclude_near)) != len(self.exclude_near):
            raise problem(f"--exclude-near: the same test set twice in {self.exclude_near}")
        return self

    @property
    def samples_cap(self) -> int | None:
        """Samples per shard: the given cap, else 5000 unless a byte size caps the shards."""
        if self.max_samples_per_shard is None and self.shard_size is None:
            return DEFAULT_MAX_SAMPLES_PER_SHARD
        return self.max_samples_per_shard


class PrepConfig(StageConfig):
    """`vitp submit prep`'s array tasks: where they run, and prep's options (the same as `vitp prep`'s)."""

    engine: EngineCfg = Field(default_factory=EngineCfg)
    hardware: HardwareCfg = Field(default_factory=HardwareCfg)
    cluster: ClusterCfg = Field(default_factory=ClusterCfg)
    prep: PrepCfg = Field(default_factory=PrepCfg)


def flag(field: str) -> str:
    """``near_threshold`` -> ``--near-threshold``: how the command line names a field."""
    return "--" + field.replace("_", "-")


def prep_cfg(options: dict[str, Any]) -> PrepCfg:
    """``options`` (field names) as a :class:`PrepCfg`; a mistake is one ConfigError line naming the flag."""
    from pipeline.config.loading import build

    try:
        return build(PrepCfg, dict(options))
    except ConfigError as e:
        text = str(e)
        key = text.split(":", 1)[0].split("[", 1)[0]
        if key in PrepCfg.model_fields:  # the validators' own messages name the flags already
            text = flag(key) + text[len(key):]
        raise ConfigError(text) from None
