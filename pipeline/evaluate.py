"""The evaluation stage: ``evaluate(cfg) -> EvalResult``, for `vitp eval` and `vitp submit eval`.

Scores the checkpoint ``cfg.eval.checkpoint`` on ``cfg.data.path``: top-1/top-5, per-class accuracy
and the confusion matrix on ``cfg.eval.split``; few-shot linear evaluation and a linear probe on
frozen features fitted on ``cfg.data.train_split``. Under a launcher every rank scores its own part
of the split; rank 0 writes ``results.json`` (keys ``eval/...``) and the artifacts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from pipeline.config import Config, ConfigError
from pipeline.data import DataError, read_info
from pipeline.distributed import choose_accelerator, comm_device, dist_env, export_env, init_process_group
from pipeline.eval.classify import evaluate_model, write_results
from pipeline.weights import load_model


@dataclass
class EvalResult:
    status: str  # "completed"
    metrics: dict[str, float] = field(default_factory=dict)
    results: str | None = None  # results.json (rank 0)
    fewshot_text: str | None = None


def default_out(checkpoint: str) -> Path:
    c = Path(checkpoint)
    return c if c.is_dir() else Path(f"eval_{c.stem}")


def evaluate(cfg: Config) -> EvalResult:
    e = cfg.eval
    if not e.checkpoint:
        raise ConfigError("eval.checkpoint: give the run directory or weights file to evaluate")
    if not e.top1 and not e.fewshot and not e.linear_probe:
        raise ConfigError("eval: nothing to do (top1, fewshot and linear_probe are all off)")
    for split in [e.split, *([cfg.data.train_split] if e.fewshot or e.linear_probe else [])]:
        try:
            read_info(cfg.data.path).split(split)
        except DataError as err:
            raise FileNotFoundError(str(err)) from None
    d = dist_env()
    kind = choose_accelerator(cfg.engine.backend)  # a submitted job's GPU request is checked at job start
    if d.world_size > 1:
        export_env(d)
        init_process_group(d, cfg.engine.backend, cfg.engine.dist_timeout_s)
        device = comm_device()
    else:
        device = torch.device(kind)
    model = load_model(e.checkpoint, variant=e.variant, img_size=e.img_size).to(device)
    out_dir = Path(e.out) if e.out else default_out(e.checkpoint)
    res = evaluate_model(model, cfg.data, split=e.split, batch=e.batch, device=device, classify_split=e.top1,
                         fewshot_cfg=e if e.fewshot else None, linear_probe=e.linear_probe, out_dir=out_dir,
                         train_split=cfg.data.train_split, max_train_images=e.max_train_images,
                         autocast=torch.bfloat16 if device.type == "cuda" else None)
    text = res.pop("fewshot_text", None)
    metrics = {k: v for k, v in res.items() if isinstance(v, float)}
    path = None
    if d.rank == 0:
        path = str(write_results({f"eval/{k}": v for k, v in res.items()}, out_dir))
    return EvalResult("completed", metrics, path, text)
