"""`vitp`: one command per stage. Each command's ``main(argv: list[str]) -> int`` (its argparse, with
`--help` and an example) lives in launch/ and is imported only when the command runs, so `vitp prep`
starts without torch and `vitp --help` is instant; the stages it calls are library functions of a
typed config. This table is the only place that knows the commands, and :func:`run_command` the only
place that turns an error into an exit code: the error's class says which
(:class:`pipeline.errors.Classified`; the project's bad values are ValueErrors, exit 2); anything else
is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from pipeline.errors import Classified, exit_code

# command → (module:function, one-line summary, example)
COMMANDS: dict[str, tuple[str, str, str]] = {
    "prep": ("data_prep.cli:prep_main", "shard images into WebDataset tars",
             "vitp prep ~/imagenet/train shards/ --val-fraction 0.01 --resize-shorter 256 --workers 8"),
    "verify": ("data_prep.cli:verify_main", "check every shard of a prep output",
               "vitp verify shards/"),
    "decontam": ("data_prep.cli:decontam_main", "check a prep output against new test sets; list what to leave out",
                 "vitp decontam shards/ --exclude-near data/imagenet_val --exclude-near s3://bench/cifar10"),
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
    "suite": ("launch.suite:suite_main", "judge a checkpoint the paper's way: transfer over many datasets",
              "vitp suite --config configs/suite/tiny.yaml init.from=runs/pre run.dir=runs/suite"),
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

# `vitp COMMAND SUB ...` served by another module than COMMAND's (it builds on COMMAND's module)
SUBCOMMANDS: dict[tuple[str, str], str] = {
    ("submit", "suite"): "launch.suite_slurm:submit_suite",  # a transfer suite: arrays and dependent jobs
}


# What 1 means for each command whose run can fail after it started (0 is success, 2 a usage, config
# or input mistake, for every command).
FAILED = {
    "prep": "a worker process died or an upload failed (rerun the same command to resume)",
    "verify": "problems found (listed on stdout)",
    "pretrain": "a failed run (a non-finite loss); 143: stopped by SIGTERM after a checkpoint (run it again "
                "to resume)",
    "transfer": "a failed run (a non-finite loss); 143: stopped by SIGTERM after a checkpoint (run it again "
                "to resume)",
    "suite": "a cell failed (the others are kept; the same command again retries it)",
    "submit": "with --wait: a job failed, or --preflight's checks failed",
    "preflight": "a check failed",
    "logs": "no log yet",
    "cancel": "a job could not be cancelled",
    "sync": "records not delivered (the server is still unreachable; the spool is kept)",
    "demo": "a step of the demo failed",
}

class CommandFailed(Classified, RuntimeError):
    """What a command ran failed (exit 1); the message is one line."""

    exit_code = 1


def run_command(fn, argv: list[str]) -> int:
    """``fn(argv)`` with the one error path of every command: a project error is ``error: MESSAGE`` on
    stderr (one line) and its exit code (2 a usage, config or input mistake; 1 a failed run)."""
    try:
        return int(fn(argv) or 0)
    except Exception as e:
        code = exit_code(e)
        if code is None:
            raise
        print_error(e)
        return code


def add_config_args(p: argparse.ArgumentParser) -> None:
    """The `--config X.yaml key=value ...` arguments every config-driven stage takes."""
    p.add_argument("--config", required=True, help="YAML recipe, e.g. configs/pretrain/tiny_cpu.yaml")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                   help="dotted overrides, e.g. optim.lr=3e-4 train.steps=100")


def exit_codes_text(command: str) -> str:
    """The exit codes of ``command``, for its --help."""
    failed = f", 1 {FAILED[command]}" if command in FAILED else ""
    return f"exit codes: 0 done{failed}, 2 a usage, config or input mistake (one line on stderr)"


def parser_for(command: str, description: str = "") -> argparse.ArgumentParser:
    """An argparse parser named `vitp COMMAND` whose help ends with the table's example and the
    command's exit codes."""
    _, summary, example = COMMANDS[command]
    return argparse.ArgumentParser(prog=f"vitp {command}", description=description or summary,
                                   epilog=f"example:\n  {example}\n\n{exit_codes_text(command)}",
                                   formatter_class=argparse.RawDescriptionHelpFormatter)


def print_error(message: object) -> None:
    """``error: MESSAGE`` on stderr in one write: every rank of a launch shares the pipe, and under
    PYTHONUNBUFFERED=1 a print's text and its newline are two writes that other ranks' lines interleave."""
    sys.stderr.write(f"error: {message}\n")
    sys.stderr.flush()


def load_args_config(args: argparse.Namespace, **kw):
    """``--config X.yaml key=value ...`` loaded and validated (a mistake: ConfigError, exit 2 before
    anything starts)."""
    from pipeline.config import load_config

    return load_config(args.config, args.overrides, **kw)


def config_main(argv: list[str]) -> int:
    p = parser_for("config")
    sub = p.add_subparsers(dest="action", required=True)
    show = sub.add_parser("show", help="print the resolved config as YAML",
                          epilog=f"example:\n  {COMMANDS['config'][2]}\n\n{exit_codes_text('config')}",
                          formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_args(show)
    args = p.parse_args(argv)
    from pipeline.config import to_yaml

    print(to_yaml(load_args_config(args)), end="")
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
    return getattr(importlib.import_module(module), func)


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
    sub = SUBCOMMANDS.get((command, rest[0] if rest else ""))
    if sub is not None:
        return run_command(_resolve(sub), rest[1:])
    return run_command(_resolve(COMMANDS[command][0]), rest)


if __name__ == "__main__":
    sys.exit(main())
