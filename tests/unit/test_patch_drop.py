"""Patch dropping (model.patch_drop, train.patch_drop_until): which patches a training image keeps,
what the blocks see, that evaluation sees every patch, the FLOPs counted, the config and the plan."""

import math

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from pipeline.config import ConfigError, DataCfg, load_config
from pipeline.eval.evaluators import Context, prelogits
from pipeline.eval.loop import classify
from pipeline.eval.task import Task
from pipeline.model import build_vit, draw_keep, kept_patches, train_step_flops, vit_forward_flops
from pipeline.train.patchdrop import PatchDrop

TINY = dict(width=32, depth=2, heads=4, mlp_dim=64, patch=4, img_size=16, num_classes=5)  # N = 16 patches


def _cfg(drop=0.5, until=None, seed=0):
    return dict(drop=drop, until=until, seed=seed)


def _block_inputs(model, fn):
    """The tokens entering the first block during ``fn()``: a list of [B, T, D] tensors."""
    seen = []
    h = model.blocks[0].register_forward_pre_hook(lambda mod, args: seen.append(args[0].detach().clone()))
    try:
        fn()
    finally:
        h.remove()
    return seen


# --------------------------------------------------------------------------------------------------
# Which patches
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n, drop, kept", [(196, 0.5, 98), (196, 0.75, 49), (16, 0.5, 8), (16, 0.3, 11),
                                           (10, 0.7, 3), (100, 0.9, 10), (4, 0.99, 1)])
def test_kept_count_matches_timm_rounding(n, drop, kept):
    assert kept_patches(n, drop) == kept == max(1, round(n * (1 - drop) - 0.5 + 1e-9))


def test_kept_positions_per_image_seeded_and_distinct():
    model = build_vit(**TINY)
    pd = PatchDrop(model, **_cfg(0.5), rank=0, device=torch.device("cpu"))
    k = pd.keep(step=3, micro=0, batch=6)
    assert k.shape == (6, 8) and k.dtype == torch.int64
    for row in k:  # a subset of the 16 patches, no repeats, ascending
        assert row.unique().numel() == 8 and row.min() >= 0 and row.max() < 16
        assert torch.equal(row, row.sort().values)
    assert len({tuple(r.tolist()) for r in k}) == 6  # every image its own draw
    assert torch.equal(k, pd.keep(3, 0, 6))  # the same (seed, rank, step, micro): the same draw (resume)
    again = PatchDrop(build_vit(**TINY), **_cfg(0.5), rank=0, device=torch.device("cpu"))
    assert torch.equal(k, again.keep(3, 0, 6))  # a fresh process draws it too: nothing to checkpoint
    for other in (pd.keep(4, 0, 6), pd.keep(3, 1, 6),
                  PatchDrop(model, **_cfg(0.5), rank=1, device=torch.device("cpu")).keep(3, 0, 6),
                  PatchDrop(model, **_cfg(0.5, seed=1), rank=0, device=torch.device("cpu")).keep(3, 0, 6)):
        assert not torch.equal(k, other)  # another step, micro batch, rank or seed: another draw
    # over many draws every patch is kept about half the time (uniform)
    freq = torch.bincount(torch.cat([pd.keep(s, 0, 8).flatten() for s in range(200)]), minlength=16) / 1600
    assert freq.min() > 0.42 and freq.max() < 0.58


def test_draw_does_not_touch_the_global_rng():
    pd = PatchDrop(build_vit(**TINY), **_cfg(0.5), rank=0, device=torch.device("cpu"))
    torch.manual_seed(5)
    before = torch.get_rng_state()
    pd.keep(0, 0, 4)
    assert torch.equal(before, torch.get_rng_state())  # dropout / drop-path streams are unchanged


def test_until_switches_to_every_patch():
    pd = PatchDrop(build_vit(**TINY), **_cfg(0.5, until=3), rank=0, device=torch.device("cpu"))
    assert [pd.active(s) for s in range(5)] == [True, True, True, False, False]  # steps 1-3 drop
    assert pd.keep(2, 0, 2) is not None and pd.keep(3, 0, 2) is None
    off = PatchDrop(object(), **_cfg(0.0), rank=0, device=torch.device("cpu"))  # off: any model, no grid read
    assert off.keep(0, 0, 2) is None and not off.active(0)
    assert "8 of 16 patches until step 3" in pd.describe()


# --------------------------------------------------------------------------------------------------
# What the blocks see
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kw", [dict(pool="token"), dict(pool="gap"), dict(pool="gap", class_token=False)])
def test_class_token_and_kept_position_embeddings_unchanged(kw):
    torch.manual_seed(0)
    model = build_vit(**TINY, **kw).train()
    x = torch.randn(3, 3, 16, 16)
    keep = draw_keep(3, 16, 0.5, torch.Generator().manual_seed(1))
    (full,) = _block_inputs(model, lambda: model(x))
    (dropped,) = _block_inputs(model, lambda: model(x, keep=keep))
    p = model.num_prefix_tokens
    assert full.shape == (3, p + 16, 32) and dropped.shape == (3, p + 8, 32)
    assert torch.equal(dropped[:, :p], full[:, :p])  # the class token (with its pos-emb) always kept
    want = torch.stack([full[b, p + keep[b]] for b in range(3)])  # each patch with its own position
    assert torch.equal(dropped[:, p:], want)
    logits = model(x, keep=keep)
    assert logits.shape == (3, 5) and torch.isfinite(logits).all()


def test_gradients_flow_with_checkpointing_and_mixed_inputs():
    """Activation checkpointing recomputes on the kept tokens: the same gradients as without it."""
    torch.manual_seed(0)
    a, b = build_vit(**TINY).train(), build_vit(**TINY).train()
    b.load_state_dict(a.state_dict())
    b.set_grad_checkpointing(True)
    # a head that is not constant: a constant one sends the same gradient to every feature, which the
    # final LayerNorm cancels exactly, leaving the body's gradients to rounding noise
    head = 0.01 * torch.randn(a.head.weight.shape, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        for m in (a, b):
            m.head.weight.copy_(head)
    lam = 0.7  # a mixup-style blend of two batches and soft targets: dropping comes after it
    x = lam * torch.randn(4, 3, 16, 16) + (1 - lam) * torch.randn(4, 3, 16, 16)
    keep = draw_keep(4, 16, 0.5, torch.Generator().manual_seed(2))
    for m in (a, b):
        m(x, keep=keep).logsumexp(-1).sum().backward()
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(pa.grad, pb.grad, rtol=1e-5, atol=1e-7, msg=name)
    assert a.pos_embed.grad[0, 1:].abs().sum(-1).eq(0).sum() < 16  # kept positions got gradient


def test_bad_keep_shape_is_one_line():
    model = build_vit(**TINY)
    with pytest.raises(ValueError, match=r"keep: expected \[batch=2, K\]"):
        model(torch.randn(2, 3, 16, 16), keep=torch.zeros(3, 8, dtype=torch.long))


def test_eval_paths_see_every_patch_and_match_patch_drop_zero():
    """classify (val, `vitp eval`, transfer's final eval) and prelogits (few-shot, the probe) call the
    model without ``keep``: every block input has all tokens and the logits are a model's at patch_drop=0."""
    torch.manual_seed(0)
    model = build_vit(**TINY).train()
    with torch.no_grad():
        model.head.weight.normal_()
    # one training step with dropping, as the loop runs it
    model(torch.randn(4, 3, 16, 16), keep=draw_keep(4, 16, 0.5, torch.Generator().manual_seed(0))).sum().backward()
    images, labels = torch.randn(6, 3, 16, 16), torch.arange(6) % 5
    batches = [(images[:3], labels[:3]), (images[3:], labels[3:])]
    ctx = Context(DataCfg(), Task(False), img_size=16, batch=3, device=torch.device("cpu"), rank=0, world=1)
    valid = [(x, y, torch.ones(len(y), dtype=torch.bool)) for x, y in batches]
    seen = _block_inputs(model, lambda: classify(model, batches, 5))
    seen += _block_inputs(model, lambda: prelogits(model, valid, ctx, lambda t: t))
    assert len(seen) == 4 and all(s.shape[1] == 17 for s in seen)
    res = classify(model, batches, 5)
    model.eval()
    with torch.no_grad():
        want = torch.nn.functional.cross_entropy(model(images), labels, reduction="sum").item() / 6
    assert res.loss == pytest.approx(want, rel=1e-6)
    assert "patch_drop" not in model.config  # exported weights carry no trace of it


# --------------------------------------------------------------------------------------------------
# FLOPs
# --------------------------------------------------------------------------------------------------
def test_flops_against_a_hand_count():
    """TINY at patch_drop 0.5: 16 patches of 4x4x3, 8 kept + the class token = 9 tokens, D 32, MLP 64."""
    D, M, N, T, P, K = 32, 64, 16, 9, 4 * 4 * 3, 5
    embed = 2 * N * P * D  # every patch is embedded: dropping comes after the patch embedding
    block = 2 * T * (3 * D * D + D * D + 2 * D * M) + 2 * 2 * T * T * D  # qkv, proj, MLP; QK^T and AV
    # token 0 only past attention (class-token head): one qkv GEMM over all T tokens, token 0's query sliced
    last = 2 * T * 3 * D * D + 2 * (D * D + 2 * D * M) + 2 * 2 * T * D
    head = 2 * D * K
    hand = embed + block + last + head
    assert hand == 273_984
    assert vit_forward_flops(TINY, patch_drop=0.5) == hand
    assert vit_forward_flops(TINY, batch=3, patch_drop=0.5) == 3 * hand
    assert train_step_flops(TINY, batch=2, patch_drop=0.5, grad_checkpointing=False) == 6 * hand
    full_T = 17
    full = (embed + 2 * full_T * (3 * D * D + D * D + 2 * D * M) + 4 * full_T * full_T * D
            + 2 * full_T * 3 * D * D + 2 * (D * D + 2 * D * M) + 4 * full_T * D + head)
    assert vit_forward_flops(TINY) == full and vit_forward_flops(TINY, patch_drop=0.0) == full


@pytest.mark.parametrize("kw", [dict(pool="token"), dict(pool="gap")])
def test_flops_match_what_runs(kw):
    """FlopCounterMode over the real forward with ``keep`` (math attention, which it can see)."""
    model = build_vit(**{**TINY, "img_size": 32}, **kw)  # 64 patches
    for drop in (0.25, 0.5, 0.75):
        keep = draw_keep(2, 64, drop, torch.Generator().manual_seed(0))
        with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as fc:
            model(torch.randn(2, 3, 32, 32), keep=keep)
        counted, ours = fc.get_total_flops(), vit_forward_flops(model, batch=2, patch_drop=drop)
        assert abs(ours - counted) / counted < 0.01, drop


# --------------------------------------------------------------------------------------------------
# Config and plan
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("override, msg", [
    ("model.patch_drop=1.0", r"^model\.patch_drop: a fraction of patches in \[0, 1\)"),
    ("model.patch_drop=-0.1", r"^model\.patch_drop: must be >= 0"),
    ("model.patch_drop=half", r"^model\.patch_drop: expected a number"),
    ("train.patch_drop_until=-1", r"^train\.patch_drop_until: must be >= 0"),
    ("train.patch_drop_until=0.5", r"^train\.patch_drop_until: expected"),
])
def test_config_errors_name_the_key(override, msg):
    with pytest.raises(ConfigError, match=msg) as e:
        load_config("configs/pretrain/tiny_cpu.yaml", [override])
    assert "\n" not in str(e.value)


def test_config_defaults_off_and_accepts_values():
    cfg = load_config("configs/pretrain/tiny_cpu.yaml")
    assert cfg.model.patch_drop == 0.0 and cfg.train.patch_drop_until is None
    cfg = load_config("configs/pretrain/tiny_cpu.yaml", ["model.patch_drop=0.5", "train.patch_drop_until=95"])
    assert (cfg.model.patch_drop, cfg.train.patch_drop_until) == (0.5, 95)


def test_transfer_refuses_patch_drop():
    from pipeline.transfer import transfer

    cfg = load_config("configs/transfer/tiny_cpu.yaml", ["model.patch_drop=0.5"])
    with pytest.raises(ConfigError, match=r"^model\.patch_drop: 0\.5 is for pre-training"):
        transfer(cfg)


def test_plan_counts_both_phases_and_shows_the_saving():
    from pipeline.plan.cost import format_report, plan, step_time

    over = ["cluster.nodes=1", "train.steps=1000"]
    base = plan(load_config("configs/pretrain/vit_l16.yaml", over, world_size=8))
    cfg = load_config("configs/pretrain/vit_l16.yaml", over + ["model.patch_drop=0.5", "train.patch_drop_until=950"],
                      world_size=8)
    p = plan(cfg)
    per_rank = 4096 // 8
    shape = _shape(cfg)
    dropped = train_step_flops(shape.config, batch=per_rank, patch_drop=0.5, grad_checkpointing=False)
    assert p["time"]["model_flops_per_rank"] == dropped
    assert p["time"]["model_flops_per_rank"] < 0.55 * base["time"]["model_flops_per_rank"]
    full_step = step_time(cfg, shape, patch_drop=0.0)
    assert p["patch_drop"]["full_step_s"] == full_step["step_s"] == base["time"]["step_s"]
    want_s = 950 * p["time"]["step_s"] + 50 * base["time"]["step_s"]
    assert p["cost"]["total_s"] == pytest.approx(want_s, rel=1e-12)
    want_flops = 950 * p["time"]["model_flops_per_step"] + 50 * base["time"]["model_flops_per_step"]
    assert p["cost"]["total_flops"] == pytest.approx(want_flops, rel=1e-12)
    assert p["cost"]["tpuv3_core_days"] < 0.6 * base["cost"]["tpuv3_core_days"]
    assert p["patch_drop"]["time_saving"] == pytest.approx(1 - want_s / base["cost"]["total_s"])
    text = format_report(p)
    assert "patch drop 0.5 (98 of 196 patches) for steps 1-950 of 1,000" in text
    assert f"{p['patch_drop']['time_saving']:.0%} less time" in text
    assert "patch drop" not in format_report(base)


def _shape(cfg):
    from pipeline.plan.cost import model_shape

    return model_shape(cfg)[0]


def test_plan_sweep_over_patch_drop():
    from pipeline.plan.cost import format_sweep, parse_sweep
    from pipeline.plan.planned import sweep

    rows = sweep("configs/pretrain/vit_l16.yaml", ["cluster.nodes=1"], parse_sweep(["patch_drop=0,0.5,1.0"]))
    assert [r["set"]["model.patch_drop"] for r in rows] == ["0", "0.5", "1.0"]
    assert rows[1]["gpu_hours"] < 0.6 * rows[0]["gpu_hours"]
    assert rows[2]["invalid"].startswith("model.patch_drop:")
    assert math.isclose(rows[1]["step_s"] / rows[0]["step_s"], rows[1]["gpu_hours"] / rows[0]["gpu_hours"])
    assert "patch_drop" in format_sweep(rows).splitlines()[0]


@pytest.mark.slow
def test_train_compile_with_patch_drop_and_the_switch_to_every_patch():
    """Compiled blocks (train.compile, real inductor on the CPU) on the kept tokens, then on every patch
    (after train.patch_drop_until): the same logits and gradients as eager."""
    from pipeline.train.engine import compile_blocks

    torch.manual_seed(0)
    eager, compiled = build_vit(**TINY).train(), build_vit(**TINY).train()
    with torch.no_grad():
        eager.head.weight.normal_()  # zero-initialised: gradients would not reach the blocks
    compiled.load_state_dict(eager.state_dict())
    assert compile_blocks(compiled, load_config("configs/pretrain/tiny_cpu.yaml", ["train.compile=true"])) == 2
    x = torch.randn(3, 3, 16, 16)
    for keep in (draw_keep(3, 16, 0.5, torch.Generator().manual_seed(0)),
                 draw_keep(3, 16, 0.5, torch.Generator().manual_seed(1)), None):
        a, b = eager(x, keep=keep), compiled(x, keep=keep)
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)
        a.logsumexp(-1).sum().backward()
        b.logsumexp(-1).sum().backward()
        grad = eager.blocks[0].mlp.fc1.weight.grad
        assert grad.abs().max() > 0
        torch.testing.assert_close(compiled.blocks[0].mlp.fc1.weight.grad, grad, rtol=1e-4, atol=1e-5)
