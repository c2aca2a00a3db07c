"""Argument parsing of every stage command, and what each prints; the stages themselves are library
functions of a typed config (pipeline.pretrain, .transfer, .evaluate) that know nothing of argv.

Exit codes (launch/cli.py maps the errors, the same for every command): 0 done (or stopped for a
requeue), 1 a non-finite loss, 2 a usage or input error (one line naming the key, file or value, before
anything starts where it can be known then), 143 stopped by SIGTERM after a checkpoint.

A command imports its stage (torch, the model, DeepSpeed) only once its command line and config are
checked: `--help` and a mistake answer without loading them.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from launch.cli import add_config_args, load_args_config, parser_for
from pipeline.stops import Status


def stop_on_term() -> None:
    """SIGTERM asks for a checkpoint at the next step boundary, as scancel does under SLURM
    (launch/job_body.py, which installs its own). It reaches a local or torchrun rank from a user's
    kill, torchrun's agent, or the launcher stopping the ranks after one of them died: such a rank then
    fails in its next collective and, on the way out, still delivers or spools the tracking records it
    holds, which the default action (die at once) lost."""
    import signal

    from pipeline import stops

    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, lambda signum, frame: stops.request_stop(stops.Stop.CANCEL))


def evaluators_of(cfg, stage: str | None = None) -> list:
    """The declared evaluators (pipeline/eval/evaluators) of ``stage`` (default: a training stage for
    a training config, else eval), checked without reading data: a bad entry is one line naming its
    key (exit 2) before anything is queued or started."""
    from pipeline.config import Config
    from pipeline.eval import evaluators as evals

    training = stage != "eval" if stage else isinstance(cfg, Config)
    return evals.declare(evals.run_entries(cfg) if training else evals.eval_entries(cfg))


def check_addresses(cfg, stage: str | None = None) -> None:
    """Every remote dataset the stage reads (data.path, each evaluator's data) answers, before
    anything is queued or started: a missing bucket, a 403 or a 404 is one line naming the key, the
    address (without its query string) and the reason (data_prep.store.AddressError, exit 2). Local
    folders are checked, with their split names, by pipeline.data.check_splits."""
    from data_prep import store
    from pipeline.data import source_for

    extra = [(f"{d.key}.data" if d.key.startswith("evals[") else d.key, d.entry.data)
             for d in evaluators_of(cfg, stage)]
    for key, address in [("data.path", cfg.data.path), *extra]:
        if address and store.is_remote(address):
            source_for(address).check_reachable(key)


def stage_main(argv: list[str], command: str, description: str, fn) -> int:
    """`vitp pretrain|transfer --config X.yaml [overrides]`: parse, validate (exit 2 before anything
    starts), run ``fn(cfg)`` in this process group; 143 (128 + SIGTERM) when a SIGTERM stopped it after
    saving a checkpoint (run it again to resume). Errors: launch/cli.py's run_command."""
    from pipeline.distributed import dist_env, leave_process_group, rank0_print

    p = parser_for(command, description)
    add_config_args(p)
    args = p.parse_args(argv)
    cfg = load_args_config(args, world_size=dist_env().world_size)
    check_addresses(cfg)
    stop_on_term()
    try:
        result = fn(cfg)
    finally:
        leave_process_group()
    rank0_print(f"{command} {result.status} at step {result.step}" + (f" ({result.reason})" if result.reason else "")
                + _data_wait_summary(getattr(result, "data_wait", None)))
    return 143 if result.status == Status.STOPPED else 0


def _data_wait_summary(data_wait: float | None) -> str:
    """'; waited for data 3% of the training time', and why it matters when over 10%."""
    from pipeline.train.periodic import DATA_WAIT_WARN

    if data_wait is None:
        return ""
    out = f"; waited for data {data_wait:.0%} of the training time"
    if data_wait > DATA_WAIT_WARN:
        out += f" (warning: over {DATA_WAIT_WARN:.0%}: the loader is the bottleneck)"
    return out


def _pretrain(cfg):
    from pipeline.pretrain import pretrain

    return pretrain(cfg)


def _transfer(cfg):
    from pipeline.transfer import transfer

    return transfer(cfg)


def pretrain_main(argv: list[str]) -> int:
    return stage_main(argv, "pretrain", "pre-train a ViT with DeepSpeed ZeRO; resumes from RUN_DIR's newest "
                                        "complete checkpoint (run.fresh=true starts over)", _pretrain)


def transfer_main(argv: list[str]) -> int:
    return stage_main(argv, "transfer", "Fine-tune a pre-trained ViT at a (higher) resolution on a downstream "
                                        "dataset: init.from is a run dir, checkpoint folder, safetensors, timm "
                                        ".pth or JAX .npz.", _transfer)


# --------------------------------------------------------------------------------------------------
# vitp eval (and vitp submit eval: the same flags)
# --------------------------------------------------------------------------------------------------
def add_eval_args(p: argparse.ArgumentParser) -> None:
    from pipeline.data import kinds_help

    p.add_argument("--checkpoint", required=True,
                   help="a run directory (pretrain/transfer), a DeepSpeed checkpoint folder, or a weights file "
                        "(vitp .safetensors; timm .pth/.safetensors or JAX .npz need --model)")
    p.add_argument("--data", required=True, help=f"{kinds_help()}; a folder, s3://, gs:// or https:// address")
    p.add_argument("--split", default="val", help="split to score (default: val)")
    p.add_argument("--fewshot", action="store_true", help="few-shot linear evaluation (train split -> --split)")
    p.add_argument("--shots", default="1,5,10,25", help="few-shot shots per class (default: 1,5,10,25)")
    p.add_argument("--seeds", type=int, default=3, help="few-shot draws per shot count (default: 3)")
    p.add_argument("--l2", type=float, default=1024.0,
                   help="few-shot ridge regulariser (default: 1024, big_vision's 2^10)")
    p.add_argument("--linear-probe", action="store_true", help="logistic regression on frozen features")
    p.add_argument("--no-top1", action="store_true", help="skip scoring the model's own head")
    p.add_argument("--model", default=None, help="architecture for weight files without a config, e.g. vit_b16")
    p.add_argument("--img-size", type=int, default=None, help="evaluate at this resolution (pos-emb resampled)")
    p.add_argument("--batch", type=int, default=64, help="images per rank per batch (default: 64)")
    p.add_argument("--max-train-images", type=int, default=None,
                   help="the linear probe's training images, in all (a seeded draw; default: the whole split)")
    p.add_argument("--out", default=None, help="where results.json and artifacts go (default: the run dir, "
                                               "else ./eval_<checkpoint name>)")
    p.add_argument("--evals", default=None, metavar="FILE",
                   help="a YAML list of evaluators (or a file with an evals: list), run instead of the ones "
                        "--no-top1/--fewshot/--linear-probe choose (see the README's evaluation section)")


def eval_overrides(args: argparse.Namespace) -> list[str]:
    """`vitp eval` flags -> overrides of the evaluation stage's config (pipeline.config.EvalConfig)."""
    from data_prep import store
    from pipeline.config import ConfigError
    from pipeline.data import local_source, source_for

    remote = store.is_remote(args.data)
    if remote:
        source_for(args.data).check_reachable("--data")
    elif not Path(args.data).exists() and local_source(args.data) is None:  # a synthetic spec is no folder
        raise FileNotFoundError(f"--data {args.data}: no such dataset folder")
    try:
        shots = [int(s) for s in args.shots.split(",") if s.strip()]
    except ValueError:
        raise ConfigError(f"--shots: comma-separated integers; got {args.shots!r}") from None
    if args.fewshot and (not shots or any(s < 1 for s in shots) or args.l2 <= 0 or args.seeds < 1):
        raise ConfigError(f"--shots/--seeds/--l2: need shots >= 1, seeds >= 1, l2 > 0; got "
                          f"{args.shots}, {args.seeds}, {args.l2}")
    kv = {"eval.checkpoint": args.checkpoint, "data.path": args.data, "eval.split": args.split,
          "eval.fewshot": args.fewshot, "eval.fewshot_shots": shots or [1], "eval.fewshot_seeds": args.seeds,
          "eval.fewshot_l2": args.l2, "eval.linear_probe": args.linear_probe, "eval.top1": not args.no_top1,
          "eval.variant": args.model, "eval.img_size": args.img_size, "eval.batch": args.batch,
          "eval.max_train_images": args.max_train_images, "eval.out": args.out}
    if args.evals:
        kv["evals"] = read_evals_file(args.evals)
    return [f"{k}={json.dumps(v)}" for k, v in kv.items()]


def read_evals_file(path: str) -> list:
    """``--evals FILE``: a YAML list of evaluator entries, or a mapping whose ``evals`` key holds one."""
    import yaml

    from pipeline.config import ConfigError

    try:
        doc = yaml.safe_load(Path(path).read_text())
    except OSError as e:
        raise ConfigError(f"--evals {path}: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"--evals {path}: not YAML ({str(e).splitlines()[0]})") from None
    if isinstance(doc, dict) and "evals" in doc:
        doc = doc["evals"]
    if not isinstance(doc, list) or not doc:
        raise ConfigError(f"--evals {path}: expected a non-empty list of evaluators (or an evals: list)")
    return doc


def print_eval(res) -> None:
    from pipeline.distributed import rank0_print

    for key, v in res.metrics.items():
        rank0_print(f"{key:<28} {v:.4f}")
    if res.fewshot_text:
        rank0_print(res.fewshot_text)
    if res.results:
        rank0_print(f"results: {res.results}")
    if res.mlflow_run_id:
        rank0_print(f"mlflow run: {res.mlflow_run_id}"
                    + (f" (nested under {res.mlflow_parent_run_id})" if res.mlflow_parent_run_id else ""))


def eval_main(argv: list[str]) -> int:
    from pipeline.config import ConfigError, EvalConfig, load_config
    from pipeline.distributed import dist_env, leave_process_group

    p = parser_for("eval", "Evaluate a checkpoint: top-1/top-5, per-class accuracy and confusion matrix on a "
                           "split (on multi-label data: precision@1, mean average precision and per-class AP); "
                           "few-shot linear evaluation and a linear probe on frozen features.")
    add_eval_args(p)
    p.add_argument("overrides", nargs="*", metavar="data.KEY=VALUE",
                   help="the data section as the run had it, e.g. data.minival_fraction=0.02 for --split minival")
    args = p.parse_intermixed_args(argv)
    bad = [o for o in args.overrides if not o.startswith("data.")]
    if bad:
        raise ConfigError(f"override {bad[0]!r}: `vitp eval` takes its flags and data.* overrides")
    cfg = load_config(None, [*eval_overrides(args), *args.overrides], world_size=dist_env().world_size,
                      schema=EvalConfig)
    from pipeline.evaluate import evaluate

    try:
        res = evaluate(cfg)
    finally:
        leave_process_group()
    print_eval(res)
    return 0


# --------------------------------------------------------------------------------------------------
# vitp export, inspect, plan
# --------------------------------------------------------------------------------------------------
def export_main(argv: list[str]) -> int:
    p = parser_for("export", "export consolidated fp32 weights of a run or checkpoint (any ZeRO stage)")
    p.add_argument("checkpoint", help="a run dir, a checkpoints/step-* folder or a .safetensors file")
    p.add_argument("--format", choices=["safetensors", "timm"], default="safetensors",
                   help="vitp names (safetensors) or timm VisionTransformer names (timm, also safetensors)")
    p.add_argument("out", help="output file, e.g. model.safetensors")
    args = p.parse_args(argv)
    from pipeline.train.engine import fp32_state_dict
    from pipeline.weights import export

    n = export(args.checkpoint, args.out, args.format, consolidate=fp32_state_dict)
    print(f"wrote {args.out}: {n['tensors']} tensors, {n['params'] / 1e6:.2f}M parameters ({args.format})")
    return 0


def inspect_main(argv: list[str]) -> int:
    p = parser_for("inspect", "Draw the paper's Figure 6/7 panels for a checkpoint.")
    p.add_argument("--checkpoint", required=True,
                   help="a run directory (pre-training/transfer), or a vitp .safetensors export")
    p.add_argument("--image", action="append", default=[], help="an input image (repeatable)")
    p.add_argument("--out", required=True, help="folder for the PNGs")
    args = p.parse_args(argv)
    from pipeline.eval.figures import load_images, write_figures
    from pipeline.train.engine import fp32_state_dict
    from pipeline.weights import load_model

    model = load_model(args.checkpoint, consolidate=fp32_state_dict)
    images = load_images(args.image, model.img_size) if args.image else None
    for path in write_figures(model, args.out, images):
        print(path)
    return 0


def plan_main(argv: list[str]) -> int:
    from pipeline.plan.cost import (
        SWEEP_KEYS,
        PlanError,
        format_report,
        format_sweep,
        model_shape,
        parse_sweep,
        plan,
    )
    from pipeline.plan.planned import load_planned, sweep
    from pipeline.plan.recommend import format_recommendation, recommend

    p = parser_for("plan", "Memory per GPU, step time, throughput and cost of a pre-training run, on paper, "
                           "and the ZeRO stage to train it with on this cluster.")
    add_config_args(p)
    p.add_argument("--resources", default=None,
                   help="a cluster file (cluster: and hardware: only), e.g. configs/cluster/h100_8x.yaml")
    p.add_argument("--sweep", nargs="+", default=[], metavar="KEY=V1,V2",
                   help=f"a table over options; keys: {', '.join(SWEEP_KEYS)} (ckpt/offload take on,off)")
    p.add_argument("--dataset-size", type=int, default=None,
                   help="images per epoch (default: data.path's _info.json, else JFT-300M's 300M)")
    p.add_argument("--num-classes", type=int, default=None,
                   help="head size when model.num_classes is 0 (default: _info.json, else JFT's 18291)")
    p.add_argument("--backend", choices=["cuda", "cpu"], default="cuda",
                   help="cuda: GPUs (default); cpu: DeepSpeed on CPU over gloo (touched pages, no CUDA context)")
    p.add_argument("--headroom", type=float, default=0.0,
                   help="fraction of device memory kept free for fragmentation (e.g. 0.1)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    args = p.parse_args(argv)
    kw = dict(dataset=args.dataset_size, num_classes=args.num_classes, backend=args.backend,
              headroom=args.headroom)
    if not 0 <= args.headroom < 1:
        raise PlanError(f"--headroom: must be in [0, 1); got {args.headroom}")
    cfg = load_planned(args.config, args.overrides, args.resources)
    result = plan(cfg, **kw)
    rec = recommend(cfg, model_shape(cfg, args.num_classes)[0], backend=args.backend, headroom=args.headroom)
    rows = sweep(args.config, args.overrides, parse_sweep(args.sweep), resources=args.resources,
                 **kw) if args.sweep else None
    if args.json:
        print(json.dumps({**result, "recommendation": rec, "sweep": rows}, indent=1, default=float))
        return 0
    print(format_report(result))
    print("\n" + format_recommendation(rec))
    if rows is not None:
        print("\n== sweep (NO: does not fit in device memory)")
        print(format_sweep(rows))
    return 0
