"""The transfer suite on the local two-node SLURM cluster against its cells submitted one at a time.

    python bench/suite.py [--datasets 3] [--lrs 0.003,0.01,0.03,0.1] [--steps 2]

From a tiny pre-trained checkpoint (configs/pretrain/tiny_cpu.yaml, 3 steps on this machine), the tiny
suite (configs/suite/tiny.yaml's cell settings: one rank on one core per fine-tune) over ``--datasets``
small datasets x 4 lrs is submitted as one `vitp submit suite --wait`; then the same fine-tunes (every
grid cell and each dataset's final at the lr the suite chose, the same steps) go in one at a time with
`vitp submit transfer --wait`, as a user without the suite would. Prints

    ratio suite_vs_one_by_one VALUE     wall time of the suite / of the one-by-one cells (goal <= 0.75)
    ratio final_top1_vs_eval VALUE      each final's test_top1 over `vitp eval` on its run dir (1.0 each)

Needs the local cluster up (launch/services/slurm.sh); the MLflow store is a SQLite file in the temp folder.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.unit.test_data_shards import write_dataset  # noqa: E402  (prep's layout, tiny PNG/JPEG tars)


def vitp(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    r = subprocess.run([sys.executable, "-m", "launch.cli", *args], cwd=ROOT, env=env, capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"vitp {' '.join(args[:2])} failed ({r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
    return r


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--datasets", type=int, default=3)
    p.add_argument("--lrs", default="0.003,0.01,0.03,0.1")
    p.add_argument("--steps", type=int, default=2)
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="vitp_bench_suite_"))
    data = {}
    for i in range(args.datasets):
        data[f"set{i}"] = tmp / f"set{i}"
        write_dataset(data[f"set{i}"], {"train": [20, 20], "test": [12]}, num_classes=2 + i)
    pre = tmp / "pre"
    vitp("pretrain", "--config", "configs/pretrain/tiny_cpu.yaml", f"run.dir={pre}", "train.steps=3",
         "data.path=synthetic:train=256,val=32", "tracking.enabled=false", "cluster.tasks_per_node=1")

    spec = yaml.safe_load((ROOT / "configs/suite/tiny.yaml").read_text())
    spec["lrs"] = [float(x) for x in args.lrs.split(",")]
    spec["overrides"] = [*(o for o in spec["overrides"] if not o.startswith("train.steps=")),
                         f"train.steps={args.steps}"]
    spec["datasets"] = [{"name": n, "data": str(d)} for n, d in data.items()]
    (tmp / "suite.yaml").write_text(yaml.safe_dump(spec))
    common = [f"init.from={pre}", f"cluster.log_dir={tmp / 'jobs'}", f"tracking.uri=sqlite:///{tmp / 'mlflow.db'}"]

    t0 = time.perf_counter()
    vitp("submit", "suite", "--config", str(tmp / "suite.yaml"), f"run.dir={tmp / 'suite'}", *common, "--wait")
    t_suite = time.perf_counter() - t0
    with open(tmp / "suite" / "suite.csv", newline="") as f:
        rows = list(csv.DictReader(f))

    t0 = time.perf_counter()
    for i, r in enumerate(rows):
        cfg = yaml.safe_load((Path(r["run_dir"]) / "config.yaml").read_text())
        held = ([f"data.minival_fraction={cfg['data']['minival_fraction']}", "data.val_split=minival"]
                if r["phase"] == "grid" else [f"data.val_split={cfg['data']['val_split']}"])
        vitp("submit", "transfer", "--config", spec["transfer_config"], *spec["overrides"], *common,
             f"data.path={data[r['dataset']]}", f"optim.lr={r['lr']}", f"run.dir={tmp / 'one' / str(i)}", *held,
             "--wait")
    t_one = time.perf_counter() - t0

    ratios = []
    for r in (r for r in rows if r["phase"] == "final"):
        out = tmp / "eval" / r["dataset"]
        vitp("eval", "--checkpoint", r["run_dir"], "--data", str(data[r["dataset"]]), "--split", "test",
             "--out", str(out))
        ev = json.loads((out / "results.json").read_text())["eval/test/top1"]
        print(f"{r['dataset']}: final test_top1 {float(r['test_top1']):.6f}  vitp eval {ev:.6f}", flush=True)
        ratios.append(float(r["test_top1"]) / ev if ev else float(float(r["test_top1"]) == ev))
    print(f"suite {t_suite:.1f} s, {len(rows)} cells one by one {t_one:.1f} s")
    print(f"ratio suite_vs_one_by_one {t_suite / t_one:.3f}")
    print(f"ratio final_top1_vs_eval {min(ratios):.6f}")


if __name__ == "__main__":
    main()
