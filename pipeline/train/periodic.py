"""Work the training loop does once in a while, behind one small interface (big_vision's
``for (name, evaluator, every, prefix) in evaluators(): if itstime(step, every): ...``).

A :class:`Periodic` task has a ``name``, says whether it is ``due(step)`` and ``run(step)`` returns
its metrics (rank 0's count; {} elsewhere); ``after_checkpoint`` (default False) says that it runs
once the step's checkpoint is saved. The loop runs, after each optimizer step, the due tasks of
one list in their order, those before the checkpoint, then the checkpoint manager's ``save`` (it
decides whether the step is one to save), then those after it:

    TrainLog        the training window's loss, top-1, lr, throughput, MFU,  (every train.log_every)
                    data_wait
    Evaluations     the declared evaluators that run before the checkpoint   (pipeline/train/evaluations.py)
    ...             tasks the caller adds (build_run(tasks=...))
    Evaluations     the ones that run after it (few-shot, the linear probe)

A task that also has ``state_dict``/``load_state_dict`` is checkpointed under its ``name``. Tasks
after the checkpoint run once its step is saved, so a kill inside them resumes right there; they
must remember which steps they did (their state) to be re-run safely.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Protocol

import torch

from pipeline import faults
from pipeline.data.loader import skip_record
from pipeline.distributed import all_reduce, rank0_print, rank_world
from pipeline.eval.task import Task
from pipeline.train import engine as eng_lib

DATA_WAIT_WARN = 0.1  # a run waiting longer than this share of its training time for batches says so


class Periodic(Protocol):
    name: str
    after_checkpoint: bool  # optional; False when absent

    def due(self, step: int) -> bool: ...

    def run(self, step: int) -> dict: ...


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
    window's sums, the engine's grad norm, the loader's skip counts), the run's :class:`Task` (whose
    hit metric the record carries), its timing (``every``: train.log_every, ``last_step``:
    train.steps) and the step's size (``global_batch`` images)."""

    name = "train_log"

    def __init__(self, schedule, window: Window, engine, loader, drops, flops: dict[bool, float], task: Task,
                 *, every: int, last_step: int, global_batch: int, peak_flops: float):
        self.every, self.steps, self.global_batch = every, last_step, global_batch
        self.schedule, self.window, self.engine, self.loader, self.drops = schedule, window, engine, loader, drops
        self.flops, self.task = flops, task  # flops: model FLOPs of a step, by whether it drops patches
        self.peak_flops = peak_flops  # one rank's accelerator, FLOP/s (hardware.peak_tflops)
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
        record = {"loss": loss, self.task.hit: top1, "lr": lr, "grad_norm": eng_lib.grad_norm(self.engine),
                  "images_per_s": self.global_batch / dt, "step_s": dt,
                  "mfu": window_flops / max(n, 1) / dt / self.peak_flops,
                  "data_wait": data_wait, **skip_record(self.loader.skipped), **memory_gb(),
                  **self.loader.read_stats()}
        if drops.drop:  # the fraction this window's last step dropped (0 after train.patch_drop_until)
            record["patch_drop"] = drops.drop if drops.active(step - 1) else 0.0
        rank0_print(f"step {step:>7d}/{self.steps}  loss {loss:.4f}  {self.task.show(record)}  lr {lr:.2e}  "
                    f"gnorm {record['grad_norm']:.3f}  {record['images_per_s']:.1f} img/s  "
                    f"mfu {record['mfu']:.1%}  rss {record['rss_gb']:.1f}G")
        return record


def memory_gb() -> dict:
    import psutil

    out = {"rss_gb": psutil.Process().memory_info().rss / 2**30}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda_max_gb"] = torch.cuda.max_memory_allocated() / 2**30
    return out
