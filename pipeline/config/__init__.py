"""Typed, strict configuration: one source of truth for defaults and checks.

A config is a YAML file (``yaml.safe_load`` only) merged with dotted command-line overrides
(``optim.lr=3e-4``), validated by the pydantic models of :mod:`pipeline.config.sections`: each
section is its own model that checks its fields (types, ranges) and its own combinations; the stage's
root model checks what spans sections (batch divisibility by the world size). Every mistake raises
:class:`ConfigError` with one line naming the key and the reason, before anything starts
(:mod:`pipeline.config.loading`).

Each stage validates only the sections it reads: :class:`Config` (pre-training, fine-tuning),
:class:`EvalConfig` (`vitp eval`), :class:`PrepConfig` (`vitp submit prep`'s jobs).

Recipes may name a parent with ``base: other.yaml`` (path relative to the file); the child's keys
win, section by section.
"""

from pipeline.config.loading import (
    RESOURCE_SECTIONS,
    Resolved,
    apply_overrides,
    build,
    flatten,
    from_dict,
    load_config,
    resolve,
    secret_values,
    to_dict,
    to_yaml,
    write_resolved,
)
from pipeline.config.prep import PrepCfg, PrepConfig, prep_cfg
from pipeline.config.sections import (
    CheckpointCfg,
    ClusterCfg,
    ConfigError,
    DataCfg,
    EngineCfg,
    EvalCfg,
    EvalEntry,
    HardwareCfg,
    InitCfg,
    ModelCfg,
    OptimCfg,
    RunCfg,
    ScheduleCfg,
    Section,
    TrackingCfg,
    TrainCfg,
    fewshot_sets,
)
from pipeline.config.stages import Config, EvalConfig, StageConfig, validate, world_size_from_env

__all__ = [
    "RESOURCE_SECTIONS", "CheckpointCfg", "ClusterCfg", "Config", "ConfigError", "DataCfg", "EngineCfg", "EvalCfg",
    "EvalConfig", "EvalEntry", "HardwareCfg", "InitCfg", "ModelCfg", "OptimCfg", "PrepCfg", "PrepConfig", "Resolved",
    "RunCfg", "ScheduleCfg", "Section", "StageConfig", "TrackingCfg", "TrainCfg", "apply_overrides", "build",
    "fewshot_sets", "flatten", "from_dict", "load_config", "prep_cfg", "resolve", "secret_values", "to_dict", "to_yaml",
    "validate", "world_size_from_env", "write_resolved",
]
