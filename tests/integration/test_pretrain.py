"""Pre-training on 2 CPU ranks (DeepSpeed over gloo): ZeRO stages, kill/resume exactness, torn saves,
world-size change, MLflow outage. Runs share a few uninterrupted reference runs (module fixtures).

The tiny recipe with a constant lr after warm-up, so a 3-step run equals the first 3 steps of a
6-step run.
"""

import json
import shutil
import uuid
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from launch.local import run_local

pytestmark = pytest.mark.distributed
ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs/pretrain/tiny_cpu.yaml")
COMMON = ["data.path=synthetic:train=512,val=64", "train.log_every=1", "checkpoint.every=2",
          "tracking.enabled=false", "schedule.warmup_steps=2", "schedule.decay=constant", "train.steps=6"]


def pretrain(run_dir, *overrides, nprocs=2, env=None) -> int:
    argv = ["pretrain", "--config", TINY, f"run.dir={run_dir}", *COMMON, *overrides]
    return run_local(argv, nprocs, env=env, timeout=900)


def metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def losses(run_dir) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in metrics(run_dir) if "loss" in r}


def weights(run_dir) -> dict[str, torch.Tensor]:
    return load_file(str(Path(run_dir) / "model.safetensors"))


def assert_same_weights(a, b):
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Uninterrupted 6-step runs, by ZeRO stage (made on first use)."""
    made = {}

    def get(stage: int) -> Path:
        if stage not in made:
            d = tmp_path_factory.mktemp(f"ref_zero{stage}")
            assert pretrain(d, f"engine.zero_stage={stage}") == 0
            made[stage] = d
        return made[stage]

    return get


def test_zero2_trains_and_writes_outputs(reference):
    d = reference(2)
    ls = losses(d)
    assert sorted(ls) == [1, 2, 3, 4, 5, 6]
    assert ls[6] < ls[1] - 0.05  # it learns
    final = [r for r in metrics(d) if "val_top1" in r]
    assert len(final) == 1 and final[0]["val_n"] == 64  # each val sample once over both ranks
    assert (d / "config.yaml").is_file() and (d / "loss_curve.png").is_file()
    assert sorted(p.name for p in (d / "checkpoints").glob("step-*")) == ["step-00000004", "step-00000006"]
    assert (d / "checkpoints/LATEST").read_text().strip() == "step-00000006"
    assert not (d / "checkpoints/latest").exists()  # DeepSpeed's unsafe pointer is not written
    rec = metrics(d)[0]
    for key in ("lr", "grad_norm", "images_per_s", "mfu", "skipped", "rss_gb", "top1"):
        assert key in rec


@pytest.mark.parametrize("stage", [1, 3])
def test_zero_stages_agree(reference, tmp_path, stage):
    if stage == 3:
        run = reference(3)  # the kill/resume test needs this full run anyway
    else:
        run = tmp_path
        assert pretrain(tmp_path, f"engine.zero_stage={stage}", "train.steps=3") == 0
    got, ref = losses(run), losses(reference(2))
    for s in (1, 2, 3):
        assert got[s] == pytest.approx(ref[s], rel=1e-5, abs=1e-6)
    assert got[3] < got[1]
    w, wr = weights(run), weights(reference(2))
    assert w.keys() == wr.keys()  # ZeRO-3 weights are consolidated like the others


@pytest.mark.parametrize("stage", [2, 3, pytest.param(1, marks=pytest.mark.slow)])
def test_kill_and_resume_is_bit_exact(reference, tmp_path, stage):
    ref = reference(stage)
    rc = pretrain(tmp_path, f"engine.zero_stage={stage}", env={"VITP_TEST_KILL_AT_STEP": "5"})
    assert rc != 0
    assert losses(tmp_path).keys() == {1, 2, 3, 4}
    assert pretrain(tmp_path, f"engine.zero_stage={stage}") == 0
    assert [r["step"] for r in metrics(tmp_path) if "loss" in r] == [1, 2, 3, 4, 5, 6]  # none twice
    assert losses(tmp_path) == losses(ref)
    assert_same_weights(tmp_path, ref)


def test_kill_during_save_resumes_from_previous(reference, tmp_path):
    rc = pretrain(tmp_path, "engine.zero_stage=2", env={"VITP_TEST_KILL_DURING_SAVE": "4"})
    assert rc != 0
    ck = tmp_path / "checkpoints"
    assert (ck / "tmp-step-00000004").is_dir() and not (ck / "step-00000004").exists()
    assert (ck / "LATEST").read_text().strip() == "step-00000002"
    assert pretrain(tmp_path, "engine.zero_stage=2") == 0
    assert losses(tmp_path) == losses(reference(2))
    assert_same_weights(tmp_path, reference(2))
    assert not list(ck.glob("tmp-*"))


def test_world_size_change_via_universal_checkpoint(reference, tmp_path, capfd):
    src = reference(2)
    (tmp_path / "checkpoints").mkdir()
    shutil.copytree(src / "checkpoints/step-00000004", tmp_path / "checkpoints/step-00000004")
    shutil.copy(src / "config.yaml", tmp_path / "config.yaml")
    # 2 ranks x 16 → 1 rank x 16 x 2 accumulation steps: the same samples per step
    assert pretrain(tmp_path, "engine.zero_stage=2", nprocs=1) == 0
    out = capfd.readouterr().out
    assert "written by 2 ranks, resuming on 1" in out and "universal" in out
    got, ref = losses(tmp_path), losses(src)
    assert set(got) == {5, 6}
    for s in (5, 6):
        assert got[s] == pytest.approx(ref[s], rel=1e-4)


def test_non_empty_run_dir_needs_fresh(tmp_path, capfd):
    (tmp_path / "notes.txt").write_text("someone else's\n")
    assert pretrain(tmp_path, "train.steps=1", nprocs=1) == 2
    assert "run.fresh=true" in capfd.readouterr().err


@pytest.mark.mlflow_server
def test_mlflow_outage_mid_run_loses_nothing(tmp_path, mlflow_server):
    """The server is stopped while a run trains: the run completes, buffers (and at close spools) the
    metrics it could not send; the next job on the run dir continues the same MLflow run and delivers
    them. Every step's loss is in MLflow exactly once."""
    import threading

    from mlflow import MlflowClient

    from tests.services import mlflow_start, mlflow_stop

    exp = f"outage-{uuid.uuid4().hex[:12]}"  # the server's store outlives test sessions
    common = [f"tracking.uri={mlflow_server}", f"tracking.experiment={exp}", "tracking.enabled=true",
              "tracking.flush_every_s=0.5", "tracking.close_timeout_s=2"]  # job A need not wait for the server
    rc = {}
    job = threading.Thread(target=lambda: rc.setdefault("a", pretrain(tmp_path, *common, "train.steps=8")))
    job.start()
    try:
        while job.is_alive() and len(losses_or_empty(tmp_path)) < 2:  # wait for training to be under way
            job.join(0.2)
        mlflow_stop()
        job.join()
    finally:
        mlflow_start()
    assert rc["a"] == 0
    assert pretrain(tmp_path, *common, "train.steps=9") == 0  # resumes at 8, delivers the backlog
    assert not (tmp_path / "mlflow_spool.jsonl").exists()
    client = MlflowClient(mlflow_server)
    runs = client.search_runs([client.get_experiment_by_name(exp).experiment_id])
    assert len(runs) == 1  # the second job continued the same run
    hist = client.get_metric_history(runs[0].info.run_id, "loss")
    assert sorted(m.step for m in hist) == list(range(1, 10))


def losses_or_empty(run_dir) -> dict:
    try:
        return losses(run_dir)
    except (FileNotFoundError, json.JSONDecodeError):  # not written yet, or a line half-written
        return {}


@pytest.mark.parametrize("stage", [2, 3])
def test_consolidated_weights_and_export(reference, tmp_path, stage):
    """model.safetensors == the fp32 weights joined from the ZeRO files; timm export renames only."""
    from launch.stages import export_main
    from pipeline.model import build_vit, vitp_to_timm
    from pipeline.weights import load_checkpoint_weights

    d = reference(stage)
    from_ckpt, cfg = load_checkpoint_weights(d / "checkpoints/step-00000006")
    final = weights(d)
    assert from_ckpt.keys() == final.keys()
    assert all(torch.equal(from_ckpt[k], final[k]) for k in final)
    build_vit(**cfg).load_state_dict(final)  # the stored model config rebuilds the architecture
    out = tmp_path / "w.safetensors"
    assert export_main([str(d / "checkpoints/step-00000006"), str(out)]) == 0
    exported = load_file(str(out))
    assert all(torch.equal(exported[k], final[k]) for k in final)
    # timm's ViT has no pre-logits layer: the tiny recipe (representation_size=64) is refused clearly
    assert export_main([str(d), "--format", "timm", str(tmp_path / "t.safetensors")]) == 2
    without = {k: v for k, v in final.items() if not k.startswith("pre_logits.")}
    assert vitp_to_timm(without).keys() == without.keys()  # the names timm uses are ours


@pytest.mark.slow
def test_vit_l16_recipe_two_steps_zero3(tmp_path):
    """The shipped ViT-L/16 recipe, shrunk only in batch, steps, data and precision (~10 GB RSS/rank)."""
    argv = ["pretrain", "--config", str(ROOT / "configs/pretrain/vit_l16.yaml"), f"run.dir={tmp_path}",
            "data.path=synthetic:train=64,val=2", "train.global_batch=2", "train.micro_batch=1",
            "train.steps=2", "schedule.warmup_steps=1", "engine.precision=fp32", "engine.zero_stage=3",
            "tracking.enabled=false", "data.val_split=null", "train.log_every=1"]
    assert run_local(argv, 2, timeout=1800) == 0
    ls = losses(tmp_path)
    assert set(ls) == {1, 2} and all(torch.isfinite(torch.tensor(v)) for v in ls.values())


def test_ema_resumes_exactly_and_is_the_exported_model(reference, tmp_path):
    """optim.ema: the average is checkpointed (a killed run resumes it bit-exactly) and becomes
    model.safetensors; the raw weights stay those of the run without EMA."""
    ema = ["optim.ema=0.5", "engine.zero_stage=2"]
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    assert pretrain(whole, *ema) == 0
    assert pretrain(killed, *ema, env={"VITP_TEST_KILL_AT_STEP": "5"}) != 0
    assert pretrain(killed, *ema) == 0
    assert losses(killed) == losses(whole) == losses(reference(2))  # EMA does not touch training
    assert_same_weights(killed, whole)
    raw, avg = weights(reference(2)), weights(whole)
    assert any(not torch.equal(raw[k], avg[k]) for k in raw)
    assert all(torch.isfinite(v).all() for v in avg.values())
