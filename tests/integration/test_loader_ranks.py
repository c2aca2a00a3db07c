"""2 ranks × 2 DataLoader workers over 5 uneven shards, each rank its own process (rank/world from
the launcher's env vars), under a watchdog: equal step counts, no hang, each sample once per epoch,
the same key sequence on a second run, and resume from a state dict matching the first run."""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.unit.test_data_shards import write_dataset

ROOT = Path(__file__).resolve().parents[2]

RANK_SCRIPT = r"""
import hashlib, itertools, json, sys
from pipeline.config import DataCfg
from pipeline.data.loader import TrainLoader
path, resume_at = sys.argv[1], int(sys.argv[2])
cfg = DataCfg(path=path, workers=2, shuffle_buffer=6, randaugment="rand-m9-mstd0.5")
mk = lambda: TrainLoader(cfg, img_size=16, micro_batch=4, global_batch=8, seed=11, return_keys=True)
ld = mk()  # rank/world from RANK/WORLD_SIZE
digest = lambda x, y: hashlib.sha256(x.numpy().tobytes() + y.numpy().tobytes()).hexdigest()
epochs = [[(ks, digest(x, y)) for x, y, ks in ld] for _ in range(2)]
first = mk()
list(itertools.islice(first.forever(), resume_at))
again = mk()
again.load_state_dict(json.loads(json.dumps(first.state_dict())))  # through JSON, as a checkpoint would
rest = [(ks, digest(x, y)) for x, y, ks in itertools.islice(again.forever(), 2 * len(ld) - resume_at)]
print(json.dumps({"rank": ld.rank, "steps": len(ld), "epochs": epochs, "resumed": rest}))
"""


def run_ranks(path: Path, world: int, resume_at: int, timeout: float = 240) -> list[dict]:
    procs = []
    for r in range(world):
        env = {**os.environ, "RANK": str(r), "WORLD_SIZE": str(world), "PYTHONPATH": str(ROOT)}
        procs.append(subprocess.Popen([sys.executable, "-c", RANK_SCRIPT, str(path), str(resume_at)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT))
    out = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=timeout)  # the watchdog: a hang fails here
            assert p.returncode == 0, stderr[-3000:]
            out.append(json.loads(stdout.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return out


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_two_ranks_two_workers_uneven_shards(tmp_path):
    keys = write_dataset(tmp_path, {"train": [3, 9, 5, 12, 11]})["train"]  # 40 = 5 global batches
    a = run_ranks(tmp_path, 2, resume_at=3)
    assert [r["steps"] for r in a] == [5, 5]
    for e in range(2):
        assert [len(r["epochs"][e]) for r in a] == [5, 5]
        seen = [k for r in a for ks, _ in r["epochs"][e] for k in ks]
        assert collections.Counter(seen) == collections.Counter(keys)
    assert a[0]["epochs"][0] != a[0]["epochs"][1]
    for r in a:  # resumed at micro-batch 3: the rest equals the uninterrupted run, pixels included
        assert r["resumed"] == (r["epochs"][0] + r["epochs"][1])[3:]
    b = run_ranks(tmp_path, 2, resume_at=7)
    assert [r["epochs"] for r in a] == [r["epochs"] for r in b]  # same seed → same keys and pixels
    for r in b:
        assert r["resumed"] == (r["epochs"][0] + r["epochs"][1])[7:]
