"""`vitp sync RUN_DIR`: deliver what a run could not send to MLflow (RUN_DIR/mlflow_spool.jsonl).

A run whose tracking server was unreachable at its end keeps its undelivered records in the spool
and says so; this sends them once the server is back, each record once, and ends the MLflow run
with the status the job ended in (the convention of `wandb sync` for offline runs).

Exit codes: 0 delivered (or nothing to deliver), 1 the server is still unreachable (the spool is
kept), 2 a usage error.
"""

from __future__ import annotations


def sync_main(argv: list[str]) -> int:
    from launch.cli import parser_for, print_error

    p = parser_for("sync", "Deliver a run directory's undelivered MLflow records (RUN_DIR/mlflow_spool.jsonl) "
                           "and finish its MLflow run.")
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run directory whose spool to deliver")
    p.add_argument("--uri", default=None, help="tracking server (default: the one the spool names)")
    p.add_argument("--timeout", type=float, default=60.0,
                   help="seconds to keep trying an unreachable server (default 60)")
    args = p.parse_args(argv)
    from pipeline.tracking.mlflow_sink import SPOOL, MlflowSink

    res = MlflowSink.sync(args.run_dir, uri=args.uri, timeout=args.timeout)
    if not res["delivered"] and not res["left"]:
        print(f"{args.run_dir}: nothing to sync (no {SPOOL})")
        return 0
    runs = ", ".join(f"{rid} ({status})" for rid, status in sorted(res["runs"].items())) or "none"
    print(f"delivered {res['delivered']} records to {res['uri']}; runs: {runs}")
    if res["left"]:
        print_error(f"{res['left']} records not delivered ({res['error']}); they stay in "
                    f"{args.run_dir}/{SPOOL}: run `vitp sync {args.run_dir}` again")
        return 1
    return 0
