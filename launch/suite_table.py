"""A transfer suite's results: each cell's state read from its run dir, the choice of each dataset's lr,
and the tables (``OUT/suite.csv`` one row per cell, ``OUT/suite.md`` Table 2's shape) and ``suite.png``.

A cell is *completed* when its run dir's ``results.json`` holds its score (``<split>/top1``, or on
multi-label data ``<split>/prec1``), *failed* when the suite recorded a failure in ``suite_cell.json``
(with the reason), *pending* otherwise; a completed final whose lr is no longer the chosen one is
*superseded*: kept in suite.csv, out of every mean. A dataset's score is the mean (± std) over its
finals' repeats; with groups (VTAB's natural / specialized / structured) each group's mean is a row
too. Everything here is read from the run dirs, so the table of a suite resumed, or run half on
SLURM, is the same table.
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

STATE_FILE = "suite_state.json"  # the suite's own: its checkpoint's name, its MLflow parent run per identity
CELL_FILE = "suite_cell.json"  # the suite's record of a cell that failed: {"status", "error"}
COLUMNS = ["dataset", "group", "phase", "lr", "seed", "minival_top1", "test_top1", "selected", "status", "error",
           "run_dir", "decontaminated"]  # decontaminated (launch/suite_decontam.py): yes, no, or "" (not known)
# results.json keys that are not metrics of an evaluator (the extra columns of a final)
_NOT_EXTRA = {"step", "num_classes", "img_size", "parent_step"}


@dataclass
class CellState:
    status: str  # "completed" | "failed" | "pending" | "skipped"
    score: float | None = None  # top-1 (prec@1 on multi-label data) on the split the cell is scored on
    error: str = ""
    extra: dict[str, float] = field(default_factory=dict)  # a final's other metrics (its `evals:` entries)


def read_results(run_dir: Path) -> dict:
    try:
        return json.loads((Path(run_dir) / "results.json").read_text())
    except (OSError, ValueError):
        return {}


def cell_state(run_dir: Path, split: str) -> CellState:
    """What the cell's run dir says (see the module docstring)."""
    res = read_results(run_dir)
    score = next((res[k] for k in (f"{split}/top1", f"{split}/prec1") if isinstance(res.get(k), (int, float))), None)
    if score is not None:
        extra = {k: float(v) for k, v in res.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
                 and k not in _NOT_EXTRA and not k.startswith(f"{split}/")}
        return CellState("completed", float(score), extra=extra)
    try:
        rec = json.loads((Path(run_dir) / CELL_FILE).read_text())
        return CellState(rec.get("status", "failed"), error=rec.get("error", ""))
    except (OSError, ValueError):
        return CellState("pending")


def record_failure(run_dir: Path, error: str, status: str = "failed") -> None:
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    (Path(run_dir) / CELL_FILE).write_text(json.dumps({"status": status, "error": error}))


def clear_record(run_dir: Path) -> None:
    (Path(run_dir) / CELL_FILE).unlink(missing_ok=True)


def choose(scores: list[tuple[float, float | None]]) -> float | None:
    """The lr of the best minival score among ``(lr, score)`` (None: the cell has none); ties go to the
    smaller lr. None when no cell has a score."""
    done = [(lr, s) for lr, s in scores if s is not None and not math.isnan(s)]
    if not done:
        return None
    return min(done, key=lambda x: (-x[1], x[0]))[0]


def write_tables(out: Path, rows: list[dict], label: str | None = None) -> tuple[Path, Path]:
    """``suite.csv`` (every cell, then each final's extra metrics as columns) and ``suite.md`` (its
    column named ``label``: the checkpoint's name; default the folder's)."""
    out = Path(out)
    extra = sorted({k for r in rows for k in r.get("extra", {})})
    with open(out / "suite.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(COLUMNS + extra)
        for r in rows:
            w.writerow([_cell_text(r.get(c)) for c in COLUMNS] + [_cell_text(r.get("extra", {}).get(k)) for k in extra])
    md = out / "suite.md"
    checked = {r["dataset"]: r.get("decontaminated") or "" for r in rows}
    md.write_text(markdown([(label or out.name, finals(rows))], groups(rows),
                           checked if any(checked.values()) else None))
    return out / "suite.csv", md


def _cell_text(v) -> str:
    if v is None:
        return ""
    if isinstance(v, bool):
        return "yes" if v else ""
    if isinstance(v, float):
        return f"{v:.6g}"
    return str(v)


Scores = dict[str, list[float] | None]  # dataset -> its finals' test scores (one per repeat); None: not all done


def finals(rows: list[dict]) -> Scores:
    """dataset -> the test scores of its current finals (None unless every repeat completed), in the
    rows' order; superseded finals are left out."""
    out: dict[str, list[float] | None] = {}
    for r in rows:
        got = out.setdefault(r["dataset"], [])
        if r["phase"] != "final" or r["status"] == "superseded" or got is None:
            continue
        out[r["dataset"]] = got + [r["test_top1"]] if r["status"] == "completed" else None
    return {d: v or None for d, v in out.items()}


def groups(rows: list[dict]) -> dict[str, str]:
    """dataset -> its group, for the datasets that name one."""
    return {r["dataset"]: r["group"] for r in rows if r.get("group")}


def score(v: list[float] | float | None) -> float | None:
    """A dataset's number: the mean over its repeats."""
    if v is None or isinstance(v, float | int):
        return v
    return sum(v) / len(v) if v else None


def std(v: list[float] | float | None) -> float | None:
    """The population std over a dataset's repeats (None for a single run)."""
    if v is None or isinstance(v, float | int) or len(v) < 2:
        return None
    m = sum(v) / len(v)
    return math.sqrt(sum((x - m) ** 2 for x in v) / len(v))


def mean(scores: dict) -> float | None:
    """The mean over datasets of their :func:`score`; None unless every dataset has one."""
    vals = [score(v) for v in scores.values()]
    return sum(vals) / len(vals) if vals and all(v is not None for v in vals) else None


def group_means(scores: dict, group_of: dict[str, str]) -> dict[str, float | None]:
    """group -> the mean over its datasets, in the order groups first appear."""
    names = list(dict.fromkeys(group_of[d] for d in scores if d in group_of))
    return {g: mean({d: v for d, v in scores.items() if group_of.get(d) == g}) for g in names}


def markdown(columns: list[tuple[str, dict]], group_of: dict[str, str] | None = None,
             checked: dict[str, str] | None = None) -> str:
    """Table 2's shape: one row per dataset, one column per checkpoint, scores in % (mean ± std over
    repeats), then each group's mean and the mean over all datasets. ``checked``: a last column, whether
    each test split was among the sets the pre-training data was checked against
    (launch/suite_decontam.py)."""
    group_of = group_of or {}
    names = list(dict.fromkeys(d for _, col in columns for d in col))

    def fmt(v) -> str:
        m, s = score(v), std(v)
        return "-" if m is None else f"{100 * m:.2f}" + (f" ± {100 * s:.2f}" if s is not None else "")

    def tail(d) -> str:
        return "" if checked is None else f" {checked.get(d, '') if d else ''} |"

    lines = ["| dataset | " + " | ".join(n for n, _ in columns) + " |" + (" decontaminated |" if checked else ""),
             "|---|" + "---:|" * len(columns) + ("---|" if checked else "")]
    for d in names:
        lines.append(f"| {d} | " + " | ".join(fmt(col.get(d)) for _, col in columns) + " |" + tail(d))
    per_col = [group_means({d: col.get(d) for d in names}, group_of) for _, col in columns]
    for g in dict.fromkeys(g for gm in per_col for g in gm):
        lines.append(f"| *{g}* | " + " | ".join(fmt(gm.get(g)) for gm in per_col) + " |" + tail(None))
    lines.append("| **mean** | " + " | ".join(fmt(mean({d: col.get(d) for d in names})) for _, col in columns)
                 + " |" + tail(None))
    return "\n".join(lines) + "\n"


def read_csv_finals(out: Path) -> tuple[Scores, dict[str, str]]:
    """(dataset -> its finals' test scores, dataset -> group) from a suite's ``suite.csv``."""
    p = Path(out) / "suite.csv"
    if not p.is_file():
        raise FileNotFoundError(f"{p}: not found (is {out} a suite's output folder?)")
    with open(p, newline="") as f:
        rows = [dict(r, test_top1=float(r["test_top1"]) if r.get("test_top1") else None) for r in csv.DictReader(f)]
    return finals(rows), groups(rows)


def draw(columns: list[tuple[str, dict]], path: Path) -> Path:
    """Bars per dataset (and the mean), one colour per checkpoint."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    names = list(dict.fromkeys(d for _, col in columns for d in col)) + ["mean"]
    width = 0.8 / max(1, len(columns))
    fig, ax = plt.subplots(figsize=(max(4.0, 0.9 * len(names) * max(1, len(columns)) ** 0.5), 3.2))
    x = np.arange(len(names))
    for i, (label, col) in enumerate(columns):
        vals = [score(col.get(d)) for d in names[:-1]] + [mean({d: col.get(d) for d in names[:-1]})]
        ax.bar(x + i * width, [100 * (v or 0.0) for v in vals], width, label=label)
    ax.set_xticks(x + width * (len(columns) - 1) / 2, names, rotation=30, ha="right")
    ax.set_ylabel("test top-1 (%)")
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return Path(path)


def column_name(out: Path) -> str:
    """A suite's column: the name of the checkpoint it evaluated (recorded in its suite_state.json),
    else its folder's name."""
    try:
        return json.loads((Path(out) / STATE_FILE).read_text())["checkpoint_name"]
    except (OSError, ValueError, KeyError, TypeError):
        return Path(out).resolve().name


def report(out: Path, compare: list[str]) -> tuple[Path, Path]:
    """`vitp suite report OUT --compare OTHER ...`: suite.md with one column per suite, and suite.png."""
    out = Path(out)
    read = [(column_name(Path(o)), *read_csv_finals(o)) for o in [out, *compare]]
    group_of = {d: g for _, _, gs in read for d, g in gs.items()}
    columns = [(name, col) for name, col, _ in read]
    md = out / "suite.md"
    md.write_text(markdown(columns, group_of))
    return md, draw(columns, out / "suite.png")
