"""Small image sets written as real files and sharded by `vitp prep`, for the multi-label and few-shot tests.

- ``stripes``: multi-label. Each 32x32 PNG holds three vertical stripes coloured by its 1-3 labels
  (classes are colours), so every label is visible and the multi-hot target is learnable; the
  manifest lists labels as class names, ``a;b`` text or JSON lists, and carries bad rows.
- ``blobs``: single-label, separable for few-shot: class c is a colour plus noise; ``shuffle=True``
  keeps the images and permutes the labels (a linear probe must then be near chance).
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
from PIL import Image

COLOURS = {"red": (220, 30, 30), "green": (30, 200, 40), "blue": (40, 50, 220), "yellow": (230, 220, 30),
           "magenta": (210, 40, 200), "cyan": (40, 210, 210)}
BAD_ROWS = {  # path -> (labels cell, reject detail fragment)
    "bad/unknown.png": ("red;purple", "'purple' is not a known class"),
    "bad/empty.png": ("", "labels is empty"),
    "bad/not_a_list.png": ('{"red": 1}', "JSON list"),
    "bad/primary.png": ("red;blue", "is not one of its labels"),
}


def _png(path: Path, a: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(a).save(path)


def stripes_manifest(root: Path, n_train: int, n_val: int, seed: int = 0) -> Path:
    """Images under root/img/ and root/manifest.csv (path, labels, label, split); returns the manifest."""
    rng = np.random.default_rng(seed)
    names = list(COLOURS)
    rows = []
    for i in range(n_train + n_val):
        k = int(rng.integers(1, 4))
        labels = [names[j] for j in rng.choice(len(names), size=k, replace=False)]
        a = rng.normal(128, 20, (32, 32, 3))
        for s, (lo, hi) in enumerate(((0, 11), (11, 22), (22, 32))):
            a[:, lo:hi] = np.array(COLOURS[labels[s % k]]) + rng.normal(0, 12, (32, hi - lo, 3))
        rel = f"img/{i:05d}.png"
        _png(root / rel, np.clip(a, 0, 255).astype(np.uint8))
        cell = json.dumps(labels) if i % 3 == 0 else ";".join(labels)  # both spellings
        rows.append({"path": rel, "labels": cell, "label": "", "split": "train" if i < n_train else "val"})
    good = (root / rows[0]["path"]).read_bytes()
    for rel, (cell, _) in BAD_ROWS.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(good)
        rows.append({"path": rel, "labels": cell, "label": "green" if "primary" in rel else "", "split": "train"})
    m = root / "manifest.csv"
    with open(m, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["path", "labels", "label", "split"])
        w.writeheader()
        w.writerows(rows)
    return m


def blobs_manifest(root: Path, per_class_train: int, per_class_test: int, classes: int = 4, seed: int = 0,
                   shuffle: bool = False) -> Path:
    """Single-label images root/img/*.png and root/manifest.csv (path, label, split)."""
    rng = np.random.default_rng(seed)
    names = list(COLOURS)[:classes]
    rows = []
    for split, per in (("train", per_class_train), ("test", per_class_test)):
        for c in range(classes):
            for j in range(per):
                a = np.array(COLOURS[names[c]]) + rng.normal(0, 30, (32, 32, 3))
                rel = f"img/{split}_{c}_{j:04d}.png"
                _png(root / rel, np.clip(a, 0, 255).astype(np.uint8))
                rows.append({"path": rel, "label": names[c], "split": split})
    if shuffle:
        labels = [r["label"] for r in rows]
        for r, y in zip(rows, rng.permutation(labels)):
            r["label"] = str(y)
    m = root / "manifest.csv"
    with open(m, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["path", "label", "split"])
        w.writeheader()
        w.writerows(rows)
    return m
