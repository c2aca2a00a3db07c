"""The training objective, one function for pre-training, fine-tuning and evaluation."""

from __future__ import annotations

import torch
import torch.nn.functional as F


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
