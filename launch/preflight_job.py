"""The preflight job (what `vitp preflight` and `vitp submit --preflight` queue and report) and the
driver probe of `vitp submit`; the command itself is launch/preflight.py.

    vitp preflight --config configs/pretrain/vit_l16.yaml --resources configs/cluster/h100_8x.yaml \\
        cluster.nodes=16 data.path=/data/shards run.dir=/data/runs/vit_l16
    vitp submit pretrain ... --preflight        # the same first; the real job is queued only if it passed

The preflight takes the run's own arguments and goes through the same submit machinery
(launch/submit.py, a launch/job_body.py StageJob) on the same partition, node count and tasks, for
``--time-min`` minutes. Its ranks run pipeline/preflight.py in a gloo group (so the report gets out
even where NCCL does not work) and rank 0 writes the table into the job's result.json; this side
prints it and a verdict.

Before queuing a GPU job, `vitp submit` asks one node of the partition (``srun -N1`` of this Python,
no GPU requested: the driver's kernel module answers without a device) for torch's CUDA build and
the node's NVIDIA driver, and refuses with one line naming both when they do not fit
(pipeline/driver.py holds NVIDIA's table). The preflight asks every node.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
from pathlib import Path

from .job_body import StageJob
from .jobs import outcome, read_result, wait

TARGET = "pipeline.preflight:preflight"
PROBE_WAIT_S = 120  # srun --immediate: how long the probe may wait for a node before it is skipped
ROOT = Path(__file__).resolve().parents[1]

DEFAULTS = {"io_mb": 256, "read_mb": 1024, "allreduce_mb": 64.0, "min_fabric": 0.5, "time_min": 10}


def add_preflight_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--io-mb", type=int, default=DEFAULTS["io_mb"],
                   help=f"MiB each node writes and fsyncs in run.dir (default {DEFAULTS['io_mb']})")
    p.add_argument("--read-mb", type=int, default=DEFAULTS["read_mb"],
                   help=f"MiB of shards each node reads, at most (default {DEFAULTS['read_mb']})")
    p.add_argument("--allreduce-mb", type=float, default=DEFAULTS["allreduce_mb"],
                   help=f"all-reduce message size in MiB (default {DEFAULTS['allreduce_mb']:g})")
    p.add_argument("--min-fabric", type=float, default=DEFAULTS["min_fabric"],
                   help="fraction of the bus bandwidth vitp plan assumes (NVLink, or across nodes "
                        "hardware.nics_per_node x inter_node_gbps) NCCL's bus bandwidth must reach "
                        f"(default {DEFAULTS['min_fabric']:g})")
    p.add_argument("--time-min", type=int, default=DEFAULTS["time_min"],
                   help=f"time limit of the preflight job in minutes (default {DEFAULTS['time_min']})")


def wants_gpus(cfg) -> tuple[bool, bool]:
    """(GPUs asked for, NCCL asked for) by the run the preflight prepares."""
    from pipeline.distributed import wants_gpu

    gpus = wants_gpu(cfg.engine.backend, cfg.cluster.gpus_per_node)
    return gpus, gpus and cfg.engine.backend != "gloo"


def preflight_job(cfg, opts: dict):
    """(the config the job is submitted with, the StageJob its tasks run).

    The submission keeps the run's resources (partition, nodes, tasks, GPUs) for ``time_min``
    minutes; the tasks' own config asks for gloo and no GPU so the job's group always forms, and the
    preflight is told what the run wants instead.
    """
    from pipeline.config import to_dict

    job_cfg = copy.deepcopy(cfg)
    job_cfg.cluster.time_min = opts["time_min"]
    job_cfg.cluster.job_name = f"{cfg.cluster.job_name}-preflight"
    inner = to_dict(job_cfg)
    inner["engine"]["backend"], inner["cluster"]["gpus_per_node"] = "gloo", 0
    gpus, nccl = wants_gpus(cfg)
    kwargs = {"want_gpus": gpus, "want_nccl": nccl, "io_mb": opts["io_mb"], "read_mb": opts["read_mb"],
              "allreduce_mb": opts["allreduce_mb"], "min_fabric": opts["min_fabric"]}
    return job_cfg, StageJob("preflight", inner, kwargs=kwargs, target=TARGET)


def report(cfg, entry: dict) -> int:
    """Wait for a submitted preflight, print the table and the verdict; 0 passed, 1 failed."""
    nodes, tasks = cfg.cluster.nodes, cfg.world_size_planned
    print(f"preflight job {entry['job_id']}: {nodes} node(s), {tasks} task(s)"
          f"{' on ' + cfg.cluster.partition if cfg.cluster.partition else ''}", flush=True)
    state = wait([entry])[entry["job_id"]]
    ok, line = outcome(entry, state)
    res = read_result(entry["folder"]) or {}
    if not ok or "passed" not in res:
        print(f"preflight FAILED: {line}", file=sys.stderr, flush=True)
        return 1
    print(res["table"], flush=True)
    print(res["verdict"], file=sys.stdout if res["passed"] else sys.stderr, flush=True)
    return 0 if res["passed"] else 1


# --------------------------------------------------------------------------------------------------
# The driver probe of `vitp submit`
# --------------------------------------------------------------------------------------------------
def probe_command(cfg) -> list[str]:
    """One task on one node of the job's partition, no GPU asked (none needs to be free), this Python."""
    c = cfg.cluster
    cmd = ["srun", "-N1", "-n1", f"--immediate={PROBE_WAIT_S}", "--time=2", f"--job-name={c.job_name}-driver"]
    for key in ("partition", "account", "qos", "constraint"):
        if getattr(c, key):
            cmd.append(f"--{key}={getattr(c, key)}")
    return [*cmd, sys.executable, "-m", "pipeline.driver"]


def node_probe(cfg, cluster: str) -> dict | str:
    """The compute node's {host, torch_cuda, driver, problem}, or why it could not be learned."""
    if cluster != "slurm":  # the local executors run on this machine
        from pipeline.driver import probe

        return probe()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    try:
        r = subprocess.run(probe_command(cfg), capture_output=True, text=True, env=env, timeout=PROBE_WAIT_S + 180)
    except (OSError, subprocess.SubprocessError) as e:
        return f"srun failed ({e})"
    lines = [x for x in r.stdout.splitlines() if x.startswith("{")]
    if r.returncode or not lines:
        err = (r.stderr.strip().splitlines() or [f"exit {r.returncode}"])[-1]
        return f"srun on {cfg.cluster.partition or 'the default partition'} failed: {err}"
    return json.loads(lines[-1])


class DriverMismatch(ValueError):
    """torch's CUDA build cannot start on the compute node's NVIDIA driver; one line naming both."""


def check_driver(cfg, cluster: str) -> None:
    """Refuse a GPU job whose torch cannot start on the partition's driver (one line, both versions)."""
    gpus, _ = wants_gpus(cfg)
    if not gpus:
        return
    got = node_probe(cfg, cluster)
    if isinstance(got, str):
        print(f"warning: could not learn the compute nodes' NVIDIA driver ({got}); the job checks it at start",
              file=sys.stderr, flush=True)
        return
    if got["problem"]:
        raise DriverMismatch(f"{got['problem']}: a GPU job would fail at start; not queued (a torch built for the "
                          "node's CUDA, or a newer driver; `vitp preflight` checks every node)")
