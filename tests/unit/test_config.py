"""Every config mistake fails fast with one line naming the key, exit code 2."""

import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.config import ConfigError, flatten, from_dict, load_config, to_dict, write_resolved

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs/pretrain/tiny_cpu.yaml"
RECIPES = sorted((ROOT / "configs/pretrain").glob("*.yaml")) + sorted((ROOT / "configs/transfer").glob("*.yaml"))


def error_of(overrides, path=TINY, **kw) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(path, overrides, **kw)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_shipped_recipes_validate(recipe):
    cfg = load_config(recipe)
    assert cfg.train.global_batch % (cfg.world_size_planned * cfg.train.micro_batch) == 0


def test_paper_recipes_hold_the_papers_settings():
    for name, lr, dropout in [("vit_b16", 8e-4, 0.0), ("vit_l16", 4e-4, 0.1), ("vit_h14", 3e-4, 0.1)]:
        cfg = load_config(ROOT / f"configs/pretrain/{name}.yaml")
        assert cfg.model.name == name and cfg.optim.lr == pytest.approx(lr)
        assert cfg.model.dropout == dropout and cfg.optim.weight_decay == 0.1
        assert cfg.optim.betas == [0.9, 0.999] and cfg.train.global_batch == 4096
        assert cfg.schedule.warmup_steps == 10000 and cfg.optim.clip_grad == 1.0
        assert cfg.model.representation_size is not None  # the tanh pre-training head


def test_overrides_and_float_parsing():
    cfg = load_config(TINY, ["optim.lr=3e-4", "train.steps=7", "data.path=/x/y", "seed=5", "init.from=a.npz",
                             "tracking.uri=http://127.0.0.1:5000", "run.dir=runs/t"])
    assert cfg.optim.lr == 3e-4 and cfg.train.steps == 7 and cfg.data.path == "/x/y" and cfg.seed == 5
    assert cfg.init.from_ == "a.npz" and cfg.tracking.uri == "http://127.0.0.1:5000"


def test_unknown_key_suggests_closest():
    assert error_of(["optim.lrr=1"]) == "optim.lrr: unknown key (did you mean 'optim.lr'?)"
    assert "trian: unknown key (did you mean 'train'?)" in error_of(["trian.steps=1"])


def test_wrong_type():
    assert error_of(["train.steps=many"]) == "train.steps: expected an integer, got 'many'"
    assert error_of(["model.grad_checkpointing=3"]) == "model.grad_checkpointing: expected true or false, got 3"
    assert "engine.precision: must be one of fp32, bf16, fp16; got 'fp8'" == error_of(["engine.precision=fp8"])


def test_out_of_range():
    assert error_of(["engine.zero_stage=4"]) == "engine.zero_stage: expected 0, 1, 2, 3 or auto, got 4"
    assert error_of(["optim.lr=0"]) == "optim.lr: must be > 0; got 0.0"
    assert error_of(["model.dropout=1.5"]) == "model.dropout: must be <= 1.0; got 1.5"


def test_one_timeout_became_two():
    """Joining and each collective have their own bounds; the old single key names both."""
    cfg = load_config(TINY)
    assert (cfg.engine.rendezvous_timeout_s, cfg.engine.collective_timeout_s) == (300, 1800)
    assert error_of(["engine.dist_timeout_s=600"]) == (
        "engine.dist_timeout_s: replaced by engine.rendezvous_timeout_s (joining the group, default 300) "
        "and engine.collective_timeout_s (each collective, default 1800)")


def test_batch_divisibility():
    msg = error_of(["train.global_batch=30", "train.micro_batch=4"], world_size=2)
    assert msg == "train.global_batch: 30 is not divisible by world size 2 x train.micro_batch 4"
    assert "train.micro_batch: 64 is larger than train.global_batch 32" == error_of(["train.micro_batch=64"])


def test_batch_layout_exact_and_planned():
    """One arithmetic: the run's layout refuses a split that does not divide; the plan's floors it."""
    from pipeline.config.batch import BatchLayout

    cfg = load_config(TINY, ["train.global_batch=32", "train.micro_batch=4"])
    ok = BatchLayout.of(cfg.train, 2)
    assert (ok.accumulation, ok.per_rank) == (4, 16)
    with pytest.raises(ConfigError, match="^train.global_batch: 32 is not divisible by world size 3 x "):
        BatchLayout.of(cfg.train, 3)
    loose = BatchLayout.planned(cfg.train, 3)
    assert (loose.accumulation, loose.per_rank) == (2, 10)  # 32 // 12, 32 // 3
    assert BatchLayout.planned(cfg.train, 16).accumulation == 0  # micro batch 4 > 2 images per rank
    with pytest.raises(ConfigError, match="world size must be >= 1; got 0"):
        BatchLayout.planned(cfg.train, 0)


def test_patch_must_divide_image():
    assert error_of(["model.img_size=30"]) == "model.img_size: 30 is not divisible by the patch size 4"
    msg = error_of(["model.img_size=230"], path=ROOT / "configs/pretrain/vit_b16.yaml")
    assert msg == "model.img_size: 230 is not divisible by the patch size 16"


def test_yaml_python_tags_refused(tmp_path):
    bad = tmp_path / "evil.yaml"
    bad.write_text("seed: 0\nrun: !!python/object/apply:os.system ['touch pwned']\n")
    msg = error_of([], path=bad)
    assert msg.startswith(f"{bad}:2: YAML tag not allowed")
    assert not (tmp_path / "pwned").exists()


def test_missing_file_and_bad_override(tmp_path):
    assert error_of([], path=tmp_path / "nope.yaml") == f"{tmp_path / 'nope.yaml'}: config file not found"
    assert "expected KEY=VALUE" in error_of(["optim.lr"])


def test_round_trip_and_resolved_file(tmp_path):
    cfg = load_config(TINY, ["optim.lr=3e-4"])
    assert from_dict(to_dict(cfg)) == cfg
    path = write_resolved(cfg, tmp_path)
    assert load_config(path) == cfg
    flat = flatten(cfg)
    assert flat["optim.lr"] == 3e-4 and flat["engine.zero_stage"] == 2


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "launch.cli", *args], capture_output=True, text=True, cwd=ROOT)


def test_cli_config_show_and_exit_code_2():
    ok = run_cli("config", "show", "--config", str(TINY), "optim.lr=3e-4")
    assert ok.returncode == 0 and "lr: 0.0003" in ok.stdout
    bad = run_cli("config", "show", "--config", str(TINY), "optim.lrr=3e-4")
    assert bad.returncode == 2
    assert bad.stderr.strip() == "error: optim.lrr: unknown key (did you mean 'optim.lr'?)"


def test_cli_help_everywhere():
    from launch.cli import COMMANDS

    top = run_cli("--help")
    assert top.returncode == 0 and all(name in top.stdout for name in COMMANDS)
    for name in ["config", "pretrain"]:
        h = run_cli(name, "--help")
        assert "example:" in h.stdout, (name, h.stdout, h.stderr)
    assert run_cli("nonsense").returncode == 2


def test_ema_needs_replicated_parameters():
    assert error_of(["optim.ema=0.999", "engine.zero_stage=3"]) == \
        "optim.ema: needs engine.zero_stage <= 2 (ZeRO-3 partitions the parameters)"
    assert load_config(TINY, ["optim.ema=0.999"]).optim.ema == 0.999
