"""A stand-in training stage with the real stage's contract, for testing the launch layer alone.

`train(cfg)` runs cfg.train.steps deterministic "steps" on every rank: a weight vector w ← 0.9·w +
g(step) averaged over ranks (a real all-reduce over the process group the launcher built), rank 0
appends {"step", "loss"} to RUN_DIR/metrics.jsonl, polls pipeline.train.stopping every step (any rank asking
is enough, agreed by all-reduce), saves on every rank and returns status "stopped"; it resumes from
RUN_DIR/ckpt. The final weights go to RUN_DIR/model.json. Each step also costs a little compute time
so a signal can land mid-run.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from pipeline.train import stopping

STOP_CODES = {None: 0, "cancel": 1, "requeue": 2}


def _allreduce(t: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
    if dist.is_initialized():
        dist.all_reduce(t, op=op)
    return t


def train(cfg) -> dict:
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    run = Path(cfg.run.dir)
    ckpt = run / "ckpt"
    run.mkdir(parents=True, exist_ok=True)
    w = torch.zeros(4, dtype=torch.float64)
    start = 0
    if (ckpt / "latest").is_file():
        start = int((ckpt / "latest").read_text())
        w = torch.tensor(json.loads((ckpt / f"w-{start}-rank{rank}.json").read_text()), dtype=torch.float64)
    if rank == 0:  # drop lines past the checkpoint (written after it, before the stop)
        m = run / "metrics.jsonl"
        lines = m.read_text().splitlines() if m.is_file() else []
        m.write_text("".join(ln + "\n" for ln in lines if json.loads(ln)["step"] <= start))
    step = start
    while step < cfg.train.steps:
        code = torch.tensor([STOP_CODES[stopping.stop_reason()]])
        code = int(_allreduce(code, dist.ReduceOp.MAX))
        if code:
            reason = {v: k for k, v in STOP_CODES.items()}[code]
            _save(ckpt, step, w, rank, world)
            return {"status": "stopped", "step": step, "run_dir": str(run), "stop_reason": reason}
        step += 1
        g = torch.arange(4, dtype=torch.float64) * (rank + 1) / (step + 1)
        w = 0.9 * w + _allreduce(g) / world
        time.sleep(0.15)  # stands in for a step's compute
        if rank == 0:
            with open(run / "metrics.jsonl", "a") as f:
                f.write(json.dumps({"step": step, "loss": float(w.square().sum())}) + "\n")
    if rank == 0:
        (run / "model.json").write_text(json.dumps(w.tolist()))
    return {"status": "completed", "step": step, "run_dir": str(run), "world_size": world}


def _save(ckpt: Path, step: int, w: torch.Tensor, rank: int, world: int) -> None:
    ckpt.mkdir(parents=True, exist_ok=True)
    (ckpt / f"w-{step}-rank{rank}.json").write_text(json.dumps(w.tolist()))
    if dist.is_initialized():
        dist.barrier()  # collective, like DeepSpeed's save_checkpoint
    if rank == 0:
        (ckpt / "latest").write_text(str(step))


def test_stub_runs_alone(tmp_path):
    from pipeline.config import load_config

    cfg = load_config("configs/pretrain/tiny_cpu.yaml", [f"run.dir={tmp_path}", "train.steps=3"], world_size=1)
    stopping.clear()
    assert train(cfg)["status"] == "completed"
    assert [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]
