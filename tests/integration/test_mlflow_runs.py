"""What a user of MLflow sees of vitp, asserted through the REST API the UI reads, on a real server:
the experiment's kind, dataset inputs and standard source tags on pretrain/transfer/eval runs, system
metrics and no `time` metric, the eval run nested under its parent, a registered model that takes any
batch in a fresh process, and a run stranded by an outage finished later by `vitp sync`.

One tiny chain (real shards -> pretrain -> transfer -> eval, one rank each) feeds the slow tests.
"""

from __future__ import annotations

import getpass
import json
import os
import subprocess
import sys
import urllib.parse
import urllib.request
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from pipeline.data import read_info
from pipeline.tracking.mlflow_store import KIND, KIND_TAG
from pipeline.weights import load_model

pytestmark = pytest.mark.mlflow_server
ROOT = Path(__file__).resolve().parents[2]
CLASSES = ("circle", "cross", "square")


def vitp(*args, env=None, timeout=600):
    e = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", **(env or {}))
    return subprocess.run([sys.executable, "-m", "launch.cli", *args], cwd=ROOT, env=e, capture_output=True,
                          text=True, timeout=timeout)


def rest(uri: str, path: str, body: dict | None = None, **query) -> dict:
    """GET (or POST ``body``) ``/api/2.0/mlflow/<path>``: the JSON the MLflow UI renders."""
    url = f"{uri}/api/2.0/mlflow/{path}" + (f"?{urllib.parse.urlencode(query)}" if query else "")
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def run_of(uri: str, run_id: str) -> dict:
    run = rest(uri, "runs/get", run_id=run_id)["run"]
    run["tags"] = {t["key"]: t["value"] for t in run["data"].get("tags", [])}
    run["metrics"] = {m["key"]: m["value"] for m in run["data"].get("metrics", [])}
    return run


def inputs_of(run: dict) -> dict[str, dict]:
    """{dataset name: {digest, source, profile, context}} of a run's dataset inputs."""
    out = {}
    for di in run.get("inputs", {}).get("dataset_inputs", []):
        ds = di["dataset"]
        out[ds["name"]] = {"digest": ds["digest"], "source_type": ds["source_type"],
                           "source": json.loads(ds["source"]), "profile": json.loads(ds["profile"]),
                           "context": {t["key"]: t["value"] for t in di.get("tags", [])}["mlflow.data.context"]}
    return out


def history(uri: str, run_id: str, key: str) -> list[int]:
    got = rest(uri, "metrics/get-history", run_id=run_id, metric_key=key, max_results=25000)
    return sorted(m["step"] for m in got.get("metrics", []))


def git_head() -> str | None:
    r = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return r.stdout.strip() or None if r.returncode == 0 else None


def write_shapes(root: Path, per_class: int = 16) -> Path:
    """A tiny ImageFolder: one drawn shape per class (+ noise), 24x24 PNGs."""
    rng = np.random.default_rng(0)
    yy, xx = np.mgrid[0:24, 0:24]
    masks = {"circle": (yy - 12) ** 2 + (xx - 12) ** 2 < 49, "cross": (abs(yy - 12) < 2) | (abs(xx - 12) < 2),
             "square": (abs(yy - 12) < 7) & (abs(xx - 12) < 7)}
    for c in CLASSES:
        (root / c).mkdir(parents=True)
        for i in range(per_class):
            img = rng.normal(40, 20, (24, 24, 3)) + 180 * masks[c][..., None]
            Image.fromarray(np.clip(img, 0, 255).astype(np.uint8)).save(root / c / f"{i}.png")
    return root


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    from data_prep import prep

    d = tmp_path_factory.mktemp("shapes")
    prep(write_shapes(d / "images"), d / "shards", val_fraction=0.25, seed=0, max_samples_per_shard=16,
         progress=False)
    return d / "shards"


@pytest.fixture(scope="module")
def chain(shards, mlflow_server, tmp_path_factory):
    """pretrain -> transfer (registered) -> eval --fewshot, into one fresh experiment."""
    d = tmp_path_factory.mktemp("chain")
    exp, name = f"ui-{uuid.uuid4().hex[:10]}", f"vitp-ui-{uuid.uuid4().hex[:8]}"
    common = [f"data.path={shards}", f"tracking.uri={mlflow_server}", f"tracking.experiment={exp}",
              "tracking.system_metrics_every_s=0.5", "checkpoint.every=0", "train.log_every=2"]
    r = vitp("pretrain", "--config", str(ROOT / "configs/pretrain/tiny_cpu.yaml"), f"run.dir={d / 'pre'}",
             "model.img_size=16", "train.steps=6", "train.global_batch=16", "train.micro_batch=16", *common)
    assert r.returncode == 0, r.stderr[-3000:]
    r = vitp("transfer", "--config", str(ROOT / "configs/transfer/tiny_cpu.yaml"), f"run.dir={d / 'ft'}",
             f"init.from={d / 'pre'}", "model.img_size=32", "train.steps=4", "train.global_batch=16",
             "train.micro_batch=16", f"tracking.register_name={name}", *common)
    assert r.returncode == 0, r.stderr[-3000:]
    r = vitp("eval", "--checkpoint", str(d / "ft"), "--data", str(shards), "--split", "val", "--fewshot",
             "--shots", "1,2", "--seeds", "2", "--out", str(d / "eval"))
    assert r.returncode == 0, r.stderr[-3000:]
    exp_doc = rest(mlflow_server, "experiments/get-by-name", experiment_name=exp)["experiment"]
    found = rest(mlflow_server, "runs/search", {"experiment_ids": [exp_doc["experiment_id"]], "max_results": 10})
    runs = [run_of(mlflow_server, f["info"]["run_id"]) for f in found["runs"]]
    return {"dir": d, "experiment": exp_doc, "runs": {run["tags"]["stage"]: run for run in runs}, "model": name,
            "eval_out": r.stdout}


@pytest.mark.slow
def test_experiment_opens_as_model_training_and_runs_carry_sources(chain):
    tags = {t["key"]: t["value"] for t in chain["experiment"]["tags"]}
    assert tags[KIND_TAG] == KIND == "custom_model_development"
    assert set(chain["runs"]) == {"pretrain", "transfer", "eval"}
    for stage, run in chain["runs"].items():
        t = run["tags"]
        assert t["mlflow.source.name"] == f"vitp {stage}"
        assert t["mlflow.user"] == getpass.getuser()
        assert t.get("mlflow.source.git.commit") == git_head()
        assert "git_commit" not in t  # the standard tag replaced it
        assert run["info"]["status"] == "FINISHED"


@pytest.mark.slow
def test_every_stage_logs_its_datasets(chain, shards):
    info = read_info(str(shards))
    plan_id = json.loads((shards / "_info.json").read_text())["plan_id"]
    want = {"training": "train", "evaluation": "val"}
    for stage in ("pretrain", "transfer", "eval"):  # eval fits few-shot on train, scores val
        got = inputs_of(chain["runs"][stage])
        assert {v["context"]: v["profile"]["split"] for v in got.values()} == want, stage
        for name, ds in got.items():
            split = ds["profile"]["split"]
            assert name == f"shards/{split}" and ds["digest"] == plan_id == info.digest
            assert ds["source_type"] == "local" and ds["source"] == {"uri": str(shards.resolve())}
            assert ds["profile"] == {"split": split, "num_samples": info.splits[split].num_samples,
                                     "num_classes": len(CLASSES), "num_shards": len(info.splits[split].urls)}


@pytest.mark.slow
def test_system_metrics_and_no_time_metric(chain):
    for stage, run in chain["runs"].items():
        assert "time" not in run["metrics"], stage
        assert run["metrics"]["system/cpu_utilization_percentage"] >= 0.0, stage
        assert run["metrics"]["system/system_memory_usage_megabytes"] > 0.0, stage
    pre = chain["runs"]["pretrain"]
    assert {"loss", "top1", "lr", "images_per_s", "step_s", "data_wait"} <= set(pre["metrics"])


@pytest.mark.slow
def test_eval_run_is_nested_under_the_evaluated_run(chain, mlflow_server, tmp_path):
    ev, ft, pre = (chain["runs"][s] for s in ("eval", "transfer", "pretrain"))
    assert ev["tags"]["mlflow.parentRunId"] == ft["info"]["run_id"]
    assert ft["tags"]["mlflow.parentRunId"] == pre["info"]["run_id"] and ft["tags"]["vitp.parent_step"] == "6"
    assert ev["info"]["experiment_id"] == ft["info"]["experiment_id"]
    assert f"nested under {ft['info']['run_id']}" in chain["eval_out"]
    results = json.loads((chain["dir"] / "eval" / "results.json").read_text())
    for key in ("val/top1", "val/top5", "val/loss", "fewshot/1shot", "fewshot/2shot"):
        assert ev["metrics"][key] == pytest.approx(results[f"eval/{key}"]), key
    arts = {a["path"] for a in rest(mlflow_server, "artifacts/list", run_id=ev["info"]["run_id"])["files"]}
    assert {"per_class_val.json", "confusion_val.png", "confusion_val.json", "results.json"} <= arts
    assert json.loads(ev["tags"]["mlflow.loggedArtifacts"]) == [{"path": "per_class_val.json", "type": "table"}]
    from mlflow import MlflowClient

    table = json.loads(Path(MlflowClient(mlflow_server).download_artifacts(
        ev["info"]["run_id"], "per_class_val.json", str(tmp_path))).read_text())
    rows = [dict(zip(table["columns"], row)) for row in table["data"]]  # MLflow's table format
    assert [r["name"] for r in rows] == list(CLASSES) and [r["class"] for r in rows] == [0, 1, 2]
    assert sum(r["support"] for r in rows) == ev["metrics"]["val/n"]
    hits = sum(r["accuracy"] * r["support"] for r in rows)
    assert hits == pytest.approx(ev["metrics"]["val/top1"] * ev["metrics"]["val/n"])


FRESH = """
import json, sys
import mlflow, mlflow.pyfunc, mlflow.pytorch, numpy as np, torch
uri, model, xs, out = sys.argv[1:]
mlflow.set_tracking_uri(uri)
x = np.load(xs)
net, py = mlflow.pytorch.load_model(model), mlflow.pyfunc.load_model(model)
res = {"sig": np.array(py.metadata.get_input_schema().inputs[0].shape)}
for n in (1, 4, 64):
    with torch.no_grad():
        res[f"pytorch{n}"] = net(torch.from_numpy(x[:n])).numpy()
    res[f"pyfunc{n}"] = py.predict(x[:n])
np.savez(out, **res)
"""


@pytest.mark.slow
def test_registered_model_serves_any_batch_in_a_fresh_process(chain, mlflow_server, tmp_path):
    from mlflow import MlflowClient

    ft = chain["runs"]["transfer"]
    versions = MlflowClient(mlflow_server).search_model_versions(f"name='{chain['model']}'")
    assert [(v.version, v.run_id) for v in versions] == [("1", ft["info"]["run_id"])]
    x = np.random.default_rng(0).standard_normal((64, 3, 32, 32)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    r = subprocess.run([sys.executable, "-c", FRESH, mlflow_server, f"models:/{chain['model']}/1",
                        str(tmp_path / "x.npy"), str(tmp_path / "out.npz")], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    got = np.load(tmp_path / "out.npz")
    assert got["sig"].tolist() == [-1, 3, 32, 32]
    ours = load_model(chain["dir"] / "ft" / "model.safetensors").eval()
    for n in (1, 4, 64):
        with torch.no_grad():
            want = ours(torch.from_numpy(x[:n])).numpy()
        for flavour in ("pytorch", "pyfunc"):
            assert got[f"{flavour}{n}"].shape == (n, len(CLASSES))
            np.testing.assert_allclose(got[f"{flavour}{n}"], want, atol=1e-5, err_msg=f"{flavour} batch {n}")
