"""The README's user guide cannot rot: every fenced block marked `readme-test` is run, command by
command, on the local SLURM cluster and MLflow server, with tiny overrides appended (the paper-size
recipes are shrunk to a 2-layer ViT on 2 CPU nodes; everything else is the README's text)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Appended to config-driven commands: a 2-layer ViT, a few steps, the local cluster, fp32 on CPU.
TINY_MODEL = ["model.width=32", "model.depth=2", "model.heads=2", "model.mlp_dim=64", "model.patch=4",
              "model.dropout=0.0", "data.workers=1", "data.shuffle_buffer=64", "engine.precision=fp32",
              "train.global_batch=8", "train.micro_batch=4", "train.log_every=2", "checkpoint.every=0",
              "schedule.warmup_steps=1"]
LOCAL_CLUSTER = ["cluster.nodes=2", "cluster.tasks_per_node=1", "cluster.gpus_per_node=0", "cluster.cpus_per_task=1",
                 "cluster.mem_gb=null", "cluster.exclusive=false", "cluster.partition=debug", "cluster.time_min=20"]
# prefix → (options inserted right after the prefix, overrides appended at the end)
SHARDING = ["--workers", "1", "--max-samples-per-shard", "200"]
TINY = {
    "vitp submit pretrain": ([], TINY_MODEL + LOCAL_CLUSTER + ["model.img_size=16", "model.representation_size=32",
                                                               "train.steps=6", "train.eval_every=0"]),
    "vitp submit transfer": ([], TINY_MODEL + LOCAL_CLUSTER + ["model.img_size=32", "train.steps=4"]),
    "vitp submit prep": (SHARDING, ["cluster.partition=debug", "cluster.cpus_per_task=1"]),
    "vitp prep": (SHARDING + ["--no-progress"], []),
}


def readme_commands(text: str) -> list[str]:
    """Commands of the ```bash readme-test blocks, continuation lines joined, comments dropped."""
    cmds = []
    for block in re.findall(r"```bash readme-test\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #")[0].strip()
            if line and not line.startswith("#"):
                cmds.append(line)
    return cmds


def with_tiny_overrides(cmd: str) -> str:
    for prefix, (opts, overrides) in TINY.items():
        if cmd.startswith(prefix + " "):
            return " ".join([prefix, *opts, cmd[len(prefix) + 1:], *overrides])
    return cmd


def test_readme_blocks_are_found_and_cover_the_guide():
    cmds = readme_commands((ROOT / "README.md").read_text())
    firsts = {" ".join(c.split()[:3 if c.startswith("vitp submit") else 2]) for c in cmds}
    for needed in ["vitp prep", "vitp verify", "vitp plan", "vitp submit pretrain", "vitp submit transfer",
                   "vitp submit prep", "vitp jobs", "vitp logs", "vitp eval", "vitp inspect", "vitp export"]:
        assert needed in firsts, needed


@pytest.mark.slurm
@pytest.mark.mlflow_server
@pytest.mark.slow
def test_every_readme_command_runs(tmp_path, slurm_cluster, mlflow_server):
    from launch.demo import write_digits

    write_digits(tmp_path / "digits")  # real images: an ImageFolder under digits/images
    env = dict(os.environ, IMAGES=str(tmp_path / "digits" / "images"), SHARDS=str(tmp_path / "shards"),
               RUNS=str(tmp_path / "runs"), MLFLOW_TRACKING_URI=mlflow_server,
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    env.pop("WORLD_SIZE", None)
    job = None
    for cmd in readme_commands((ROOT / "README.md").read_text()):
        if "<JOB>" in cmd:
            assert job, f"{cmd}: no job submitted before it"
            cmd = cmd.replace("<JOB>", job)
        cmd = with_tiny_overrides(cmd)
        # log_dir under tmp: `vitp jobs`/`logs` read the same index the submissions wrote
        if cmd.startswith("vitp submit"):
            cmd += f" cluster.log_dir={tmp_path / 'jobs'}"
        elif cmd.startswith(("vitp jobs", "vitp logs")):
            cmd += f" --log-dir {tmp_path / 'jobs'}"
        r = subprocess.run(["bash", "-c", cmd], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, f"{cmd}\n--- stdout\n{r.stdout[-3000:]}\n--- stderr\n{r.stderr[-3000:]}"
        m = re.search(r"^job (\S+)$", r.stdout, flags=re.M)
        if m:
            job = m.group(1)
        if cmd.startswith("vitp plan"):
            assert "ZeRO" in r.stdout
    runs = tmp_path / "runs"
    assert (runs / "vit_l16" / "model.safetensors").is_file()
    assert (runs / "vit_l16_384" / "results.json").is_file()
    assert (runs / "vit_l16_384_timm.safetensors").is_file()
    assert len(list((runs / "vit_l16" / "figures").glob("*.png"))) >= 2
