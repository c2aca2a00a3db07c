"""A transfer suite's file (``SUITE.yaml``) and the cells it makes: the paper's protocol (Appendix B.1.1).

    transfer_config: configs/transfer/vit_l16_384.yaml   # the recipe every cell starts from
    lrs: [0.001, 0.003, 0.01, 0.03]                       # default: the paper's
    minival_fraction: 0.02                                # or vtab1k: true (800 + 200 from train)
    repeats: 1                                            # finals per dataset (seeds 0..N-1)
    datasets:
      - name: pets
        data: s3://bucket/pets        # a vitp prep output
        test_split: test              # default test
        lrs: [0.001, 0.003]           # this dataset's own grid / minival (default: the suite's)
        minival_fraction: 0.1
        group: natural                # VTAB's groups: natural | specialized | structured
        overrides: [train.steps=500]  # any transfer-config overrides (after the suite's `overrides:`)

Per dataset: a *grid* cell per lr (train less minival, scored on minival), then the *final* cell(s)
with the best lr (all of train, or VTAB-1k's 1000, scored on the test split). With a single lr there
is nothing to choose: no grid cell, the final only. Cells are transfer runs in
``OUT/<dataset>/grid_lr<lr>`` and ``OUT/<dataset>/final_lr<lr>`` (``..._seed<s>`` for repeats past
the first). The keys the protocol owns (the lr, the minival) are refused in ``overrides``, naming the
entry key to use. Everything here is checked before a cell is queued: a mistake is one line naming
the file and the key.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from pydantic import Field, ValidationError, model_validator

from pipeline.config.sections import Bool, Float, Int, List, Section, Str, one_of

PAPER_LRS = [0.001, 0.003, 0.01, 0.03]
VTAB_TRAIN, VTAB_MINIVAL = 800, 200  # VTAB-1k: 1000 training examples, 200 of them to choose on


GROUPS = ("natural", "specialized", "structured")  # VTAB's task groups (Zhai et al. 2019)
# transfer-config keys the suite sets per cell -> the suite file's key to use instead
OWNED = {"optim.lr": "lrs", "data.minival_fraction": "minival_fraction", "data.minival_seed": "minival_seed",
         "data.train_limit": "vtab1k", "data.minival_limit": "vtab1k", "seed": "repeats"}


class SuiteError(ValueError):
    """A suite file or command-line mistake, found before anything is queued; one line."""


def owned_key(override: str) -> str | None:
    """The suite-owned key an override ``KEY=VALUE`` sets, else None."""
    key = override.split("=", 1)[0].strip()
    return key if key in OWNED else None


class SuiteDataset(Section):
    name: Str
    data: Str  # a `vitp prep` output: folder, s3://, gs://, https://
    test_split: Str = "test"
    lrs: List(Float) | None = None  # default: the suite's
    minival_fraction: Float | None = Field(None, gt=0.0, lt=1.0)  # default: the suite's
    vtab1k: Bool | None = None  # default: the suite's
    group: one_of(*GROUPS) | None = None
    overrides: List(Str) = Field(default_factory=list)

    @model_validator(mode="after")
    def _name(self):
        if not re.fullmatch(r"[\w.-]+", self.name):
            raise ValueError(f"name: {self.name!r}: letters, digits, _ . - only (it names the dataset's folder "
                           "and its metrics)")
        if self.lrs is not None and (not self.lrs or any(lr <= 0 for lr in self.lrs)):
            raise ValueError(f"lrs: one or more learning rates > 0; got {self.lrs}")
        for o in self.overrides:
            if owned_key(o):
                raise ValueError(f"overrides: {owned_key(o)} is set by the suite; use the entry's "
                                 f"`{OWNED[owned_key(o)]}:` instead")
        return self


class SuiteSpec(Section):
    transfer_config: Str
    lrs: List(Float) = Field(default_factory=lambda: list(PAPER_LRS))
    minival_fraction: Float = Field(0.02, gt=0.0, lt=1.0)
    minival_seed: Int = 0
    vtab1k: Bool = False  # 800 to train + 200 to choose on, then the final on all 1000
    repeats: Int = Field(1, ge=1)  # finals per dataset, seeds 0..N-1 (the paper's Table 2: 3)
    overrides: List(Str) = Field(default_factory=list)  # transfer-config overrides of every cell
    datasets: List(SuiteDataset)

    @model_validator(mode="after")
    def _lists(self):
        if not self.lrs or any(lr <= 0 for lr in self.lrs):
            raise ValueError(f"lrs: one or more learning rates > 0; got {self.lrs}")
        for o in self.overrides:
            if owned_key(o):
                raise ValueError(f"overrides: {owned_key(o)} is set by the suite; use `{OWNED[owned_key(o)]}:` "
                                 "(the suite's, or a dataset entry's) instead")
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
    seed: int = 0  # a final's repeat

    @property
    def name(self) -> str:
        return f"{self.dataset}/{self.run_dir.name}"

    def plus(self, overrides: list[str]) -> Cell:
        """The same cell with more overrides (known only once the suite runs: its MLflow parent run)."""
        return dataclasses.replace(self, overrides=[*self.overrides, *overrides])


def lr_text(lr: float) -> str:
    return f"{lr:g}"


@dataclass(frozen=True)
class Protocol:
    """One dataset's protocol: the suite's defaults under the entry's own keys."""

    lrs: list[float]
    minival_fraction: float
    vtab1k: bool


def protocol(spec: SuiteSpec, d: SuiteDataset) -> Protocol:
    return Protocol(list(d.lrs if d.lrs is not None else spec.lrs),
                    d.minival_fraction if d.minival_fraction is not None else spec.minival_fraction,
                    d.vtab1k if d.vtab1k is not None else spec.vtab1k)


def dataset_entry(spec: SuiteSpec, name: str) -> SuiteDataset:
    return next(x for x in spec.datasets if x.name == name)


def grid_cells(spec: SuiteSpec, out: Path, common: list[str]) -> dict[str, list[Cell]]:
    """dataset name -> its grid cells, in the order of its ``lrs`` (``common``: the command line's
    overrides); none where a single lr leaves nothing to choose."""
    out_cells = {}
    for d in spec.datasets:
        lrs = protocol(spec, d).lrs
        out_cells[d.name] = [_cell(spec, d, out, common, "grid", lr) for lr in lrs] if len(lrs) > 1 else []
    return out_cells


def final_cell(spec: SuiteSpec, name: str, lr: float, out: Path, common: list[str], seed: int = 0) -> Cell:
    return _cell(spec, dataset_entry(spec, name), out, common, "final", lr, seed)


def final_dir(out: Path, name: str, lr: float, seed: int = 0) -> Path:
    return out / name / (f"final_lr{lr_text(lr)}" + (f"_seed{seed}" if seed else ""))


def _cell(spec: SuiteSpec, d: SuiteDataset, out: Path, common: list[str], phase: str, lr: float,
          seed: int = 0) -> Cell:
    proto = protocol(spec, d)
    if phase == "grid":
        run_dir = out / d.name / f"grid_lr{lr_text(lr)}"
        held = ([f"data.train_limit={VTAB_TRAIN}", f"data.minival_limit={VTAB_MINIVAL}"] if proto.vtab1k
                else [f"data.minival_fraction={proto.minival_fraction}"])
        held += [f"data.minival_seed={spec.minival_seed}", "data.val_split=minival", "tracking.log_model=false"]
        split = "minival"
    else:  # all of train: the 1000 of VTAB-1k, else the whole split
        run_dir = final_dir(out, d.name, lr, seed)
        held = ([f"data.train_limit={VTAB_TRAIN + VTAB_MINIVAL}", f"data.minival_seed={spec.minival_seed}"]
                if proto.vtab1k else ["data.minival_fraction=0", "data.train_limit=null", "data.minival_limit=null"])
        held += [f"data.val_split={d.test_split}"]
        split = d.test_split
    own = [f"data.path={d.data}", f"optim.lr={lr}", f"seed={seed}", f"run.dir={run_dir}",
           f"run.name=suite-{d.name}-{run_dir.name}", "tracking.register_name=null", *held]
    return Cell(d.name, phase, lr, run_dir, [*spec.overrides, *common, *d.overrides, *own], split, seed)


def cell_config(spec: SuiteSpec, cell: Cell, spec_path: str | Path = "SUITE.yaml"):
    """The cell's validated transfer config; SuiteError naming the suite file and the key otherwise."""
    from pipeline.config import ConfigError, load_config

    try:
        return load_config(spec.transfer_config, cell.overrides)
    except ConfigError as e:
        raise SuiteError(f"{spec_path}: datasets[{cell.dataset}]: {e}") from None
