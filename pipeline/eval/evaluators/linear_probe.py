"""``type: linear_probe``: multinomial logistic regression on the frozen pre-logit features of
``train_split`` (whitened, full-batch L-BFGS: pipeline/eval/linear.py), scored on ``test_split``.

    options: max_train_images (in all, over every rank; default all), l2 (default: chosen),
             l2_grid [1e-5 .. 1e-1], holdout_fraction 0.2, seed 0
    -> {<prefix>top1, <prefix>train_top1, <prefix>l2 (the l2 used), <prefix>heldout_top1 (its held-out
       score, when chosen)} (rank 0 fits the probe on the gathered features)

The l2 is chosen on a held-out part of the training features (fewshot.choose_probe_l2), then the probe
is fitted on all of them. Both the image cap and the hold-out are drawn by a seeded permutation of
the split's positions, and the gathered features are put in position order before any fit: 1 rank
and 2 ranks report the same number.
"""

from __future__ import annotations

import numpy as np
import torch
from pydantic import Field

from pipeline.config import ConfigError, Section
from pipeline.config.sections import Float, Int, List
from pipeline.distributed import gather_object, wait_for_rank0
from pipeline.eval import linear as fs
from pipeline.eval.evaluators import Evaluator, prelogits


class Options(Section):
    max_train_images: Int | None = Field(None, ge=1)  # in all (a seeded draw of the split's positions)
    l2: Float | None = Field(None, gt=0)  # a fixed l2; None: chosen from l2_grid on held-out data
    l2_grid: List(Float) = Field(default_factory=lambda: list(fs.PROBE_L2_GRID))
    holdout_fraction: Float = Field(0.2, gt=0.0, lt=1.0)
    seed: Int = 0


class LinearProbe(Evaluator):
    splits = ("train_split", "test_split")
    after_checkpoint = True
    Options = Options

    def __init__(self, entry, options, ctx):
        super().__init__(entry, options, ctx)
        if self.info.multi_label:
            raise ConfigError(f"{self.name}: {self.data.path} is multi-label; the linear probe needs single-label "
                              "data")
        if not options.l2_grid or any(x <= 0 for x in options.l2_grid):
            raise ConfigError(f"{self.name}: l2_grid: one or more values > 0; got {options.l2_grid}")
        n, cap = self.loader(entry.train_split).num_samples, options.max_train_images
        keep = None if cap is None or cap >= n else np.sort(np.random.default_rng(options.seed).permutation(n)[:cap])
        self.train_loader = self.loader(entry.train_split, positions=None if keep is None else keep.tolist())

    def _train_batches(self):
        """(uint8 images, labels, valid, positions of the rows) of this rank's share of the kept images."""
        ld = self.train_loader
        pos = list(ld.rank_positions)
        for b, (x, y, valid) in enumerate(ld):
            yield x, y, valid, torch.tensor(pos[b * ld.batch:(b + 1) * ld.batch] + [-1] * ld.batch)[:ld.batch]

    def run(self, model, step: int) -> dict:
        """Features of this rank's share, gathered to rank 0, which chooses the l2 and fits the probe."""
        was_training = model.training
        model.eval()
        try:
            train = prelogits(model, self._train_batches(), self.ctx, self.source.normalize)
            test = prelogits(model, self.loader(self.entry.test_split), self.ctx, self.source.normalize)
        finally:
            model.train(was_training)
        parts = gather_object((train[:3], test[:2]))
        out = {}
        if self.ctx.rank == 0:
            tr_x, tr_y, tr_pos = (torch.cat(c) for c in zip(*(p[0] for p in parts)))
            order = torch.argsort(tr_pos)  # position order: the same rows in the same order on any world size
            tr_x, tr_y = tr_x[order], tr_y[order]
            te_x, te_y = (torch.cat(c) for c in zip(*(p[1] for p in parts)))
            o, k = self.options, self.info.num_classes
            if o.l2 is None:
                l2, held = fs.choose_probe_l2(tr_x, tr_y, k, o.l2_grid, o.holdout_fraction, o.seed)
                out[f"{self.prefix}heldout_top1"] = held[l2]
            else:
                l2 = o.l2
            lp = fs.linear_probe(tr_x, tr_y, te_x, te_y, k, l2=l2)
            out.update({f"{self.prefix}top1": lp["top1"], f"{self.prefix}train_top1": lp["train_top1"],
                        f"{self.prefix}l2": float(l2)})
        wait_for_rank0()  # the fit is rank 0's alone: the others wait outside any collective's timeout
        return out


EVALUATOR = LinearProbe
