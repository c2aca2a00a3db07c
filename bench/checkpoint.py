"""What a checkpoint costs the training it interrupts: background (checkpoint.async) against inline.

A ViT-B/16-sized model (86M parameters; 32 px images, so a CPU step is quick and the checkpoint, ~1.4 GB
over the ranks with AdamW under ZeRO-2, is what matters) trains on 2 gloo ranks through vitp's DeepSpeed
engine; the run's CheckpointManager saves it to a folder on real disk (the files are fsynced). After a
first round (each kind's first save allocates its host buffers: printed, not in the ratios), in
interleaved rounds, each of the same steps:

    inline      one save with checkpoint.async=false: the time it holds training (write, fsync, publish)
    async       one save with checkpoint.async=true, then steps until every rank's write is done and the
                checkpoint published (K steps, each ending with that question to all ranks); the time the
                save itself held training is its blocked time
    base        the same K steps (and questions) without a save

    ratio ckpt_async_blocked_vs_sync   median blocked time, async / inline (goal <= 0.15)
    ratio ckpt_async_step_rate         steps per second over the async save's duration against the same
                                       steps without a save: base time / async time (goal >= 0.9)

Also printed, to tell the two costs apart: the CPU time rank 0's writer thread took, and the rate of
the steps that ran beside it (the blocked copy left out). On a host whose cores the ranks already fill
(cluster.cpus_per_task=1, a rank per core) the writer's CPU comes out of the steps.

    python bench/checkpoint.py                 # 1 + 3 rounds, files under ./bench-checkpoint-*/ (removed after)
    python bench/checkpoint.py --rounds 5 --dir /scratch/me
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

OVERRIDES = ["model.name=vit_b16", "model.img_size=32", "model.num_classes=10", "train.global_batch=4",
             "train.micro_batch=2", "engine.zero_stage=2", "engine.precision=fp32", "cluster.cpus_per_task=1",
             "data.path=synthetic:train=64,val=8"]


def rank_main(out_dir: Path, rounds: int, result: Path) -> None:
    import torch

    from pipeline.config import load_config
    from pipeline.distributed import any_rank, rank_world, setup
    from pipeline.model import build_vit
    from pipeline.train import engine as eng
    from pipeline.train.checkpoint import CheckpointManager, RngState

    cfg = load_config(ROOT / "configs/pretrain/tiny_cpu.yaml", OVERRIDES, world_size=2)
    setup(cfg)
    rank, world = rank_world()
    torch.manual_seed(0)
    model = build_vit("vit_b16", img_size=32, num_classes=10)
    engine = eng.build_engine(model, cfg)
    x = torch.randn(cfg.train.micro_batch, 3, 32, 32)
    y = torch.randint(0, 10, (cfg.train.micro_batch,))

    def step() -> None:
        loss = torch.nn.functional.cross_entropy(engine(x), y)
        engine.backward(loss)
        engine.step()

    def steps(k: int) -> float:
        """``k`` steps, each ending with the question the async round asks (like for like)."""
        t = time.perf_counter()
        for _ in range(k):
            step()
            any_rank(False)
        return time.perf_counter() - t

    managers = {mode: CheckpointManager(out_dir / mode, engine, {"rng": RngState()}, every=0, last_step=10**9,
                                        keep=1, background=mode == "async") for mode in ("inline", "async")}
    steps(3)  # Adam's moments exist from the first step: every save below is the full size
    per_step = steps(3) / 3
    rows = []
    for n in range(rounds + 1):  # round 0: the first save of each kind also allocates its buffers (reported apart)
        managers["inline"].save(n)
        inline = managers["inline"].blocked_s
        t, k = time.perf_counter(), 0
        managers["async"].save(n)
        blocked = managers["async"].blocked_s
        while True:  # steps until every rank's write is done and published: the save's duration
            step()
            k += 1
            if not any_rank(managers["async"].writing):
                break
        during = time.perf_counter() - t
        managers["async"].wait()
        rows.append({"inline_s": inline, "async_blocked_s": blocked, "base_s": steps(k), "async_s": during,
                     "steps": k, "write_cpu_s": managers["async"].write_cpu_s})
    if rank == 0:
        size = sum(f.stat().st_size for f in (out_dir / "async").rglob("*") if f.is_file())
        result.write_text(json.dumps({"rows": rows, "bytes": size, "per_step_s": per_step, "world": world}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default=".", help="where the checkpoints are written (a real disk)")
    ap.add_argument("--rank-main", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank_main:
        rank_main(Path(args.rank_main[0]), args.rounds, Path(args.rank_main[1]))
        return
    from pipeline.network import free_port

    work = Path(tempfile.mkdtemp(prefix="bench-checkpoint-", dir=args.dir))
    try:
        result, port = work / "result.json", free_port()
        procs = [subprocess.Popen([sys.executable, __file__, "--rounds", str(args.rounds), "--rank-main",
                                   str(work / "ckpt"), str(result)], cwd=ROOT,
                                  env={**os.environ, "PYTHONPATH": str(ROOT), "RANK": str(r), "WORLD_SIZE": "2",
                                       "LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                                       "MASTER_PORT": str(port), "DS_ACCELERATOR": "cpu"}) for r in range(2)]
        if any(p.wait() for p in procs):
            sys.exit("bench/checkpoint.py: a rank failed (its output is above)")
        res = json.loads(result.read_text())
    finally:
        shutil.rmtree(work, ignore_errors=True)
    first, rows = res["rows"][0], res["rows"][1:]
    print(f"ViT-B/16-sized model on {res['world']} ranks, checkpoint {res['bytes'] / 1e9:.2f} GB on disk, "
          f"step {res['per_step_s']:.3f} s")
    print(f"first save (allocates the host copy; not in the ratios): inline {first['inline_s']:.2f} s, "
          f"async blocked {first['async_blocked_s']:.3f} s")
    for i, r in enumerate(rows, 1):
        print(f"round {i}: inline save {r['inline_s']:.2f} s, async save blocked {r['async_blocked_s']:.3f} s "
              f"and its write took {r['write_cpu_s']:.2f} s of CPU in its thread; "
              f"{r['steps']} steps {r['base_s']:.2f} s without a save, {r['async_s']:.2f} s with one")
    med = statistics.median
    # where the steps' time went: the copy inside the step (blocked), then the writer thread's CPU beside them
    print(f"rank 0, medians: a save blocks {med(r['async_blocked_s'] for r in rows):.3f} s, its write takes "
          f"{med(r['write_cpu_s'] for r in rows):.2f} s of CPU; the steps while it runs (blocked time left out) go at "
          f"{med(r['base_s'] / (r['async_s'] - r['async_blocked_s']) for r in rows):.3f} of the rate without a save; "
          f"{os.cpu_count()} CPU(s) here, load average {os.getloadavg()[0]:.1f}")
    blocked = med(r["async_blocked_s"] for r in rows) / med(r["inline_s"] for r in rows)
    print(f"ratio ckpt_async_blocked_vs_sync {blocked:.3f}")
    print(f"ratio ckpt_async_step_rate {med(r['base_s'] / r['async_s'] for r in rows):.3f}")


if __name__ == "__main__":
    main()
