"""A transfer suite's file (``SUITE.yaml``) and the cells it makes: the paper's protocol (Appendix B.1.1).

    transfer_config: configs/transfer/vit_l16_384.yaml   # the recipe every cell starts from
    lrs: [0.001, 0.003, 0.01, 0.03]                       # default: the paper's
    minival_fraction: 0.02                                # or vtab1k: true (800 + 200 from train)
    datasets:
      - name: pets
        data: s3://bucket/pets        # a vitp prep output
        test_split: test              # default test
        overrides: [train.steps=500]  # any transfer-config overrides (after the suite's `overrides:`)

Per dataset: a *grid* cell per lr (train less minival, scored on minival), then one *final* cell with
the best lr (all of train, or VTAB-1k's 1000, scored on the test split). Cells are transfer runs in
``OUT/<dataset>/grid_lr<lr>`` and ``OUT/<dataset>/final_lr<lr>``. Everything here is checked before a
cell is queued: a mistake is one line naming the file and the key.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from pydantic import Field, ValidationError, model_validator

from pipeline.config.sections import Bool, Float, Int, List, Section, Str

PAPER_LRS = [0.001, 0.003, 0.01, 0.03]
VTAB_TRAIN, VTAB_MINIVAL = 800, 200  # VTAB-1k: 1000 training examples, 200 of them to choose on


class SuiteError(ValueError):
    """A suite file or command-line mistake, found before anything is queued; one line."""


class SuiteDataset(Section):
    name: Str
    data: Str  # a `vitp prep` output: folder, s3://, gs://, https://
    test_split: Str = "test"
    overrides: List(Str) = Field(default_factory=list)

    @model_validator(mode="after")
    def _name(self):
        if not re.fullmatch(r"[\w.-]+", self.name):
            raise ValueError(f"name: {self.name!r}: letters, digits, _ . - only (it names the dataset's folder "
                           "and its metrics)")
        return self


class SuiteSpec(Section):
    transfer_config: Str
    lrs: List(Float) = Field(default_factory=lambda: list(PAPER_LRS))
    minival_fraction: Float = Field(0.02, gt=0.0, lt=1.0)
    minival_seed: Int = 0
    vtab1k: Bool = False  # 800 to train + 200 to choose on, then the final on all 1000
    overrides: List(Str) = Field(default_factory=list)  # transfer-config overrides of every cell
    datasets: List(SuiteDataset)

    @model_validator(mode="after")
    def _lists(self):
        if not self.lrs or any(lr <= 0 for lr in self.lrs):
            raise ValueError(f"lrs: one or more learning rates > 0; got {self.lrs}")
        if not self.datasets:
            raise ValueError("datasets: no dataset")
        names = [d.name for d in self.datasets]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"datasets: name {dup[0]!r} used twice")
        return self


def _where(loc) -> str:
    return ".".join(f"[{x}]" if isinstance(x, int) else str(x) for x in loc).replace(".[", "[")


def load_suite(path: str | Path) -> SuiteSpec:
    """The suite file, validated; SuiteError ``FILE: KEY: problem`` otherwise."""
    p = Path(path)
    try:
        raw = yaml.safe_load(p.read_text())
    except OSError as e:
        raise SuiteError(f"{p}: cannot read ({e.strerror or e})") from None
    except yaml.YAMLError as e:
        raise SuiteError(f"{p}: not YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(raw, dict):
        raise SuiteError(f"{p}: expected a mapping (transfer_config, lrs, datasets, ...)")
    try:
        spec = SuiteSpec.model_validate(raw)
    except ValidationError as e:
        err = e.errors()[0]
        where = _where(err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        raise SuiteError(f"{p}: {where + ': ' if where and not msg.startswith(where) else ''}{msg}") from None
    cfg = Path(spec.transfer_config)
    if not cfg.is_file() and (p.parent / cfg).is_file():
        spec.transfer_config = str(p.parent / cfg)
    if not Path(spec.transfer_config).is_file():
        raise SuiteError(f"{p}: transfer_config: {spec.transfer_config} not found")
    return spec


@dataclass
class Cell:
    """One transfer run of the suite."""

    dataset: str
    phase: str  # "grid" | "final"
    lr: float
    run_dir: Path
    overrides: list[str] = field(default_factory=list)  # over the suite's transfer_config
    score_split: str = "minival"

    @property
    def name(self) -> str:
        return f"{self.dataset}/{self.run_dir.name}"

    def plus(self, overrides: list[str]) -> Cell:
        """The same cell with more overrides (known only once the suite runs: its MLflow parent run)."""
        return dataclasses.replace(self, overrides=[*self.overrides, *overrides])


def lr_text(lr: float) -> str:
    return f"{lr:g}"


def grid_cells(spec: SuiteSpec, out: Path, common: list[str]) -> dict[str, list[Cell]]:
    """dataset name -> its grid cells, in the order of ``lrs`` (``common``: the command line's overrides)."""
    return {d.name: [_cell(spec, d, out, common, "grid", lr) for lr in spec.lrs] for d in spec.datasets}


def final_cell(spec: SuiteSpec, dataset: str, lr: float, out: Path, common: list[str]) -> Cell:
    d = next(x for x in spec.datasets if x.name == dataset)
    return _cell(spec, d, out, common, "final", lr)


def _cell(spec: SuiteSpec, d: SuiteDataset, out: Path, common: list[str], phase: str, lr: float) -> Cell:
    run_dir = out / d.name / f"{phase}_lr{lr_text(lr)}"
    if phase == "grid":
        held = ([f"data.train_limit={VTAB_TRAIN}", f"data.minival_limit={VTAB_MINIVAL}"] if spec.vtab1k
                else [f"data.minival_fraction={spec.minival_fraction}"])
        held += [f"data.minival_seed={spec.minival_seed}", "data.val_split=minival", "tracking.log_model=false"]
        split = "minival"
    else:
        held = ([f"data.train_limit={VTAB_TRAIN + VTAB_MINIVAL}", f"data.minival_seed={spec.minival_seed}"]
                if spec.vtab1k else [])
        held += [f"data.val_split={d.test_split}"]
        split = d.test_split
    own = [f"data.path={d.data}", f"optim.lr={lr}", f"run.dir={run_dir}", f"run.name=suite-{d.name}-{phase}-"
           f"lr{lr_text(lr)}", "tracking.register_name=null", *held]
    return Cell(d.name, phase, lr, run_dir, [*spec.overrides, *common, *d.overrides, *own], split)


def cell_config(spec: SuiteSpec, cell: Cell, spec_path: str | Path = "SUITE.yaml"):
    """The cell's validated transfer config; SuiteError naming the suite file and the key otherwise."""
    from pipeline.config import ConfigError, load_config

    try:
        return load_config(spec.transfer_config, cell.overrides)
    except ConfigError as e:
        raise SuiteError(f"{spec_path}: datasets[{cell.dataset}]: {e}") from None
