"""`vitp demo`: the whole product on this machine, on real data, with the real parts.

scikit-learn's handwritten digits (1797 real 8x8 scans) → an ImageFolder of upsampled PNGs and a
manifest with a stratified train/val/test split → `prep` (WebDataset shards) → `pretrain` (2 local
ranks, DeepSpeed ZeRO-2, low resolution; a few-shot evaluator on the digits' own train/test splits
every 250 steps draws the few-shot curve in MLflow) → `transfer` (2x resolution, 2D pos-emb resampling) →
`eval` on the held-out test split (top-1 and few-shot) → figures; everything tracked in one local
MLflow store. `--data DIR` runs the same flow on a user's own ImageFolder.
"""

from __future__ import annotations

import csv
import json
import os
import shutil
import time
from pathlib import Path

from launch.cli import CommandFailed, run_command
from pipeline.files import read_jsonl

ROOT = Path(__file__).resolve().parents[1]
PRETRAIN_RECIPE = ROOT / "configs/pretrain/tiny_cpu.yaml"
TRANSFER_RECIPE = ROOT / "configs/transfer/tiny_cpu.yaml"
DIGITS_SIZE = 32  # stored PNG side; pre-training sees 16 px, transfer 32 px


def write_digits(out: Path, *, seed: int = 0, test_fraction: float = 0.2, val_fraction: float = 0.1) -> Path:
    """sklearn's digits → PNGs under ``out/images/<digit>/`` and ``out/manifest.csv`` (path, label,
    split), stratified by class with a fixed seed.  Returns the manifest path."""
    import numpy as np
    from PIL import Image
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    idx = np.arange(len(digits.target))
    rest, test = train_test_split(idx, test_size=test_fraction, stratify=digits.target, random_state=seed)
    train, val = train_test_split(rest, test_size=val_fraction / (1 - test_fraction),
                                  stratify=digits.target[rest], random_state=seed)
    split_of = {int(i): s for s, ids in (("train", train), ("val", val), ("test", test)) for i in ids}
    rows = []
    for i, (img, label) in enumerate(zip(digits.images, digits.target)):
        rel = Path("images") / str(label) / f"digit_{i:04d}.png"
        path = out / rel
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            pixels = (img / 16.0 * 255).round().astype(np.uint8)  # scans hold 0..16
            Image.fromarray(pixels, "L").resize((DIGITS_SIZE, DIGITS_SIZE), Image.BICUBIC).convert("RGB").save(path)
        rows.append({"path": str(rel), "label": str(label), "split": split_of[i]})
    manifest = out / "manifest.csv"
    with open(manifest, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["path", "label", "split"])
        w.writeheader()
        w.writerows(rows)
    return manifest


def prep_digits(folder: Path, shards: Path) -> dict:
    """The demo's dataset: the digits written under ``folder``, sharded into ``shards`` by `vitp prep`
    as the demo does (160 samples a shard, its train/val/test split); returns prep's summary."""
    from data_prep import prep

    return prep(write_digits(folder), shards, split_column="split", seed=0, max_samples_per_shard=160,
                progress=False)


def _stage(name: str, summary: list, fn):
    print(f"\n=== {name} ===", flush=True)
    t0 = time.perf_counter()
    metric, value = fn()
    summary.append({"stage": name, "seconds": round(time.perf_counter() - t0, 1), "metric": metric, "value": value})
    return value


def _run_ranks(argv: list[str], nprocs: int) -> None:
    from launch.local import run_local

    rc = run_local(argv, nprocs)
    if rc != 0:
        raise CommandFailed(f"`vitp {' '.join(argv[:1])}` failed with exit code {rc}")


# Tuned on the digits: 1.3k training images want a higher lr, gentle crops (a digit cut in half
# is another digit) and no tanh pre-logits layer (it costs the tiny model ~4 points here).
PRETRAIN_TUNING = ["optim.lr=3e-3", "schedule.warmup_steps=20", "data.crop_scale=[0.8,1.0]",
                   "model.representation_size=null"]
TRANSFER_TUNING = ["data.crop_scale=[0.8,1.0]"]


def run_demo(out: Path, *, data: Path | None = None, nprocs: int = 2, pretrain_steps: int = 1000,
             transfer_steps: int = 300, overrides: tuple[str, ...] = ()) -> list[dict]:
    """The whole flow; returns the summary rows (also written to ``out/summary.json``)."""
    from data_prep import prep

    out = out.resolve()
    for old in ("shards", "pretrain", "transfer", "eval", "figures"):  # a rerun starts over
        shutil.rmtree(out / old, ignore_errors=True)
    (out / "mlflow.db").unlink(missing_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    uri = f"sqlite:///{out / 'mlflow.db'}"
    shards, pre_dir, ft_dir = out / "shards", out / "pretrain", out / "transfer"
    summary: list[dict] = []
    summary_extra: dict = {}
    common = [f"tracking.uri={uri}", "tracking.experiment=vitp-demo", f"data.path={shards}", *overrides]

    def do_prep():
        if data is None:
            res = prep_digits(out / "digits", shards)
        else:
            res = prep(data, shards, val_fraction=0.2, seed=0, workers=min(2, os.cpu_count() or 1), progress=False)
        return "samples", sum((res["num_samples"] or {}).values())

    def do_pretrain():
        # the digits are their own downstream set (a user's folder has no test split to score)
        fewshot = [f"eval.fewshot_data=[digits={shards}]"] if data is None else []  # every 250 steps (recipe)
        _run_ranks(["pretrain", "--config", str(PRETRAIN_RECIPE), f"run.dir={pre_dir}", "model.img_size=16",
                    f"train.steps={pretrain_steps}", f"checkpoint.every={pretrain_steps}",
                    "engine.zero_stage=2", "train.log_every=50", *fewshot, *PRETRAIN_TUNING, *common], nprocs)
        if fewshot:
            summary_extra["pretrain_fewshot_10shot"] = _metric_curve(pre_dir, "fewshot/digits/10shot")
        return "train_loss", _last_metric(pre_dir, "loss")

    def do_transfer():
        _run_ranks(["transfer", "--config", str(TRANSFER_RECIPE), f"run.dir={ft_dir}", f"init.from={pre_dir}",
                    f"model.img_size={2 * 16}", f"train.steps={transfer_steps}",
                    "tracking.register_name=vitp-demo-digits", "train.log_every=50", *TRANSFER_TUNING, *common],
                   nprocs)
        return "val_top1", _results(ft_dir).get("val/top1")

    test_split = "test" if data is None else "val"

    def do_eval():
        from launch.stages import eval_main

        rc = run_command(eval_main, ["--checkpoint", str(ft_dir), "--data", str(shards), "--split", test_split,
                        "--fewshot", "--out", str(out / "eval")])
        if rc:
            raise CommandFailed(f"vitp eval failed with exit code {rc}")
        res = json.loads((out / "eval" / "results.json").read_text())
        summary_extra["fewshot_10shot"] = res.get("eval/fewshot/10shot")
        return f"{test_split}_top1", res[f"eval/{test_split}/top1"]

    def do_figures():
        from data_prep.schema import IMAGE_EXTS
        from launch.stages import inspect_main

        # attention maps over a few held-out images (Figure 6) need inputs; any ImageFolder works
        root = out / "digits" / "images" if data is None else data
        images = sorted(p for p in root.rglob("*") if p.suffix.lower()[1:] in IMAGE_EXTS)[::97][:8]
        for name, run in (("pretrain", pre_dir), ("transfer", ft_dir)):
            argv = ["--checkpoint", str(run), "--out", str(out / "figures" / name)]
            if run_command(inspect_main, argv + [a for p in images for a in ("--image", str(p))]):
                raise CommandFailed(f"vitp inspect {run} failed")
        return "figures", len(list((out / "figures").rglob("*.png")))

    _stage("prep", summary, do_prep)
    _stage("pretrain", summary, do_pretrain)
    _stage("transfer", summary, do_transfer)
    _stage("eval", summary, do_eval)
    _stage("figures", summary, do_figures)
    (out / "summary.json").write_text(json.dumps({"stages": summary, **summary_extra}, indent=1) + "\n")
    print_table(summary)
    print(f"\nMLflow UI:  mlflow ui --backend-store-uri {uri}   (then open http://127.0.0.1:5000)")
    return summary


def _last_metric(run_dir: Path, key: str):
    lines = read_jsonl(run_dir / "metrics.jsonl")
    vals = [r[key] for r in lines if key in r]
    return round(vals[-1], 4) if vals else None


def _metric_curve(run_dir: Path, key: str) -> dict[int, float]:
    """{step: value} of ``key`` in a run's metrics.jsonl."""
    lines = read_jsonl(run_dir / "metrics.jsonl")
    return {r["step"]: round(r[key], 4) for r in lines if key in r}


def _results(run_dir: Path) -> dict:
    p = run_dir / "results.json"
    return json.loads(p.read_text()) if p.exists() else {}


def print_table(summary: list[dict]) -> None:
    print(f"\n{'stage':<10} {'seconds':>8}  {'metric':<12} value")
    for row in summary:
        v = row["value"]
        v = f"{v:.4f}" if isinstance(v, float) else str(v)
        print(f"{row['stage']:<10} {row['seconds']:>8.1f}  {row['metric']:<12} {v}")


def main(argv: list[str]) -> int:
    from launch.cli import parser_for

    p = parser_for("demo", "Run prep → pretrain → transfer → eval → figures on this machine (CPU).")
    p.add_argument("--out", default="runs/demo", help="output folder (default runs/demo)")
    p.add_argument("--data", help="your own ImageFolder (root/<class>/<image>) instead of the digits")
    p.add_argument("--nprocs", type=int, default=2, help="local ranks for pretrain/transfer (default 2)")
    p.add_argument("--pretrain-steps", type=int, default=1000)
    p.add_argument("--transfer-steps", type=int, default=300)
    args = p.parse_args(argv)
    if args.data and not Path(args.data).is_dir():
        raise FileNotFoundError(f"--data {args.data}: not a directory")
    run_demo(Path(args.out), data=Path(args.data) if args.data else None, nprocs=args.nprocs,
             pretrain_steps=args.pretrain_steps, transfer_steps=args.transfer_steps)
    return 0
