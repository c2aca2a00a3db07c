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

from pipeline.train.loss import loss_fn


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
