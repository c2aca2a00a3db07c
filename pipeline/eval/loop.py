"""The one evaluation loop: top-1/top-5, loss, per-class accuracy and the confusion matrix on a split
(the classify evaluator's, pipeline/eval/evaluators: during training, after fine-tuning and in `vitp
eval`); on multi-label data precision@1 and mean average precision instead. The features few-shot
and the probe fit on are read by pipeline/eval/evaluators' ``prelogits``.

Every rank reads its own part of the split (the loader hands each sample to exactly one rank), so
the counts are summed across ranks in one all-reduce: of the confusion matrix for `vitp eval` (top-1,
per-class and the matrix itself all follow from it), of per-class hits and samples during training
(K² counts would not fit a 21k-class head). Every rank
runs the same number of forward calls (ZeRO-3 gathers parameters inside forward): padding rows
are computed and masked, and a rank whose batches ran out runs dummy ones until all have.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from pipeline.distributed import all_gather_object, all_reduce, rank_world
from pipeline.eval.figures import pyplot
from pipeline.files import write_json

# images [B, C, H, W] (or uint8 for `prepare`), labels [B][, valid bool [B]: pipeline.data.loader pads the
# last batches of a rank with invalid rows so all ranks run the same number of batches]
Batch = tuple[torch.Tensor, ...]


def _is_dist() -> bool:
    return rank_world()[1] > 1


@dataclass
class ClassifyResult:
    """Counts over the whole split (all ranks): correct[c] and support[c], the hits and samples of class
    c; confusion[t, p] (when counted: `vitp eval`), the samples of class t predicted p."""

    correct: torch.Tensor  # [K] int64
    support: torch.Tensor  # [K] int64
    top5_correct: int
    loss_sum: float
    images_per_s: float = 0.0
    class_names: list[str] = field(default_factory=list)
    confusion: torch.Tensor | None = None  # [K, K] int64

    @property
    def n(self) -> int:
        return int(self.support.sum())

    @property
    def top1(self) -> float:
        return float(self.correct.sum()) / max(self.n, 1)

    @property
    def top5(self) -> float:
        return self.top5_correct / max(self.n, 1)

    @property
    def loss(self) -> float:
        return self.loss_sum / max(self.n, 1)

    @property
    def per_class(self) -> list[float | None]:
        """Accuracy of each class (None for a class absent from the split)."""
        return [None if s == 0 else c / s for c, s in zip(self.correct.tolist(), self.support.tolist())]

    def metrics(self, prefix: str = "val") -> dict[str, float]:
        return {f"{prefix}/top1": self.top1, f"{prefix}/top5": self.top5, f"{prefix}/loss": self.loss,
                f"{prefix}/n": float(self.n)}


def _to_device(batch: Batch, device, prepare, dtype, num_classes: int | None = None):
    """-> (model input, labels, valid mask) on ``device``; padding rows stay in the batch (label
    clamped to 0, valid False), so every batch keeps its shape and nothing waits on the device.
    Multi-hot labels [B, K] stay as they are."""
    x, y = batch[0], batch[1]
    valid = batch[2] if len(batch) > 2 and batch[2] is not None else torch.ones(len(y), dtype=torch.bool)
    if num_classes is not None and y.ndim == 2 and y.shape[1] != num_classes:
        raise ValueError(f"multi-hot labels have {y.shape[1]} classes, expected {num_classes}")
    if num_classes is not None and y.ndim == 1:  # on the host, before the copy: no device sync
        real = y[valid]
        if real.numel() and int(real.max()) >= num_classes:
            raise ValueError(f"label {int(real.max())} out of range for {num_classes} classes")
    x = x.to(device, non_blocking=True)
    x = prepare(x) if prepare is not None else x
    y = y if y.ndim == 2 else y.clamp(min=0).long()
    return x.to(dtype), y.to(device, non_blocking=True), valid.to(device, non_blocking=True)


def _same_count(batches, device) -> int:
    """The most batches any rank has (one all-reduce, before the loop): every rank runs that many
    forward calls, the ones past its own end on dummy inputs."""
    n = torch.tensor([len(batches)], dtype=torch.int64, device=device)
    return int(all_reduce(n, "max").item()) if _is_dist() else len(batches)


@torch.no_grad()
def classify(model: torch.nn.Module, batches: Iterable[Batch], num_classes: int, *,
             device: torch.device | str = "cpu", prepare: Callable | None = None,
             dtype: torch.dtype = torch.float32, autocast: torch.dtype | None = None,
             loss: Callable | None = None, dummy_shape: tuple[int, ...] | None = None,
             confusion: bool = True) -> ClassifyResult:
    """Run `model` over `batches` and count top-1/top-5 hits, summed over all ranks.

    batches: a sized iterable of (images [B, C, H, W], labels [B][, valid [B]]); `prepare` maps the
    raw images on the device (e.g. uint8 -> normalised float). model(x): logits [B, num_classes].
    ``loss(logits, y)`` -> per-sample loss [B] (default: cross-entropy). ``dummy_shape``: the image
    shape [B, C, H, W] a rank feeds while others still have batches (the model's forward may be
    collective); the batches' own B, so a compiled model sees no other shape. Labels >= num_classes
    are an error. No host<->device sync inside the loop.
    ``confusion``: also count the [K, K] confusion matrix (`vitp eval` writes it); without it only
    per-class hits and samples (2K counts: what in-training validation logs).
    """
    was_training = model.training
    model.eval()
    loss = loss or (lambda lg, t: F.cross_entropy(lg, t, reduction="none"))
    K = num_classes
    # confusion: [K*K] (t*K + p) + top-5; else per class hits [K] and samples [K] + top-5: 2K, not K² (at
    # ImageNet-21k's 21,843 classes the matrix is 3.8 GB on every rank and in every all-reduce)
    counts = torch.zeros((K * K if confusion else 2 * K) + 1, dtype=torch.int64, device=device)
    sums = torch.zeros(2, dtype=torch.float64, device=device)  # loss sum, images
    k5 = min(5, K)
    t0 = time.perf_counter()
    for logits, y, valid in _lockstep(model, batches, K, device, prepare, dtype, autocast, dummy_shape):
        w = valid.long()  # padding rows add 0
        pred = logits.argmax(-1)
        if confusion:
            counts[:-1].scatter_add_(0, y * K + pred, w)
        else:
            counts[:K].scatter_add_(0, y, (pred == y).long() * w)
            counts[K:-1].scatter_add_(0, y, w)
        counts[-1:] += ((logits.topk(k5, -1).indices == y[:, None]).any(-1).long() * w).sum()
        sums += torch.stack([(loss(logits, y).double() * w).sum(), w.sum().double()])
    counts = all_reduce(counts)
    sums = all_reduce(sums)
    elapsed = torch.tensor([max(time.perf_counter() - t0, 1e-9)], dtype=torch.float64, device=device)
    elapsed = all_reduce(elapsed, "max")  # the ranks ran side by side: all images / the slowest rank
    model.train(was_training)
    counts, sums = counts.cpu(), sums.cpu()
    speed = float(sums[1]) / max(float(elapsed.cpu()[0]), 1e-9)
    if confusion:
        matrix = counts[:-1].view(K, K)
        return ClassifyResult(matrix.diag().clone(), matrix.sum(1), int(counts[-1]), float(sums[0]),
                              images_per_s=speed, confusion=matrix)
    return ClassifyResult(counts[:K], counts[K:-1], int(counts[-1]), float(sums[0]), images_per_s=speed)


@dataclass
class MultiLabelResult:
    """Multi-label scores over the whole split (all ranks)."""

    hits: int  # images whose top prediction is one of their labels
    n: int
    loss_sum: float
    ap: list[float | None] | None = None  # per class average precision (None: no positive in the split)
    images_per_s: float = 0.0

    @property
    def prec1(self) -> float:
        """big_vision's prec@1: the share of images whose highest-scoring class is one of their labels."""
        return self.hits / max(self.n, 1)

    @property
    def loss(self) -> float:
        return self.loss_sum / max(self.n, 1)

    @property
    def mean_ap(self) -> float | None:
        """Mean over classes with a positive of their average precision (None when not computed)."""
        got = [a for a in self.ap or [] if a is not None]
        return sum(got) / len(got) if got else None

    def metrics(self, prefix: str = "val") -> dict[str, float]:
        out = {f"{prefix}/prec1": self.prec1, f"{prefix}/loss": self.loss, f"{prefix}/n": float(self.n)}
        if self.mean_ap is not None:
            out[f"{prefix}/mAP"] = self.mean_ap
        return out


def average_precision(scores: torch.Tensor, targets: torch.Tensor) -> list[float | None]:
    """Average precision of each class: scores [N, K], targets [N, K] bool -> K values (None for a
    class without positives). AP = sum over score thresholds of precision x recall gained there;
    tied scores share one threshold, as in sklearn's ``average_precision_score``."""
    n = scores.shape[0]
    if n == 0:
        return [None] * scores.shape[1]
    s, order = scores.double().sort(dim=0, descending=True, stable=True)
    t = targets.gather(0, order).double()
    tp = t.cumsum(0)
    rows = torch.arange(n, dtype=torch.int64).view(-1, 1).expand_as(s)
    end = torch.ones_like(s, dtype=torch.bool)
    end[:-1] = s[1:] != s[:-1]  # the last row of each group of tied scores
    last = torch.where(end, rows, torch.full_like(rows, n)).flip(0).cummin(0).values.flip(0)
    precision = tp.gather(0, last) / (last + 1).double()  # at the end of each row's tie group
    pos = t.sum(0)
    ap = (precision * t).sum(0) / pos.clamp_min(1)
    return [float(a) if p > 0 else None for a, p in zip(ap.tolist(), pos.tolist())]


@torch.no_grad()
def classify_multilabel(model: torch.nn.Module, batches: Iterable[Batch], num_classes: int, *,
                        device: torch.device | str = "cpu", prepare: Callable | None = None,
                        dtype: torch.dtype = torch.float32, autocast: torch.dtype | None = None,
                        loss: Callable | None = None, dummy_shape: tuple[int, ...] | None = None,
                        mean_ap: bool = False) -> MultiLabelResult:
    """``classify`` for multi-hot labels [B, K]: precision@1 and loss, summed over all ranks, and
    with ``mean_ap`` every class's average precision. ``loss(logits, y)`` -> [B] (default: the
    per-class sigmoid cross-entropy). mAP needs every score: each rank keeps its [n, K] scores on
    the host and all ranks gather them at the end (N x K floats; fine for downstream sets such as
    VOC or COCO, not meant for an 18k-class JFT split)."""
    was_training = model.training
    model.eval()
    loss = loss or (lambda lg, t: F.binary_cross_entropy_with_logits(lg, t.float(), reduction="none").sum(-1))
    sums = torch.zeros(3, dtype=torch.float64, device=device)  # prec@1 hits, loss sum, images
    kept: list[tuple[torch.Tensor, torch.Tensor]] = []
    t0 = time.perf_counter()
    for logits, y, valid in _lockstep(model, batches, num_classes, device, prepare, dtype, autocast, dummy_shape,
                                      multi_label=True):
        w = valid.double()
        hit = y.gather(1, logits.argmax(-1, keepdim=True)).squeeze(1).double()
        sums += torch.stack([(hit * w).sum(), (loss(logits, y).double() * w).sum(), w.sum()])
        if mean_ap:
            keep = valid.cpu()
            kept.append((logits.cpu()[keep], y.cpu()[keep]))
    sums = all_reduce(sums)
    elapsed = torch.tensor([max(time.perf_counter() - t0, 1e-9)], dtype=torch.float64, device=device)
    elapsed = all_reduce(elapsed, "max")
    model.train(was_training)
    ap = None
    if mean_ap:
        scores = torch.cat([k[0] for k in kept]) if kept else torch.zeros(0, num_classes)
        targets = torch.cat([k[1] for k in kept]) if kept else torch.zeros(0, num_classes, dtype=torch.bool)
        if _is_dist():
            parts = all_gather_object((scores, targets))  # plain tensors between our own ranks
            scores, targets = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
        ap = average_precision(scores, targets.bool())
    hits, loss_sum, n = sums.cpu().tolist()
    return MultiLabelResult(int(hits), int(n), loss_sum, ap, images_per_s=n / max(float(elapsed.cpu()[0]), 1e-9))


def _lockstep(model, batches, num_classes: int, device, prepare, dtype, autocast, dummy_shape, multi_label=False):
    """(logits [B, K] float32, labels, valid [B]) of every batch, on ``device``; as many forward calls
    on every rank (past its own batches, on a dummy batch of ``dummy_shape`` with no valid row)."""
    total = _same_count(batches, device)
    it = iter(batches)
    for _ in range(total):
        batch = next(it, None)
        if batch is None:  # this rank is done; keep the collective forward calls in step
            if dummy_shape is None:
                raise RuntimeError("ranks have unequal eval batch counts; pass dummy_shape")
            n = dummy_shape[0]
            y = torch.zeros(n, num_classes, dtype=torch.bool) if multi_label else torch.zeros(n, dtype=torch.long)
            batch = (torch.zeros(dummy_shape, dtype=torch.uint8), y, torch.zeros(n, dtype=torch.bool))
        x, y, valid = _to_device(batch, device, prepare, dtype, num_classes)
        with torch.autocast(torch.device(device).type, dtype=autocast or torch.bfloat16, enabled=autocast is not None):
            logits = model(x)
        if logits.shape[-1] != num_classes:
            raise ValueError(f"model gives {logits.shape[-1]} logits but the dataset has {num_classes} classes")
        yield logits.float(), y, valid


# --------------------------------------------------------------------------------------------------
# Artifacts
# --------------------------------------------------------------------------------------------------
def plot_confusion(confusion: torch.Tensor, path: str | Path, class_names: list[str] | None = None) -> Path:
    """Row-normalised confusion matrix as a PNG (rows: true class, columns: predicted)."""
    plt = pyplot()
    k = confusion.shape[0]
    rows = confusion.double().sum(1, keepdim=True).clamp_min(1)
    norm = (confusion.double() / rows).numpy()
    size = min(4 + 0.25 * k, 24)
    fig, ax = plt.subplots(figsize=(size, size))
    im = ax.imshow(norm, vmin=0, vmax=1, cmap="Blues")
    if k <= 40:  # beyond that the tick labels are unreadable anyway
        names = class_names if class_names and len(class_names) == k else [str(i) for i in range(k)]
        ax.set_xticks(range(k), names, rotation=90, fontsize=7)
        ax.set_yticks(range(k), names, fontsize=7)
    ax.set_xlabel("predicted")
    ax.set_ylabel("true")
    fig.colorbar(im, ax=ax, fraction=0.046)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_artifacts(res: ClassifyResult, out_dir: str | Path, split: str = "val",
                    class_names: list[str] | None = None) -> list[Path]:
    """per_class_{split}.json, confusion_{split}.json and confusion_{split}.png into `out_dir`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    names = class_names or [str(i) for i in range(res.confusion.shape[0])]
    support = res.confusion.sum(1).tolist()
    per_class = [{"class": c, "name": names[c] if c < len(names) else str(c), "accuracy": a,
                  "support": support[c]} for c, a in enumerate(res.per_class)]
    p1 = write_json(out / f"per_class_{split}.json", per_class)
    p2 = write_json(out / f"confusion_{split}.json", res.confusion.tolist(), indent=None)
    p3 = plot_confusion(res.confusion, out / f"confusion_{split}.png", names)
    return [p1, p2, p3]


def write_results(results: dict, run_dir: str | Path) -> Path:
    """Merge `results` into RUN_DIR/results.json (atomic replace; rank 0 only calls this)."""
    import json

    path = Path(run_dir) / "results.json"
    old = json.loads(path.read_text()) if path.is_file() else {}
    return write_json(path, {**old, **results})
