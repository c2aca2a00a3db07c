"""Weight conversions between vitp, timm and the official JAX (.npz) ViT checkpoints.

vitp parameter names are timm's VisionTransformer names, plus `pre_logits.*` (the paper's
pre-training hidden tanh layer, which timm dropped) and `patch_embed.backbone.*` (hybrid stem):
  patch_embed.proj.weight [D, C, P, P]      cls_token [1, 1, D]      pos_embed [1, prefix+N, D]
  blocks.{i}.norm1|norm2.weight|bias [D]     blocks.{i}.attn.qkv.weight [3D, D] (q|k|v, head, hd)
  blocks.{i}.attn.proj.weight [D, D]         blocks.{i}.mlp.fc1.weight [M, D], fc2.weight [D, M]
  norm.weight|bias [D]   pre_logits.weight [R, D]   head.weight [K, R|D]
So the timm conversions are checks: they refuse timm features the paper's ViT does not have
(fc_norm, layer scale, register tokens, ...) instead of silently computing something else.

Official JAX checkpoints (google-research/vision_transformer) are flat '/'-joined flax trees; two
block namings exist: released checkpoints number the sub-modules in call order across types
(LayerNorm_0, MultiHeadDotProductAttention_1, LayerNorm_2, MlpBlock_3), the current code numbers
per type (LayerNorm_0, MultiHeadDotProductAttention_0, LayerNorm_1, MlpBlock_0).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

_BLOCK_NAMES = {
    "released": ("LayerNorm_0", "MultiHeadDotProductAttention_1", "LayerNorm_2", "MlpBlock_3"),
    "current": ("LayerNorm_0", "MultiHeadDotProductAttention_0", "LayerNorm_1", "MlpBlock_0"),
}
# timm parameters for features outside the paper's ViT; loading them would change the function.
_TIMM_UNSUPPORTED = re.compile(
    r"^(fc_norm\.|reg_token|norm_pre\.|attn_pool\.|patch_embed\.norm\.|patch_embed\.backbone\.)"
    r"|^blocks\.\d+\.(ls[12]\.|attn\.(q_norm|k_norm|norm)\.)")
_VITP_ONLY = re.compile(r"^(pre_logits\.|patch_embed\.backbone\.)")
_WRAPPERS = ("module.", "_orig_mod.", "model.")  # DDP / torch.compile / Lightning-style prefixes


def unwrap_state_dict(sd: Mapping[str, Any]) -> dict[str, Any]:
    """Strip wrapper prefixes shared by every key (`module.`, `_orig_mod.`) and nested containers."""
    for container in ("state_dict", "model", "module", "params"):
        if container in sd and isinstance(sd[container], Mapping) and len(sd) <= 4:
            sd = sd[container]
    sd = dict(sd)
    changed = True
    while changed and sd:
        changed = False
        for pre in _WRAPPERS:
            if all(k.startswith(pre) for k in sd):
                sd = {k[len(pre):]: v for k, v in sd.items()}
                changed = True
    return sd


def is_vitp_state_dict(sd: Mapping[str, Any]) -> bool:
    """True when the dict uses vitp-only names (a timm dict never has them)."""
    return any(_VITP_ONLY.match(k) for k in sd)


def timm_to_vitp(sd: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """timm VisionTransformer state dict -> vitp state dict (same names; refuses extra features)."""
    sd = unwrap_state_dict(sd)
    for k in sd:
        if _TIMM_UNSUPPORTED.search(k):
            raise ValueError(f"timm key {k!r} belongs to a feature the paper's ViT does not have "
                             "(fc_norm / layer scale / qk-norm / register tokens / hybrid)")
    return {k: torch.as_tensor(v) for k, v in sd.items()}


def vitp_to_timm(sd: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """vitp state dict -> timm VisionTransformer state dict (same names; refuses vitp-only parts)."""
    sd = unwrap_state_dict(sd)
    for k in sd:
        if _VITP_ONLY.match(k):
            raise ValueError(f"vitp key {k!r} has no timm VisionTransformer equivalent "
                             "(pre-logits tanh layer / hybrid ResNet stem)")
    return dict(sd)


def _t(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a)).float()


def jax_npz_to_vitp(arrays: Mapping[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """Official JAX ViT arrays (flat '/' keys, e.g. from numpy.load) -> vitp state dict.

    Keys the mapping does not use are passed through under their JAX name, so a loader reports them
    as unexpected. big_vision's layout (top-level `pos_embedding` without the class token's row)
    is accepted too: the class token row is set to zero, which computes the same function.
    """
    a = dict(arrays)
    for pre in ("opt/target/", "params/"):
        if a and all(k.startswith(pre) for k in a):
            a = {k[len(pre):]: v for k, v in a.items()}
    out: dict[str, torch.Tensor] = {}

    def take(key: str) -> np.ndarray:
        if key not in a:
            raise ValueError(f"JAX checkpoint has no key {key!r}")
        return a.pop(key)

    naming = "released" if any("MultiHeadDotProductAttention_1" in k for k in a) else "current"
    ln1, mha, ln2, mlp = _BLOCK_NAMES[naming]
    k = take("embedding/kernel")  # [P, P, C, D] HWIO
    out["patch_embed.proj.weight"] = _t(k.transpose(3, 2, 0, 1))
    out["patch_embed.proj.bias"] = _t(take("embedding/bias"))
    has_cls = "cls" in a
    if has_cls:
        out["cls_token"] = _t(take("cls"))
    if "Transformer/posembed_input/pos_embedding" in a:
        out["pos_embed"] = _t(take("Transformer/posembed_input/pos_embedding"))
    elif "pos_embedding" in a:
        pe = _t(take("pos_embedding"))
        if has_cls:
            pe = torch.cat([pe.new_zeros(1, 1, pe.shape[-1]), pe], dim=1)
        out["pos_embed"] = pe
    depth = 1 + max((int(m.group(1)) for key in a
                     if (m := re.match(r"Transformer/encoderblock_(\d+)/", key))), default=-1)
    for i in range(depth):
        p, o = f"Transformer/encoderblock_{i}/", f"blocks.{i}."
        for src, dst in ((ln1, "norm1"), (ln2, "norm2")):
            out[o + dst + ".weight"] = _t(take(f"{p}{src}/scale"))
            out[o + dst + ".bias"] = _t(take(f"{p}{src}/bias"))
        qkv_w, qkv_b = [], []
        for name in ("query", "key", "value"):
            w = take(f"{p}{mha}/{name}/kernel")  # [D, heads, head_dim]
            qkv_w.append(w.reshape(w.shape[0], -1).T)
            qkv_b.append(take(f"{p}{mha}/{name}/bias").reshape(-1))
        out[o + "attn.qkv.weight"] = _t(np.concatenate(qkv_w, 0))
        out[o + "attn.qkv.bias"] = _t(np.concatenate(qkv_b, 0))
        w = take(f"{p}{mha}/out/kernel")  # [heads, head_dim, D]
        out[o + "attn.proj.weight"] = _t(w.reshape(-1, w.shape[-1]).T)
        out[o + "attn.proj.bias"] = _t(take(f"{p}{mha}/out/bias"))
        for j, fc in enumerate(("fc1", "fc2")):
            out[f"{o}mlp.{fc}.weight"] = _t(take(f"{p}{mlp}/Dense_{j}/kernel").T)
            out[f"{o}mlp.{fc}.bias"] = _t(take(f"{p}{mlp}/Dense_{j}/bias"))
    out["norm.weight"] = _t(take("Transformer/encoder_norm/scale"))
    out["norm.bias"] = _t(take("Transformer/encoder_norm/bias"))
    for jax_name, name in (("pre_logits", "pre_logits"), ("head", "head")):
        if f"{jax_name}/kernel" in a:
            out[f"{name}.weight"] = _t(take(f"{jax_name}/kernel").T)
            out[f"{name}.bias"] = _t(take(f"{jax_name}/bias"))
    out.update({key: torch.as_tensor(np.asarray(v)) for key, v in a.items()})  # -> "unexpected"
    return out


def vitp_to_jax_npz(sd: Mapping[str, Any] | torch.nn.Module, naming: str = "released", *,
                    heads: int | None = None) -> dict[str, np.ndarray]:
    """vitp state dict (or model) -> flat arrays in the official JAX layout; np.savez(path, **out).

    `heads` is needed to split the fused qkv kernel into [D, heads, head_dim]; it is read from
    model.config when a model is passed.
    """
    if naming not in _BLOCK_NAMES:
        raise ValueError(f"naming={naming!r}: expected one of {sorted(_BLOCK_NAMES)}")
    if isinstance(sd, torch.nn.Module):
        heads = heads or sd.config["heads"]
        sd = sd.state_dict()
    if heads is None:
        raise ValueError("vitp_to_jax_npz needs heads= to reshape the attention kernels")
    sd = {k: v.detach().cpu().float().numpy() for k, v in unwrap_state_dict(sd).items()}
    if any(k.startswith("patch_embed.backbone.") for k in sd):
        raise ValueError("vitp_to_jax_npz: the hybrid ResNet stem has no JAX export")
    ln1, mha, ln2, mlp = _BLOCK_NAMES[naming]
    out = {"embedding/kernel": sd.pop("patch_embed.proj.weight").transpose(2, 3, 1, 0),
           "embedding/bias": sd.pop("patch_embed.proj.bias"),
           "Transformer/posembed_input/pos_embedding": sd.pop("pos_embed")}
    if "cls_token" in sd:
        out["cls"] = sd.pop("cls_token")
    depth = 1 + max((int(m.group(1)) for k in sd if (m := re.match(r"blocks\.(\d+)\.", k))),
                    default=-1)
    for i in range(depth):
        p, o = f"Transformer/encoderblock_{i}/", f"blocks.{i}."
        for dst, src in ((ln1, "norm1"), (ln2, "norm2")):
            out[f"{p}{dst}/scale"] = sd.pop(o + src + ".weight")
            out[f"{p}{dst}/bias"] = sd.pop(o + src + ".bias")
        w, b = sd.pop(o + "attn.qkv.weight"), sd.pop(o + "attn.qkv.bias")
        dim = w.shape[1]
        for name, wi, bi in zip(("query", "key", "value"), np.split(w, 3), np.split(b, 3)):
            out[f"{p}{mha}/{name}/kernel"] = wi.T.reshape(dim, heads, dim // heads)
            out[f"{p}{mha}/{name}/bias"] = bi.reshape(heads, dim // heads)
        out[f"{p}{mha}/out/kernel"] = sd.pop(o + "attn.proj.weight").T.reshape(heads, -1, dim)
        out[f"{p}{mha}/out/bias"] = sd.pop(o + "attn.proj.bias")
        for j, fc in enumerate(("fc1", "fc2")):
            out[f"{p}{mlp}/Dense_{j}/kernel"] = sd.pop(f"{o}mlp.{fc}.weight").T
            out[f"{p}{mlp}/Dense_{j}/bias"] = sd.pop(f"{o}mlp.{fc}.bias")
    out["Transformer/encoder_norm/scale"] = sd.pop("norm.weight")
    out["Transformer/encoder_norm/bias"] = sd.pop("norm.bias")
    for name in ("pre_logits", "head"):
        if f"{name}.weight" in sd:
            out[f"{name}/kernel"] = sd.pop(f"{name}.weight").T
            out[f"{name}/bias"] = sd.pop(f"{name}.bias")
    if sd:
        raise ValueError(f"vitp_to_jax_npz: keys with no JAX equivalent: {sorted(sd)}")
    return {k: np.ascontiguousarray(v) for k, v in out.items()}
