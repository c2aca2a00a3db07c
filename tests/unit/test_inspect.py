"""The paper's figures: the numbers behind them, and PNGs that are really drawn."""

import numpy as np
import torch
from PIL import Image

from pipeline.eval.figures import (
    attention_probs,
    attention_rollout,
    mean_attention_distance,
    patch_filter_components,
    posemb_similarity,
    write_figures,
)
from pipeline.model import build_vit


def tiny(**kw):
    torch.manual_seed(0)
    return build_vit(width=32, depth=3, heads=4, mlp_dim=64, patch=4, img_size=(16, 24), num_classes=5, **kw)


def test_attention_probs_match_the_models_own_forward():
    model = tiny().eval()
    x = torch.randn(2, 3, 16, 24)
    probs = attention_probs(model, x)
    assert len(probs) == 3 and probs[0].shape == (2, 4, 1 + 4 * 6, 1 + 4 * 6)
    torch.testing.assert_close(probs[1].sum(-1), torch.ones(2, 4, 25))
    # recomputed attention reproduces the block output computed by SDPA
    blk = model.blocks[0]
    t = torch.cat([model.cls_token.expand(2, -1, -1), model.patch_embed(x)], 1) + model.pos_embed
    a = blk.attn
    _, _, v = a.qkv(blk.norm1(t)).view(2, 25, 3, 4, 8).permute(2, 0, 3, 1, 4)
    manual = a.proj((probs[0] @ v).transpose(1, 2).reshape(2, 25, 32))
    torch.testing.assert_close(manual, a(blk.norm1(t)), atol=1e-5, rtol=1e-5)


def test_mean_distance_of_uniform_and_self_attention():
    model = tiny()
    n = 1 + 24
    uniform = [torch.full((1, 4, n, n), 1.0 / n)]
    d = mean_attention_distance(model, uniform)
    ys, xs = np.meshgrid(np.arange(4), np.arange(6), indexing="ij")
    pos = np.stack([ys.ravel(), xs.ravel()], 1) * 4.0
    expect = np.linalg.norm(pos[:, None] - pos[None], axis=-1).mean()
    np.testing.assert_allclose(d, np.full((1, 4), expect), rtol=1e-5)
    eye = [torch.eye(n).expand(1, 4, n, n)]
    np.testing.assert_allclose(mean_attention_distance(model, eye), 0.0, atol=1e-6)


def test_rollout_of_identity_attention_is_flat_and_weights_figures_shapes():
    model = tiny()
    n = 25
    rolled = attention_rollout(model, [torch.eye(n).expand(1, 4, n, n)] * 3)
    assert rolled.shape == (1, 4, 6)
    assert np.allclose(rolled, 0.0)  # the class token attends only to itself
    sim = posemb_similarity(model)
    assert sim.shape == (4, 6, 4, 6)
    np.testing.assert_allclose(np.einsum("ijij->ij", sim), 1.0, rtol=1e-5)
    comps = patch_filter_components(model)
    assert comps.shape == (28, 4, 4, 3) and comps.min() >= 0 and comps.max() <= 1


def test_write_figures_draws_every_panel(tmp_path):
    model = tiny()
    images = torch.randint(0, 255, (3, 3, 16, 24), dtype=torch.uint8)
    paths = write_figures(model, tmp_path, images)
    names = sorted(p.name for p in paths)
    assert names == ["attention_distance.png", "attention_rollout.png", "patch_filters.png",
                     "posemb_similarity.png"]
    for p in paths:
        with Image.open(p) as im:
            assert im.size[0] > 200 and im.size[1] > 150
            assert np.asarray(im.convert("L")).std() > 5  # not a blank canvas
