"""Offline image → WebDataset shard preparation: `prep`, `finalize`, `verify` (no torch import anywhere here)."""

from __future__ import annotations


def __getattr__(name: str):
    # lazy: `import data_prep` (e.g. by the CLI) must not pay for cv2/PIL/numpy until they are used
    if name in ("prep", "finalize"):
        from . import build as _build

        return getattr(_build, name)
    if name == "verify":
        from .checks import verify

        return verify
    raise AttributeError(name)


__all__ = ["prep", "finalize", "verify"]
