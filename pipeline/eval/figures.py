"""The paper's figures for a trained ViT (Dosovitskiy et al. 2020, Figures 6 and 7).

- ``patch_filters.png``: principal components of the patch-embedding filters (Fig. 7 left)
- ``posemb_similarity.png``: cosine similarity of each patch's position embedding with all
  others, one small map per patch position (Fig. 7 centre)
- ``attention_distance.png``: mean attention distance per head vs depth (Fig. 7 right)
- ``attention_rollout.png``: attention rollout from the class token over input images (Fig. 6)

The figures read weights and recompute attention probabilities from each block's own layers, so
the model (which uses fused SDPA) needs no hooks or changes.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from pipeline.model import ViT


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend (no display on a cluster node): the one setup."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


# --------------------------------------------------------------------------------------------------
# Numbers behind the figures
# --------------------------------------------------------------------------------------------------
def patch_filter_components(model: ViT, k: int = 28) -> np.ndarray:
    """Top-k principal components of the linear patch embedding.  -> [k, P, P, C] in [0, 1]."""
    w = model.patch_embed.proj.weight.detach().float().cpu()  # [D, C, P, P]
    d, c, p, _ = w.shape
    flat = (w.reshape(d, -1) - w.reshape(d, -1).mean(0, keepdim=True)).numpy()
    _, _, vt = np.linalg.svd(flat, full_matrices=False)  # rows of vt: components over C*P*P
    comps = vt[: min(k, vt.shape[0])].reshape(-1, c, p, p).transpose(0, 2, 3, 1)
    lo = comps.min(axis=(1, 2, 3), keepdims=True)
    hi = comps.max(axis=(1, 2, 3), keepdims=True)
    return (comps - lo) / np.maximum(hi - lo, 1e-12)


def posemb_similarity(model: ViT) -> np.ndarray:
    """Cosine similarity between patch position embeddings.  -> [gh, gw, gh, gw]."""
    gh, gw = model.patch_grid
    pe = model.pos_embed.detach().float().cpu()[0, model.num_prefix_tokens:]  # [N, D]
    pe = torch.nn.functional.normalize(pe, dim=-1)
    return (pe @ pe.T).reshape(gh, gw, gh, gw).numpy()


@torch.no_grad()
def attention_probs(model: ViT, x: torch.Tensor) -> list[torch.Tensor]:
    """Per block, the softmax attention of every head.  x: [B, C, H, W] -> L x [B, heads, T, T]."""
    model.eval()
    t = model.patch_embed(x)
    if model.cls_token is not None:
        t = torch.cat([model.cls_token.expand(t.shape[0], -1, -1), t], dim=1)
    t = t + model.pos_embed
    probs = []
    for blk in model.blocks:
        a = blk.attn
        b, n, d = t.shape
        q, k, _ = a.qkv(blk.norm1(t)).view(b, n, 3, a.heads, a.head_dim).permute(2, 0, 3, 1, 4)
        probs.append(torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(a.head_dim), dim=-1))
        t = blk(t)
    return probs


def mean_attention_distance(model: ViT, probs: list[torch.Tensor]) -> np.ndarray:
    """Average pixel distance between query and attended patches (the "receptive field size").

    Class-token rows and columns are left out, attention renormalised over patches. -> [L, heads].
    """
    gh, gw = model.patch_grid
    stride = model.patch_embed.stride
    ys, xs = torch.meshgrid(torch.arange(gh), torch.arange(gw), indexing="ij")
    pos = torch.stack([ys.flatten(), xs.flatten()], -1).float() * stride  # [N, 2] pixels
    dist = torch.cdist(pos, pos)  # [N, N]
    pre = model.num_prefix_tokens
    out = []
    for p in probs:
        patch = p[:, :, pre:, pre:]
        patch = patch / patch.sum(-1, keepdim=True).clamp_min(1e-12)
        out.append((patch * dist).sum(-1).mean(dim=(0, 2)))  # [heads]
    return torch.stack(out).numpy()


def attention_rollout(model: ViT, probs: list[torch.Tensor]) -> np.ndarray:
    """Abnar & Zuidema's rollout as the paper uses it: average heads, add the residual identity,
    renormalise, multiply through the layers; read the class token's row.  -> [B, gh, gw] in [0, 1]."""
    b, _, t, _ = probs[0].shape
    eye = torch.eye(t)
    joint = eye.expand(b, t, t)
    for p in probs:
        a = p.mean(1) + eye
        a = a / a.sum(-1, keepdim=True)
        joint = a @ joint
    gh, gw = model.patch_grid
    if model.num_prefix_tokens:
        row = joint[:, 0, model.num_prefix_tokens:]
    else:  # no class token (GAP): how much every patch is attended to, on average
        row = joint.mean(1)
    row = row / row.amax(-1, keepdim=True).clamp_min(1e-12)
    return row.reshape(b, gh, gw).numpy()


# --------------------------------------------------------------------------------------------------
# Figures
# --------------------------------------------------------------------------------------------------
def _grid(n: int) -> tuple[int, int]:
    cols = math.ceil(math.sqrt(n))
    return math.ceil(n / cols), cols


def plot_patch_filters(model: ViT, path: Path) -> Path:
    plt = pyplot()
    comps = patch_filter_components(model)
    rows, cols = _grid(len(comps))
    fig, axes = plt.subplots(rows, cols, figsize=(cols * 1.1, rows * 1.1 + 0.6), squeeze=False)
    for i, ax in enumerate(axes.flat):
        ax.axis("off")
        if i < len(comps):
            img = comps[i] if comps.shape[-1] == 3 else comps[i][..., 0]
            ax.imshow(img, cmap=None if comps.shape[-1] == 3 else "gray", interpolation="nearest")
            ax.set_title(f"PC{i + 1}", fontsize=6)
    fig.suptitle("RGB embedding filters (first principal components)", fontsize=9)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def plot_posemb_similarity(model: ViT, path: Path) -> Path:
    plt = pyplot()
    sim = posemb_similarity(model)
    gh, gw = sim.shape[:2]
    fig, axes = plt.subplots(gh, gw, figsize=(gw * 0.6 + 1.2, gh * 0.6 + 0.8), squeeze=False)
    for r in range(gh):
        for c in range(gw):
            ax = axes[r, c]
            im = ax.imshow(sim[r, c], vmin=-1, vmax=1, cmap="viridis", interpolation="nearest")
            ax.set_xticks([])
            ax.set_yticks([])
            if c == 0:
                ax.set_ylabel(str(r + 1), fontsize=6)
            if r == gh - 1:
                ax.set_xlabel(str(c + 1), fontsize=6)
    fig.supxlabel("Input patch column", fontsize=8)
    fig.supylabel("Input patch row", fontsize=8)
    fig.suptitle("Position embedding similarity", fontsize=9)
    fig.colorbar(im, ax=axes, shrink=0.6, label="Cosine similarity")
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def plot_attention_distance(model: ViT, dist: np.ndarray, path: Path) -> Path:
    plt = pyplot()
    depth, heads = dist.shape
    fig, ax = plt.subplots(figsize=(4.5, 3.5))
    for h in range(heads):
        ax.scatter(np.arange(1, depth + 1), dist[:, h], s=12, label=f"Head {h + 1}")
    ax.set_xticks(np.arange(1, depth + 1))
    ax.set_xlabel("Network depth (layer)")
    ax.set_ylabel("Mean attention distance (pixels)")
    ax.set_title(f"ViT ({model.config['width']}d, patch {model.config['patch']})")
    ax.set_ylim(0, model.img_size[0] * math.sqrt(2))
    if heads <= 16:
        ax.legend(fontsize=5, ncol=2)
    fig.savefig(path, dpi=130, bbox_inches="tight")
    plt.close(fig)
    return path


def plot_rollout(images: torch.Tensor, maps: np.ndarray, path: Path) -> Path:
    """images: uint8 [B, 3, H, W]; maps: [B, gh, gw] in [0, 1]."""
    plt = pyplot()
    b = len(images)
    fig, axes = plt.subplots(2, b, figsize=(b * 1.6, 3.4), squeeze=False)
    for i in range(b):
        img = images[i].permute(1, 2, 0).numpy()
        up = torch.nn.functional.interpolate(torch.from_numpy(maps[i])[None, None], size=img.shape[:2],
                                             mode="bilinear", align_corners=False)[0, 0].numpy()
        axes[0, i].imshow(img)
        axes[1, i].imshow((img * up[..., None]).astype(np.uint8))
        for ax in axes[:, i]:
            ax.axis("off")
    axes[0, 0].set_title("Input", fontsize=8, loc="left")
    axes[1, 0].set_title("Attention (rollout)", fontsize=8, loc="left")
    fig.suptitle("Attention from the output token to the input space", fontsize=9)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


def write_figures(model: ViT, out_dir: str | Path, images: torch.Tensor | None = None,
                  normalize=None) -> list[Path]:
    """All figures into ``out_dir``.  images: uint8 [B, 3, H, W] at the model's resolution (the
    attention figures need inputs; without them only the weight figures are drawn).
    ``normalize``: uint8 → model input (default: [-1, 1] as the loader's ``normalize``)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model = model.float().cpu().eval()
    paths = [plot_posemb_similarity(model, out / "posemb_similarity.png")]
    if model.patch_embed.backbone is None:  # hybrids embed ResNet features, not pixels
        paths.insert(0, plot_patch_filters(model, out / "patch_filters.png"))
    if images is not None and len(images):
        x = normalize(images) if normalize else images.float() / 127.5 - 1.0
        probs = attention_probs(model, x)
        paths.append(plot_attention_distance(model, mean_attention_distance(model, probs),
                                             out / "attention_distance.png"))
        k = min(8, len(images))
        paths.append(plot_rollout(images[:k], attention_rollout(model, [p[:k] for p in probs]),
                                  out / "attention_rollout.png"))
    return paths


def load_images(paths: list[str], size: tuple[int, int]) -> torch.Tensor:
    """Image files -> uint8 [B, 3, H, W] resized to the model's input size."""
    from PIL import Image

    out = []
    for p in paths:
        try:
            with Image.open(p) as im:
                im = im.convert("RGB").resize((size[1], size[0]), Image.BICUBIC)
                out.append(torch.from_numpy(np.asarray(im).copy()).permute(2, 0, 1))
        except (OSError, ValueError) as e:
            raise ValueError(f"{p}: not a readable image ({e})") from None
    return torch.stack(out)


def loss_curve_png(records: list[dict], path: str | Path, key: str = "loss") -> Path | None:
    """Plot ``key`` against step from metrics.jsonl records; None if nothing to plot."""
    pts = [(r["step"], r[key]) for r in records if key in r]
    if not pts:
        return None
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(*zip(*pts))
    ax.set_xlabel("step")
    ax.set_ylabel(key)
    ax.set_yscale("log" if all(v > 0 for _, v in pts) else "linear")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return Path(path)
