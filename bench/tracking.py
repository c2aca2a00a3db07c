"""Cost of MLflow tracking on the training step: the same run alternates blocks of steps with the
tracker on (every step logs the loop's metrics to a real MLflow server) and with no tracker at all.

    python -m bench.tracking [--uri http://127.0.0.1:5055] [--blocks 12 --block-steps 100]

Without --uri it starts a server with launch/services/mlflow.sh (a private state dir and port).
An "on" block holds everything tracking costs the trainer: it opens an MLflow sink (continuing one
MLflow run, as a resumed job does) behind the sink container the training loop logs through, logs
every step, and closes it, which waits until the server has every
metric; its thread is gone before the "off" block starts, so an "off" block runs with no tracker and
nothing in flight. Opening and closing per block overstates the cost of a real run (which does that
once), so the ratio is an upper bound.
Blocks come in pairs, (off, on) and (on, off) in turn. Prints `ratio tracking_overhead VALUE` =
the median over pairs of (step time on - step time off) / step time off, with step time measured as
this process's CPU time (all its threads, the tracker's included): what tracking costs the trainer.
Per pair, because other users' load drifts: it moves both blocks of a pair alike, and a burst that
hits one block moves one pair rather than the sum (the ratio of the summed times is printed too).
The server's own CPU is left out on purpose, since on a cluster it runs elsewhere; on a shared
2-core box it would only add noise. The wall-clock ratio, which includes waiting for the server at
each block's close, is printed beside it (`ratio tracking_overhead_wall`), meaningful on a quiet
machine. On a busy one the A/B difference is noisy (single pairs differ by +-15%), so the CPU the
tracker itself used (this thread inside its calls, plus its thread's CPU clock, read before close) is
printed too, over the median off-block step: `ratio tracking_overhead_attributed`, a floor for the
A/B ratio that load cannot move.
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

from pipeline.network import free_port

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
    p.add_argument("--blocks", type=int, default=12, help="on/off pairs of blocks")
    # 100 steps (about 5 s here): a block's open and close, which a real run pays once per job, would
    # otherwise be charged every few steps and make most of the measured cost
    p.add_argument("--block-steps", type=int, default=100)
    p.add_argument("--warmup", type=int, default=16, help="flushed requests before timing")
    args = p.parse_args(argv)

    from pipeline.model import build_vit
    from pipeline.tracking import Sinks
    from pipeline.tracking.mlflow_sink import MlflowSink

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

    def open_sink(run_id=None) -> MlflowSink:
        return MlflowSink(uri, experiment="bench-tracking", run_name="bench", spool_dir=state, run_id=run_id,
                          flush_every_s=2.0)

    step, times, cpu, delivered = 0, {"on": [], "off": []}, {"on": [], "off": []}, True
    attributed = []  # per on-block, CPU s/step spent in tracker calls and in the tracker's thread
    try:
        tracker = open_sink()
        # warm-up: each server worker imports its store lazily on its first requests (seconds of CPU
        # on this box); that is start-up cost, not per-step cost, so it happens before the clock starts
        for i in range(args.warmup):
            tracker.log({"warmup": float(i)}, i)
            tracker.flush(60)
        run_id = tracker.run_id
        tracker.close()
        for block in range(2 * args.blocks):
            mode = ("off", "on", "on", "off")[block % 4]
            t0, c0 = time.perf_counter(), time.process_time()
            own = time.thread_time()
            sink = open_sink(run_id) if mode == "on" else None
            tracker = Sinks(sink) if sink is not None else None  # as the loop logs: through the container
            spent = time.thread_time() - own  # this thread's CPU inside tracker calls
            for _ in range(args.block_steps):
                step += 1
                logits = model(x)
                loss = F.cross_entropy(logits, y)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                if tracker is not None:  # what the loop logs at log_every=1, the worst case
                    own = time.thread_time()
                    tracker.log({"loss": loss.item(), "top1": 0.5, "lr": 1e-3, "grad_norm": 1.0,
                                         "images_per_s": 100.0, "step_s": 0.1, "mfu": 0.1, "skipped": 0,
                                         "rss_gb": 1.0}, step)
                    spent += time.thread_time() - own
            if tracker is not None:  # on the clock: delivering the block's metrics is part of its cost
                own = time.thread_time()
                delivered &= tracker.flush(120)
                spent += time.thread_time() - own
                # the tracker thread's own CPU, read while it is still alive (close joins it)
                spent += time.clock_gettime(time.pthread_getcpuclockid(sink._thread.ident))
                own = time.thread_time()
                tracker.close()
                spent += time.thread_time() - own
                attributed.append(spent / args.block_steps)
            times[mode].append((time.perf_counter() - t0) / args.block_steps)
            cpu[mode].append((time.process_time() - c0) / args.block_steps)
            print(f"block {block:2d} tracking {mode:>3}: wall {times[mode][-1] * 1e3:.2f} ms/step, "
                  f"cpu {cpu[mode][-1] * 1e3:.2f} ms/step", flush=True)
    finally:
        if env is not None:
            subprocess.run(["bash", str(ROOT / "launch/services/mlflow.sh"), "down"], env=env,
                           stdout=subprocess.DEVNULL)
    on, off = statistics.median(times["on"]), statistics.median(times["off"])
    c_on, c_off = sum(cpu["on"]), sum(cpu["off"])
    pairs = [(a - b) / b for a, b in zip(cpu["on"], cpu["off"])]  # the i-th on and off block: one pair
    wall_pairs = [(a - b) / b for a, b in zip(times["on"], times["off"])]
    print(f"step time: tracking off {off * 1e3:.2f} ms, on {on * 1e3:.2f} ms wall (median of {args.blocks} "
          f"blocks of {args.block_steps}); cpu {c_off / args.blocks * 1e3:.2f} vs {c_on / args.blocks * 1e3:.2f} ms; "
          f"all metrics delivered: {delivered}")
    print(f"# per pair: {' '.join(f'{r:+.3f}' for r in pairs)}; ratio of sums {(c_on - c_off) / c_off:.4f}")
    print(f"ratio tracking_overhead {statistics.median(pairs):.4f}")
    print(f"ratio tracking_overhead_wall {statistics.median(wall_pairs):.4f}")
    print(f"ratio tracking_overhead_attributed {statistics.median(attributed) / statistics.median(cpu['off']):.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
