"""Position-embedding resampling: identity, agreement with timm, prefix tokens kept aside."""

import pytest
import torch
from timm.layers import resample_abs_pos_embed

from pipeline.model import resample_posemb


def test_identity_returns_input_unchanged():
    pe = torch.randn(1, 1 + 4 * 6, 8)
    out = resample_posemb(pe, (4, 6), (4, 6))
    assert out is pe


@pytest.mark.parametrize("mode", ["bicubic", "bilinear"])
@pytest.mark.parametrize("old, new, prefix", [
    ((4, 4), (6, 6), 1), ((6, 6), (3, 3), 1), ((4, 6), (8, 5), 1), ((7, 7), (12, 12), 0),
    ((5, 3), (2, 9), 1),
])
def test_matches_timm(mode, old, new, prefix):
    pe = torch.randn(1, prefix + old[0] * old[1], 16)
    ours = resample_posemb(pe, old, new, num_prefix=prefix, mode=mode)
    ref = resample_abs_pos_embed(pe, list(new), list(old), num_prefix_tokens=prefix,
                                 interpolation=mode)
    assert ours.shape == (1, prefix + new[0] * new[1], 16)
    torch.testing.assert_close(ours, ref, atol=1e-6, rtol=0)
    if prefix:
        assert torch.equal(ours[:, :prefix], pe[:, :prefix])


def test_layout_is_row_major():
    # a pos-emb that encodes its own (row, col) must still encode (row, col) after upsampling x2
    gh, gw = 3, 5
    rows, cols = torch.meshgrid(torch.arange(gh).float(), torch.arange(gw).float(), indexing="ij")
    pe = torch.stack([rows, cols], -1).reshape(1, gh * gw, 2)
    out = resample_posemb(pe, (gh, gw), (6, 10), num_prefix=0, mode="bilinear")
    grid = out.reshape(6, 10, 2)
    assert (grid[..., 0][:, 0].diff() >= 0).all() and torch.allclose(grid[0, :, 0], grid[0, 0, 0])
    assert (grid[..., 1][0].diff() >= 0).all() and torch.allclose(grid[:, 0, 1], grid[0, 0, 1])


def test_wrong_token_count_is_a_clear_error():
    with pytest.raises(ValueError, match=r"17 tokens.*\(4, 5\)"):
        resample_posemb(torch.randn(1, 17, 8), (4, 5), (8, 8))
