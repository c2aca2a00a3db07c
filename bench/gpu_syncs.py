"""Host<->device syncs of vitp's plain training step, counted from a torch.profiler trace on the GPU.

    python bench/gpu_syncs.py --out DIR            # one GPU: ViT-B/16, bf16, ZeRO-2, compiled blocks (--compile)
    python bench/gpu_syncs.py --out DIR --smoke    # the same path on the CPU (a tiny ViT, fp32, gloo)

The real pre-training stage (pipeline.pretrain) over synthetic data, one rank; the profiler covers
--steps plain steps (no periodic work due: no log, eval, checkpoint) after --warmup steps (compiling,
allocator warm-up), started and stopped at the loop's per-step seam (pipeline.faults.hit "step"); the
run ends right after, without its final checkpoint. Per step, one ratio line each:

    plain_step_syncs_gpu         cudaDeviceSynchronize + cudaStreamSynchronize (the host waits for the GPU)
    plain_step_event_syncs_gpu   cudaEventSynchronize (the loop waits for the previous step's flags copy)
    plain_step_dtoh_copies_gpu   device-to-host copies on the GPU (a pageable one also blocks the host)
    plain_step_scalar_reads_gpu  aten::_local_scalar_dense: .item()/.tolist() of a tensor (on a GPU: of a
                                 device tensor, each a copy and a sync; on the CPU: every one)
    plain_step_pageable_htod_gpu host-to-device copies from pageable memory (each waits for the stream's
                                 earlier work: DeepSpeed's torch.tensor(-1.0, device=...) was one per group)

Before measuring it prints what it will check (``expect NAME <= N``, the README's count for this run:
ZeRO-2 bf16 on one GPU, accumulation 1: one synchronize() after backward under overlap_comm, the loop's
event wait for the previous step's flags, no scalar read, no pageable copy); on a GPU a figure above
its expectation fails the run (exit 1) after every ratio line is printed.

DIR/syncs.txt names the Python line under each counted event; DIR/syncs_trace.json.gz is the trace
(left out above 15 MiB). On the CPU every CUDA figure is 0: the smoke exercises the path, not the count.
"""

from __future__ import annotations

import argparse
import gzip
import os
import re
import shutil
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

HOST_SYNCS = ("cudaDeviceSynchronize", "cudaStreamSynchronize")
EVENT_SYNC = "cudaEventSynchronize"
SCALAR_READ = "aten::_local_scalar_dense"
STOP_MARK = "gpu_syncs_stop"  # the synchronize before the profiler stops: not the step's
SMOKE = ["model.width=32", "model.depth=2", "model.heads=2", "model.mlp_dim=64", "model.patch=8", "model.img_size=32",
         "model.representation_size=32", "engine.precision=fp32", "engine.backend=gloo", "cluster.gpus_per_node=0",
         "train.compile=false", "data.path=synthetic:classes=10,train=64,val=0", "train.micro_batch=4",
         "train.global_batch=4", "data.val_split="]
GPU = ["engine.precision=bf16", "engine.backend=nccl", "cluster.gpus_per_node=1", "data.workers=4"]
TRACE_LIMIT = 15 * 2**20
# the README's counts per plain step for this run (ZeRO-2, bf16, one rank, accumulation 1)
EXPECT = {"plain_step_syncs_gpu": 1, "plain_step_event_syncs_gpu": 1, "plain_step_scalar_reads_gpu": 0,
          "plain_step_pageable_htod_gpu": 0}
PY_FRAME = re.compile(r"\.py\(\d+\): ")


class Measured(Exception):
    """Raised at the loop's seam once the profiled steps are done: the run ends there."""


def overrides(a) -> list[str]:
    last = a.warmup + a.steps + 2  # the last step logs; the one before the first unprofiled step must not
    common = [f"run.dir={a.run_dir}", f"train.steps={last}", f"train.log_every={last}", "train.eval_every=0",
              "checkpoint.every=0", "tracking.enabled=false", "engine.zero_stage=2", "cluster.nodes=1",
              "cluster.tasks_per_node=1", "schedule.warmup_steps=1"]
    if a.smoke:
        return [*common, *SMOKE]
    return [*common, *GPU, f"train.compile={str(a.compile == 'on').lower()}", f"train.micro_batch={a.batch}",
            f"train.global_batch={a.batch}",
            f"data.path=synthetic:classes=1000,train={8 * a.batch},val=0", "data.val_split="]


def profile_steps(a):
    """Run the stage; the profiler (stopped) over steps warmup+1 .. warmup+steps."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    from pipeline import faults
    from pipeline.config import load_config
    from pipeline.distributed import leave_process_group
    from pipeline.network import free_port
    from pipeline.pretrain import pretrain

    for k, v in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}.items():
        os.environ.setdefault(k, v)
    if a.smoke:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    cfg = load_config(ROOT / "configs" / "pretrain" / f"{a.model}.yaml", overrides(a), world_size=1)
    cuda = not a.smoke and torch.cuda.is_available()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    prof = profile(activities=acts, with_stack=True)
    first, stop = a.warmup + 1, a.warmup + 1 + a.steps
    seam = faults.hit

    def hit(event: str, at: int, scope: str = "") -> None:
        if event == "step" and at == first:
            prof.start()
        elif event == "step" and at == stop:
            with record_function(STOP_MARK):
                if cuda:
                    torch.cuda.synchronize()  # every profiled step's GPU work is in the trace
            prof.stop()
            raise Measured
        seam(event, at, scope)

    faults.hit = hit
    try:
        pretrain(cfg)
    except Measured:
        pass
    else:
        raise SystemExit(f"error: the run ended before step {stop}: nothing measured")
    finally:
        faults.hit = seam
        leave_process_group()
    return prof


def where(e) -> str:
    """The innermost vitp or DeepSpeed line above a profiler event (else the innermost Python line): with
    ``with_stack`` the Python frames are the event's enclosing events, named ``file.py(line): function``."""
    frames = []
    node = e.cpu_parent
    while node is not None:
        if PY_FRAME.search(node.name):
            frames.append(node.name)
        node = node.cpu_parent
    for f in frames:
        m = re.search(r"(?:^|/)((?:pipeline|deepspeed)/.*)", f)
        if m:
            return m.group(1)
    return frames[0] if frames else "(no Python frame)"


def _calls_cuda(e) -> bool:
    return any(c.name.startswith("cuda") or _calls_cuda(c) for c in e.cpu_children)


def count(prof, steps: int) -> tuple[dict[str, float], Counter]:
    events = list(prof.events())
    stop = [e for e in events if e.name == STOP_MARK]
    if stop:  # leave out what the stop's own synchronize recorded
        t0 = stop[0].time_range.start
        events = [e for e in events if e.time_range.start < t0]
    if any(e.name.startswith("cuda") for e in events):  # on a GPU, a read of a host tensor is no sync
        events = [e for e in events if e.name != SCALAR_READ or _calls_cuda(e)]
    names = Counter(e.name for e in events)
    figures = {
        "plain_step_syncs_gpu": sum(names[n] for n in HOST_SYNCS) / steps,
        "plain_step_event_syncs_gpu": names[EVENT_SYNC] / steps,
        "plain_step_dtoh_copies_gpu": sum(v for n, v in names.items() if n.startswith("Memcpy DtoH")) / steps,
        "plain_step_scalar_reads_gpu": names[SCALAR_READ] / steps,
        "plain_step_pageable_htod_gpu": sum(v for n, v in names.items()
                                            if n.startswith("Memcpy HtoD") and "Pageable" in n) / steps,
    }
    sites = Counter((e.name, where(e)) for e in events if e.name in (*HOST_SYNCS, EVENT_SYNC, SCALAR_READ))
    return figures, sites


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="folder for syncs.txt and syncs_trace.json.gz")
    ap.add_argument("--run-dir", type=Path, default=None, help="the run's folder (default OUT/../syncs_run)")
    ap.add_argument("--model", default="vit_b16", help="a recipe in configs/pretrain/ (default vit_b16)")
    ap.add_argument("--batch", type=int, default=256, help="micro batch = global batch, one rank (default 256)")
    ap.add_argument("--warmup", type=int, default=2, help="unprofiled steps first (default 2)")
    ap.add_argument("--steps", type=int, default=3, help="profiled plain steps (default 3)")
    ap.add_argument("--compile", choices=["on", "off"], default="on",
                    help="train.compile on the GPU (default on; make gpu-check: off, since compiling adds no host "
                         "sync and would spend that part's budget)")
    ap.add_argument("--smoke", action="store_true", help="the same path on the CPU, a tiny ViT")
    a = ap.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    a.run_dir = a.run_dir or a.out.parent / "syncs_run"
    shutil.rmtree(a.run_dir, ignore_errors=True)
    for k, v in EXPECT.items():
        print(f"expect {k} <= {v}", flush=True)
    prof = profile_steps(a)
    figures, sites = count(prof, a.steps)
    lines = [f"{n:<28s} {k / a.steps:6.2f}/step  {w}" for (n, w), k in sorted(sites.items(), key=lambda x: -x[1])]
    (a.out / "syncs.txt").write_text(f"{a.steps} plain steps of {a.model}; per step:\n"
                                     + "".join(f"{k} {v:.2f}\n" for k, v in figures.items())
                                     + "where (event, per step, innermost vitp/DeepSpeed line):\n"
                                     + "".join(line + "\n" for line in lines))
    print("\n".join(lines), file=sys.stderr)
    for k, v in figures.items():  # the figures first: exporting the trace takes long and may be cut short
        print(f"ratio {k} {v:.4f}", flush=True)
    export_trace(prof, a.out / "syncs_trace.json")
    over = [k for k, v in figures.items() if k in EXPECT and v > EXPECT[k]]
    if over and not a.smoke:
        print(f"syncs: above the README's count: {', '.join(f'{k} {figures[k]:g} > {EXPECT[k]}' for k in over)}",
              file=sys.stderr, flush=True)
        return 1
    return 0


def export_trace(prof, trace: Path) -> None:
    """The profiler trace, gzipped, beside syncs.txt (left out above TRACE_LIMIT)."""
    prof.export_chrome_trace(str(trace))
    with open(trace, "rb") as f, gzip.open(f"{trace}.gz", "wb", compresslevel=6) as g:
        shutil.copyfileobj(f, g)
    trace.unlink()
    if Path(f"{trace}.gz").stat().st_size > TRACE_LIMIT:
        Path(f"{trace}.gz").unlink()
        print(f"syncs: the trace is over {TRACE_LIMIT >> 20} MiB gzipped; left out", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
