"""Evaluation throughput: `vitp eval`'s classify() over real shards through pipeline.data.loader's EvalLoader,
against the model's raw forward on the same batches already in memory, in the same run.

    python bench/eval.py [--model vit_s16] [--images 256] [--img-size 224] [--batch 32] [--repeats 3]

Data: ImageNet-like 500x375 JPEGs sharded by `vitp prep --resize-shorter 256` (how an eval set is
stored), evaluated with the usual resize-256 / centre-crop-224 transform (crop_pct 0.875).

Prints `ratio eval_vs_forward VALUE` (images/s of eval / images/s of forward; target >= 0.9): the
evaluation path should cost little beyond the model itself (decode, normalise, counting). On this
2-core CPU the loader worker and the model share the cores, so a model much cheaper than decoding
(``--model vit_ti16 --img-size 64``) measures the decoder, not the pipeline; that setting is printed
as its own line with ``--tiny``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.prep import make_dataset  # noqa: E402
from data_prep import prep  # noqa: E402
from pipeline.config import DataCfg  # noqa: E402
from pipeline.data.loader import EvalLoader, normalize  # noqa: E402
from pipeline.eval.loop import classify  # noqa: E402
from pipeline.model import build_vit  # noqa: E402


def make_shards(root: Path, n: int) -> Path:
    """n ImageNet-like JPEGs in 10 class folders, sharded by `vitp prep` at shorter side 256, all val."""
    src = root / "images"
    make_dataset(src, n)
    out = root / "shards"
    prep(src, out, val_fraction=0.999, resize_shorter=256, quality=90, progress=False)
    return out


def measure(shards: Path, model_name: str, img_size: int, batch: int, repeats: int,
            crop_pct: float) -> tuple[float, float, int, str]:
    """(best forward img/s, best eval img/s, images, device): forward over the decoded batches held in
    memory vs classify() over the EvalLoader (one worker), interleaved."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    model = build_vit(model_name, img_size=img_size, num_classes=10).to(device).eval()
    data = DataCfg(path=str(shards), workers=1, eval_crop_pct=crop_pct)

    def load():
        return EvalLoader(data, img_size=img_size, batch=batch, rank=0, world_size=1, split="val")

    batches = [(b[0][b[2]], b[1][b[2]]) for b in load()]  # the same images, decoded once, in memory
    n = sum(len(y) for _, y in batches)

    @torch.no_grad()
    def forward() -> float:
        t0 = time.perf_counter()
        for x, _ in batches:
            model(normalize(x.to(device)))
        if device == "cuda":
            torch.cuda.synchronize()
        return n / (time.perf_counter() - t0)

    def evaluate() -> float:
        t0 = time.perf_counter()
        res = classify(model, load(), 10, device=device, prepare=normalize)
        assert res.n == n, (res.n, n)
        return n / (time.perf_counter() - t0)  # wall time, loader start-up included

    forward(), evaluate()  # warm-up (allocator, kernels, page cache)
    fw, ev = [], []
    for _ in range(repeats):  # interleaved: a noisy neighbour hits both alike
        fw.append(forward())
        ev.append(evaluate())
    return max(fw), max(ev), n, device


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--images", type=int, default=256)
    p.add_argument("--img-size", type=int, default=224)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--crop-pct", type=float, default=0.875)
    p.add_argument("--model", default="vit_s16", help="variant; patch 16 at --img-size")
    p.add_argument("--tiny", action="store_true", help="also vit_ti16 at 64 px (decoder-bound on a CPU)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        shards = make_shards(Path(tmp), args.images)
        fw, ev, n, device = measure(shards, args.model, args.img_size, args.batch, args.repeats, args.crop_pct)
        print(f"# {args.model} {args.img_size}px: images {n}  forward {fw:.1f} img/s  eval {ev:.1f} img/s  ({device})")
        print(f"ratio eval_vs_forward {ev / fw:.3f}")
        if args.tiny:
            fw, ev, n, device = measure(shards, "vit_ti16", 64, 64, args.repeats, args.crop_pct)
            print(f"# vit_ti16 64px: images {n}  forward {fw:.1f} img/s  eval {ev:.1f} img/s  ({device})")
            print(f"ratio eval_vs_forward_ti16_64px {ev / fw:.3f}")


if __name__ == "__main__":
    main()
