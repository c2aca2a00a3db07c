"""``type: fewshot``: few-shot linear accuracy of the frozen representation, the paper's measure of
pre-training (closed-form ridge regression; its Figures 5, 6 and 8), as big_vision runs it.

    options: shots [1, 5, 10, 25], seeds 3, l2 1024 (big_vision's)
    built (once)
        the train split's labels: each rank reads the ``.cls`` of every W-th shard (tar headers and
        label bytes, no image), one all_gather_object joins them; the k-shot subsets of
        pipeline/eval/linear.py's one definition (per seed, per class a permutation seeded by it,
        its first k: nested; a k some class cannot supply is skipped, said once). The images read
        are the union over seeds of the largest subsets.
    run
        pre-logit features (the head's input) of the subsets and of the whole test split: each
        sample on one rank, the same number of forward calls on every rank (ZeRO-3 gathers
        parameters inside forward); one gather_object to rank 0, which solves the ridge for each
        seed and k and scores the test split while the others wait outside any collective
        -> {<prefix><name>/<k>shot: mean accuracy over seeds, <prefix><name>/<k>shot_std} (rank 0)

Decoded images stay in memory between runs (the eval transform is deterministic) while the
context's cache budget lasts. Needs single-label data.
"""

from __future__ import annotations

import numpy as np
import torch
from pydantic import Field, model_validator
from pydantic_core import PydanticCustomError

from pipeline import faults
from pipeline.config import ConfigError, Section
from pipeline.config.sections import Float, Int, List
from pipeline.distributed import all_gather_object, gather_object, rank0_print, wait_for_rank0
from pipeline.eval import linear as fs
from pipeline.eval.evaluators import Evaluator, prelogits


def train_labels(source, split: str, rank: int, world: int) -> np.ndarray:
    """Labels [N] of every sample of ``split`` in position order (each rank reads its parts)."""
    parts: dict[int, list] = {}
    for got in all_gather_object(source.split_labels(split, rank, world)):
        parts.update(got)
    return np.array([y for p in sorted(parts) for y in parts[p]], dtype=np.int64)


class Options(Section):
    shots: List(Int) = Field(default_factory=lambda: [1, 5, 10, 25])
    seeds: Int = Field(3, ge=1)
    l2: Float = Field(fs.FEWSHOT_L2, gt=0)  # the ridge's regulariser: big_vision's 2^10

    @model_validator(mode="after")
    def _shots(self):
        if not self.shots or any(k < 1 for k in self.shots):
            raise PydanticCustomError("vitp_check", "{message}",
                                      {"message": f"shots: each shot count must be >= 1; got {self.shots}"})
        return self


class Fewshot(Evaluator):
    splits = ("train_split", "test_split")
    after_checkpoint = True
    Options = Options

    @staticmethod
    def default_prefix(name: str) -> str:
        return "fewshot/"

    def __init__(self, entry, options, ctx):
        super().__init__(entry, options, ctx)
        if self.info.multi_label:
            raise ConfigError(f"{self.name}: {self.data.path} is multi-label; few-shot needs single-label data")
        labels = train_labels(self.source, entry.train_split, ctx.rank, ctx.world)
        self.subsets = fs.shot_subsets(labels, list(options.shots), options.seeds, self.info.num_classes)
        for k, why in self.subsets.skipped.items():
            rank0_print(f"few-shot {self.name}: {k}-shot skipped ({why})")
        self.loaders = {"train": self.loader(entry.train_split, positions=self.subsets.positions().tolist()),
                        "test": self.loader(entry.test_split)}
        size = sum(ld.num_batches * ld.batch for ld in self.loaders.values()) * 3 * ctx.img_size ** 2
        self.cache = size <= ctx.cache_bytes
        ctx.cache_bytes -= size if self.cache else 0
        self.cached: dict[str, list] = {}

    @property
    def key_prefix(self) -> str:
        return f"{self.prefix}{self.name}/"

    def _batches(self, part: str):
        """(uint8 images, labels, valid, positions of the rows) of this rank's share of ``part``."""
        if part in self.cached:
            yield from self.cached[part]
            return
        ld, kept = self.loaders[part], []
        pos = list(ld.rank_positions)
        for b, (x, y, valid) in enumerate(ld):
            p = torch.tensor(pos[b * ld.batch:(b + 1) * ld.batch] + [-1] * ld.batch)[:ld.batch]
            if self.cache:
                kept.append((x, y, valid, p))
            yield x, y, valid, p
        if self.cache:
            self.cached[part] = kept

    def _features(self, model, part: str, step: int) -> list[torch.Tensor]:
        """This rank's pre-logit features [n, D], labels [n] and positions [n] of ``part``."""
        return prelogits(model, self._batches(part), self.ctx, self.source.normalize,
                         on_batch=lambda b: faults.hit("fewshot", step) if b == 0 else None)

    def run(self, model, step: int) -> dict:
        if not self.subsets.shots:  # every shot count was skipped (said when built); the same on every rank
            return {}
        was_training = model.training
        model.eval()
        try:
            train, test = self._features(model, "train", step), self._features(model, "test", step)
        finally:
            model.train(was_training)
        parts = gather_object((train, test))  # rank 0: every rank's; others: None
        out = {}
        if self.ctx.rank == 0:
            o = self.options
            tr_x, tr_y, tr_pos = (torch.cat(c) for c in zip(*(p[0] for p in parts)))
            te_x, te_y, _ = (torch.cat(c) for c in zip(*(p[1] for p in parts)))
            res = fs.fewshot_accuracy(tr_x, tr_y, te_x, te_y, self.info.num_classes, self.subsets.shots, o.seeds,
                                      o.l2, positions=tr_pos, subsets=self.subsets)
            out = fs.fewshot_metrics(res, self.key_prefix)
            self.text = fs.format_fewshot({**res, **{k: {"skipped": w} for k, w in self.subsets.skipped.items()}})
        wait_for_rank0()  # the solve is rank 0's alone: the others wait outside any collective's timeout
        return out


EVALUATOR = Fewshot
