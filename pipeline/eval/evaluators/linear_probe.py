"""``type: linear_probe``: multinomial logistic regression on the frozen pre-logit features of
``train_split`` (whitened, full-batch L-BFGS: pipeline/eval/fewshot.py), scored on ``test_split``.

    options: max_train_images (per rank; default all), l2 1e-4
    -> {<prefix>top1, <prefix>train_top1} (rank 0; every rank fits the same probe on the gathered
       features)
"""

from __future__ import annotations

import torch
from pydantic import Field

from pipeline.config import ConfigError, Section
from pipeline.config.sections import Float, Int
from pipeline.distributed import gather_object, wait_for_rank0
from pipeline.eval import fewshot as fs
from pipeline.eval.evaluators import Evaluator, prelogits


class Options(Section):
    max_train_images: Int | None = Field(None, ge=1)
    l2: Float = Field(1e-4, gt=0)


class LinearProbe(Evaluator):
    splits = ("train_split", "test_split")
    after_checkpoint = True
    Options = Options

    def __init__(self, entry, options, ctx):
        super().__init__(entry, options, ctx)
        if self.info.multi_label:
            raise ConfigError(f"{self.name}: {self.data.path} is multi-label; the linear probe needs single-label "
                              "data")

    def run(self, model, step: int) -> dict:
        """Features of this rank's share, gathered to rank 0, which fits the probe."""
        was_training = model.training
        model.eval()
        try:
            train = prelogits(model, self.loader(self.entry.train_split), self.ctx, self.source.normalize,
                              max_images=self.options.max_train_images)
            test = prelogits(model, self.loader(self.entry.test_split), self.ctx, self.source.normalize)
        finally:
            model.train(was_training)
        parts = gather_object((train[:2], test[:2]))
        out = {}
        if self.ctx.rank == 0:
            tr_x, tr_y = (torch.cat(c) for c in zip(*(p[0] for p in parts)))
            te_x, te_y = (torch.cat(c) for c in zip(*(p[1] for p in parts)))
            lp = fs.linear_probe(tr_x, tr_y, te_x, te_y, self.info.num_classes, l2=self.options.l2)
            out = {f"{self.prefix}top1": lp["top1"], f"{self.prefix}train_top1": lp["train_top1"]}
        wait_for_rank0()  # the fit is rank 0's alone: the others wait outside any collective's timeout
        return out


EVALUATOR = LinearProbe
