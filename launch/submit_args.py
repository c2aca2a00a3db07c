"""`vitp submit`'s command line: its three parsers (prep, eval, the training stages), the expansion
of ``--sweep``/``--sweep-file`` into one override list per array task, and prep's shard ranges per
task. launch/submit.py checks and submits what these describe.
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

from pipeline.errors import Classified


class SubmitError(Classified, ValueError):
    """A submission mistake found before anything reached the queue; one line."""

    retry = False


# --------------------------------------------------------------------------------------------------
# Sweeps and prep ranges
# --------------------------------------------------------------------------------------------------
def _fmt(v) -> str:
    return v if isinstance(v, str) else json.dumps(v)


def parse_sweep(sweeps: list[str], sweep_file: str | None = None) -> list[list[str]]:
    """``["optim.lr=1e-3,3e-4", "train.steps=10,20"]`` → the cartesian product as override lists;
    a sweep file is a YAML list of mappings ``{dotted.key: value}``."""
    sets: list[list[str]] = [[]]
    for item in sweeps:
        key, sep, values = item.partition("=")
        if not sep or not key or not values:
            raise SubmitError(f"--sweep {item!r}: expected KEY=V1,V2,..., e.g. optim.lr=1e-3,3e-4")
        sets = [s + [f"{key}={v.strip()}"] for s in sets for v in values.split(",")]
    if sweep_file:
        import yaml

        try:
            rows = yaml.safe_load(Path(sweep_file).read_text())
        except (OSError, yaml.YAMLError) as e:
            raise SubmitError(f"--sweep-file {sweep_file}: {e}") from None
        if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows) or not rows:
            raise SubmitError(f"--sweep-file {sweep_file}: expected a list of mappings {{dotted.key: value}}")
        sets = [s + [f"{k}={_fmt(v)}" for k, v in r.items()] for s, r in itertools.product(sets, rows)]
    return sets if sweeps or sweep_file else []


def split_shards(n_shards: int, tasks: int) -> list[tuple[int, int]]:
    """Contiguous, nearly equal ranges of the plan's shards; never an empty task."""
    tasks = max(1, min(tasks, n_shards))
    bounds = [round(i * n_shards / tasks) for i in range(tasks + 1)]
    return [(bounds[i], bounds[i + 1]) for i in range(tasks)]


# --------------------------------------------------------------------------------------------------
# Parsers
# --------------------------------------------------------------------------------------------------
def common_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cluster", choices=["slurm", "local", "debug"], default=None,
                   help="submitit executor (default: slurm when sbatch is on PATH, else local)")
    p.add_argument("--resources",
                   help="cluster/hardware YAML merged over the recipe, e.g. configs/cluster/h100_8x.yaml")
    p.add_argument("--wait", action="store_true", help="block until the job ends; non-zero exit if it failed")
    p.add_argument("--dry-run", action="store_true", help="check and print the sbatch parameters; submit nothing")
    p.add_argument("--skip-driver-check", action="store_true",
                   help="queue a GPU job without first asking a node for its NVIDIA driver (launch/preflight.py)")


def prep_parser() -> argparse.ArgumentParser:
    from data_prep.cli import add_prep_options

    from .cli import parser_for

    p = parser_for("submit", "Submit `vitp prep` as a SLURM array over the plan's shards.")
    p.add_argument("source", help="ImageFolder directory or CSV/JSONL/Parquet manifest")
    p.add_argument("out", help="output folder (shared file system)")
    p.add_argument("overrides", nargs="*", metavar="cluster.KEY=VALUE")
    p.add_argument("--tasks", type=int, default=1, help="array tasks (each writes a range of shards; --workers "
                                                         "processes each)")
    add_prep_options(p)  # `vitp prep`'s own options, but --shard-range and --no-progress (the array sets them)
    common_args(p)
    return p


def decontam_parser() -> argparse.ArgumentParser:
    from data_prep.cli import add_decontam_options

    from .cli import parser_for

    p = parser_for("submit", "Submit `vitp decontam` as a SLURM array over the prep output's shards: the "
                             "test sets are hashed once, here; each task checks a range of shards; the last "
                             "to finish writes OUT/_exclude.json.")
    p.epilog = ("example:\n  vitp submit decontam out/web --tasks 64 --exclude-near data/pets_test --wait\n\n"
                + p.epilog.split("\n\n", 1)[1])
    p.add_argument("out", help="a finished `vitp prep` output (a shared folder, s3:// or gs://)")
    p.add_argument("overrides", nargs="*", metavar="cluster.KEY=VALUE")
    p.add_argument("--tasks", type=int, default=1, help="array tasks (each checks a range of shards)")
    add_decontam_options(p)  # `vitp decontam`'s own options
    common_args(p)
    return p


def stage_parser() -> argparse.ArgumentParser:
    from .cli import add_config_args, parser_for

    p = parser_for("submit", "Submit a stage (pretrain, transfer, eval) to SLURM through submitit; "
                             "prints `job <id>`. Resource overrides go under cluster., e.g. cluster.nodes=2.")
    add_config_args(p)
    p.add_argument("--sweep", action="append", default=[], metavar="KEY=V1,V2",
                   help="one array task per value (several --sweep: every combination)")
    p.add_argument("--sweep-file", help="YAML list of override mappings, one array task each")
    p.add_argument("--preflight", action="store_true",
                   help="run `vitp preflight` with the same arguments first; submit only if it passed")
    common_args(p)
    return p


def eval_parser() -> argparse.ArgumentParser:
    from .cli import parser_for
    from .stages import add_eval_args

    p = parser_for("submit", "Submit `vitp eval` (the same flags) as a job; resource overrides go under cluster.")
    add_eval_args(p)
    p.add_argument("overrides", nargs="*", metavar="cluster.KEY=VALUE")
    common_args(p)
    return p
