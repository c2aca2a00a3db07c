"""`vitp`: one command per stage. Each command's ``main(argv: list[str]) -> int`` (its argparse, with
`--help` and an example) lives in launch/ and is imported only when the command runs, so `vitp prep`
starts without torch and `vitp --help` is instant; the stages it calls are library functions of a
typed config. This table is the only place that knows the commands.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# command → (module:function, one-line summary, example)
COMMANDS: dict[str, tuple[str, str, str]] = {
    "prep": ("data_prep.cli:prep_main", "shard images into WebDataset tars",
             "vitp prep ~/imagenet/train shards/ --val-fraction 0.01 --resize-shorter 256 --workers 8"),
    "verify": ("data_prep.cli:verify_main", "check every shard of a prep output",
               "vitp verify shards/"),
    "pretrain": ("launch.stages:pretrain_main", "pre-train a ViT (DeepSpeed ZeRO)",
                 "vitp pretrain --config configs/pretrain/tiny_cpu.yaml data.path=shards/ train.steps=50"),
    "transfer": ("launch.stages:transfer_main", "fine-tune at higher resolution",
                 "vitp transfer --config configs/transfer/tiny_cpu.yaml init.from=runs/pre data.path=shards/"),
    "eval": ("launch.stages:eval_main", "top-1, few-shot and linear-probe evaluation",
             "vitp eval --checkpoint runs/ft --data shards/ --split val"),
    "export": ("launch.stages:export_main", "export consolidated weights",
               "vitp export runs/pre --format safetensors model.safetensors"),
    "inspect": ("launch.stages:inspect_main", "the paper's figures for a checkpoint",
                "vitp inspect --checkpoint runs/pre --image cat.jpg --out figs/"),
    "plan": ("launch.stages:plan_main", "memory, step time and cost of a run, on paper",
             "vitp plan --config configs/pretrain/vit_l16.yaml cluster.nodes=4 --sweep zero=1,2,3"),
    "submit": ("launch.submit:submit_main", "submit a stage to SLURM (submitit)",
               "vitp submit pretrain --config configs/pretrain/vit_l16.yaml cluster.nodes=4 data.path=/data/shards"),
    "preflight": ("launch.preflight:preflight_main", "prove the cluster (driver, GPUs, NCCL, disks) before a run",
                  "vitp preflight --config configs/pretrain/vit_l16.yaml --resources configs/cluster/h100_8x.yaml "
                  "cluster.nodes=4 data.path=/data/shards run.dir=/data/runs/l16"),
    "jobs": ("launch.submit:jobs_main", "list submitted jobs", "vitp jobs"),
    "logs": ("launch.submit:logs_main", "show a job's logs", "vitp logs 1234 --rank 0 --follow"),
    "cancel": ("launch.submit:cancel_main", "cancel a job", "vitp cancel 1234"),
    "sync": ("launch.sync:sync_main", "deliver a run's undelivered MLflow records and finish its run",
             "vitp sync runs/pre"),
    "demo": ("launch.demo:main", "the whole pipeline on scikit-learn's digits, on this machine",
             "vitp demo --out runs/demo"),
    "config": ("launch.cli:config_main", "show the resolved config",
               "vitp config show --config configs/pretrain/vit_b16.yaml optim.lr=3e-4"),
}


def add_config_args(p: argparse.ArgumentParser) -> None:
    """The `--config X.yaml key=value ...` arguments every config-driven stage takes."""
    p.add_argument("--config", required=True, help="YAML recipe, e.g. configs/pretrain/tiny_cpu.yaml")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                   help="dotted overrides, e.g. optim.lr=3e-4 train.steps=100")


def parser_for(command: str, description: str = "") -> argparse.ArgumentParser:
    """An argparse parser named `vitp COMMAND` whose help ends with the table's example."""
    _, summary, example = COMMANDS[command]
    return argparse.ArgumentParser(prog=f"vitp {command}", description=description or summary,
                                   epilog=f"example:\n  {example}",
                                   formatter_class=argparse.RawDescriptionHelpFormatter)


def print_error(message: object) -> None:
    """``error: MESSAGE`` on stderr in one write: every rank of a launch shares the pipe, and under
    PYTHONUNBUFFERED=1 a print's text and its newline are two writes that other ranks' lines interleave."""
    sys.stderr.write(f"error: {message}\n")
    sys.stderr.flush()


def load_config_or_exit(args: argparse.Namespace, **kw):
    """Load and validate; on a mistake print its one line and exit 2 before anything starts."""
    from pipeline.config import ConfigError, load_config

    try:
        return load_config(args.config, args.overrides, **kw)
    except ConfigError as e:
        print_error(e)
        raise SystemExit(2) from None


def config_main(argv: list[str]) -> int:
    p = parser_for("config")
    sub = p.add_subparsers(dest="action", required=True)
    show = sub.add_parser("show", help="print the resolved config as YAML",
                          epilog=f"example:\n  {COMMANDS['config'][2]}",
                          formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_args(show)
    args = p.parse_args(argv)
    from pipeline.config import to_yaml

    print(to_yaml(load_config_or_exit(args)), end="")
    return 0


def _top_parser() -> argparse.ArgumentParser:
    lines = [f"  {name:<9} {summary}" for name, (_, summary, _) in COMMANDS.items()]
    return argparse.ArgumentParser(
        prog="vitp", usage="vitp COMMAND [--help] ...",
        description="vitp: pre-training pipeline for Vision Transformers.\n\ncommands:\n" + "\n".join(lines),
        epilog="example:\n  vitp demo\n  vitp pretrain --config configs/pretrain/tiny_cpu.yaml data.path=shards/",
        formatter_class=argparse.RawDescriptionHelpFormatter)


def _resolve(target: str):
    module, func = target.split(":")
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name and (module == e.name or module.startswith(e.name + ".")):
            return None  # the stage's module does not exist yet
        raise
    return getattr(mod, func, None)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        _top_parser().print_help()
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        _top_parser().print_usage(sys.stderr)
        print(f"vitp: error: unknown command {command!r}", file=sys.stderr)
        return 2
    fn = _resolve(COMMANDS[command][0])
    if fn is None:
        if rest and rest[0] in ("-h", "--help"):
            parser_for(command, COMMANDS[command][1] + " (not implemented yet)").print_help()
        print(f"vitp {command}: not implemented yet", file=sys.stderr)
        return 3
    return int(fn(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
