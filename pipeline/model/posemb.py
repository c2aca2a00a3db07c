"""Resampling learned position embeddings to a new patch grid (paper section 3.2).

Fine-tuning at a higher resolution keeps the patch size, so the sequence gets longer and the
pre-trained embeddings no longer fit; the paper interpolates them in 2D according to their location
in the original image. Prefix tokens (class token) have no location and are kept as they are.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_LINEAR_MODES = ("linear", "bilinear", "bicubic", "trilinear")


def resample_posemb(posemb: torch.Tensor, old_grid: tuple[int, int], new_grid: tuple[int, int],
                    num_prefix: int = 1, mode: str = "bicubic",
                    antialias: bool = True) -> torch.Tensor:
    """Resample [1, prefix + gh*gw, D] position embeddings from old_grid to new_grid.

    posemb: [1, num_prefix + old_gh * old_gw, D] -> [1, num_prefix + new_gh * new_gw, D].
    Row-major grids (row = image row), as the patch conv + flatten produces them. Interpolation
    uses F.interpolate with align_corners=False and (for bilinear/bicubic) antialias=True when
    shrinking, which is what timm.layers.resample_abs_pos_embed does. Returns `posemb` itself
    (same object, bit-exact) when the grid is unchanged.
    """
    old_grid, new_grid = tuple(int(g) for g in old_grid), tuple(int(g) for g in new_grid)
    if posemb.ndim != 3 or posemb.shape[0] != 1:
        raise ValueError(f"posemb must be [1, tokens, D], got {tuple(posemb.shape)}")
    expected = num_prefix + old_grid[0] * old_grid[1]
    if posemb.shape[1] != expected:
        raise ValueError(f"posemb has {posemb.shape[1]} tokens but old_grid={old_grid} with "
                         f"num_prefix={num_prefix} needs {expected}")
    if old_grid == new_grid:
        return posemb
    prefix, grid = posemb[:, :num_prefix], posemb[:, num_prefix:]
    dim = posemb.shape[-1]
    # [1, gh*gw, D] -> [1, D, gh, gw]: interpolate treats D as channels
    grid = grid.reshape(1, old_grid[0], old_grid[1], dim).permute(0, 3, 1, 2).float()
    kwargs = {}
    if mode in _LINEAR_MODES:
        kwargs["align_corners"] = False
    if mode in ("bilinear", "bicubic"):
        kwargs["antialias"] = antialias
    grid = F.interpolate(grid, size=new_grid, mode=mode, **kwargs)
    grid = grid.permute(0, 2, 3, 1).reshape(1, new_grid[0] * new_grid[1], dim).to(posemb.dtype)
    return torch.cat([prefix, grid], dim=1)
