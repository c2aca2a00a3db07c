"""``type: classify``: the model's own head on ``split``, through the one eval loop
(pipeline/eval/loop.py), each sample once over the ranks.

    -> {<prefix>top1, top5, loss, n, images_per_s} on single-label data;
       {<prefix>prec1, loss, n, images_per_s} (+ mAP with the report) on multi-label data

Inside a run it keeps per-class counts at most (2K numbers); with the report (`vitp eval`, a
fine-tune's final evaluation) it counts the confusion matrix and writes per_class_<name>.json,
confusion_<name>.json/.png (per_class_ap_<name>.json on multi-label data) into the context's out_dir.
"""

from __future__ import annotations

from pathlib import Path

from pipeline.eval.evaluators import Evaluator
from pipeline.eval.loop import classify, classify_multilabel, write_artifacts
from pipeline.files import write_json


class Classify(Evaluator):
    splits = ("split",)

    def __init__(self, entry, options, ctx):
        super().__init__(entry, options, ctx)
        self.batches = self.loader(entry.split)

    def run(self, model, step: int) -> dict:
        c, k = self.ctx, self.info.num_classes
        head = getattr(getattr(model, "module", model), "num_classes", k)
        if head != k:
            raise ValueError(f"{self.data.path}: the dataset has {k} classes but the model's head has {head}; use "
                             "few-shot or the linear probe instead")
        kw = dict(device=c.device, prepare=self.source.normalize, dtype=c.dtype, autocast=c.autocast,
                  loss=self.task.per_sample_loss, dummy_shape=(c.batch, 3, c.img_size, c.img_size))
        self.artifacts = []
        names = list(self.info.classes)
        if self.task.multi_label:
            res = classify_multilabel(model, self.batches, k, mean_ap=c.report, **kw)
            out = {"prec1": res.prec1, "loss": res.loss, "n": float(res.n)}
            if res.mean_ap is not None:
                out["mAP"] = res.mean_ap
            if c.report and c.rank == 0 and c.out_dir is not None:
                self.artifacts.append(write_json(Path(c.out_dir) / f"per_class_ap_{self.name}.json",
                                                 [{"class": i, "name": names[i] if i < len(names) else str(i),
                                                   "ap": a} for i, a in enumerate(res.ap or [])]))
        else:
            res = classify(model, self.batches, k, confusion=c.report, **kw)
            out = {"top1": res.top1, "top5": res.top5, "loss": res.loss, "n": float(res.n)}
            if c.report and c.rank == 0 and c.out_dir is not None:
                self.artifacts += write_artifacts(res, c.out_dir, self.name, names)
        out["images_per_s"] = res.images_per_s
        return {self.prefix + key: v for key, v in out.items()}


EVALUATOR = Classify
