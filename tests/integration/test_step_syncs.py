"""Host<->device syncs of a plain training step (no log, no periodic work due), counted through the real
loop and DeepSpeed engine (2 ranks over gloo, 2 micro batches per step) at the recipes' settings (bf16,
gradient clipping, ZeRO-2 and ZeRO-3 with ``overlap_comm`` as on GPUs; and ZeRO-1, DeepSpeed's BF16_Optimizer), at
most what the README documents (its GPU section lists each with its source line).

What is counted, per rank, between one step's start and the next, as a GPU would see it:
- calls of the accelerator's ``synchronize`` (DeepSpeed's ``get_accelerator()``), ``torch.cuda.synchronize``,
  and the places DeepSpeed would call it on a GPU: ``if not get_accelerator().resolves_data_dependency():
  synchronize()``, which the CPU accelerator answers True (the line after the question is read);
- the tensor reads that wait for a device tensor's value: ``item``, ``tolist``, ``bool()``, ``float()``, ``int()``;
- host-to-device scalar creations: ``torch.tensor(number, device=...)``, a copy from pageable memory that
  waits for the stream's earlier work on a GPU (on the CPU the device is the host; counted all the same).
On the CPU every tensor is a host tensor, so every read inside the step counts, except those while the
loader fetches the next batch (host-side sample indices, never a device tensor). Steps 3-5 are counted:
DeepSpeed's throughput timer starts synchronising at its third step.
"""

import collections
import gc
import json
import linecache
import numbers
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
             "schedule.warmup_steps=2", "data.workers=0", "engine.precision=bf16", "optim.clip_grad=1.0"]
PLAIN_STEPS = (3, 4, 5)
# the README's counts per plain step for these runs (bf16, 2 parameter groups, 2 micro batches, on the CPU:
# with torch's unfused AdamW reading its step counter once per group)
DOCUMENTED = {2: 5, 1: 4, 3: 7}


def _site() -> str:
    """The innermost caller outside torch: 'deepspeed/runtime/utils.py:233' or 'pipeline/train/loop.py:108'."""
    for f in reversed(traceback.extract_stack()[:-2]):  # not this function's frame, nor the counter's
        path = f.filename
        if "site-packages/torch/" in path and "torch/optim/" not in path:
            continue
        return f"{path.split('site-packages/')[-1].split(str(ROOT) + '/')[-1]}:{f.lineno}"
    return "?"


def _gpu_would_sync(site_frame) -> bool:
    """Whether the line after the caller's ``resolves_data_dependency()`` question synchronises."""
    return "synchronize()" in linecache.getline(site_frame.f_code.co_filename, site_frame.f_lineno + 1)


def main(run_dir: str, stage: str) -> None:
    """One rank (``python -m tests.integration.test_step_syncs RUN_DIR STAGE``): train, counting syncs per step."""
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
    accel, resolves, tensor = get_accelerator(), get_accelerator().resolves_data_dependency, torch.tensor

    def answering():  # the CPU answers True; a GPU answers False and synchronises on the next line
        if now["step"] and not now["fetching"] and _gpu_would_sync(sys._getframe(1)):
            seen[now["step"]].append(f"synchronize (on a GPU) {_site()}")
        return resolves()
    accel.resolves_data_dependency = answering

    def scalar_to_device(data, *args, **kwargs):
        if now["step"] and not now["fetching"] and kwargs.get("device") is not None \
                and isinstance(data, numbers.Number):
            seen[now["step"]].append(f"host-to-device {_site()}")
        return tensor(data, *args, **kwargs)
    torch.tensor = scalar_to_device
    from pipeline.train import engine as eng

    made = eng.deepspeed_config

    def overlapping(*args, **kwargs):  # what the engine sets on GPUs (it is off on the CPU accelerator)
        ds = made(*args, **kwargs)
        ds["zero_optimization"]["overlap_comm"] = True
        return ds
    eng.deepspeed_config = overlapping
    hit = faults.hit

    def step_starts(event, at, scope=""):
        if event == "step":
            now["step"] = at
        return hit(event, at, scope)
    faults.hit = step_starts
    full: dict[int, int] = collections.Counter()  # generation-2 collections by step: only at log steps

    def collecting(phase, info):
        if phase == "start" and info["generation"] == 2 and now["step"]:
            full[now["step"]] += 1
    gc.callbacks.append(collecting)

    cfg = load_config(ROOT / "configs/pretrain/tiny_cpu.yaml", [*OVERRIDES, f"engine.zero_stage={stage}",
                                                                 f"run.dir={run_dir}"])
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
    (Path(run_dir) / f"gc.{rank}.json").write_text(json.dumps(full))


@pytest.mark.parametrize("stage", [2, 1, 3])
def test_plain_step_syncs_at_most_what_the_readme_documents(tmp_path, stage):
    assert run_local([str(tmp_path), str(stage)], 2, timeout=900, module="tests.integration.test_step_syncs") == 0
    for rank in (0, 1):
        seen = json.loads((tmp_path / f"syncs.{rank}.json").read_text())
        for step, calls in seen.items():
            assert len(calls) <= DOCUMENTED[stage], (rank, step, collections.Counter(calls))
            # the norm and the clip neither copy a scalar to the device nor read one (device_norm.py)
            assert not [c for c in calls if c.startswith("host-to-device")], calls
            assert not [c for c in calls if "stage_1_and_2.py" in c and "__bool__" in c], calls
        if stage in (2, 3):  # each micro batch's backward ends in DeepSpeed's synchronize under overlap_comm
            ends = [sum(c.startswith("synchronize (on a GPU) deepspeed/runtime/zero/stage") for c in calls)
                    for calls in seen.values()]
            assert ends == [2] * len(seen), seen
        assert any(calls for calls in seen.values())  # the counter sees the step's reads at all
        full = json.loads((tmp_path / f"gc.{rank}.json").read_text())
        assert set(full) == {"6"}, full  # generation 2 at the log step only (pipeline/train/collector.py)
    readme = (ROOT / "README.md").read_text()
    counted = rf"\b{DOCUMENTED[stage]} host syncs per plain step at ZeRO-{stage}\b"
    assert re.search(counted, readme), "the README states the count"


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
