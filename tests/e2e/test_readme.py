"""The README's user guide cannot rot: every fenced block marked `readme-test` is run, command by
command, on the local SLURM cluster and MLflow server, with tiny settings (the paper-size recipes are
shrunk to a 2-layer ViT on 2 CPU nodes; everything else is the README's text), and what each command
prints is checked: prep's and verify's counts, the job table, the metrics."""

import json
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
# prefix → (options: set to these values, replacing the README's own, or added; overrides appended at the end)
SHARDING = {"--workers": "1", "--max-samples-per-shard": "200"}
TINY = {
    "vitp submit pretrain": ({}, TINY_MODEL + LOCAL_CLUSTER + ["model.img_size=16", "model.representation_size=32",
                                                               "train.steps=6", "train.eval_every=0"]),
    "vitp submit transfer": ({}, TINY_MODEL + LOCAL_CLUSTER + ["model.img_size=32", "train.steps=4"]),
    "vitp submit prep": (SHARDING, ["cluster.partition=debug", "cluster.cpus_per_task=1"]),
    "vitp prep": ({**SHARDING, "--no-progress": None}, []),
}
DIGITS = 1797  # scikit-learn's digits, the images the test uses


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
    """The README's command with the test's option values (replacing its own: argparse takes the last
    one, so appending `--workers 1` before a README `--workers 16` would not count) and overrides."""
    for prefix, (opts, overrides) in TINY.items():
        if cmd.startswith(prefix + " "):
            words = cmd.split()
            for name, value in opts.items():
                if name in words:
                    if value is not None:
                        words[words.index(name) + 1] = value
                else:
                    words += [name] if value is None else [name, value]
            return " ".join(words + overrides)
    return cmd


def test_readme_blocks_are_found_and_cover_the_guide():
    cmds = readme_commands((ROOT / "README.md").read_text())
    firsts = {" ".join(c.split()[:3 if c.startswith("vitp submit") else 2]) for c in cmds}
    for needed in ["vitp prep", "vitp verify", "vitp plan", "vitp submit pretrain", "vitp submit transfer",
                   "vitp submit prep", "vitp jobs", "vitp logs", "vitp eval", "vitp inspect", "vitp export"]:
        assert needed in firsts, needed
    assert with_tiny_overrides("vitp prep $IMAGES $SHARDS --val-fraction 0.01 --workers 16") == (
        "vitp prep $IMAGES $SHARDS --val-fraction 0.01 --workers 1 --max-samples-per-shard 200 --no-progress")


class Checks:
    """What each README command must print, given what came before (job ids, counts)."""

    def __init__(self, tmp_path: Path):
        self.tmp, self.jobs, self.info = tmp_path, {}, None

    def __call__(self, cmd: str, out: str) -> None:
        name = " ".join(cmd.split()[:3 if cmd.startswith("vitp submit") else 2])
        getattr(self, re.sub(r"\W", "_", name), lambda out: None)(out)

    def vitp_prep(self, out):
        summary = json.loads(out)
        assert summary["complete"] and summary["shards_written"] == summary["shards_total"] == 10  # 1797 / 200
        assert sum(summary["num_samples"].values()) == DIGITS and summary["num_samples"]["val"] == 20  # 1% per class
        self.info = summary["num_samples"]

    def vitp_verify(self, out):
        assert out.strip().endswith(f"OK: 10 shards, {DIGITS} samples (train {self.info['train']}, "
                                    f"val {self.info['val']}), 0 rejects"), out

    def vitp_submit_prep(self, out):
        self._submitted("prep", out, tasks=3)

    def vitp_submit_pretrain(self, out):
        self._submitted("pretrain", out)

    def vitp_submit_transfer(self, out):
        self._submitted("transfer", out)

    def _submitted(self, stage, out, tasks=0):
        lines = out.splitlines()
        job = re.fullmatch(r"job (\S+)", lines[0]).group(1)
        ids = [f"{job}_{i}" for i in range(tasks)] if tasks else [job]
        assert [ln for ln in lines if ln.startswith("job ") and "COMPLETED" in ln] == [
            f"job {i} COMPLETED status=completed" + (f" step={s}" if (s := {"pretrain": 6, "transfer": 4}.get(stage))
                                                     else "") + f" (logs: vitp logs {i})" for i in ids], out
        self.jobs.update({i: stage for i in ids})

    def vitp_jobs(self, out):
        rows = [ln.split() for ln in out.splitlines()[1:]]
        assert {(r[0], r[1], r[2]) for r in rows} == {(j, s, "COMPLETED") for j, s in self.jobs.items()}, out
        assert {r[0]: r[5] for r in rows} == {j: "1" if s == "prep" else "2" for j, s in self.jobs.items()}

    def vitp_logs(self, out):
        assert "vitp: pretrain rank 0/2" in out and re.search(r"^step +6/6\b", out, flags=re.M), out[-2000:]

    def vitp_eval(self, out):
        top1 = float(re.search(r"^val/top1 +(\S+)$", out, flags=re.M).group(1))
        assert 0.0 <= top1 <= 1.0
        results = json.loads(Path(re.search(r"^results: (\S+)$", out, flags=re.M).group(1)).read_text())
        assert round(results["eval/val/top1"], 4) == top1
        assert any(k.startswith("eval/fewshot") for k in results) and any("probe" in k for k in results), results

    def vitp_inspect(self, out):
        pngs = [Path(p) for p in out.split() if p.endswith(".png")]
        assert len(pngs) >= 2 and all(p.is_file() for p in pngs), out

    def vitp_export(self, out):
        assert re.fullmatch(r"wrote \S+vit_l16_384_timm.safetensors: \d+ tensors, [\d.]+M parameters \(timm\)\n", out)

    def python__c(self, out):
        assert {"pretrain", "transfer"} <= set(out.split()), out


@pytest.mark.slurm
@pytest.mark.mlflow_server
@pytest.mark.slow
def test_every_readme_command_runs(tmp_path, slurm_cluster, mlflow_server):
    from launch.demo import write_digits
    from tests.data_prep_fixtures import tree_bytes

    write_digits(tmp_path / "digits")  # real images: an ImageFolder under digits/images
    env = dict(os.environ, IMAGES=str(tmp_path / "digits" / "images"), SHARDS=str(tmp_path / "shards"),
               RUNS=str(tmp_path / "runs"), MLFLOW_TRACKING_URI=mlflow_server,
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    env.pop("WORLD_SIZE", None)
    check, job = Checks(tmp_path), None
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
        # the array writes the same plan into its own folder (into $SHARDS, which `vitp prep` has just
        # completed, every task would skip every shard); the two must come out byte-identical
        own = {"SHARDS": str(tmp_path / "shards_array")} if cmd.startswith("vitp submit prep") else {}
        r = subprocess.run(["bash", "-c", cmd], cwd=ROOT, env={**env, **own}, capture_output=True, text=True,
                           timeout=900)
        assert r.returncode == 0, f"{cmd}\n--- stdout\n{r.stdout[-3000:]}\n--- stderr\n{r.stderr[-3000:]}"
        check(cmd, r.stdout)
        m = re.search(r"^job (\S+)$", r.stdout, flags=re.M)
        if m:
            job = m.group(1)
        if cmd.startswith("vitp plan"):
            assert "ZeRO" in r.stdout
    assert tree_bytes(tmp_path / "shards") == tree_bytes(tmp_path / "shards_array")
    runs = tmp_path / "runs"
    assert (runs / "vit_l16" / "model.safetensors").is_file()
    assert (runs / "vit_l16_384" / "results.json").is_file()
    assert (runs / "vit_l16_384_timm.safetensors").is_file()
    assert len(list((runs / "vit_l16" / "figures").glob("*.png"))) >= 2
