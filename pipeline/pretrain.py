"""Upstream pre-training: ``pretrain(cfg) -> Result``, the same under run_local, torchrun, deepspeed
or a SLURM task (rank/world come from the environment).

One optimizer step = ``accum`` micro batches per rank (global batch = micro x accum x world).
Once in a while: log (console, RUN_DIR/metrics.jsonl, MLflow), evaluate on the val split, save a
checkpoint. A stop request (pipeline.train.stopping: preemption, time limit) is agreed by all ranks at a
step boundary, checkpointed and returned as status "stopped". A non-finite loss stops before the
optimizer step, saving nothing.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from pipeline.distributed import dist_env, export_env, leave_process_group, rank0_print
from pipeline.train import checkpoint as ckpt_lib
from pipeline.train import engine as eng_lib
from pipeline.train import stopping
from pipeline.config import Config, ConfigError, flatten, to_yaml, write_resolved
from pipeline.train.ema import Ema
from pipeline.train.schedule import lr_for
from pipeline.train.tracking import loss_curve_png, start_tracking


@dataclass
class Result:
    status: str  # "completed" | "stopped"
    step: int
    run_dir: str
    reason: str | None = None
    loss: float | None = None  # mean loss of the last logged window
    val_top1: float | None = None
    weights: str | None = None  # RUN_DIR/model.safetensors when completed
    mlflow_run_id: str | None = None


class NonFiniteLoss(RuntimeError):
    pass


class RunDirError(RuntimeError):
    pass


# --------------------------------------------------------------------------------------------------
# Pieces the loop uses
# --------------------------------------------------------------------------------------------------
def data_module(cfg: Config):
    """pipeline.data.synthetic for ``data.path=synthetic:...``, else the shard reader pipeline.data.loader."""
    from pipeline.data import synthetic

    if synthetic.is_synthetic(cfg.data.path):
        return synthetic
    if not cfg.data.path:
        raise ConfigError("data.path: empty; give a `vitp prep` output folder (or synthetic: for a smoke run)")
    from pipeline.data import loader as data

    return data


def num_classes_of(cfg: Config, data) -> int:
    if cfg.model.num_classes:
        return cfg.model.num_classes
    info = data.read_info(cfg.data.path)  # a dict (synthetic) or pipeline.data.loader.Info
    get = info.get if isinstance(info, dict) else lambda k: getattr(info, k, None)
    return int(get("num_classes") or len(get("classes")))


def model_kwargs(cfg: Config, num_classes: int) -> dict:
    """build_vit keyword arguments from the model section (explicit dims override the variant)."""
    m = cfg.model
    kw = dict(img_size=m.img_size, num_classes=num_classes, pool=m.pool, class_token=m.class_token,
              representation_size=m.representation_size, dropout=m.dropout,
              attn_dropout=m.attn_dropout, drop_path=m.drop_path)
    kw.update({k: getattr(m, k) for k in ("width", "depth", "heads", "mlp_dim", "patch")
               if getattr(m, k) is not None})
    return kw


def loss_fn(cfg: Config, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """logits [B, K] (fp32), targets: labels [B] int64 or soft targets [B, K] (mixup/smoothing
    already applied by the loader) → scalar. "sigmoid": the paper's per-class sigmoid
    cross-entropy, summed over classes, averaged over the batch."""
    soft = targets.ndim == 2
    if cfg.train.loss == "sigmoid":
        target = targets.to(logits.dtype) if soft else F.one_hot(targets, logits.shape[-1]).to(logits.dtype)
        return F.binary_cross_entropy_with_logits(logits, target, reduction="none").sum(-1).mean()
    if soft:
        return -(targets * F.log_softmax(logits, dim=-1)).sum(-1).mean()
    return F.cross_entropy(logits, targets, label_smoothing=cfg.data.label_smoothing)


def prepare_run_dir(cfg: Config, rank: int) -> Path | None:
    """The checkpoint to resume from, if any; refuses to reuse a foreign non-empty run dir.

    Every rank decides the same from the shared filesystem; only rank 0 deletes (run.fresh=true).
    """
    run_dir = Path(cfg.run.dir)
    latest = ckpt_lib.latest_checkpoint(run_dir)
    entries = [p.name for p in run_dir.iterdir()] if run_dir.is_dir() else []
    if cfg.run.fresh:
        dist.barrier()  # everyone has looked before rank 0 deletes
        if rank == 0 and entries:
            print(f"run.fresh=true: starting over in {run_dir} (deleting its checkpoints and metrics)", flush=True)
            shutil.rmtree(ckpt_lib.root(run_dir), ignore_errors=True)
            for name in ("metrics.jsonl", "model.safetensors", "loss_curve.png", "mlflow_spool.jsonl"):
                (run_dir / name).unlink(missing_ok=True)
        dist.barrier()
        return None
    if latest is not None:
        return latest
    ours = run_dir / "config.yaml"
    if entries and not (ours.is_file() and ours.read_text() == to_yaml(cfg)):
        raise RunDirError(f"run.dir {run_dir} is not empty and holds no complete checkpoint of this config; "
                          "pass run.fresh=true to start over there, or choose another run.dir")
    return None  # empty, or an earlier attempt of this very run that died before its first checkpoint


def keep_metrics_up_to(path: Path, step: int) -> list[dict]:
    """Drop metrics.jsonl records after ``step`` (a resume re-runs them); return the kept ones."""
    if not path.is_file():
        return []
    kept = [r for r in map(json.loads, filter(str.strip, path.read_text().splitlines())) if r["step"] <= step]
    tmp = path.with_name(".metrics.jsonl.tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
    os.replace(tmp, path)
    return kept


@torch.no_grad()
def evaluate(engine, cfg: Config, data, device, dtype) -> dict:
    """Top-1 and loss on the val split, each sample once: ranks sum (correct, loss, count).

    Ranks with fewer batches run dummy ones so every rank makes the same number of forward calls
    (ZeRO-3 gathers parameters collectively inside forward).
    """
    d = dist_env()
    loader = data.EvalLoader(cfg.data, img_size=cfg.model.img_size, batch=cfg.eval.batch, rank=d.rank,
                             world_size=d.world_size, split=cfg.data.val_split)
    engine.eval()
    sums = torch.zeros(3, dtype=torch.float64)
    it = iter(loader)
    while True:
        batch = next(it, None)
        more = torch.tensor([float(batch is not None)])
        dist.all_reduce(more, op=dist.ReduceOp.MAX)
        if not more.item():
            break
        if batch is None:
            x = torch.zeros(1, 3, cfg.model.img_size, cfg.model.img_size, dtype=torch.uint8)
            y, valid = torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.bool)
        else:  # pipeline.data.loader pads ranks to equal batch counts and marks padding valid=False
            x, y = batch[0], batch[1]
            valid = batch[2] if len(batch) > 2 else torch.ones(len(y), dtype=torch.bool)
        logits = engine(data.normalize(x.to(device)).to(dtype)).float()
        valid = valid.to(device)
        y, logits = y.to(device)[valid], logits[valid]
        if len(y):
            sums += torch.tensor([(logits.argmax(-1) == y).sum().item(),
                                  loss_fn(cfg, logits, y).item() * len(y), len(y)], dtype=torch.float64)
    dist.all_reduce(sums)
    engine.train()
    n = max(sums[2].item(), 1.0)
    return {"val_top1": sums[0].item() / n, "val_loss": sums[1].item() / n, "val_n": int(sums[2].item())}


def skipped_count(loader) -> int:
    s = getattr(loader, "skipped", 0)  # pipeline.data.loader: reason -> count
    return int(sum(s.values()) if isinstance(s, dict) else s)


def memory_gb() -> dict:
    import psutil

    out = {"rss_gb": psutil.Process().memory_info().rss / 2**30}
    if torch.cuda.is_available():
        out["cuda_max_gb"] = torch.cuda.max_memory_allocated() / 2**30
    return out


def step_flops(model, cfg: Config, images_per_rank: int) -> float:
    try:
        from pipeline.model.flops import train_step_flops

        return float(train_step_flops(model.config, batch=images_per_rank,
                                      grad_checkpointing=cfg.model.grad_checkpointing))
    except Exception:  # MFU is a nicety; a model the counter does not know just reports none
        return float("nan")


def draw_figures(sd: dict, model_config: dict, images: torch.Tensor | None, out: Path) -> list[Path]:
    """The paper's figures for the final weights (attention panels over a few training images);
    a figure that fails to draw warns and never fails the run."""
    from pipeline.eval.figures import write_figures
    from pipeline.model import build_vit

    try:
        model = build_vit(**model_config)
        model.load_state_dict(sd)
        return write_figures(model, out, None if images is None else images.cpu())
    except Exception as e:  # figures are a report, not a result
        warnings.warn(f"figures not drawn: {type(e).__name__}: {e}", stacklevel=2)
        return []


# --------------------------------------------------------------------------------------------------
# The stage
# --------------------------------------------------------------------------------------------------
def pretrain(cfg: Config, *, build_model=None, param_groups: list[dict] | None = None,
             stage: str = "pretrain") -> Result:
    """Train ``cfg``; the same loop serves fine-tuning: ``build_model(cfg, num_classes)`` replaces
    the ViT built from ``cfg.model`` and ``param_groups`` (e.g. layer-wise lr decay) the default
    weight-decay groups; ``stage`` tags the MLflow run."""
    d = dist_env()
    export_env(d)
    eng_lib.init_distributed(cfg)
    rank, world = dist.get_rank(), dist.get_world_size()
    run_dir = Path(cfg.run.dir)
    resume_from = prepare_run_dir(cfg, rank)
    data = data_module(cfg)

    # model: identical initialisation on every rank, then per-rank randomness (dropout)
    from pipeline.model import build_vit

    torch.manual_seed(cfg.seed)
    num_classes = num_classes_of(cfg, data)
    if build_model is not None:
        model = build_model(cfg, num_classes)
    else:
        model = build_vit(cfg.model.name, **model_kwargs(cfg, num_classes))
    torch.manual_seed(cfg.seed * 1000 + rank)
    universal = ckpt_lib.universal_for(resume_from, world) if resume_from else None
    engine = eng_lib.build_engine(model, cfg, param_groups, load_universal=universal is not None)
    device, dtype = engine.device, eng_lib.input_dtype(cfg)
    accum = eng_lib.grad_accumulation(cfg, world)
    loader = data.TrainLoader(cfg.data, img_size=cfg.model.img_size, micro_batch=cfg.train.micro_batch,
                              global_batch=cfg.train.global_batch, rank=rank, world_size=world, seed=cfg.seed)

    ema = Ema(engine.module, cfg.optim.ema) if cfg.optim.ema else None
    step, run_id, run_key, history = 0, None, None, []
    metrics_path = run_dir / "metrics.jsonl"
    if resume_from is not None:
        state = ckpt_lib.resume(engine, resume_from, universal)
        step, run_id = state["step"], state["manifest"].get("mlflow_run_id")
        run_key = state["manifest"].get("mlflow_run_key")
        loader.load_state_dict(state["loader"])
        if ema is not None:
            ema.load_state_dict({k[4:]: v for k, v in state["shared"].items() if k.startswith("ema/")})
        rank0_print(f"resuming from {resume_from} (step {step}, saved by {state['manifest']['world_size']} ranks)")
    if rank == 0:
        write_resolved(cfg, run_dir)
        history = keep_metrics_up_to(metrics_path, step)
    tracker = start_tracking(cfg, run_dir, rank=rank, world_size=world, stage=stage, run_id=run_id,
                             run_key=run_key, params=flatten(cfg))  # logged only if a new run is made
    n_params = sum(p.numel() for p in model.parameters()) if cfg.engine.zero_stage < 3 else None
    rank0_print(f"pretrain: {world} rank(s), ZeRO-{cfg.engine.zero_stage}, {cfg.engine.precision}, "
                f"global batch {cfg.train.global_batch} = {cfg.train.micro_batch} x {accum} accum x {world}, "
                f"steps {step}->{cfg.train.steps}" + (f", {n_params / 1e6:.2f}M params" if n_params else ""))

    def save(at_step: int) -> Path:
        manifest = {"config": json.loads(json.dumps(flatten(cfg))), "model_config": model.config,
                    "zero_stage": cfg.engine.zero_stage, "precision": cfg.engine.precision,
                    "mlflow_run_id": tracker.run_id, "mlflow_run_key": tracker.run_key}
        shared = {f"ema/{k}": v for k, v in ema.state_dict().items()} if ema is not None else None
        return ckpt_lib.save(engine, run_dir, at_step, loader_state=loader.state_dict(), manifest=manifest,
                             keep=cfg.checkpoint.keep, shared=shared)

    def log(record: dict) -> None:
        if rank == 0:
            history.append(record)
            with open(metrics_path, "a") as f:
                f.write(json.dumps(record) + "\n")
            tracker.log_metrics({k: v for k, v in record.items() if k != "step"}, record["step"])

    flops = step_flops(model, cfg, cfg.train.micro_batch * accum)
    window = torch.zeros(3, dtype=torch.float64)  # loss sum, correct, count over logged steps
    t_window, steps_window, saved_at, last = time.perf_counter(), 0, None, {}
    batches = loader.forever() if hasattr(loader, "forever") else iter(loader)  # across epochs
    mix = getattr(loader, "mix", None)  # pipeline.data.loader: mixup/cutmix/smoothing → soft targets
    images = None  # the last batch: its first images feed the attention figures at the end
    engine.train()
    while step < cfg.train.steps:
        ckpt_lib.maybe_fault("step", step + 1)
        lr = lr_for(cfg, step)
        eng_lib.set_lr(engine, lr)

        # forward/backward over the micro batches; DeepSpeed averages and reduces the gradients
        local = torch.zeros(3, dtype=torch.float64)
        for m in range(accum):
            images, labels = next(batches)
            labels = labels.to(device)
            x = data.normalize(images.to(device))
            x, targets = mix(x, labels) if mix is not None else (x, labels)
            logits = engine(x.to(dtype)).float()
            loss = loss_fn(cfg, logits, targets)
            engine.backward(loss)
            if m < accum - 1:
                engine.step()  # not a boundary: DeepSpeed only counts the micro step
            local += torch.tensor([loss.item() * len(labels), (logits.argmax(-1) == labels).sum().item(),
                                   len(labels)], dtype=torch.float64)

        # one small all-reduce a step: any rank asking to stop (2: requeue, which wins over 1: any
        # other reason, e.g. cancel), any rank with a non-finite loss
        asked = stopping.stop_reason()
        flags = torch.tensor([0.0 if asked is None else 2.0 if asked == "requeue" else 1.0,
                              float(not math.isfinite(local[0]))])
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        if flags[1]:
            good = ckpt_lib.latest_checkpoint(run_dir)
            tracker.close(timeout=10.0)
            raise NonFiniteLoss(f"step {step + 1}: non-finite loss (lr {lr:.3g}); stopped before the optimizer "
                                f"step, nothing saved; last complete checkpoint: {good or 'none'}")
        engine.step()  # the boundary: clip, optimizer update
        if ema is not None:
            ema.update(engine.module)
        step += 1
        window += local
        steps_window += 1

        record = {}
        if step % cfg.train.log_every == 0 or step == cfg.train.steps:
            dist.all_reduce(window)
            dt = (time.perf_counter() - t_window) / steps_window
            record.update(loss=window[0].item() / window[2].item(), top1=window[1].item() / window[2].item(),
                          lr=lr, grad_norm=eng_lib.grad_norm(engine),
                          images_per_s=cfg.train.global_batch / dt, step_s=dt,
                          mfu=flops / dt / (cfg.hardware.peak_tflops * 1e12), skipped=skipped_count(loader),
                          **memory_gb())
            rank0_print(f"step {step:>7d}/{cfg.train.steps}  loss {record['loss']:.4f}  top1 {record['top1']:.3f}  "
                        f"lr {lr:.2e}  gnorm {record['grad_norm']:.3f}  {record['images_per_s']:.1f} img/s  "
                        f"mfu {record['mfu']:.1%}  rss {record['rss_gb']:.1f}G")
            window.zero_()
        if cfg.data.val_split and cfg.train.eval_every and step % cfg.train.eval_every == 0:
            record.update(evaluate(engine, cfg, data, device, dtype))
            rank0_print(f"step {step:>7d}  val top1 {record['val_top1']:.4f}  ({record['val_n']} images)")
        if record:
            log({"step": step, **record, "time": time.time()})
            last.update(record)

        if flags[0]:
            reason = "requeue" if flags[0] == 2 else (stopping.stop_reason() or "cancel")
            path = save(step)
            rank0_print(f"stopping at step {step} ({reason}); checkpoint {path}")
            tracker.close(timeout=min(60.0, max(5.0, 10 * cfg.tracking.flush_every_s)))
            return Result("stopped", step, str(run_dir), reason=reason, loss=last.get("loss"),
                          mlflow_run_id=tracker.run_id)
        if cfg.checkpoint.every and step % cfg.checkpoint.every == 0 and step < cfg.train.steps:
            save(step)
            saved_at = step
        if record or saved_at == step:  # eval, logging and saving are not training time
            t_window, steps_window = time.perf_counter(), 0

    # the end: final checkpoint, final eval, consolidated fp32 weights, artifacts
    final = save(step) if saved_at != step else ckpt_lib.root(run_dir) / ckpt_lib.tag_for(step)
    if cfg.data.val_split and "val_top1" not in last:
        last.update(evaluate(engine, cfg, data, device, dtype))
        rank0_print(f"final val top1 {last['val_top1']:.4f} ({last['val_n']} images)")
        log({"step": step, **{k: v for k, v in last.items() if k.startswith("val_")}, "time": time.time()})
    weights = run_dir / "model.safetensors"
    if rank == 0:
        sd, model_config = ckpt_lib.load_checkpoint_weights(final)
        if ema is not None:  # the averaged weights are the ones to ship; raw ones stay in checkpoints
            averaged = ema.state_dict()
            sd = {k: averaged.get(k, v) for k, v in sd.items()}
        ckpt_lib.save_weights(sd, model_config, weights)
        png = loss_curve_png(history, run_dir / "loss_curve.png")
        for path in (run_dir / "config.yaml", weights, png):
            if path is not None:
                tracker.log_artifact(path)
        for path in draw_figures(sd, model_config, None if images is None else images[:8], run_dir / "figures"):
            tracker.log_artifact(path, "figures")
        rank0_print(f"done: {weights}")
    dist.barrier()
    tracker.close(timeout=min(60.0, max(5.0, 10 * cfg.tracking.flush_every_s)),
                  status=None if stage == "transfer" else "FINISHED")  # transfer still logs its model
    return Result("completed", step, str(run_dir), loss=last.get("loss"), val_top1=last.get("val_top1"),
                  weights=str(weights), mlflow_run_id=tracker.run_id)


def stage_main(argv: list[str], command: str, description: str, fn, usage_errors: tuple = ()) -> int:
    """`vitp pretrain|transfer --config X.yaml [overrides]`: parse, validate (exit 2 before anything
    starts), run ``fn(cfg)`` in this process group; exit 1 on a non-finite loss, 2 on a usage error."""
    from launch.cli import add_config_args, load_config_or_exit, parser_for

    p = parser_for(command, description)
    add_config_args(p)
    args = p.parse_args(argv)
    cfg = load_config_or_exit(args, world_size=dist_env().world_size)
    try:
        result = fn(cfg)
    except NonFiniteLoss as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 1
    except (RunDirError, ConfigError, FileNotFoundError, *usage_errors) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    finally:
        leave_process_group()
    rank0_print(f"{command} {result.status} at step {result.step}" + (f" ({result.reason})" if result.reason else ""))
    return 0


def main(argv: list[str]) -> int:
    return stage_main(argv, "pretrain", "pre-train a ViT with DeepSpeed ZeRO; resumes from RUN_DIR's newest "
                                        "complete checkpoint (run.fresh=true starts over)", pretrain)
