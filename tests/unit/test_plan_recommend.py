"""`vitp plan`'s ZeRO recommendation: per model and cluster, with its reason, and the recipes follow it."""

from __future__ import annotations

import json

import pytest

from launch.stages import plan_main
from pipeline.plan import cost as P
from pipeline.plan.planned import load_planned
from pipeline.plan.recommend import recommend

RESOURCES = "configs/cluster/h100_8x.yaml"


@pytest.fixture(autouse=True)
def _root(repo_root, monkeypatch):
    monkeypatch.chdir(repo_root)
    monkeypatch.delenv("WORLD_SIZE", raising=False)


def _rec(name, *overrides):
    cfg = load_planned(f"configs/pretrain/{name}.yaml", list(overrides), RESOURCES)
    return cfg, recommend(cfg, P.model_shape(cfg)[0])


@pytest.mark.parametrize("name", ["vit_b16", "vit_l16", "vit_h14"])
def test_recipes_train_with_the_stage_the_plan_recommends(name):
    """Fails when a recipe (or the plan) drifts: its ZeRO stage and activation checkpointing are the
    plan's choice for its own node count on the H100 resources file. (tiny_cpu is a 2-rank CPU recipe
    for tests: the GPU memory and link numbers do not apply to it.)"""
    cfg, rec = _rec(name)
    assert (cfg.engine.zero_stage, cfg.model.grad_checkpointing) == (rec["stage"], rec["checkpointing"]), rec["reason"]


@pytest.mark.parametrize("name,gpus,stage_bytes", [("vit_l16", 128, 3.21), ("vit_h14", 256, 6.53)])
def test_cli_prints_the_recommendation_and_why(capsys, name, gpus, stage_bytes):
    rc = plan_main(["--config", f"configs/pretrain/{name}.yaml", "--resources", RESOURCES])
    out = capsys.readouterr().out
    assert rc == 0
    section = out.split("== ZeRO stage for this model and cluster")[1]
    lines = section.strip().splitlines()
    assert len(lines) == 1 + 1 + 6 + 1  # title rest, header, 3 stages x ckpt on/off, the recommendation
    chosen = [ln for ln in lines if ln.endswith("<-")]
    assert len(chosen) == 1 and chosen[0].split()[:2] == ["ZeRO-2", "off"]
    rec = lines[-1]
    assert rec.startswith("   recommended: ZeRO-2 without activation checkpointing: every stage fits without it; "
                          "ZeRO-3 only where ZeRO-1/2 do not fit")
    assert f"it sends {stage_bytes:.2f} GB per rank per step" in rec and "(ZeRO-1 " in rec
    assert f"on {gpus} GPUs of 80 GB" in rec and "accumulation 1" in rec and "compute-bound" in rec


def test_recommendation_depends_on_the_cluster():
    """The NIC rails decide between ZeRO-1 and -2 once the model accumulates: on 2 nodes ViT-L accumulates
    8 micro batches; ZeRO-2 all-reduces its fp32 buckets in every micro step's backward, ZeRO-1
    (BF16_Optimizer) once after it. With 8 rails (400 GB/s) backward hides ZeRO-2's 20 GB; over one NIC
    (50 GB/s) it cannot, and ZeRO-1's 3 GB win."""
    _, big = _rec("vit_l16")
    _, rails = _rec("vit_l16", "cluster.nodes=2")
    _, one_nic = _rec("vit_l16", "cluster.nodes=2", "hardware.nics_per_node=1")
    assert big["stage"] == 2 and rails["stage"] == 2 and one_nic["stage"] == 1 and not one_nic["checkpointing"]
    z = {r["stage"]: r for r in one_nic["options"] if not r["checkpointing"]}
    assert z[1]["accumulation"] == 8
    # in bf16 parameter bytes Gw (gradients reduce in fp32, 2 Gw): ZeRO-1 2x2 + 1, ZeRO-2 8x2x2 + 1, ZeRO-3 8x(2 + 2)
    assert z[2]["comm_bytes"] == pytest.approx(z[1]["comm_bytes"] * (8 * 2 * 2 + 1) / 5)
    assert z[3]["comm_bytes"] == pytest.approx(z[1]["comm_bytes"] * 8 * 4 / 5)
    assert z[2]["step_s"] > z[1]["step_s"] and "ZeRO-1 without" in one_nic["reason"]


def test_zero3_only_where_zero1_and_2_do_not_fit():
    """ZeRO-3's step may be the shortest on paper (all its traffic overlaps compute), but vitp compiles no
    blocks and keeps no EMA under it: it is chosen only when ZeRO-1/2 do not fit."""
    _, rec = _rec("vit_l16")
    z = {r["stage"]: r for r in rec["options"] if not r["checkpointing"]}
    assert z[3]["step_s"] < z[2]["step_s"] and rec["stage"] == 2
    # a 15B ViT (width 5120, depth 48) on 24 GB GPUs: its whole bf16 weights alone outgrow ZeRO-1/2
    _, tight = _rec("vit_h14", "model.width=5120", "model.mlp_dim=20480", "model.heads=40", "model.depth=48",
                    "train.micro_batch=1", "hardware.device_mem_gb=24")
    fits = {r["stage"]: r["fits"] for r in tight["options"] if not r["checkpointing"]}
    assert fits == {1: False, 2: False, 3: True} and tight["stage"] == 3 and not tight["checkpointing"]


def test_checkpointing_only_when_nothing_fits_without_it():
    # ViT-H at micro batch 128 per GPU (1 node, accumulation 4) on a 24 GB device: activations need it
    _, rec = _rec("vit_h14", "cluster.nodes=1", "train.micro_batch=128", "hardware.device_mem_gb=24")
    assert rec["checkpointing"] is True and rec["stage"] in (1, 2, 3)
    assert not any(r["fits"] for r in rec["options"] if not r["checkpointing"])
    assert "with activation checkpointing: no stage fits without it" in rec["reason"]
    _, none = _rec("vit_h14", "cluster.nodes=1", "hardware.device_mem_gb=2")
    assert none["stage"] is None and "lower train.micro_batch" in none["reason"]


def test_json_carries_the_recommendation(capsys):
    assert plan_main(["--config", "configs/pretrain/vit_l16.yaml", "--resources", RESOURCES, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["recommendation"]["stage"] == 2 and len(doc["recommendation"]["options"]) == 6


def test_zero_stage_auto_takes_the_plans_choice_at_submission_and_says_it(capsys):
    from launch.submit import load_submit_config
    from pipeline.config import ConfigError, load_config

    cfg = load_submit_config("configs/pretrain/vit_l16.yaml", ["engine.zero_stage=auto"], RESOURCES)
    assert cfg.engine.zero_stage == 2
    out = capsys.readouterr().out
    assert out.startswith("engine.zero_stage: auto -> 2 (vitp plan: ZeRO-2 without activation checkpointing")
    assert len(out.splitlines()) == 1
    # the plan of "auto" is the plan of the stage it takes; over one NIC ViT-L on 2 nodes takes ZeRO-1
    auto = ["engine.zero_stage=auto", "cluster.nodes=2", "hardware.nics_per_node=1"]
    assert load_planned("configs/pretrain/vit_l16.yaml", auto, RESOURCES).engine.zero_stage == 1
    # a given stage stays as it is, silently
    given = load_submit_config("configs/pretrain/vit_l16.yaml", ["engine.zero_stage=1"], RESOURCES)
    assert given.engine.zero_stage == 1
    assert capsys.readouterr().out == ""
    with pytest.raises(ConfigError, match=r"engine\.zero_stage: expected 0, 1, 2, 3 or auto, got 4"):
        load_config("configs/pretrain/vit_l16.yaml", ["engine.zero_stage=4"])
    with pytest.raises(ConfigError, match="engine.zero_stage: auto: no ZeRO stage fits on 128 GPUs of 2 GB"):
        load_submit_config("configs/pretrain/vit_l16.yaml", ["engine.zero_stage=auto", "hardware.device_mem_gb=2"],
                           RESOURCES)


def test_zero_stage_auto_reaching_the_stage_is_chosen_there(capsys):
    """Started without `vitp submit` (run_local, torchrun), the stage itself takes the plan's choice."""
    from pipeline.config import load_config
    from pipeline.pretrain import stage_chosen

    cfg = stage_chosen(load_config("configs/pretrain/tiny_cpu.yaml", ["engine.zero_stage=auto"]))
    assert cfg.engine.zero_stage in (1, 2) and capsys.readouterr().out.startswith(
        f"engine.zero_stage: auto -> {cfg.engine.zero_stage} (vitp plan: ")
