"""Vision Transformer (Dosovitskiy et al. 2020, "An Image is Worth 16x16 Words").

image [B, C, H, W] --patch conv P x P / P--> [B, N, D]   (N = H/P * W/P; == linear proj. of patches)
  --prepend class token--> [B, 1+N, D] --+ learned pos-emb [1, 1+N, D]--> dropout
  --L pre-LN blocks (x + MSA(LN x), x + MLP(LN x))--> final LN --> tokens [B, 1+N, D]
  --pool (class token | mean of patch tokens)--> [B, D] --[pre-logits Linear + tanh]--> head --> [B, K]

Parameter names follow timm's VisionTransformer so that converting is a rename-free check
(see convert.py). Initialisation follows the official JAX code: zero class token and head, pos-emb
~ truncated normal std 0.02, xavier-uniform attention/MLP kernels, MLP biases ~ N(0, 1e-6),
lecun-normal patch embedding and pre-logits. GELU is the exact (erf) one, as timm uses; the JAX
reference used the tanh approximation, which is within ~1e-3 on activations.

With the class-token head, ``model(x)`` runs token 0 alone through the last block's query, output
projection and MLP (every token still supplies keys and values): the logits and all gradients are
those of the full computation, for ~1/depth less work (ViT-B/16: 32.7 instead of 35.1 GFLOPs).
``forward_features`` still returns every token.

Patch dropping (FLIP, Li et al. 2023; PatchDropout, Liu et al. 2023): ``model(x, keep=idx)`` with
``idx: [B, K]`` patch indices (``draw_keep``) runs the blocks on the class token and those K patch
tokens only; the position embeddings are added before the gather, so every kept token carries its
own. Without ``keep`` (evaluation, export, transfer) every patch is computed.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn
from torch.utils.checkpoint import checkpoint

from pipeline.model.resnet import ResNetStem

# name -> (width, mlp_dim, heads, depth, patch); paper Table 1 plus Ti/S from the AugReg paper.
_DIMS = {"ti": (192, 768, 3, 12), "s": (384, 1536, 6, 12), "b": (768, 3072, 12, 12),
         "l": (1024, 4096, 16, 24), "h": (1280, 5120, 16, 32)}
VARIANTS: dict[str, dict[str, Any]] = {
    name: dict(width=w, mlp_dim=m, heads=h, depth=d, patch=p)
    for name, (size, p) in {"vit_ti16": ("ti", 16), "vit_s16": ("s", 16), "vit_b16": ("b", 16),
                            "vit_b32": ("b", 32), "vit_l16": ("l", 16), "vit_l32": ("l", 32),
                            "vit_h14": ("h", 14)}.items()
    for (w, m, h, d) in [_DIMS[size]]
}
# Hybrids: ResNet-50 stages 1-3 (3, 4, 9 units; stride 16), patch size 1 on the feature map.
VARIANTS["vit_r50_b16"] = dict(VARIANTS["vit_b16"], patch=1, resnet_layers=(3, 4, 9))
VARIANTS["vit_r50_l32"] = dict(VARIANTS["vit_l32"], patch=2, resnet_layers=(3, 4, 9))

_LN_EPS = 1e-6  # flax LayerNorm default; the released weights were trained with it


def kept_patches(num_patches: int, drop: float) -> int:
    """How many of ``num_patches`` patch tokens a step at patch-drop fraction ``drop`` keeps: the
    fraction 1 - drop of them rounded down (as timm's ``patch_drop_rate``), at least one."""
    return max(1, math.floor(num_patches * (1.0 - drop) + 1e-9))


def draw_keep(batch: int, num_patches: int, drop: float, generator: torch.Generator) -> torch.Tensor:
    """Patches each image keeps: [B, K] int64 indices into the N patches, ascending, drawn
    independently per image (a uniform random subset of size K = kept_patches(N, drop)) from
    ``generator``, on its device. The count is fixed, so shapes are static for torch.compile."""
    k = kept_patches(num_patches, drop)
    scores = torch.rand(batch, num_patches, generator=generator, device=generator.device)
    return scores.argsort(dim=1)[:, :k].sort(dim=1).values


def _pair(v: int | tuple[int, int] | list[int]) -> tuple[int, int]:
    return (int(v), int(v)) if isinstance(v, int) else (int(v[0]), int(v[1]))


def _dropout(p: float) -> nn.Module:
    # no module call at all when disabled: the benchmark runs at p=0, as does most pre-training
    return nn.Dropout(p) if p > 0 else nn.Identity()


def lecun_normal_(w: torch.Tensor) -> None:
    """flax lecun_normal: truncated (+-2 sigma) normal with variance 1/fan_in."""
    fan_in = w[0].numel()
    std = math.sqrt(1.0 / fan_in) / 0.87962566103423978  # undo the std shrink of truncation
    nn.init.trunc_normal_(w, std=std, a=-2 * std, b=2 * std)


class DropPath(nn.Module):
    """Stochastic depth: drop the whole residual branch per sample.  x: [B, ...]."""

    def __init__(self, p: float):
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        keep = 1.0 - self.p
        mask = x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(keep)
        return x * mask.div_(keep)


class Attention(nn.Module):
    """Multi-head self-attention with one fused qkv projection.  x: [B, T, D] -> [B, T, D].

    qkv.weight: [3D, D], rows ordered (q|k|v, head, head_dim).
    """

    def __init__(self, dim: int, heads: int, attn_dropout: float, dropout: float):
        super().__init__()
        if dim % heads:
            raise ValueError(f"width={dim} is not divisible by heads={heads}")
        self.heads, self.head_dim = heads, dim // heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.attn_dropout = attn_dropout
        self.proj_drop = _dropout(dropout)

    def forward(self, x: torch.Tensor, first_query_only: bool = False) -> torch.Tensor:
        """x: [B, T, D] -> [B, T, D], or [B, 1, D] with ``first_query_only``: the output of token 0
        alone (its query against all keys/values), which is all a class-token head reads."""
        B, T, D = x.shape
        p = self.attn_dropout if self.training else 0.0
        if first_query_only:
            # one qkv GEMM over every token, token 0's query sliced from its output: the q of the other
            # tokens is 1/12 of a block's work, while slicing the weight instead (q from w[:D] on token 0,
            # k, v from w[D:]) made the weight's gradient two zero-filled [3D, D] buffers summed, and
            # the block slower than computing every token (bench/model_step.py)
            qkv = self.qkv(x)
            q = rearrange(qkv[:, :1, :D], "b t (h d) -> b h t d", h=self.heads)
            k, v = rearrange(qkv[:, :, D:], "b t (kv h d) -> kv b h t d", kv=2, h=self.heads)
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=p)
            return self.proj_drop(self.proj(rearrange(y, "b h t d -> b t (h d)")))
        # a view + permute (no copy): SDPA takes the strides as they are
        q, k, v = rearrange(self.qkv(x), "b t (qkv h d) -> qkv b h t d", qkv=3, h=self.heads)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p)
        return self.proj_drop(self.proj(rearrange(y, "b h t d -> b t (h d)")))


class Mlp(nn.Module):
    """fc1 -> GELU -> dropout -> fc2 -> dropout.  x: [B, T, D] -> [B, T, D]."""

    def __init__(self, dim: int, hidden: int, dropout: float):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)
        self.drop = _dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.fc2(self.drop(F.gelu(self.fc1(x)))))


class Block(nn.Module):
    """Pre-LN encoder block.  x: [B, T, D] -> [B, T, D]."""

    def __init__(self, dim: int, heads: int, mlp_dim: int, dropout: float, attn_dropout: float,
                 drop_path: float):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=_LN_EPS)
        self.attn = Attention(dim, heads, attn_dropout, dropout)
        self.norm2 = nn.LayerNorm(dim, eps=_LN_EPS)
        self.mlp = Mlp(dim, mlp_dim, dropout)
        self.drop_path = DropPath(drop_path) if drop_path > 0 else nn.Identity()

    def forward(self, x: torch.Tensor, first_token_only: bool = False) -> torch.Tensor:
        """``first_token_only``: compute only token 0's output, [B, 1, D] (it still attends to all)."""
        if first_token_only:
            x = x[:, :1] + self.drop_path(self.attn(self.norm1(x), first_query_only=True))
        else:
            x = x + self.drop_path(self.attn(self.norm1(x)))
        return x + self.drop_path(self.mlp(self.norm2(x)))


class PatchEmbed(nn.Module):
    """Image (or ResNet feature map, for hybrids) -> patch tokens.  x: [B, C, H, W] -> [B, N, D]."""

    def __init__(self, patch: int, in_chans: int, dim: int, resnet_layers: tuple[int, ...] | None,
                 resnet_width: int):
        super().__init__()
        self.backbone = None
        self.stride = patch
        if resnet_layers is not None:
            self.backbone = ResNetStem(tuple(resnet_layers), resnet_width, in_chans)
            in_chans, self.stride = self.backbone.out_channels, self.backbone.stride * patch
        self.proj = nn.Conv2d(in_chans, dim, patch, stride=patch)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.backbone is not None:
            x = self.backbone(x)
        return rearrange(self.proj(x), "b d gh gw -> b (gh gw) d")  # patches in row-major order


class ViT(nn.Module):
    """The ViT classifier; build it with `build_vit` (which also fills `config`).

    Attributes: patch_grid (gh, gw), num_prefix_tokens (1 with a class token, else 0), width,
    num_classes, config (kwargs for build_vit to rebuild this architecture).
    """

    def __init__(self, *, width: int, depth: int, heads: int, mlp_dim: int | None = None,
                 patch: int = 16, img_size: int | tuple[int, int] = 224, num_classes: int = 1000,
                 pool: str = "token", class_token: bool = True,
                 representation_size: int | None = None, dropout: float = 0.0,
                 attn_dropout: float = 0.0, drop_path: float = 0.0, in_chans: int = 3,
                 resnet_layers: tuple[int, ...] | None = None, resnet_width: int = 64):
        super().__init__()
        mlp_dim = mlp_dim or 4 * width
        img_size = _pair(img_size)
        if pool not in ("token", "gap"):
            raise ValueError(f"pool={pool!r}: expected 'token' or 'gap'")
        if pool == "token" and not class_token:
            raise ValueError("pool='token' needs class_token=True (use pool='gap' without it)")
        for k, v in dict(dropout=dropout, attn_dropout=attn_dropout, drop_path=drop_path).items():
            if not 0.0 <= v < 1.0:
                raise ValueError(f"{k}={v}: expected a probability in [0, 1)")
        self.config = dict(width=width, depth=depth, heads=heads, mlp_dim=mlp_dim, patch=patch,
                           img_size=img_size, num_classes=num_classes, pool=pool,
                           class_token=class_token, representation_size=representation_size,
                           dropout=dropout, attn_dropout=attn_dropout, drop_path=drop_path,
                           in_chans=in_chans, resnet_layers=resnet_layers,
                           resnet_width=resnet_width)
        if resnet_layers is not None:
            self.config["resnet_layers"] = tuple(resnet_layers)
        self.width, self.pool, self.num_classes = width, pool, num_classes
        self.img_size = img_size
        self.patch_embed = PatchEmbed(patch, in_chans, width, resnet_layers, resnet_width)
        s = self.patch_embed.stride
        if img_size[0] % s or img_size[1] % s:
            raise ValueError(f"img_size={img_size} is not divisible by the patch stride {s}")
        self.patch_grid = (img_size[0] // s, img_size[1] // s)
        self.num_prefix_tokens = 1 if class_token else 0
        self.cls_token = nn.Parameter(torch.zeros(1, 1, width)) if class_token else None
        num_tokens = self.num_prefix_tokens + self.patch_grid[0] * self.patch_grid[1]
        self.pos_embed = nn.Parameter(torch.zeros(1, num_tokens, width))
        self.pos_drop = _dropout(dropout)
        rates = [drop_path * i / max(depth - 1, 1) for i in range(depth)]  # linear, as in DeiT
        self.blocks = nn.ModuleList(
            Block(width, heads, mlp_dim, dropout, attn_dropout, r) for r in rates)
        self.norm = nn.LayerNorm(width, eps=_LN_EPS)
        self.pre_logits = nn.Linear(width, representation_size) if representation_size else None
        head_in = representation_size or width
        self.head = nn.Linear(head_in, num_classes) if num_classes else None
        self.grad_checkpointing = False
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """Official JAX ViT initialisation (see module docstring)."""
        lecun_normal_(self.patch_embed.proj.weight)
        nn.init.zeros_(self.patch_embed.proj.bias)
        if self.cls_token is not None:
            nn.init.zeros_(self.cls_token)
        nn.init.trunc_normal_(self.pos_embed, std=0.02, a=-0.04, b=0.04)
        for blk in self.blocks:
            # q, k and v are separate D x D kernels in the reference: xavier each one on its own
            for w in blk.attn.qkv.weight.chunk(3, dim=0):
                nn.init.xavier_uniform_(w)
            nn.init.zeros_(blk.attn.qkv.bias)
            nn.init.xavier_uniform_(blk.attn.proj.weight)
            nn.init.zeros_(blk.attn.proj.bias)
            for fc in (blk.mlp.fc1, blk.mlp.fc2):
                nn.init.xavier_uniform_(fc.weight)
                nn.init.normal_(fc.bias, std=1e-6)
            for ln in (blk.norm1, blk.norm2):
                nn.init.ones_(ln.weight)
                nn.init.zeros_(ln.bias)
        nn.init.ones_(self.norm.weight)
        nn.init.zeros_(self.norm.bias)
        if self.pre_logits is not None:
            lecun_normal_(self.pre_logits.weight)
            nn.init.zeros_(self.pre_logits.bias)
        if self.head is not None:
            nn.init.zeros_(self.head.weight)
            nn.init.zeros_(self.head.bias)

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        """Recompute each block's activations in backward (saves memory, ~+1 forward of compute)."""
        self.grad_checkpointing = enable

    def keep_patches(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """x: [B, prefix + N, D] (position embeddings added), keep: [B, K] patch indices
        -> [B, prefix + K, D]: the prefix (class) token and the kept patch tokens, in ``keep``'s order."""
        if keep.ndim != 2 or keep.shape[0] != x.shape[0]:
            raise ValueError(f"keep: expected [batch={x.shape[0]}, K] patch indices; got {tuple(keep.shape)}")
        p = self.num_prefix_tokens
        patches = x[:, p:].gather(1, keep.unsqueeze(-1).expand(-1, -1, x.shape[-1]))
        return torch.cat([x[:, :p], patches], dim=1) if p else patches

    def forward_features(self, x: torch.Tensor, first_token_only: bool = False,
                         keep: torch.Tensor | None = None) -> torch.Tensor:
        """x: [B, C, H, W] -> tokens [B, prefix + N, D] after the final LayerNorm.

        ``first_token_only``: the last block computes only token 0 (-> [B, 1, D]); every token still
        feeds it through attention. Equal to ``forward_features(x)[:, :1]`` (up to float rounding), for
        ~1/depth of the work less: the class-token head needs nothing else.
        ``keep``: [B, K] patch indices (training with patch dropping): only those patches, after their
        position embeddings are added, go through the blocks (-> [B, prefix + K, D]).
        """
        if x.shape[-2:] != self.img_size:
            raise ValueError(f"input is {tuple(x.shape[-2:])} pixels but the model was built for "
                             f"img_size={self.img_size}; rebuild it and load_pretrained to resample")
        x = self.patch_embed(x)
        if self.cls_token is not None:
            x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        x = x + self.pos_embed
        if keep is not None:
            x = self.keep_patches(x, keep)
        x = self.pos_drop(x)
        use_ckpt = self.grad_checkpointing and torch.is_grad_enabled()
        last = len(self.blocks) - 1
        for i, blk in enumerate(self.blocks):
            first = first_token_only and i == last
            x = checkpoint(blk, x, first, use_reentrant=False) if use_ckpt else blk(x, first)
        return self.norm(x)

    def forward_head(self, tokens: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        """tokens: [B, T, D] -> logits [B, K] (or the representation [B, R|D] if pre_logits)."""
        if self.pool == "token":
            x = tokens[:, 0]
        else:
            x = tokens[:, self.num_prefix_tokens:].mean(dim=1)
        if self.pre_logits is not None:
            x = torch.tanh(self.pre_logits(x))
        if pre_logits or self.head is None:
            return x
        return self.head(x)

    def forward(self, x: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        """x: [B, C, H, W] -> logits [B, num_classes] ([B, R|D] when num_classes == 0).
        ``keep``: [B, K] patch indices to compute (patch dropping, training only); None: every patch."""
        return self.forward_head(self.forward_features(x, first_token_only=self.pool == "token", keep=keep))


def build_vit(variant: str | None = None, **kwargs: Any) -> ViT:
    """Build a ViT from a variant name (VARIANTS) and/or explicit dims; kwargs override the table.

    build_vit("vit_b16", num_classes=1000, img_size=224)
    build_vit(width=64, depth=2, heads=4, mlp_dim=128, patch=4, img_size=32, num_classes=10)
    build_vit(**model.config) rebuilds the same architecture.
    """
    if variant is not None:
        if variant not in VARIANTS:
            raise ValueError(f"unknown ViT variant {variant!r}; known: {', '.join(VARIANTS)}")
        kwargs = {**VARIANTS[variant], **kwargs}
    missing = [k for k in ("width", "depth", "heads") if k not in kwargs]
    if missing:
        raise ValueError(f"build_vit needs a variant name or {', '.join(missing)}")
    if kwargs.get("img_size") is not None and not isinstance(kwargs["img_size"], int):
        kwargs["img_size"] = _pair(kwargs["img_size"])  # JSON/YAML gives lists
    return ViT(**kwargs)


def reset_head(model: ViT, num_classes: int, keep_representation: bool = False) -> ViT:
    """Replace the classifier with a zero-initialised one for `num_classes` (in place).

    The paper fine-tunes by removing the pre-training head (hidden tanh layer + classifier) and
    attaching one zero-initialised D x K linear layer: keep_representation=False does that;
    True keeps the pre-logits layer and only swaps the final linear.
    """
    if not keep_representation and model.pre_logits is not None:
        model.pre_logits = None
        model.config["representation_size"] = None
    head_in = model.pre_logits.out_features if model.pre_logits is not None else model.width
    ref = model.pos_embed
    if num_classes:
        model.head = nn.Linear(head_in, num_classes, device=ref.device, dtype=ref.dtype)
        nn.init.zeros_(model.head.weight)
        nn.init.zeros_(model.head.bias)
    else:
        model.head = None
    model.num_classes = model.config["num_classes"] = num_classes
    return model
