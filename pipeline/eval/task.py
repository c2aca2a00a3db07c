"""The task's kind, decided once per dataset: single- or multi-label (the dataset says) and the loss
(``train.loss``, as big_vision names its loss: softmax or sigmoid cross-entropy). Every evaluator and
every logger reads its metric names from here: a record's hit metric is top-1, or precision@1
(big_vision's prec@1) on multi-label data.

    task = Task.of(info, loss="sigmoid")
    task.hit                          "top1" | "prec1"
    task.per_sample_loss(logits, y)   [B]
    task.show(record, "val_")         "top1 0.8120" | "prec@1 0.6400"
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Task:
    multi_label: bool
    loss: str = "softmax"  # train.loss: "softmax" | "sigmoid"

    @classmethod
    def of(cls, info, loss: str | None = None) -> Task:
        """The task of a dataset ``info`` (pipeline.data.Info) trained with ``loss`` (None, unknown:
        softmax on single-label data, sigmoid on multi-label data)."""
        multi = bool(info.multi_label)
        return cls(multi, loss or ("sigmoid" if multi else "softmax"))

    @property
    def hit(self) -> str:
        return "prec1" if self.multi_label else "top1"

    def per_sample_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """logits [B, K], labels [B] or multi-hot [B, K] -> the run's loss of each sample [B]."""
        return loss_fn(self.loss, logits, targets, reduction="none")

    def show(self, record: dict, prefix: str = "") -> str:
        """The record's hit metric as a log shows it: 'top1 0.8120' or 'prec@1 0.6400'."""
        name = "prec@1" if self.multi_label else "top1"
        return f"{name} {record[prefix + self.hit]:.4f}"


# The objective, one function for pre-training, fine-tuning and evaluation (pipeline.train.loss names it
# for the training loop): here, below train, so evaluation needs nothing of training.
def loss_fn(kind: str, logits: torch.Tensor, targets: torch.Tensor, *, label_smoothing: float = 0.0,
            reduction: str = "mean") -> torch.Tensor:
    """logits [B, K] (fp32); targets: labels [B] int64, or soft / multi-hot targets [B, K] (mixup,
    smoothing and multi-label sets already applied by the loader) -> scalar ("mean" over the batch,
    or "sum"), or per-sample losses [B] ("none").

    "sigmoid": the paper's per-class sigmoid cross-entropy, summed over classes (JFT is multi-label):
    every class of a multi-hot row is a positive. "softmax": cross-entropy; a [B, K] row is first
    normalised into a distribution, so an image with k labels puts 1/k on each (multi-label softmax
    as in Mahajan et al. 2018); one-hot and mixed rows already sum to 1.
    """
    soft = targets.ndim == 2
    if kind == "sigmoid":
        target = targets.to(logits.dtype) if soft else F.one_hot(targets, logits.shape[-1]).to(logits.dtype)
        per = F.binary_cross_entropy_with_logits(logits, target, reduction="none").sum(-1)
    elif soft:
        t = targets.to(logits.dtype)
        t = t / t.sum(-1, keepdim=True).clamp_min(1e-12)  # an all-zero padding row stays zero
        per = -(t * F.log_softmax(logits, dim=-1)).sum(-1)
    else:
        return F.cross_entropy(logits, targets, label_smoothing=label_smoothing, reduction=reduction)
    return {"sum": per.sum, "mean": per.mean}.get(reduction, lambda: per)()


def top1_hits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """How many rows' top prediction is right, as a device scalar (no host sync): equal to the label
    [B], or one of the image's labels for multi-hot labels [B, K] (big_vision's ``prec@1``)."""
    top = logits.argmax(-1)
    if labels.ndim == 2:
        return labels.gather(1, top[:, None]).sum()
    return (top == labels).sum()
