"""The one training loop, for pre-training and fine-tuning alike, over a built :class:`Run`.

    built before (pipeline/train/build.py, from cfg, once): run dir (resume or start), model ->
            DeepSpeed engine, loader, mixer, schedule, tracker; the periodic tasks and the checkpoint
            manager, which has restored every named state
    each step:
        forward_backward   over the micro batches; loss and top-1 (precision@1 on multi-label data)
                           accumulate on the device
        agree              one small all-reduce: any rank asked to stop / saw a non-finite loss; the
                           step before had a non-finite gradient norm (known after its update)
        optimizer_step     clip + update (DeepSpeed), EMA
        periodic tasks     the due ones of one list, in order (pipeline/train/periodic.py): those
                           before the checkpoint (training log, evaluators, the caller's tasks), the
                           checkpoint manager's offer to save (a host snapshot; the files are written
                           in the background), those after it (few-shot...); their metrics go to one
                           record written before the checkpoint and one after
    finish: final checkpoint (waited for), consolidated weights, artifacts, the caller's ``finish``

What differs between stages comes in through the builder (the model, its parameter groups) and
``finish`` (what happens to the final model); the loop never asks which stage it runs, nor reads cfg.

GPU habits: the loop itself reads nothing from the device except at ``train.log_every`` (and at steps
where other periodic work is due, which sync anyway): the stop/non-finite flags are all-reduced on the
device every step and read one step later, when that all-reduce has long finished; batches are copied
from pinned memory without blocking; DeepSpeed's norm and clip run on the device (the README's GPU section
lists each sync a plain step still makes). Python's collector walks generation 2 only at log steps, the
same step on every rank (pipeline/train/collector.py). Rank-0-only work happens after the last
collective of the run.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from pipeline import checkpoint_layout as layout
from pipeline import faults, hang, stops
from pipeline.distributed import all_reduce, rank0_print, wait_for_rank0
from pipeline.errors import Classified
from pipeline.eval.figures import loss_curve_png
from pipeline.tracking import Sinks
from pipeline.train import engine as eng_lib
from pipeline.train.build import Run
from pipeline.train.collector import Collector
from pipeline.train.loss import top1_hits


@dataclass
class Result:
    status: str  # a stops.Status: completed | stopped
    step: int
    run_dir: str
    reason: str | None = None
    loss: float | None = None  # mean loss of the last logged window
    val_top1: float | None = None
    data_wait: float | None = None  # share of this job's training time spent waiting for batches
    weights: str | None = None  # RUN_DIR/model.safetensors when completed
    mlflow_run_id: str | None = None


class NonFiniteLoss(Classified, RuntimeError):
    exit_code = 1
    retry = False


@dataclass
class Finished:
    """What the caller's ``finish`` gets, on every rank, once the run's weights are published."""

    engine: object
    tracker: object
    result: Result
    rank: int
    world: int


# --------------------------------------------------------------------------------------------------
# Pieces of a step
# --------------------------------------------------------------------------------------------------
class Agreement:
    """Per step, whether any rank asked to stop (:func:`pipeline.stops.code`: 2 a requeue, which wins
    over 1 any other reason, e.g. cancel), whether any rank saw a non-finite loss, whether the
    optimizer step before had a non-finite gradient norm, and whether any rank's background checkpoint
    write failed: one [4] all-reduce (max) on the device.

    ``post`` starts step t's all-reduce without waiting; ``read`` returns the agreed flags of every
    posted step. ``lag=True`` leaves the newest posted step unread (it is read next time, after the
    next step's work is queued, so the host never waits for the GPU); every rank reads the same
    steps at the same points, so all decide alike. The gradient norm of step t is known only after
    its ``engine.step()``: it travels with step t + 1's flags, or with :meth:`settle` before a save.
    """

    def __init__(self, device):
        self.device = device
        self.pending: list[tuple[int, torch.Tensor, object]] = []  # (step, flags, copy-done event)

    def post(self, step: int, asked: str | None, loss_sum: torch.Tensor, norm_bad: torch.Tensor,
             write_failed: bool = False) -> None:
        """Step ``step``'s flags; ``norm_bad``: 1.0 on the device if step ``step`` - 1's gradient norm was
        not finite (:func:`pipeline.train.engine.nonfinite_grad_norm`); ``write_failed``: this rank's
        background checkpoint write failed (a host value: no sync)."""
        flags = torch.stack([torch.full((), stops.code(asked), dtype=torch.float32, device=self.device),
                             (~torch.isfinite(loss_sum)).to(torch.float32), norm_bad.to(torch.float32),
                             torch.full((), float(write_failed), dtype=torch.float32, device=self.device)])
        flags = all_reduce(flags, "max")
        done = None
        if flags.device.type == "cuda":  # copy back now, read later: no wait in the step
            flags = flags.to("cpu", non_blocking=True)
            done = torch.cuda.Event()
            done.record()
        self.pending.append((step, flags, done))

    def settle(self, step: int, norm_bad: torch.Tensor) -> tuple[float, tuple[int, str] | None, bool]:
        """Everything posted, and step ``step``'s own gradient norm, read now (before a checkpoint of
        ``step``: no save follows an update made with a non-finite norm). A host sync: only where one
        happens anyway."""
        self.post(step + 1, None, torch.zeros((), device=self.device), norm_bad)
        return self.read(lag=False)

    def read(self, *, lag: bool) -> tuple[float, tuple[int, str] | None, bool]:
        """(stop code, the first (step, "loss" | "gradient norm") that was not finite or None, whether a
        checkpoint write failed) over the steps read now."""
        ready, self.pending = (self.pending[:-1], self.pending[-1:]) if lag else (self.pending, [])
        stop, bad, write_failed = 0.0, None, False
        for step, flags, done in ready:
            if done is not None:
                done.synchronize()  # queued a step ago: waits for that step's copy, not for this step
            code, loss_bad, norm_bad, failed = flags.tolist()
            stop, write_failed = max(stop, code), write_failed or bool(failed)
            for at, what, flag in ((step - 1, "gradient norm", norm_bad), (step, "loss", loss_bad)):
                if flag and bad is None:
                    bad = (at, what)
        return stop, bad, write_failed


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
    tracking.sinks; rank 0's, the other ranks' record nothing). An empty record is not written.
    ``latest``: each key's newest value written by this job (the run's result reads it)."""

    def __init__(self, sinks: Sinks):
        self.sinks = sinks
        self.latest: dict = {}

    def write(self, step: int, record: dict) -> None:
        if record:
            self.sinks.log(record, step)
            self.latest.update(record)


# --------------------------------------------------------------------------------------------------
# The loop
# --------------------------------------------------------------------------------------------------
def train(run: Run, *, finish: Callable[[Finished], None] | None = None) -> Result:
    """Train the built ``run`` from its ``step`` to its ``steps``; ``finish(Finished)`` runs on every
    rank once the final weights are published, before the tracker closes (fine-tuning's final
    evaluation and model registration)."""
    from pipeline.weights import load_checkpoint_weights, save_weights

    engine, loader, source, mixer, drops = run.engine, run.loader, run.source, run.mixer, run.drops
    device, dtype, accum, tracker, checkpoints = run.device, run.dtype, run.accum, run.tracker, run.checkpoints
    step, train_log = run.step, run.train_log
    before_save = [t for t in run.periodic if not getattr(t, "after_checkpoint", False)]
    after_save = [t for t in run.periodic if getattr(t, "after_checkpoint", False)]
    log, agree = MetricsLog(tracker), Agreement(device)

    def check(lag: bool, settle: bool = False) -> float:
        """The agreed stop code; raises NonFiniteLoss (on every rank alike) before anything is saved.
        ``settle``: also this step's gradient norm (before a checkpoint; a host sync)."""
        stop, bad, write_failed = agree.settle(step, norm_bad) if settle else agree.read(lag=lag)
        if write_failed:  # every rank alike, at this step boundary; the last complete checkpoint stays
            tracker.close(status="FAILED", timeout=10.0)
            checkpoints.wait()  # raises CheckpointWriteFailed on every rank
        if bad is not None:
            at, what = bad
            checkpoints.wait(check=False)  # the write in flight holds a step before the bad one
            tracker.close(status="FAILED", timeout=10.0)
            raise NonFiniteLoss(f"step {at}: non-finite {what} (lr {run.schedule(at - 1):.3g}); stopped before saving "
                                f"it; last complete checkpoint: {layout.latest_checkpoint(run.run_dir) or 'none'}")
        return stop

    def stopped(stop: float) -> Result:
        """Checkpoint ``step`` and hand the run back (a requeued job continues it)."""
        hang.stop()  # the save has the collective timeout
        stop = max(stop, check(lag=False, settle=True))  # every rank reads every posted step before agreeing
        reason = stops.agreed(stop, stops.stop_reason())
        # the write in flight first, then this step's, waited for: the job ends once it is published
        rank0_print(f"stopping at step {step} ({reason}); checkpoint {checkpoints.save(step, wait=True)}")
        tracker.close(timeout=min(run.close_timeout, 10.0))
        return Result(stops.Status.STOPPED, step, str(run.run_dir), reason=reason, loss=log.latest.get("loss"),
                      data_wait=train_log.data_wait, mlflow_run_id=tracker.run_id)

    def run_due(tasks, step: int) -> bool:
        """The due ones of ``tasks``, in order, as one record of ``step``; whether any ran."""
        record, ran = {}, False
        for task in tasks:
            if task.due(step):
                record.update(task.run(step))
                ran = True
        log.write(step, record)
        return ran

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
            loss = run.loss(logits, targets)
            faults.poison_grad(step + 1, loss)
            engine.backward(loss)
            if m < accum - 1:
                engine.step()  # not a boundary: DeepSpeed only counts the micro step
            n = len(labels)
            sums += torch.stack([loss.detach().double() * n, top1_hits(logits, labels).double(),
                                 torch.full((), float(n), dtype=torch.float64, device=device)])
        return sums, images

    stop, batches = 0.0, train_log.timed(loader.forever())  # the log's clock times each fetch
    norm_bad = torch.zeros((), device=device)  # the last optimizer step's gradient norm was not finite
    images = None  # the last batch: its first images feed the attention figures at the end
    engine.train()
    if step:  # a resumed run whose evaluators a stop or a kill cut short
        run_due(after_save, step)
    settle = lambda: check(lag=False, settle=True)  # noqa: E731 - before a save: this step's update was finite
    with Collector() as collector:  # pipeline/train/collector.py: gc.freeze(), generation 2 at log steps
        while step < run.steps:
            faults.hit("step", step + 1)
            eng_lib.set_lr(engine, run.schedule(step))
            # these steps wait for the device anyway
            sync = checkpoints.due(step + 1) or any(task.due(step + 1) for task in run.periodic)

            step_sums, images = forward_backward(batches, step)
            agree.post(step + 1, stops.stop_reason(), step_sums[0], norm_bad, checkpoints.failed)
            stop = max(stop, check(lag=not sync))  # a non-finite loss stops before this optimizer step
            engine.step()  # the boundary: clip, optimizer update
            norm_bad = eng_lib.nonfinite_grad_norm(engine, device)  # read with the next step's flags
            if run.ema is not None:
                run.ema.update(engine.module)
            step += 1
            hang.beat()
            run.window.add(step_sums)

            with hang.busy():  # periodic work and checkpoints may take long: their collectives have timeouts
                ran = run_due(before_save, step)  # the checkpoint covers every record up to its step
                if stop:
                    return stopped(stop)
                saved = checkpoints.maybe_save(step, before=settle)
                ran = run_due(after_save, step) or ran or saved is not None
            collector.at(train_log.due(step))  # generation 2, at log steps only
            if ran:  # periodic work (and that collection) is not training time
                train_log.restart()

    # the end: final checkpoint (unless this step's is saved), consolidated fp32 weights, artifacts
    hang.stop()
    checkpoints.maybe_save(step, last_step=True, before=settle, wait=True)
    checkpoints.wait()  # a background write of the last step: the run succeeds once it is published
    run_dir = run.run_dir
    weights = run_dir / "model.safetensors"
    result = Result(stops.Status.COMPLETED, step, str(run_dir), loss=log.latest.get("loss"),
                    val_top1=log.latest.get("val_top1"), weights=str(weights), data_wait=train_log.data_wait,
                    mlflow_run_id=tracker.run_id)
    # rank 0's work below reads files, not the group: no rank waits inside a collective meanwhile
    if run.rank == 0:
        sd, model_config = load_checkpoint_weights(checkpoints.path(step), consolidate=eng_lib.fp32_state_dict)
        if run.ema is not None:  # the averaged weights are the ones to ship; raw ones stay in checkpoints
            averaged = run.ema.state_dict()
            sd = {k: averaged.get(k, v) for k, v in sd.items()}
        save_weights(sd, model_config, weights)
        png = loss_curve_png(run.history, run_dir / "loss_curve.png")
        for path in (run_dir / "config.yaml", weights, png):
            if path is not None:
                tracker.log_artifact(path)
        for path in _draw_figures(sd, model_config, None if images is None else images[:8], run_dir / "figures"):
            tracker.log_artifact(path, "figures")
        rank0_print(f"done: {weights}")
    wait_for_rank0()  # the weights file exists for every rank's finish
    if finish is not None:
        finish(Finished(engine, tracker, result, run.rank, run.world))
    tracker.close(status="FINISHED", timeout=run.close_timeout)
    return result
