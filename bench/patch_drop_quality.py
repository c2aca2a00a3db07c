"""Patch dropping at equal wall-clock: the demo's pre-training (the tiny recipe, 2 local ranks, ZeRO-2,
sklearn's digits sharded by `vitp prep`, the demo's tuning) at model.patch_drop 0 and 0.5 with the same
training time, each followed by the same 10-shot evaluation (the few-shot evaluator on the digits' train ->
test splits, its k-shot subset seeded alike), for several seeds.

    python bench/patch_drop_quality.py [--steps 1000] [--seeds 0 1 2] [--nprocs 2] [--img-size 32]

The resolution is the recipe's own 32 px (64 patch tokens). The demo pre-trains at 16 px (16 tokens) to be
quick, and there a step is almost all fixed per-step cost (the optimizer, the gradient all-reduce, the
loader), so dropping half the tokens saves a few percent of it and buys no extra steps: a measurement of
"equal quality at equal time" needs a model whose step time grows with its tokens (`--img-size 16` shows
the other regime).

The budget: the training time of `--steps` steps at patch_drop 0 (the demo's run). A shared, loaded
machine cannot hand out equal seconds to runs made one after the other (its load moves by 30% and
more from minute to minute), so the two arms always run side by side, at the same time, under the
same load: first short calibration runs of both arms together, whose step-time ratio (median over
the rounds, of each run's windows after the first; the faster arm's last windows run alone, which
can only favour the patch_drop=0 arm) converts the
budget into round(steps / ratio) steps for the patch-drop arm; then, per seed, both arms' real runs
together. Each arm runs its own full schedule (warm-up, cosine decay to its own last step). Training
time is counted as the loop logs it (``step_s`` of each window; evaluation, logging and checkpoints
excluded); with a fair budget both arms' training seconds come out about equal (printed as a check).

Prints per seed the 10-shot accuracies, then
  ratio patchdrop50_fewshot_vs_full VALUE    median over seeds of 10-shot(0.5) / 10-shot(0) (goal >= 1.00)
with the spread (min-max over seeds) on the line before it, and
  ratio patchdrop50_step_vs_full VALUE       the calibrated step-time ratio the budget was converted with.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from launch.demo import PRETRAIN_RECIPE, PRETRAIN_TUNING, prep_digits  # noqa: E402
from launch.local import run_local  # noqa: E402

DROP = 0.5
METRIC = "fewshot/digits/10shot"


def pretrain(*, run_dir: Path, shards: Path, seed: int, steps: int, drop: float, nprocs: int,
             fewshot: bool, log_every: int, img_size: int) -> list[dict]:
    """One demo pre-training run; -> its metrics.jsonl records."""
    argv = ["pretrain", "--config", str(PRETRAIN_RECIPE), f"run.dir={run_dir}", f"data.path={shards}",
            f"model.img_size={img_size}", "engine.zero_stage=2", "tracking.enabled=false", f"seed={seed}",
            f"train.steps={steps}", f"checkpoint.every={steps}", f"train.log_every={log_every}",
            f"model.patch_drop={drop}", "train.fewshot_every=0", *PRETRAIN_TUNING]
    if fewshot:
        argv += [f"eval.fewshot_data=[digits={shards}]", "eval.fewshot_shots=[10]"]
    else:
        argv += ["data.val_split=null"]  # calibration: no evaluation at the end
    if run_local(argv, nprocs) != 0:
        raise SystemExit(f"error: the pre-training run in {run_dir} failed")
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]


def training_seconds(metrics: list[dict]) -> float:
    total, prev = 0.0, 0
    for r in metrics:
        if "step_s" in r:
            total += r["step_s"] * (r["step"] - prev)
            prev = r["step"]
    return total


def steady_step_s(metrics: list[dict]) -> float:
    """Median step time of the logged windows after the first (start-up effects)."""
    return statistics.median([r["step_s"] for r in metrics if "step_s" in r][1:])


def side_by_side(*runs: dict) -> list[list[dict]]:
    """Run the given pretrain() calls at the same time (each its own local ranks); -> their metrics."""
    with ThreadPoolExecutor(len(runs)) as pool:
        return [f.result() for f in [pool.submit(pretrain, **kw) for kw in runs]]


def calibrate(tmp: Path, shards: Path, *, rounds: int, steps: int, nprocs: int,
              img_size: int) -> tuple[float, list[float]]:
    """Step-time ratio patch_drop 0.5 / 0 from short runs of the two arms side by side.
    -> (median over the rounds, each round's ratio)."""
    ratios = []
    for i in range(rounds):
        kw = dict(shards=shards, seed=0, steps=steps, nprocs=nprocs, fewshot=False, log_every=max(steps // 20, 1),
                  img_size=img_size)
        full, drop = side_by_side(dict(kw, run_dir=tmp / f"cal{i}_0", drop=0.0),
                                  dict(kw, run_dir=tmp / f"cal{i}_{DROP}", drop=DROP))
        times = {0.0: steady_step_s(full), DROP: steady_step_s(drop)}
        ratios.append(times[DROP] / times[0.0])
        print(f"# calibration {i}: step {times[0.0] * 1e3:.1f} ms at 0, {times[DROP] * 1e3:.1f} ms at {DROP}",
              flush=True)
    return statistics.median(ratios), ratios


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=1000, help="steps of the patch_drop=0 arm: the budget (demo: 1000)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--nprocs", type=int, default=2)
    p.add_argument("--calibration-rounds", type=int, default=2, help="short side-by-side runs measuring the step times")
    p.add_argument("--calibration-steps", type=int, default=300)
    p.add_argument("--img-size", type=int, default=32, help="pixels (patch 4): 32 = the tiny recipe's own 64 tokens")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        shards = tmp / "shards"
        prep_digits(tmp / "digits", shards)
        ratio, pairs = calibrate(tmp, shards, rounds=args.calibration_rounds, steps=args.calibration_steps,
                                 nprocs=args.nprocs, img_size=args.img_size)
        drop_steps = round(args.steps / ratio)
        print(f"# budget: {args.steps} steps at 0 = {drop_steps} steps at {DROP} (step-time ratio {ratio:.3f}, "
              f"rounds {', '.join(f'{r:.3f}' for r in pairs)})", flush=True)
        scores, secs = [], []
        for seed in args.seeds:
            kw = dict(shards=shards, seed=seed, nprocs=args.nprocs, fewshot=True, log_every=50, img_size=args.img_size)
            runs = side_by_side(dict(kw, run_dir=tmp / f"s{seed}_0", steps=args.steps, drop=0.0),
                                dict(kw, run_dir=tmp / f"s{seed}_{DROP}", steps=drop_steps, drop=DROP))
            got = {d: (next(r[METRIC] for r in reversed(m) if METRIC in r), training_seconds(m))
                   for d, m in zip((0.0, DROP), runs)}
            scores.append(got[DROP][0] / got[0.0][0])
            secs.append(got[DROP][1] / got[0.0][1])
            print(f"# seed {seed}: 10-shot {got[0.0][0]:.4f} at 0 ({args.steps} steps, {got[0.0][1]:.0f} s of training)"
                  f", {got[DROP][0]:.4f} at {DROP} ({drop_steps} steps, {got[DROP][1]:.0f} s); ratio {scores[-1]:.3f}",
                  flush=True)
    print(f"# spread over seeds {args.seeds}: {min(scores):.3f}-{max(scores):.3f} (per seed "
          f"{', '.join(f'{s:.3f}' for s in scores)}); training seconds 0.5/0 as run: "
          f"{', '.join(f'{s:.2f}' for s in secs)} (about 1 when the budget is fair)")
    print(f"ratio patchdrop50_fewshot_vs_full {statistics.median(scores):.3f}")
    print(f"ratio patchdrop50_step_vs_full {ratio:.3f}")


if __name__ == "__main__":
    main()
