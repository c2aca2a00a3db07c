"""Upstream pre-training: ``pretrain(cfg) -> Result``, the same under run_local, torchrun, deepspeed
or a SLURM task (rank/world come from the environment).

The ViT that ``cfg.model`` describes, its run's parts built once from ``cfg`` (pipeline/train/build.py)
and trained by the one loop (pipeline/train/loop.py): one optimizer step = ``accum`` micro batches
per rank (global batch = micro x accum x world); once in a while log, evaluate and checkpoint; a stop
request (preemption, time limit) is agreed by all ranks at a step boundary, checkpointed and
returned as status "stopped".
"""

from __future__ import annotations

from pipeline.config import Config
from pipeline.distributed import setup
from pipeline.rundir import own_run_dir
from pipeline.stops import Status
from pipeline.train.build import build_run
from pipeline.train.loop import Result, train
from pipeline.weights import build_model


def pretrain(cfg: Config) -> Result:
    setup(cfg)
    cfg = stage_chosen(cfg)
    with own_run_dir(cfg.run.dir) as claim:  # one job at a time in a run dir (pipeline/rundir.py)
        run = build_run(cfg, lambda num_classes: build_model(cfg, num_classes), stage="pretrain")
        result = train(run)
        claim.finished = result.status == Status.COMPLETED
    return result


def stage_chosen(cfg: Config) -> Config:
    """A config that reached the stage with ``engine.zero_stage: auto`` (not through `vitp submit`,
    which resolves it): the stage `vitp plan` recommends for its cluster section, said once."""
    if cfg.engine.zero_stage != "auto":  # a stage given: nothing to plan
        return cfg
    from pipeline.distributed import rank0_print
    from pipeline.plan.recommend import resolve_zero_stage

    cfg, note = resolve_zero_stage(cfg)
    if note:
        rank0_print(note)
    return cfg
