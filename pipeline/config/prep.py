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
MAX_NEAR_THRESHOLD = 24  # two random 64-bit hashes lie 32 +- 4 bits apart: beyond this, chance matches
KINDS = ("text", "int", "float", "size", "on", "off", "list")  # how a flag reads its value (data_prep/cli.py)


def option(default: Any, help: str, *, kind: str = "text", flag: str | None = None, metavar: str | None = None,
           group: str | None = None, **checks) -> Any:
    """A field of prep's schema together with its command-line flag (``--field-name`` unless ``flag``):
    ``help`` its --help text (``{default}`` becomes the default); ``kind`` how the flag reads its value
    (text; int; float; size: bytes with a unit, 500MB; on: a switch that sets True; off: ``flag`` sets
    False; list: repeatable); ``group``: flags of one group exclude each other; ``checks``: pydantic's."""
    assert kind in KINDS, kind
    cli = {"kind": kind, "flag": flag, "metavar": metavar, "group": group}
    text = help.format(default=default)
    if kind == "list":
        return Field(default_factory=list, description=text, json_schema_extra={"cli": cli}, **checks)
    return Field(default, description=text, json_schema_extra={"cli": cli}, **checks)


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
    """`vitp prep SRC OUT`'s options, each with its flag, default and --help text (data_prep/cli.py makes
    the flags of both `vitp prep` and `vitp submit prep` from these fields); ``shard_size`` in bytes."""

    seed: Int = option(0, "global shuffle seed (default {default})", kind="int")
    val_fraction: Float = option(0.0, "stratified val split fraction, e.g. 0.01 (default {default:g})", kind="float",
                                 ge=0.0, lt=1.0)
    split_column: Str | None = option(None, "manifest column naming each row's split (instead of --val-fraction)")
    path_column: Str = option("path", "manifest path column (default {default})")
    label_column: Str = option("label", "manifest label column (default {default})")
    labels_column: Str = option("labels", "manifest column of several labels per image; its presence makes the "
                                          "data multi-label (default {default})")
    classes: Classes | None = option(None, "class names in index order: .json list or text file, one per line "
                                           "(default: sorted names)")
    shard_size: Int | None = option(None, "max source bytes per shard, e.g. 500MB", kind="size", gt=0)
    max_samples_per_shard: Int | None = option(
        None, f"max samples per shard (default {DEFAULT_MAX_SAMPLES_PER_SHARD} unless --shard-size is given)",
        kind="int", gt=0)
    resize_shorter: Int | None = option(None, "shrink so the shorter side is N (never enlarges)", kind="int",
                                        group="resize", gt=0)
    resize_longer: Int | None = option(None, "shrink so the longer side is N (never enlarges)", kind="int",
                                       group="resize", gt=0)
    quality: Int = option(90, "JPEG quality of re-encoded images, 1-100 (default {default})", kind="int", ge=1, le=100)
    min_size: Int = option(16, "reject images with a side below N px (default {default})", kind="int", ge=1)
    max_pixels: Int = option(DEFAULT_MAX_PIXELS, "reject larger images before decoding (decompression bombs; "
                                                 "default {default})", kind="int", gt=0)
    keep_original: Bool = option(True, "always re-encode as JPEG (default: keep RGB JPEG/PNG/WebP bytes that need "
                                       "no change)", kind="off", flag="--no-keep-original")
    dedup: Bool = option(False, "reject files whose bytes equal an earlier file's", kind="on")
    workers: Int = option(1, "worker processes (default {default})", kind="int", ge=1)
    staging_dir: Str | None = option(None, "OUT in an object store: local folder where finished shards wait for "
                                           "their upload, a few at a time (default: the system temp folder)")
    part_size: Int = option(DEFAULT_PART_SIZE, "OUT in an object store: multipart upload part size, at least 5MiB "
                                               f"(default {DEFAULT_PART_SIZE >> 20}MiB)", kind="size", gt=0)
    exclude_near: Addresses = option([], "a downstream test set (image folder, manifest, or a `vitp prep` output; "
                                         "any address): training images that are near-duplicates of its images "
                                         "are not written (rejects.jsonl: near_duplicate); repeatable",
                                     kind="list", metavar="TEST")
    exclude_near_splits: Names | None = option(None, "of a prep output given to --exclude-near, these splits, e.g. "
                                                     "test,val (default: its test split if it has one, else every "
                                                     "split)", metavar="SPLITS")
    near_threshold: Int = option(DEFAULT_NEAR_THRESHOLD,
                                 "near-duplicate candidate: at most D of the 64 bits of the perceptual hash differ "
                                 f"(Hamming distance, 0-{MAX_NEAR_THRESHOLD}; default {{default}}, measured in the "
                                 "README's table); each candidate is then checked with thumbnails",
                                 kind="int", metavar="D", ge=0, le=MAX_NEAR_THRESHOLD)

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
