"""One few-shot number: what a run's few-shot evaluator logs at its last step equals what `vitp eval
--fewshot` of its run dir reports, for the same data, shots, seeds and l2.

A 2-rank pre-training (DeepSpeed ZeRO-2 over gloo, synthetic data, 3 steps, EMA on) evaluates a
`vitp prep` set of colour blobs (4 classes, labels shuffled so that every feature counts; train
and test splits) at its end; `vitp eval` then scores
the exported weights (the EMA's) on that set in one process. The two must agree to 1e-6 for every
shot count, mean and std over seeds: the same subsets, solver and weights.

The same run declares an evaluator of a type added from one module (tests/custom_evaluator.py, by
its `package.module:Class` path): it logs at every step, and `vitp eval --evals FILE` runs the
same class on the exported weights, with a declared few-shot entry that gives the flags' numbers.
"""

import json
from pathlib import Path

import pytest

from data_prep import prep
from launch.local import run_local
from launch.stages import eval_main
from tests.multilabel_data import blobs_manifest

pytestmark = pytest.mark.distributed
ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs/pretrain/tiny_cpu.yaml")
DATA = "synthetic:classes=4,train=64,val=8"
CUSTOM = {"name": "custom", "type": "tests.custom_evaluator:MeanLogit", "split": "val", "every": 1, "scale": 2.0}


def test_in_run_fewshot_equals_vitp_eval_of_the_run(tmp_path):
    few = tmp_path / "blobs/shards"
    prep(blobs_manifest(tmp_path / "blobs", 8, 6, shuffle=True), few, split_column="split", max_samples_per_shard=10,
         progress=False)
    run = tmp_path / "run"
    argv = ["pretrain", "--config", TINY, f"run.dir={run}", f"data.path={DATA}",
            "model.img_size=16", "model.depth=1", "model.width=32", "model.mlp_dim=64", "model.heads=2",
            "model.representation_size=32", "train.steps=3", "train.log_every=3", "checkpoint.every=3",
            "schedule.warmup_steps=1", "optim.lr=3e-3", "optim.ema=0.5", "data.workers=0", "tracking.enabled=false",
            f"eval.fewshot_data=[blobs={few}]", "eval.fewshot_shots=[1,3,7,8]", "eval.fewshot_seeds=3",
            "eval.fewshot_l2=0.5", "train.fewshot_every=0", f"evals=[{json.dumps(CUSTOM)}]"]
    assert run_local(argv, 2, env={"MLFLOW_TRACKING_URI": ""}, timeout=600) == 0
    logged = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in logged if "fewshot/seconds" in r]
    assert [r["step"] for r in last] == [3]
    mean_logit = {r["step"]: r["custom/mean_logit"] for r in logged if "custom/mean_logit" in r}
    assert sorted(mean_logit) == [1, 2, 3]  # every: 1, before the checkpoint
    assert eval_main(["--checkpoint", str(run), "--data", str(few), "--split", "test", "--fewshot", "--shots",
                      "1,3,7,8", "--seeds", "3", "--l2", "0.5", "--no-top1", "--out", str(tmp_path / "eval")]) == 0
    res = json.loads((tmp_path / "eval/results.json").read_text())
    for k in (1, 3, 7):
        for key in (f"{k}shot", f"{k}shot_std"):
            assert res[f"eval/fewshot/{key}"] == pytest.approx(last[0][f"fewshot/blobs/{key}"], abs=1e-6), key
    assert "eval/fewshot/8shot" not in res and "fewshot/blobs/8shot" not in last[0]  # class yellow has 7: skipped

    # the same classes from a declared list: the custom type on the run's data, few-shot on the blobs
    listed = tmp_path / "evals.yaml"
    listed.write_text(json.dumps({"evals": [{**CUSTOM, "every": 0}, {
        "name": "blobs", "type": "fewshot", "data": str(few), "train_split": "train", "test_split": "test",
        "shots": [1, 3, 7, 8], "seeds": 3, "l2": 0.5}]}))
    assert eval_main(["--checkpoint", str(run), "--data", DATA, "--evals", str(listed),
                      "--out", str(tmp_path / "listed")]) == 0
    got = json.loads((tmp_path / "listed/results.json").read_text())
    assert got["eval/custom/mean_logit"] == pytest.approx(mean_logit[3], rel=1e-6, abs=1e-9)
    for k in (1, 3, 7):
        assert got[f"eval/fewshot/blobs/{k}shot"] == res[f"eval/fewshot/{k}shot"]
