"""The plan's memory model against reality: peak RSS of 2 DeepSpeed ranks over gloo on CPU.

Measurement design (RSS is noisy, so each choice below removes one source of noise):
- a model large enough that its states dominate allocator slack: width 512, depth 8, fp32
  (~25M parameters, ~100 MB per fp32 copy), micro batch 8;
- the baseline is each rank's RSS after imports, process-group set-up and a warm-up engine on a
  tiny model (DeepSpeed imports and builds things lazily at its first initialize), before the model exists;
- the peak is VmHWM after two optimizer steps, with the high-water mark reset (clear_refs 5) once
  the engine is built, so one-off copies made while DeepSpeed partitions the model don't count;
- glibc's mmap threshold is pinned (MALLOC_MMAP_THRESHOLD_) so freed tensors go back to the OS
  instead of staying in the heap, and RSS follows live tensors.
The plan is evaluated with backend="cpu" (touched buffer pages, CPU dropout masks, CPU attention).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.network import free_port

ROOT = Path(__file__).resolve().parents[2]
WIDTH, DEPTH, HEADS, MLP, PATCH, IMG, CLASSES, MICRO = 512, 8, 8, 2048, 8, 64, 10, 8


def _rss_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _cfg(stage: int):
    from pipeline.config import load_config

    return load_config(None, [f"model.width={WIDTH}", f"model.depth={DEPTH}", f"model.heads={HEADS}",
                              f"model.mlp_dim={MLP}", f"model.patch={PATCH}", f"model.img_size={IMG}",
                              f"model.num_classes={CLASSES}", f"train.micro_batch={MICRO}",
                              f"train.global_batch={2 * MICRO}", "engine.precision=fp32",
                              f"engine.zero_stage={stage}", "engine.backend=gloo", "cluster.tasks_per_node=2"],
                       world_size=2)


def _warm_up(cfg) -> None:
    """One engine on a 2-block width-16 model, then dropped: DeepSpeed's lazy imports, compiled comm
    ops and process groups land in the baseline instead of in the measured delta."""
    import gc

    import torch

    from pipeline.model.vit import build_vit
    from pipeline.train import engine as eng

    tiny = build_vit(width=16, depth=2, heads=2, mlp_dim=32, patch=PATCH, img_size=IMG, num_classes=CLASSES)
    e = eng.build_engine(tiny, cfg)
    loss = e(torch.randn(MICRO, 3, IMG, IMG)).sum()
    e.backward(loss)
    e.step()
    del e, tiny, loss
    gc.collect()


def _worker(stage: int, out: str) -> None:
    """One rank: baseline RSS, build the model + the pipeline's DeepSpeed engine, 2 steps, peak RSS."""
    import torch

    from pipeline.distributed import leave_process_group, setup
    from pipeline.model.vit import build_vit
    from pipeline.train import engine as eng

    torch.manual_seed(0)
    torch.set_num_threads(1)
    cfg = _cfg(stage)
    setup(cfg)
    _warm_up(cfg)
    base = _rss_kb("VmRSS")
    m = cfg.model
    model = build_vit(width=m.width, depth=m.depth, heads=m.heads, mlp_dim=m.mlp_dim, patch=m.patch,
                      img_size=m.img_size, num_classes=m.num_classes)
    engine = eng.build_engine(model, cfg)
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM: count the steady state only
    after_init = _rss_kb("VmRSS")
    x = torch.randn(MICRO, 3, IMG, IMG)
    y = torch.randint(0, CLASSES, (MICRO,))
    for _ in range(2):
        loss = torch.nn.functional.cross_entropy(engine(x), y)
        engine.backward(loss)
        engine.step()
    peak = _rss_kb("VmHWM")
    Path(out).write_text(json.dumps({"base_kb": base, "init_kb": after_init, "peak_kb": peak}))
    leave_process_group()  # a gloo rank exiting with its group alive can abort at teardown


def measure(stage: int, tmp: Path, world: int = 2) -> list[dict]:
    """Peak RSS delta per rank (bytes) for one ZeRO stage; runs `world` processes."""
    port = free_port()
    procs, outs = [], []
    for rank in range(world):
        out = tmp / f"stage{stage}_rank{rank}.json"
        env = dict(os.environ, DS_ACCELERATOR="cpu", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                   LOCAL_WORLD_SIZE=str(world), OMP_NUM_THREADS="1",
                   MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="65536",
                   PYTHONPATH=str(ROOT))
        procs.append(subprocess.Popen([sys.executable, __file__, str(stage), str(out)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        outs.append(out)
    logs = [p.communicate(timeout=600)[0] for p in procs]
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-3000:]
    res = [json.loads(o.read_text()) for o in outs]
    return [dict(r, delta=(r["peak_kb"] - r["base_kb"]) * 1024) for r in res]


def planned(stage: int) -> dict:
    from pipeline.plan.memory import ModelShape, memory_per_rank

    shape = ModelShape.from_dims(width=WIDTH, depth=DEPTH, heads=HEADS, mlp_dim=MLP, patch=PATCH,
                                 img_size=IMG, num_classes=CLASSES)
    return memory_per_rank(shape, precision="fp32", zero_stage=stage, world_size=2, micro_batch=MICRO,
                           backend="cpu")


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_plan_matches_measured_peak_rss(stage, tmp_path):
    got = measure(stage, tmp_path)
    plan = planned(stage)
    for r in got:
        err = r["delta"] / plan["total"] - 1
        print(f"stage {stage}: measured {r['delta'] / 2**20:.0f} MiB, planned {plan['total'] / 2**20:.0f} MiB,"
              f" error {err:+.1%}")
        assert abs(err) < 0.15, (stage, r, plan)


if __name__ == "__main__":
    _worker(int(sys.argv[1]), sys.argv[2])
