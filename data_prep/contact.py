"""``OUT/near_duplicates.png``: the training images `--exclude-near` dropped, each beside the test image it
matched, with their distance, so a person can check the threshold's decisions. The matches nearest the
threshold come first (the ones a threshold decides); at most :data:`ROWS` of them."""

from __future__ import annotations

import io
import os

from PIL import Image, ImageDraw, ImageOps

from . import store
from .images import NEAR_DUPLICATE
from .testsets import MANIFEST_EXTS

SHEET_FILE = "near_duplicates.png"
ROWS, THUMB, GAP = 24, 112, 8


def _thumb(data: bytes | None) -> Image.Image:
    if data is None:
        return Image.new("RGB", (THUMB, THUMB), (128, 128, 128))
    im = ImageOps.exif_transpose(Image.open(io.BytesIO(data))).convert("RGB")
    im.thumbnail((THUMB, THUMB))
    return im


def _read(address: str) -> bytes | None:
    try:
        return store.read_bytes(address)
    except (OSError, ValueError):  # a sheet is for a person's eyes: a missing picture is a grey square
        return None


def write_sheet(out, root: str, rejects: list[dict], addresses: list[str], threshold: int) -> int:
    """Draw the sheet from ``rejects`` (rejects.jsonl's lines); ``root``: the training source's folder,
    ``addresses``: the test sets as given (their public form is what each ``of`` starts with).
    Returns the rows drawn (0: no near-duplicate, no sheet)."""
    near = sorted((r for r in rejects if r["reason"] == NEAR_DUPLICATE), key=lambda r: (-r["distance"], r["path"]))
    near = near[:ROWS]
    if not near:
        return 0
    real = {store.public(a): a for a in addresses}
    row_h = THUMB + GAP
    sheet = Image.new("RGB", (2 * THUMB + 3 * GAP + 150, len(near) * row_h + GAP + 20), (255, 255, 255))
    draw = ImageDraw.Draw(sheet)
    draw.text((GAP, 4), f"training image | test image | distance (threshold {threshold})", fill=(0, 0, 0))
    for i, r in enumerate(near):
        y = 20 + i * row_h
        public = next((p for p in real if r["of"].startswith(p + "/")), None)
        base = real[public] if public else None
        if base is not None and base.lower().endswith(MANIFEST_EXTS):  # its paths are relative to its folder
            base = base.rsplit("/", 1)[0] if "/" in base else "."
        # a prep output's image is named by its key, not a file: a grey square
        test = store.join(base, r["of"][len(public) + 1:]) if base is not None else None
        sheet.paste(_thumb(_read(os.path.join(root, r["path"]))), (GAP, y))
        sheet.paste(_thumb(_read(test) if test else None), (2 * GAP + THUMB, y))
        draw.text((3 * GAP + 2 * THUMB, y + THUMB // 2 - 6), f"d = {r['distance']}", fill=(0, 0, 0))
    buf = io.BytesIO()
    sheet.save(buf, "PNG")
    store.write_file(out, SHEET_FILE, buf.getvalue())
    return len(near)
