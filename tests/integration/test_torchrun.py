"""torchrun, as Kubernetes training operators, torchx and SkyPilot start a stage: its agent already
serves the rendezvous store on MASTER_PORT, and the ranks join it. The same tiny pre-training under
`torchrun --nproc_per_node 2 -m launch.cli pretrain ...` and under vitp's own 2-rank launcher logs the
same losses and ends with the same weights, bit for bit. The launcher's side is the session's ZeRO-2
reference run (tests/conftest.py's tiny_reference), which the pre-training tests make anyway."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pipeline.distributed import free_port
from tests.integration.test_pretrain import COMMON, SYNTHETIC, TINY

pytestmark = pytest.mark.distributed
ROOT = Path(__file__).resolve().parents[2]
# the reference's settings exactly (6 steps, a checkpoint every 2, ZeRO-2): its run is vitp's launcher's
ARGS = ["--config", TINY, *COMMON, *SYNTHETIC, "engine.zero_stage=2"]
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def losses(run: Path) -> dict[int, float]:
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in recs if "loss" in r}


def test_torchrun_runs_a_stage_like_vitps_own_launcher(tiny_reference, tmp_path):
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun)] if torchrun.is_file() else [sys.executable, "-m", "torch.distributed.run"]
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    r = subprocess.run([*cmd, "--nproc_per_node", "2", "--master_port", str(free_port()), "-m", "launch.cli",
                        "pretrain", *ARGS, f"run.dir={tmp_path / 'torchrun'}"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "pretrain: 2 rank(s)" in r.stdout

    a, b = tmp_path / "torchrun", tiny_reference(2)  # b: launch.local.run_local, 2 ranks
    assert sorted(losses(a)) == [1, 2, 3, 4, 5, 6] and losses(a) == losses(b)
    wa, wb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert (a / "checkpoints/LATEST").read_text() == (b / "checkpoints/LATEST").read_text()
