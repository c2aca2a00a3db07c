"""pipeline.data.mixing: mixup/cutmix/label smoothing as the training step applies them, outside the loader.

Images whose pixels are their row index make every blend readable: a mixup row is a constant
``lam·i + (1-lam)·(B-1-i)``, a cutmix row holds exactly two values, a ``lam`` share of its own."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeline.data.mixing import Mixer

B, K = 4, 4
Y = torch.tensor([0, 1, 2, 3])


def rows(size: int = 8) -> torch.Tensor:
    """[B, 3, size, size] float; every pixel of row i is i."""
    return torch.arange(B, dtype=torch.float32).view(B, 1, 1, 1).expand(B, 3, size, size).clone()


def smooth(y: torch.Tensor, s: float) -> torch.Tensor:
    return torch.nn.functional.one_hot(y, K).float() * (1 - s) + s / K


def image_lam(x: torch.Tensor) -> tuple[str, float]:
    """("cutmix" | "mixup", the share of row 0 that is row 0's own image)."""
    r = x[0, 0]
    if bool(((r == 0) | (r == B - 1)).all()):
        return "cutmix", float((r == 0).float().mean())
    return "mixup", 1 - float(r.mean()) / (B - 1)


# lam per (epoch, micro-batch) for seed 3, rank 1, mixup 0.8, cutmix 1.0: the values the loader's own
# mixer gave before mixing left it, so the same run mixes the same after the move
GOLDEN = {(0, 0): ("cutmix", 0.625), (0, 1): ("cutmix", 0.9375), (1, 0): ("cutmix", 0.4375),
          (2, 5): ("mixup", 0.135193)}


@pytest.mark.parametrize("position", list(GOLDEN))
def test_mix_proportions_as_before(position):
    mixer = Mixer(K, mixup=0.8, cutmix=1.0, label_smoothing=0.1, seed=3, rank=1)
    x, t = mixer(rows(), Y, position)
    kind, lam = GOLDEN[position]
    got_kind, got_lam = image_lam(x)
    assert got_kind == kind and got_lam == pytest.approx(lam, abs=1e-5)
    # targets carry the image's proportions: row i is lam of its own label and 1-lam of its mirror's
    s = smooth(Y, 0.1)
    assert t.dtype == torch.float32 and t.shape == (B, K)
    assert torch.allclose(t, lam * s + (1 - lam) * s.flip(0), atol=1e-5)
    assert torch.allclose(t.sum(1), torch.ones(B))


def test_mixup_and_cutmix_shares_over_many_batches():
    """timm's switch: half the batches cutmix, half mixup; mixup's lam ~ Beta(0.8, 0.8) (mean 0.5,
    variance 1/(4(2a+1)) = 0.096); cutmix's lam is its box's area."""
    mixer = Mixer(K, mixup=0.8, cutmix=1.0, seed=0, rank=0)
    seen = {"cutmix": [], "mixup": []}
    for step in range(400):
        x, t = mixer(rows(16), Y, (0, step))
        kind, lam = image_lam(x)
        assert float(t[0, 0]) == pytest.approx(lam, abs=1e-5)  # the target says what the image holds
        seen[kind].append(lam)
    assert 0.4 < len(seen["cutmix"]) / 400 < 0.6
    mix = torch.tensor(seen["mixup"])
    assert abs(float(mix.mean()) - 0.5) < 0.05 and abs(float(mix.var()) - 0.096) < 0.03


def test_same_position_same_mix_and_ranks_differ():
    a = Mixer(K, mixup=0.8, cutmix=1.0, seed=5, rank=0)
    b = Mixer(K, mixup=0.8, cutmix=1.0, seed=5, rank=1)
    x1, t1 = a(rows(), Y, (3, 7))
    x2, t2 = a(rows(), Y, (3, 7))
    assert torch.equal(x1, x2) and torch.equal(t1, t2)
    mixed = [m(rows(), Y, (3, s))[0][0] for m in (a, b) for s in range(4)]
    assert all(not torch.equal(u, v) for i, u in enumerate(mixed) for v in mixed[i + 1:])  # per rank and batch
    state = torch.random.get_rng_state()
    np.random.seed(1)
    before = np.random.random()
    np.random.seed(1)
    a(rows(), Y, (0, 0))
    assert np.random.random() == before  # the global numpy generator is left as it was
    assert torch.equal(torch.random.get_rng_state(), state)


def test_smoothing_only_and_nothing_to_do():
    x = rows()
    xs, t = Mixer(K, label_smoothing=0.2)(x, Y, (0, 0))
    assert xs is x and torch.allclose(t, smooth(Y, 0.2))
    plain = Mixer(K)
    assert not plain.active and plain(x, Y, (0, 0)) == (x, Y)  # the loss takes the labels themselves
    with pytest.raises(ValueError, match="even micro batch; got 3"):
        Mixer(K, mixup=1.0)(rows()[:3], Y[:3], (0, 0))


def test_from_config_reads_the_data_section():
    from pipeline.config import DataCfg
    from pipeline.data.synthetic import read_info
    from pipeline.train.build import mixer_for

    m = mixer_for(DataCfg(path="synthetic:classes=6", mixup=0.5, label_smoothing=0.3),
                  read_info("synthetic:classes=6"), seed=2, rank=1)
    assert (m.num_classes, m.mixing, m.smoothing, m.seed, m.rank, m.multi_label) == (6, True, 0.3, 2, 1, False)
