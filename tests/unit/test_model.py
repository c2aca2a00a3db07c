"""ViT architecture: API, equivalence with timm's VisionTransformer, parameter counts, training."""

import pytest
import timm
import torch

from pipeline.model import VARIANTS, build_vit, reset_head, timm_to_vitp, vitp_to_timm

TINY = dict(width=64, depth=2, heads=4, mlp_dim=128, patch=4, img_size=32, num_classes=10)


def _randomise(model: torch.nn.Module, seed: int = 0) -> None:
    # zero-initialised head/cls would hide mapping errors; give every tensor distinct values
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)


def _timm_twin(cfg: dict, **extra) -> torch.nn.Module:
    return timm.create_model(
        "vit_tiny_patch16_224", pretrained=False, img_size=cfg["img_size"],
        patch_size=cfg["patch"], embed_dim=cfg["width"], depth=cfg["depth"],
        num_heads=cfg["heads"], mlp_ratio=cfg["mlp_dim"] / cfg["width"],
        num_classes=cfg["num_classes"], **extra).eval()


def test_api_shapes_and_attributes():
    m = build_vit(**TINY, pool="token").eval()
    x = torch.randn(3, 3, 32, 32)
    assert m(x).shape == (3, 10)
    assert m.forward_features(x).shape == (3, 1 + 64, 64)
    assert m.patch_grid == (8, 8) and m.num_prefix_tokens == 1 and m.width == 64
    # config rebuilds the same architecture (same state-dict shapes)
    twin = build_vit(**m.config)
    assert {k: v.shape for k, v in twin.state_dict().items()} == {
        k: v.shape for k, v in m.state_dict().items()}


def test_reference_initialisation():
    m = build_vit(**TINY, representation_size=32)
    assert torch.count_nonzero(m.head.weight) == 0 and torch.count_nonzero(m.head.bias) == 0
    assert torch.count_nonzero(m.cls_token) == 0
    assert m.pos_embed.abs().max() <= 0.04 and 0.015 < m.pos_embed.std() < 0.025
    fc1 = m.blocks[0].mlp.fc1
    assert fc1.bias.abs().max() < 1e-5  # N(0, 1e-6)
    bound = (6 / (64 + 64)) ** 0.5  # per-slice xavier for q, k, v (each D x D)
    assert m.blocks[0].attn.qkv.weight.abs().max() <= bound
    assert m.blocks[0].attn.qkv.weight.abs().max() > 0.8 * bound


def test_gap_nonsquare_no_class_token_and_headless():
    m = build_vit(**{**TINY, "img_size": (32, 48)}, pool="gap", class_token=False).eval()
    assert m.patch_grid == (8, 12) and m.num_prefix_tokens == 0
    assert m.forward_features(torch.randn(2, 3, 32, 48)).shape == (2, 96, 64)
    m0 = build_vit(**{**TINY, "num_classes": 0}, representation_size=16).eval()
    out = m0(torch.randn(2, 3, 32, 32))
    assert out.shape == (2, 16) and out.abs().max() <= 1.0  # tanh representation
    assert not any(k.startswith("head.") for k in m0.state_dict())


@pytest.mark.parametrize("bad, match", [
    (dict(pool="token", class_token=False), "class_token"),
    (dict(img_size=30), "divisible"),
    (dict(heads=5), "divisible by heads"),
    (dict(pool="max"), "pool"),
])
def test_bad_configs_name_the_problem(bad, match):
    with pytest.raises(ValueError, match=match):
        build_vit(**{**TINY, **bad})


def test_unknown_variant_and_wrong_input_size():
    with pytest.raises(ValueError, match="vit_x99"):
        build_vit("vit_x99")
    with pytest.raises(ValueError, match="img_size"):
        build_vit(**TINY)(torch.randn(1, 3, 64, 64))


@pytest.mark.parametrize("cfg, timm_extra", [
    (dict(TINY), {}),
    (dict(TINY, img_size=(32, 48)), {}),
    (dict(TINY, pool="gap", class_token=False),
     dict(global_pool="avg", class_token=False, fc_norm=False)),
    (dict(VARIANTS["vit_ti16"], img_size=48, num_classes=7), {}),
    pytest.param(
        dict(VARIANTS["vit_s16"], img_size=(32, 64), num_classes=5, pool="gap", class_token=False),
        dict(global_pool="avg", class_token=False, fc_norm=False), marks=pytest.mark.slow),
])
def test_logits_equal_timm_both_ways(cfg, timm_extra):
    vitp = build_vit(**cfg).eval()
    ref = _timm_twin(vitp.config, **timm_extra)
    x = torch.randn(2, 3, *vitp.img_size)
    # vitp -> timm
    _randomise(vitp, 1)
    ref.load_state_dict(vitp_to_timm(vitp.state_dict()))
    with torch.no_grad():
        torch.testing.assert_close(vitp(x), ref(x), atol=1e-5, rtol=0)
    # timm -> vitp
    _randomise(ref, 2)
    vitp.load_state_dict(timm_to_vitp(ref.state_dict()))
    with torch.no_grad():
        torch.testing.assert_close(vitp(x), ref(x), atol=1e-5, rtol=0)


@pytest.mark.parametrize("name, timm_name, paper_m", [
    ("vit_b16", "vit_base_patch16_224", 86), ("vit_l16", "vit_large_patch16_224", 307),
    ("vit_l32", "vit_large_patch32_224", 307), ("vit_h14", "vit_huge_patch14_224", 632),
])
def test_param_counts_match_paper_and_timm(name, timm_name, paper_m):
    with torch.device("meta"):
        n = sum(p.numel() for p in build_vit(name, num_classes=1000, img_size=224).parameters())
        n_timm = sum(p.numel() for p in timm.create_model(timm_name, pretrained=False, num_classes=1000).parameters())
    assert n == n_timm
    assert abs(n / 1e6 - paper_m) / paper_m < 0.01  # paper Table 1 rounds to millions


def test_other_variants_build_on_meta():
    with torch.device("meta"):
        for name in VARIANTS:
            m = build_vit(name)
            assert m.width == VARIANTS[name]["width"] and len(m.blocks) == VARIANTS[name]["depth"]


def test_hybrid_r50_feature_map_is_the_patch_source():
    with torch.device("meta"):
        m = build_vit("vit_r50_b16", img_size=224)
    assert m.patch_grid == (14, 14) and m.patch_embed.backbone.out_channels == 1024
    small = build_vit(width=32, depth=1, heads=2, patch=1, img_size=(32, 64), num_classes=3,
                      resnet_layers=(1, 1), resnet_width=32).eval()
    assert small.patch_grid == (4, 8)  # stride 8 stem, patch 1
    assert small.forward_features(torch.randn(2, 3, 32, 64)).shape == (2, 33, 32)


def test_grad_checkpointing_same_gradients():
    torch.manual_seed(0)
    m = build_vit(**TINY)
    _randomise(m)
    x, y = torch.randn(4, 3, 32, 32), torch.tensor([1, 2, 3, 4])
    torch.nn.functional.cross_entropy(m(x), y).backward()
    g0 = [p.grad.clone() for p in m.parameters()]
    m.zero_grad()
    m.set_grad_checkpointing(True)
    torch.nn.functional.cross_entropy(m(x), y).backward()
    for a, p in zip(g0, m.parameters()):
        torch.testing.assert_close(a, p.grad, atol=1e-6, rtol=1e-5)


def test_dropout_and_drop_path_only_in_training():
    m = build_vit(**TINY, dropout=0.1, attn_dropout=0.1, drop_path=0.2)
    _randomise(m)
    x = torch.randn(2, 3, 32, 32)
    m.eval()
    with torch.no_grad():
        torch.testing.assert_close(m(x), m(x), atol=0, rtol=0)
        m.train()
        assert not torch.equal(m(x), m(x))
    assert m.blocks[0].drop_path.__class__.__name__ == "Identity"  # rate 0 for the first block
    assert m.blocks[1].drop_path.p == pytest.approx(0.2)


def test_reset_head_zero_init_and_config():
    m = build_vit(**TINY, representation_size=32)
    _randomise(m)
    reset_head(m, 5, keep_representation=False)
    assert m.pre_logits is None and m.head.weight.shape == (5, 64)
    assert torch.count_nonzero(m.head.weight) == 0 and torch.count_nonzero(m.head.bias) == 0
    assert m.config["num_classes"] == 5 and m.config["representation_size"] is None
    assert torch.count_nonzero(m(torch.randn(1, 3, 32, 32))) == 0
    m2 = reset_head(build_vit(**TINY, representation_size=32), 3, keep_representation=True)
    assert m2.pre_logits is not None and m2.head.weight.shape == (3, 32)
    assert {k: v.shape for k, v in build_vit(**m2.config).state_dict().items()} == {
        k: v.shape for k, v in m2.state_dict().items()}


def test_tiny_model_overfits_one_batch():
    torch.manual_seed(0)
    m = build_vit(width=32, depth=2, heads=2, mlp_dim=64, patch=4, img_size=16, num_classes=4)
    x, y = torch.randn(8, 3, 16, 16), torch.arange(8) % 4
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3, weight_decay=0.0)
    losses = []
    for _ in range(60):
        loss = torch.nn.functional.cross_entropy(m(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.1 * losses[0]


@pytest.mark.parametrize("ckpt", [False, True])
def test_class_token_logits_skip_the_last_blocks_other_tokens(ckpt):
    """model(x) computes only token 0 through the last block; logits and every gradient equal the
    full computation (forward_features over all tokens, then the head)."""
    torch.manual_seed(0)
    m = build_vit(width=64, depth=3, heads=4, mlp_dim=128, patch=4, img_size=16, num_classes=5,
                  representation_size=32)
    torch.nn.init.normal_(m.head.weight)  # the zero-initialised head would make any logits equal
    m.set_grad_checkpointing(ckpt)
    x = torch.randn(4, 3, 16, 16)
    fast = m(x)
    fast.square().sum().backward()
    g_fast = {n: p.grad.clone() for n, p in m.named_parameters()}
    m.zero_grad()
    full = m.forward_head(m.forward_features(x))
    full.square().sum().backward()
    assert fast.shape == (4, 5) and torch.allclose(fast, full, atol=1e-6)
    for n, p in m.named_parameters():
        err = (g_fast[n] - p.grad).abs().max()  # float rounding: ~5e-7 of the largest entry
        assert err <= 1e-5 * p.grad.abs().max() + 1e-7, (n, err)
    assert m.forward_features(x, first_token_only=True).shape == (4, 1, 64)


def test_key_bias_gets_only_round_off_and_changes_nothing():
    """Softmax ignores a constant added to every key's score, and a key bias adds q.b_k to all of a
    query's scores: the key third of qkv.bias has zero true gradient and no effect on any output. Kept
    anyway (timm and big_vision carry it; their checkpoints load and export unchanged); the ZeRO
    stage test compares it by effect (tests/integration/test_pretrain.py::key_bias)."""
    import torch.nn.functional as F

    torch.manual_seed(0)
    m = build_vit(width=64, depth=4, heads=4, mlp_dim=128, patch=4, img_size=32, num_classes=10,
                  representation_size=64)
    with torch.no_grad():
        m.head.weight.normal_(0, 0.02)  # the zero-initialised head would give every block a zero gradient
    x, y = torch.randn(16, 3, 32, 32), torch.randint(0, 10, (16,))
    F.cross_entropy(m(x), y).backward()
    for blk in m.blocks:
        q, k, v = blk.attn.qkv.bias.grad.abs().chunk(3)
        assert k.max() < 1e-6 * min(q.max(), v.max()), (k.max(), q.max(), v.max())  # round-off only
    m.eval()
    with torch.no_grad():
        before = m(x)
        for blk in m.blocks:
            blk.attn.qkv.bias[64:128] += torch.randn(64)  # any key bias at all
        torch.testing.assert_close(m(x), before, rtol=1e-5, atol=1e-6)
