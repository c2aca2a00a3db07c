"""The one training loop, for pre-training and fine-tuning alike.

    set up: process group, run dir (resume or start), model -> DeepSpeed engine, loader, tracker;
            the periodic tasks and the checkpoint manager, which restores every named state
    each step:
        forward_backward   over the micro batches; loss and top-1 (precision@1 on multi-label data)
                           accumulate on the device
        agree              one small all-reduce: any rank asked to stop / saw a non-finite loss
        optimizer_step     clip + update (DeepSpeed), EMA
        periodic tasks     the due ones of one list, in order (pipeline/train/periodic.py): training
                           log, validation, the caller's tasks, checkpoint, few-shot evaluators; their
                           metrics go to one record, written before the checkpoint and after the step
    finish: final checkpoint, final eval, consolidated weights, artifacts, the caller's ``finish``

What differs between stages comes in as arguments (the model, its parameter groups, what happens to
the final model); the loop never asks which stage it runs.

GPU habits: a step makes no host<->device sync except at ``train.log_every`` (and at steps where
other periodic work is due, which sync anyway): the stop/non-finite flags are all-reduced on the
device every step and read one step later, when that all-reduce has long finished; batches are copied from pinned memory
without blocking. Rank-0-only work happens after the last collective of the run.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from pipeline import data as data_lib
from pipeline import faults
from pipeline.config import Config, flatten, to_yaml, write_resolved
from pipeline.data.loader import check_splits
from pipeline.data.mixing import Mixer
from pipeline.distributed import all_reduce, broadcast_from_rank0, rank0_print, rank_world, setup, wait_for_rank0
from pipeline.eval.figures import loss_curve_png
from pipeline.tracking import METRICS, JsonlSink, Sinks
from pipeline.tracking.setup import check_access, configured_sinks, start_mlflow
from pipeline.train import checkpoint as ckpt_lib
from pipeline.train import engine as eng_lib
from pipeline.train import stopping
from pipeline.train.checkpoint import CheckpointManager, RngState, Stateful
from pipeline.train.ema import Ema
from pipeline.train.evaluators import FewshotEvaluators
from pipeline.train.loss import loss_fn, top1_hits
from pipeline.train.patchdrop import PatchDrop
from pipeline.train.periodic import Periodic, TrainLog, Validation, Window
from pipeline.train.schedule import lr_for


@dataclass
class Result:
    status: str  # "completed" | "stopped"
    step: int
    run_dir: str
    reason: str | None = None
    loss: float | None = None  # mean loss of the last logged window
    val_top1: float | None = None
    weights: str | None = None  # RUN_DIR/model.safetensors when completed
    mlflow_run_id: str | None = None


class NonFiniteLoss(RuntimeError):
    pass


class RunDirError(RuntimeError):
    pass


@dataclass
class Finished:
    """What the caller's ``finish`` gets, on every rank, once the run's weights are published."""

    cfg: Config
    engine: object
    tracker: object
    result: Result
    rank: int
    world: int


# --------------------------------------------------------------------------------------------------
# Run directory
# --------------------------------------------------------------------------------------------------
def prepare_run_dir(cfg: Config, rank: int) -> Path | None:
    """The checkpoint to resume from, if any; refuses to reuse a foreign non-empty run dir.

    Collective: rank 0 decides from its view of the shared file system and every rank follows it (another
    rank's cached listing may be stale); only rank 0 deletes (run.fresh=true).
    """
    import shutil

    run_dir = Path(cfg.run.dir)
    entries = [p.name for p in run_dir.iterdir() if not p.name.startswith(".owner")] if run_dir.is_dir() else []
    if cfg.run.fresh:
        wait_for_rank0()  # everyone has looked before rank 0 deletes
        if rank == 0 and entries:
            print(f"run.fresh=true: starting over in {run_dir} (deleting its checkpoints and metrics)", flush=True)
            shutil.rmtree(ckpt_lib.root(run_dir), ignore_errors=True)
            for name in ("metrics.jsonl", "model.safetensors", "loss_curve.png", "mlflow_spool.jsonl"):
                (run_dir / name).unlink(missing_ok=True)
        wait_for_rank0()
        return None
    latest = ckpt_lib.resume_choice(run_dir)
    if latest is not None:
        return latest
    ours = run_dir / "config.yaml"
    foreign = rank == 0 and entries and not (ours.is_file() and ours.read_text() == to_yaml(cfg))
    if broadcast_from_rank0(bool(foreign)):
        raise RunDirError(f"run.dir {run_dir} is not empty and holds no complete checkpoint of this config; "
                          "pass run.fresh=true to start over there, or choose another run.dir")
    return None  # empty, or an earlier attempt of this very run that died before its first checkpoint


# --------------------------------------------------------------------------------------------------
# Pieces of a step
# --------------------------------------------------------------------------------------------------
class Agreement:
    """Per step, whether any rank asked to stop (2: requeue, which wins over 1: any other reason,
    e.g. cancel) and whether any rank saw a non-finite loss: one [2] all-reduce (max) on the device.

    ``post`` starts step t's all-reduce without waiting; ``read`` returns the agreed flags of every
    posted step. ``lag=True`` leaves the newest posted step unread (it is read next time, after the
    next step's work is queued, so the host never waits for the GPU); every rank reads the same
    steps at the same points, so all decide alike.
    """

    def __init__(self, device):
        self.device = device
        self.pending: list[tuple[int, torch.Tensor, object]] = []  # (step, flags, copy-done event)

    def post(self, step: int, asked: str | None, loss_sum: torch.Tensor) -> None:
        code = 0.0 if asked is None else 2.0 if asked == "requeue" else 1.0
        flags = torch.stack([torch.full((), code, dtype=torch.float32, device=self.device),
                             (~torch.isfinite(loss_sum)).to(torch.float32)])
        flags = all_reduce(flags, "max")
        done = None
        if flags.device.type == "cuda":  # copy back now, read later: no wait in the step
            flags = flags.to("cpu", non_blocking=True)
            done = torch.cuda.Event()
            done.record()
        self.pending.append((step, flags, done))

    def read(self, *, lag: bool) -> tuple[float, int | None]:
        """(stop code, first step with a non-finite loss or None) over the steps read now."""
        ready, self.pending = (self.pending[:-1], self.pending[-1:]) if lag else (self.pending, [])
        stop, bad = 0.0, None
        for step, flags, done in ready:
            if done is not None:
                done.synchronize()  # queued a step ago: waits for that step's copy, not for this step
            code, nonfinite = flags.tolist()
            stop = max(stop, code)
            if nonfinite and bad is None:
                bad = step
        return stop, bad


def step_flops(model, cfg: Config, images_per_rank: int, patch_drop: float = 0.0) -> float:
    """Model FLOPs of one optimizer step on one rank (forward + backward, no recomputation: MFU
    counts the model's work, not what activation checkpointing repeats), on the tokens computed."""
    try:
        from pipeline.model.flops import train_step_flops

        return float(train_step_flops(model.config, batch=images_per_rank, grad_checkpointing=False,
                                      patch_drop=patch_drop))
    except Exception:  # MFU is a nicety; a model the counter does not know just reports none
        return float("nan")


def _draw_figures(sd: dict, model_config: dict, images: torch.Tensor | None, out: Path) -> list[Path]:
    """The paper's figures for the final weights; a figure that fails to draw warns, never fails the run."""
    from pipeline.eval.figures import write_figures
    from pipeline.model import build_vit

    try:
        model = build_vit(**model_config)
        model.load_state_dict(sd)
        return write_figures(model, out, None if images is None else images.cpu())
    except Exception as e:  # figures are a report, not a result
        warnings.warn(f"figures not drawn: {type(e).__name__}: {e}", stacklevel=2)
        return []


class MetricsLog:
    """The one place a step's metrics go: the run's sinks (pipeline/tracking: metrics.jsonl, MLflow,
    tracking.sinks; rank 0's, the other ranks' record nothing). An empty record is not written."""

    def __init__(self, sinks: Sinks):
        self.sinks = sinks

    def write(self, step: int, record: dict) -> None:
        if record:
            self.sinks.log(record, step)


@dataclass
class Parts:
    """The run's parts a caller's periodic task may need (``train(tasks=[lambda parts: ...])``)."""

    cfg: Config
    engine: object
    loader: object
    source: data_lib.DataSource  # pipeline.data.source_for(cfg.data.path)
    num_classes: int
    device: torch.device
    dtype: torch.dtype
    rank: int
    world: int


# --------------------------------------------------------------------------------------------------
# The loop
# --------------------------------------------------------------------------------------------------
def train(cfg: Config, build_model: Callable[[int], torch.nn.Module], *,
          param_groups: Callable[[torch.nn.Module], list[dict]] | None = None, stage: str = "pretrain",
          finish: Callable[[Finished], None] | None = None,
          tasks: Sequence[Callable[[Parts], Periodic]] = (), states: Mapping[str, Stateful] | None = None
          ) -> Result:
    """Train the model ``build_model(num_classes)`` as ``cfg`` says; resume from run.dir's newest
    complete checkpoint. ``param_groups(model)``: optimizer groups (default: decay / no decay);
    ``stage``: the MLflow tag; ``finish(Finished)``: runs on every rank once the final weights are
    published, before the tracker closes (fine-tuning's final evaluation and model registration).
    ``tasks``: factories of more periodic tasks (run after validation, before the checkpoint; one with
    ``state_dict`` is checkpointed under its name); ``states``: more named parts to checkpoint.
    """
    from pipeline.weights import save_weights

    setup(cfg)
    rank, world = rank_world()
    run_dir = Path(cfg.run.dir)
    resume_from = prepare_run_dir(cfg, rank)
    source = data_lib.source_for(cfg.data.path)
    # a missing split fails now, in one line, not after the last step
    check_splits(cfg.data.path, {"data.train_split": cfg.data.train_split, "data.val_split": cfg.data.val_split})
    check_access(cfg, run_dir, rank=rank)  # a refused login fails now, in one line, not after training
    hit_key = "prec1" if source.read_info().multi_label else "top1"  # big_vision's prec@1

    # model: identical initialisation on every rank, then per-rank randomness (dropout)
    torch.manual_seed(cfg.seed)
    num_classes = data_lib.num_classes(cfg.data, cfg.model.num_classes)
    model = build_model(num_classes)
    torch.manual_seed(cfg.seed * 1000 + rank)
    universal = ckpt_lib.universal_for(resume_from, world) if resume_from else None
    engine = eng_lib.build_engine(model, cfg, param_groups(model) if param_groups else None,
                                  load_universal=universal is not None)
    device, dtype = engine.device, eng_lib.input_dtype(cfg)
    accum = eng_lib.grad_accumulation(cfg, world)
    loader = source.train_loader(cfg.data, img_size=cfg.model.img_size, micro_batch=cfg.train.micro_batch,
                                 global_batch=cfg.train.global_batch, rank=rank, world_size=world, seed=cfg.seed,
                                 pin_memory=device.type == "cuda")
    mixer = Mixer.from_config(cfg.data, source.read_info(), seed=cfg.seed, rank=rank)
    ema = Ema(engine.module, cfg.optim.ema) if cfg.optim.ema else None
    window, agree = Window(device), Agreement(device)
    drops = PatchDrop(cfg, model, rank, device)
    flops = {on: step_flops(model, cfg, cfg.train.micro_batch * accum, cfg.model.patch_drop if on else 0.0)
             for on in (False, True)}  # by whether the step drops patches

    # the periodic work, in order (pipeline/train/periodic.py), and the parts a checkpoint holds
    parts = Parts(cfg, engine, loader, source, num_classes, device, dtype, rank, world)
    train_log = TrainLog(cfg, window, engine, loader, drops, flops, hit_key)
    validation = Validation(cfg, engine, source, num_classes, device, dtype)
    fewshot = FewshotEvaluators(cfg, engine, device, dtype, last_step=cfg.train.steps)
    added = [make(parts) for make in tasks]
    named = {"rng": RngState(), "loader": loader, "window": window, **({"ema": ema} if ema is not None else {}),
             **{t.name: t for t in (*added, fewshot) if hasattr(t, "state_dict")}, **(states or {})}
    checkpoints = CheckpointManager(run_dir, engine, named, every=cfg.checkpoint.every,
                                    last_step=cfg.train.steps, keep=cfg.checkpoint.keep)
    periodic = [train_log, validation, *added, checkpoints, fewshot]
    after_save = periodic[periodic.index(checkpoints) + 1:]

    resumed = checkpoints.restore(resume_from, universal) if resume_from is not None else None
    step, manifest = (resumed.step, resumed.manifest) if resumed else (0, {})
    if resumed:
        rank0_print(f"resuming from {resume_from} (step {step}, saved by {manifest['world_size']} ranks)")
    if rank == 0:
        write_resolved(cfg, run_dir)
    # rank 0's records: metrics.jsonl (past the resumed step dropped: they run again), MLflow, tracking.sinks
    metrics_file = JsonlSink(run_dir / METRICS, keep_up_to=step) if rank == 0 else None
    history = metrics_file.records if metrics_file else []
    fewshot.skip_logged(history)
    datasets = {cfg.data.train_split: "training", cfg.data.val_split: "evaluation"}
    tracker = Sinks(metrics_file, start_mlflow(
        cfg, run_dir, rank=rank, world_size=world, stage=stage, run_id=manifest.get("mlflow_run_id"),
        run_key=manifest.get("mlflow_run_key"), params=flatten(cfg),  # params: logged only if a new run is made
        datasets=data_lib.dataset_inputs(cfg.data.path, datasets) if rank == 0 else None),
        *configured_sinks(cfg, run_dir, rank=rank))
    checkpoints.manifest = lambda: {
        "config": flatten(cfg), "model_config": model.config, "zero_stage": cfg.engine.zero_stage,
        "precision": cfg.engine.precision, "mlflow_run_id": tracker.run_id, "mlflow_run_key": tracker.run_key,
        "mlflow_uri": tracker.uri}
    log = MetricsLog(tracker)
    close_timeout = cfg.tracking.close_timeout_s
    n_params = sum(p.numel() for p in model.parameters()) if cfg.engine.zero_stage < 3 else None
    rank0_print(f"{stage}: {world} rank(s) on {device.type}, ZeRO-{cfg.engine.zero_stage}, {cfg.engine.precision}, "
                f"global batch {cfg.train.global_batch} = {cfg.train.micro_batch} x {accum} accum x {world}, "
                f"steps {step}->{cfg.train.steps}" + (f", {n_params / 1e6:.2f}M params" if n_params else "")
                + (f", {drops.describe()}" if drops.drop else ""))

    def check(lag: bool) -> float:
        """The agreed stop code; raises NonFiniteLoss (on every rank alike) before anything is saved."""
        stop, bad = agree.read(lag=lag)
        if bad is not None:
            tracker.close(status="FAILED", timeout=10.0)
            raise NonFiniteLoss(f"step {bad}: non-finite loss (lr {lr_for(cfg, bad - 1):.3g}); stopped before "
                                f"saving it; last complete checkpoint: {ckpt_lib.latest_checkpoint(run_dir) or 'none'}")
        return stop

    def stopped(stop: float) -> Result:
        """Checkpoint ``step`` and hand the run back (a requeued job continues it)."""
        stop = max(stop, check(lag=False))  # every rank reads every posted step before agreeing
        reason = "requeue" if stop == 2 else (stopping.stop_reason() or "cancel")
        rank0_print(f"stopping at step {step} ({reason}); checkpoint {checkpoints.save(step)}")
        tracker.close(timeout=min(close_timeout, 10.0))
        return Result("stopped", step, str(run_dir), reason=reason, loss=train_log.last.get("loss"),
                      mlflow_run_id=tracker.run_id)

    def forward_backward(batches, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """accum micro batches of optimizer step ``step`` + 1; DeepSpeed averages and reduces the gradients.
        -> ([loss sum, top-1 hits, samples] on the device, the last micro batch's images)."""
        sums = torch.zeros(3, dtype=torch.float64, device=device)
        for m in range(accum):
            images, labels = next(batches)
            labels = labels.to(device, non_blocking=True)
            x = source.normalize(images.to(device, non_blocking=True))
            x, targets = mixer(x, labels, loader.position)
            keep = drops.keep(step, m, len(labels))  # None: every patch
            logits = (engine(x.to(dtype)) if keep is None else engine(x.to(dtype), keep=keep)).float()
            loss = loss_fn(cfg.train.loss, logits, targets, label_smoothing=cfg.data.label_smoothing)
            engine.backward(loss)
            if m < accum - 1:
                engine.step()  # not a boundary: DeepSpeed only counts the micro step
            n = len(labels)
            sums += torch.stack([loss.detach().double() * n, top1_hits(logits, labels).double(),
                                 torch.full((), float(n), dtype=torch.float64, device=device)])
        return sums, images

    stop, batches = 0.0, loader.forever()
    images = None  # the last batch: its first images feed the attention figures at the end
    engine.train()
    for task in after_save:  # a resumed run whose evaluators a stop or a kill cut short
        if task.due(step):
            log.write(step, task.run(step))
    while step < cfg.train.steps:
        faults.hit("step", step + 1)
        eng_lib.set_lr(engine, lr_for(cfg, step))
        sync = any(task.due(step + 1) for task in periodic)  # these steps wait for the device anyway

        step_sums, images = forward_backward(batches, step)
        agree.post(step + 1, stopping.stop_reason(), step_sums[0])
        stop = max(stop, check(lag=not sync))  # a non-finite loss stops before this optimizer step
        engine.step()  # the boundary: clip, optimizer update
        if ema is not None:
            ema.update(engine.module)
        step += 1
        window.add(step_sums)

        record, ran = {}, False  # one record of the due tasks' metrics per step (and one after the checkpoint)
        for task in periodic:
            if task is checkpoints:
                log.write(step, record)  # the checkpoint covers every record up to its step
                record = {}
                if stop:
                    return stopped(stop)
            if task.due(step):
                record.update(task.run(step))
                ran = True
        log.write(step, record)
        if ran:  # periodic work is not training time
            train_log.restart()

    # the end: final checkpoint, final eval, consolidated fp32 weights, artifacts
    if checkpoints.saved_at != step:
        checkpoints.save(step)
    if cfg.data.val_split and validation.last is None:  # none ran in this job: once at the end
        log.write(step, validation.run(step))
    weights = run_dir / "model.safetensors"
    result = Result("completed", step, str(run_dir), loss=train_log.last.get("loss"),
                    val_top1=(validation.last or {}).get("val_top1"), weights=str(weights),
                    mlflow_run_id=tracker.run_id)
    # rank 0's work below reads files, not the group: no rank waits inside a collective meanwhile
    if rank == 0:
        sd, model_config = ckpt_lib.read_weights(checkpoints.path(step))
        if ema is not None:  # the averaged weights are the ones to ship; raw ones stay in checkpoints
            averaged = ema.state_dict()
            sd = {k: averaged.get(k, v) for k, v in sd.items()}
        save_weights(sd, model_config, weights)
        png = loss_curve_png(history, run_dir / "loss_curve.png")
        for path in (run_dir / "config.yaml", weights, png):
            if path is not None:
                tracker.log_artifact(path)
        for path in _draw_figures(sd, model_config, None if images is None else images[:8], run_dir / "figures"):
            tracker.log_artifact(path, "figures")
        rank0_print(f"done: {weights}")
    wait_for_rank0()  # the weights file exists for every rank's finish
    if finish is not None:
        finish(Finished(cfg, engine, tracker, result, rank, world))
    tracker.close(status="FINISHED", timeout=close_timeout)
    return result
