"""Benchmark how `vitp prep`'s planning scales with the manifest: memory and time for 1M vs 10M rows.

Data: synthetic CSV manifests (`path,label`; 1000 ImageNet-like class names, 5000 distinct paths repeated,
so rows look real but no image is needed), written to a temporary directory.

Each manifest is planned by the `vitp prep` CLI in a subprocess with `--shard-range 0:0` (write the plan,
no shard: the time an array task's submitter waits before the first shard can start). Its peak RSS comes
from the kernel's accounting of that one child (os.wait4's ru_maxrss), its time is the child's wall clock.
The sizes run small, big, small in one run (the small runs bracket the big one on a shared machine);
the ratios divide the big run by the mean of the small ones. CPU seconds (user + system of the child)
are printed beside wall seconds: on a busy machine they say more about the work itself.

Prints the absolute numbers and
  ratio plan_memory_10m_vs_1m VALUE    (peak RSS; goal <= 1.5)
  ratio plan_seconds_10m_vs_1m VALUE   (wall time; goal <= 11)
  ratio plan_cpu_seconds_10m_vs_1m VALUE
  rate CPU µs per row of the larger manifest (the README's 300M estimate comes from it)

Usage: python bench/prep_scale.py [--rows 1000000,10000000] [--tmp DIR] [--keep]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CLASSES = [f"n{7919 * i % 10**8:08d}" for i in range(1000)]


def write_manifest(path: Path, rows: int) -> None:
    """`rows` rows of `path,label`, written in blocks (the writer itself stays small)."""
    with open(path, "w", encoding="utf-8") as f:
        f.write("path,label\n")
        block = 100_000
        for start in range(0, rows, block):
            f.write("".join(f"images/{i % 5000:05d}.jpg,{CLASSES[(i * 7) % 1000]}\n"
                            for i in range(start, min(rows, start + block))))


def plan_once(manifest: Path, out: Path) -> tuple[float, float, int]:
    """(wall seconds, CPU seconds, peak RSS bytes) of one `vitp prep MANIFEST OUT --shard-range 0:0` in a
    fresh process."""
    cmd = [sys.executable, "-m", "launch.cli", "prep", str(manifest), str(out), "--shard-range", "0:0",
           "--no-progress", "--val-fraction", "0.01"]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    err = proc.stderr.read().decode(errors="replace")
    if proc.returncode != 0:
        raise SystemExit(f"prep of {manifest} failed (exit {proc.returncode}): {err.strip()[-500:]}")
    return seconds, usage.ru_utime + usage.ru_stime, usage.ru_maxrss * 1024  # ru_maxrss is KiB on Linux


def _label(rows: int) -> str:
    return f"{rows // 10**6}m" if rows % 10**6 == 0 else f"{rows // 1000}k"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1000000,10000000", help="two comma-separated manifest sizes, small first")
    ap.add_argument("--tmp", help="scratch directory (default: a new temporary directory)")
    ap.add_argument("--keep", action="store_true", help="keep the manifests and plans")
    args = ap.parse_args()
    small, big = (int(x) for x in args.rows.split(","))
    tmp = Path(args.tmp or tempfile.mkdtemp(prefix="prep_scale_"))
    tmp.mkdir(parents=True, exist_ok=True)
    try:
        manifests = {}
        for rows in (small, big):
            manifests[rows] = tmp / f"manifest_{rows}.csv"
            if not manifests[rows].exists():
                write_manifest(manifests[rows], rows)
        # small, big, small: the machine is shared, so the small runs bracket the big one in time
        res: dict[int, list] = {small: [], big: []}
        for rows in (small, big, small):
            out = tmp / f"out_{rows}"
            shutil.rmtree(out, ignore_errors=True)
            seconds, cpu, rss = plan_once(manifests[rows], out)
            plan_files = [p for p in out.rglob("*") if p.is_file() and "_plan" in str(p.relative_to(out))]
            plan_bytes = sum(p.stat().st_size for p in plan_files)
            res[rows].append((seconds, cpu, rss))
            print(f"rows {rows}: plan {seconds:.1f} s ({cpu:.1f} CPU s), peak RSS {rss / 2**20:.0f} MiB, "
                  f"{seconds / rows * 1e6:.2f} µs/row, plan files {plan_bytes / 2**20:.1f} MiB", flush=True)
        s0, c0, m0 = (sum(x) / len(x) for x in zip(*res[small]))
        (s1, c1, m1), = res[big]
        name = f"{_label(big)}_vs_{_label(small)}"
        print(f"ratio plan_memory_{name} {m1 / m0:.2f}")
        print(f"ratio plan_seconds_{name} {s1 / s0:.2f}")
        print(f"ratio plan_cpu_seconds_{name} {c1 / c0:.2f}")
        rate = c1 / big
        print(f"rate {rate * 1e6:.2f} CPU us/row -> 300M rows ~ {rate * 3e8 / 3600:.1f} h of one core")
    finally:
        if not args.keep and not args.tmp:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
