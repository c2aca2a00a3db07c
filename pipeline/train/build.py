"""A training run's parts, built once from its config: the one place that reads ``cfg``.

    build_run(cfg, build_model)  -> Run
        run dir        resume from its newest complete checkpoint, or start (refuses a foreign one);
                       the resolved config is written there once (config.yaml)
        data           the source, this rank's train stream and val loader (one call), the mixer
        model/engine   identical initialisation on every rank; DeepSpeed (ZeRO, precision,
                       accumulation); EMA; patch dropping; the learning-rate schedule
        task kind      single- or multi-label, and the loss: decided once (pipeline/eval/task.py)
        periodic work  training log, the declared evaluators (``evals:`` and the shorthand keys,
                       pipeline/eval/evaluators; checked before anything starts), the caller's
                       tasks, in the order the loop runs them (pipeline/train/periodic.py)
        checkpoint     the manager with every named state; restored here when resuming
        tracking       metrics.jsonl, MLflow, tracking.sinks (after the resume: the checkpoint says
                       which MLflow run to continue)

Each part is given, once, here, its section (a part whose settings are a whole section: tracking, the
engine, the data source) or its values (the rest: mixer, schedule, patch dropping, EMA, the periodic
tasks, the evaluators), and owns its settings and state from then on;
the loop (pipeline/train/loop.py) is handed the :class:`Run` and never sees ``cfg``. The stage sets
up the process group first (:func:`pipeline.distributed.setup`).
"""

from __future__ import annotations

import functools
import os
import shutil
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

from pipeline import checkpoint_layout as layout
from pipeline import data as data_lib
from pipeline.config import Config, resolve
from pipeline.data import check_splits, minival_source
from pipeline.data.mixing import Mixer
from pipeline.distributed import any_rank, broadcast_from_rank0, rank0_print, rank_world, wait_for_rank0
from pipeline.errors import Classified
from pipeline.eval import evaluators as evals
from pipeline.eval.task import Task
from pipeline.plan.memory import checkpoint_bytes
from pipeline.tracking import METRICS, JsonlSink, Sinks
from pipeline.tracking.setup import Tracking
from pipeline.train import checkpoint as ckpt_lib
from pipeline.train import engine as eng_lib
from pipeline.train.checkpoint import CheckpointManager, RngState, Stateful
from pipeline.train.ema import Ema
from pipeline.train.evaluations import Evaluations
from pipeline.train.loss import loss_fn
from pipeline.train.patchdrop import PatchDrop
from pipeline.train.periodic import Periodic, TrainLog, Window
from pipeline.train.saving import available_host_bytes, host_room
from pipeline.train.schedule import Schedule


class RunDirError(Classified, RuntimeError):
    exit_code = 2
    retry = False


def room_for_snapshots(cfg, n_params: int, world: int) -> bool:
    """Collective: whether every node has free host memory for its ranks' checkpoint snapshots
    (checkpoint.async); a rank whose node has none warns, and every rank then writes inline."""
    need = checkpoint_bytes(n_params, precision=cfg.engine.precision, zero_stage=cfg.engine.zero_stage,
                            world_size=world)["rank0"]
    local = int(os.environ.get("LOCAL_WORLD_SIZE") or 1)
    free = available_host_bytes()
    short = not host_room(need, local, free)
    if short:
        print(f"warning: checkpoint.async: this node has {free / 2**30:.1f} GiB of host memory free, its {local} "
              f"rank(s) need {local * need / 2**30:.1f} GiB for checkpoint snapshots; checkpoints are written "
              f"inline (training waits for each save)", file=sys.stderr, flush=True)
    return not any_rank(short)


def prepare_run_dir(run, resolved_yaml: str, rank: int) -> Path | None:
    """The checkpoint to resume from, if any; refuses to reuse a foreign non-empty run dir.
    ``run``: the ``run`` section; ``resolved_yaml``: this config's config.yaml text.

    Collective: rank 0 decides from its view of the shared file system and every rank follows it (another
    rank's cached listing may be stale); only rank 0 deletes (run.fresh=true).
    """
    run_dir = Path(run.dir)
    # dot files are the bookkeeping of whoever started the run (the .owner claim, a suite cell's identity)
    entries = [p.name for p in run_dir.iterdir() if not p.name.startswith(".")] if run_dir.is_dir() else []
    if run.fresh:
        wait_for_rank0()  # everyone has looked before rank 0 deletes
        if rank == 0 and entries:
            print(f"run.fresh=true: starting over in {run_dir} (deleting its checkpoints and metrics)", flush=True)
            shutil.rmtree(layout.root(run_dir), ignore_errors=True)
            for name in ("metrics.jsonl", "model.safetensors", "loss_curve.png", "mlflow_spool.jsonl"):
                (run_dir / name).unlink(missing_ok=True)
        wait_for_rank0()
        return None
    latest = ckpt_lib.resume_choice(run_dir)
    if latest is not None:
        return latest
    ours = run_dir / "config.yaml"
    foreign = rank == 0 and entries and not (ours.is_file() and same_run(ours.read_text(), resolved_yaml))
    if broadcast_from_rank0(bool(foreign)):
        raise RunDirError(f"run.dir {run_dir} is not empty and holds no complete checkpoint of this config; "
                          "pass run.fresh=true to start over there, or choose another run.dir")
    return None  # empty, or an earlier attempt of this very run that died before its first checkpoint


# how a step is split, not what it computes: an out-of-memory retry halves it with the global batch kept
# (launch/job_body.py), and an attempt that died before its first checkpoint starts over in the same run dir
NOT_IDENTITY = (("train", "micro_batch"),)


def same_run(saved_yaml: str, resolved_yaml: str) -> bool:
    """Whether a run dir's config.yaml (``saved_yaml``) is this config's (``resolved_yaml``) but for
    the keys of :data:`NOT_IDENTITY`."""
    def identity(text: str) -> dict:
        doc = yaml.safe_load(text) or {}
        for section, key in NOT_IDENTITY:
            if isinstance(doc.get(section), dict):
                doc[section] = {k: v for k, v in doc[section].items() if k != key}
        return doc

    if saved_yaml == resolved_yaml:
        return True
    try:
        return identity(saved_yaml) == identity(resolved_yaml)
    except yaml.YAMLError:  # a config.yaml cut short: not this run's
        return False


def evaluations(declared: list, ctx, *, engine, ema: Ema | None, last_step: int) -> dict[bool, Evaluations]:
    """The declared evaluators, built (each timed: the first run logs it), as the two periodic tasks
    of the run: {after_checkpoint: Evaluations}."""
    built, setup = [], {}
    for d in declared:
        t0 = time.perf_counter()
        built.append(d.build(ctx))
        setup[d.entry.name] = time.perf_counter() - t0
    every = {d.entry.name: d.entry.every for d in declared}
    return {after: Evaluations([ev for ev in built if ev.after_checkpoint == after], engine=engine, device=ctx.device,
                               every=every, last_step=last_step, after_checkpoint=after, ema=ema, setup_s=setup)
            for after in (False, True)}


def step_flops(model, images_per_rank: int, patch_drop: float = 0.0) -> float:
    """Model FLOPs of one optimizer step on one rank (forward + backward, no recomputation: MFU
    counts the model's work, not what activation checkpointing repeats), on the tokens computed."""
    try:
        from pipeline.model.flops import train_step_flops

        return float(train_step_flops(model.config, batch=images_per_rank, grad_checkpointing=False,
                                      patch_drop=patch_drop))
    except Exception:  # MFU is a nicety; a model the counter does not know just reports none
        return float("nan")


def mixer_for(data, info, *, seed: int, rank: int) -> Mixer:
    """The training step's mixer from the ``data`` section (mixup, cutmix, label smoothing) over the
    dataset ``info``'s classes (and whether they are multi-label)."""
    return Mixer(info.num_classes, data.mixup, data.cutmix, data.label_smoothing, multi_label=info.multi_label,
                 seed=seed, rank=rank)


@dataclass
class Parts:
    """The run's parts a caller's periodic task may need (``build_run(tasks=[lambda parts: ...])``)."""

    cfg: Config
    engine: object
    loader: object
    source: data_lib.DataSource  # pipeline.data.source_for(cfg.data.path)
    num_classes: int
    device: torch.device
    dtype: torch.dtype
    rank: int
    world: int


@dataclass
class Run:
    """A built training run: everything the loop drives, each part holding its own settings and state.

    ``step`` is where training (re)starts; ``periodic`` runs in order after each optimizer step, the
    tasks that say ``after_checkpoint`` only once ``checkpoints`` has offered to save that step."""

    run_dir: Path
    stage: str
    rank: int
    world: int
    steps: int  # train.steps: the run ends after this optimizer step
    step: int
    engine: object  # the DeepSpeed engine
    model: torch.nn.Module
    device: torch.device
    dtype: torch.dtype  # the model's input dtype
    accum: int  # micro batches per optimizer step on each rank
    source: data_lib.DataSource
    loader: data_lib.TrainBatches
    mixer: Mixer
    drops: PatchDrop
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (logits, targets) -> mean loss
    task: Task  # single- or multi-label, and the loss
    schedule: Schedule
    ema: Ema | None
    window: Window
    train_log: TrainLog
    checkpoints: CheckpointManager
    periodic: list[Periodic]
    tracker: Sinks
    history: list[dict]  # rank 0's metrics.jsonl records up to ``step`` (empty elsewhere)
    close_timeout: float  # tracking.close_timeout_s


def build_run(cfg: Config, build_model: Callable[[int], torch.nn.Module], *,
              param_groups: Callable[[torch.nn.Module], list[dict]] | None = None, stage: str = "pretrain",
              tasks: Sequence[Callable[[Parts], Periodic]] = (), states: Mapping[str, Stateful] | None = None
              ) -> Run:
    """Build (and, from run.dir's newest complete checkpoint, restore) the run ``cfg`` describes, for
    the model ``build_model(num_classes)``. ``param_groups(model)``: optimizer groups (default: decay /
    no decay); ``stage``: the MLflow tag. ``tasks``: factories of more periodic tasks (run after
    validation, before the checkpoint; one with ``state_dict`` is checkpointed under its name);
    ``states``: more named parts to checkpoint. Collective: every rank builds its run.
    """
    rank, world = rank_world()
    run_dir = Path(cfg.run.dir)
    declared = evals.declare(evals.run_entries(cfg))  # a bad entry fails before anything starts
    resolved = resolve(cfg)  # config.yaml's text and the MLflow params, once
    resume_from = prepare_run_dir(cfg.run, resolved.yaml, rank)
    source = data_lib.source_for(cfg.data.path)
    # a missing split fails now, in one line, not after the last step
    check_splits(cfg.data.path, {"data.train_split": cfg.data.train_split, "data.val_split": cfg.data.val_split},
                 minival_from=(held := minival_source(cfg.data)))
    evals.check_data(declared, cfg.data.path, held)
    tracking = Tracking.from_config(cfg, run_dir, rank=rank)
    tracking.check_access()  # a refused login fails now, in one line, not after training
    info = source.read_info()

    # model: identical initialisation on every rank, then per-rank randomness (dropout)
    torch.manual_seed(cfg.seed)
    num_classes = cfg.model.num_classes or info.num_classes
    model = build_model(num_classes)
    torch.manual_seed(cfg.seed * 1000 + rank)
    n_params = sum(p.numel() for p in model.parameters())  # whole, before ZeRO-3 partitions them
    universal = ckpt_lib.universal_for(resume_from, world) if resume_from else None
    engine, dtype, accum = eng_lib.for_training(model, cfg, param_groups(model) if param_groups else None,
                                                load_universal=universal is not None)
    device = engine.device
    t = cfg.train
    d = cfg.data
    loader = source.train_loader(d, img_size=cfg.model.img_size, micro_batch=t.micro_batch,
                                 global_batch=t.global_batch, rank=rank, world_size=world, seed=cfg.seed,
                                 pin_memory=device.type == "cuda")
    mixer = mixer_for(d, info, seed=cfg.seed, rank=rank)
    ema = Ema(engine.module, cfg.optim.ema) if cfg.optim.ema else None
    drops = PatchDrop(model, drop=cfg.model.patch_drop, until=t.patch_drop_until, seed=cfg.seed, rank=rank,
                      device=device)
    s = cfg.schedule
    schedule = Schedule(lr=cfg.optim.lr, total_steps=t.steps, warmup_steps=s.warmup_steps, decay=s.decay,
                        end_lr=s.end_lr)
    flops = {on: step_flops(model, t.micro_batch * accum, cfg.model.patch_drop if on else 0.0)
             for on in (False, True)}  # by whether the step drops patches

    # the periodic work, in order (pipeline/train/periodic.py), and the parts a checkpoint holds
    task = Task.of(info, t.loss)  # the one place the run's kind is decided
    window = Window(device)
    train_log = TrainLog(schedule, window, engine, loader, drops, flops, task, every=t.log_every,
                         last_step=t.steps, global_batch=t.global_batch, peak_flops=cfg.hardware.peak_tflops * 1e12)
    ctx = evals.Context(d, task, img_size=cfg.model.img_size, batch=cfg.eval.batch, device=device, rank=rank,
                        world=world, dtype=dtype)
    sides = evaluations(declared, ctx, engine=engine, ema=ema, last_step=t.steps)
    added = [make(Parts(cfg, engine, loader, source, num_classes, device, dtype, rank, world)) for make in tasks]
    periodic = [train_log, sides[False], *added, sides[True]]
    named = {"rng": RngState(), "loader": loader, "window": window, **({"ema": ema} if ema is not None else {}),
             **{p.name: p for p in periodic if hasattr(p, "state_dict") and p is not sides[False]}, **(states or {})}
    c = cfg.checkpoint
    checkpoints = CheckpointManager(run_dir, engine, named, every=c.every, every_minutes=c.every_minutes,
                                    last_step=t.steps, keep=c.keep,
                                    background=c.async_ and room_for_snapshots(cfg, n_params, world))

    resumed = checkpoints.restore(resume_from, universal) if resume_from is not None else None
    step, manifest = (resumed.step, resumed.manifest) if resumed else (0, {})
    if resumed:
        rank0_print(f"resuming from {resume_from} (step {step}, saved by {manifest['world_size']} ranks)")
    if rank == 0:
        resolved.write(run_dir)
    # rank 0's records: metrics.jsonl (past the resumed step dropped: they run again), MLflow, tracking.sinks
    metrics_file = JsonlSink(run_dir / METRICS, keep_up_to=step) if rank == 0 else None
    history = metrics_file.records if metrics_file else []
    sides[True].skip_logged(history)
    datasets = {cfg.data.train_split: "training", cfg.data.val_split: "evaluation"}
    tracker = Sinks(metrics_file, tracking.mlflow(
        world_size=world, stage=stage, run_id=manifest.get("mlflow_run_id"), run_key=manifest.get("mlflow_run_key"),
        params=resolved.params,  # logged only if a new run is made
        datasets=data_lib.dataset_inputs(cfg.data.path, datasets) if rank == 0 else None), *tracking.extra_sinks())
    checkpoints.manifest = lambda: {
        "config": resolved.params, "model_config": model.config, "zero_stage": cfg.engine.zero_stage,
        "precision": cfg.engine.precision, "mlflow_run_id": tracker.run_id, "mlflow_run_key": tracker.run_key,
        "mlflow_uri": tracker.uri}

    run = Run(run_dir=run_dir, stage=stage, rank=rank, world=world, steps=t.steps, step=step, engine=engine,
              model=model, device=device, dtype=dtype, accum=accum, source=source, loader=loader, mixer=mixer,
              drops=drops, loss=functools.partial(loss_fn, t.loss, label_smoothing=cfg.data.label_smoothing),
              task=task, schedule=schedule, ema=ema, window=window, train_log=train_log, checkpoints=checkpoints,
              periodic=[p for p in periodic if p],
              tracker=tracker, history=history, close_timeout=cfg.tracking.close_timeout_s)
    rank0_print(f"{stage}: {world} rank(s) on {device.type}, ZeRO-{cfg.engine.zero_stage}, {cfg.engine.precision}, "
                f"global batch {t.global_batch} = {t.micro_batch} x {accum} accum x {world}, steps {step}->{t.steps}"
                + (f", {n_params / 1e6:.2f}M params" if n_params else "")
                + (f", {drops.describe()}" if drops.drop else ""))
    return run
