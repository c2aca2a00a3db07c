"""`vitp submit STAGE`: a stage as a SLURM job (or array) through submitit.

    vitp submit pretrain --config configs/pretrain/vit_b16.yaml --resources configs/cluster/h100_8x.yaml \\
        cluster.nodes=4 data.path=/data/shards --wait
    vitp submit pretrain --config X.yaml --sweep optim.lr=1e-3,3e-4      # one array, one MLflow run each
    vitp submit prep ~/imagenet/train shards/ --tasks 16 --resize-shorter 256   # array over shard ranges
    vitp submit decontam shards/ --tasks 16 --exclude-near data/pets_test        # the same, after the fact

Everything that can be wrong is checked here, at the login node, before ``sbatch``: the config
(types, ranges, batch divisibility), the partition (``sinfo``), the data (``_info.json`` holds
every split the run reads). A mistake is one line on stderr and exit 2; nothing is submitted.

Its command line (parsers, --sweep expansion, prep's shard ranges) is launch/submit_args.py.
What runs inside the job (rendezvous, signals, requeue) is launch/job_body.py; the submission index
and `vitp jobs/logs/cancel` are launch/jobs.py. This module and those are the only users of submitit.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

from . import nodes
from .attempts import Elastic, batch_lines, read_events
from .job_body import STAGE_TARGETS, StageJob, stage_schema
from .jobs import (  # noqa: F401 (cli table)
    append_index,
    cancel_main,
    job_state,
    jobs_main,
    logs_main,
    outcome,
    read_index,
    slurm_states,
    tracking_line,
    wait,
)
from .stages import check_addresses, evaluators_of
from .submit_args import (
    SubmitError,
    decontam_parser,
    eval_parser,
    parse_sweep,
    prep_parser,
    split_shards,
    stage_parser,
)

STAGES = ("prep", "pretrain", "transfer", "eval", "decontam")


# --------------------------------------------------------------------------------------------------
# Config and resources
# --------------------------------------------------------------------------------------------------
def load_submit_config(recipe: str | None, overrides: list[str], resources: str | None = None, stage: str = "pretrain"):
    """Recipe YAML, then a resources file (only `cluster:`/`hardware:`, e.g. configs/cluster/*.yaml)
    on top of it, then dotted overrides; validated as ``stage``'s config for the planned world size."""
    from pipeline.config import load_config

    cfg = load_config(recipe, overrides, resources=resources, schema=stage_schema(stage))
    return resolved_stage(cfg) if stage == "pretrain" else cfg


def resolved_stage(cfg):
    """``engine.zero_stage: auto`` replaced by the stage `vitp plan` recommends for the cluster
    section (printed in one line), checked again for the chosen stage; any other config as it is."""
    from pipeline.config import ConfigError, validate
    from pipeline.plan.cost import PlanError
    from pipeline.plan.recommend import resolve_zero_stage

    try:
        cfg, note = resolve_zero_stage(cfg)
    except PlanError as e:
        raise ConfigError(str(e)) from None
    if note:
        print(note, flush=True)
        validate(cfg, world_size=cfg.world_size_planned)
    return cfg


def slurm_parameters(cfg) -> dict:
    """cfg.cluster → the keyword arguments of submitit's ``AutoExecutor.update_parameters``."""
    c = cfg.cluster
    p = {
        "name": c.job_name, "nodes": c.nodes, "tasks_per_node": c.tasks_per_node,
        "cpus_per_task": c.cpus_per_task, "timeout_min": c.time_min,
        # USR2 this long before the limit: time for every rank to reach a step boundary and save.
        "slurm_signal_delay_s": c.signal_delay_s,
        # requeue: `scontrol requeue` is refused for jobs a site marks non-requeueable by default.
        "slurm_additional_parameters": {"requeue": True, **c.extra_sbatch},
    }
    if c.gpus_per_node:
        p["gpus_per_node"] = c.gpus_per_node
    if c.mem_gb is not None:
        p["mem_gb"] = c.mem_gb
    for key in ("partition", "account", "qos", "constraint"):
        if getattr(c, key):
            p[f"slurm_{key}"] = getattr(c, key)
    if c.exclusive:
        p["slurm_exclusive"] = True
    if c.exclude_nodes:  # nodes an earlier failure pointed at (launch/nodes.py)
        p["slurm_exclude"] = ",".join(c.exclude_nodes)
    # A task that dies (OOM killer, segfault) ends the whole step at once instead of leaving the others
    # in a collective until its timeout; the batch script then records the failure and requeues the job
    # while cluster.max_failures allows (launch/attempts.py).
    p["slurm_srun_args"] = ["--kill-on-bad-exit=1"]
    # cluster.min_nodes < cluster.nodes: queued for cluster.nodes; each requeue asks for what it can get
    setup, teardown = batch_lines(c.log_dir, c.max_failures, exclude=c.exclude_nodes,
                                  max_excluded=c.max_excluded_nodes, elastic=Elastic.of(c))
    if c.cpus_per_task > 1:
        # Slurm 22.05-23.02: srun no longer inherits sbatch's --cpus-per-task, so every rank (and its
        # loader workers) would share one core; SRUN_CPUS_PER_TASK restores it (ignored elsewhere).
        setup.append(f"export SRUN_CPUS_PER_TASK={c.cpus_per_task}")
    p["slurm_setup"], p["slurm_teardown"] = setup, teardown
    return p


def local_parameters(cfg) -> dict:
    """The same resources for submitit's local executor: all tasks on this machine."""
    c = cfg.cluster
    return {"name": c.job_name, "tasks_per_node": cfg.world_size_planned, "timeout_min": c.time_min,
            "cpus_per_task": c.cpus_per_task, **({"gpus_per_node": c.gpus_per_node} if c.gpus_per_node else {})}


def default_cluster() -> str:
    return "slurm" if shutil.which("sbatch") else "local"


# --------------------------------------------------------------------------------------------------
# Checks before sbatch
# --------------------------------------------------------------------------------------------------
def partitions() -> list[str]:
    r = subprocess.run(["sinfo", "-h", "-o", "%P"], capture_output=True, text=True, timeout=60)
    if r.returncode:
        raise SubmitError(f"cannot reach SLURM: sinfo failed ({r.stderr.strip() or r.returncode})")
    return [p.strip().rstrip("*") for p in r.stdout.split() if p.strip()]


PER_TASK_GPUS = ("gpus_per_task", "gpu_bind")  # sbatch options that give each task its own GPU


def check_cluster(cfg, cluster: str) -> None:
    c = cfg.cluster
    if c.gpus_per_node and c.tasks_per_node != c.gpus_per_node:
        raise SubmitError(f"cluster.tasks_per_node: {c.tasks_per_node} != cluster.gpus_per_node "
                          f"{c.gpus_per_node} (one task per GPU)")
    per_task = [k for k in c.extra_sbatch if k.replace("-", "_") in PER_TASK_GPUS]
    if per_task and c.gpus_per_node > 1:
        # NVIDIA/nccl#1066: NCCL detects NVLink only among the GPUs a process can see
        print(f"warning: cluster.extra_sbatch.{per_task[0]}: each task sees only its own GPU; where SLURM "
              "isolates it (cgroup ConstrainDevices) NCCL loses NVLink/P2P between the node's tasks: "
              "every task seeing the node's GPUs (vitp's default, --gpus-per-node) is the fast path",
              file=sys.stderr)
    if cluster == "slurm" and c.partition:
        known = partitions()
        if c.partition not in known:
            raise SubmitError(f"cluster.partition: unknown partition {c.partition!r} "
                              f"(this cluster has: {', '.join(known) or 'none'})")


def splits_read(cfg, stage: str) -> dict[str, str | None]:
    """Config key → split name for every split the stage reads: training stages read the train split
    and, when data.val_split is set, the val split (periodic and final evaluation; transfer's final
    evaluation reads 'val' even then, see pipeline/transfer.py); eval reads the val split."""
    val = {"data.val_split": cfg.data.val_split or ("val" if stage == "transfer" else None)}
    return val if stage == "eval" else {"data.train_split": cfg.data.train_split, **val}


def check_data(cfg, stage: str) -> None:
    """The dataset exists and has every split the run will read (pipeline.data.check_splits,
    which the stage repeats at its start). Fewer shards than ranks x loader workers is fine: the loader
    splits samples, not shards; with remote shards it costs throughput, so that gets a warning."""
    from data_prep import store
    from pipeline.data import DataError, check_splits, minival_source, source_for
    from pipeline.eval.evaluators import check_data as check_evaluators_data

    path = cfg.data.path
    if stage == "eval" and not path:
        return
    if not path:
        raise SubmitError("data.path: empty; set data.path=<a `vitp prep` output folder>")
    check_addresses(cfg, stage)  # remote datasets answer (bucket, 403, 404) before their splits are read
    try:
        check_splits(path, splits_read(cfg, stage), minival_from=(held := minival_source(cfg.data)))
        check_evaluators_data(evaluators_of(cfg, stage), path, held)  # the declared evaluators' splits
    except DataError as e:
        raise SubmitError(str(e)) from None
    if stage == "eval" or cfg.data.resampled:
        return
    files = source_for(path).shard_addresses(cfg.data.train_split)
    streams = cfg.world_size_planned * max(1, cfg.data.workers)
    if len(files) < streams and any(store.is_remote(f) or f.startswith("pipe:") for f in files):
        print(f"warning: data.path: {len(files)} remote {cfg.data.train_split!r} shards for {streams} loader "
              "streams (ranks x data.workers): streams sharing a shard each read it from its start; "
              "more, smaller shards read faster", file=sys.stderr)


def check_tracking(cfgs: list, stage: str) -> None:
    """The tracking server each job will log to accepts the credentials the job will use (this
    environment: the job inherits it): a refused login, a missing permission or a TLS failure is one
    line naming the server, the reason and what to set; nothing is queued. An unreachable server is
    not refused here: the job buffers and spools (`vitp sync`)."""
    from pipeline.tracking.mlflow_store import access_problem
    from pipeline.tracking.setup import Tracking

    seen = set()
    for cfg in cfgs:
        if not cfg.tracking.enabled:
            continue
        exp = cfg.tracking.experiment
        if stage != "eval":
            uri = Tracking.from_config(cfg, cfg.run.dir, rank=0).uri
        else:
            from pipeline.evaluate import run_of_checkpoint

            parent = run_of_checkpoint(cfg.eval.checkpoint) if Path(cfg.eval.checkpoint or "").exists() else None
            uri = parent.uri if parent and parent.run_id else os.environ.get("MLFLOW_TRACKING_URI")
            exp = (parent and parent.experiment) or exp
        if not uri or (uri, exp) in seen:
            continue
        seen.add((uri, exp))
        problem = access_problem(uri, exp)
        if problem:
            raise SubmitError(problem)


def check_run_dir(cfg, stage: str) -> None:
    """A run dir is owned by one job at a time (pipeline/rundir.py): refuse, before sbatch, a second job
    for a run dir that a queued or running job of this log dir will train in, or that a live job owns."""
    from pipeline.rundir import ACTIVE, busy

    if stage not in ("pretrain", "transfer"):
        return
    run = Path(cfg.run.dir).resolve()
    login = {"job": None, "restart": 0, "host": socket.gethostname(), "pid": os.getpid(), "pid_start": None}
    why = busy(run, login)
    if why is not None:
        raise SubmitError(why)
    same = [e for e in read_index(cfg.cluster.log_dir) if e.get("stage") in ("pretrain", "transfer")
            and e.get("run_dir") and Path(e["run_dir"]).resolve() == run]
    slurm = slurm_states([e["job_id"] for e in same if e.get("executor", "slurm") == "slurm"])
    for e in reversed(same):
        state = job_state(e, slurm)
        if state in ACTIVE:
            raise SubmitError(f"run.dir {run} is in use by job {e['job_id']} ({state}); wait for it to end "
                              f"(it resumes from its checkpoints by itself), `vitp cancel {e['job_id']}`, or "
                              "choose another run.dir")


def check_nodes(cfg, stage: str, cluster: str) -> None:
    """The nodes the run dir's last job left out are left out again unless cluster.exclude_nodes says
    otherwise (launch/nodes.py); refused when they leave the partition too few nodes for the job."""
    note = nodes.carry_over(cfg, stage, read_index(cfg.cluster.log_dir), read_events)
    if note:
        print(note, file=sys.stderr, flush=True)
    problem = nodes.nodes_left_problem(cfg, nodes.partition_nodes(cfg.cluster.partition)) \
        if cluster == "slurm" and cfg.cluster.exclude_nodes else None
    if problem:
        raise SubmitError(problem)


def check_stage_importable(stage: str, target: str | None) -> None:
    """The job's entry point exists here (module and function), before anything is queued."""
    import importlib

    module, func = (target or STAGE_TARGETS[stage]).split(":")
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        raise SubmitError(f"stage {stage}: cannot import {module} ({e})") from None
    if not callable(getattr(mod, func, None)):
        raise SubmitError(f"stage {stage}: {module} has no function {func}")


# --------------------------------------------------------------------------------------------------
# Submission
# --------------------------------------------------------------------------------------------------
def make_executor(cfg, cluster: str):
    import submitit

    ex = submitit.AutoExecutor(folder=str(Path(cfg.cluster.log_dir) / "%j"), cluster=cluster,
                               slurm_max_num_timeout=cfg.cluster.max_requeues)
    params = slurm_parameters(cfg) if cluster == "slurm" else local_parameters(cfg)
    elastic = Elastic.of(cfg.cluster) if cluster == "slurm" else None
    if elastic is not None:  # the first attempt too asks only for the nodes the partition has up
        params["nodes"] = elastic.size(cfg.cluster.exclude_nodes or [], cfg.cluster.partition)
        if params["nodes"] < cfg.cluster.nodes:
            print(f"cluster.nodes={cfg.cluster.nodes}: partition {cfg.cluster.partition or '(default)'} has "
                  f"{params['nodes']} nodes up; the job asks for {params['nodes']} (cluster.min_nodes="
                  f"{cfg.cluster.min_nodes}; each requeue asks again)", file=sys.stderr, flush=True)
    if cluster == "debug":
        params = {"timeout_min": cfg.cluster.time_min}
    ex.update_parameters(**params)
    return ex


def same_job(cfgs: list, sets: list[list[str]]) -> None:
    """A sweep is one job array, and an array has one set of sbatch parameters: a sweep point that
    changes them (cluster.nodes, say) would run with the first point's; refuse it, naming the key."""
    first = slurm_parameters(cfgs[0])
    for c, s in zip(cfgs[1:], sets[1:]):
        p = slurm_parameters(c)
        for key in sorted(set(first) | set(p)):
            if first.get(key) != p.get(key):
                raise SubmitError(f"--sweep: point {' '.join(s)!r} changes the job's {key} ({first.get(key)!r} -> "
                                  f"{p.get(key)!r}); an array job has one set of sbatch parameters, submit it "
                                  "separately")


def submit_jobs(stage: str, cfgs: list, calls: list[StageJob], cluster: str, extra: dict | None = None,
                after: list[str] | None = None) -> list[dict]:
    """Submit one job (one call) or one array (several); write each job's resolved config; index them.
    ``after``: SLURM job ids it starts after, whatever their outcome (``afterany``; a suite's final)."""
    from pipeline.config import write_resolved

    ex = make_executor(cfgs[0], cluster)
    if after:
        more = slurm_parameters(cfgs[0])["slurm_additional_parameters"]
        ex.update_parameters(slurm_additional_parameters={**more, "dependency": "afterany:" + ":".join(after)})
    if len(calls) == 1:
        jobs = [ex.submit(calls[0])]
    else:
        with ex.batch():
            jobs = [ex.submit(c) for c in calls]
    try:  # submitit's local executor leaves its unformatted folder template behind
        (Path(cfgs[0].cluster.log_dir) / "%j").rmdir()
    except OSError:
        pass
    if cluster == "debug":  # submitit's debug executor runs a job in this process when its result is asked for
        for job in jobs:
            job.environ["SUBMITIT_FOLDER"] = str(job.paths.folder)  # JobEnvironment.paths reads it
            try:
                job.results()
            except Exception:  # noqa: S110 — the job folder holds its error record; outcome() reports it
                pass
    entries = []
    for job, cfg, call in zip(jobs, cfgs, calls):
        folder = Path(job.paths.folder)
        write_resolved(cfg, folder)
        entry = {"job_id": str(job.job_id), "stage": stage, "folder": str(folder.resolve()), "executor": cluster,
                 "run_dir": _run_dir(stage, cfg, call),
                 "tasks": cfg.world_size_planned, "time": time.time(), **(extra or {})}
        if cfg.cluster.exclude_nodes:  # what the run dir's next job carries over (launch/nodes.py)
            entry["exclude_nodes"] = list(cfg.cluster.exclude_nodes)
        append_index(cfg.cluster.log_dir, entry)
        entries.append(entry)
    return entries


def _run_dir(stage: str, cfg, call: StageJob) -> str:
    """Where the job's results go: the run dir, prep's output folder, or eval's results folder."""
    if stage in ("prep", "decontam"):
        return call.kwargs.get("out", "")
    if stage == "eval":
        from pipeline.evaluate import default_out

        return str(cfg.eval.out or default_out(cfg.eval.checkpoint))
    return cfg.run.dir


def _driver_check(args, cfg, cluster: str) -> None:
    """A GPU job: one node's NVIDIA driver vs torch's CUDA build, before sbatch (a preflight asks every node)."""
    if getattr(args, "preflight", False) or args.skip_driver_check:
        return
    from .preflight_job import DriverMismatch, check_driver

    try:
        check_driver(cfg, cluster)
    except DriverMismatch as e:
        raise SubmitError(str(e)) from None


def run_preflight(cfg, cluster: str, opts: dict | None = None) -> int:
    """`vitp preflight`: queue the preflight job with the run's resources, wait, print table and verdict;
    0 passed, 1 failed (launch/preflight_job.py)."""
    from .preflight_job import DEFAULTS, preflight_job, report

    job_cfg, call = preflight_job(cfg, {**DEFAULTS, **(opts or {})})
    return report(cfg, submit_jobs("preflight", [job_cfg], [call], cluster)[0])


def _prep_calls(args, cfg) -> tuple[list, list[StageJob]]:
    from data_prep import prep
    from data_prep.cli import prep_options
    from pipeline.config import prep_cfg

    if not Path(args.source).exists():
        raise SubmitError(f"source: {args.source} not found")
    opts = prep_options(args)  # the same schema, names and defaults as `vitp prep`
    # the tasks run elsewhere: a local test set by its absolute path, as the source and OUT
    opts["exclude_near"] = [a if "://" in a else str(Path(a).resolve()) for a in opts.get("exclude_near", [])]
    cfg.prep = prep_cfg(opts)
    # The plan is written here, once: every task then reads the same deterministic shard list.
    total = prep(args.source, args.out, cfg.prep, shard_range=(0, 0), progress=False)["shards_total"]
    ranges = split_shards(total, args.tasks)
    out = args.out if "://" in args.out else str(Path(args.out).resolve())  # a bucket prefix stays as given
    common = {"source": str(Path(args.source).resolve()), "out": out, "shard_ranges": ranges}
    calls = [StageJob("prep", _cfg_dict(cfg), kwargs={**common, "task": i}) for i in range(len(ranges))]
    return [cfg] * len(calls), calls


def _decontam_calls(args, cfg) -> tuple[list, list[StageJob]]:
    """`vitp submit decontam`: every check and the test sets' hashing here, once (a bad input is one
    line and nothing is queued); one task per range of OUT's shards."""
    from data_prep.cli import decontam_options
    from data_prep.decontam import submit_plan

    test_sets, splits, threshold = decontam_options(args)
    # the tasks run elsewhere: local addresses by their absolute paths
    test_sets = [a if "://" in a else str(Path(a).resolve()) for a in test_sets]
    out = args.out if "://" in args.out else str(Path(args.out).resolve())
    out, ranges, request = submit_plan(out, test_sets, splits, threshold, args.rehash,
                                       lambda n: split_shards(n, args.tasks))
    common = {"out": out, "shard_ranges": [list(r) for r in ranges], "request": request}
    calls = [StageJob("decontam", _cfg_dict(cfg), kwargs={**common, "task": i}) for i in range(len(ranges))]
    return [cfg] * len(calls), calls


def _cfg_dict(cfg) -> dict:
    from pipeline.config import to_dict

    return to_dict(cfg)


def submit_main(argv: list[str], target: str | None = None) -> int:
    """`vitp submit STAGE ...`; ``target`` ("module:function") replaces the stage function (tests)."""
    if not argv or argv[0] in ("-h", "--help"):
        stage_parser().print_help()
        print(f"\nstages: {', '.join(STAGES)}, suite; `vitp submit prep --help` and "
              "`vitp submit decontam --help` for the array forms, "
              "`vitp submit suite --help` for a transfer suite")
        return 0 if argv else 2
    stage, rest = argv[0], argv[1:]
    if stage not in STAGES:
        raise SubmitError(f"unknown stage {stage!r}; one of {', '.join(STAGES)}")
    # intermixed: key=value overrides may come before or after the options
    parser = {"prep": prep_parser, "decontam": decontam_parser, "eval": eval_parser}.get(stage, stage_parser)()
    args = parser.parse_intermixed_args(rest)
    cluster = args.cluster or default_cluster()
    extra: dict = {}
    if stage in ("prep", "decontam"):
        bad = [o for o in args.overrides if not o.startswith("cluster.")]
        if bad:
            raise SubmitError(f"override {bad[0]!r}: `submit {stage}` takes only cluster.* overrides")
        cfg = load_submit_config(None, args.overrides, args.resources, stage)
        cfg.cluster.nodes, cfg.cluster.tasks_per_node = 1, 1  # each array task is one process
        check_cluster(cfg, cluster)
        if args.tasks < 1:
            raise SubmitError(f"--tasks: must be >= 1; got {args.tasks}")
        if args.dry_run:
            print(json.dumps(slurm_parameters(cfg), indent=1, sort_keys=True))
            return 0
        cfgs, calls = (_prep_calls if stage == "prep" else _decontam_calls)(args, cfg)
    elif stage == "eval":
        from .stages import eval_overrides

        bad = [o for o in args.overrides if not o.startswith(("cluster.", "engine.", "data."))]
        if bad:
            raise SubmitError(f"override {bad[0]!r}: `submit eval` takes its flags and cluster.*/engine.*/data.*")
        cfg = load_submit_config(None, [*eval_overrides(args), *args.overrides], args.resources, stage)
        check_cluster(cfg, cluster)
        check_stage_importable(stage, target)
        _driver_check(args, cfg, cluster)
        check_tracking([cfg], stage)
        if args.dry_run:
            print(json.dumps(slurm_parameters(cfg), indent=1, sort_keys=True))
            return 0
        cfgs, calls = [cfg], [StageJob(stage, _cfg_dict(cfg), target=target)]
    else:
        base = load_submit_config(args.config, args.overrides, args.resources)
        check_cluster(base, cluster)
        check_stage_importable(stage, target)
        sets = parse_sweep(args.sweep, args.sweep_file)
        cfgs, envs = [base], [{}]
        if sets:
            sweep_id = f"{base.cluster.job_name}-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:4]}"
            extra["sweep"] = sweep_id
            cfgs, envs = [], []
            for i, s in enumerate(sets):
                own_dir = any(o.startswith("run.dir=") for o in s)
                run_dir = [] if own_dir else [f"run.dir={base.run.dir}/{sweep_id}/{i}"]
                cfgs.append(load_submit_config(args.config, [*args.overrides, *s, *run_dir], args.resources))
                tags = {"sweep": sweep_id, "sweep_index": str(i), "sweep_overrides": " ".join(s)}
                envs.append({"VITP_MLFLOW_TAGS": json.dumps(tags, sort_keys=True)})
        for c in cfgs:
            check_data(c, stage)
            check_run_dir(c, stage)
            check_nodes(c, stage, cluster)
        same_job(cfgs, sets)
        _driver_check(args, base, cluster)
        check_tracking(cfgs, stage)
        if args.dry_run:
            print(json.dumps(slurm_parameters(cfgs[0]), indent=1, sort_keys=True))
            return 0
        calls = [StageJob(stage, _cfg_dict(c), env=e, target=target) for c, e in zip(cfgs, envs)]
    if getattr(args, "preflight", False):  # the same resources for every sweep point (same_job)
        rc = run_preflight(cfgs[0], cluster)
        if rc:
            print(f"not submitted: the preflight failed (vitp submit {stage} ... without --preflight to queue anyway)",
                  file=sys.stderr, flush=True)
            return rc
    from pipeline.config import secret_values
    from pipeline.secrets import remember

    for c in cfgs:  # the job's pickle holds them redacted; its environment brings them back
        remember(secret_values(c))
    entries = submit_jobs(stage, cfgs, calls, cluster, extra)
    if len(entries) == 1:
        print(f"job {entries[0]['job_id']}", flush=True)
    else:
        print(f"job {entries[0]['job_id'].split('_')[0]}", flush=True)
        for e in entries:
            print(f"  task {e['job_id']}  {e['run_dir']}", flush=True)
    if not args.wait:
        return 0
    states = wait(entries)
    rc = 0
    for e in entries:
        ok, line = outcome(e, states[e["job_id"]])
        print(line, file=sys.stdout if ok else sys.stderr, flush=True)
        rc = rc or (0 if ok else 1)
    for e in entries:  # last: what tracking did (delivered, or what waits for `vitp sync`)
        if stage != "prep" and e.get("run_dir"):
            print(f"job {e['job_id']} {tracking_line(e['run_dir'])}", flush=True)
    return rc
