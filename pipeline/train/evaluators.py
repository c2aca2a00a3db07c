"""Few-shot evaluators inside a training run, as big_vision runs them during pre-training (the
paper judges pre-training by few-shot linear accuracy: its Figures 5, 6 and 8).

For every folder of ``eval.fewshot_data`` (a `vitp prep` output with ``train`` and ``test`` splits,
named by its folder or as ``NAME=PATH``):

    at the start of the run (once)
        the train split's labels: each rank reads the ``.cls`` of every W-th shard (tar headers and
        label bytes, no image), one all_gather_object joins them
        the k-shot subsets of pipeline/eval/fewshot.py's one definition: for each of
        ``eval.fewshot_seeds`` seeds, per class a permutation seeded by it, its first k for each k of
        ``eval.fewshot_shots`` (nested; the same subsets in every run, at every step and in `vitp
        eval`; a k that some class cannot supply is skipped, said once); the images read are the
        union over seeds of the largest subsets
    every ``train.fewshot_every`` steps and at the end
        pre-logit features (the head's input) of the subsets and of the whole test split, from the
        weights the run exports (the EMA's, swapped in and back, when optim.ema is on): each sample
        on one rank, the same number of forward calls through the engine on every rank (ZeRO-3
        gathers parameters inside forward, so nothing else may call the model meanwhile)
        one gather_object of the features to rank 0, which solves the closed-form ridge for each
        seed and k (pipeline/eval/fewshot.py, ``eval.fewshot_l2``) and scores the test split;
        the others wait for it on the side group (no rank waits inside a collective's timeout)
        -> {"fewshot/<name>/<k>shot": mean accuracy over seeds, "fewshot/<name>/<k>shot_std": its
           std, "fewshot/seconds": wall time} on rank 0 (the first
           time also "fewshot/setup_seconds", the label scan)

Decoded test and subset images stay in memory between evaluations (the eval transform is
deterministic) while a rank's share fits ``CACHE_BYTES``; beyond that they are read again each time.

Which steps are done travels with the checkpoint (the newest evaluated step is a checkpointed state)
and is completed from the run's log: a step is evaluated once, after that step's checkpoint, and a
resumed run (after a stop, or a kill during an evaluator) evaluates the step it resumes at unless
``metrics.jsonl`` already holds its few-shot record. A stop request that arrives
while an evaluator runs is honoured at a step boundary right after it, as always.
"""

from __future__ import annotations

import contextlib
import time

import numpy as np
import torch

from pipeline import faults
from pipeline.config import DataCfg, fewshot_sets
from pipeline.data import DataError
from pipeline.data import loader as shard_loader
from pipeline.data.shards import SkipCounts, read_shard
from pipeline.distributed import all_gather_object, all_reduce, gather_object, rank0_print, rank_world, wait_for_rank0
from pipeline.eval import fewshot as fs
from pipeline.train.ema import Ema

CACHE_BYTES = 1 << 30  # decoded uint8 images kept per rank, all evaluators together
PREFIX = "fewshot/"


def train_labels(info, split: str, rank: int, world: int) -> np.ndarray:
    """Labels [N] of every sample of ``split`` in position order; rank r reads shards r, r+W, ..."""
    sp = info.split(split)
    mine = {s: [x[2] for x in read_shard(sp.urls[s], SkipCounts(), 0, None, num_classes=info.num_classes, read=False)]
            for s in range(rank, len(sp.urls), world)}
    shards: dict[int, list[int]] = {}
    for part in all_gather_object(mine):
        shards.update(part)
    return np.array([y for s in range(len(sp.urls)) for y in shards[s]], dtype=np.int64)


class _Set:
    """One few-shot dataset: its subset, its test split, and (maybe) their decoded batches."""

    def __init__(self, name: str, path: str, *, shots: list[int], seeds: int, batch: int, img_size: int,
                 crop_pct: float, rank: int, world: int):
        self.name = name
        self.data = DataCfg(path=path, workers=0, eval_crop_pct=crop_pct, val_split="test")
        try:
            self.info = shard_loader.read_info(path)
            self.info.split("train")
            self.info.split("test")
        except DataError as e:
            raise DataError(f"eval.fewshot_data: {e}") from None
        if self.info.multi_label:
            raise DataError(f"eval.fewshot_data: {path} is multi-label; few-shot needs single-label data")
        labels = train_labels(self.info, "train", rank, world)
        self.subsets = fs.shot_subsets(labels, list(shots), seeds, self.info.num_classes)
        for k, why in self.subsets.skipped.items():
            rank0_print(f"few-shot {self.name}: {k}-shot skipped ({why})")
        self.subset = self.subsets.positions()  # the union over seeds of the largest subsets
        kw = dict(img_size=img_size, batch=batch, rank=rank, world_size=world, num_workers=0)
        self.loaders = {"train": shard_loader.EvalLoader(self.data, split="train", positions=self.subset.tolist(),
                                                         **kw),
                        "test": shard_loader.EvalLoader(self.data, split="test", **kw)}
        self.cached: dict[str, list] = {}

    def rank_bytes(self, img_size: int) -> int:
        return sum(ld.num_batches * ld.batch for ld in self.loaders.values()) * 3 * img_size * img_size

    def batches(self, part: str, cache: bool):
        """(uint8 images, labels, valid, positions of the rows) of this rank's share of ``part``."""
        if part in self.cached:
            yield from self.cached[part]
            return
        ld, kept = self.loaders[part], []
        pos = list(ld.rank_positions)
        for b, (x, y, valid) in enumerate(ld):
            p = torch.tensor(pos[b * ld.batch:(b + 1) * ld.batch] + [-1] * ld.batch)[:ld.batch]
            item = (x, y, valid, p)
            if cache:
                kept.append(item)
            yield item
        if cache:
            self.cached[part] = kept


class FewshotEvaluators:
    """The few-shot evaluators of a run, as one periodic task of the training loop ("fewshot": due every
    ``train.fewshot_every`` steps and at ``last_step``, after that step's checkpoint) and one checkpointed
    state (its progress: the newest evaluated step, equal on every rank).

    Built once from values of four sections (the builder reads them): ``data`` (eval.fewshot_data's
    ``[name=path, ...]``), ``shots``, ``l2``, ``batch`` (eval.fewshot_shots, eval.fewshot_l2, eval.batch),
    ``every``/``last_step`` (train.fewshot_every, train.steps), ``img_size`` (model.img_size) and
    ``crop_pct`` (data.eval_crop_pct)."""

    name = "fewshot"
    checkpoint_scope = "shared"

    def __init__(self, engine, device, dtype, *, data: list[str], shots: list[int], seeds: int, l2: float,
                 batch: int, every: int, last_step: int, img_size: int, crop_pct: float, ema: Ema | None = None):
        self.engine, self.device, self.dtype, self.seeds, self.l2, self.ema = engine, device, dtype, seeds, l2, ema
        self.rank, self.world = rank_world()
        t0 = time.perf_counter()
        self.every, self.last_step = every, last_step
        self.sets = [_Set(n, p, shots=shots, seeds=seeds, batch=batch, img_size=img_size, crop_pct=crop_pct,
                          rank=self.rank, world=self.world) for n, p in fewshot_sets(data)]
        budget = sum(s.rank_bytes(img_size) for s in self.sets)
        self.cache = budget <= CACHE_BYTES
        self.done = 0  # the newest evaluated step
        self.setup_s = time.perf_counter() - t0  # logged with the first evaluation

    def state_dict(self) -> dict:
        return {"done": self.done}

    def load_state_dict(self, sd: dict) -> None:
        self.done = max(self.done, int(sd["done"]))

    def skip_logged(self, history: list[dict]) -> None:
        """Collective. A step evaluated after the resumed checkpoint was written (a kill came later)
        is in metrics.jsonl (rank 0 read it) but not in the checkpoint: count it done, on every rank."""
        logged = max((r["step"] for r in history if any(k.startswith(PREFIX) for k in r)), default=0)
        if self.sets:
            logged = int(all_reduce(torch.tensor([logged], dtype=torch.int64, device=self.device), "max").item())
        self.done = max(self.done, logged)

    def due(self, step: int) -> bool:
        return bool(self.sets) and step > self.done and (
            step == self.last_step or (self.every > 0 and step % self.every == 0))

    def run(self, step: int) -> dict:
        """Run every evaluator (collective) -> its metrics on rank 0 ({} on the others)."""
        t0 = time.perf_counter()
        out: dict = {}
        for s in self.sets:
            out.update(self._run(s, step))
        self.done = step
        if self.rank == 0:
            out[PREFIX + "seconds"] = time.perf_counter() - t0
            if self.setup_s is not None:
                out[PREFIX + "setup_seconds"], self.setup_s = self.setup_s, None
            rank0_print(f"step {step:>7d}  " + "  ".join(f"{k[len(PREFIX):]} {v:.3f}" for k, v in out.items()
                                                        if not k.endswith(("seconds", "_std"))))
        return out

    @torch.no_grad()
    def _features(self, s: _Set, part: str, step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This rank's pre-logit features [n, D] float32 (host), labels [n], positions [n] of ``part``.
        The features stay on the device until the last batch: one copy back, no sync per batch."""
        model = self.engine
        head = getattr(getattr(model, "module", model), "head", None)
        got: list[torch.Tensor] = []
        hook = head.register_forward_pre_hook(lambda _m, a: got.append(a[0])) if head is not None else None
        feats, labels, valid, pos = [], [], [], []
        try:
            for b, (x, y, ok, p) in enumerate(s.batches(part, self.cache)):
                x = shard_loader.normalize(x.to(self.device, non_blocking=True)).to(self.dtype)
                out = model(x)
                feats.append((got.pop() if hook is not None else out).float())
                labels.append(y)
                valid.append(ok)
                pos.append(p)
                if b == 0:
                    faults.hit("fewshot", step)
        finally:
            if hook is not None:
                hook.remove()
        keep = torch.cat(valid)
        return torch.cat(feats).cpu()[keep], torch.cat(labels)[keep], torch.cat(pos)[keep]

    def _run(self, s: _Set, step: int) -> dict:
        if not s.subsets.shots:  # every shot count was skipped (said at the start); the same on every rank
            return {}
        was_training = self.engine.training
        self.engine.eval()
        module = getattr(self.engine, "module", self.engine)
        try:  # the weights the run exports: the average when optim.ema is on (put back after)
            with self.ema.applied(module) if self.ema is not None else contextlib.nullcontext():
                train = self._features(s, "train", step)
                test = self._features(s, "test", step)
        finally:
            self.engine.train(was_training)
        parts = gather_object((train, test))  # rank 0: every rank's; others: None
        out = {}
        if self.rank == 0:
            tr_x, tr_y, tr_pos = (torch.cat(c) for c in zip(*(p[0] for p in parts)))
            te_x, te_y, _ = (torch.cat(c) for c in zip(*(p[1] for p in parts)))
            res = fs.fewshot_accuracy(tr_x, tr_y, te_x, te_y, s.info.num_classes, s.subsets.shots, self.seeds,
                                      self.l2, positions=tr_pos, subsets=s.subsets)
            out = fs.fewshot_metrics(res, f"{PREFIX}{s.name}/")
        wait_for_rank0()  # the solve is rank 0's alone: the others wait outside any collective's timeout
        return out
