"""`vitp submit suite`: the transfer suite (launch/suite.py) on SLURM.

    vitp submit suite --config configs/suite/paper.yaml init.from=runs/pre run.dir=runs/suite [--wait]

Per dataset, its grid cells that are not completed go in as one job array (the `--sweep` machinery:
``submit_jobs``, one task per lr), and one job that depends on the array (``afterany``: it runs whatever
the tasks' fate) chooses the lr from the run dirs, fine-tunes the final and rewrites the tables; the
last final to end publishes the suite's MLflow run. Datasets go in side by side: the cluster decides
how many cells run at once. The same command again submits only what is missing (a half-trained cell
resumes from its checkpoints); while any job of this suite is queued or running it is refused.
"""

from __future__ import annotations

import json
import sys

from .submit_args import SubmitError


def suite_submit_parser():
    from .cli import add_config_args, parser_for
    from .submit_args import common_args

    p = parser_for("submit", "Submit a transfer suite to SLURM: per dataset an array of grid cells, then a job "
                             "that depends on it and runs the final (see `vitp suite --help`).")
    add_config_args(p)
    p.add_argument("--keep-grid-weights", action="store_true", help="keep every grid cell's checkpoints")
    p.add_argument("--rerun-changed", action="store_true",
                   help="rerun the completed cells another checkpoint or config made (see `vitp suite --help`)")
    common_args(p)
    return p


def check_not_running(suite, log_dir: str) -> None:
    """A suite's output folder is owned by its jobs: refuse a second submission while one is active."""
    from pipeline.rundir import ACTIVE

    from .jobs import job_state, read_index, slurm_states

    mine = [e for e in read_index(log_dir) if e.get("suite") == str(suite.out)]
    slurm = slurm_states([e["job_id"] for e in mine if e.get("executor", "slurm") == "slurm"])
    for e in mine:
        state = job_state(e, slurm)
        if state in ACTIVE:
            raise SubmitError(f"run.dir {suite.out}: this suite's job {e['job_id']} is {state}; wait for it to end "
                              "(then the same command submits what is missing) or `vitp cancel` it")


def submit_suite(argv: list[str]) -> int:
    from pipeline.config import to_dict

    from .job_body import StageJob
    from .jobs import outcome, wait
    from .submit import check_cluster, check_run_dir, check_tracking, default_cluster, same_job, submit_jobs
    from .suite import OK, Suite, finish_if_done, summary
    from .suite_mlflow import open_parent
    from .suite_spec import cell_config, protocol

    args = suite_submit_parser().parse_intermixed_args(argv)
    cluster = args.cluster or default_cluster()
    if cluster != "slurm":
        raise SubmitError(f"--cluster {cluster}: a suite's jobs depend on each other, which needs SLURM; "
                          "run `vitp suite` to run it on this machine")
    if args.resources:
        raise SubmitError("--resources: not for a suite; put cluster.* overrides in the suite file's `overrides:`")
    suite = Suite(args.config, args.overrides, args.keep_grid_weights, args.rerun_changed)
    suite.check()
    check_not_running(suite, suite.base.cluster.log_dir)
    suite.check_identities()
    todo = {d: [c for c in cells if not suite.done(c)] for d, cells in suite.grid.items()}
    cfgs = {c.name: cell_config(suite.spec, c, suite.path) for cells in todo.values() for c in cells}
    for c in cfgs.values():
        check_cluster(c, cluster)
        check_run_dir(c, "transfer")
    check_tracking([suite.base], "transfer")
    if args.dry_run:
        print(json.dumps({d: [c.name for c in cells] for d, cells in todo.items()}, indent=1))
        return 0
    suite.out.mkdir(parents=True, exist_ok=True)
    parent = open_parent(suite)
    parent.close(status=None, timeout=suite.base.tracking.close_timeout_s)  # the last final ends it
    extra = [f"tracking.parent_run={parent.run_id}"] if parent.run_id else []
    tag = {"suite": str(suite.out)}
    entries = []
    for d in suite.spec.datasets:
        grid = []
        if todo[d.name]:
            cells = todo[d.name]
            for c in cells:
                suite.prepare(c)
            gcfgs = [cell_config(suite.spec, c.plus(extra), suite.path) for c in cells]
            same_job(gcfgs, [[f"optim.lr={c.lr}"] for c in cells])
            calls = [StageJob("transfer", to_dict(g), env={"VITP_MLFLOW_TAGS": json.dumps({**tag, "cell": c.name})})
                     for g, c in zip(gcfgs, cells)]
            grid = submit_jobs("transfer", gcfgs, calls, cluster, tag)
            print(f"{d.name}: grid job {grid[0]['job_id'].split('_')[0]} ({len(grid)} lrs)", flush=True)
        placeholder = cell_config(suite.spec, suite.final(d.name, protocol(suite.spec, d).lrs[0]).plus(extra),
                                  suite.path)
        call = StageJob("transfer", to_dict(placeholder), target="launch.suite_slurm:final_job",
                        kwargs={"suite_file": suite.path, "overrides": args.overrides, "dataset": d.name,
                                "keep_grid_weights": args.keep_grid_weights, "parent_run": parent.run_id,
                                "rerun_changed": args.rerun_changed})
        after = sorted({e["job_id"].split("_")[0] for e in grid})
        (final,) = submit_jobs("transfer", [placeholder], [call], cluster,
                               {**tag, "suite_final": d.name, "after": after}, after=after)
        print(f"{d.name}: final job {final['job_id']}" + (f" (after {', '.join(after)})" if after else ""), flush=True)
        entries += [*grid, final]
    if not args.wait:
        return 0
    states = wait(entries)
    for e in entries:
        ok, line = outcome(e, states[e["job_id"]])
        if not ok:
            print(line, file=sys.stderr, flush=True)
    table = finish_if_done(suite)
    print((suite.out / "suite.md").read_text(), end="")
    print(f"suite: {summary(table)}", flush=True)
    return 0 if all(r["status"] in OK for r in table) else 1


def final_job(cfg, *, suite_file: str, overrides: list[str], dataset: str, keep_grid_weights: bool,
              parent_run: str | None, rerun_changed: bool = False):
    """Inside the job that follows a dataset's grid (every rank): choose the lr, record the grid's
    failures, fine-tune the finals (one per repeat, one after another), then (rank 0) rewrite the
    tables and, when this was the last cell of the suite, publish its MLflow run. ``cfg`` (the final
    at the first lr) set up the job."""
    from pipeline.config import load_config
    from pipeline.distributed import rank_world
    from pipeline.transfer import transfer

    from .suite import Suite, drop_weights, finish_if_done, selected_lr
    from .suite_table import cell_state, clear_record, record_failure

    rank, world = rank_world()
    rank0 = rank == 0
    suite = Suite(suite_file, overrides, keep_grid_weights, rerun_changed)
    for c in suite.grid[dataset]:
        state = cell_state(c.run_dir, c.score_split)
        if rank0 and state.status == "pending":
            record_failure(c.run_dir, "its array task ended without results (see `vitp jobs`, `vitp logs`)")
        if rank0 and state.status == "completed" and not keep_grid_weights:
            drop_weights(c.run_dir)
    best = selected_lr(suite, dataset)
    result = None
    for final in suite.finals(dataset, best if best is not None else suite.grid[dataset][0].lr):
        if best is not None and suite.done(final):
            continue
        try:
            if best is None:
                raise RuntimeError(f"suite: {dataset}: no grid cell completed; no final")
            extra = [f"tracking.parent_run={parent_run}"] if parent_run else []
            fcfg = load_config(suite.spec.transfer_config, [*final.overrides, *extra],
                               world_size=world)
            if rank0:
                suite.prepare(final)
                clear_record(final.run_dir)
            result = transfer(fcfg)
        except Exception as e:
            if rank0:
                record_failure(final.run_dir, str(e).splitlines()[-1] if str(e) else type(e).__name__,
                               "skipped" if best is None else "failed")
                finish_if_done(suite)
            raise
    if rank0:
        finish_if_done(suite)
    return result
