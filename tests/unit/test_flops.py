"""Analytic FLOPs agree with torch's FlopCounterMode (multiply-add = 2 FLOPs)."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from pipeline.model import build_vit, train_step_flops, vit_forward_flops


def _counted(model, batch, features=False):
    # on the meta device SDPA takes a path FlopCounterMode sees (the CPU flash kernel it does not)
    x = torch.empty(batch, model.config["in_chans"], *model.img_size, device="meta")
    with FlopCounterMode(display=False) as fc:
        model.forward_features(x) if features else model(x)
    return fc.get_total_flops()


@pytest.mark.parametrize("name, kw", [
    ("vit_ti16", {}), ("vit_s16", {}), ("vit_b32", dict(img_size=384)), ("vit_l16", {}),
    ("vit_b16", dict(img_size=(224, 320), pool="gap", class_token=False)),
    ("vit_r50_b16", {}), (None, dict(width=64, depth=3, heads=4, patch=4, img_size=(32, 48),
                                     num_classes=10, representation_size=48)),
])
def test_forward_flops_match_flop_counter(name, kw):
    with torch.device("meta"):
        m = build_vit(name, **kw)
    for features in (False, True):
        ours, counted = vit_forward_flops(m, batch=2, features=features), _counted(m, 2, features)
        assert abs(ours - counted) / counted < 0.01, features
        assert vit_forward_flops(m.config, batch=2, features=features) == ours


def test_known_value_and_train_step_multipliers():
    # ViT-B/16 at 224 px: the commonly quoted 17.6 G multiply-adds per image
    assert vit_forward_flops("vit_b16", features=True) / 1e9 == pytest.approx(35.1, rel=0.01)
    # the class-token head needs only token 0 out of the last block: 2.4 GFLOPs of it are skipped
    assert vit_forward_flops("vit_b16") / 1e9 == pytest.approx(32.7, rel=0.01)
    f = vit_forward_flops("vit_s16", batch=4)
    assert train_step_flops("vit_s16", batch=4) == 3 * f
    assert train_step_flops("vit_s16", batch=4, grad_checkpointing=True) == 4 * f
    with torch.device("meta"):
        m = build_vit("vit_s16")
    m.set_grad_checkpointing(True)
    assert train_step_flops(m, batch=4) == 4 * f
