"""Cost of MLflow tracking on the training step: the same run alternates blocks of steps with the
tracker on (every step logs the loop's metrics to a real MLflow server) and off.

    python -m bench.tracking [--uri http://127.0.0.1:5055] [--blocks 8 --block-steps 25]

Without --uri it starts a server with launch/services/mlflow.sh (a private state dir and port).
Prints `ratio tracking_overhead VALUE` = (step time on - step time off) / step time off, with step
time measured as this process's CPU time (all its threads, the tracker's included): what tracking
costs the trainer. The server's own CPU is left out on purpose, since on a cluster it runs elsewhere;
on a shared 2-core box it would only add noise. The wall-clock ratio is printed beside it
(`ratio tracking_overhead_wall`), meaningful on a quiet machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from pipeline.distributed import free_port

ROOT = Path(__file__).resolve().parents[1]


def _start_server(state: str) -> tuple[str, dict]:
    port = free_port()
    env = dict(os.environ, VITP_SERVICES_DIR=state, VITP_MLFLOW_PORT=str(port), VITP_PYTHON=sys.executable)
    subprocess.run(["bash", str(ROOT / "launch/services/mlflow.sh"), "up"], env=env, check=True,
                   stdout=subprocess.DEVNULL)
    return f"http://127.0.0.1:{port}", env


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--uri", help="a running MLflow server; default: start one")
    p.add_argument("--blocks", type=int, default=12, help="A/B blocks each (alternating)")
    p.add_argument("--block-steps", type=int, default=15)
    p.add_argument("--warmup", type=int, default=16, help="flushed requests before timing")
    args = p.parse_args(argv)

    from pipeline.model import build_vit
    from pipeline.train.tracking import Tracker

    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = build_vit(width=64, depth=4, heads=4, mlp_dim=128, patch=4, img_size=32, num_classes=10)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(32, 3, 32, 32), torch.randint(0, 10, (32,))

    state = tempfile.mkdtemp(prefix="bench-mlflow-")
    env = None
    uri = args.uri
    if uri is None:
        uri, env = _start_server(state)
    tracker = Tracker(uri, experiment="bench-tracking", run_name="bench", spool_dir=state, flush_every_s=2.0)
    # warm-up: each server worker imports its store lazily on its first requests (seconds of CPU on
    # this box); that is start-up cost, not per-step cost, so it happens before the clock starts
    for i in range(args.warmup):
        tracker.log_metrics({"warmup": float(i)}, i)
        tracker.flush(60)
    step, times, cpu = 0, {"on": [], "off": []}, {"on": [], "off": []}
    try:
        for block in range(2 * args.blocks):
            mode = "on" if block % 2 else "off"
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(args.block_steps):
                step += 1
                logits = model(x)
                loss = F.cross_entropy(logits, y)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                if mode == "on":  # what the loop logs at log_every=1, the worst case
                    tracker.log_metrics({"loss": loss.item(), "top1": 0.5, "lr": 1e-3, "grad_norm": 1.0,
                                         "images_per_s": 100.0, "step_s": 0.1, "mfu": 0.1, "skipped": 0,
                                         "rss_gb": 1.0}, step)
            times[mode].append((time.perf_counter() - t0) / args.block_steps)
            cpu[mode].append((time.process_time() - c0) / args.block_steps)
            print(f"block {block:2d} tracking {mode:>3}: wall {times[mode][-1] * 1e3:.2f} ms/step, "
                  f"cpu {cpu[mode][-1] * 1e3:.2f} ms/step", flush=True)
        delivered = tracker.flush(120)
        tracker.close()
    finally:
        if env is not None:
            subprocess.run(["bash", str(ROOT / "launch/services/mlflow.sh"), "down"], env=env,
                           stdout=subprocess.DEVNULL)
    on, off = statistics.median(times["on"]), statistics.median(times["off"])
    c_on, c_off = sum(cpu["on"]), sum(cpu["off"])
    print(f"step time: tracking off {off * 1e3:.2f} ms, on {on * 1e3:.2f} ms wall (median of {args.blocks} "
          f"blocks of {args.block_steps}); cpu {c_off / args.blocks * 1e3:.2f} vs {c_on / args.blocks * 1e3:.2f} ms; "
          f"all metrics delivered: {delivered}")
    print(f"ratio tracking_overhead {(c_on - c_off) / c_off:.4f}")
    print(f"ratio tracking_overhead_wall {(on - off) / off:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
