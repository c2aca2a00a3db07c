"""The suite's protocol without running a cell: cell identity (refusal, --rerun-changed, superseded
finals), each dataset's own lrs / minival, suite-owned keys refused, a single lr without a grid, VTAB's
per-task augmentation switches, groups and repeats in the tables."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from launch.suite import Suite, rows, run_suite, selected_lr
from launch.suite_mlflow import metrics
from launch.suite_spec import SuiteError, cell_config
from launch.suite_table import write_tables
from tests.unit.test_suite import ROOT, made  # noqa: F401  (the fixture)


def _suite(made, *extra, pre=None, rerun=False, **changes) -> Suite:  # noqa: F811
    write, pre0, tmp = made
    s = Suite(str(write(**changes)), [f"init.from={pre or pre0}", f"run.dir={tmp / 'out'}", "tracking.enabled=false",
                                      *extra], rerun_changed=rerun)
    s.check()
    return s


def _complete(s: Suite, cell, score: float) -> None:
    """As a cell's run leaves its run dir: its identity (recorded when it starts), then its results."""
    s.prepare(cell)
    (cell.run_dir / "results.json").write_text(json.dumps({f"{cell.score_split}/top1": score, "step": 2}))


def _tree(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


def test_another_checkpoint_is_refused_and_changes_nothing(made):  # noqa: F811
    write, pre, tmp = made
    s = _suite(made)
    for c, v in zip(s.grid["a"], (0.4, 0.6)):
        _complete(s, c, v)
    _complete(s, s.final("a", 0.03), 0.5)
    before = _tree(s.out)
    other = tmp / "other.safetensors"
    other.write_bytes(b"other weights")
    with pytest.raises(SuiteError) as e:
        run_suite(_suite(made, pre=other), run_cell=lambda *a: pytest.fail("a cell ran"))
    assert str(e.value) == (f"{s.out}: datasets[a]: grid_lr0.01: init.from differs from what made its results; run "
                            "with --rerun-changed to rerun the changed cells, or give another run.dir")
    assert _tree(s.out) == before
    pre.write_bytes(b"retrained in place")  # the same path, other weights
    with pytest.raises(SuiteError, match=r"grid_lr0.01: init.from \(its weights' digest\) differs"):
        _suite(made).check_identities()
    pre.write_bytes(b"")
    with pytest.raises(SuiteError, match=r"datasets\[a\]: grid_lr0.01: train.steps differs"):
        _suite(made, "train.steps=3").check_identities()
    assert _suite(made).check_identities() == []  # the same command: nothing changed


def test_rerun_changed_reruns_the_changed_cells_and_their_finals(made):  # noqa: F811
    write, pre, tmp = made
    s = _suite(made)
    for c, v in zip(s.grid["a"], (0.4, 0.6)):
        _complete(s, c, v)
    _complete(s, s.final("a", 0.03), 0.5)
    (s.grid["b"][0].run_dir / "results.json").parent.mkdir(parents=True)
    other = tmp / "other.safetensors"
    other.write_bytes(b"other weights")
    s2 = _suite(made, pre=other, rerun=True)
    assert [c.name for c in s2.check_identities()] == ["a/grid_lr0.01", "a/grid_lr0.03", "a/final_lr0.03"]
    ran = []

    def fake(suite, cell, parent):  # the cell's run: what run_cell_local leaves, scores by the new weights
        ran.append(cell.name)
        _complete(suite, cell, {"grid_lr0.01": 0.9, "grid_lr0.03": 0.1}.get(cell.run_dir.name, 0.7))

    table = run_suite(s2, run_cell=fake)
    assert ran == ["a/grid_lr0.01", "a/grid_lr0.03", "a/final_lr0.01", "b/grid_lr0.01", "b/grid_lr0.03",
                   "b/final_lr0.01"]
    got = {(r["dataset"], r["phase"], r["lr"]): r["status"] for r in table}
    assert got[("a", "final", 0.01)] == "completed" and got[("a", "final", 0.03)] == "superseded"
    for r in table:
        if r["status"] == "completed":
            assert json.loads((Path(r["run_dir"]) / ".suite_identity.json").read_text())["source"] == str(other)
    assert run_suite(_suite(made, pre=other), run_cell=lambda *a: pytest.fail("a cell ran")) == table


def test_a_fixed_grid_cell_that_wins_supersedes_the_old_final(made):  # noqa: F811
    s = _suite(made)
    _complete(s, s.grid["a"][0], 0.4)
    s.prepare(s.grid["a"][1])  # failed, then its shard was fixed: same identity
    _complete(s, s.final("a", 0.01), 0.5)
    assert selected_lr(s, "a") == 0.01
    _complete(s, s.grid["a"][1], 0.8)
    assert s.check_identities() == []
    _complete(s, s.final("a", 0.03), 0.6)
    for d in ("b",):
        for c, v in zip(s.grid[d], (0.3, 0.2)):
            _complete(s, c, v)
        _complete(s, s.final(d, 0.01), 0.9)
    table = rows(s)
    finals = [(r["lr"], r["status"], r["test_top1"]) for r in table if r["dataset"] == "a" and r["phase"] == "final"]
    assert finals == [(0.03, "completed", 0.6), (0.01, "superseded", 0.5)]
    assert metrics(table)["suite/mean_test_top1"] == pytest.approx((0.6 + 0.9) / 2)
    assert metrics(table)["suite/a/lr"] == 0.03 and metrics(table)["suite/a/minival_top1"] == 0.8
    _, md = write_tables(s.out, table, "vit_pre")
    assert md.read_text().splitlines()[0] == "| dataset | vit_pre |"
    assert md.read_text().splitlines()[-1] == "| **mean** | 75.00 |"


def test_each_dataset_its_own_lrs_and_minival_and_finals_on_all_of_train(made):  # noqa: F811
    write, pre, tmp = made
    s = _suite(made, datasets=[{"name": "a", "data": str(tmp / "a"), "lrs": [0.001, 0.003, 0.06],
                                "minival_fraction": 0.1},
                               {"name": "b", "data": str(tmp / "b")}])
    assert [c.lr for c in s.grid["a"]] == [0.001, 0.003, 0.06] and [c.lr for c in s.grid["b"]] == [0.01, 0.03]
    assert cell_config(s.spec, s.grid["a"][0]).data.minival_fraction == 0.1
    assert cell_config(s.spec, s.grid["b"][0]).data.minival_fraction == 0.2
    for d, lr in (("a", 0.06), ("b", 0.01)):
        cfg = cell_config(s.spec, s.final(d, lr))
        assert (cfg.optim.lr, cfg.data.minival_fraction, cfg.data.train_limit, cfg.data.val_split) == (lr, 0, None,
                                                                                                       "test")


@pytest.mark.parametrize("where,key,use", [
    ("dataset", "optim.lr", "lrs"), ("dataset", "data.minival_fraction", "minival_fraction"),
    ("dataset", "data.minival_seed", "minival_seed"), ("dataset", "data.train_limit", "vtab1k"),
    ("suite", "data.minival_limit", "vtab1k"), ("command", "optim.lr", "lrs"), ("command", "seed", "repeats")])
def test_suite_owned_keys_are_refused(made, where, key, use):  # noqa: F811
    write, pre, tmp = made
    if where == "command":
        with pytest.raises(SuiteError, match=f"^{key}: set by the suite per cell; use the suite file's `{use}:`"):
            _suite(made, f"{key}=1")
        return
    changes = ({"datasets": [{"name": "a", "data": str(tmp / "a"), "overrides": [f"{key}=1"]}]} if where == "dataset"
               else {"overrides": [f"{key}=1"]})
    where_re = r"datasets\[0\]: overrides" if where == "dataset" else "overrides"
    with pytest.raises(SuiteError, match=f"suite.yaml: {where_re}: {key} is set by the suite; use .*`{use}:`") as e:
        _suite(made, **changes)
    assert "\n" not in str(e.value)


def test_a_single_lr_runs_no_grid_cell(made):  # noqa: F811
    s = _suite(made, lrs=[0.01])
    assert s.grid == {"a": [], "b": []} and selected_lr(s, "a") == 0.01
    ran = []
    run_suite(s, run_cell=lambda suite, cell, parent: (ran.append(cell.name), _complete(suite, cell, 0.5)))
    assert ran == ["a/final_lr0.01", "b/final_lr0.01"]
    assert [(r["phase"], r["minival_top1"]) for r in rows(s)] == [("final", None), ("final", None)]


def test_vtab1k_is_the_papers(tmp_path):
    s = Suite(str(ROOT / "configs/suite/vtab1k.yaml"), [f"init.from={tmp_path}", f"run.dir={tmp_path}/out"])
    assert s.spec.lrs == [0.01] and all(cells == [] for cells in s.grid.values())
    off = {}
    for d in s.spec.datasets:
        cfg = cell_config(s.spec, s.final(d.name, 0.01))
        assert cfg.train.steps == 2500 and cfg.data.train_limit == 1000 and cfg.optim.lr == 0.01
        off[d.name] = (cfg.data.hflip, cfg.data.random_crop)
    no_flip = {"dsprites_loc", "dsprites_ori", "smallnorb_azi"}
    no_crop = {"clevr_count", "clevr_dist", "dmlab", "kitti_dist", "dsprites_loc"}
    assert off == {d: (d not in no_flip, d not in no_crop) for d in off}
    groups = [d.group for d in s.spec.datasets]
    assert (groups.count("natural"), groups.count("specialized"), groups.count("structured")) == (7, 4, 8)


def test_groups_and_repeats_in_the_tables(made):  # noqa: F811
    write, pre, tmp = made
    s = _suite(made, lrs=[0.01], repeats=2,
               datasets=[{"name": "a", "data": str(tmp / "a"), "group": "natural"},
                         {"name": "b", "data": str(tmp / "b"), "group": "structured"}])
    assert [c.run_dir.name for c in s.finals("a", 0.01)] == ["final_lr0.01", "final_lr0.01_seed1"]
    assert [cell_config(s.spec, c).seed for c in s.finals("a", 0.01)] == [0, 1]
    for d, scores in (("a", (0.5, 0.7)), ("b", (0.2, 0.2))):
        for c, v in zip(s.finals(d, 0.01), scores):
            _complete(s, c, v)
    table = rows(s)
    assert [(r["dataset"], r["seed"], r["test_top1"]) for r in table] == [("a", 0, 0.5), ("a", 1, 0.7), ("b", 0, 0.2),
                                                                        ("b", 1, 0.2)]
    _, md = write_tables(s.out, table, "ckpt")
    assert md.read_text().splitlines()[2:] == ["| a | 60.00 ± 10.00 |", "| b | 20.00 ± 0.00 |",
                                               "| *natural* | 60.00 |", "| *structured* | 20.00 |",
                                               "| **mean** | 40.00 |"]
    m = metrics(table)
    assert m["suite/a/test_top1"] == pytest.approx(0.6) and m["suite/a/test_top1_std"] == pytest.approx(0.1)
    assert m["suite/natural/mean_test_top1"] == pytest.approx(0.6) and m["suite/mean_test_top1"] == pytest.approx(0.4)


def test_paper_suite_is_table_4(tmp_path):
    s = Suite(str(ROOT / "configs/suite/paper.yaml"), [f"init.from={tmp_path}", f"run.dir={tmp_path}/out"])
    got = {}
    for d in s.spec.datasets:
        grid = cell_config(s.spec, s.grid[d.name][0])
        final = cell_config(s.spec, s.final(d.name, s.grid[d.name][-1].lr))
        got[d.name] = ([c.lr for c in s.grid[d.name]], grid.data.minival_fraction, grid.train.steps,
                       grid.model.img_size, grid.optim.ema, final.data.minival_fraction)
    paper = [0.001, 0.003, 0.01, 0.03]
    assert got == {"imagenet": ([0.003, 0.01, 0.03, 0.06], 0.01, 20000, 512, 0.9999, 0.0),
                   "cifar10": (paper, 0.02, 10000, 384, None, 0.0), "cifar100": (paper, 0.02, 10000, 384, None, 0.0),
                   "pets": (paper, 0.1, 500, 384, None, 0.0), "flowers": (paper, 0.1, 500, 384, None, 0.0)}


def test_checkpoint_name_is_its_runs(tmp_path):
    from launch.suite_identity import checkpoint_name

    run = tmp_path / "runs" / "pre_l16"
    (run / "checkpoints" / "step-00000004").mkdir(parents=True)
    assert checkpoint_name(str(run)) == "pre_l16"
    (run / "config.yaml").write_text("run: {name: vit_l16_jft}\n")
    assert checkpoint_name(str(run)) == checkpoint_name(str(run / "checkpoints" / "step-00000004")) == "vit_l16_jft"
    (run / "model.safetensors").write_bytes(b"")
    assert checkpoint_name(str(run / "model.safetensors")) == "pre_l16"
    assert checkpoint_name(str(tmp_path / "B_16.npz")) == "B_16"
