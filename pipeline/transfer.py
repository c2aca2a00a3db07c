"""Fine-tuning a pre-trained ViT on a downstream dataset, usually at a higher resolution (paper 3.2).

    source weights (run dir | DeepSpeed checkpoint | safetensors | timm .pth | JAX .npz)
      --build the model at the target resolution: same patch size, more patches-->
      --load: pos-emb resampled in 2D to the new grid; pre-training head dropped-->
      --new zero-initialised K-way head (optionally keep the pre-logits layer)-->
      --the pre-training loop (same DeepSpeed engine, checkpoints, MLflow) with SGD momentum,
        no weight decay, cosine decay after warm-up, clip 1.0; optional layer-wise lr decay-->
      --top-1/top-5, per-class accuracy, confusion matrix on val --> RUN_DIR/results.json

    vitp transfer --config configs/transfer/tiny_cpu.yaml init.from=runs/pre data.path=shards/
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from pipeline.model import ViT, build_vit, load_pretrained, load_state_dict_into, reset_head


class TransferError(ValueError):
    """A transfer input that cannot work (missing checkpoint, other architecture, bad class count)."""


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


def read_source(path: str | Path) -> tuple[dict | None, dict | None]:
    """A transfer source -> (state dict or None for a weights file, its model config or None).

    Directories are our own run / checkpoint folders (pipeline.train.checkpoint knows their layout);
    files are left to `load_pretrained`, which sniffs the format and never unpickles code.
    """
    p = Path(path)
    if not str(path) or not p.exists():
        raise TransferError(f"init.from: {path or '(empty)'}: no such checkpoint (give a run directory, "
                            "a checkpoint folder, or a .safetensors / .pth / .npz file)")
    if p.is_dir():
        from pipeline.train.checkpoint import load_checkpoint_weights

        try:
            sd, mcfg = load_checkpoint_weights(p)
        except FileNotFoundError as e:
            raise TransferError(f"init.from: {e}") from None
        return dict(sd), dict(mcfg) if mcfg else None
    return None, _file_config(p)


_HEAD = re.compile(r"^head\.")
_REPR = re.compile(r"^pre_logits\.")


def load_source_into(model: ViT, path: str | Path, *, posemb_mode: str = "bicubic",
                     keep_representation: bool = False, sd: dict | None = None,
                     src_cfg: dict | None = None):
    """Load source weights into `model` (built at the target resolution) and give it a zero head.

    Everything except the head (and the pre-logits layer unless kept) must come from the source:
    a missing or unexpected encoder key means another architecture, which is an error naming it.
    Returns the LoadReport.
    """
    if sd is None and src_cfg is None:
        sd, src_cfg = read_source(path)
    try:
        if sd is not None:
            sd = {k: v for k, v in sd.items() if not _HEAD.match(k)}  # the paper always drops it
            old = _grid(src_cfg) if src_cfg else None
            rep = load_state_dict_into(model, sd, source=str(path), posemb_mode=posemb_mode, old_grid=old)
        else:
            rep = load_pretrained(model, path, posemb_mode=posemb_mode)
    except ValueError as e:
        raise TransferError(f"init.from: {e} (is the checkpoint the same architecture as model.*?)") from None
    missing = [k for k in rep.missing if not _HEAD.match(k)]
    unexpected = [k for k in rep.unexpected if not _HEAD.match(k)
                  and not (_REPR.match(k) and not keep_representation)]
    if missing or unexpected:
        raise TransferError(f"init.from: {path} does not match model.* (another architecture?): "
                            f"missing {missing[:4]}{'...' if len(missing) > 4 else ''}, "
                            f"unexpected {unexpected[:4]}{'...' if len(unexpected) > 4 else ''}")
    reset_head(model, model.num_classes, keep_representation=keep_representation)
    return rep


def _model_kwargs(mcfg) -> dict:
    """cfg.model -> build_vit kwargs (variant name and explicit dims)."""
    kw = {k: getattr(mcfg, k) for k in ("width", "depth", "heads", "mlp_dim", "patch")
          if getattr(mcfg, k) is not None}
    kw.update(img_size=mcfg.img_size, pool=mcfg.pool, class_token=mcfg.class_token, dropout=mcfg.dropout,
              attn_dropout=mcfg.attn_dropout, drop_path=mcfg.drop_path)
    return kw


def build_transfer_model(cfg, num_classes: int):
    """The target model at cfg.model.img_size with `num_classes` outputs, initialised from cfg.init.from.

    -> (model, LoadReport). The head is zero; pos-emb resampled to the new patch grid.
    """
    if num_classes < 1:
        raise TransferError(f"model.num_classes: need at least 1 downstream class; got {num_classes}")
    src = cfg.init.from_
    if not src:
        raise TransferError("init.from: no transfer source; pass init.from=RUN_DIR_OR_WEIGHTS")
    sd, src_cfg = read_source(src)
    rep = None
    if cfg.init.keep_representation:
        rep = (src_cfg or {}).get("representation_size") or cfg.model.representation_size
        if not rep:
            raise TransferError(f"init.keep_representation: {src} has no pre-logits layer to keep")
    try:
        model = build_vit(cfg.model.name, **_model_kwargs(cfg.model), num_classes=num_classes,
                          representation_size=rep)
    except ValueError as e:
        raise TransferError(f"model: {e}") from None
    if src_cfg and src_cfg.get("patch") is not None and cfg.model.patch is not None \
            and int(src_cfg["patch"]) != int(model.config["patch"]):
        raise TransferError(f"model.patch: {model.config['patch']} differs from the checkpoint's patch size "
                            f"{src_cfg['patch']}; fine-tuning keeps the patch size (more patches, not bigger)")
    report = load_source_into(model, src, posemb_mode=cfg.init.posemb_mode,
                              keep_representation=cfg.init.keep_representation, sd=sd, src_cfg=src_cfg)
    return model, report


def load_model(path: str | Path, *, variant: str | None = None, img_size: int | None = None,
               num_classes: int | None = None) -> ViT:
    """Any checkpoint -> a ViT in eval mode, its head included (for `vitp eval`).

    Run dirs and vitp safetensors carry their architecture; other files need `variant`
    (then the head is kept only when `num_classes` is given and matches).
    """
    sd, src_cfg = read_source(path)
    if src_cfg is None and variant is None:
        raise TransferError(f"{path}: the file does not say its architecture; pass --model (e.g. vit_b16)")
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
        raise TransferError(str(e)) from None
    if rep.missing:
        raise TransferError(f"{path}: weights missing for {rep.missing[:4]} (another architecture than --model?)")
    return model.eval()


def param_groups_layer_decay(model: ViT, lr_decay: float | None, weight_decay: float = 0.0) -> list[dict]:
    """Layer-wise lr decay (BEiT / DeiT III): block i gets lr_scale = decay^(depth - i).

    Patch embedding, class token and pos-emb count as layer 0 (scale decay^(depth + 1)), the final
    norm / pre-logits / head as layer depth + 1 (scale 1). lr_decay None: one group, scale 1.
    """
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if lr_decay is None:
        return [{"params": [p for _, p in params], "weight_decay": weight_decay, "lr_scale": 1.0}]
    depth = len(model.blocks)
    groups: dict[int, dict] = {}
    for name, p in params:
        m = re.match(r"blocks\.(\d+)\.", name)
        if m:
            layer = int(m.group(1)) + 1
        elif name.startswith(("patch_embed.", "cls_token", "pos_embed")):
            layer = 0
        else:
            layer = depth + 1
        g = groups.setdefault(layer, {"params": [], "weight_decay": weight_decay,
                                      "lr_scale": lr_decay ** (depth + 1 - layer)})
        g["params"].append(p)
    return [groups[k] for k in sorted(groups)]


# --------------------------------------------------------------------------------------------------
# The stage
# --------------------------------------------------------------------------------------------------
def source_lineage(path: str | Path) -> dict:
    """{'parent_run_id', 'parent_step', 'parent_checkpoint'} when the source is one of our run dirs."""
    from pipeline.train import checkpoint as ckpt_lib

    p = Path(path)
    if not p.is_dir():
        return {"parent_checkpoint": str(p)}
    ck = p if (p / ckpt_lib.MANIFEST).is_file() else ckpt_lib.latest_checkpoint(p)
    if ck is None:
        return {"parent_checkpoint": str(p)}
    man = ckpt_lib.read_manifest(ck)
    out = {"parent_checkpoint": str(ck), "parent_step": man.get("step")}
    if man.get("mlflow_run_id"):
        out["parent_run_id"] = man["mlflow_run_id"]
    return out


def transfer(cfg):
    """Fine-tune from cfg.init.from; returns pretrain's Result (final metrics also in RUN_DIR/results.json)."""
    import torch.distributed as dist

    from pipeline.distributed import dist_env, export_env, rank0_print
    from pipeline.train import engine as eng_lib
    from pipeline import pretrain as pt
    from pipeline.eval.classify import evaluate_model, write_results
    from pipeline.train.tracking import start_tracking

    d = dist_env()
    export_env(d)
    eng_lib.init_distributed(cfg)
    data = pt.data_module(cfg)
    k = pt.num_classes_of(cfg, data)
    torch.manual_seed(cfg.seed)  # every rank builds the same model
    model, report = build_transfer_model(cfg, k)
    if report.resampled_posemb:
        (a, b) = report.resampled_posemb
        rank0_print(f"transfer: pos-emb resampled {a[0]}x{a[1]} -> {b[0]}x{b[1]} ({cfg.init.posemb_mode}); "
                    f"new zero head for {k} classes")
    groups = param_groups_layer_decay(model, cfg.optim.layer_decay, cfg.optim.weight_decay)
    result = pt.pretrain(cfg, build_model=lambda *a: model, param_groups=groups, stage="transfer")
    if result.status != "completed":
        return result

    # final evaluation of the published weights: top-1/top-5, per-class, confusion matrix
    rank, world = dist.get_rank(), dist.get_world_size()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    final = load_model(Path(cfg.run.dir) / "model.safetensors").to(device)
    res = evaluate_model(final, cfg.data, split=cfg.data.val_split or "val", batch=cfg.eval.batch,
                         device=device, linear_probe=cfg.eval.linear_probe, out_dir=cfg.run.dir)
    lineage = source_lineage(cfg.init.from_)
    if rank == 0:
        metrics = {k_: v for k_, v in res.items() if isinstance(v, float)}
        doc = {**metrics, "step": result.step, "num_classes": k, "img_size": cfg.model.img_size,
               "posemb_resampled": [list(g) for g in report.resampled_posemb] if report.resampled_posemb else None,
               "source": str(cfg.init.from_), **lineage, "mlflow_run_id": result.mlflow_run_id}
        path = write_results(doc, cfg.run.dir)
        tracker = start_tracking(cfg, cfg.run.dir, rank=rank, world_size=world, stage="transfer",
                                 run_id=result.mlflow_run_id)
        tracker.set_tags({"stage": "transfer", **{f"vitp.{k_}": v for k_, v in lineage.items()},
                          **({"mlflow.parentRunId": lineage["parent_run_id"]} if "parent_run_id" in lineage else {})})
        tracker.log_metrics({f"final/{k_}": v for k_, v in metrics.items()}, result.step)
        for a in [path, *res.get("artifacts", [])]:
            tracker.log_artifact(a)
        example = torch.zeros(1, 3, cfg.model.img_size, cfg.model.img_size).numpy()
        tracker.log_model_pytorch(final.cpu().eval(), input_example=example,
                                  registered_name=cfg.tracking.register_name)
        tracker.close(timeout=60.0, status="FINISHED")
        split = cfg.data.val_split or "val"
        rank0_print(f"transfer: val top1 {res[split + '/top1']:.4f}  top5 {res[split + '/top5']:.4f}  -> {path}")
        result.val_top1 = res[split + "/top1"]
    dist.barrier()
    return result


def main(argv: list[str]) -> int:
    from pipeline.pretrain import stage_main

    return stage_main(argv, "transfer", "Fine-tune a pre-trained ViT at a (higher) resolution on a downstream "
                                        "dataset: init.from is a run dir, checkpoint folder, safetensors, timm "
                                        ".pth or JAX .npz.", transfer, usage_errors=(TransferError,))
