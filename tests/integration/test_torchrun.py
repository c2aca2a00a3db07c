"""One command, three launchers, the same bits. torchrun (as Kubernetes training operators, torchx and
SkyPilot start a stage: its agent already serves the rendezvous store on MASTER_PORT and the ranks join
it), vitp's own 2-rank launcher (`run_local`) and `vitp submit --cluster local` (submitit's local
executor, as a SLURM task: no OMP_NUM_THREADS of its own) run the same tiny pre-training over `vitp prep`
shards of real images. Each rank takes its CPU threads from cluster.cpus_per_task
(pipeline.distributed.use_cpu_threads), whatever its launcher put in OMP_NUM_THREADS, so the logged
losses and the final weights are equal bit for bit, at 1 thread per rank and at 2."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from launch.local import run_local
from pipeline.network import free_port
from tests.data_prep_fixtures import build_corpus, vitp_prep

pytestmark = pytest.mark.distributed
ROOT = Path(__file__).resolve().parents[2]
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("shards")
    build_corpus(d / "images", n_good_per_class=12)
    vitp_prep(d / "images", d / "shards")
    return d / "shards"


def stage_args(data: Path, cpus: int) -> list[str]:
    # depth 1, 4 steps: enough for 1 thread against 2 to show in the weights (fp32 sums in another order)
    return ["--config", str(ROOT / "configs/pretrain/tiny_cpu.yaml"), f"data.path={data}", "data.val_split=",
            "model.depth=1", "train.steps=4", "train.log_every=1", "checkpoint.every=2", "tracking.enabled=false",
            "schedule.warmup_steps=2", "schedule.decay=constant", f"cluster.cpus_per_task={cpus}"]


def losses(run: Path) -> dict[int, float]:
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in recs if "loss" in r}


def vitp_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


@pytest.mark.parametrize("cpus", [1, 2])
def test_torchrun_submit_and_vitps_own_launcher_give_the_same_bits(shards, tmp_path, monkeypatch, cpus):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # a user's shell: each launcher does what it does
    args = stage_args(shards, cpus)
    # torchrun's console script is this module's main; through this interpreter every launcher's ranks run
    # the same python path (DeepSpeed's JIT-built CPU comm op is rebuilt when its include paths change)
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                        str(free_port()), "-m", "launch.cli", "pretrain", *args, f"run.dir={tmp_path / 'torchrun'}"],
                       cwd=ROOT, env=vitp_env(), capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "pretrain: 2 rank(s)" in r.stdout
    assert run_local(["pretrain", *args, f"run.dir={tmp_path / 'local'}"], 2, timeout=900) == 0
    r = subprocess.run([sys.executable, "-m", "launch.cli", "submit", "pretrain", "--cluster", "local", *args,
                        f"run.dir={tmp_path / 'submit'}", f"cluster.log_dir={tmp_path / 'jobs'}", "--wait"],
                       cwd=ROOT, env=vitp_env(), capture_output=True, text=True, timeout=900,
                       stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]

    runs = [tmp_path / "torchrun", tmp_path / "local", tmp_path / "submit"]
    assert sorted(losses(runs[0])) == [1, 2, 3, 4]
    assert losses(runs[1]) == losses(runs[0]) and losses(runs[2]) == losses(runs[0])
    w = [load_file(str(run / "model.safetensors")) for run in runs]
    for other in w[1:]:
        assert other.keys() == w[0].keys()
        assert [k for k in w[0] if not torch.equal(w[0][k], other[k])] == []
    assert len({(run / "checkpoints/LATEST").read_text() for run in runs}) == 1
