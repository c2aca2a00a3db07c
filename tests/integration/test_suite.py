"""`vitp suite` on this machine: configs/suite/tiny.yaml (2 datasets x 2 lrs, 2 steps a cell, one rank
each) from the session's tiny pre-trained checkpoint, into the real MLflow server. A corrupt shard fails
one dataset's grid (recorded, the other dataset finished); the same command, once the shard is back,
runs only what is missing, and a final whose results were lost resumes from its checkpoint to the same
number. The tables, the choice of lr and the parent/nested MLflow runs are checked by value."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import yaml

from launch.suite_identity import checkpoint_name
from tests.integration.test_mlflow_runs import rest, run_of
from tests.unit.test_data_shards import write_dataset

pytestmark = [pytest.mark.mlflow_server, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]


def vitp(*args, timeout=900):
    e = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "launch.cli", *args], cwd=ROOT, env=e, capture_output=True,
                          text=True, timeout=timeout)


def tiny_suite(tmp_path: Path, data: dict[str, Path], test_splits: dict[str, str] | None = None) -> Path:
    """configs/suite/tiny.yaml with its datasets at ``data`` (and their ``test_splits``)."""
    spec = yaml.safe_load((ROOT / "configs/suite/tiny.yaml").read_text())
    for d in spec["datasets"]:
        d["data"] = str(data[d["name"]])
        d["test_split"] = (test_splits or {}).get(d["name"], d.get("test_split", "test"))
    spec["transfer_config"] = str(ROOT / spec["transfer_config"])
    path = tmp_path / "suite.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def table(out: Path) -> dict[tuple[str, str, str], dict]:
    with open(out / "suite.csv", newline="") as f:
        return {(r["dataset"], r["phase"], r["lr"]): r for r in csv.DictReader(f)}


def started(stdout: str) -> list[str]:
    return [ln.split()[1] for ln in stdout.splitlines() if ln.startswith("suite: ") and ln.endswith(" ...")]


def test_suite_fails_one_cell_keeps_the_rest_and_resumes(tiny_reference, corpus_shards, mlflow_server, tmp_path):
    pre = tiny_reference(2)
    b = tmp_path / "shapes_b"
    write_dataset(b, {"train": [15, 15], "test": [9]}, num_classes=2)
    good = (b / "train-000001.tar").read_bytes()
    (b / "train-000001.tar").write_bytes(good[: len(good) // 2])  # cut off: its labels cannot all be read
    spec = tiny_suite(tmp_path, {"shapes_a": corpus_shards, "shapes_b": b}, {"shapes_a": "val"})
    out, exp = tmp_path / "out", f"suite-{uuid.uuid4().hex[:10]}"
    args = ["suite", "--config", str(spec), f"init.from={pre}", f"run.dir={out}", f"tracking.uri={mlflow_server}",
            f"tracking.experiment={exp}"]

    r = vitp(*args)
    assert r.returncode == 1, r.stderr[-3000:]
    assert started(r.stdout) == ["shapes_a/grid_lr0.01", "shapes_a/grid_lr0.03", f"shapes_a/final_lr{_best(out)}",
                                 "shapes_b/grid_lr0.01", "shapes_b/grid_lr0.03"]
    t = table(out)
    for lr in ("0.01", "0.03"):
        row = t[("shapes_b", "grid", lr)]
        assert row["status"] == "failed" and "needs every label" in row["error"] and row["minival_top1"] == ""
    assert t[("shapes_b", "final", "")]["status"] == "skipped"
    assert "suite: 3/6 cells completed" in r.stdout and "run the same command again" in r.stderr

    # grid: scored on minival (3 classes x round(0.2 n_c)), weights dropped; the final keeps its weights
    grid = [t[("shapes_a", "grid", lr)] for lr in ("0.01", "0.03")]
    for row in grid:
        res = json.loads((Path(row["run_dir"]) / "results.json").read_text())
        assert float(row["minival_top1"]) == pytest.approx(res["minival/top1"])
        assert not (Path(row["run_dir"]) / "checkpoints").exists()
    scores = [(float(g["minival_top1"]), float(g["lr"])) for g in grid]
    best = min(scores, key=lambda s: (-s[0], s[1]))[1]
    assert [g["selected"] for g in grid] == ["yes" if float(g["lr"]) == best else "" for g in grid]
    final = t[("shapes_a", "final", f"{best:g}")]
    final_dir = Path(final["run_dir"])
    assert final["status"] == "completed" and (final_dir / "model.safetensors").is_file()
    first_test = json.loads((final_dir / "results.json").read_text())["val/top1"]
    assert float(final["test_top1"]) == pytest.approx(first_test)

    # fixed shard, a lost results.json: the same command runs only what is missing
    (b / "train-000001.tar").write_bytes(good)
    (final_dir / "results.json").unlink()
    r = vitp(*args)
    assert r.returncode == 0, r.stderr[-3000:]
    assert started(r.stdout)[0] == f"shapes_a/{final_dir.name}"
    assert [s for s in started(r.stdout) if s.startswith("shapes_b/")][:2] == ["shapes_b/grid_lr0.01",
                                                                               "shapes_b/grid_lr0.03"]
    assert len(started(r.stdout)) == 4 and "suite: 6/6 cells completed" in r.stdout
    t = table(out)
    assert float(t[("shapes_a", "final", f"{best:g}")]["test_top1"]) == pytest.approx(first_test)  # resumed
    md = (out / "suite.md").read_text().splitlines()
    finals = {row["dataset"]: float(row["test_top1"]) for row in t.values() if row["phase"] == "final"}
    assert md[0] == f"| dataset | {checkpoint_name(str(pre))} |"  # the checkpoint's, not OUT's name
    assert md[-1] == f"| **mean** | {100 * sum(finals.values()) / 2:.2f} |"

    # MLflow: one parent run for the suite, every cell's run nested under it
    exp_id = rest(mlflow_server, "experiments/get-by-name", experiment_name=exp)["experiment"]["experiment_id"]
    runs = [run_of(mlflow_server, x["info"]["run_id"])
            for x in rest(mlflow_server, "runs/search", {"experiment_ids": [exp_id], "max_results": 50})["runs"]]
    (parent,) = [x for x in runs if x["tags"].get("stage") == "suite"]
    cells = [x for x in runs if x["tags"].get("stage") == "transfer"]
    assert {x["tags"]["mlflow.parentRunId"] for x in cells} == {parent["info"]["run_id"]}
    assert len({x["info"]["run_name"] for x in cells}) == 6
    m = parent["metrics"]
    assert m["suite/mean_test_top1"] == pytest.approx(sum(finals.values()) / 2)
    assert m["suite/shapes_b/test_top1"] == pytest.approx(finals["shapes_b"])
    assert parent["tags"]["vitp.checkpoint"] == str(pre) and parent["info"]["status"] == "FINISHED"


def _best(out: Path) -> str:
    t = table(out)
    (row,) = [r for (d, p, _), r in t.items() if d == "shapes_a" and p == "final"]
    return row["lr"]


def _tree(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


def test_another_checkpoint_is_refused_then_rerun_changed_reruns_it(tiny_reference, corpus_shards, mlflow_server,
                                                                    tmp_path):
    """One dataset x 2 lrs from the run dir, then from an earlier checkpoint of the same run (other
    weights): refused in one line with OUT untouched; with --rerun-changed every cell runs again, each
    records the new checkpoint, the final equals `vitp eval` of its run dir, and MLflow has one parent
    run per checkpoint."""
    pre = tiny_reference(2)
    earlier = sorted((pre / "checkpoints").glob("step-*"))[0]
    spec = yaml.safe_load(tiny_suite(tmp_path, {"shapes_a": corpus_shards, "shapes_b": corpus_shards},
                                     {"shapes_a": "val"}).read_text())
    spec["datasets"] = spec["datasets"][:1]
    (tmp_path / "one.yaml").write_text(yaml.safe_dump(spec))
    out, exp = tmp_path / "out", f"suite-{uuid.uuid4().hex[:10]}"
    args = ["suite", "--config", str(tmp_path / "one.yaml"), f"run.dir={out}", f"tracking.uri={mlflow_server}",
            f"tracking.experiment={exp}"]
    r = vitp(*args, f"init.from={pre}")
    assert r.returncode == 0, r.stderr[-3000:]
    before = _tree(out)

    r = vitp(*args, f"init.from={earlier}")
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr[-3000:]
    assert r.stderr == (f"error: {out}: datasets[shapes_a]: grid_lr0.01: init.from differs from what made its "
                        "results; run with --rerun-changed to rerun the changed cells, or give another run.dir\n")
    assert _tree(out) == before and started(r.stdout) == []

    r = vitp(*args, f"init.from={earlier}", "--rerun-changed")
    assert r.returncode == 0, r.stderr[-3000:]
    t = table(out)
    (final,) = [row for row in t.values() if row["phase"] == "final" and row["status"] == "completed"]
    assert started(r.stdout) == ["shapes_a/grid_lr0.01", "shapes_a/grid_lr0.03", f"shapes_a/final_lr{final['lr']}"]
    for row in t.values():
        ident = json.loads((Path(row["run_dir"]) / ".suite_identity.json").read_text())
        assert ident["source"] == str(earlier) or row["status"] == "superseded"
    ev = vitp("eval", "--checkpoint", final["run_dir"], "--data", str(corpus_shards), "--split", "val", "--out",
              str(tmp_path / "eval"))
    assert ev.returncode == 0, ev.stderr[-3000:]
    got = json.loads((tmp_path / "eval" / "results.json").read_text())["eval/val/top1"]
    assert float(final["test_top1"]) == pytest.approx(got, abs=1e-6)
    assert (out / "suite.md").read_text().splitlines()[0] == f"| dataset | {checkpoint_name(str(earlier))} |"

    exp_id = rest(mlflow_server, "experiments/get-by-name", experiment_name=exp)["experiment"]["experiment_id"]
    runs = [run_of(mlflow_server, x["info"]["run_id"])
            for x in rest(mlflow_server, "runs/search", {"experiment_ids": [exp_id], "max_results": 50})["runs"]]
    parents = {x["tags"]["vitp.checkpoint"]: x for x in runs if x["tags"].get("stage") == "suite"}
    assert set(parents) == {str(pre), str(earlier)}
    assert parents[str(earlier)]["metrics"]["suite/shapes_a/test_top1"] == pytest.approx(float(final["test_top1"]))


def test_superseded_final_is_tagged_and_parents_are_per_checkpoint(mlflow_server, tmp_path):
    """No cell trains: a final's MLflow run (made as the transfer stage makes it) whose lr is no longer
    chosen is tagged superseded when the suite publishes; the parent's metrics leave it out; another
    checkpoint into the same OUT gets its own parent run."""
    from launch.suite import Suite, finish_if_done
    from pipeline.tracking.setup import Tracking

    write_dataset(tmp_path / "a", {"train": [10, 10], "test": [6]})
    spec = yaml.safe_load((ROOT / "configs/suite/tiny.yaml").read_text())
    spec.update(transfer_config=str(ROOT / spec["transfer_config"]),
                datasets=[{"name": "a", "data": str(tmp_path / "a")}])
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(spec))
    pre, exp = tmp_path / "pre.safetensors", f"suite-{uuid.uuid4().hex[:10]}"
    pre.write_bytes(b"weights")

    def suite() -> Suite:
        return Suite(str(tmp_path / "s.yaml"), [f"init.from={pre}", f"run.dir={tmp_path / 'out'}",
                                                f"tracking.uri={mlflow_server}", f"tracking.experiment={exp}"])

    s = suite()
    old = s.final("a", 0.03)
    s.prepare(old)
    sink = Tracking(s.base.tracking, old.run_dir, rank=0).mlflow(world_size=1, stage="transfer")
    sink.log({"final/test/top1": 0.5}, 2)
    sink.close(status="FINISHED")
    (old.run_dir / "results.json").write_text(json.dumps({"test/top1": 0.5, "mlflow_run_id": sink.run_id}))
    for c, v in zip(s.grid["a"], (0.9, 0.1)):  # the fixed lr 0.01 cell now wins
        s.prepare(c)
        (c.run_dir / "results.json").write_text(json.dumps({"minival/top1": v}))
    new = s.final("a", 0.01)
    s.prepare(new)
    (new.run_dir / "results.json").write_text(json.dumps({"test/top1": 0.7}))

    table = finish_if_done(suite())
    assert [(r["lr"], r["status"]) for r in table if r["phase"] == "final"] == [(0.01, "completed"),
                                                                               (0.03, "superseded")]
    run = run_of(mlflow_server, sink.run_id)
    assert run["tags"]["vitp.suite_status"] == "superseded" and run["info"]["status"] == "FINISHED"
    state = json.loads((tmp_path / "out" / "suite_state.json").read_text())
    (first,) = state["parents"].values()
    parent = run_of(mlflow_server, first["mlflow_run_id"])
    assert parent["metrics"]["suite/mean_test_top1"] == pytest.approx(0.7)
    assert parent["metrics"]["suite/a/lr"] == 0.01 and parent["tags"]["vitp.checkpoint"] == str(pre)

    pre.write_bytes(b"other weights")  # same path, another checkpoint: another parent run
    finish_if_done(suite())
    parents = json.loads((tmp_path / "out" / "suite_state.json").read_text())["parents"]
    assert len(parents) == 2 and len({p["mlflow_run_id"] for p in parents.values()}) == 2
