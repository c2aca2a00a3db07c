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


def _mosaic(tiles: np.ndarray, cols: int, gap: float = np.nan) -> np.ndarray:
    """tiles [n, h, w(, c)] -> one image [rows*(h+1)-1, cols*(w+1)-1(, c)], row by row, the tiles apart
    by one pixel of ``gap``. One image on one Axes draws in a fraction of the time a grid of Axes takes
    (each Axes costs matplotlib ~20 ms to make and draw: 196 of them for a 14x14 position grid)."""
    n, h, w = tiles.shape[:3]
    rows = math.ceil(n / cols)
    out = np.full((rows * (h + 1) - 1, cols * (w + 1) - 1, *tiles.shape[3:]), gap, dtype=np.float64)
    for i in range(n):
        r, c = divmod(i, cols)
        out[r * (h + 1):r * (h + 1) + h, c * (w + 1):c * (w + 1) + w] = tiles[i]
    return out


def _tile_ticks(ax, rows: int, cols: int, h: int, w: int, fontsize: float) -> None:
    """Tick each tile's row and column (1-based) at its centre."""
    ax.set_xticks([c * (w + 1) + (w - 1) / 2 for c in range(cols)], [str(c + 1) for c in range(cols)],
                  fontsize=fontsize)
    ax.set_yticks([r * (h + 1) + (h - 1) / 2 for r in range(rows)], [str(r + 1) for r in range(rows)],
                  fontsize=fontsize)
    ax.tick_params(length=0)
    for side in ax.spines.values():
        side.set_visible(False)


def plot_patch_filters(model: ViT, path: Path) -> Path:
    plt = pyplot()
    comps = patch_filter_components(model)  # [k, P, P, C]
    _, cols = _grid(len(comps))
    gray = comps.shape[-1] != 3
    img = _mosaic(comps[..., 0] if gray else comps, cols, gap=1.0)  # white between filters
    fig, ax = plt.subplots(figsize=(cols * 1.1, cols * 1.1 * img.shape[0] / img.shape[1] + 0.4))
    ax.imshow(img, cmap="gray" if gray else None, vmin=0, vmax=1, interpolation="nearest")
    ax.axis("off")
    ax.set_title(f"RGB embedding filters (first {len(comps)} principal components, row by row)", fontsize=9)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def plot_posemb_similarity(model: ViT, path: Path) -> Path:
    plt = pyplot()
    sim = posemb_similarity(model)  # [gh, gw, gh, gw]
    gh, gw = sim.shape[:2]
    img = np.ma.masked_invalid(_mosaic(sim.reshape(gh * gw, gh, gw), gw))
    cmap = plt.get_cmap("viridis").with_extremes(bad="white")
    fig, ax = plt.subplots(figsize=(gw * 0.6 + 1.2, gh * 0.6 + 0.8))
    im = ax.imshow(img, vmin=-1, vmax=1, cmap=cmap, interpolation="nearest")
    _tile_ticks(ax, gh, gw, gh, gw, fontsize=6)
    ax.set_xlabel("Input patch column", fontsize=8)
    ax.set_ylabel("Input patch row", fontsize=8)
    ax.set_title("Position embedding similarity", fontsize=9)
    fig.colorbar(im, ax=ax, shrink=0.6, label="Cosine similarity")
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
