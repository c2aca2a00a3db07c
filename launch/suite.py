"""`vitp suite`: judge a checkpoint the paper's way, over many datasets in one command.

    vitp suite --config configs/suite/tiny.yaml init.from=runs/pre run.dir=runs/suite
    vitp suite report runs/suite --compare runs/suite_other      # one column per checkpoint, suite.png

Per dataset (launch/suite_spec.py): one transfer run per lr on train less minival, scored on minival;
the best (ties: the smaller lr) is fine-tuned again on all of train and scored on the test split.
This process runs the cells one after another with the local launcher; `vitp submit suite` queues them
on SLURM (launch/suite_slurm.py). Every cell is the transfer stage, in its own run dir under OUT, so:

- the same command again skips completed cells, resumes half-trained ones from their checkpoints
  and reruns failed ones; a failing cell is recorded (``suite_cell.json``) and the others go on;
- OUT/suite.csv and OUT/suite.md are rewritten from the run dirs after every cell (launch/suite_table.py);
- MLflow: a parent run for the suite (its id kept in OUT/suite_state.json), each cell's run nested
  under it, ``suite/<dataset>/test_top1`` and ``suite/mean_test_top1``, the tables and the figure.

OUT is owned by one suite at a time (pipeline/rundir.py): a second `vitp suite` on it is refused.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from .suite_spec import Cell, SuiteError, cell_config, final_cell, grid_cells, load_suite, lr_text
from .suite_table import cell_state, choose, clear_record, record_failure, write_tables

STATE_FILE = "suite_state.json"


# --------------------------------------------------------------------------------------------------
# The plan: the suite file and the command line, checked before anything runs
# --------------------------------------------------------------------------------------------------
class Suite:
    """A suite file bound to its output folder and the command line's overrides, checked."""

    def __init__(self, spec_path: str, overrides: list[str], keep_grid_weights: bool = False):
        self.path, self.spec = spec_path, load_suite(spec_path)
        out = [o.split("=", 1)[1] for o in overrides if o.startswith("run.dir=")]
        if not out or not out[-1]:
            raise SuiteError("run.dir: give the suite's output folder, e.g. run.dir=runs/suite")
        self.out = Path(out[-1]).resolve()
        self.common = [o for o in overrides if not o.startswith("run.dir=")]
        src = [o.split("=", 1)[1] for o in self.common if o.startswith("init.from=")]
        if not src or not src[-1]:
            raise SuiteError("init.from: give the pre-trained checkpoint to evaluate, e.g. init.from=runs/pre")
        if "://" not in src[-1] and not Path(src[-1]).exists():
            raise SuiteError(f"init.from: {src[-1]} not found")
        self.source = src[-1]
        self.keep_grid_weights = keep_grid_weights
        self.grid = grid_cells(self.spec, self.out, self.common)
        self.base = cell_config(self.spec, self.grid[self.spec.datasets[0].name][0], spec_path)
        self.uri = None
        if self.base.tracking.enabled:
            from pipeline.tracking.setup import Tracking

            self.uri = Tracking.from_config(self.base, self.out, rank=0).uri
            self.common.append(f"tracking.uri={self.uri}")  # the cells log where the suite's parent run is
            self.grid = grid_cells(self.spec, self.out, self.common)

    def final(self, dataset: str, lr: float) -> Cell:
        return final_cell(self.spec, dataset, lr, self.out, self.common)

    def check(self) -> None:
        """Every cell's config, every dataset's splits and limits: one line naming the file and the key."""
        from pipeline.data import DataError, check_splits, read_info

        for d in self.spec.datasets:
            cfg = None
            for cell in [*self.grid[d.name], self.final(d.name, self.spec.lrs[0])]:
                cfg = cell_config(self.spec, cell, self.path)
            try:
                check_splits(d.data, {"data.train_split": cfg.data.train_split, "test_split": d.test_split})
                if self.spec.vtab1k:
                    n = read_info(d.data).split(cfg.data.train_split).num_samples
                    if n < 1000:
                        raise DataError(f"vtab1k: 1000 examples asked of split {cfg.data.train_split!r}, which "
                                        f"has {n}")
            except DataError as e:
                raise SuiteError(f"{self.path}: datasets[{d.name}]: {e}") from None


# --------------------------------------------------------------------------------------------------
# Running cells
# --------------------------------------------------------------------------------------------------
def _last_error(log: Path, rc: int) -> str:
    """The cell's one-line reason: its last ``error:`` line, else its exit code."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        lines = []
    errs = [ln.split("error: ", 1)[1] for ln in lines if "error: " in ln]
    return errs[-1][:500] if errs else f"exit code {rc} (see {log})"


def drop_weights(run_dir: Path) -> None:
    """A grid cell's weights, once scored: its checkpoints and consolidated model (the table keeps its score)."""
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    (run_dir / "model.safetensors").unlink(missing_ok=True)


def run_cell_local(suite: Suite, cell: Cell, parent_run: str | None) -> None:
    """One cell with the local launcher (as many ranks as its cluster section plans); its outcome is
    what its run dir then holds (completed) or the failure recorded there."""
    from .local import run_local

    cfg = cell_config(suite.spec, cell, suite.path)
    logs = suite.out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    log = logs / f"{cell.dataset}-{cell.run_dir.name}.log"
    clear_record(cell.run_dir)
    extra = [f"tracking.parent_run={parent_run}"] if parent_run else []
    print(f"suite: {cell.name} ...", flush=True)
    rc = run_local(["transfer", "--config", suite.spec.transfer_config, *cell.plus(extra).overrides],
                   cfg.cluster.nodes * cfg.cluster.tasks_per_node, log=log)
    finish_cell(suite, cell, rc, log)


def finish_cell(suite: Suite, cell: Cell, rc: int, log: Path) -> None:
    state = cell_state(cell.run_dir, cell.score_split)
    if state.status == "completed":
        if cell.phase == "grid" and not suite.keep_grid_weights:
            drop_weights(cell.run_dir)
        print(f"suite: {cell.name} {cell.score_split} {state.score:.4f}", flush=True)
    else:
        record_failure(cell.run_dir, _last_error(log, rc))
        print(f"suite: {cell.name} failed: {_last_error(log, rc)}", flush=True)


def selected_lr(suite: Suite, dataset: str) -> float | None:
    return choose([(c.lr, cell_state(c.run_dir, c.score_split).score) for c in suite.grid[dataset]])


def rows(suite: Suite) -> list[dict]:
    """The table's rows, read from the run dirs (launch/suite_table.py)."""
    from .suite_decontam import marks

    out, checked = [], marks(suite.source, suite.spec.datasets)
    for d in suite.spec.datasets:
        best = selected_lr(suite, d.name)
        for c in suite.grid[d.name]:
            s = cell_state(c.run_dir, c.score_split)
            out.append({"dataset": d.name, "phase": "grid", "lr": c.lr, "minival_top1": s.score,
                        "selected": c.lr == best, "status": s.status, "error": s.error, "run_dir": str(c.run_dir)})
        if best is None:
            out.append({"dataset": d.name, "phase": "final", "status": "skipped",
                        "error": "no grid cell completed", "run_dir": ""})
            continue
        f = suite.final(d.name, best)
        s = cell_state(f.run_dir, f.score_split)
        mini = next(r["minival_top1"] for r in out if r["dataset"] == d.name and r["selected"])
        out.append({"dataset": d.name, "phase": "final", "lr": best, "minival_top1": mini, "test_top1": s.score,
                    "selected": True, "status": s.status, "error": s.error, "run_dir": str(f.run_dir),
                    "extra": s.extra})
    return [{**r, "decontaminated": checked[r["dataset"]]} for r in out]


# --------------------------------------------------------------------------------------------------
# MLflow: the suite's parent run
# --------------------------------------------------------------------------------------------------
def open_parent(suite: Suite):
    """The suite's MLflow run (continued when OUT/suite_state.json names it), or a no-op sink."""
    from pipeline.tracking import Sink
    from pipeline.tracking.setup import Tracking
    from pipeline.weights import source_lineage

    from .suite_decontam import marks

    if not suite.uri:
        return Sink()
    state_file = suite.out / STATE_FILE
    state = json.loads(state_file.read_text()) if state_file.is_file() else {}
    section = suite.base.tracking.model_copy(update={"system_metrics": False, "parent_run": None})
    sink = Tracking(section, suite.out, rank=0, run_name=f"suite-{suite.out.name}").mlflow(
        world_size=1, stage="suite", run_id=state.get("mlflow_run_id"), run_key=state.get("mlflow_run_key"),
        params={"suite.file": suite.path, "suite.lrs": suite.spec.lrs, "suite.vtab1k": suite.spec.vtab1k,
                "suite.minival_fraction": suite.spec.minival_fraction, "init.from": suite.source,
                "suite.datasets": ",".join(d.name for d in suite.spec.datasets)})
    if sink.run_id:
        state_file.write_text(json.dumps({"mlflow_run_id": sink.run_id, "mlflow_run_key": sink.run_key}))
    lineage = source_lineage(suite.source)
    checked = marks(suite.source, suite.spec.datasets)
    sink.set_tags({"vitp.checkpoint": suite.source,
                   **({"vitp.decontaminated": ",".join(f"{k}={v}" for k, v in checked.items())}
                      if any(checked.values()) else {}),
                   **({"vitp.pretrain_run": lineage["parent_run_id"]} if "parent_run_id" in lineage else {})})
    return sink


def publish(suite: Suite, sink, table: list[dict]) -> None:
    """The table's numbers, the tables and the figure on the suite's run."""
    from .suite_table import draw, finals, mean

    fin = finals(table)
    metrics = {f"suite/{d}/test_top1": v for d, v in fin.items() if v is not None}
    if mean(fin) is not None:
        metrics["suite/mean_test_top1"] = mean(fin)
    png = draw([(suite.out.name, fin)], suite.out / "suite.png")
    sink.log(metrics, 0)
    for p in (suite.out / "suite.csv", suite.out / "suite.md", png):
        sink.log_artifact(p)


# --------------------------------------------------------------------------------------------------
# The command
# --------------------------------------------------------------------------------------------------
def finish_if_done(suite: Suite) -> list[dict]:
    """The tables from the run dirs; once no cell is left to run, the suite's MLflow run gets the numbers,
    the tables and the figure, and ends (FINISHED, or FAILED when a cell failed). -> the table's rows."""
    table = rows(suite)
    write_tables(suite.out, table)
    if any(r["status"] == "pending" for r in table):
        return table
    sink = open_parent(suite)
    publish(suite, sink, table)
    ok = all(r["status"] == "completed" for r in table)
    sink.close(status="FINISHED" if ok else "FAILED", timeout=suite.base.tracking.close_timeout_s)
    return table


def run_suite(suite: Suite, run_cell=run_cell_local) -> list[dict]:
    """Every cell that is not completed, dataset by dataset (grid, then the final); the tables after each."""
    from pipeline.rundir import Heartbeat, claim, release

    suite.check()
    suite.out.mkdir(parents=True, exist_ok=True)
    mine = claim(suite.out)
    beat = Heartbeat(suite.out)
    try:
        parent = open_parent(suite)
        parent.close(status=None, timeout=suite.base.tracking.close_timeout_s)  # finish_if_done ends it
        for d in suite.spec.datasets:
            for cell in suite.grid[d.name]:
                if cell_state(cell.run_dir, cell.score_split).status != "completed":
                    run_cell(suite, cell, parent.run_id)
                write_tables(suite.out, rows(suite))
            best = selected_lr(suite, d.name)
            if best is not None:
                final = suite.final(d.name, best)
                if cell_state(final.run_dir, final.score_split).status != "completed":
                    run_cell(suite, final, parent.run_id)
            write_tables(suite.out, rows(suite))
        return finish_if_done(suite)
    finally:
        beat.stop()
        release(suite.out, mine)


def summary(table: list[dict]) -> str:
    done = sum(r["status"] == "completed" for r in table)
    bad = [f"{r['dataset']}/{r['phase']}" + (f" lr {lr_text(r['lr'])}" if r.get("lr") is not None else "")
           + f" ({r['error']})" for r in table if r["status"] != "completed"]
    return f"{done}/{len(table)} cells completed" + (f"; not: {'; '.join(bad)}" if bad else "")


def suite_parser() -> argparse.ArgumentParser:
    from .cli import add_config_args, parser_for

    p = parser_for("suite", "Fine-tune a checkpoint on every dataset of a suite file: a grid of learning rates "
                            "scored on minival, then the best on all of train scored on the test split; writes "
                            "RUN_DIR/suite.csv, suite.md, suite.png. `vitp suite report OUT [--compare OTHER ...]` "
                            "redraws the table with one column per suite. The same command again resumes.")
    add_config_args(p)
    p.add_argument("--keep-grid-weights", action="store_true",
                   help="keep every grid cell's checkpoints (default: only the finals keep theirs)")
    return p


def report_main(argv: list[str]) -> int:
    from .cli import parser_for
    from .suite_table import report

    p = parser_for("suite", "Rewrite OUT/suite.md with one column per suite (checkpoint) and draw suite.png.")
    p.add_argument("out", help="a suite's output folder (its run.dir)")
    p.add_argument("--compare", nargs="*", default=[], help="other suites' output folders")
    args = p.parse_args(argv)
    md, png = report(Path(args.out), args.compare)
    print(md.read_text(), end="")
    print(f"figure: {png}")
    return 0


def suite_main(argv: list[str]) -> int:
    if argv and argv[0] == "report":
        return report_main(argv[1:])
    args = suite_parser().parse_intermixed_args(argv)
    suite = Suite(args.config, args.overrides, args.keep_grid_weights)
    table = run_suite(suite)
    print((suite.out / "suite.md").read_text(), end="")
    line = summary(table)
    print(f"suite: {line}", flush=True)
    if any(r["status"] != "completed" for r in table):
        from .cli import CommandFailed

        raise CommandFailed(f"suite: {line}; run the same command again to retry what failed")
    return 0
