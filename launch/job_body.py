"""What runs inside a submitted job, on every task: the pickled :class:`StageJob`.

submitit starts one Python process per task (``srun``), unpickles the callable and calls it. The
callable then

1. reads rank/world/master from submitit's ``JobEnvironment`` and exports RANK, WORLD_SIZE,
   LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, then sets the process up
   (:func:`pipeline.distributed.setup`: the accelerator, held to the GPUs the job asked for, and the
   process group, with a timeout, before DeepSpeed starts, so DeepSpeed reuses it; no ssh, no hostfile);
2. replaces submitit's signal handlers on every rank: SIGUSR2 (time limit near) and SIGTERM only ask
   the stage to stop at the next step boundary (:func:`pipeline.stops.request_stop`).
   submitit's own handler checkpoints from rank 0 alone, but DeepSpeed's save is collective and would
   hang;
3. runs the stage; when it comes back "stopped", every rank has saved, and rank 0 asks
   :func:`pipeline.stops.after_stop` what the stop was and what comes next: USR2 → requeue
   (``scontrol requeue``, bounded by cluster.max_requeues); TERM → asks SLURM why (:func:`term_cause`):
   a preemption (PreemptMode=REQUEUE sends TERM, the job is RUNNING with a PreemptTime) requeues the
   job itself — a job that exits within its GraceTime would otherwise end COMPLETED — while
   ``scancel``/``vitp cancel`` (the job is already COMPLETING) stops for good, and a job SLURM requeued
   itself (a node failed: COMPLETING with Restarts past this attempt's) records nothing, for the next
   attempt finds out why (launch/attempts.py :func:`~launch.attempts.start_of_attempt`). A requeued attempt exits
   without a result pickle (submitit's ``done()`` and ``vitp submit --wait`` then keep waiting for it).

A task that dies without a word (SIGKILL, OOM, segfault) is handled outside the tasks, by the batch
script (launch/attempts.py).

Files in the job folder (cfg.cluster.log_dir/JOBID): config.yaml (resolved), result.json (the final
outcome, rank 0), error.<rank>.json (that rank raised: its error's last line), events.jsonl (one line
per attempt: how it ended), cancel-requested (`vitp cancel` asked), nccl_trace_rank_<r> (NCCL's flight
recorder, dumped when a collective times out), submitit's logs and pickles.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import signal
import sys
import time
from pathlib import Path

from launch import nodes
from launch.attempts import Elastic, append_event, count, read_events
from pipeline import faults, hang, slurm, stops
from pipeline.distributed import DistEnv, export_env, leave_process_group, setup
from pipeline.error_record import write_error
from pipeline.errors import Classified
from pipeline.files import write_json
from pipeline.network import rendezvous_port
from pipeline.stops import Next, Outcome, Status, Stop
from pipeline.world import place

# Stages whose loop polls pipeline.stops every step and saves collectively when asked.
COOPERATIVE = {"pretrain", "transfer"}
STAGE_TARGETS = {
    "pretrain": "pipeline.pretrain:pretrain",
    "transfer": "pipeline.transfer:transfer",
    "eval": "pipeline.evaluate:evaluate",
    "prep": "launch.job_body:run_prep",
    "decontam": "launch.job_body:run_decontam",
}


def stage_schema(stage: str):
    """The config model of ``stage``: the sections it reads (pipeline.config)."""
    from pipeline.config import Config, EvalConfig, PrepConfig

    return {"eval": EvalConfig, "prep": PrepConfig, "decontam": PrepConfig}.get(stage, Config)


CANCEL_MARK = "cancel-requested"  # written by `vitp cancel` before scancel


class RequeueLimitError(Classified, RuntimeError):
    """Stopped for a requeue, but cluster.max_requeues is used up."""

    retry = False


def nccl_debug_env(folder: str | os.PathLike, environ=None) -> dict[str, str]:
    """NCCL's flight recorder: every rank keeps its last collectives and, when one times out, dumps them
    to ``FOLDER/nccl_trace_rank_<rank>`` (a hang leaves evidence of which collective and which ranks).
    Names for torch >= 2.7 (TORCH_FR_*) and before (TORCH_NCCL_*); a value the user set is kept."""
    env = os.environ if environ is None else environ
    prefix = str(Path(folder).resolve() / "nccl_trace_rank_")
    want = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "2000", "TORCH_FR_BUFFER_SIZE": "2000",
            "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
            "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": prefix, "TORCH_FR_DUMP_TEMP_FILE": prefix}
    return {k: v for k, v in want.items() if k not in env}


def term_cause(job_id: str, folder: Path) -> Stop:
    """Why this job got SIGTERM: `vitp cancel`'s mark, else what SLURM says (:func:`pipeline.slurm.term_cause`)."""
    if (folder / CANCEL_MARK).exists():
        return Stop.CANCEL
    return slurm.term_cause(job_id)


def job_dist_env(job_env, engine: dict | None = None, environ=None) -> DistEnv:
    """Rank/world/master of a task submitit started (slurm, local or debug).

    Rank and world are the executor's own variables, read by :func:`pipeline.world.place` (only that
    executor's: RANK/WORLD_SIZE a submitting shell exported are not this job's). The master is the
    allocation's (its first node, a port derived from the job id) unless the config's
    ``engine.master_addr``/``master_port`` say otherwise: MASTER_ADDR/MASTER_PORT in the environment
    came from the submitting shell (sbatch exports it) and are stale here.
    """
    env = os.environ if environ is None else environ
    engine = engine or {}
    p = place(env, launchers=(job_env.cluster,))
    hosts = list(job_env.hostnames) if job_env.cluster == "slurm" else ["127.0.0.1"]
    port = int(engine.get("master_port") or rendezvous_port(str(job_env.job_id), slurm.restart_count(env)))
    return DistEnv(rank=p.rank, world_size=p.world_size, local_rank=p.local_rank,
                   local_world_size=p.local_world_size, master_addr=engine.get("master_addr") or hosts[0],
                   master_port=port, source=job_env.cluster)


def _nodes_of(cfg) -> dict:
    """The node count this attempt ran on, for its events.jsonl line, when it may differ from cluster.nodes."""
    elastic = Elastic.of(cfg.cluster)
    return elastic.fields() if elastic else {}


def _on_usr2(signum, frame) -> None:
    # A requeue beats a cancel: on a time limit SLURM sends USR2 first and TERM at the end, and on
    # preemption TERM may come first; either way the run must come back.
    stops.clear()
    stops.request_stop(Stop.REQUEUE)


def _on_term(signum, frame) -> None:
    # scancel, a preemption (PreemptMode=REQUEUE) or the time limit: rank 0 asks SLURM which once
    # every rank has saved (term_cause); a signal handler only sets the flag.
    stops.request_stop(Stop.CANCEL)


def install_stop_handlers() -> None:
    """Every rank: the signals only set the stop flag (all a handler may safely do)."""
    signal.signal(signal.SIGUSR2, _on_usr2)
    signal.signal(signal.SIGTERM, _on_term)
    signal.signal(signal.SIGCONT, signal.SIG_IGN)  # SLURM sends CONT with TERM; nothing to do


def _requeue_now_handler(job_id: str, rank: int, max_requeues: int):
    """For stages that do not poll (prep resumes per shard, eval restarts): requeue at once."""

    def handler(signum, frame):
        if rank == 0 and slurm.restart_count() < max_requeues:
            slurm.requeue(job_id)
        raise SystemExit(0)

    return handler


def _file_barrier(folder: Path, tag: str, d: DistEnv, timeout_s: float) -> None:
    """All ranks reached this point (files in the shared job folder; the process group may be gone)."""
    bdir = folder / f".barrier-{tag}"
    bdir.mkdir(parents=True, exist_ok=True)
    (bdir / str(d.rank)).touch()
    if not d.is_rank0:
        return
    deadline = time.monotonic() + timeout_s
    while len(list(bdir.iterdir())) < d.world_size:
        if time.monotonic() > deadline:
            raise RuntimeError(f"requeue: only {len(list(bdir.iterdir()))}/{d.world_size} ranks "
                               f"finished saving within {timeout_s:g}s; not requeuing")
        time.sleep(0.2)


def _plain(result) -> dict:
    """A stage's Result → a JSON-able dict (status, step, run_dir, mlflow_run_id, ...)."""
    if dataclasses.is_dataclass(result):
        raw = dataclasses.asdict(result)
    elif isinstance(result, dict):
        raw = dict(result)
    else:
        raw = {k: getattr(result, k) for k in ("status", "step", "run_dir", "mlflow_run_id", "reason", "stop_reason")
               if hasattr(result, k)}
    return {k: v for k, v in raw.items() if isinstance(v, (str, int, float, bool, type(None), list, dict))}


def _write_result(folder: Path, summary: dict) -> None:
    write_json(folder / "result.json", summary)


def resolve_target(target: str):
    module, func = target.split(":")
    return getattr(importlib.import_module(module), func)


def run_prep(cfg, *, source: str, out: str, shard_ranges: list, task: int = 0) -> dict:
    """One array task of `vitp submit prep`: its range of the plan's shards (prep's options: ``cfg.prep``);
    the last one to finish writes _info.json (prep() finalizes when every shard is complete)."""
    from data_prep import prep

    a, b = shard_ranges[task]
    summary = prep(source, out, cfg.prep, shard_range=(a, b), progress=False)
    return {"status": Status.COMPLETED, "task": task, "shard_range": [a, b],
            **{k: v for k, v in summary.items() if k in ("shards_written", "shards_skipped", "complete")}}


def run_decontam(cfg, *, out: str, shard_ranges: list, request: str, task: int = 0) -> dict:
    """One array task of `vitp submit decontam`: its range of OUT's shards checked against the index the
    submitter stored; the task that finds every range's part written merges them into _exclude.json."""
    from data_prep.decontam import run_part

    return {"status": "completed", "task": task, "shard_range": list(shard_ranges[task]),
            **run_part(out, shard_ranges, request, task)}


@dataclasses.dataclass
class StageJob:
    """The callable submitit pickles: ``stage`` run with the resolved config (a plain dict).

    ``env``: extra environment for the task (e.g. VITP_MLFLOW_TAGS for a sweep's shared tag).
    ``kwargs``: extra keyword arguments for the target (prep's source/out/ranges).
    ``target``: "module:function" overriding the stage's default (tests use a stub stage).
    """

    stage: str
    cfg: dict
    env: dict = dataclasses.field(default_factory=dict)
    kwargs: dict = dataclasses.field(default_factory=dict)
    target: str | None = None

    def __call__(self) -> dict:
        import submitit  # only here and in launch/submit.py

        job_env = submitit.JobEnvironment()
        folder = Path(job_env.paths.folder)
        try:
            return self._run(job_env, folder)
        except Exception as e:  # SystemExit (stop, requeue) passes: those are not failures
            write_error(folder, int(job_env.global_rank), e, getattr(self, "_micro_batch", None))
            raise

    def _run(self, job_env, folder: Path) -> dict:
        from pipeline.config import from_dict

        d = job_dist_env(job_env, self.cfg.get("engine"))
        export_env(d)
        os.environ.update({k: str(v) for k, v in self.env.items()})
        os.environ["VITP_JOB_ID"] = str(job_env.job_id)
        os.environ.update(nccl_debug_env(folder))  # read when the NCCL process group is created
        cfg = from_dict(self._attempt_cfg(folder, d), world_size=d.world_size, schema=stage_schema(self.stage))
        stops.clear()
        if self.stage in COOPERATIVE:
            install_stop_handlers()
        elif job_env.cluster == "slurm":
            signal.signal(signal.SIGUSR2, _requeue_now_handler(str(job_env.job_id), d.rank,
                                                               cfg.cluster.max_requeues))
        print(f"vitp: {self.stage} rank {d.rank}/{d.world_size} local {d.local_rank}/{d.local_world_size} "
              f"master {d.master_addr}:{d.master_port} restart {slurm.restart_count()}", file=sys.stderr, flush=True)
        # the accelerator is this node's choice (never the submitting host's DS_ACCELERATOR), held to the
        # GPUs the config asks for; the rendezvous is the one exported above
        hang.watch(folder, d.rank, cfg.cluster.hang_dump_s)  # start-up keeps it alive until the first step
        setup(cfg)

        faults.hit("step", 0)  # tests may hold every rank here, before the stage starts
        fn = resolve_target(self.target or STAGE_TARGETS[self.stage])
        try:
            result = fn(cfg, **self.kwargs) if self.kwargs else fn(cfg)
        finally:
            hang.stop()  # a stage that raised is not a hang, however long its way out takes
        leave_process_group()  # every rank returned; what follows synchronises through files
        summary = {"stage": self.stage, "job_id": str(job_env.job_id), "world_size": d.world_size,
                   "restarts": slurm.restart_count(), **_plain(result)}
        if summary.get("status") == Status.STOPPED:
            self._after_stop(summary, cfg, d, folder, job_env)
        if d.is_rank0:
            _write_result(folder, summary)
            if job_env.cluster == "slurm":
                append_event(folder, {"event": Outcome.COMPLETED, "restart": slurm.restart_count(),
                                      "step": summary.get("step"), **_nodes_of(cfg)})
        return summary

    def _attempt_cfg(self, folder: Path, d: DistEnv) -> dict:
        """The config this attempt runs: the submitted one, with the train.micro_batch an earlier attempt's
        out-of-memory error halved it to (pipeline.stops.micro_batch_now; the global batch is kept)."""
        if self.stage not in COOPERATIVE:
            return self.cfg
        planned = int(self.cfg["train"]["micro_batch"])
        self._micro_batch = stops.micro_batch_now(read_events(folder), planned)
        if self._micro_batch == planned:
            return self.cfg
        if d.is_rank0:
            print(f"vitp: train.micro_batch {planned} -> {self._micro_batch} (an earlier attempt ran out of "
                  "memory; train.global_batch kept, the accumulation grows)", file=sys.stderr, flush=True)
        return {**self.cfg, "train": {**self.cfg["train"], "micro_batch": self._micro_batch}}

    def _after_stop(self, summary: dict, cfg, d: DistEnv, folder: Path, job_env) -> None:
        reason = stops.job_reason(summary.get("stop_reason") or summary.get("reason"), stops.stop_reason())
        summary["stop_reason"] = reason
        if job_env.cluster != "slurm":
            if reason == Stop.CANCEL:
                if d.is_rank0:
                    _write_result(folder, summary)
                raise SystemExit(0)
            raise RequeueLimitError(f"stopped at step {summary.get('step')} for a requeue, but the "
                                    f"'{job_env.cluster}' executor cannot requeue; resubmit to resume")
        job_id, step = str(job_env.job_id), summary.get("step")
        # every rank has saved before rank 0 requeues (which kills the job) or reports the end
        _file_barrier(folder, f"stop-{slurm.restart_count()}", d, cfg.engine.collective_timeout_s)
        if d.is_rank0:
            requeues = count(read_events(folder), Outcome.REQUEUED)
            outcome, then = stops.after_stop(reason, term_cause(job_id, folder), requeues, cfg.cluster.max_requeues)
            if then == Next.FAIL:
                raise RequeueLimitError(
                    f"stopped at step {step}: job already requeued {requeues} times "
                    f"(cluster.max_requeues={cfg.cluster.max_requeues}); resubmit to resume from the checkpoint")
            if outcome is None:  # SLURM requeued the job itself (a node failed): the next attempt says why
                raise SystemExit(0)
            append_event(folder, {"event": outcome, "restart": slurm.restart_count(), "step": step, **_nodes_of(cfg)})
            elastic = Elastic.of(cfg.cluster)
            if then == Next.END:  # the checkpoint is saved; nothing is requeued
                summary["stop_reason"] = Stop.TIME_LIMIT if outcome == Outcome.TIME_LIMIT else Stop.CANCEL
                _write_result(folder, summary)
            elif elastic is not None:  # the next attempt asks for the nodes it can get (cluster.min_nodes)
                elastic.requeue(job_id, nodes.excluded(cfg.cluster.exclude_nodes, read_events(folder)),
                                os.environ.get("SLURM_JOB_PARTITION") or cfg.cluster.partition)
            else:
                slurm.requeue(job_id)
        # No result pickle on a requeue: SystemExit passes submitit's `except Exception`, so the job counts
        # as unfinished and the requeued run writes the final result.
        raise SystemExit(0)
