"""`vitp preflight`: prove the cluster before the big job (launch/preflight_job.py builds and reports the
job, pipeline/preflight.py is what its ranks run).

    vitp preflight --config configs/pretrain/vit_l16.yaml --resources configs/cluster/h100_8x.yaml \\
        cluster.nodes=16 data.path=/data/shards run.dir=/data/runs/vit_l16

Exit 0 passed, 1 a check failed (one line on stderr naming it), 2 a config or data mistake found
before anything was queued.
"""

from __future__ import annotations

import json

from .preflight_job import DEFAULTS, add_preflight_args, preflight_job
from .submit import (
    SubmitError,
    check_cluster,
    check_data,
    default_cluster,
    load_submit_config,
    run_preflight,
    slurm_parameters,
)


# --------------------------------------------------------------------------------------------------
# `vitp preflight`
# --------------------------------------------------------------------------------------------------
def preflight_main(argv: list[str]) -> int:
    from .cli import add_config_args, parser_for

    p = parser_for("preflight", "A short job on the run's partition and node count that checks torch's CUDA vs "
                                "each node's driver, the GPUs each task sees, an all-reduce over every rank (NCCL "
                                "on GPUs, its bus bandwidth vs the resources file's fabric), the gloo side group, "
                                "write + fsync throughput of run.dir and the shards' read throughput vs what the "
                                "planned step rate needs; prints one table and a verdict.")
    add_config_args(p)
    p.add_argument("--resources",
                   help="cluster/hardware YAML merged over the recipe, e.g. configs/cluster/h100_8x.yaml")
    p.add_argument("--cluster", choices=["slurm", "local"], default=None,
                   help="submitit executor (default: slurm when sbatch is on PATH, else local)")
    p.add_argument("--dry-run", action="store_true", help="check and print the sbatch parameters; submit nothing")
    add_preflight_args(p)
    args = p.parse_intermixed_args(argv)
    cluster = args.cluster or default_cluster()
    opts = {k: getattr(args, k) for k in DEFAULTS}
    if args.io_mb < 1 or args.read_mb < 0 or args.allreduce_mb <= 0 or not 0 <= args.min_fabric <= 1:
        raise SubmitError("--io-mb >= 1, --read-mb >= 0, --allreduce-mb > 0, 0 <= --min-fabric <= 1; got "
                          f"{args.io_mb}, {args.read_mb}, {args.allreduce_mb:g}, {args.min_fabric:g}")
    cfg = load_submit_config(args.config, args.overrides, args.resources)
    check_cluster(cfg, cluster)
    check_data(cfg, "pretrain")
    if args.dry_run:
        print(json.dumps(slurm_parameters(preflight_job(cfg, opts)[0]), indent=1, sort_keys=True))
        return 0
    return run_preflight(cfg, cluster, opts)
