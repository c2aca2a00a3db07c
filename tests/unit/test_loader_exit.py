"""A process whose training loader still has workers at exit ends: the workers ignore SIGTERM (SLURM's
stop signals are for the main process), so multiprocessing's exit handler, which terminates and then
joins daemonic children, would otherwise wait for them forever."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.unit.test_data_shards import write_dataset

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent("""
    import gc, sys
    from pipeline.config import DataCfg
    from pipeline.data.loader import TrainLoader

    gc.disable()  # the iterator below is never collected: its workers are alive when the interpreter exits
    ld = TrainLoader(DataCfg(path=sys.argv[1], workers=1, shuffle_buffer=4), img_size=16, micro_batch=2,
                     global_batch=2, rank=0, world_size=1)
    it = ld.forever()
    images, labels = next(it)
    cycle = [it]
    cycle.append(cycle)
    print("batch", tuple(images.shape), flush=True)
""")


def test_exit_with_live_loader_workers_does_not_hang(tmp_path):
    write_dataset(tmp_path / "ds", {"train": [4, 4]})
    r = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "ds")], cwd=ROOT, capture_output=True, text=True,
                       timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr[-2000:]
    assert "batch (2, 3, 16, 16)" in r.stdout and "killed by signal" not in r.stderr
