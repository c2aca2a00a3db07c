"""Weights in and out: any source (a run dir, a DeepSpeed checkpoint folder, vitp/timm safetensors,
timm .pth, JAX .npz) into a ViT, and the one writer of vitp's safetensors export.

    read_source(path)            -> (state dict | None, model config | None)
    load_model(path)             a ViT in eval mode, head included (evaluation, figures, export)
    build_from_source(cfg, k)    the fine-tuning model: target resolution, pos-emb resampled in 2D,
                                 the source's head dropped for a zero K-way head (paper 3.2)
    load_checkpoint_weights(p)   consolidated fp32 weights of a run (any ZeRO stage), no engine
    save_weights(sd, config, p)  safetensors with vitp's metadata (format, model config)
    export(src, out, fmt)        `vitp export`

A DeepSpeed ``step-*`` folder is joined into one fp32 state dict by a consolidator the caller passes
(``consolidate=``, a callable ``ckpt_dir -> state dict``: the stages pass
pipeline.train.engine.fp32_state_dict), so this module reads the checkpoint layout
(pipeline.checkpoint_layout) but never imports train, nor DeepSpeed.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from pathlib import Path

import torch

from pipeline import checkpoint_layout as layout
from pipeline.errors import Classified
from pipeline.files import replacing
from pipeline.model import ViT, build_vit, load_pretrained, load_state_dict_into, reset_head

# a DeepSpeed checkpoint folder -> its consolidated fp32 state dict (pipeline.train.engine.fp32_state_dict)
Consolidate = Callable[[str], "dict[str, torch.Tensor]"]


class WeightsError(Classified, ValueError):
    """Weights that cannot work as asked (missing checkpoint, other architecture, bad class count)."""

    retry = False


# --------------------------------------------------------------------------------------------------
# Reading a source
# --------------------------------------------------------------------------------------------------
def _file_config(path: Path) -> dict | None:
    """model.config stored as metadata in a vitp safetensors file (None for other formats)."""
    with open(path, "rb") as f:
        head = f.read(16)
    if len(head) < 9 or head[8:9] != b"{":
        return None
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
    return json.loads(meta["config"]) if meta.get("format") == "vitp" and "config" in meta else None


def _grid(cfg: dict) -> tuple[int, int] | None:
    size, patch = cfg.get("img_size"), cfg.get("patch")
    if size is None or not patch or cfg.get("resnet_layers"):
        return None
    h, w = (size, size) if isinstance(size, int) else size
    return h // patch, w // patch


def read_source(path: str | Path, *, consolidate: Consolidate | None = None) -> tuple[dict | None, dict | None]:
    """A transfer source -> (state dict or None for a weights file, its model config or None).

    Directories are our own run / checkpoint folders (pipeline.checkpoint_layout knows their layout);
    files are left to `load_pretrained`, which sniffs the format and never unpickles code.
    """
    p = Path(path)
    if not str(path) or not p.exists():
        raise WeightsError(f"init.from: {path or '(empty)'}: no such checkpoint (give a run directory, "
                            "a checkpoint folder, or a .safetensors / .pth / .npz file)")
    if p.is_dir():
        try:
            sd, mcfg = load_checkpoint_weights(p, consolidate=consolidate)
        except FileNotFoundError as e:
            raise WeightsError(f"init.from: {e}") from None
        return dict(sd), dict(mcfg) if mcfg else None
    return None, _file_config(p)


_HEAD = re.compile(r"^head\.")
_REPR = re.compile(r"^pre_logits\.")


def model_kwargs(mcfg, num_classes: int) -> dict:
    """build_vit keyword arguments from a ModelCfg (explicit dims override the variant): the one
    place a config section becomes a model."""
    kw = {k: getattr(mcfg, k) for k in ("width", "depth", "heads", "mlp_dim", "patch")
          if getattr(mcfg, k) is not None}
    kw.update(img_size=mcfg.img_size, num_classes=num_classes, pool=mcfg.pool, class_token=mcfg.class_token,
              representation_size=mcfg.representation_size, dropout=mcfg.dropout,
              attn_dropout=mcfg.attn_dropout, drop_path=mcfg.drop_path)
    return kw


def build_model(cfg, num_classes: int) -> ViT:
    """The ViT that ``cfg.model`` describes, freshly initialised."""
    return build_vit(cfg.model.name, **model_kwargs(cfg.model, num_classes))


def load_source_into(model: ViT, path: str | Path, *, posemb_mode: str = "bicubic",
                     keep_representation: bool = False, sd: dict | None = None,
                     src_cfg: dict | None = None, consolidate: Consolidate | None = None):
    """Load source weights into `model` (built at the target resolution) and give it a zero head.

    Everything except the head (and the pre-logits layer unless kept) must come from the source:
    a missing or unexpected encoder key means another architecture, which is an error naming it.
    Returns the LoadReport.
    """
    if sd is None and src_cfg is None:
        sd, src_cfg = read_source(path, consolidate=consolidate)
    try:
        if sd is not None:
            sd = {k: v for k, v in sd.items() if not _HEAD.match(k)}  # the paper always drops it
            old = _grid(src_cfg) if src_cfg else None
            rep = load_state_dict_into(model, sd, source=str(path), posemb_mode=posemb_mode, old_grid=old)
        else:
            rep = load_pretrained(model, path, posemb_mode=posemb_mode)
    except ValueError as e:
        raise WeightsError(f"init.from: {e} (is the checkpoint the same architecture as model.*?)") from None
    missing = [k for k in rep.missing if not _HEAD.match(k)]
    unexpected = [k for k in rep.unexpected if not _HEAD.match(k)
                  and not (_REPR.match(k) and not keep_representation)]
    if missing or unexpected:
        raise WeightsError(f"init.from: {path} does not match model.* (another architecture?): "
                            f"missing {missing[:4]}{'...' if len(missing) > 4 else ''}, "
                            f"unexpected {unexpected[:4]}{'...' if len(unexpected) > 4 else ''}")
    reset_head(model, model.num_classes, keep_representation=keep_representation)
    return rep


def build_from_source(cfg, num_classes: int, *, consolidate: Consolidate | None = None):
    """The target model at cfg.model.img_size with `num_classes` outputs, initialised from cfg.init.from.

    -> (model, LoadReport). The head is zero; pos-emb resampled to the new patch grid.
    """
    if num_classes < 1:
        raise WeightsError(f"model.num_classes: need at least 1 downstream class; got {num_classes}")
    src = cfg.init.from_
    if not src:
        raise WeightsError("init.from: no transfer source; pass init.from=RUN_DIR_OR_WEIGHTS")
    sd, src_cfg = read_source(src, consolidate=consolidate)
    rep = None
    if cfg.init.keep_representation:
        rep = (src_cfg or {}).get("representation_size") or cfg.model.representation_size
        if not rep:
            raise WeightsError(f"init.keep_representation: {src} has no pre-logits layer to keep")
    try:
        # the paper drops the pre-training pre-logits layer unless asked to keep it
        model = build_vit(cfg.model.name, **{**model_kwargs(cfg.model, num_classes), "representation_size": rep})
    except ValueError as e:
        raise WeightsError(f"model: {e}") from None
    if src_cfg and src_cfg.get("patch") is not None and cfg.model.patch is not None \
            and int(src_cfg["patch"]) != int(model.config["patch"]):
        raise WeightsError(f"model.patch: {model.config['patch']} differs from the checkpoint's patch size "
                            f"{src_cfg['patch']}; fine-tuning keeps the patch size (more patches, not bigger)")
    report = load_source_into(model, src, posemb_mode=cfg.init.posemb_mode,
                              keep_representation=cfg.init.keep_representation, sd=sd, src_cfg=src_cfg)
    return model, report


def load_model(path: str | Path, *, variant: str | None = None, img_size: int | None = None,
               num_classes: int | None = None, consolidate: Consolidate | None = None) -> ViT:
    """Any checkpoint -> a ViT in eval mode, its head included (for `vitp eval`).

    Run dirs and vitp safetensors carry their architecture; other files need `variant`
    (then the head is kept only when `num_classes` is given and matches).
    """
    sd, src_cfg = read_source(path, consolidate=consolidate)
    if src_cfg is None and variant is None:
        raise WeightsError(f"{path}: the file does not say its architecture; pass --model (e.g. vit_b16)")
    kw = dict(src_cfg or {})
    if variant is not None:
        kw = {**kw, "num_classes": num_classes or kw.get("num_classes", 0)}
    if img_size is not None:
        kw["img_size"] = img_size
    kw.pop("variant", None)
    model = build_vit(variant, **kw)
    try:
        if sd is not None:
            rep = load_state_dict_into(model, sd, source=str(path), old_grid=_grid(src_cfg) if src_cfg else None)
        else:
            rep = load_pretrained(model, path)
    except ValueError as e:
        raise WeightsError(str(e)) from None
    if rep.missing:
        raise WeightsError(f"{path}: weights missing for {rep.missing[:4]} (another architecture than --model?)")
    return model.eval()


def source_digest(path: str | Path) -> str:
    """What a transfer source holds, as ``sha256:<hex>``: of the weights file it reads (a file, a run
    dir's model.safetensors), else of its newest complete checkpoint's manifest (which names the step
    and is rewritten with every save); a remote address is named, not read (``address:<path>``)."""
    import hashlib

    if "://" in str(path):
        return f"address:{path}"
    p = Path(path)
    target = p if p.is_file() else p / "model.safetensors" if (p / "model.safetensors").is_file() else None
    h = hashlib.sha256()
    if target is None:
        ck = layout.checkpoint_in(p) if p.is_dir() else None
        if ck is None:
            raise WeightsError(f"init.from: {path}: no weights file and no complete checkpoint to digest")
        h.update(ck.name.encode())
        target = ck / layout.MANIFEST
    with open(target, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return f"sha256:{h.hexdigest()}"


def source_lineage(path: str | Path) -> dict:
    """{'parent_run_id', 'parent_step', 'parent_checkpoint'} when the source is one of our run dirs."""
    p = Path(path)
    if not p.is_dir():
        return {"parent_checkpoint": str(p)}
    ck = layout.checkpoint_in(p)
    if ck is None:
        return {"parent_checkpoint": str(p)}
    man = layout.read_manifest(ck)
    out = {"parent_checkpoint": str(ck), "parent_step": man.get("step")}
    if man.get("mlflow_run_id"):
        out["parent_run_id"] = man["mlflow_run_id"]
    return out



# --------------------------------------------------------------------------------------------------
# Our own files: consolidated weights and the export
# --------------------------------------------------------------------------------------------------
def _read_safetensors(path: Path) -> tuple[dict, dict | None]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        sd = {k: f.get_tensor(k) for k in f.keys()}
    return sd, json.loads(meta["config"]) if "config" in meta else None


def load_checkpoint_weights(path: str | os.PathLike, *, consolidate: Consolidate | None = None
                            ) -> tuple[dict[str, torch.Tensor], dict | None]:
    """Consolidated fp32 weights + model config (build_vit kwargs) from a pre-training output.

    path: a run dir (its model.safetensors, else its newest checkpoint), a ``step-*`` checkpoint
    folder (any ZeRO stage) or a vitp .safetensors file. A checkpoint folder is joined by
    ``consolidate`` (its model config comes from the manifest); without one it is an error.
    """
    p = Path(path)
    if p.is_file():
        return _read_safetensors(p)
    if (p / "model.safetensors").is_file():
        return _read_safetensors(p / "model.safetensors")
    ck = layout.checkpoint_in(p)
    if ck is None:
        raise FileNotFoundError(f"{p}: no model.safetensors and no complete checkpoint in it")
    if consolidate is None:
        raise WeightsError(f"{ck}: a DeepSpeed checkpoint needs consolidating, and no consolidator was passed "
                           "(consolidate=pipeline.train.engine.fp32_state_dict)")
    return consolidate(str(ck)), layout.read_manifest(ck).get("model_config")


def save_weights(sd: dict[str, torch.Tensor], model_config: dict | None, path: str | os.PathLike,
                 *, fmt: str = "vitp") -> Path:
    """fp32 state dict → safetensors; fmt "vitp" adds the metadata pipeline.model.load_pretrained reads."""
    from safetensors.torch import save_file

    meta = {"format": fmt if fmt == "vitp" else "pt"}
    if model_config is not None:
        meta["config"] = json.dumps(model_config)
    with replacing(path) as tmp:
        save_file({k: v.detach().cpu().float().contiguous() for k, v in sd.items()}, str(tmp), metadata=meta)
    return Path(path)


def save_model(model: torch.nn.Module, path: str | os.PathLike) -> Path:
    """A model's weights and its build_vit config (``model.config``) as vitp safetensors."""
    return save_weights(model.state_dict(), getattr(model, "config", None), path)


def export(checkpoint: str | os.PathLike, out: str | os.PathLike, fmt: str = "safetensors", *,
           consolidate: Consolidate | None = None) -> dict:
    """Consolidated fp32 weights of ``checkpoint`` to ``out``: vitp names ("safetensors") or timm
    VisionTransformer names ("timm", also safetensors). -> {"tensors", "params"}."""
    sd, model_config = load_checkpoint_weights(checkpoint, consolidate=consolidate)
    if fmt == "timm":
        from pipeline.model.convert import vitp_to_timm

        try:
            sd, model_config = vitp_to_timm(sd), None
        except ValueError as e:  # e.g. the paper's pre-logits layer, which timm's ViT lacks
            raise WeightsError(f"{checkpoint}: cannot export as timm: {e}") from None
    save_weights(sd, model_config, out, fmt="vitp" if fmt == "safetensors" else "pt")
    return {"tensors": len(sd), "params": sum(v.numel() for v in sd.values())}



