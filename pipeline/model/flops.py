"""Analytic FLOP counts of the ViT, for model FLOPs utilisation (MFU).

Convention of torch.utils.flop_counter: a multiply-add is 2 FLOPs, only matmuls and convolutions
count (norms, softmax, GELU, biases are noise at ViT sizes). Attention counts QK^T and AV,
2 * 2 * T^2 * D per block. Note that FlopCounterMode itself counts 0 for the CPU flash-attention
kernel; on the meta device or with the math SDPA backend it agrees with these numbers.

With patch dropping (``patch_drop``) the patch embedding still runs on the whole image, and the
blocks on the class token plus the kept patches (``kept_patches``): the tokens actually computed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from pipeline.model.vit import VARIANTS, kept_patches


def _config(model_or_config: torch.nn.Module | Mapping[str, Any] | str) -> dict[str, Any]:
    if isinstance(model_or_config, str):
        if model_or_config not in VARIANTS:
            raise ValueError(f"unknown ViT variant {model_or_config!r}")
        return {"img_size": 224, "num_classes": 1000, **VARIANTS[model_or_config]}
    if isinstance(model_or_config, torch.nn.Module):
        return dict(model_or_config.config)
    return dict(model_or_config)


def _ceil_half(n: int) -> int:
    return (n + 1) // 2


def _stem_flops(layers: tuple[int, ...], width: int, cin: int, h: int, w: int):
    """ResNet stem forward FLOPs for one image; returns (flops, channels, h, w) of its output."""
    h, w = _ceil_half(h), _ceil_half(w)  # 7x7 / 2 root conv
    flops = 2 * h * w * width * cin * 49
    h, w = _ceil_half(h), _ceil_half(w)  # 3x3 / 2 max-pool
    c = width
    for i, n_units in enumerate(layers):
        wd = width * 2**i
        for u in range(n_units):
            stride = 2 if (u == 0 and i > 0) else 1
            ho, wo = (_ceil_half(h), _ceil_half(w)) if stride == 2 else (h, w)
            flops += 2 * h * w * c * wd  # conv1 1x1 at the input resolution
            flops += 2 * ho * wo * wd * wd * 9  # conv2 3x3 (strided)
            flops += 2 * ho * wo * wd * wd * 4  # conv3 1x1 -> 4 * wd
            if c != wd * 4 or stride != 1:
                flops += 2 * ho * wo * c * wd * 4  # projection shortcut
            c, h, w = wd * 4, ho, wo
    return flops, c, h, w


def vit_forward_flops(model_or_config: torch.nn.Module | Mapping[str, Any] | str,
                      batch: int = 1, features: bool = False, patch_drop: float = 0.0) -> int:
    """Forward FLOPs of `batch` images for a ViT model, its config dict or a variant name: of
    ``model(x)`` (with a class-token head the last block computes token 0 only), or of
    ``forward_features(x)`` (every token through every block) with ``features=True``;
    ``patch_drop``: of a training forward that keeps ``kept_patches(N, patch_drop)`` patches."""
    cfg = _config(model_or_config)
    d, depth = int(cfg["width"]), int(cfg["depth"])
    mlp = int(cfg.get("mlp_dim") or 4 * d)
    patch = int(cfg.get("patch", 16))
    size = cfg.get("img_size", 224)
    h, w = (size, size) if isinstance(size, int) else (int(size[0]), int(size[1]))
    cin = int(cfg.get("in_chans", 3))
    flops = 0
    if cfg.get("resnet_layers"):
        stem, cin, h, w = _stem_flops(tuple(cfg["resnet_layers"]), int(cfg.get("resnet_width", 64)),
                                      cin, h, w)
        flops += stem
    n = (h // patch) * (w // patch)
    flops += 2 * n * d * cin * patch * patch  # patch embedding: every patch, dropping comes after it
    t = (kept_patches(n, patch_drop) if patch_drop else n) + (1 if cfg.get("class_token", True) else 0)
    per_block = 2 * t * (3 * d * d + d * d + 2 * d * mlp) + 4 * t * t * d
    if features or cfg.get("pool", "token") != "token":
        return (flops + depth * per_block) * batch
    # last block, token 0 only: the qkv projection of all t tokens (one GEMM; token 0's query is sliced
    # from it, pipeline/model/vit.py), one query's attention, its projection and MLP
    last = 2 * t * 3 * d * d + 2 * (d * d + 2 * d * mlp) + 4 * t * d
    flops += (depth - 1) * per_block + last
    rep = cfg.get("representation_size") or 0
    if rep:
        flops += 2 * d * rep
    k = int(cfg.get("num_classes", 0) or 0)
    flops += 2 * (rep or d) * k
    return flops * batch


def train_step_flops(model_or_config: torch.nn.Module | Mapping[str, Any] | str, batch: int = 1,
                     grad_checkpointing: bool | None = None, patch_drop: float = 0.0) -> int:
    """FLOPs of one forward + backward: 3x forward (backward is 2x), 4x with activation
    checkpointing (the forward is run again in backward). None reads it from the model.
    ``patch_drop``: the fraction of patches a training step drops (model.patch_drop)."""
    if grad_checkpointing is None:
        grad_checkpointing = bool(getattr(model_or_config, "grad_checkpointing", False))
    return (4 if grad_checkpointing else 3) * vit_forward_flops(model_or_config, batch, patch_drop=patch_drop)
