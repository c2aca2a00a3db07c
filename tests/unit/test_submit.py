"""The launch layer without a cluster: resources → sbatch, config merging, sweeps, shard ranges, data
checks, rank/world from a job environment, and rendezvous failures that must be errors, not hangs."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from launch.attempts import batch_lines
from launch.job_body import job_dist_env
from launch.submit import (
    SubmitError,
    check_cluster,
    check_data,
    load_submit_config,
    parse_sweep,
    slurm_parameters,
    split_shards,
)
from pipeline.config import ConfigError
from pipeline.distributed import DistEnv, RendezvousError, init_process_group
from pipeline.network import free_port, port_free, rendezvous_port

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs/pretrain/tiny_cpu.yaml")
H100 = str(ROOT / "configs/cluster/h100_8x.yaml")


def test_slurm_parameters_from_resources_file():
    cfg = load_submit_config(str(ROOT / "configs/pretrain/vit_b16.yaml"),
                             ["cluster.nodes=4", "cluster.account=vision", "cluster.qos=high", "cluster.time_min=90",
                              "cluster.extra_sbatch={mail-type: END}"], H100)
    setup, teardown = batch_lines(cfg.cluster.log_dir, cfg.cluster.max_failures)
    assert slurm_parameters(cfg) == {
        "name": cfg.cluster.job_name, "nodes": 4, "tasks_per_node": 8, "gpus_per_node": 8, "cpus_per_task": 12,
        "mem_gb": 960.0, "timeout_min": 90, "slurm_partition": "gpu", "slurm_account": "vision",
        "slurm_qos": "high", "slurm_exclusive": True, "slurm_signal_delay_s": 300,
        "slurm_additional_parameters": {"requeue": True, "mail-type": "END"},
        "slurm_srun_args": ["--kill-on-bad-exit=1"],  # a dead task ends the step (tests/unit/test_attempts.py)
        "slurm_setup": [*setup, "export SRUN_CPUS_PER_TASK=12"],  # srun inherits --cpus-per-task on every version
        "slurm_teardown": teardown}


def test_slurm_parameters_render_to_sbatch(tmp_path):
    if shutil.which("srun") is None:
        pytest.skip("submitit's SLURM executor needs srun on PATH")
    from launch.submit import make_executor

    cfg = load_submit_config(TINY, ["cluster.nodes=2", "cluster.tasks_per_node=1", "cluster.partition=debug",
                                    f"cluster.log_dir={tmp_path}", "cluster.signal_delay_s=45"])
    text = make_executor(cfg, "slurm")._executor._make_submission_file_text("python x", "u")
    for line in ("--nodes=2", "--ntasks-per-node=1", "--partition=debug", "--signal=USR2@45", "--requeue",
                 "--time=30", "--cpus-per-task=1"):
        assert f"#SBATCH {line}" in text, line


def test_resources_merge_order_and_checks(tmp_path):
    cfg = load_submit_config(TINY, ["cluster.nodes=2"], str(ROOT / "configs/cluster/local_debug.yaml"))
    # recipe (1 x 2 tasks) < resources file (2 nodes x 1 task, partition debug) < overrides
    assert (cfg.cluster.nodes, cfg.cluster.tasks_per_node, cfg.cluster.partition) == (2, 1, "debug")
    assert cfg.cluster.job_name == "vitp-debug" and cfg.model.width == 64
    bad = tmp_path / "res.yaml"
    bad.write_text("cluster: {nodes: 2}\noptim: {lr: 1.0}\n")
    with pytest.raises(ConfigError, match="optim: a resources file holds only cluster: and hardware:"):
        load_submit_config(TINY, [], str(bad))
    with pytest.raises(ConfigError, match="cluster.nodes: must be >= 1; got 0"):
        load_submit_config(TINY, ["cluster.nodes=0"])
    with pytest.raises(ConfigError, match="train.global_batch: 32 is not divisible by world size 3"):
        load_submit_config(TINY, ["cluster.nodes=3", "cluster.tasks_per_node=1"])
    with pytest.raises(SubmitError, match="one task per GPU"):
        check_cluster(load_submit_config(TINY, ["cluster.gpus_per_node=4"]), "local")


def test_per_task_gpu_binding_is_warned_about(capsys):
    """Each task bound to its own GPU can cost NVLink (NVIDIA/nccl#1066); vitp's default does not."""
    check_cluster(load_submit_config(TINY, ["cluster.gpus_per_node=2"]), "local")
    assert capsys.readouterr().err == ""
    check_cluster(load_submit_config(TINY, ["cluster.gpus_per_node=2", "cluster.extra_sbatch={gpus-per-task: '1'}"]),
                  "local")
    err = capsys.readouterr().err.strip()
    assert err.startswith("warning: cluster.extra_sbatch.gpus-per-task: each task sees only its own GPU;")
    assert "NVLink" in err and "\n" not in err


def test_parse_sweep(tmp_path):
    assert parse_sweep([]) == []
    assert parse_sweep(["optim.lr=1e-3,3e-4", "train.steps=10,20"]) == [
        ["optim.lr=1e-3", "train.steps=10"], ["optim.lr=1e-3", "train.steps=20"],
        ["optim.lr=3e-4", "train.steps=10"], ["optim.lr=3e-4", "train.steps=20"]]
    f = tmp_path / "sweep.yaml"
    f.write_text("- {optim.lr: 0.001, model.name: vit_b16}\n- {optim.lr: 0.0003}\n")
    assert parse_sweep([], str(f)) == [["optim.lr=0.001", "model.name=vit_b16"], ["optim.lr=0.0003"]]
    with pytest.raises(SubmitError, match="expected KEY=V1,V2"):
        parse_sweep(["optim.lr"])


SUBMIT = ["pretrain", "--config", TINY, "--cluster", "local", "data.path=synthetic", "cluster.tasks_per_node=1"]


def test_dry_run_checks_every_sweep_task_prints_sbatch_parameters_and_submits_nothing(tmp_path, capsys):
    from launch.cli import run_command
    from launch.submit import submit_main

    jobs, run = tmp_path / "jobs", tmp_path / "run"
    where = [f"cluster.log_dir={jobs}", f"run.dir={run}"]
    assert submit_main([*SUBMIT, *where, "--dry-run", "--sweep", "optim.lr=1e-3,3e-4"]) == 0
    printed = json.loads(capsys.readouterr().out)
    want = slurm_parameters(load_submit_config(TINY, ["data.path=synthetic", "cluster.tasks_per_node=1", *where]))
    assert printed == want and printed["tasks_per_node"] == 1 and printed["nodes"] == 1
    # one bad task in the sweep fails the whole submission, before anything is queued
    assert run_command(submit_main, [*SUBMIT, *where, "--dry-run", "--sweep", "train.micro_batch=16,7"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: train.global_batch: 32 is not divisible") and len(err.splitlines()) == 1
    assert not jobs.exists() and not run.exists()  # no index, no job folder, no run dir
    # an array shares one set of sbatch parameters: a point that changes them is refused, by name
    assert run_command(submit_main, [*SUBMIT, *where, "--dry-run", "--sweep", "cluster.time_min=30,60"]) == 2
    err = capsys.readouterr().err
    assert err == ("error: --sweep: point 'cluster.time_min=60' changes the job's timeout_min (30 -> 60); an array "
                   "job has one set of sbatch parameters, submit it separately\n")


def record_stage(cfg) -> dict:
    """A stand-in stage for the sweep test: records what its task was given."""
    import os

    run = Path(cfg.run.dir)
    run.mkdir(parents=True, exist_ok=True)
    (run / "seen.json").write_text(json.dumps({"lr": cfg.optim.lr, "steps": cfg.train.steps,
                                               "tags": json.loads(os.environ["VITP_MLFLOW_TAGS"])}))
    return {"status": "completed", "step": cfg.train.steps, "run_dir": str(run)}


def test_sweep_and_sweep_file_submit_one_array_task_each(tmp_path, capsys, monkeypatch):
    """--sweep x --sweep-file rows: one array task each, its own run dir (base/SWEEP_ID/i unless the row
    names one), its own resolved config, and the sweep's MLflow tags."""
    from launch.jobs import read_index, wait
    from launch.submit import submit_main

    monkeypatch.setenv("PYTHONPATH", str(ROOT))  # the tasks import this module for record_stage
    jobs, run, own = tmp_path / "jobs", tmp_path / "run", tmp_path / "own"
    rows = tmp_path / "sweep.yaml"
    rows.write_text(f"- {{train.steps: 3}}\n- {{train.steps: 5, run.dir: {own}}}\n")
    argv = [*SUBMIT, f"cluster.log_dir={jobs}", f"run.dir={run}", "--sweep", "optim.lr=0.002",
            "--sweep-file", str(rows)]
    assert submit_main(argv, target="tests.unit.test_submit:record_stage") == 0
    out = capsys.readouterr().out.splitlines()
    entries = read_index(jobs)
    assert len(entries) == 2 and len({e["sweep"] for e in entries}) == 1
    sweep = entries[0]["sweep"]
    assert out[0].startswith("job ") and [ln.split()[1] for ln in out[1:]] == [e["job_id"] for e in entries]
    states = wait(entries, poll_s=0.5, timeout_s=300)
    assert list(states.values()) == ["COMPLETED", "COMPLETED"], states
    dirs = [run / sweep / "0", own]
    assert [e["run_dir"] for e in entries] == [str(d) for d in dirs]
    for i, (d, steps) in enumerate(zip(dirs, (3, 5))):
        seen = json.loads((d / "seen.json").read_text())
        assert (seen["lr"], seen["steps"]) == (0.002, steps)
        assert seen["tags"] == {"sweep": sweep, "sweep_index": str(i),
                                "sweep_overrides": f"optim.lr=0.002 train.steps={steps}"
                                + ("" if i == 0 else f" run.dir={own}")}
        resolved = (Path(entries[i]["folder"]) / "config.yaml").read_text()
        assert f"steps: {steps}" in resolved and "lr: 0.002" in resolved


@pytest.mark.parametrize("n,tasks", [(10, 3), (3, 3), (2, 5), (7, 1), (100, 16)])
def test_split_shards_covers_plan(n, tasks):
    ranges = split_shards(n, tasks)
    assert len(ranges) == min(n, tasks)
    assert ranges[0][0] == 0 and ranges[-1][1] == n
    assert all(a < b for a, b in ranges) and all(ranges[i][1] == ranges[i + 1][0] for i in range(len(ranges) - 1))
    sizes = [b - a for a, b in ranges]
    assert max(sizes) - min(sizes) <= 1


def test_check_data(tmp_path, capsys):
    def cfg(*o):
        return load_submit_config(TINY, list(o))  # 1 node x 2 tasks, workers 1, data.val_split: val

    with pytest.raises(SubmitError, match="data.path: empty"):
        check_data(cfg(), "pretrain")
    with pytest.raises(SubmitError, match=r"_info.json: not found"):
        check_data(cfg(f"data.path={tmp_path}"), "pretrain")
    (tmp_path / "_info.json").write_text(json.dumps({"splits": {"train": {"filenames": ["a.tar"]}}}))
    # the shipped recipes evaluate on 'val': a dataset without it fails here, not at the end of training
    with pytest.raises(SubmitError, match=r"^data.val_split: 'val' not in .*\(has: train\); re-run vitp prep"):
        check_data(cfg(f"data.path={tmp_path}"), "pretrain")
    with pytest.raises(SubmitError, match=r"^data.val_split: 'val' not in"):
        check_data(cfg(f"data.path={tmp_path}"), "eval")
    with pytest.raises(SubmitError, match="^data.train_split: 'big' not in"):
        check_data(cfg(f"data.path={tmp_path}", "data.train_split=big", "data.val_split="), "pretrain")
    check_data(cfg(f"data.path={tmp_path}", "data.val_split="), "pretrain")
    with pytest.raises(SubmitError, match=r"^data.val_split: 'val' not in"):  # transfer's final eval reads val
        check_data(cfg(f"data.path={tmp_path}", "data.val_split="), "transfer")
    # one shard for 2 ranks x 2 workers: the loader splits samples, so no refusal and, locally, no warning
    check_data(cfg(f"data.path={tmp_path}", "data.val_split=", "data.workers=2"), "pretrain")
    assert capsys.readouterr().err == ""
    (tmp_path / "_info.json").write_text(json.dumps({"splits": {"train": {"filenames": ["https://h/a.tar"]}}}))
    check_data(cfg(f"data.path={tmp_path}", "data.val_split=", "data.workers=2"), "pretrain")
    assert capsys.readouterr().err.startswith("warning: data.path: 1 remote 'train' shards for 4 loader streams")
    check_data(cfg("data.path=synthetic"), "pretrain")


def test_job_dist_env_from_submitit_environment():
    je = SimpleNamespace(job_id="4242", cluster="slurm", hostnames=["gpu07", "gpu08"])
    d = job_dist_env(je, environ=SLURM_TASK)
    assert (d.rank, d.world_size, d.local_rank, d.local_world_size, d.master_addr) == (5, 8, 1, 4, "gpu07")
    assert d.master_port == rendezvous_port("4242") and 20000 <= d.master_port < 40000
    assert job_dist_env(je, environ={**SLURM_TASK, "SLURM_RESTART_COUNT": "1"}).master_port != d.master_port
    # the submitting shell's MASTER_ADDR/PORT and RANK/WORLD_SIZE (sbatch exports them into the job) are
    # stale: ignored, the job reads its own executor's variables only
    stale = {**SLURM_TASK, "MASTER_ADDR": "login3", "MASTER_PORT": "1234", "RANK": "0", "WORLD_SIZE": "2"}
    got = job_dist_env(je, environ=stale)
    assert (got.rank, got.world_size, got.master_addr, got.master_port) == (5, 8, "gpu07", d.master_port)
    # the config chooses, when it says so
    chosen = job_dist_env(je, {"master_addr": "10.1.2.3", "master_port": 29400}, environ=stale)
    assert (chosen.master_addr, chosen.master_port) == ("10.1.2.3", 29400)
    # submitit's local executor: its own variables (SLURM's of an enclosing allocation are not this job's)
    local = SimpleNamespace(**{**je.__dict__, "cluster": "local"})
    loc = {**SLURM_TASK, "SUBMITIT_LOCAL_GLOBALID": "1", "SUBMITIT_LOCAL_LOCALID": "1", "SUBMITIT_LOCAL_NTASKS": "2",
           "SUBMITIT_LOCAL_JOB_NUM_NODES": "1"}
    d = job_dist_env(local, environ=loc)
    assert (d.rank, d.world_size, d.local_rank, d.local_world_size, d.master_addr) == (1, 2, 1, 2, "127.0.0.1")
    debug = SimpleNamespace(**{**je.__dict__, "cluster": "debug"})  # one process, as submitit's debug executor
    assert (job_dist_env(debug, environ=SLURM_TASK).rank, job_dist_env(debug, environ=SLURM_TASK).world_size) == (0, 1)


def test_config_check_counts_a_launchers_world_not_an_enclosing_allocation(monkeypatch):
    """`vitp submit` run inside an salloc/sbatch shell sees that shell's SLURM_NTASKS: the job it submits
    runs on the planned world, which the config check keeps; a launcher's RANK/WORLD_SIZE is the world."""
    from pipeline.config import load_config, world_size_from_env
    from pipeline.config.sections import ConfigError

    over = ["model.name=vit_ti16", "train.global_batch=8", "train.micro_batch=2", "cluster.nodes=1",
            "cluster.tasks_per_node=2"]
    cfg = load_config(None, over, world_size=2)
    assert world_size_from_env(cfg, {}) == 2  # no launcher: planned
    assert world_size_from_env(cfg, SLURM_TASK) == 2  # an enclosing allocation of 8 tasks: still planned
    assert world_size_from_env(cfg, {**SLURM_TASK, "RANK": "0", "WORLD_SIZE": "4"}) == 4
    for k in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    for k, v in SLURM_TASK.items():  # 8 tasks: 8 / (8 x 2) would not split
        monkeypatch.setenv(k, v)
    assert load_config(None, over).train.global_batch == 8
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")  # a launcher's 3 ranks: refused, naming the key
    with pytest.raises(ConfigError, match="train.global_batch: 8 is not divisible by world size 3"):
        load_config(None, over)


SLURM_TASK = {"SLURM_JOB_ID": "4242", "SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
              "SLURM_JOB_NUM_NODES": "2", "SLURM_NTASKS_PER_NODE": "4(x2)", "SLURM_JOB_NODELIST": "gpu[07-08]"}


@pytest.mark.parametrize("restart", [0, 1])
def test_dist_env_from_slurm_variables_agrees_with_the_job_launcher(restart):
    """A task started by srun alone (no launcher variables) reads rank/world/master from SLURM_*; a task
    started by submitit derives them in launch.job_body.job_dist_env. For the same job they must agree,
    the port above all: ranks that derive different ports never meet."""
    from pipeline.distributed import dist_env

    env = {**SLURM_TASK, "SLURM_RESTART_COUNT": str(restart)}
    d = dist_env(env)
    assert (d.rank, d.world_size, d.local_rank, d.local_world_size) == (5, 8, 1, 4)
    assert d.master_addr == "gpu07" and d.source == "slurm"
    assert d.master_port == 20000 + (4242 * 7 + restart) % 20000  # 29694 + restart
    je = SimpleNamespace(job_id="4242", cluster="slurm", hostnames=["gpu07", "gpu08"])
    j = job_dist_env(je, environ=env)
    assert (j.rank, j.world_size, j.local_rank, j.local_world_size, j.master_addr, j.master_port) == (
        d.rank, d.world_size, d.local_rank, d.local_world_size, d.master_addr, d.master_port)


def test_dist_env_precedence_and_defaults():
    from pipeline.distributed import dist_env

    # a launcher's variables win over SLURM's (torchrun inside an allocation)
    launcher = {**SLURM_TASK, "RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.9", "MASTER_PORT": "1234"}
    d = dist_env(launcher)
    assert (d.rank, d.world_size, d.local_rank, d.master_addr, d.master_port, d.source) == (
        1, 2, 0, "10.0.0.9", 1234, "env")
    # SLURM without SLURM_NTASKS_PER_NODE: tasks spread evenly; MASTER_* in the environment came from
    # the submitting shell (srun/sbatch copy it) and are ignored; engine.master_addr/port choose
    no_per_node = {k: v for k, v in SLURM_TASK.items() if k != "SLURM_NTASKS_PER_NODE"}
    d = dist_env({**no_per_node, "MASTER_ADDR": "login3", "MASTER_PORT": "2345"})
    assert (d.local_world_size, d.master_addr, d.master_port) == (4, "gpu07", rendezvous_port("4242"))
    d = dist_env({**no_per_node, "MASTER_ADDR": "login3"}, master_addr="gpu08", master_port=2345)
    assert (d.master_addr, d.master_port) == ("gpu08", 2345)
    assert dist_env({}) == DistEnv()  # no launcher, no SLURM: one process


def test_rendezvous_port_clash_is_a_clear_error():
    with socket.socket() as s:
        s.bind(("", 0))
        s.listen()
        port = s.getsockname()[1]
        assert not port_free(port)
        t0 = time.monotonic()
        with pytest.raises(RendezvousError, match=f"rendezvous port {port} .* already in use"):
            init_process_group(DistEnv(rank=0, world_size=2, master_port=port), "gloo", rendezvous_s=30)
        assert time.monotonic() - t0 < 5


RANK0_ALONE = """
import sys
from pipeline.distributed import DistEnv, RendezvousError, init_process_group
try:
    init_process_group(DistEnv(rank=0, world_size=2, master_port=int(sys.argv[1])), "gloo", rendezvous_s=2)
except RendezvousError as e:
    print("ERR", e)
"""


def test_missing_rank_times_out_with_message():
    port = free_port()
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-c", RANK0_ALONE, str(port)], capture_output=True, text=True,
                       cwd=ROOT, timeout=120)
    line = next(x for x in r.stdout.splitlines() if x.startswith("ERR"))
    assert "rank 0/2: rendezvous at 127.0.0.1" in line and "waiting for the other ranks" in line
    assert "engine.rendezvous_timeout_s" in line
    assert time.monotonic() - t0 < 60  # 2 s limit + interpreter start, nowhere near a hang


TWO_RANKS_LEAVE = """
import sys
import torch
import torch.distributed as dist
from pipeline.distributed import DistEnv, init_process_group, leave_process_group
rank, port = int(sys.argv[1]), int(sys.argv[2])
assert init_process_group(DistEnv(rank=rank, world_size=2, master_port=port), "gloo", rendezvous_s=60)
t = torch.tensor([rank + 1.0])
dist.all_reduce(t)
leave_process_group()
leave_process_group()  # no group left: a no-op
print("SUM", float(t), "LEFT", not dist.is_initialized())
"""


def test_ranks_leave_the_group_and_exit_cleanly():
    """Each rank ends with its gloo group destroyed and exits 0 (a group left alive at exit can abort)."""
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-c", TWO_RANKS_LEAVE, str(r), str(port)], cwd=ROOT, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for r in range(2)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-2000:]
        assert "SUM 3.0 LEFT True" in out, out[-2000:]
