"""Work the training loop does once in a while, behind one small interface (big_vision's
``for (name, evaluator, every, prefix) in evaluators(): if itstime(step, every): ...``).

A :class:`Periodic` task has a ``name``, says whether it is ``due(step)`` and ``run(step)`` returns
its metrics (rank 0's count; {} elsewhere). The loop runs, after each optimizer step, the due tasks
of one list in order:

    TrainLog        the training window's loss, top-1, lr, throughput, MFU,  (every train.log_every)
                    data_wait
    Validation      loss and top-1 on the val split                          (every train.eval_every)
    ...             tasks the caller adds (build_run(tasks=...))
    CheckpointManager  (pipeline/train/checkpoint.py): saves                 (every checkpoint.every)
    FewshotEvaluators  (pipeline/train/evaluators.py)                        (every train.fewshot_every)

A task that also has ``state_dict``/``load_state_dict`` is checkpointed under its ``name``. Tasks
after the checkpoint run once its step is saved, so a kill inside them resumes right there; they
must remember which steps they did (their state) to be re-run safely.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Protocol

import torch

from pipeline import faults
from pipeline.distributed import all_reduce, rank0_print, rank_world
from pipeline.eval.classify import classify, classify_multilabel
from pipeline.train import engine as eng_lib

DATA_WAIT_WARN = 0.1  # a run waiting longer than this share of its training time for batches says so


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

    def reduce(self, wait: float = 0.0) -> tuple[float, float, int, float]:
        """All ranks' (mean loss, top-1, samples, the largest of their ``wait``: this rank's share of the
        window spent waiting for batches); one all-reduce, the one host sync of a logging step. Resets."""
        rank, world = rank_world()
        waits = torch.zeros(world, dtype=torch.float64, device=self.sums.device)
        waits[rank] = wait  # a fill on the device: each rank's value in its own slot, summed = gathered
        loss, hits, n, *each = all_reduce(torch.cat([self.sums, waits])).tolist()
        self.sums.zero_()
        self.steps = 0
        return loss / max(n, 1.0), hits / max(n, 1.0), int(n), max(each)

    def state_dict(self) -> dict:
        return {"sums": self.sums.tolist(), "steps": self.steps}

    def load_state_dict(self, sd: dict) -> None:
        self.sums.copy_(torch.tensor(sd["sums"], dtype=torch.float64))
        self.steps = int(sd["steps"])


class TrainLog:
    """The training record of the window since the last log: every ``train.log_every`` steps and at
    the last. Time spent in periodic work is not training time: the loop calls ``restart()`` after it.

    Built once from the run's :class:`~pipeline.train.schedule.Schedule`, the parts it reads (the
    window's sums, the engine's grad norm, the loader's skip counts), its timing (``every``:
    train.log_every, ``last_step``: train.steps) and the step's size (``global_batch`` images)."""

    name = "train_log"

    def __init__(self, schedule, window: Window, engine, loader, drops, flops: dict[bool, float], hit_key: str,
                 *, every: int, last_step: int, global_batch: int, peak_flops: float):
        self.every, self.steps, self.global_batch = every, last_step, global_batch
        self.schedule, self.window, self.engine, self.loader, self.drops = schedule, window, engine, loader, drops
        self.flops, self.hit_key = flops, hit_key  # flops: model FLOPs of a step, by whether it drops patches
        self.peak_flops = peak_flops  # one rank's accelerator, FLOP/s (hardware.peak_tflops)
        self.last: dict = {}  # the newest record
        self.wait_total = self.time_total = 0.0  # seconds waited for batches / trained, over logged windows
        self.warned = False
        self.restart()

    def restart(self) -> None:
        self.t0 = time.perf_counter()
        self.waited = 0.0  # seconds this rank waited for its next batch since t0

    def timed(self, batches: Iterator) -> Iterator:
        """``batches``, with the time each ``next`` takes added to the window's wait (host clocks only:
        no device sync; the batch's copy to the GPU is queued after it)."""
        while True:
            t = time.perf_counter()
            faults.slow_batch()
            batch = next(batches)
            self.waited += time.perf_counter() - t
            yield batch

    @property
    def data_wait(self) -> float | None:
        """The run's share of training time spent waiting for batches (on the slowest rank of each
        window), over the windows logged so far in this job; None before the first."""
        return self.wait_total / self.time_total if self.time_total else None

    def due(self, step: int) -> bool:
        return step % self.every == 0 or step == self.steps

    def run(self, step: int) -> dict:
        drops, n = self.drops, self.window.steps
        elapsed = time.perf_counter() - self.t0
        loss, top1, _, data_wait = self.window.reduce(min(self.waited / elapsed, 1.0) if elapsed > 0 else 0.0)
        self.wait_total, self.time_total = self.wait_total + data_wait * elapsed, self.time_total + elapsed
        if data_wait > DATA_WAIT_WARN and not self.warned:
            self.warned = True
            rank0_print(f"warning: step {step}: {data_wait:.0%} of the training time went to waiting for the next "
                        f"batch (over {DATA_WAIT_WARN:.0%}): the loader is the bottleneck; more data.workers, or "
                        "faster storage for data.path")
        dt = elapsed / max(n, 1)
        window_flops = sum(self.flops[drops.active(s)] for s in range(step - n, step))
        lr = self.schedule(step - 1)  # the rate step ``step`` trained with
        record = {"loss": loss, self.hit_key: top1, "lr": lr, "grad_norm": eng_lib.grad_norm(self.engine),
                  "images_per_s": self.global_batch / dt, "step_s": dt,
                  "mfu": window_flops / max(n, 1) / dt / self.peak_flops,
                  "data_wait": data_wait, "skipped": int(sum(self.loader.skipped.values())), **memory_gb(),
                  **self.loader.read_stats()}
        if drops.drop:  # the fraction this window's last step dropped (0 after train.patch_drop_until)
            record["patch_drop"] = drops.drop if drops.active(step - 1) else 0.0
        rank0_print(f"step {step:>7d}/{self.steps}  loss {loss:.4f}  {headline(record)}  lr {lr:.2e}  "
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


class Validation:
    """Loss and top-1 (precision@1 on multi-label data: ``val_prec1``) on the val split every
    ``train.eval_every`` steps (collective), through the one eval loop, each sample once over the ranks.

    ``loader``: this rank's share of the val split (re-read at each validation), None without one;
    ``loss(logits, targets)``: per-sample losses [B]."""

    name = "validation"

    def __init__(self, loader, *, every: int, engine, source, num_classes: int, device, dtype,
                 loss: Callable, img_size: int, batch: int):
        self.loader, self.every, self.engine, self.source = loader, every, engine, source
        self.num_classes, self.device, self.dtype, self.loss = num_classes, device, dtype, loss
        # a full batch (eval.batch), as the loader's: a compiled block sees one evaluation shape
        self.dummy_shape = (batch, 3, img_size, img_size)
        self.last: dict | None = None  # the newest result of this process

    @property
    def enabled(self) -> bool:
        return self.loader is not None

    def due(self, step: int) -> bool:
        return bool(self.enabled and self.every and step % self.every == 0)

    def run(self, step: int) -> dict:
        multi = self.source.read_info().multi_label
        kw = dict(device=self.device, prepare=self.source.normalize, dtype=self.dtype, loss=self.loss,
                  dummy_shape=self.dummy_shape)
        # per-class counts at most: the confusion matrix (K² counts) is `vitp eval`'s
        res = (classify_multilabel(self.engine, self.loader, self.num_classes, **kw) if multi else
               classify(self.engine, self.loader, self.num_classes, confusion=False, **kw))
        head = {"val_prec1": res.prec1} if multi else {"val_top1": res.top1}
        self.last = {**head, "val_loss": res.loss, "val_n": res.n}
        rank0_print(f"step {step:>7d}  {headline(self.last, 'val_')}  ({self.last['val_n']} images)")
        return self.last
