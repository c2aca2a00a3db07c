"""Each stage's root config: the sections that stage reads (pipeline/config/sections.py) and the
checks that span them (:func:`validate`; the world size comes from the validation context).
``PrepConfig`` lives beside the prep schema (pipeline/config/prep.py).
"""

from __future__ import annotations

from pydantic import Field, ValidationInfo, model_validator

from pipeline.config.batch import BatchLayout
from pipeline.config.sections import (
    CheckpointCfg,
    ClusterCfg,
    ConfigError,
    DataCfg,
    EngineCfg,
    EvalCfg,
    EvalList,
    HardwareCfg,
    InitCfg,
    Int,
    ModelCfg,
    OptimCfg,
    RunCfg,
    ScheduleCfg,
    Section,
    TrackingCfg,
    TrainCfg,
    problem,
)
from pipeline.world import LAUNCHER, place


class StageConfig(Section):
    """A stage's root: its sections, and the checks that span them (the world size comes from the
    validation context, see :func:`validate`)."""

    @property
    def world_size_planned(self) -> int:
        return self.cluster.nodes * self.cluster.tasks_per_node

    @model_validator(mode="after")
    def _world(self, info: ValidationInfo):
        try:
            validate(self, world_size=(info.context or {}).get("world_size"))
        except ConfigError as e:
            raise problem(str(e)) from None
        return self


class Config(StageConfig):
    """Pre-training and fine-tuning (`vitp pretrain`, `vitp transfer`, `vitp config show`)."""

    seed: Int = 0
    run: RunCfg = Field(default_factory=RunCfg)
    model: ModelCfg = Field(default_factory=ModelCfg)
    data: DataCfg = Field(default_factory=DataCfg)
    optim: OptimCfg = Field(default_factory=OptimCfg)
    schedule: ScheduleCfg = Field(default_factory=ScheduleCfg)
    train: TrainCfg = Field(default_factory=TrainCfg)
    engine: EngineCfg = Field(default_factory=EngineCfg)
    checkpoint: CheckpointCfg = Field(default_factory=CheckpointCfg)
    tracking: TrackingCfg = Field(default_factory=TrackingCfg)
    hardware: HardwareCfg = Field(default_factory=HardwareCfg)
    cluster: ClusterCfg = Field(default_factory=ClusterCfg)
    init: InitCfg = Field(default_factory=InitCfg)
    eval: EvalCfg = Field(default_factory=EvalCfg)
    evals: EvalList() = Field(default_factory=list)  # declared evaluators (pipeline/eval/evaluators)


class EvalConfig(StageConfig):
    """The evaluation stage (`vitp eval`, `vitp submit eval`): the model comes from the checkpoint."""

    data: DataCfg = Field(default_factory=DataCfg)
    eval: EvalCfg = Field(default_factory=EvalCfg)
    engine: EngineCfg = Field(default_factory=EngineCfg)
    tracking: TrackingCfg = Field(default_factory=TrackingCfg)
    hardware: HardwareCfg = Field(default_factory=HardwareCfg)
    cluster: ClusterCfg = Field(default_factory=ClusterCfg)
    evals: EvalList() = Field(default_factory=list)  # run instead of the eval.* flags' ones when given


def world_size_from_env(cfg: StageConfig, environ=None) -> int:
    """The world a launcher started this process in (its RANK/WORLD_SIZE: torchrun, deepspeed, vitp's
    local launcher), else the one ``cfg`` plans. Only a launcher's variables count: SLURM's, in an
    salloc/sbatch shell that runs `vitp submit`, describe that shell's allocation, not the job."""
    p = place(environ, launchers=(LAUNCHER,))
    return p.world_size if p.source == LAUNCHER else cfg.world_size_planned


def validate(cfg: StageConfig, *, world_size: int | None = None) -> None:
    """The checks that span sections, for ``world_size`` ranks (default: $WORLD_SIZE, else the
    cluster section's nodes x tasks_per_node)."""
    ws = world_size if world_size is not None else world_size_from_env(cfg)
    if ws < 1:
        raise ConfigError(f"world size must be >= 1; got {ws}")
    if isinstance(cfg, Config):
        BatchLayout.of(cfg.train, ws)  # the global batch splits over ws ranks
        _every_node_count(cfg)
        if cfg.optim.ema is not None and cfg.engine.zero_stage == 3:
            raise ConfigError("optim.ema: needs engine.zero_stage <= 2 (ZeRO-3 partitions the parameters)")


def _every_node_count(cfg: Config) -> None:
    """A job with cluster.min_nodes < cluster.nodes may run on any count between them: the global batch must
    split on each (refused at submission, not when a requeue lands on that count)."""
    c = cfg.cluster
    for n in range(c.fewest_nodes, c.nodes):
        try:
            BatchLayout.of(cfg.train, n * c.tasks_per_node)
        except ConfigError as e:
            raise ConfigError(f"cluster.min_nodes: {c.min_nodes} lets an attempt run on {n} nodes "
                              f"({n * c.tasks_per_node} ranks), where {e}") from None
