"""The one training loop, for pre-training and fine-tuning alike.

    set up: process group, run dir (resume or start), model -> DeepSpeed engine, loader, tracker
    each step:
        forward_backward   over the micro batches; loss and top-1 (precision@1 on multi-label data)
                           accumulate on the device
        agree              one small all-reduce: any rank asked to stop / saw a non-finite loss
        optimizer_step     clip + update (DeepSpeed), EMA
        maybe_log / maybe_eval / maybe_save / few-shot evaluators (pipeline/train/evaluators.py)
    finish: final checkpoint, few-shot, final eval, consolidated weights, artifacts, the caller's ``finish``

What differs between stages comes in as arguments (the model, its parameter groups, what happens to
the final model); the loop never asks which stage it runs.

GPU habits: a step makes no host<->device sync except at ``train.log_every`` (and at eval/save
steps, which sync anyway): the stop/non-finite flags are all-reduced on the device every step and
read one step later, when that all-reduce has long finished; batches are copied from pinned memory
without blocking. Rank-0-only work happens after the last collective of the run.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from pipeline import data as data_lib
from pipeline import faults
from pipeline.config import Config, flatten, to_yaml, write_resolved
from pipeline.data.loader import check_splits
from pipeline.data.mixing import Mixer
from pipeline.distributed import all_reduce, broadcast_from_rank0, rank0_print, rank_world, setup, wait_for_rank0
from pipeline.eval.classify import classify, classify_multilabel
from pipeline.eval.figures import loss_curve_png
from pipeline.tracking import METRICS, JsonlSink, Sinks
from pipeline.tracking.setup import check_access, configured_sinks, start_mlflow
from pipeline.train import checkpoint as ckpt_lib
from pipeline.train import engine as eng_lib
from pipeline.train import stopping
from pipeline.train.ema import Ema
from pipeline.train.evaluators import FewshotEvaluators
from pipeline.train.loss import loss_fn, top1_hits
from pipeline.train.patchdrop import PatchDrop
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
class Window:
    """Loss sum, top-1 hits and sample count since the last log, on the device (no host syncs).

    It is part of the checkpoint's state: a run stopped mid-window resumes with the same sums, so
    its logged records equal an uninterrupted run's step for step.
    """

    def __init__(self, device):
        self.sums = torch.zeros(3, dtype=torch.float64, device=device)
        self.steps = 0

    def add(self, step_sums: torch.Tensor) -> None:
        self.sums += step_sums
        self.steps += 1

    def reduce(self) -> tuple[float, float, int]:
        """All ranks' (mean loss, top-1, samples); the one host sync of a logging step. Resets."""
        loss, hits, n = all_reduce(self.sums).tolist()
        self.sums.zero_()
        self.steps = 0
        return loss / max(n, 1.0), hits / max(n, 1.0), int(n)

    def state_dict(self) -> dict:
        return {"sums": self.sums.tolist(), "steps": self.steps}

    def load_state_dict(self, sd: dict) -> None:
        if sd:
            self.sums.copy_(torch.tensor(sd["sums"], dtype=torch.float64))
            self.steps = int(sd["steps"])


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


def memory_gb() -> dict:
    import psutil

    out = {"rss_gb": psutil.Process().memory_info().rss / 2**30}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda_max_gb"] = torch.cuda.max_memory_allocated() / 2**30
    return out


def evaluate(engine, cfg: Config, source, num_classes: int, device, dtype) -> dict:
    """Top-1 (precision@1 on multi-label data: ``val_prec1``) and loss on the val split through the
    one eval loop, each sample once over the ranks."""
    rank, world = rank_world()
    loader = source.eval_loader(cfg.data, img_size=cfg.model.img_size, batch=cfg.eval.batch, rank=rank,
                                world_size=world, split=cfg.data.val_split)
    multi = source.read_info().multi_label
    res = (classify_multilabel if multi else classify)(
        engine, loader, num_classes, device=device, prepare=source.normalize, dtype=dtype,
        loss=lambda lg, y: loss_fn(cfg.train.loss, lg, y, reduction="none"),
        dummy_shape=(1, 3, cfg.model.img_size, cfg.model.img_size))
    head = {"val_prec1": res.prec1} if multi else {"val_top1": res.top1}
    return {**head, "val_loss": res.loss, "val_n": res.n}


def _headline(record: dict, prefix: str = "") -> str:
    """'top1 0.812' or, on multi-label data, 'prec@1 0.640' from a record's metrics."""
    key = next(k for k in (f"{prefix}top1", f"{prefix}prec1") if k in record)
    return f"{key.replace('prec1', 'prec@1').replace('_', ' ')} {record[key]:.4f}"


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


# --------------------------------------------------------------------------------------------------
# The loop
# --------------------------------------------------------------------------------------------------
def train(cfg: Config, build_model: Callable[[int], torch.nn.Module], *,
          param_groups: Callable[[torch.nn.Module], list[dict]] | None = None, stage: str = "pretrain",
          finish: Callable[[Finished], None] | None = None) -> Result:
    """Train the model ``build_model(num_classes)`` as ``cfg`` says; resume from run.dir's newest
    complete checkpoint. ``param_groups(model)``: optimizer groups (default: decay / no decay);
    ``stage``: the MLflow tag; ``finish(Finished)``: runs on every rank once the final weights are
    published, before the tracker closes (fine-tuning's final evaluation and model registration).
    """
    from pipeline.weights import load_checkpoint_weights, save_weights

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

    step, run_id, run_key = 0, None, None
    if resume_from is not None:
        state = ckpt_lib.resume(engine, resume_from, universal)
        step, run_id = state["step"], state["manifest"].get("mlflow_run_id")
        run_key = state["manifest"].get("mlflow_run_key")
        loader.load_state_dict(state["loader"])
        window.load_state_dict(state["train"].get("window"))
        if ema is not None:
            ema.load_state_dict({k[4:]: v for k, v in state["shared"].items() if k.startswith("ema/")})
        rank0_print(f"resuming from {resume_from} (step {step}, saved by {state['manifest']['world_size']} ranks)")
    if rank == 0:
        write_resolved(cfg, run_dir)
    # rank 0's records: metrics.jsonl (past the resumed step dropped: they run again), MLflow, tracking.sinks
    metrics_file = JsonlSink(run_dir / METRICS, keep_up_to=step) if rank == 0 else None
    history = metrics_file.records if metrics_file else []
    datasets = {cfg.data.train_split: "training", cfg.data.val_split: "evaluation"}
    tracker = Sinks(metrics_file, start_mlflow(
        cfg, run_dir, rank=rank, world_size=world, stage=stage, run_id=run_id, run_key=run_key,
        params=flatten(cfg),  # params: logged only if a new run is made
        datasets=data_lib.dataset_inputs(cfg.data.path, datasets) if rank == 0 else None),
        *configured_sinks(cfg, run_dir, rank=rank))
    fewshot = FewshotEvaluators(cfg, engine, device, dtype, history)
    close_timeout = cfg.tracking.close_timeout_s
    n_params = sum(p.numel() for p in model.parameters()) if cfg.engine.zero_stage < 3 else None
    rank0_print(f"{stage}: {world} rank(s) on {device.type}, ZeRO-{cfg.engine.zero_stage}, {cfg.engine.precision}, "
                f"global batch {cfg.train.global_batch} = {cfg.train.micro_batch} x {accum} accum x {world}, "
                f"steps {step}->{cfg.train.steps}" + (f", {n_params / 1e6:.2f}M params" if n_params else "")
                + (f", {drops.describe()}" if drops.drop else ""))

    def save(at_step: int) -> Path:
        manifest = {"config": flatten(cfg), "model_config": model.config, "zero_stage": cfg.engine.zero_stage,
                    "precision": cfg.engine.precision, "mlflow_run_id": tracker.run_id,
                    "mlflow_run_key": tracker.run_key, "mlflow_uri": tracker.uri}
        shared = {f"ema/{k}": v for k, v in ema.state_dict().items()} if ema is not None else None
        return ckpt_lib.save(engine, run_dir, at_step, loader_state=loader.state_dict(), manifest=manifest,
                             keep=cfg.checkpoint.keep, shared=shared, train_state={"window": window.state_dict()})

    def log(record: dict) -> None:
        tracker.log({k: v for k, v in record.items() if k != "step"}, record["step"])

    def run_fewshot(final: bool = False) -> bool:
        """The few-shot evaluators if ``step`` is one of theirs, after its checkpoint (a kill inside
        them resumes there); each step is logged once. True if they ran."""
        few = fewshot.maybe_run(step, final)
        if few is not None:
            log({"step": step, **few})
        return few is not None

    def check(lag: bool) -> float:
        """The agreed stop code; raises NonFiniteLoss (on every rank alike) before anything is saved."""
        stop, bad = agree.read(lag=lag)
        if bad is not None:
            tracker.close(status="FAILED", timeout=10.0)
            raise NonFiniteLoss(f"step {bad}: non-finite loss (lr {lr_for(cfg, bad - 1):.3g}); stopped before "
                                f"saving it; last complete checkpoint: {ckpt_lib.latest_checkpoint(run_dir) or 'none'}")
        return stop

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

    flops = {on: step_flops(model, cfg, cfg.train.micro_batch * accum, cfg.model.patch_drop if on else 0.0)
             for on in (False, True)}  # by whether the step drops patches
    t_window, saved_at, last, stop = time.perf_counter(), None, {}, 0.0
    batches = loader.forever()
    images = None  # the last batch: its first images feed the attention figures at the end
    engine.train()
    if step < cfg.train.steps:
        run_fewshot()  # a resumed run whose evaluators a stop or a kill cut short
    while step < cfg.train.steps:
        faults.hit("step", step + 1)
        lr = lr_for(cfg, step)
        eng_lib.set_lr(engine, lr)
        nxt = step + 1
        do_log = nxt % cfg.train.log_every == 0 or nxt == cfg.train.steps
        do_eval = bool(cfg.data.val_split and cfg.train.eval_every and nxt % cfg.train.eval_every == 0)
        do_save = bool(cfg.checkpoint.every and nxt % cfg.checkpoint.every == 0) or nxt == cfg.train.steps
        sync_step = do_log or do_eval or do_save  # these steps wait for the device anyway

        step_sums, images = forward_backward(batches, step)
        agree.post(nxt, stopping.stop_reason(), step_sums[0])
        stop = max(stop, check(lag=not sync_step))  # a non-finite loss stops before this optimizer step
        engine.step()  # the boundary: clip, optimizer update
        if ema is not None:
            ema.update(engine.module)
        step = nxt
        window.add(step_sums)

        record = {}
        if do_log:
            steps_in_window = window.steps
            loss, top1, _ = window.reduce()
            dt = (time.perf_counter() - t_window) / max(steps_in_window, 1)
            window_flops = sum(flops[drops.active(s)] for s in range(step - steps_in_window, step))
            record.update({"loss": loss, hit_key: top1}, lr=lr, grad_norm=eng_lib.grad_norm(engine),
                          images_per_s=cfg.train.global_batch / dt, step_s=dt,
                          mfu=window_flops / max(steps_in_window, 1) / dt / (cfg.hardware.peak_tflops * 1e12),
                          skipped=int(sum(loader.skipped.values())), **memory_gb())
            if drops.drop:  # the fraction this window's last step dropped (0 after train.patch_drop_until)
                record["patch_drop"] = drops.drop if drops.active(step - 1) else 0.0
            rank0_print(f"step {step:>7d}/{cfg.train.steps}  loss {loss:.4f}  {_headline(record)}  lr {lr:.2e}  "
                        f"gnorm {record['grad_norm']:.3f}  {record['images_per_s']:.1f} img/s  "
                        f"mfu {record['mfu']:.1%}  rss {record['rss_gb']:.1f}G")
        if do_eval:
            record.update(evaluate(engine, cfg, source, num_classes, device, dtype))
            rank0_print(f"step {step:>7d}  {_headline(record, 'val_')}  ({record['val_n']} images)")
        if record:
            log({"step": step, **record})
            last.update(record)
        if stop:
            stop = max(stop, check(lag=False))  # every rank reads every posted step before agreeing
            reason = "requeue" if stop == 2 else (stopping.stop_reason() or "cancel")
            path = save(step)
            rank0_print(f"stopping at step {step} ({reason}); checkpoint {path}")
            tracker.close(timeout=min(close_timeout, 10.0))  # the requeued job continues the run
            return Result("stopped", step, str(run_dir), reason=reason, loss=last.get("loss"),
                          mlflow_run_id=tracker.run_id)
        if do_save and step < cfg.train.steps:
            save(step)
            saved_at = step
        evaluated = run_fewshot() if step < cfg.train.steps else False
        if record or evaluated or saved_at == step:  # eval, logging and saving are not training time
            t_window = time.perf_counter()

    # the end: final checkpoint, final eval, consolidated fp32 weights, artifacts
    final = save(step) if saved_at != step else ckpt_lib.root(run_dir) / ckpt_lib.tag_for(step)
    run_fewshot(final=True)
    if cfg.data.val_split and "val_n" not in last:
        last.update(evaluate(engine, cfg, source, num_classes, device, dtype))
        rank0_print(f"final {_headline(last, 'val_')} ({last['val_n']} images)")
        log({"step": step, **{k: v for k, v in last.items() if k.startswith("val_")}})
    weights = run_dir / "model.safetensors"
    result = Result("completed", step, str(run_dir), loss=last.get("loss"), val_top1=last.get("val_top1"),
                    weights=str(weights), mlflow_run_id=tracker.run_id)
    # rank 0's work below reads files, not the group: no rank waits inside a collective meanwhile
    if rank == 0:
        sd, model_config = load_checkpoint_weights(final)
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

