"""`vitp prep` and `vitp verify`: their arguments; launch/cli.py dispatches them and maps their errors."""

from __future__ import annotations

import argparse
import functools
import json
import re
import sys

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
          "kib": 1024, "mib": 1024**2, "gib": 1024**3}

PREP_EPILOG = """\
examples:
  vitp prep data/imagenet/train out/in1k --resize-shorter 256 --quality 90 --val-fraction 0.01 --workers 8
  vitp prep data/labels.csv out/ds --split-column split --shard-size 500MB
  vitp prep data/imagenet/train out/in1k --resize-shorter 256 --shard-range 0:16   # one SLURM array task
  vitp prep data/imagenet/train s3://bucket/in1k --resize-shorter 256 --workers 8  # into an object store
  vitp prep data/web out/web --exclude-near data/imagenet/val --exclude-near s3://bucket/cifar10  # decontaminated

A manifest (.csv/.jsonl/.parquet) has a path column (relative to the manifest) and a label column
(class names or integer indices), or a labels column for multi-label data (`3;17;42`, a JSON list,
or a list value; names or indices; the sample's .cls is the first one, or the label column's value
when the manifest has both, and the json holds them all as "labels"). Rerunning the same command
resumes: complete shards are kept.

OUT may be an object store prefix (s3://bucket/prefix, gs://bucket/prefix; extras vitp[s3], vitp[gcs];
credentials from the SDK's own environment/profile chain): each shard is made in --staging-dir and
uploaded when complete, its _stats.json after it (the marker a rerun trusts), _info.json last.

Exit status 0 done; 1 a worker process died or an upload failed (rerun the same command to resume);
2 a usage or input mistake (one line on stderr).
"""

VERIFY_EPILOG = """\
examples:
  vitp verify out/in1k --workers 8
  vitp verify s3://bucket/in1k --workers 8        # each shard streamed, nothing downloaded to disk
Exit status 0 when every shard decodes and all counts and hashes agree; 1 with the problems listed;
2 a usage or input mistake (one line on stderr).
"""


def parse_size(text: str) -> int:
    """'500MB' → 500_000_000, '64MiB' → 67_108_864, '1000' → 1000."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"--shard-size {text!r}: expected a size like 500MB, 1GiB or 1000000")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


@functools.cache
def size_option(option: str):
    """The argparse type of the byte-size flag ``option``: :func:`parse_size`, its mistake naming ``option``
    (one function per flag, so both commands' flags hold the same one)."""
    def parse(text: str) -> int:
        try:
            return parse_size(text)
        except argparse.ArgumentTypeError:
            raise argparse.ArgumentTypeError(f"{option} {text!r}: expected a size like 500MB, 1GiB or 1000000") \
                from None
    return parse


def parse_range(text: str) -> tuple[int, int]:
    m = re.fullmatch(r"(\d+):(\d+)", text.strip())
    if not m:
        raise argparse.ArgumentTypeError(f"--shard-range {text!r}: expected START:STOP, e.g. 0:16")
    return int(m.group(1)), int(m.group(2))


class Renamed(argparse.Action):
    """An old spelling of an option: refused with one line naming the new one."""

    def __init__(self, option_strings, dest, new: str = "", **kw):
        super().__init__(option_strings, dest, nargs="?", help=argparse.SUPPRESS, **kw)
        self.new = new

    def __call__(self, parser, namespace, values, option_string=None):
        raise ValueError(f"{option_string}: renamed; use {self.new}")


_TYPES = {"text": None, "int": int, "float": float}


def add_prep_options(p: argparse.ArgumentParser) -> None:
    """A flag for every field of pipeline.config.PrepCfg, made from the field (its flag, kind, --help
    text): the same on both commands. Defaults stay None: the schema fills in what was not given."""
    from pipeline.config.prep import PrepCfg, flag

    groups: dict[str, argparse._MutuallyExclusiveGroup] = {}
    for name, field in PrepCfg.model_fields.items():
        cli = field.json_schema_extra["cli"]
        kind, option = cli["kind"], cli["flag"] or flag(name)
        if cli["group"] and cli["group"] not in groups:
            groups[cli["group"]] = p.add_mutually_exclusive_group()
        into = groups[cli["group"]] if cli["group"] else p
        kw = {"help": field.description, **({"metavar": cli["metavar"]} if cli["metavar"] else {})}
        if kind in ("on", "off"):
            into.add_argument(option, dest=name, action="store_true" if kind == "on" else "store_false",
                              default=None, **kw)
        elif kind == "list":
            into.add_argument(option, dest=name, action="append", **kw)
        else:
            into.add_argument(option, dest=name, type=size_option(option) if kind == "size" else _TYPES[kind], **kw)
    p.add_argument("--shard-size-mb", action=Renamed, new="--shard-size 500MB (bytes with a unit)")


def prep_options(args: argparse.Namespace) -> dict:
    """The PrepCfg fields the command line gave (the schema fills in the rest)."""
    from pipeline.config.prep import PrepCfg

    return {k: getattr(args, k) for k in PrepCfg.model_fields if getattr(args, k, None) is not None}


def prep_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vitp prep", description="Shard images into WebDataset tars.",
                                epilog=PREP_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", help="ImageFolder directory (root/<class>/<image>) or manifest file")
    p.add_argument("out", help="output directory, or s3://bucket/prefix, gs://bucket/prefix")
    add_prep_options(p)
    p.add_argument("--shard-range", type=parse_range,
                   help="only these planned shards, START:STOP (job arrays; 0:0 only plans); a task reuses "
                        "OUT's plan when it was made for the same source and options")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress line on stderr")
    return p


def prep_main(argv: list[str]) -> int:
    args = prep_parser().parse_args(argv)
    from pipeline.config.prep import prep_cfg

    from .build import prep  # after parsing: `--help` stays instant

    # a mistake in the input is a ValueError/FileNotFoundError (exit 2), a dead worker shards.WorkerDied
    # (exit 1): `vitp`'s one error path (launch/cli.py) prints either as one line
    cfg = prep_cfg(prep_options(args))
    summary = prep(args.source, args.out, cfg, shard_range=args.shard_range, progress=args.progress)
    print(json.dumps(summary, indent=1))
    return 0


def verify_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="vitp verify", description="Check prepared shards end to end.",
                                epilog=VERIFY_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", help="what vitp prep wrote: a folder, s3://bucket/prefix, gs://..., https://...")
    p.add_argument("--workers", type=int, default=1, help="processes reading shards (default 1)")
    args = p.parse_args(argv)
    if args.workers < 1:
        raise ValueError(f"--workers: must be >= 1; got {args.workers}")
    from . import store
    from .checks import verify
    from .schema import INFO_FILE, DatasetInfo

    shown = store.public(args.out)
    if store.is_remote(args.out):  # a missing bucket, a 403, a 404: one line, exit 2, before any shard
        store.check_readable(store.join(args.out, INFO_FILE), "vitp verify")
    problems = verify(args.out, workers=args.workers)
    for line in problems:
        print(line)
    if problems:
        print(f"vitp verify: {len(problems)} problem(s) in {shown}", file=sys.stderr)
        return 1
    # verify() has read every shard and found the counts of _info.json true: say them
    info = DatasetInfo.from_json(store.read_file(args.out, INFO_FILE).decode("utf-8"))
    splits = info.splits
    shards = sum(len(s.filenames) for s in splits.values())
    per_split = ", ".join(f"{name} {s.num_samples}" for name, s in splits.items())
    print(f"vitp verify: {shown} OK: {shards} shards, {sum(s.num_samples for s in splits.values())} samples "
          f"({per_split}), {info.num_rejects or 0} rejects")
    return 0


DECONTAM_EPILOG = """\
Reads the signatures `vitp prep` stored beside each shard (no image is read) and writes
OUT/_exclude.json: the samples that are near-duplicates of a test image. Every loader leaves them
out (the shards stay as they are). OUT/_info.json's decontaminated block then lists the test sets
beside those prep checked, marked "by": "vitp decontam". The same test sets again change nothing.
An output prepared before prep stored signatures needs --rehash (each such shard is decoded once
and its signatures written). `vitp submit decontam` runs the same check as a SLURM array over shard ranges.

example:
  vitp decontam out/web --exclude-near data/imagenet_val --exclude-near s3://bench/cifar10
Exit status 0 when the list is written; 2 a usage or input mistake (one line on stderr), nothing written.
"""


def add_decontam_options(p: argparse.ArgumentParser) -> None:
    """`vitp decontam`'s options after OUT (`vitp submit decontam` takes the same)."""
    from pipeline.config.prep import DEFAULT_NEAR_THRESHOLD, MAX_NEAR_THRESHOLD

    p.add_argument("--exclude-near", action="append", metavar="TEST", required=True,
                   help="a test set (repeatable): an image folder, a manifest or a vitp prep output")
    p.add_argument("--exclude-near-splits", metavar="SPLITS",
                   help="of a prep output given to --exclude-near, these splits (default: test, else all)")
    p.add_argument("--near-threshold", type=int, metavar="D", default=DEFAULT_NEAR_THRESHOLD,
                   help=f"hash candidates within D bits (0-{MAX_NEAR_THRESHOLD}; default {DEFAULT_NEAR_THRESHOLD})")
    p.add_argument("--rehash", action="store_true",
                   help="an output prepared before prep stored signatures: decode its shards once to make them")


def decontam_options(args) -> tuple[list[str], list[str] | None, int]:
    """Checked options -> (test sets, splits or None, threshold); a mistake is one line naming the option."""
    from pipeline.config.prep import MAX_NEAR_THRESHOLD

    if not 0 <= args.near_threshold <= MAX_NEAR_THRESHOLD:
        raise ValueError(f"--near-threshold: must be in 0..{MAX_NEAR_THRESHOLD}; got {args.near_threshold}")
    if len(set(args.exclude_near)) != len(args.exclude_near):
        raise ValueError(f"--exclude-near: the same test set twice in {args.exclude_near}")
    splits = args.exclude_near_splits.split(",") if args.exclude_near_splits else None
    return args.exclude_near, splits, args.near_threshold


def decontam_line(out: str, s: dict) -> str:
    """The one line `vitp decontam` (and `vitp submit decontam`'s last task) prints of a summary."""
    from . import store
    from .schema import EXCLUDE_FILE

    per = ", ".join(f"{a['address']}: {a['rejected']} ({a['duplicated']} test images)" for a in s["against"])
    return f"vitp decontam: {s['excluded']} samples excluded ({per}); {store.public(store.join(out, EXCLUDE_FILE))}"


def decontam_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="vitp decontam", description="Check a prep output against test sets.",
                                epilog=DECONTAM_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", help="what vitp prep wrote: a folder, s3://bucket/prefix, gs://...")
    add_decontam_options(p)
    args = p.parse_args(argv)
    test_sets, splits, threshold = decontam_options(args)
    from .decontam import decontam

    print(decontam_line(args.out, decontam(args.out, test_sets, splits, threshold, rehash=args.rehash)))
    return 0
