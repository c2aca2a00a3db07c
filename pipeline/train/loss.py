"""The training objective, one function for pre-training, fine-tuning and evaluation."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def loss_fn(kind: str, logits: torch.Tensor, targets: torch.Tensor, *, label_smoothing: float = 0.0,
            reduction: str = "mean") -> torch.Tensor:
    """logits [B, K] (fp32); targets: labels [B] int64 or soft targets [B, K] (mixup/smoothing already
    applied by the loader) -> scalar ("mean" over the batch, or "sum").

    "sigmoid": the paper's per-class sigmoid cross-entropy, summed over classes (JFT is multi-label);
    "softmax": cross-entropy.
    """
    soft = targets.ndim == 2
    if kind == "sigmoid":
        target = targets.to(logits.dtype) if soft else F.one_hot(targets, logits.shape[-1]).to(logits.dtype)
        per = F.binary_cross_entropy_with_logits(logits, target, reduction="none").sum(-1)
    elif soft:
        per = -(targets * F.log_softmax(logits, dim=-1)).sum(-1)
    else:
        return F.cross_entropy(logits, targets, label_smoothing=label_smoothing, reduction=reduction)
    return {"sum": per.sum, "mean": per.mean}.get(reduction, lambda: per)()
