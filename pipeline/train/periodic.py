"""Work the training loop does once in a while, behind one small interface (big_vision's
``for (name, evaluator, every, prefix) in evaluators(): if itstime(step, every): ...``).

A :class:`Periodic` task has a ``name``, says whether it is ``due(step)`` and ``run(step)`` returns
its metrics (rank 0's count; {} elsewhere). The loop runs, after each optimizer step, the due tasks
of one list in order:

    TrainLog        the training window's loss, top-1, lr, throughput, MFU  (every train.log_every)
    Validation      loss and top-1 on the val split                          (every train.eval_every)
    ...             tasks the caller adds (train(tasks=...))
    CheckpointManager  (pipeline/train/checkpoint.py): saves                 (every checkpoint.every)
    FewshotEvaluators  (pipeline/train/evaluators.py)                        (every train.fewshot_every)

A task that also has ``state_dict``/``load_state_dict`` is checkpointed under its ``name``. Tasks
after the checkpoint run once its step is saved, so a kill inside them resumes right there; they
must remember which steps they did (their state) to be re-run safely.
"""

from __future__ import annotations

import time
from typing import Protocol

import torch

from pipeline.config import Config
from pipeline.distributed import all_reduce, rank0_print, rank_world
from pipeline.eval.classify import classify, classify_multilabel
from pipeline.train import engine as eng_lib
from pipeline.train.loss import loss_fn
from pipeline.train.schedule import lr_for


class Periodic(Protocol):
    name: str

    def due(self, step: int) -> bool: ...

    def run(self, step: int) -> dict: ...


def headline(record: dict, prefix: str = "") -> str:
    """'top1 0.812' or, on multi-label data, 'prec@1 0.640' from a record's metrics."""
    key = next(k for k in (f"{prefix}top1", f"{prefix}prec1") if k in record)
    return f"{key.replace('prec1', 'prec@1').replace('_', ' ')} {record[key]:.4f}"


class Window:
    """Loss sum, top-1 hits and sample count since the last log, on the device (no host syncs).

    A checkpointed state: a run stopped mid-window resumes with the same sums, so its logged records
    equal an uninterrupted run's step for step (on the same number of ranks; see checkpoint.Stateful).
    """

    checkpoint_scope = "rank_local"

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
        self.sums.copy_(torch.tensor(sd["sums"], dtype=torch.float64))
        self.steps = int(sd["steps"])


class TrainLog:
    """The training record of the window since the last log: every ``train.log_every`` steps and at
    the last. Time spent in periodic work is not training time: the loop calls ``restart()`` after it."""

    name = "train_log"

    def __init__(self, cfg: Config, window: Window, engine, loader, drops, flops: dict[bool, float],
                 hit_key: str):
        self.cfg, self.window, self.engine, self.loader, self.drops = cfg, window, engine, loader, drops
        self.flops, self.hit_key = flops, hit_key  # flops: model FLOPs of a step, by whether it drops patches
        self.last: dict = {}  # the newest record
        self.restart()

    def restart(self) -> None:
        self.t0 = time.perf_counter()

    def due(self, step: int) -> bool:
        return step % self.cfg.train.log_every == 0 or step == self.cfg.train.steps

    def run(self, step: int) -> dict:
        cfg, drops, n = self.cfg, self.drops, self.window.steps
        loss, top1, _ = self.window.reduce()
        dt = (time.perf_counter() - self.t0) / max(n, 1)
        window_flops = sum(self.flops[drops.active(s)] for s in range(step - n, step))
        lr = lr_for(cfg, step - 1)  # the rate step ``step`` trained with
        record = {"loss": loss, self.hit_key: top1, "lr": lr, "grad_norm": eng_lib.grad_norm(self.engine),
                  "images_per_s": cfg.train.global_batch / dt, "step_s": dt,
                  "mfu": window_flops / max(n, 1) / dt / (cfg.hardware.peak_tflops * 1e12),
                  "skipped": int(sum(self.loader.skipped.values())), **memory_gb(),
                  **(self.loader.read_stats() if hasattr(self.loader, "read_stats") else {})}
        if drops.drop:  # the fraction this window's last step dropped (0 after train.patch_drop_until)
            record["patch_drop"] = drops.drop if drops.active(step - 1) else 0.0
        rank0_print(f"step {step:>7d}/{cfg.train.steps}  loss {loss:.4f}  {headline(record)}  lr {lr:.2e}  "
                    f"gnorm {record['grad_norm']:.3f}  {record['images_per_s']:.1f} img/s  "
                    f"mfu {record['mfu']:.1%}  rss {record['rss_gb']:.1f}G")
        self.last = record
        return record


def memory_gb() -> dict:
    import psutil

    out = {"rss_gb": psutil.Process().memory_info().rss / 2**30}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda_max_gb"] = torch.cuda.max_memory_allocated() / 2**30
    return out


def validate(engine, cfg: Config, source, num_classes: int, device, dtype) -> dict:
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


class Validation:
    """Loss and top-1 on ``data.val_split`` every ``train.eval_every`` steps (collective)."""

    name = "validation"

    def __init__(self, cfg: Config, engine, source, num_classes: int, device, dtype):
        self.cfg, self.args = cfg, (engine, cfg, source, num_classes, device, dtype)
        self.last: dict | None = None  # the newest result of this process

    def due(self, step: int) -> bool:
        every = self.cfg.train.eval_every
        return bool(self.cfg.data.val_split and every and step % every == 0)

    def run(self, step: int) -> dict:
        self.last = validate(*self.args)
        rank0_print(f"step {step:>7d}  {headline(self.last, 'val_')}  ({self.last['val_n']} images)")
        return self.last
