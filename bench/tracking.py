"""Cost of MLflow tracking on the training step: the same run alternates blocks of steps with the
tracker on (every step logs the loop's metrics to a real MLflow server) and off.

    python -m bench.tracking [--uri http://127.0.0.1:5055] [--blocks 8 --block-steps 25]

Without --uri it starts a server with launch/services/mlflow.sh (a private state dir and port).
Prints `ratio tracking_overhead VALUE` = (step time on - step time off) / step time off.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]


def _start_server(state: str) -> tuple[str, dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, VITP_SERVICES_DIR=state, VITP_MLFLOW_PORT=str(port), VITP_PYTHON=sys.executable)
    subprocess.run(["bash", str(ROOT / "launch/services/mlflow.sh"), "up"], env=env, check=True,
                   stdout=subprocess.DEVNULL)
    return f"http://127.0.0.1:{port}", env


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--uri", help="a running MLflow server; default: start one")
    p.add_argument("--blocks", type=int, default=8, help="A/B blocks each (alternating)")
    p.add_argument("--block-steps", type=int, default=25)
    args = p.parse_args(argv)

    from pipeline.model import build_vit
    from pipeline.tracking import Tracker

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
    step, times = 0, {"on": [], "off": []}
    try:
        for block in range(2 * args.blocks):
            mode = "on" if block % 2 else "off"
            t0 = time.perf_counter()
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
        delivered = tracker.flush(120)
        tracker.close()
    finally:
        if env is not None:
            subprocess.run(["bash", str(ROOT / "launch/services/mlflow.sh"), "down"], env=env,
                           stdout=subprocess.DEVNULL)
    on, off = statistics.median(times["on"]), statistics.median(times["off"])
    print(f"step time: tracking off {off * 1e3:.2f} ms, on {on * 1e3:.2f} ms (median of {args.blocks} blocks "
          f"of {args.block_steps}); all metrics delivered: {delivered}")
    print(f"ratio tracking_overhead {(on - off) / off:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
