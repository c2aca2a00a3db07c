"""Evaluation throughput: `vitp eval`'s classify() over real shards through pipeline.data's EvalLoader,
against the model's raw forward on the same batches already in memory, in the same run.

    python bench/eval.py [--images 512] [--img-size 64] [--batch 64] [--repeats 3]

Prints `ratio eval_vs_forward VALUE` (images/s of eval / images/s of forward; target >= 0.9): the
evaluation path should cost little beyond the model itself (decode, normalise, counting).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from data_prep import prep  # noqa: E402
from pipeline.config import DataCfg  # noqa: E402
from pipeline.data import EvalLoader, normalize  # noqa: E402
from pipeline.evaluate import classify  # noqa: E402
from pipeline.model import build_vit  # noqa: E402


def make_shards(root: Path, n: int, size: int, classes: int = 10) -> Path:
    """An ImageFolder of n smooth random PNGs, sharded with `vitp prep` (all into the val split)."""
    rng = np.random.default_rng(0)
    src = root / "images"
    for i in range(n):
        d = src / f"c{i % classes}"
        d.mkdir(parents=True, exist_ok=True)
        coarse = rng.integers(0, 255, (4, 4, 3), dtype=np.uint8)
        Image.fromarray(coarse).resize((size, size), Image.BILINEAR).save(d / f"{i}.png")
    out = root / "shards"
    prep(src, out, val_fraction=0.999, progress=False)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--images", type=int, default=512)
    p.add_argument("--img-size", type=int, default=64)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--model", default="vit_ti16", help="variant; patch 16 at --img-size")
    args = p.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    model = build_vit(args.model, img_size=args.img_size, num_classes=10).to(device).eval()
    with tempfile.TemporaryDirectory() as tmp:
        data = DataCfg(path=str(make_shards(Path(tmp), args.images, args.img_size)), workers=1)
        load = lambda: EvalLoader(data, img_size=args.img_size, batch=args.batch, rank=0, world_size=1,  # noqa: E731
                                  split="val")
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
        for _ in range(args.repeats):  # interleaved: a noisy neighbour hits both alike
            fw.append(forward())
            ev.append(evaluate())
    print(f"images {n}  forward {max(fw):.1f} img/s  eval {max(ev):.1f} img/s  ({device})")
    print(f"ratio eval_vs_forward {max(ev) / max(fw):.3f}")


if __name__ == "__main__":
    main()
