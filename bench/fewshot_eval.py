"""What the few-shot evaluators cost a pre-training run: the tiny recipe with its default
`train.fewshot_every` (250) and shots (1/5/10/25), 2 local ranks, 1000 steps on sklearn's digits
sharded by `vitp prep`, the digits themselves as the few-shot set (train -> test) — the demo's
pre-training, without MLflow.

    python bench/fewshot_eval.py [--steps 1000] [--nprocs 2]

Both sides come from one run: the evaluators' wall time as the run logs it (``fewshot/seconds`` per
evaluation plus ``fewshot/setup_seconds``, the train split's label scan) against the training time
(``step_s`` x steps of every logged window; evaluation, logging and checkpoint time excluded, as
the loop measures it). Prints `ratio fewshot_eval_overhead VALUE` (goal <= 0.03).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from launch.demo import PRETRAIN_RECIPE, prep_digits  # noqa: E402
from launch.local import run_local  # noqa: E402


def overhead(metrics: list[dict]) -> tuple[float, float, int]:
    """(evaluator seconds, training seconds, evaluations) from a run's metrics.jsonl records."""
    evaluator = sum(r.get("fewshot/seconds", 0.0) + r.get("fewshot/setup_seconds", 0.0) for r in metrics)
    training, prev = 0.0, 0
    for r in metrics:
        if "step_s" in r:
            training += r["step_s"] * (r["step"] - prev)
            prev = r["step"]
    return evaluator, training, sum("fewshot/seconds" in r for r in metrics)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=1000, help="train.steps (default 1000, as the demo)")
    p.add_argument("--nprocs", type=int, default=2)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        shards = tmp / "shards"
        prep_digits(tmp / "digits", shards)
        argv = ["pretrain", "--config", str(PRETRAIN_RECIPE), f"run.dir={tmp / 'run'}", f"data.path={shards}",
                f"eval.fewshot_data=[digits={shards}]", "tracking.enabled=false"]
        argv += [f"train.steps={args.steps}", f"checkpoint.every={args.steps}"]
        if run_local(argv, args.nprocs) != 0:
            raise SystemExit("error: the pre-training run failed")
        metrics = [json.loads(x) for x in (tmp / "run/metrics.jsonl").read_text().splitlines()]
    evaluator, training, n = overhead(metrics)
    print(f"# {n} evaluations: {evaluator:.2f} s of evaluators, {training:.2f} s of training steps")
    print(f"ratio fewshot_eval_overhead {evaluator / training:.4f}")


if __name__ == "__main__":
    main()
