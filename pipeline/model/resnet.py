"""ResNet stem for the hybrid ViT (paper section 3.1, "Hybrid Architecture").

The hybrid feeds the transformer with a CNN feature map instead of raw pixels: the paper uses a
ResNet-50 whose stage 4 is removed and stage 3 holds 9 units (so features come out at stride 16),
with the BiT changes: GroupNorm instead of BatchNorm and weight-standardised convolutions. The
bottleneck unit here is the post-activation one of the official hybrid code (relu after the sum,
last GroupNorm scale zero-initialised so each unit starts as the identity on its residual path).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class StdConv2d(nn.Conv2d):
    """Conv2d whose kernel is standardised per output channel before use (BiT).

    w: [O, I, kh, kw] -> (w - mean) / (std + eps), mean/std over (I, kh, kw), population std.
    """

    def __init__(self, *args, eps: float = 1e-5, **kwargs):
        super().__init__(*args, **kwargs)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        mean = w.mean(dim=(1, 2, 3), keepdim=True)
        std = w.std(dim=(1, 2, 3), keepdim=True, unbiased=False)
        w = (w - mean) / (std + self.eps)
        return F.conv2d(x, w, self.bias, self.stride, self.padding, self.dilation, self.groups)


def _gn(channels: int) -> nn.GroupNorm:
    # 32 groups and eps 1e-6 are flax GroupNorm's defaults, which the released hybrids used.
    return nn.GroupNorm(32, channels, eps=1e-6)


class Bottleneck(nn.Module):
    """1x1 -> 3x3 (strided) -> 1x1 bottleneck, out = relu(residual + y).  x: [B, Cin, H, W]."""

    def __init__(self, cin: int, width: int, stride: int):
        super().__init__()
        cout = width * 4
        self.proj = None
        if cin != cout or stride != 1:
            self.proj = nn.Sequential(StdConv2d(cin, cout, 1, stride=stride, bias=False), _gn(cout))
        self.conv1, self.gn1 = StdConv2d(cin, width, 1, bias=False), _gn(width)
        self.conv2 = StdConv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.gn2 = _gn(width)
        self.conv3, self.gn3 = StdConv2d(width, cout, 1, bias=False), _gn(cout)
        nn.init.zeros_(self.gn3.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        residual = x if self.proj is None else self.proj(x)
        y = F.relu(self.gn1(self.conv1(x)))
        y = F.relu(self.gn2(self.conv2(y)))
        y = self.gn3(self.conv3(y))
        return F.relu(residual + y)


class ResNetStem(nn.Module):
    """Root (7x7/2 conv, GN, relu, 3x3/2 max-pool) + bottleneck stages.

    layers=(3, 4, 9), width=64 is the paper's R50 hybrid: x [B, 3, H, W] -> [B, 1024, H/16, W/16].
    """

    def __init__(self, layers: tuple[int, ...], width: int = 64, in_chans: int = 3):
        super().__init__()
        self.conv_root = StdConv2d(in_chans, width, 7, stride=2, padding=3, bias=False)
        self.gn_root = _gn(width)
        self.pool = nn.MaxPool2d(3, stride=2, padding=1)
        stages, cin = [], width
        for i, n_units in enumerate(layers):
            w = width * 2**i
            units = [Bottleneck(cin if u == 0 else w * 4, w, 2 if (u == 0 and i > 0) else 1)
                     for u in range(n_units)]
            stages.append(nn.Sequential(*units))
            cin = w * 4
        self.stages = nn.Sequential(*stages)
        self.out_channels = cin
        self.stride = 4 * 2 ** max(len(layers) - 1, 0)
        for m in self.modules():
            if isinstance(m, StdConv2d):
                # flax's Conv default (lecun normal); weight standardisation removes the scale anyway
                nn.init.normal_(m.weight, std=1.0 / math.sqrt(m.weight[0].numel()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(F.relu(self.gn_root(self.conv_root(x))))
        return self.stages(x)
