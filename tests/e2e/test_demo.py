"""`make demo`'s job, end to end on this machine: real digits, real stages, real parts.

prep → pretrain (2 local ranks, ZeRO-2, 16 px) → transfer (32 px) → eval on the held-out test split
→ figures, tracked in one local MLflow store; the held-out accuracy target is asserted.
"""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.distributed
def test_demo_end_to_end(tmp_path):
    out = tmp_path / "demo"
    r = subprocess.run([sys.executable, "-m", "launch.cli", "demo", "--out", str(out)], cwd=ROOT,
                       capture_output=True, text=True, timeout=1500)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "mlflow ui --backend-store-uri" in r.stdout

    summary = json.loads((out / "summary.json").read_text())
    rows = {row["stage"]: row for row in summary["stages"]}
    assert list(rows) == ["prep", "pretrain", "transfer", "eval", "figures"]
    assert rows["prep"]["value"] == 1797  # every digit sharded, none rejected
    assert rows["eval"]["metric"] == "test_top1"
    assert rows["eval"]["value"] >= 0.90, summary
    assert summary["fewshot_10shot"] > 0.5
    assert all(row["seconds"] > 0 for row in rows.values())

    # the position embeddings were resampled 4x4 → 8x8 for the higher resolution
    ft = json.loads((out / "transfer" / "results.json").read_text())
    assert ft["posemb_resampled"] == [[4, 4], [8, 8]]
    assert ft["parent_run_id"]

    for stage in ("pretrain", "transfer"):
        names = {p.name for p in (out / "figures" / stage).glob("*.png")}
        assert names == {"patch_filters.png", "posemb_similarity.png", "attention_distance.png",
                         "attention_rollout.png"}
        for name in names:
            with Image.open(out / "figures" / stage / name) as im:
                assert np.asarray(im.convert("L")).std() > 5

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{out / 'mlflow.db'}")
    exp = client.get_experiment_by_name("vitp-demo")
    runs = {r.data.tags.get("stage"): r for r in client.search_runs([exp.experiment_id])}
    assert {"pretrain", "transfer"} <= set(runs)
    pre, tra = runs["pretrain"], runs["transfer"]
    assert tra.data.tags.get("mlflow.parentRunId") == pre.info.run_id
    assert pre.data.params["engine.zero_stage"] == "2" and pre.data.tags.get("world_size") == "2"
    losses = client.get_metric_history(pre.info.run_id, "loss")
    steps = [m.step for m in losses]
    assert len(steps) == len(set(steps)) and max(steps) == 1000
    assert losses[-1].value < losses[0].value
    curve = client.get_metric_history(pre.info.run_id, "fewshot/digits/10shot")  # logged during pre-training
    assert [m.step for m in curve] == [250, 500, 750, 1000] and curve[-1].value > 0.5
    assert list(summary["pretrain_fewshot_10shot"]) == ["250", "500", "750", "1000"]
    versions = client.search_model_versions("name='vitp-demo-digits'")
    assert versions and versions[0].run_id == tra.info.run_id
