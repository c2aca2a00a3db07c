"""Host<->device syncs of a plain training step (no log, no periodic work due), counted through the real
loop and DeepSpeed engine (2 ranks, ZeRO-2 over gloo, 2 micro batches per step), at most what the README
documents (its GPU section lists each with its source line).

What is counted, per rank, between one step's start and the next: calls of the accelerator's
``synchronize`` (DeepSpeed's ``get_accelerator()``), ``torch.cuda.synchronize``, and the tensor reads that
wait for a device tensor's value: ``item``, ``tolist``, ``bool()``, ``float()``, ``int()``. On the CPU every
tensor is a host tensor, so every read inside the step counts, except those while the loader fetches the
next batch (host-side sample indices, never a device tensor). Steps 3-5 are counted: DeepSpeed's throughput
timer starts synchronising at its third step.
"""

import collections
import json
import re
import sys
import traceback
from pathlib import Path

import pytest

from launch.local import run_local

pytestmark = pytest.mark.distributed
ROOT = Path(__file__).resolve().parents[2]
OVERRIDES = ["data.path=synthetic:classes=4,train=256,val=32", "model.depth=1", "train.steps=6", "train.log_every=6",
             "train.global_batch=32", "train.micro_batch=8", "checkpoint.every=6", "tracking.enabled=false",
             "schedule.warmup_steps=2", "data.workers=0"]
PLAIN_STEPS = (3, 4, 5)
DOCUMENTED = 6  # the README's count for this run (fp32, ZeRO-2, 2 parameter groups, on the CPU)


def _site() -> str:
    """The innermost caller outside torch: 'deepspeed/runtime/utils.py:233' or 'pipeline/train/loop.py:108'."""
    for f in reversed(traceback.extract_stack()[:-2]):  # not this function's frame, nor the counter's
        path = f.filename
        if "site-packages/torch/" in path and "torch/optim/" not in path:
            continue
        return f"{path.split('site-packages/')[-1].split(str(ROOT) + '/')[-1]}:{f.lineno}"
    return "?"


def main(run_dir: str) -> None:
    """One rank (``python -m tests.integration.test_step_syncs RUN_DIR``): train, counting syncs per step."""
    import torch
    from deepspeed.accelerator import get_accelerator

    from pipeline import faults
    from pipeline.config import load_config
    from pipeline.distributed import rank_world, setup
    from pipeline.train.build import build_run
    from pipeline.train.loop import train
    from pipeline.weights import build_model

    now = {"step": 0, "fetching": False}
    seen: dict[int, list[str]] = collections.defaultdict(list)

    def counting(owner, name):
        orig = getattr(owner, name)

        def wrapper(*args, **kwargs):
            if now["step"] and not now["fetching"]:
                seen[now["step"]].append(f"{name} {_site()}")
            return orig(*args, **kwargs)
        setattr(owner, name, wrapper)

    counting(get_accelerator(), "synchronize")
    counting(torch.cuda, "synchronize")
    for name in ("item", "tolist", "__bool__", "__float__", "__int__"):
        counting(torch.Tensor, name)
    hit = faults.hit

    def step_starts(event, at, scope=""):
        if event == "step":
            now["step"] = at
        return hit(event, at, scope)
    faults.hit = step_starts

    cfg = load_config(ROOT / "configs/pretrain/tiny_cpu.yaml", [*OVERRIDES, f"run.dir={run_dir}"])
    setup(cfg)
    run = build_run(cfg, lambda k: build_model(cfg, k))
    forever = run.loader.forever

    def fetched():  # the loader's own reads are host work on host tensors: not counted
        it = forever()
        while True:
            now["fetching"] = True
            try:
                batch = next(it)
            finally:
                now["fetching"] = False
            yield batch
    run.loader.forever = fetched
    train(run)
    now["step"] = 0
    rank, _ = rank_world()
    (Path(run_dir) / f"syncs.{rank}.json").write_text(json.dumps({s: seen[s] for s in PLAIN_STEPS}))


def test_plain_step_syncs_at_most_what_the_readme_documents(tmp_path):
    assert run_local([str(tmp_path)], 2, timeout=900, module="tests.integration.test_step_syncs") == 0
    for rank in (0, 1):
        seen = json.loads((tmp_path / f"syncs.{rank}.json").read_text())
        for step, calls in seen.items():
            assert len(calls) <= DOCUMENTED, (rank, step, collections.Counter(calls))
        assert any(calls for calls in seen.values())  # the counter sees the step's reads at all
    readme = (ROOT / "README.md").read_text()
    assert re.search(rf"\b{DOCUMENTED} host syncs per plain step\b", readme), "the README states the count"


if __name__ == "__main__":
    main(sys.argv[1])
