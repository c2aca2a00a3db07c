"""The transfer suite's parts that run no cell: the suite file's checks (one line naming the file and
the key, before anything is queued), the cells it makes, the choice of lr, and the tables."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from launch.suite import Suite, rows
from launch.suite_spec import SuiteError, cell_config
from launch.suite_table import choose, markdown, record_failure, report, write_tables
from tests.unit.test_data_shards import write_dataset

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def made(tmp_path):
    """(write(spec changes) -> suite file, pre-trained stand-in, two datasets with train + test)."""
    for name in ("a", "b"):
        write_dataset(tmp_path / name, {"train": [10, 10], "test": [6]})
    pre = tmp_path / "pre.safetensors"
    pre.write_bytes(b"")

    def write(**changes) -> Path:
        spec = yaml.safe_load((ROOT / "configs/suite/tiny.yaml").read_text())
        spec["transfer_config"] = str(ROOT / spec["transfer_config"])
        spec["datasets"] = [{"name": n, "data": str(tmp_path / n)} for n in ("a", "b")]
        spec.update(changes)
        p = tmp_path / "suite.yaml"
        p.write_text(yaml.safe_dump(spec))
        return p

    return write, pre, tmp_path


def suite(made, *extra, **changes) -> Suite:
    write, pre, tmp = made
    s = Suite(str(write(**changes)), [f"init.from={pre}", f"run.dir={tmp / 'out'}", "tracking.enabled=false", *extra])
    s.check()
    return s


def test_cells_are_the_protocol(made):
    s = suite(made)
    cells = s.grid["a"]
    assert [c.lr for c in cells] == [0.01, 0.03] and [c.run_dir.name for c in cells] == ["grid_lr0.01", "grid_lr0.03"]
    assert {"data.minival_fraction=0.2", "data.val_split=minival", "optim.lr=0.01", "tracking.register_name=null",
            "model.img_size=32"} <= set(cells[0].overrides)
    final = s.final("a", 0.03)
    assert final.score_split == "test" and "data.val_split=test" in final.overrides
    cfg = cell_config(s.spec, final)
    assert (cfg.data.minival_fraction, cfg.data.train_limit, cfg.data.minival_limit, cfg.seed) == (0.0, None, None, 0)


def test_vtab1k_cells_take_800_and_200_then_1000(made):
    write, pre, tmp = made
    write_dataset(tmp / "big", {"train": [600, 500], "test": [4]})
    s = Suite(str(write(vtab1k=True, datasets=[{"name": "big", "data": str(tmp / "big")}])),
              [f"init.from={pre}", f"run.dir={tmp / 'out'}", "tracking.enabled=false"])
    s.check()
    assert {"data.train_limit=800", "data.minival_limit=200"} <= set(s.grid["big"][0].overrides)
    assert "data.train_limit=1000" in s.final("big", 0.01).overrides


@pytest.mark.parametrize("changes,extra,message", [
    ({"lrs": []}, [], r"suite.yaml: lrs: one or more learning rates > 0; got \[\]"),
    ({"datasets": []}, [], "suite.yaml: datasets: no dataset"),
    ({"datasets": [{"name": "a"}]}, [], r"suite.yaml: datasets\[0\].data: Field required"),
    ({"datasets": [{"name": "a", "data": "DIR/a", "tset_split": "x"}]}, [],
     r"suite.yaml: datasets\[0\].tset_split: Extra inputs are not permitted"),
    ({"datasets": [{"name": "zz", "data": "DIR/nowhere"}]}, [],
     r"suite.yaml: datasets\[zz\]: .*nowhere/_info.json: not found"),
    ({"datasets": [{"name": "a", "data": "DIR/a", "test_split": "val"}]}, [],
     r"suite.yaml: datasets\[a\]: test_split: 'val' not in .*_info.json \(has: train, test\)"),
    ({"vtab1k": True}, [],
     r"suite.yaml: datasets\[a\]: vtab1k: 1000 examples asked of split 'train', which has 20"),
    ({"datasets": [{"name": "a", "data": "DIR/a", "overrides": ["optim.lrr=1"]}]}, [],
     r"suite.yaml: datasets\[a\]: .*optim.lrr"),
    ({"transfer_config": "configs/transfer/nope.yaml"}, [], "suite.yaml: transfer_config: .*nope.yaml not found"),
])
def test_bad_input_is_one_line_before_anything_runs(made, changes, extra, message):
    write, pre, tmp = made
    changes = json.loads(json.dumps(changes).replace("DIR", str(tmp)))
    with pytest.raises(SuiteError, match=message) as e:
        suite(made, *extra, **changes)
    assert "\n" not in str(e.value) and not (tmp / "out").exists()


def test_command_line_needs_checkpoint_and_out(made):
    write, pre, tmp = made
    with pytest.raises(SuiteError, match="run.dir: give the suite's output folder"):
        Suite(str(write()), [f"init.from={pre}"])
    with pytest.raises(SuiteError, match="init.from: give the pre-trained checkpoint"):
        Suite(str(write()), [f"run.dir={tmp}/out"])
    with pytest.raises(SuiteError, match="init.from: .*missing not found"):
        Suite(str(write()), [f"init.from={tmp}/missing", f"run.dir={tmp}/out"])


def test_choose_best_ties_smaller_lr_failed_cells_left_out():
    assert choose([(0.001, 0.5), (0.003, 0.7), (0.01, 0.6)]) == 0.003
    assert choose([(0.03, 0.7), (0.01, 0.7), (0.003, 0.2)]) == 0.01  # tie: the smaller lr
    assert choose([(0.001, None), (0.003, 0.1)]) == 0.003  # a failed cell has no score
    assert choose([(0.001, None)]) is None


def _done(run_dir: Path, split: str, score: float, **more) -> None:
    run_dir.mkdir(parents=True)
    (run_dir / "results.json").write_text(json.dumps({f"{split}/top1": score, "step": 2, **more}))


def test_rows_and_tables_from_run_dirs(made):
    s = suite(made)
    _done(s.grid["a"][0].run_dir, "minival", 0.4)
    _done(s.grid["a"][1].run_dir, "minival", 0.6)
    _done(s.final("a", 0.03).run_dir, "test", 0.55, **{"fewshot/a/5shot": 0.3})  # an `evals:` metric
    record_failure(s.grid["b"][0].run_dir, "data.path: boom")
    _done(s.grid["b"][1].run_dir, "minival", 0.2)
    table = rows(s)
    got = [(r["dataset"], r["phase"], r.get("lr"), r["status"], r.get("selected")) for r in table]
    assert got == [("a", "grid", 0.01, "completed", False), ("a", "grid", 0.03, "completed", True),
                   ("a", "final", 0.03, "completed", True), ("b", "grid", 0.01, "failed", False),
                   ("b", "grid", 0.03, "completed", True), ("b", "final", 0.03, "pending", True)]
    csv_path, md = write_tables(s.out.parent, table)
    lines = csv_path.read_text().splitlines()
    assert lines[0] == ("dataset,group,phase,lr,seed,minival_top1,test_top1,selected,status,error,run_dir,"
                        "decontaminated,fewshot/a/5shot")
    assert lines[3].startswith("a,,final,0.03,0,0.6,0.55,yes,completed,,") and lines[3].endswith(",0.3")
    assert lines[4].startswith("b,,grid,0.01,,,,,failed,data.path: boom,")
    assert md.read_text().splitlines()[-3:] == ["| a | 55.00 |", "| b | - |", "| **mean** | - |"]


def test_report_compares_checkpoints(tmp_path):
    for name, scores in (("one", (0.5, 0.7)), ("two", (0.6, 0.9))):
        out = tmp_path / name
        out.mkdir()
        write_tables(out, [{"dataset": d, "phase": "final", "lr": 0.01, "test_top1": v, "status": "completed"}
                           for d, v in zip(("pets", "flowers"), scores)])
    (tmp_path / "two" / "suite_state.json").write_text(json.dumps({"checkpoint_name": "vit_b16"}))
    md, png = report(tmp_path / "one", [str(tmp_path / "two")])
    assert md.read_text().splitlines() == ["| dataset | one | vit_b16 |", "|---|---:|---:|", "| pets | 50.00 | 60.00 |",
                                           "| flowers | 70.00 | 90.00 |", "| **mean** | 60.00 | 75.00 |"]
    assert png.stat().st_size > 1000
    assert markdown([("x", {"a": None})]).splitlines()[-1] == "| **mean** | - |"


@pytest.mark.parametrize("name,datasets", [("paper", 5), ("vtab1k", 19), ("tiny", 2)])
def test_shipped_suites_load_and_every_cell_validates(name, datasets, tmp_path):
    s = Suite(str(ROOT / f"configs/suite/{name}.yaml"), [f"init.from={tmp_path}", f"run.dir={tmp_path}/out"])
    assert len(s.spec.datasets) == datasets
    for d in s.spec.datasets:
        for cell in [*s.grid[d.name], s.final(d.name, s.spec.lrs[-1])]:
            cell_config(s.spec, cell)


def test_multilabel_cells_are_scored_by_prec1(tmp_path):
    from launch.suite_table import cell_state

    (tmp_path / "results.json").write_text(json.dumps({"minival/prec1": 0.75, "minival/mAP": 0.5, "step": 3}))
    state = cell_state(tmp_path, "minival")
    assert (state.status, state.score, state.extra) == ("completed", 0.75, {})
    assert cell_state(tmp_path, "test").status == "pending"
