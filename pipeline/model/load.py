"""Loading weights into a vitp ViT: by file content (vitp/timm safetensors, timm .pth/.bin, official
JAX .npz) or from a state dict already in memory.

Position embeddings are resampled to the model's patch grid (fine-tuning at a new resolution) and
the classifier is zero-initialised again when the class count differs; every other shape mismatch
is an error naming the key, because silently skipping it would train a half-random model.
"""

from __future__ import annotations

import json
import math
import pickle
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open

from pipeline.model.convert import (
    is_vitp_state_dict,
    jax_npz_to_vitp,
    timm_to_vitp,
    unwrap_state_dict,
)
from pipeline.model.posemb import resample_posemb

Grid = tuple[int, int]


@dataclass
class LoadReport:
    """What a load did. missing: model keys left at their current values; unexpected: checkpoint
    keys the model has no place for; head keys dropped by a head reset are in neither."""

    source: str
    missing: list[str]
    unexpected: list[str]
    resampled_posemb: tuple[Grid, Grid] | None
    head_reset: bool


def _grid_from_config(cfg: Mapping[str, Any]) -> Grid | None:
    try:
        size = cfg["img_size"]
        h, w = (size, size) if isinstance(size, int) else size
        stride = int(cfg["patch"])
        if cfg.get("resnet_layers"):
            stride *= 4 * 2 ** (len(cfg["resnet_layers"]) - 1)
        return h // stride, w // stride
    except (KeyError, TypeError, ValueError):
        return None


def _old_grid(n: int, model_grid: Grid, hint: Grid | None, source: str) -> Grid:
    """Patch grid of a checkpoint's pos-emb with n grid rows; square unless told otherwise."""
    if hint is not None and hint[0] * hint[1] == n:
        return tuple(hint)
    if model_grid[0] * model_grid[1] == n:
        return model_grid
    side = math.isqrt(n)
    if side * side == n:
        return side, side
    raise ValueError(f"{source}: pos_embed has {n} grid positions, which is not a square and not "
                     f"the model's grid {model_grid}; pass old_grid=(h, w)")


def _zero_head(model: torch.nn.Module) -> None:
    with torch.no_grad():
        model.head.weight.zero_()
        model.head.bias.zero_()


def load_state_dict_into(model: torch.nn.Module, sd: Mapping[str, Any], source: str = "state_dict",
                         *, posemb_mode: str = "bicubic",
                         old_grid: Grid | None = None) -> LoadReport:
    """Load a vitp-named state dict into `model` (in place); see the module docstring.

    sd: vitp names (timm's ViT names are the same); wrapper prefixes such as `module.` are removed.
    old_grid: the checkpoint's patch grid when its pos-emb is for a non-square grid.
    """
    sd = {k: torch.as_tensor(v) for k, v in unwrap_state_dict(sd).items()}
    own = model.state_dict()
    resampled = None
    if "pos_embed" in sd and "pos_embed" in own:
        pe, ref = sd["pos_embed"], own["pos_embed"]
        if pe.ndim != 3 or pe.shape[0] != 1 or pe.shape[-1] != ref.shape[-1]:
            raise ValueError(f"{source}: pos_embed has shape {tuple(pe.shape)} in the checkpoint "
                             f"but {tuple(ref.shape)} in the model")
        ckpt_prefix, prefix = int("cls_token" in sd), model.num_prefix_tokens
        grid = _old_grid(pe.shape[1] - ckpt_prefix, model.patch_grid, old_grid, source)
        if ckpt_prefix > prefix:  # class-token checkpoint into a GAP model: its row has no use
            pe = pe[:, ckpt_prefix:]
        elif ckpt_prefix < prefix:  # keep the model's own class-token row
            pe = torch.cat([ref[:, :prefix].to(pe), pe], dim=1)
        sd["pos_embed"] = resample_posemb(pe, grid, model.patch_grid, prefix, posemb_mode)
        if tuple(grid) != tuple(model.patch_grid):
            resampled = (tuple(grid), tuple(model.patch_grid))
    head_reset = False
    if "head.weight" in own and "head.weight" in sd and sd["head.weight"].shape != own[
            "head.weight"].shape:
        head_reset = True
        sd.pop("head.weight")
        sd.pop("head.bias", None)
        _zero_head(model)
    for k, v in sd.items():
        if k in own and v.shape != own[k].shape:
            raise ValueError(f"{source}: {k} has shape {tuple(v.shape)} in the checkpoint but "
                             f"{tuple(own[k].shape)} in the model")
    missing = sorted(k for k in own if k not in sd and not (head_reset and k.startswith("head.")))
    unexpected = sorted(k for k in sd if k not in own)
    model.load_state_dict({k: v for k, v in sd.items() if k in own}, strict=False)
    return LoadReport(source, missing, unexpected, resampled, head_reset)


def _sniff(path: Path) -> str:
    with open(path, "rb") as f:
        head = f.read(16)
    if head[:4] == b"PK\x03\x04":
        with zipfile.ZipFile(path) as z:
            names = z.namelist()
        return "npz" if names and all(n.endswith(".npy") for n in names) else "torch"
    if head[:1] == b"\x80":  # a bare (legacy) pickle stream
        return "torch"
    if len(head) >= 9 and head[8:9] == b"{":  # safetensors: u64 header length, then JSON
        return "safetensors"
    raise ValueError(f"{path}: not a safetensors, torch or npz file (starts with {head[:8]!r})")


def _read_torch(path: Path) -> Mapping[str, Any]:
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, AttributeError, TypeError) as e:
        # torch's message is a page long; the line naming the refused global is the useful one
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()] or [type(e).__name__]
        first = next((ln for ln in lines if "Unsupported" in ln), lines[0]).split(". Please")[0]
        raise ValueError(f"{path}: refused to load: not a plain tensor state dict, and unpickling "
                         f"it could run code ({first})") from None
    if not isinstance(obj, Mapping):
        raise ValueError(f"{path}: expected a state dict, found {type(obj).__name__}")
    return obj


def _to_vitp(sd: Mapping[str, Any]) -> tuple[dict[str, torch.Tensor], str]:
    sd = unwrap_state_dict(sd)
    if any("/" in k for k in sd):
        return jax_npz_to_vitp({k: np.asarray(v) for k, v in sd.items()}), "jax"
    if is_vitp_state_dict(sd):
        return {k: torch.as_tensor(v) for k, v in sd.items()}, "vitp"
    return timm_to_vitp(sd), "timm"


def load_pretrained(model: torch.nn.Module, path: str | Path, *, posemb_mode: str = "bicubic",
                    old_grid: Grid | None = None) -> LoadReport:
    """Load a checkpoint file into `model`, detecting its format from the content.

    Formats: vitp safetensors (pipeline.weights.save_weights), timm ViT weights (.safetensors, or .pth/.bin read
    with torch.load(weights_only=True)), official JAX .npz (numpy.load(allow_pickle=False)).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such checkpoint file")
    kind = _sniff(path)
    if kind == "npz":
        with np.load(path, allow_pickle=False) as z:
            sd, fmt = jax_npz_to_vitp({k: z[k] for k in z.files}), "jax"
    elif kind == "torch":
        sd, fmt = _to_vitp(_read_torch(path))
    else:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            raw = {k: f.get_tensor(k) for k in f.keys()}
        sd, fmt = (raw, "vitp") if meta.get("format") == "vitp" else _to_vitp(raw)
        if fmt == "vitp" and "config" in meta and old_grid is None:
            old_grid = _grid_from_config(json.loads(meta["config"]))
    return load_state_dict_into(model, sd, source=f"{path} ({fmt})", posemb_mode=posemb_mode,
                                old_grid=old_grid)
