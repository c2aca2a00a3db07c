"""The evaluation stage: ``evaluate(cfg) -> EvalResult``, for `vitp eval` and `vitp submit eval`.

Runs the declared evaluators (pipeline/eval/evaluators: ``evals:``, from ``--evals FILE``; else the
flags' entries on ``cfg.eval.split``: top-1/top-5, per-class accuracy and the confusion matrix;
few-shot linear evaluation and a linear probe on frozen features fitted on ``cfg.data.train_split``)
on the checkpoint ``cfg.eval.checkpoint``, the same classes a training run runs. Under a launcher
every rank scores its own part of each split; rank 0 writes ``results.json`` (keys ``eval/...``)
and the artifacts.

MLflow: the evaluation is a run of its own, nested under the run that wrote the checkpoint (the
checkpoint's manifest names it and its store), with the splits as dataset inputs, the metrics
(``test/top1``, ``fewshot/10shot``, ``linear_probe/top1``, ...) at the checkpoint's step, the
per-class table and the confusion figure. A checkpoint without a run logs a top-level run when
``$MLFLOW_TRACKING_URI`` is set, and nothing otherwise.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pipeline import checkpoint_layout as layout
from pipeline.config import ConfigError, EvalConfig, flatten
from pipeline.data import DataError, dataset_inputs, minival_source, read_info
from pipeline.distributed import comm_device, rank_world, setup
from pipeline.eval import evaluators as evals
from pipeline.eval.loop import write_results
from pipeline.eval.task import Task
from pipeline.stops import Status
from pipeline.tracking import Sinks
from pipeline.tracking.setup import Tracking
from pipeline.train.engine import fp32_state_dict
from pipeline.weights import load_model


@dataclass
class EvalResult:
    status: str  # stops.Status.COMPLETED
    metrics: dict[str, float] = field(default_factory=dict)
    results: str | None = None  # results.json (rank 0)
    fewshot_text: str | None = None
    mlflow_run_id: str | None = None  # the evaluation's own run (rank 0)
    mlflow_parent_run_id: str | None = None  # the evaluated run it is nested under


@dataclass
class CheckpointRun:
    """What the checkpoint's manifest says about the run that wrote it (all None for a bare file)."""

    run_id: str | None = None
    uri: str | None = None
    experiment: str | None = None
    step: int = 0
    loss: str | None = None  # train.loss of the run (None: not recorded)


def run_of_checkpoint(checkpoint: str | os.PathLike) -> CheckpointRun:
    """The MLflow run (and its store) of a run dir, a checkpoint folder or a run dir's model.safetensors."""
    p = Path(checkpoint)
    ck = layout.checkpoint_in(p if p.is_dir() else p.parent)
    if ck is None:
        return CheckpointRun()
    run_dir = ck.parent.parent  # RUN_DIR/checkpoints/step-*
    man = layout.read_manifest(ck)
    conf = man.get("config") or {}
    uri = man.get("mlflow_uri") or conf.get("tracking.uri") or os.environ.get("MLFLOW_TRACKING_URI")
    if uri is None or (uri.startswith("sqlite:///") and not Path(uri.removeprefix("sqlite:///")).is_file()):
        local = run_dir / "mlflow.db"  # the default store, or the run dir moved since
        uri = f"sqlite:///{local.resolve()}" if local.is_file() else None
    return CheckpointRun(man.get("mlflow_run_id"), uri, conf.get("tracking.experiment"), int(man.get("step") or 0),
                         conf.get("train.loss"))


def default_out(checkpoint: str) -> Path:
    c = Path(checkpoint)
    return c if c.is_dir() else Path(f"eval_{c.stem}")


def evaluate(cfg: EvalConfig) -> EvalResult:
    e = cfg.eval
    if not e.checkpoint:
        raise ConfigError("eval.checkpoint: give the run directory or weights file to evaluate")
    declared = evals.declare(evals.eval_entries(cfg))
    try:
        evals.check_data(declared, cfg.data.path, minival_source(cfg.data))
    except DataError as err:
        raise FileNotFoundError(str(err)) from None
    setup(cfg)
    device = comm_device()
    rank, world = rank_world()
    model = load_model(e.checkpoint, variant=e.variant, img_size=e.img_size, consolidate=fp32_state_dict).to(device)
    out_dir = Path(e.out) if e.out else default_out(e.checkpoint)
    img = model.img_size[0] if isinstance(model.img_size, tuple) else int(model.img_size)
    task = Task.of(read_info(cfg.data.path), run_of_checkpoint(e.checkpoint).loss)  # as the run trained
    ctx = evals.Context(cfg.data, task, img_size=img, batch=e.batch, device=device, rank=rank, world=world,
                        autocast=torch.bfloat16 if device.type == "cuda" else None, report=True, out_dir=out_dir)
    tracker, parent = _start_tracking(cfg, declared, out_dir, rank, world)
    try:
        res = evals.run_all([d.build(ctx) for d in declared], model, parent.step)
    except BaseException:
        tracker.close(status="FAILED", timeout=10.0)
        raise
    metrics = {k: v for k, v in res.metrics.items() if isinstance(v, float)}
    path = None
    if rank == 0:
        path = str(write_results({f"eval/{k}": v for k, v in res.metrics.items()}, out_dir))
        tracker.log(metrics, parent.step)
        for a in res.artifacts:
            if Path(a).name.startswith("per_class_"):  # MLflow's table format: the UI shows a table
                tracker.log_table(json.loads(Path(a).read_text()), Path(a).name)
            else:
                tracker.log_artifact(a)
        tracker.log_artifact(path)
        tracker.close(status="FINISHED", timeout=cfg.tracking.close_timeout_s)
    return EvalResult(Status.COMPLETED, metrics, path, "\n".join(res.texts) or None, tracker.run_id, parent.run_id)


def _start_tracking(cfg: EvalConfig, declared: list, out_dir: Path, rank: int, world: int
                    ) -> tuple[Sinks, CheckpointRun]:
    """The evaluation's run (rank 0): under the evaluated run when there is one; else top-level when
    $MLFLOW_TRACKING_URI is set; else none. Plus the tracking.sinks, on rank 0."""
    e, parent = cfg.eval, run_of_checkpoint(cfg.eval.checkpoint)
    uri = parent.uri if parent.run_id else os.environ.get("MLFLOW_TRACKING_URI")
    tracking = Tracking(cfg.tracking, out_dir, rank=rank)
    extra = tracking.extra_sinks()
    if rank != 0 or not uri or not cfg.tracking.enabled:
        return Sinks(*extra), parent
    splits = {}  # the default dataset's splits the evaluators read
    for d in declared:
        if not d.entry.data or d.entry.data == cfg.data.path:
            splits.update({getattr(d.entry, s): "training" if s == "train_split" else "evaluation"
                           for s in d.cls.splits})
    tracker = tracking.mlflow(world_size=world, stage="eval", uri=uri, parent_run_id=parent.run_id,
                              run_name=f"eval-{e.split}", experiment=parent.experiment or cfg.tracking.experiment,
                              params={k: v for k, v in flatten(cfg).items() if k.startswith(("eval.", "data."))},
                              datasets=dataset_inputs(cfg.data.path, splits))
    tracker = Sinks(tracker, *extra)
    tracker.set_tags({"vitp.checkpoint": str(Path(e.checkpoint).resolve()), "vitp.eval_split": e.split})
    return tracker, parent
