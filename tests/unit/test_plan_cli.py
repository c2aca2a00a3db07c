"""`vitp plan`: step time, cost, sweep table, JSON and one-line errors."""

from __future__ import annotations

import json

import pytest

from launch.cli import run_command
from launch.stages import plan_main
from pipeline.plan import cost as P
from pipeline.plan.planned import load_planned

CFG = "configs/pretrain/{}.yaml"


@pytest.fixture(autouse=True)
def _root(repo_root, monkeypatch):
    monkeypatch.chdir(repo_root)
    monkeypatch.delenv("WORLD_SIZE", raising=False)


def _plan(name, *overrides, **kw):
    return P.plan(load_planned(CFG.format(name), list(overrides)), **kw)


def test_step_time_follows_flops_mfu_and_link():
    from pipeline.model.flops import train_step_flops

    p = _plan("vit_b16", "cluster.nodes=1", "train.global_batch=512", "hardware.assumed_mfu=0.5")
    t = p["time"]
    shape, _ = P.model_shape(load_planned(CFG.format("vit_b16"), []))
    assert t["flops_per_rank"] == train_step_flops(shape.config, batch=64, grad_checkpointing=False)
    assert t["compute_s"] == pytest.approx(t["flops_per_rank"] / (989e12 * 0.5))
    assert t["link"] == "intra-node" and t["link_gbps"] == 450
    n, P_ = 8, p["model"]["params"]  # ZeRO-2: fp32 all-reduce of the gradient buckets, bf16 parameter gather
    assert t["comm_bytes"] == pytest.approx((n - 1) / n * (2 * 4 + 2) * P_)
    # the buckets' all-reduce hides behind backward (2/3 of the compute), the gather after the step does not
    assert t["comm"]["overlaps"] == "backward" and t["comm"]["exposed"] == pytest.approx((n - 1) / n * 2 * P_)
    assert t["exposed_comm_s"] == pytest.approx(t["comm"]["exposed"] / 450e9)
    assert t["step_s"] == pytest.approx(t["compute_s"] + t["exposed_comm_s"])
    ck = _plan("vit_b16", "cluster.nodes=1", "train.global_batch=512", "model.grad_checkpointing=true")
    assert ck["time"]["flops_per_rank"] == pytest.approx(t["flops_per_rank"] * 4 / 3)
    multi = _plan("vit_b16", "cluster.nodes=2", "train.global_batch=512", "train.micro_batch=32")
    # across nodes a ring's bytes leave each node once per NIC rail: 8 x 50 GB/s, below NVLink's 450
    assert multi["time"]["link"] == "inter-node" and multi["time"]["link_gbps"] == 400
    one_nic = _plan("vit_b16", "cluster.nodes=2", "train.global_batch=512", "train.micro_batch=32",
                    "hardware.nics_per_node=1")
    assert one_nic["time"]["link_gbps"] == 50
    assert one_nic["time"]["comm_s"] == pytest.approx(8 * multi["time"]["comm_s"])


def test_comm_bytes_per_stage_for_vit_l_on_16_nodes_of_8_gpus_by_hand():
    """What each rank of ViT-L/16 (323,099,507 parameters) on 16 x 8 GPUs sends per optimizer step, as
    deepspeed 0.19.8 sends it with vitp's settings (fp32 gradients, bf16 parameters, ring: 127/128):
    ZeRO-2 all-reduces its buckets (use_multi_rank_bucket_allreduce), it does not reduce-scatter."""
    GB, ring = 1e9, 127 / 128
    z = {s: _plan("vit_l16", "cluster.nodes=16", f"engine.zero_stage={s}", "train.micro_batch=32")["time"]
         for s in (0, 1, 2, 3)}
    assert z[0]["comm_bytes"] / GB == pytest.approx(2.5646, abs=1e-4)  # fp32 all-reduce: 2 x 4 B x P x ring
    assert z[1]["comm_bytes"] / GB == pytest.approx(3.2058, abs=1e-4)  # + bf16 all-gather: (8 + 2) B x P x ring
    assert z[2]["comm_bytes"] / GB == pytest.approx(3.2058, abs=1e-4)  # the same bytes, the reduction in backward
    assert z[3]["comm_bytes"] / GB == pytest.approx(2.5646, abs=1e-4)  # fp32 reduce-scatter + 2 bf16 gathers
    assert z[2]["comm"]["grad_reduce"] / GB == pytest.approx(2 * 4 * 323_099_507 * ring / GB)
    assert [z[s]["comm"]["reduce_op"] for s in range(4)] == ["all-reduce"] * 3 + ["reduce-scatter"]
    acc = _plan("vit_l16", "cluster.nodes=16", "engine.zero_stage=2", "train.micro_batch=8")["time"]
    assert acc["accumulation"] == 4 and acc["comm_bytes"] / GB == pytest.approx(10.8996, abs=1e-4)  # (4 x 8 + 2) B
    # 400 GB/s over the rails: ZeRO-1's 3.21 GB are 8.0 ms after backward; ZeRO-2 hides its 6.4 ms of
    # all-reduce behind 15.4 ms of backward and waits only for the gather (1.6 ms)
    assert z[1]["exposed_comm_s"] == pytest.approx(3.2058e9 / 400e9, rel=1e-4)
    assert z[2]["exposed_comm_s"] == pytest.approx(0.6411e9 / 400e9, rel=1e-3)
    assert z[2]["step_s"] < z[1]["step_s"]


def test_comm_bytes_reduce_gradients_in_fp32_and_gather_parameters_in_bf16():
    """Hand-computed bytes per rank per step of bf16 ViT-L on 128 ranks, ring collectives moving
    (n-1)/n of a buffer: gradients travel in fp32 (the engine's communication_data_type, 4 bytes per
    parameter), parameter all-gathers in bf16 (2 bytes)."""
    from pipeline.config.sections import REDUCE_DTYPE
    from pipeline.train.engine import deepspeed_config

    cfg = load_planned(CFG.format("vit_l16"), [])
    assert deepspeed_config(cfg, 128)["communication_data_type"] == REDUCE_DTYPE == "fp32"
    z = {s: _plan("vit_l16", f"engine.zero_stage={s}", "train.micro_batch=32")["time"] for s in (0, 1, 2, 3)}
    P_, ring = 323_099_507, 127 / 128
    assert _plan("vit_l16")["model"]["params"] == P_
    assert z[0]["comm_bytes"] == pytest.approx(ring * 2 * 4 * P_)  # fp32 all-reduce
    assert z[1]["comm_bytes"] == pytest.approx(ring * (2 * 4 + 2) * P_)  # fp32 all-reduce + bf16 gather
    assert z[2]["comm_bytes"] == pytest.approx(ring * (2 * 4 + 2) * P_)  # fp32 bucket all-reduces + bf16 gather
    assert z[3]["comm_bytes"] == pytest.approx(ring * (4 + 2 * 2) * P_)  # reduce-scatter + gathers in fwd and bwd
    z1_fp32 = _plan("vit_l16", "engine.zero_stage=1", "train.micro_batch=32", "engine.precision=fp32")["time"]
    assert z1_fp32["comm_bytes"] == pytest.approx(ring * (2 * 4 + 4) * P_)  # bucket all-reduces + all-gather
    # with accumulation, stage 2 reduces every micro step and gathers once; stage 3 does all every micro step
    acc = {s: _plan("vit_l16", f"engine.zero_stage={s}", "train.micro_batch=8")["time"] for s in (2, 3)}
    assert acc[2]["accumulation"] == 4 and acc[2]["comm_bytes"] == pytest.approx(ring * (4 * 2 * 4 + 2) * P_)
    assert acc[3]["comm_bytes"] == pytest.approx(4 * z[3]["comm_bytes"])


def test_cost_and_paper_units():
    p = _plan("vit_h14", "model.num_classes=18291", "model.grad_checkpointing=true")
    c, th = p["cost"], p["throughput"]
    assert c["paper_tpuv3_core_days"] == 2500
    # model FLOPs: checkpointing activations costs time, not model work
    assert p["setup"]["grad_checkpointing"] and c["total_flops"] == pytest.approx(
        p["time"]["model_flops_per_step"] * 1_025_000) == pytest.approx(p["time"]["flops_per_step"] * 1_025_000 * 3 / 4)
    assert c["tpuv3_core_days"] == pytest.approx(c["total_flops"] / (61.5e12 * 0.5) / 86400)
    assert c["gpu_hours"] == pytest.approx(c["total_s"] * 256 / 3600)
    assert th["dataset_size"] == 300_000_000 and th["epochs"] == pytest.approx(1_025_000 * 4096 / 3e8)
    assert th["epoch_s"] == pytest.approx(3e8 / th["images_per_s"])
    assert _plan("vit_b16")["cost"]["paper_tpuv3_core_days"] is None


def test_dataset_size_and_classes_from_info_json(tmp_path):
    (tmp_path / "_info.json").write_text(json.dumps({"num_classes": 10, "splits": {"train": {"num_samples": 1234}}}))
    p = _plan("tiny_cpu", f"data.path={tmp_path}", backend="cpu")
    assert p["throughput"]["dataset_size"] == 1234
    assert p["model"]["classes"].startswith("10 classes")


def test_max_micro_batch_is_the_largest_that_fits():
    cfg = load_planned(CFG.format("vit_l16"), ["hardware.device_mem_gb=40"])
    p = P.plan(cfg)
    mb = p["verdict"]["max_micro_batch"]
    assert mb > 32
    at = P.plan(load_planned(CFG.format("vit_l16"), ["hardware.device_mem_gb=40", "train.global_batch=4096"]),
                shape=None)
    assert at["verdict"]["fits"]
    from pipeline.plan.memory import GiB, memory_per_rank

    shape, _ = P.model_shape(cfg)
    kw = dict(precision="bf16", zero_stage=2, world_size=128, dropout=True, accumulation=1)
    assert memory_per_rank(shape, micro_batch=mb, **kw)["total"] <= 40 * GiB
    assert memory_per_rank(shape, micro_batch=mb + 1, **kw)["total"] > 40 * GiB


def test_cli_report_has_sections_verdict_and_sweep(capsys):
    rc = plan_main(["--config", CFG.format("vit_l16"), "hardware.device_mem_gb=6",
                 "--sweep", "zero=1,3", "micro_batch=16,32", "ckpt=on,off"])
    out = capsys.readouterr().out
    assert rc == 0
    for section in ("== model", "== memory per GPU", "== verdict", "== step time", "== cost", "== comparison"):
        assert section in out
    assert "largest micro batch that fits" in out and "680 TPUv3-core-days" in out
    table = out.split("== sweep")[1].strip().splitlines()[1:]
    assert len(table) == 1 + 8  # header + 2 x 2 x 2 rows
    assert any(" NO " in r for r in table) and any(" yes " in r for r in table)


def test_cli_report_shows_what_a_save_holds_training_and_its_share(capsys):
    """`vitp plan` prints the checkpoint section from the plan's own numbers: the blocking time of an
    async save and its share of the run at the minutes cadence, the inline share beside it, and the
    host snapshot in the memory table; checkpoint.async=false says the save holds training for its write."""
    args = ["--config", CFG.format("vit_b16"), "checkpoint.every_minutes=10", "hardware.storage_write_gbps=0.1"]
    assert plan_main(args) == 0
    out = capsys.readouterr().out
    ck = _plan("vit_b16", "checkpoint.every_minutes=10", "hardware.storage_write_gbps=0.1")["checkpoint"]
    assert ck["interval_s"] == 600 and ck["write_s"] == pytest.approx(ck["bytes"] / 1e8)
    section = out.split("== checkpoints (checkpoint.*)\n")[1].split("\n\n")[0].splitlines()
    assert section == [
        f"   {ck['bytes'] / 1e9:.2f} GB per checkpoint, written in {P._dur(ck['write_s'])} "  # noqa: SLF001
        "(hardware.storage_write_gbps)",
        f"   async: each save holds training {P._dur(ck['blocking_s'])} (the largest rank's "  # noqa: SLF001
        f"{ck['snapshot_bytes'] / 1e9:.2f} GB copied to host memory, hardware.host_copy_gbps); the write goes on "
        "in the background",
        f"   one save every 10.0 min: {ck['share']:.2%} of the run; inline saves would cost {ck['inline_share']:.2%}"]
    assert ck["share"] < ck["inline_share"] and f"{ck['inline_share']:.2%}" != "0.00%"
    assert any(r.startswith("   checkpoint snapshot (async)") and r.endswith(f"{ck['snapshot_bytes'] / 2**30:.2f}")
               for r in out.splitlines())
    assert plan_main([*args, "checkpoint.async=false"]) == 0
    inline = capsys.readouterr().out
    assert f"   inline: each save holds training {P._dur(ck['write_s'])}\n" in inline  # noqa: SLF001
    assert f"one save every 10.0 min: {ck['inline_share']:.2%} of the run\n" in inline


def test_cli_sweep_nodes_and_offload_mark_invalid_rows(capsys):
    rc = plan_main(["--config", CFG.format("vit_b16"), "--sweep", "nodes=1,3", "offload=on,off"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "invalid: train.global_batch: 4096 is not divisible by world size 24" in out


def test_step_time_and_memory_at_min_nodes():
    """A job that may be requeued on cluster.min_nodes nodes: the plan says what such an attempt's step
    costs (the same global batch on half the ranks: twice the compute per rank) and whether it fits."""
    base = ["cluster.nodes=2", "engine.zero_stage=3"]
    full = _plan("vit_l16", *base)
    assert full["fewest_nodes"] is None
    p = _plan("vit_l16", *base, "cluster.min_nodes=1")
    f, one = p["fewest_nodes"], _plan("vit_l16", "cluster.nodes=1", "engine.zero_stage=3")
    assert p["time"] == full["time"] and p["memory"] == full["memory"]  # the plan itself is cluster.nodes'
    assert (f["nodes"], f["world_size"], f["accumulation"]) == (1, 8, 2 * p["setup"]["accumulation"])
    assert f["step_s"] == pytest.approx(one["time"]["step_s"]) and f["step_s"] > 1.9 * p["time"]["step_s"]
    assert f["memory_total"] == one["memory"]["total"] > p["memory"]["total"]  # ZeRO-3 over 8 ranks, not 16
    gib = (p["memory"]["total"] + f["memory_total"]) / 2 / P.GiB  # between the two: fits at 2 nodes only
    tight = _plan("vit_l16", *base, "cluster.min_nodes=1", f"hardware.device_mem_gb={gib}")
    assert tight["verdict"]["fits"] and not tight["fewest_nodes"]["fits"]
    line = next(x for x in P.format_report(tight).splitlines() if "cluster.min_nodes" in x)
    assert line.startswith("   at cluster.min_nodes=1 (8 ranks, accumulation ") and "DOES NOT FIT" in line


def test_cli_json(capsys):
    assert plan_main(["--config", CFG.format("tiny_cpu"), "--backend", "cpu", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["setup"]["world_size"] == 2 and d["verdict"]["fits"] is True
    assert d["memory"]["total"] > d["memory"]["model_states"] > 0


@pytest.mark.parametrize("overrides,msg", [
    (["cluster.nodes=0"], "cluster.nodes: must be >= 1; got 0"),
    (["train.micro_batch=128", "train.global_batch=64"], "train.micro_batch: 128 is larger than train.global_batch"),
    (["--sweep", "bogus=1"], "--sweep 'bogus=1'"),
    (["--dataset-size", "0"], "--dataset-size: must be >= 1"),
])
def test_cli_impossible_inputs_one_line_exit_2(capsys, overrides, msg):
    rc = run_command(plan_main, ["--config", CFG.format("tiny_cpu"), *overrides])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.count("\n") == 1 and msg in err


def test_vitp_entry_point_dispatches_plan(capsys):
    from launch.cli import main

    assert main(["plan", "--config", CFG.format("tiny_cpu"), "--backend", "cpu"]) == 0
    assert "FITS" in capsys.readouterr().out
