"""The training objective, one function for pre-training, fine-tuning and evaluation: the task's
(:mod:`pipeline.eval.task`, below train, which evaluation reads without importing training)."""

from pipeline.eval.task import loss_fn, top1_hits

__all__ = ["loss_fn", "top1_hits"]
