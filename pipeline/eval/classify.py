"""Evaluation of a ViT: top-1/top-5 on a split, per-class accuracy, confusion matrix; few-shot linear
evaluation and a linear probe on frozen features (pipeline/eval/fewshot.py).

Every rank reads its own part of the split (the loader hands each sample to exactly one rank), so
the counts are summed across ranks (one all-reduce of the confusion matrix: top-1, per-class and
the matrix itself all follow from it); few-shot features are gathered to every rank.

    vitp eval --checkpoint runs/ft --data shards/ --split val [--fewshot] [--linear-probe]
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from pipeline.eval import fewshot as fs

# images [B, C, H, W] (or uint8 for `prepare`), labels [B][, valid bool [B]: pipeline.data.loader pads the
# last batches of a rank with invalid rows so all ranks run the same number of batches]
Batch = tuple[torch.Tensor, ...]


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _is_dist() -> bool:
    return _world()[1] > 1


@dataclass
class ClassifyResult:
    """Counts over the whole split (all ranks). confusion[t, p]: samples of class t predicted p."""

    confusion: torch.Tensor  # [K, K] int64
    top5_correct: int
    loss_sum: float
    images_per_s: float = 0.0
    class_names: list[str] = field(default_factory=list)

    @property
    def n(self) -> int:
        return int(self.confusion.sum())

    @property
    def top1(self) -> float:
        return float(self.confusion.diag().sum()) / max(self.n, 1)

    @property
    def top5(self) -> float:
        return self.top5_correct / max(self.n, 1)

    @property
    def loss(self) -> float:
        return self.loss_sum / max(self.n, 1)

    @property
    def per_class(self) -> list[float | None]:
        """Accuracy of each class (None for a class absent from the split)."""
        support = self.confusion.sum(1)
        return [None if s == 0 else float(self.confusion[c, c]) / float(s) for c, s in enumerate(support.tolist())]

    def metrics(self, prefix: str = "val") -> dict[str, float]:
        return {f"{prefix}/top1": self.top1, f"{prefix}/top5": self.top5, f"{prefix}/loss": self.loss,
                f"{prefix}/n": float(self.n)}


def _to_device(batch: Batch, device, prepare, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = batch[0], batch[1]
    if len(batch) > 2 and batch[2] is not None and not bool(batch[2].all()):
        x, y = x[batch[2]], y[batch[2]]  # drop padding rows: they are no samples
    x = x.to(device, non_blocking=True)
    x = prepare(x) if prepare is not None else x
    return x.to(dtype), y.to(device, non_blocking=True).long()


@torch.no_grad()
def classify(model: torch.nn.Module, batches: Iterable[Batch], num_classes: int, *,
             device: torch.device | str = "cpu", prepare: Callable | None = None,
             dtype: torch.dtype = torch.float32, autocast: torch.dtype | None = None) -> ClassifyResult:
    """Run `model` over `batches` and count top-1/top-5 hits, summed over all ranks.

    batches: (images [B, C, H, W], labels [B]); `prepare` maps the raw images on the device (e.g.
    uint8 -> normalised float). model(x): logits [B, num_classes]. Labels >= num_classes are an error.
    """
    was_training = model.training
    model.eval()
    confusion = torch.zeros(num_classes * num_classes, dtype=torch.int64, device=device)
    top5 = torch.zeros((), dtype=torch.int64, device=device)
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    k5 = min(5, num_classes)
    seen, t0 = 0, time.perf_counter()
    for batch in batches:
        x, y = _to_device(batch, device, prepare, dtype)
        if not y.numel():
            continue
        with torch.autocast(torch.device(device).type, dtype=autocast, enabled=autocast is not None):
            logits = model(x)
        if logits.shape[-1] != num_classes:
            raise ValueError(f"model gives {logits.shape[-1]} logits but the dataset has {num_classes} classes")
        if y.numel() and int(y.max()) >= num_classes:
            raise ValueError(f"label {int(y.max())} out of range for {num_classes} classes")
        logits = logits.float()
        pred = logits.argmax(-1)
        # flat index t*K + p -> one bincount per batch instead of a K x K scatter
        confusion += torch.bincount(y * num_classes + pred, minlength=num_classes * num_classes)
        top5 += (logits.topk(k5, -1).indices == y[:, None]).any(-1).sum()
        loss_sum += F.cross_entropy(logits, y, reduction="sum").double()
        seen += y.numel()
    if str(device).startswith("cuda"):
        torch.cuda.synchronize(device)
    elapsed = time.perf_counter() - t0
    if _is_dist():
        counts = torch.cat([confusion, top5[None]])
        dist.all_reduce(counts)
        # loss sum and images/s of the whole job (the ranks ran side by side, so rates add up)
        floats = torch.stack([loss_sum, torch.tensor(seen / max(elapsed, 1e-9), dtype=torch.float64,
                                                      device=device)])
        dist.all_reduce(floats)
        confusion, top5 = counts[:-1], counts[-1]
        loss_sum, ips = floats[0], float(floats[1])
    else:
        ips = seen / max(elapsed, 1e-9)
    model.train(was_training)
    return ClassifyResult(confusion.view(num_classes, num_classes).cpu(), int(top5), float(loss_sum),
                          images_per_s=ips)


@torch.no_grad()
def extract_features(model: torch.nn.Module, batches: Iterable[Batch], *, device: torch.device | str = "cpu",
                     prepare: Callable | None = None, dtype: torch.dtype = torch.float32,
                     max_images: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Frozen representations (the input of the classifier head), gathered from all ranks.

    -> features [N, R|D] float32 on the CPU, labels [N]; N sums every rank's images (each rank
    stops after `max_images` of its own).
    """
    was_training = model.training
    model.eval()
    feats, labels, n = [], [], 0
    for batch in batches:
        if max_images is not None and n >= max_images:
            break
        x, y = _to_device(batch, device, prepare, dtype)
        if not y.numel():
            continue
        feats.append(model.forward_head(model.forward_features(x), pre_logits=True).float().cpu())
        labels.append(y.cpu())
        n += y.numel()
    model.train(was_training)
    width = getattr(model, "pre_logits", None)
    width = width.out_features if width is not None else model.width
    f = torch.cat(feats) if feats else torch.zeros(0, width)
    y = torch.cat(labels) if labels else torch.zeros(0, dtype=torch.long)
    if max_images is not None:
        f, y = f[:max_images], y[:max_images]
    if _is_dist():
        parts: list = [None] * _world()[1]
        dist.all_gather_object(parts, (f, y))  # plain tensors between our own ranks
        f = torch.cat([p[0] for p in parts])
        y = torch.cat([p[1] for p in parts])
    return f, y


# --------------------------------------------------------------------------------------------------
# Artifacts
# --------------------------------------------------------------------------------------------------
def plot_confusion(confusion: torch.Tensor, path: str | Path, class_names: list[str] | None = None) -> Path:
    """Row-normalised confusion matrix as a PNG (rows: true class, columns: predicted)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
    p1 = out / f"per_class_{split}.json"
    p1.write_text(json.dumps(per_class, indent=1))
    p2 = out / f"confusion_{split}.json"
    p2.write_text(json.dumps(res.confusion.tolist()))
    p3 = plot_confusion(res.confusion, out / f"confusion_{split}.png", names)
    return [p1, p2, p3]


def write_results(results: dict, run_dir: str | Path) -> Path:
    """Merge `results` into RUN_DIR/results.json (atomic replace; rank 0 only calls this)."""
    path = Path(run_dir) / "results.json"
    old = json.loads(path.read_text()) if path.is_file() else {}
    old.update(results)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(old, indent=1, sort_keys=True))
    os.replace(tmp, path)
    return path


def fewshot_summary(res: dict[int, dict], prefix: str = "fewshot") -> dict[str, float]:
    """{shots: {mean, std}} -> flat metrics {'fewshot/5shot': mean, 'fewshot/5shot_std': std}."""
    out = {}
    for k, r in res.items():
        if "mean" in r:
            out[f"{prefix}/{k}shot"] = r["mean"]
            out[f"{prefix}/{k}shot_std"] = r["std"]
    return out


# --------------------------------------------------------------------------------------------------
# Whole evaluations over a dataset (used by `vitp eval` and by the transfer stage)
# --------------------------------------------------------------------------------------------------
def _data_module(path: str):
    """pipeline.data.loader reads shards (and dispatches `synthetic:`); synthetic works without it."""
    from pipeline.data import synthetic

    if synthetic.is_synthetic(path):
        return synthetic
    from pipeline.data import loader as data

    return data


def eval_batches(data_cfg, split: str, *, img_size: int, batch: int, rank: int = 0, world_size: int = 1):
    """This rank's share of `split`: (uint8 [B, 3, H, W], int64 [B]); every sample once over all ranks."""
    mod = _data_module(data_cfg.path)
    return mod.EvalLoader(data_cfg, img_size=img_size, batch=batch, rank=rank, world_size=world_size, split=split)


def dataset_info(data_cfg) -> tuple[int, list[str]]:
    """(num_classes, class names) of a prep output (pipeline.data.loader.Info) or a synthetic spec (dict)."""
    info = _data_module(data_cfg.path).read_info(data_cfg.path)
    get = info.get if isinstance(info, dict) else lambda k: getattr(info, k, None)
    names = list(get("classes") or [])
    return int(get("num_classes") or len(names)), names


def evaluate_model(model: torch.nn.Module, data_cfg, *, split: str = "val", batch: int = 64,
                   device: torch.device | str = "cpu", classify_split: bool = True,
                   fewshot_cfg=None, linear_probe: bool = False, out_dir: str | Path | None = None,
                   autocast: torch.dtype | None = None, train_split: str = "train",
                   max_train_images: int | None = None) -> dict:
    """Run the requested evaluations of `model` on the dataset at data_cfg.path; returns flat metrics.

    classify_split: top-1/top-5/loss/per-class on `split` (needs a head whose class count matches the
    dataset). fewshot_cfg (an EvalCfg): few-shot ridge on features of `train_split` -> `split`.
    linear_probe: logistic regression on the same features. Artifacts (per-class, confusion PNG) are
    written by rank 0 into `out_dir`. Collective when distributed: every rank must call it.
    """
    rank, world = _world()
    k, names = dataset_info(data_cfg)
    img = model.img_size[0] if isinstance(model.img_size, tuple) else int(model.img_size)
    prepare = _data_module(data_cfg.path).normalize
    load = lambda s: eval_batches(data_cfg, s, img_size=img, batch=batch, rank=rank, world_size=world)  # noqa: E731
    out: dict = {}
    artifacts: list[Path] = []
    if classify_split:
        if getattr(model, "num_classes", 0) != k:
            raise ValueError(f"{data_cfg.path}: the dataset has {k} classes but the model's head has "
                             f"{getattr(model, 'num_classes', 0)}; use few-shot or the linear probe instead")
        res = classify(model, load(split), k, device=device, prepare=prepare, autocast=autocast)
        out.update(res.metrics(split))
        out[f"{split}/images_per_s"] = res.images_per_s
        if rank == 0 and out_dir is not None:
            artifacts += write_artifacts(res, out_dir, split, names)
    if fewshot_cfg is not None or linear_probe:
        tr_x, tr_y = extract_features(model, load(train_split), device=device, prepare=prepare,
                                      max_images=max_train_images)
        te_x, te_y = extract_features(model, load(split), device=device, prepare=prepare)
        if fewshot_cfg is not None:
            few = fs.fewshot_eval(tr_x, tr_y, te_x, te_y, k, shots=fewshot_cfg.fewshot_shots,
                                  seeds=fewshot_cfg.fewshot_seeds, l2=fewshot_cfg.fewshot_l2)
            out.update(fewshot_summary(few))
            out["fewshot_text"] = fs.format_fewshot(few)
        if linear_probe:
            lp = fs.linear_probe(tr_x, tr_y, te_x, te_y, k)
            out["linear_probe/top1"] = lp["top1"]
            out["linear_probe/train_top1"] = lp["train_top1"]
    out["artifacts"] = [str(p) for p in artifacts]
    return out


def main(argv: list[str]) -> int:
    from launch.cli import parser_for

    p = parser_for("eval", "Evaluate a checkpoint: top-1/top-5, per-class accuracy and confusion matrix on a "
                           "split; few-shot linear evaluation and a linear probe on frozen features.")
    p.add_argument("--checkpoint", required=True,
                   help="a run directory (pretrain/transfer), a DeepSpeed checkpoint folder, or a weights file "
                        "(vitp .safetensors; timm .pth/.safetensors or JAX .npz need --model)")
    p.add_argument("--data", required=True, help="a `vitp prep` output folder")
    p.add_argument("--split", default="val", help="split to score (default: val)")
    p.add_argument("--fewshot", action="store_true", help="few-shot linear evaluation (train split -> --split)")
    p.add_argument("--shots", default="1,5,10,25", help="few-shot shots per class (default: 1,5,10,25)")
    p.add_argument("--seeds", type=int, default=3, help="few-shot draws per shot count (default: 3)")
    p.add_argument("--l2", type=float, default=1.0, help="few-shot ridge regulariser (default: 1.0)")
    p.add_argument("--linear-probe", action="store_true", help="logistic regression on frozen features")
    p.add_argument("--no-top1", action="store_true", help="skip scoring the model's own head")
    p.add_argument("--model", default=None, help="architecture for weight files without a config, e.g. vit_b16")
    p.add_argument("--img-size", type=int, default=None, help="evaluate at this resolution (pos-emb resampled)")
    p.add_argument("--batch", type=int, default=64, help="images per rank per batch (default: 64)")
    p.add_argument("--max-train-images", type=int, default=None,
                   help="per rank, cap on training images read for few-shot / linear probe features")
    p.add_argument("--out", default=None, help="where results.json and artifacts go (default: the run dir, "
                                               "else ./eval_<checkpoint name>)")
    args = p.parse_args(argv)
    import sys

    from pipeline.distributed import leave_process_group, rank0_print
    from pipeline.config import ConfigError, DataCfg, EvalCfg
    from pipeline.transfer import load_model

    try:
        shots = [int(s) for s in args.shots.split(",") if s.strip()]
        few = EvalCfg(fewshot_shots=shots, fewshot_seeds=args.seeds, fewshot_l2=args.l2) if args.fewshot else None
        if few is not None and (any(s < 1 for s in shots) or args.l2 <= 0 or args.seeds < 1):
            raise ConfigError(f"--shots/--seeds/--l2: need shots >= 1, seeds >= 1, l2 > 0; got "
                              f"{args.shots}, {args.seeds}, {args.l2}")
        if not Path(args.data).exists() and not args.data.startswith("synthetic:"):
            raise FileNotFoundError(f"--data {args.data}: no such dataset folder")
        _init_dist_from_env()
        device = "cuda" if torch.cuda.is_available() else "cpu"
        model = load_model(args.checkpoint, variant=args.model, img_size=args.img_size).to(device)
        out_dir = Path(args.out) if args.out else _default_out(args.checkpoint)
        res = evaluate_model(model, DataCfg(path=args.data), split=args.split, batch=args.batch, device=device,
                             classify_split=not args.no_top1, fewshot_cfg=few, linear_probe=args.linear_probe,
                             out_dir=out_dir, max_train_images=args.max_train_images)
    except (ConfigError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if _world()[0] == 0:
        text = res.pop("fewshot_text", None)
        path = write_results({f"eval/{k}": v for k, v in res.items()}, out_dir)
        for key, v in res.items():
            if isinstance(v, float):
                rank0_print(f"{key:<28} {v:.4f}")
        if text:
            rank0_print(text)
        rank0_print(f"results: {path}")
    leave_process_group()
    return 0


def _default_out(checkpoint: str) -> Path:
    c = Path(checkpoint)
    return c if c.is_dir() else Path(f"eval_{c.stem}")


def _init_dist_from_env() -> None:
    """Join a process group when a launcher started several ranks (gloo on CPU, nccl on GPUs)."""
    from pipeline.distributed import dist_env, export_env, init_process_group

    env = dist_env()
    if env.world_size > 1 and not dist.is_initialized():
        export_env(env)
        if torch.cuda.is_available():
            torch.cuda.set_device(env.local_rank)
        init_process_group(env)  # same rendezvous, timeout and one-line errors as every stage
