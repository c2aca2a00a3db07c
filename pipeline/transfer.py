"""Fine-tuning a pre-trained ViT on a downstream dataset, usually at a higher resolution (paper 3.2).

    source weights (run dir | DeepSpeed checkpoint | safetensors | timm .pth | JAX .npz)
      --build the model at the target resolution: same patch size, more patches-->
      --load: pos-emb resampled in 2D to the new grid; pre-training head dropped-->
      --new zero-initialised K-way head (optionally keep the pre-logits layer)-->
      --the one training loop (same DeepSpeed engine, checkpoints, MLflow) with SGD momentum,
        no weight decay, cosine decay after warm-up, clip 1.0; optional layer-wise lr decay-->
      --top-1/top-5, per-class accuracy, confusion matrix on val, and the declared
        `evals:` entries --> RUN_DIR/results.json

    vitp transfer --config configs/transfer/tiny_cpu.yaml init.from=runs/pre data.path=shards/
"""

from __future__ import annotations

from pathlib import Path

import torch

from pipeline.config import Config, ConfigError, EvalEntry
from pipeline.data import check_splits, minival_source, read_info
from pipeline.distributed import rank0_print, setup
from pipeline.eval import evaluators as evals
from pipeline.eval.loop import write_results
from pipeline.eval.task import Task
from pipeline.rundir import own_run_dir
from pipeline.stops import Status
from pipeline.train.build import build_run
from pipeline.train.engine import fp32_state_dict, param_groups_layer_decay
from pipeline.train.loop import Finished, Result, train
from pipeline.weights import build_from_source, load_model, source_lineage


def transfer(cfg: Config) -> Result:
    """Fine-tune from cfg.init.from; the final metrics also go to RUN_DIR/results.json and MLflow."""
    if cfg.model.patch_drop:
        raise ConfigError(f"model.patch_drop: {cfg.model.patch_drop} is for pre-training; transfer fine-tunes "
                          "on every patch (set it to 0)")
    report = None

    def build(num_classes: int):
        nonlocal report
        model, report = build_from_source(cfg, num_classes, consolidate=fp32_state_dict)
        if report.resampled_posemb:
            (a, b) = report.resampled_posemb
            rank0_print(f"transfer: pos-emb resampled {a[0]}x{a[1]} -> {b[0]}x{b[1]} ({cfg.init.posemb_mode}); "
                        f"new zero head for {num_classes} classes")
        return model

    def publish(run: Finished) -> None:
        """Evaluate the published weights (every rank: the eval is collective); rank 0 records them."""
        device = run.engine.device
        final = load_model(Path(cfg.run.dir) / "model.safetensors").to(device)
        split = cfg.data.val_split or "val"
        entries = [("data.val_split", EvalEntry(name=split, type="classify", split=split))]
        if cfg.eval.linear_probe:
            entries.append(("eval.linear_probe", EvalEntry(name="linear_probe", type="linear_probe",
                                                           train_split=cfg.data.train_split, test_split=split)))
        # the declared evals: also score the published weights, into results.json (a suite's final columns)
        entries += [(key, e) for key, e in evals.run_entries(cfg) if key.startswith("evals[")]
        ctx = evals.Context(cfg.data, Task.of(read_info(cfg.data.path), cfg.train.loss), img_size=cfg.model.img_size,
                            batch=cfg.eval.batch, device=device, rank=run.rank, world=run.world, report=True,
                            out_dir=Path(cfg.run.dir), autocast=torch.bfloat16 if device.type == "cuda" else None)
        done = evals.run_all([d.build(ctx) for d in evals.declare(entries)], final, run.result.step)
        res = done.metrics
        run.result.val_top1 = res.get(split + "/top1")  # None on multi-label data (prec1, mAP instead)
        if run.rank != 0:
            return
        lineage = source_lineage(cfg.init.from_)
        metrics = {k: v for k, v in res.items() if isinstance(v, float)}
        doc = {**metrics, "step": run.result.step, "num_classes": final.num_classes, "img_size": cfg.model.img_size,
               "posemb_resampled": [list(g) for g in report.resampled_posemb] if report.resampled_posemb else None,
               "source": str(cfg.init.from_), **lineage, "mlflow_run_id": run.result.mlflow_run_id}
        path = write_results(doc, cfg.run.dir)
        run.tracker.set_tags({"stage": "transfer", **{f"vitp.{k}": v for k, v in lineage.items()},
                              **({"mlflow.parentRunId": lineage["parent_run_id"]}
                                 if "parent_run_id" in lineage and not cfg.tracking.parent_run else {})})
        run.tracker.log({f"final/{k}": v for k, v in metrics.items()}, run.result.step)
        for a in [path, *done.artifacts]:
            run.tracker.log_artifact(a)
        # two images: the logged program's batch dimension stays dynamic (a batch of 1 would fix it)
        example = torch.zeros(2, 3, cfg.model.img_size, cfg.model.img_size).numpy()
        if cfg.tracking.log_model:
            run.tracker.log_model(final.cpu().eval(), input_example=example,
                                  registered_name=cfg.tracking.register_name)
        shown = "  ".join(f"{k} {res[f'{split}/{k}']:.4f}" for k in ("top1", "top5", "prec1", "mAP")
                          if f"{split}/{k}" in res)
        rank0_print(f"transfer: val {shown}  -> {path}")

    check_splits(cfg.data.path, {"data.val_split": cfg.data.val_split or "val"},  # publish scores it
                 minival_from=minival_source(cfg.data))
    setup(cfg)
    with own_run_dir(cfg.run.dir) as claim:  # one job at a time in a run dir (pipeline/rundir.py)
        groups = lambda m: param_groups_layer_decay(m, cfg.optim.layer_decay, cfg.optim.weight_decay)  # noqa: E731
        run = build_run(cfg, build, stage="transfer", param_groups=groups)
        result = train(run, finish=publish)
        claim.finished = result.status == Status.COMPLETED
    return result
