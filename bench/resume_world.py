"""Resuming at another world size vs at the same one, side by side in one run (CPU, gloo, ViT-B/16's
86M parameters and their fp32 Adam states, ZeRO-2; images cut to 32 px so a step is cheap: the
states, not the activations, are what a resume moves).

  saved      2 ranks train 1 step and save checkpoint 1 (once)
  same       resume it on 2 ranks and run step 2: load + first step
  other      resume a copy on 1 rank and run step 2: the universal conversion (ds_to_universal) +
             load + first step (accumulation 2 keeps the global batch)

Each resume is a whole `vitp pretrain` process set (start-up, DeepSpeed init, load, one step, exit);
reps alternate the order. Prints per-rep times, the conversion's share as the run reports it, and
``ratio resume_other_world_vs_same`` (median of per-rep ratios; the goal is <= 3). The loader's side
of a resume at another world size (the global order's throughput) is bench/loader.py's
``ratio loader_global_order_vs_rank_order``.

Example:  python bench/resume_world.py --reps 2
"""

from __future__ import annotations

import argparse
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from launch.local import run_local  # noqa: E402

CONFIG = str(ROOT / "configs/pretrain/vit_b16.yaml")
ARGS = ["model.img_size=32", "data.path=synthetic:train=64", "data.val_split=", "data.resampled=false",
        "data.workers=0",
        "engine.precision=fp32", "engine.zero_stage=2", "engine.backend=gloo", "train.global_batch=4",
        "train.micro_batch=2", "train.log_every=1", "train.eval_every=0", "train.fewshot_every=0",
        "schedule.warmup_steps=1", "checkpoint.every=1", "checkpoint.keep=5", "tracking.enabled=false",
        "cluster.gpus_per_node=0", "cluster.tasks_per_node=2", "cluster.nodes=1"]


def pretrain(run: Path, steps: int, nprocs: int, log: Path) -> float:
    """Seconds for `vitp pretrain` to `steps` on ``nprocs`` ranks in ``run`` (resuming what is there)."""
    t = time.perf_counter()
    rc = run_local(["pretrain", "--config", CONFIG, f"run.dir={run}", f"train.steps={steps}", *ARGS], nprocs,
                   timeout=1800, log=log)
    if rc != 0:
        raise SystemExit(f"bench: pretrain on {nprocs} rank(s) exited {rc}; see {log}")
    return time.perf_counter() - t


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        saved, log = tmp / "saved", tmp / "log.txt"
        print(f"saving: 2 ranks, step 1, {pretrain(saved, 1, 2, log):.1f}s", flush=True)
        ckpt = saved / "checkpoints/step-00000001"
        size = sum(f.stat().st_size for f in ckpt.rglob("*") if f.is_file()) / 2**30
        print(f"checkpoint: {size:.2f} GiB", flush=True)
        times: dict[str, list[float]] = {"same": [], "other": []}
        for rep in range(a.reps):
            for kind in (("same", "other") if rep % 2 == 0 else ("other", "same")):
                run = tmp / f"{kind}{rep}"
                shutil.copytree(saved, run)
                times[kind].append(pretrain(run, 2, 2 if kind == "same" else 1, log))
                print(f"rep {rep} {kind:5s} {times[kind][-1]:7.1f}s", flush=True)
                shutil.rmtree(run)
        text = log.read_text(errors="replace")
        if not re.search(r"converting\s+it to a universal checkpoint", text):
            raise SystemExit("bench: the 1-rank resume did not convert the checkpoint (see the log)")
    for kind, ts in times.items():
        print(f"best {kind:5s} {min(ts):7.1f}s")
    per_rep = [o / s for o, s in zip(times["other"], times["same"])]
    print("reps resume_other_world_vs_same " + " ".join(f"{r:.3f}" for r in per_rep))
    print(f"ratio resume_other_world_vs_same {statistics.median(per_rep):.3f}")


if __name__ == "__main__":
    main()
