"""`vitp suite`: judge a checkpoint the paper's way, over many datasets in one command.

    vitp suite --config configs/suite/tiny.yaml init.from=runs/pre run.dir=runs/suite
    vitp suite report runs/suite --compare runs/suite_other      # one column per checkpoint, suite.png

Per dataset (launch/suite_spec.py): one transfer run per lr on train less minival, scored on minival;
the best (ties: the smaller lr) is fine-tuned again on all of train and scored on the test split.
This process runs the cells one after another with the local launcher; `vitp submit suite` queues them
on SLURM (launch/suite_slurm.py). Every cell is the transfer stage, in its own run dir under OUT, so:

- the same command again skips completed cells, resumes half-trained ones from their checkpoints
  and reruns failed ones; a failing cell is recorded (``suite_cell.json``) and the others go on;
- a completed cell counts only when its recorded identity (launch/suite_identity.py: the checkpoint and
  the resolved config) is what the command asks for now: otherwise the suite is refused before anything
  runs, or with ``--rerun-changed`` the changed cells (and the finals that depend on them) run again;
- OUT/suite.csv and OUT/suite.md are rewritten from the run dirs after every cell (launch/suite_table.py);
  a final whose lr is no longer chosen is ``superseded`` there, out of every mean;
- MLflow (launch/suite_mlflow.py): a parent run per checkpoint (kept in OUT/suite_state.json), each
  cell's run nested under it, the numbers, the tables and the figure.

OUT is owned by one suite at a time (pipeline/rundir.py): a second `vitp suite` on it is refused.
"""

from __future__ import annotations

import argparse
import re
import shutil
from pathlib import Path

from . import suite_identity as ident
from .suite_spec import (
    OWNED,
    Cell,
    SuiteError,
    cell_config,
    dataset_entry,
    final_cell,
    grid_cells,
    load_suite,
    lr_text,
    owned_key,
    protocol,
)
from .suite_table import cell_state, choose, clear_record, record_failure, write_tables


# --------------------------------------------------------------------------------------------------
# The plan: the suite file and the command line, checked before anything runs
# --------------------------------------------------------------------------------------------------
class Suite:
    """A suite file bound to its output folder and the command line's overrides, checked."""

    def __init__(self, spec_path: str, overrides: list[str], keep_grid_weights: bool = False,
                 rerun_changed: bool = False):
        self.path, self.spec = spec_path, load_suite(spec_path)
        out = [o.split("=", 1)[1] for o in overrides if o.startswith("run.dir=")]
        if not out or not out[-1]:
            raise SuiteError("run.dir: give the suite's output folder, e.g. run.dir=runs/suite")
        self.out = Path(out[-1]).resolve()
        self.common = [o for o in overrides if not o.startswith("run.dir=")]
        for o in self.common:
            if owned_key(o):
                raise SuiteError(f"{o.split('=', 1)[0]}: set by the suite per cell; use the suite file's "
                                 f"`{OWNED[owned_key(o)]}:` instead")
        src = [o.split("=", 1)[1] for o in self.common if o.startswith("init.from=")]
        if not src or not src[-1]:
            raise SuiteError("init.from: give the pre-trained checkpoint to evaluate, e.g. init.from=runs/pre")
        if "://" not in src[-1] and not Path(src[-1]).exists():
            raise SuiteError(f"init.from: {src[-1]} not found")
        self.source = src[-1]
        self.keep_grid_weights, self.rerun_changed = keep_grid_weights, rerun_changed
        self.grid = grid_cells(self.spec, self.out, self.common)
        first = self.spec.datasets[0]
        self.base = cell_config(self.spec, self.final(first.name, protocol(self.spec, first).lrs[0]), spec_path)
        self._source_digest: str | None = None
        self._ids: dict[Path, dict] = {}
        self.uri = None
        if self.base.tracking.enabled:
            from pipeline.tracking.setup import Tracking

            self.uri = Tracking.from_config(self.base, self.out, rank=0).uri
            self.common.append(f"tracking.uri={self.uri}")  # the cells log where the suite's parent run is
            self.grid = grid_cells(self.spec, self.out, self.common)

    def final(self, dataset: str, lr: float, seed: int = 0) -> Cell:
        return final_cell(self.spec, dataset, lr, self.out, self.common, seed)

    def finals(self, dataset: str, lr: float) -> list[Cell]:
        """The dataset's finals at ``lr``: one per repeat (seeds 0..repeats-1)."""
        return [self.final(dataset, lr, s) for s in range(self.spec.repeats)]

    @property
    def name(self) -> str:
        """The checkpoint's name: the column of suite.md and suite.png."""
        return ident.checkpoint_name(self.source)

    def source_digest(self) -> str:
        if self._source_digest is None:
            from pipeline.weights import WeightsError, source_digest

            try:
                self._source_digest = source_digest(self.source)
            except WeightsError as e:
                raise SuiteError(str(e)) from None
        return self._source_digest

    def identity(self, cell: Cell) -> dict:
        """What makes ``cell`` now (launch/suite_identity.py); a final's holds its grid's digests."""
        if cell.run_dir not in self._ids:
            config = ident.config_identity(cell_config(self.spec, cell, self.path))
            grid = [self.identity(g)["digest"] for g in self.grid[cell.dataset]] if cell.phase == "final" else None
            self._ids[cell.run_dir] = ident.make(self.source, self.source_digest(), config, grid)
        return self._ids[cell.run_dir]

    def changed(self, cell: Cell) -> str | None:
        """The first key where what ``cell``'s run dir holds differs from what is asked now; None when
        it holds nothing (no results, no identity) or the same."""
        was = ident.recorded(cell.run_dir)
        if was is None and not (cell.run_dir / "results.json").is_file():
            return None
        return ident.first_difference(was, self.identity(cell))

    def done(self, cell: Cell) -> bool:
        """Completed, by what is asked now."""
        return cell_state(cell.run_dir, cell.score_split).status == "completed" and self.changed(cell) is None

    def prepare(self, cell: Cell) -> None:
        """Before a cell runs: what its run dir holds of another identity goes (nothing of it is resumed
        or reported), then its identity is recorded."""
        if self.changed(cell) is not None:
            ident.wipe(cell.run_dir)
        ident.record(cell.run_dir, self.identity(cell))

    def check_identities(self) -> list[Cell]:
        """The completed cells that another identity made (grid cells and the finals the table reports):
        SuiteError naming the first, unless --rerun-changed (then they are returned, to run again)."""
        out = []
        for d in self.spec.datasets:
            best = selected_lr(self, d.name)
            for cell in [*self.grid[d.name], *(self.finals(d.name, best) if best is not None else [])]:
                if cell_state(cell.run_dir, cell.score_split).status != "completed":
                    continue
                key = self.changed(cell)
                if key is None:
                    continue
                if not self.rerun_changed:
                    raise SuiteError(f"{self.out}: datasets[{d.name}]: {cell.run_dir.name}: {key} differs from what "
                                     "made its results; run with --rerun-changed to rerun the changed cells, or "
                                     "give another run.dir")
                out.append(cell)
        return out

    def check(self) -> None:
        """Every cell's config, every dataset's splits and limits: one line naming the file and the key."""
        from pipeline.data import DataError, check_splits, read_info

        for d in self.spec.datasets:
            cfg = None
            for cell in [*self.grid[d.name], self.final(d.name, protocol(self.spec, d).lrs[0])]:
                cfg = cell_config(self.spec, cell, self.path)
            try:
                check_splits(d.data, {"data.train_split": cfg.data.train_split, "test_split": d.test_split})
                if protocol(self.spec, d).vtab1k:
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
    suite.prepare(cell)
    clear_record(cell.run_dir)
    extra = [f"tracking.parent_run={parent_run}"] if parent_run else []
    print(f"suite: {cell.name} ...", flush=True)
    rc = run_local(["transfer", "--config", suite.spec.transfer_config, *cell.plus(extra).overrides],
                   cfg.world_size_planned, log=log)
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
    """The dataset's chosen lr: its only one, else the best minival score of its grid (None: no grid
    cell completed)."""
    lrs = protocol(suite.spec, dataset_entry(suite.spec, dataset)).lrs
    if len(lrs) == 1:
        return lrs[0]
    return choose([(c.lr, cell_state(c.run_dir, c.score_split).score) for c in suite.grid[dataset]])


_FINAL_DIR = re.compile(r"final_lr(?P<lr>[^_]+)(?:_seed(?P<seed>\d+))?")


def superseded(suite: Suite, dataset: str, current: list[Cell]) -> list[tuple[float, int, Path]]:
    """(lr, seed, run dir) of the dataset's completed finals that are not among ``current`` (another
    lr was chosen since they ran)."""
    keep = {c.run_dir for c in current}
    out = []
    for p in sorted((suite.out / dataset).glob("final_lr*")):
        m = _FINAL_DIR.fullmatch(p.name)
        if m and p not in keep and (p / "results.json").is_file():
            out.append((float(m["lr"]), int(m["seed"] or 0), p))
    return out


def rows(suite: Suite) -> list[dict]:
    """The table's rows, read from the run dirs (launch/suite_table.py)."""
    from .suite_decontam import marks

    out, checked = [], marks(suite.source, suite.spec.datasets)
    for d in suite.spec.datasets:
        best = selected_lr(suite, d.name)
        base = {"dataset": d.name, "group": d.group}
        mini = None
        for c in suite.grid[d.name]:
            s = cell_state(c.run_dir, c.score_split)
            mini = s.score if c.lr == best else mini
            out.append({**base, "phase": "grid", "lr": c.lr, "minival_top1": s.score, "selected": c.lr == best,
                        "status": s.status, "error": s.error, "run_dir": str(c.run_dir)})
        if best is None:
            out.append({**base, "phase": "final", "status": "skipped", "error": "no grid cell completed",
                        "run_dir": ""})
        current = suite.finals(d.name, best) if best is not None else []
        for f in current:
            s = cell_state(f.run_dir, f.score_split)
            out.append({**base, "phase": "final", "lr": best, "seed": f.seed, "minival_top1": mini,
                        "test_top1": s.score, "selected": True, "status": s.status, "error": s.error,
                        "run_dir": str(f.run_dir), "extra": s.extra})
        for lr, seed, p in superseded(suite, d.name, current):
            s = cell_state(p, d.test_split)
            out.append({**base, "phase": "final", "lr": lr, "seed": seed, "test_top1": s.score, "selected": False,
                        "status": "superseded", "error": f"lr {lr_text(best)} chosen since", "run_dir": str(p)})
    return [{**r, "decontaminated": checked[r["dataset"]]} for r in out]


def write_all(suite: Suite) -> list[dict]:
    """The table's rows, written as suite.csv and suite.md (its column: the checkpoint's name)."""
    table = rows(suite)
    write_tables(suite.out, table, suite.name)
    return table


# --------------------------------------------------------------------------------------------------
# The command
# --------------------------------------------------------------------------------------------------
OK = ("completed", "superseded")  # a superseded final is history, not a failure


def finish_if_done(suite: Suite) -> list[dict]:
    """The tables from the run dirs; once no cell is left to run, the suite's MLflow run gets the numbers,
    the tables and the figure, and ends (FINISHED, or FAILED when a cell failed). -> the table's rows."""
    from .suite_mlflow import open_parent, publish

    table = write_all(suite)
    if any(r["status"] == "pending" for r in table):
        return table
    sink = open_parent(suite)
    publish(suite, sink, table)
    ok = all(r["status"] in OK for r in table)
    sink.close(status="FINISHED" if ok else "FAILED", timeout=suite.base.tracking.close_timeout_s)
    return table


def run_suite(suite: Suite, run_cell=run_cell_local) -> list[dict]:
    """Every cell that is not completed (by what is asked now), dataset by dataset (grid, then the
    finals); the tables after each. A completed cell another identity made is refused before anything
    runs (Suite.check_identities), or with --rerun-changed run again."""
    from pipeline.rundir import Heartbeat, claim, release

    from .suite_mlflow import open_parent

    suite.check()
    suite.check_identities()
    suite.out.mkdir(parents=True, exist_ok=True)
    mine = claim(suite.out)
    beat = Heartbeat(suite.out)
    try:
        parent = open_parent(suite)
        parent.close(status=None, timeout=suite.base.tracking.close_timeout_s)  # finish_if_done ends it
        for d in suite.spec.datasets:
            for cell in suite.grid[d.name]:
                if not suite.done(cell):
                    run_cell(suite, cell, parent.run_id)
                write_all(suite)
            best = selected_lr(suite, d.name)
            for final in suite.finals(d.name, best) if best is not None else []:
                if not suite.done(final):
                    run_cell(suite, final, parent.run_id)
            write_all(suite)
        return finish_if_done(suite)
    finally:
        beat.stop()
        release(suite.out, mine)


def summary(table: list[dict]) -> str:
    table = [r for r in table if r["status"] != "superseded"]
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
    p.add_argument("--rerun-changed", action="store_true",
                   help="rerun the completed cells another checkpoint or config made (and the finals that "
                        "depend on them); without it such a suite is refused")
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
    suite = Suite(args.config, args.overrides, args.keep_grid_weights, args.rerun_changed)
    table = run_suite(suite)
    print((suite.out / "suite.md").read_text(), end="")
    line = summary(table)
    print(f"suite: {line}", flush=True)
    if any(r["status"] not in OK for r in table):
        from .cli import CommandFailed

        raise CommandFailed(f"suite: {line}; run the same command again to retry what failed")
    return 0
