"""An evaluator type added from this one module, as a team would add its own: declared in a config as
``type: tests.custom_evaluator:MeanLogit`` and run, unchanged, inside a training run and by `vitp
eval` (tests/integration/test_fewshot_one_number.py)."""

import torch
from pydantic import Field

from pipeline.config import Section
from pipeline.config.sections import Float
from pipeline.distributed import all_reduce
from pipeline.eval.evaluators import Evaluator


class Options(Section):
    scale: Float = Field(1.0, gt=0)


class MeanLogit(Evaluator):
    """The mean logit of the model's head over ``split`` (x ``scale``) -> {<prefix>mean_logit}."""

    splits = ("split",)
    Options = Options

    @torch.no_grad()
    def run(self, model, step: int) -> dict:
        c = self.ctx
        sums = torch.zeros(2, dtype=torch.float64, device=c.device)
        was_training = model.training
        model.eval()
        for x, _y, valid in self.loader(self.entry.split):  # the same batch count on every rank
            logits = model(self.source.normalize(x.to(c.device)).to(c.dtype)).double()
            w = valid.to(c.device).double()
            sums += torch.stack([(logits.mean(-1) * w).sum(), w.sum()])
        model.train(was_training)
        total, n = all_reduce(sums).tolist()
        return {f"{self.prefix}mean_logit": self.options.scale * total / n}
