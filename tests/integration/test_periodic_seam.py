"""Adding periodic work and a checkpointed part to a training run is a change in one file: this one.

``Probe`` is a periodic task (due every 3 steps) that is also stateful (how often it ran); ``Tally``
is a plain checkpointed part (the sum of the steps the probe saw). Both go in through the loop's
public seam, ``build_run(tasks=..., states=...)``, with no edit to the loop or the builder. A real 2-rank pre-training
(DeepSpeed ZeRO-2 over gloo, synthetic data) runs whole, and again killed before step 7 and resumed
from the step-4 checkpoint: the probe ran at its steps, and its records after the resume equal the
uninterrupted run's, which they can only if both states came back from the checkpoint.
"""

import json
import sys
from pathlib import Path

import pytest
import torch

from launch.local import run_local

pytestmark = pytest.mark.distributed
ROOT = Path(__file__).resolve().parents[2]
OVERRIDES = ["data.path=synthetic:classes=4,train=256,val=32", "model.depth=1", "train.steps=8", "train.log_every=4",
             "checkpoint.every=4", "tracking.enabled=false", "schedule.warmup_steps=2", "data.workers=0",
             "checkpoint.async=false"]  # inline saves: step 4's checkpoint is published before the kill at 7


class Tally:
    """A checkpointed part that is no task: the sum of the steps the probe saw."""

    def __init__(self):
        self.total = 0

    def state_dict(self) -> dict:
        return {"total": self.total}

    def load_state_dict(self, sd: dict) -> None:
        self.total = int(sd["total"])


class Probe:
    """A periodic task every 3 steps, checkpointed under its name: how many times it ran."""

    name = "probe"

    def __init__(self, tally: Tally):
        self.tally, self.runs = tally, 0

    def due(self, step: int) -> bool:
        return step % 3 == 0

    def run(self, step: int) -> dict:
        self.runs += 1
        self.tally.total += step
        return {"probe/runs": self.runs, "probe/tally": self.tally.total}

    def state_dict(self) -> dict:
        return {"runs": self.runs}

    def load_state_dict(self, sd: dict) -> None:
        self.runs = int(sd["runs"])


def main(run_dir: str) -> None:
    """One rank of the run (``python -m tests.integration.test_periodic_seam RUN_DIR``)."""
    from pipeline.config import load_config
    from pipeline.distributed import setup
    from pipeline.train.build import build_run
    from pipeline.train.loop import train
    from pipeline.weights import build_model

    cfg = load_config(ROOT / "configs/pretrain/tiny_cpu.yaml", [*OVERRIDES, f"run.dir={run_dir}"])
    setup(cfg)
    tally = Tally()
    train(build_run(cfg, lambda k: build_model(cfg, k), tasks=[lambda parts: Probe(tally)], states={"tally": tally}))


def probe_records(run_dir: Path) -> list[dict]:
    recs = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    return [r for r in recs if "probe/runs" in r]


def run(run_dir: Path, env: dict | None = None) -> int:
    return run_local([str(run_dir)], 2, env=env, timeout=900, module="tests.integration.test_periodic_seam")


def test_a_task_and_a_state_added_from_outside_run_and_resume(tmp_path):
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    assert run(whole) == 0
    expected = [{"step": 3, "probe/runs": 1, "probe/tally": 3}, {"step": 6, "probe/runs": 2, "probe/tally": 9}]
    assert probe_records(whole) == expected

    assert run(killed, {"VITP_TEST_KILL_AT_STEP": "7"}) != 0
    assert probe_records(killed) == expected  # ran at 3 and 6 before the kill
    ckpt = killed / "checkpoints/step-00000004"
    saved = torch.load(ckpt / "vitp_rank0.pt", weights_only=True)["states"]
    assert saved["probe"] == {"runs": 1} and saved["tally"] == {"total": 3}
    assert (killed / "checkpoints/LATEST").read_text().strip() == "step-00000004"

    assert run(killed) == 0  # resumes at 4: step 6's record is dropped, then made again from the restored state
    assert probe_records(killed) == expected
    loss = lambda d: [(r["step"], r["loss"]) for r in map(json.loads, (d / "metrics.jsonl").read_text().splitlines())  # noqa: E731
                      if "loss" in r]
    assert loss(killed) == loss(whole) and [s for s, _ in loss(whole)] == [4, 8]


if __name__ == "__main__":
    main(sys.argv[1])
