"""The prepared check for a GPU machine: every part's outcome reported, room for a rerun.

    python3 bench/gpu_wheels.py                     # here, with a package registry: .gpu-wheels/ (make gpu-wheels)
    python3 bench/gpu_check.py --out DIR            # on the GPU machine (no registry, no make needed), the
                                                    # wheels beside the source (make gpu-check GPU_CHECK_OUT=DIR)
    python3 bench/gpu_check.py --smoke              # every part on this CPU, tiny sizes (GPU_CHECK_SMOKE=1)

What travels to the GPU machine: the source tree and .gpu-wheels/, at most 64 MiB together (checked by
gpu_wheels.py where they are made and by the install part where they arrive). DIR may be a mount point:
its contents are cleared, the folder itself kept.

Parts, in order, each in its own process group under a time budget (seconds, BUDGETS; a part may use
what the ones before it left unused); a part that fails or runs out of time is reported, and the next
one runs. The host-sync count comes right after the install and prints its ratio lines before
anything slower runs:

    install    15  pip --no-deps --target WORK/site of the wheels (on PYTHONPATH for every later part), then
                   every requirement of vitp and of the wheels met at its version. Smoke: `pip install
                   --dry-run --target --python-version 3.12` of the wheels, the requirements checked here,
                   and every later part's processes see only the image's packages and the wheels
                   (bench/gpu_image/sitecustomize.py)
    syncs      45  bench/gpu_syncs.py: host syncs of a plain ViT-B/16 step in a 3-step profiler trace, against
                   the README's count (it prints what it expects first, its ratios before the trace is written)
    tests_gpu 210  pytest tests/gpu with VITP_REQUIRE_GPU=1: a skip fails (smoke: each skips with its reason);
                   every run there uncompiled but the submit test's
    pretrain  130  `vitp prep` of 512 synthetic photos, then a 1-GPU ViT-B/16 pre-training of 200 steps at
                   batch 256, tracking off: MFU and data_wait, medians of its training records after the
                   first (which compiles)
    gpu_step   60  bench/gpu_step.py sized down: vit_b16 at micro batches 128 and 256, vitp's step alone

Files in DIR (at most 8, each under 16 MiB): summary.json (every part: status, seconds, figures, note),
check.log (each part's output, its tail), tests_gpu.xml, syncs.txt, syncs_trace.json.gz,
pretrain_metrics.jsonl. Stdout: one `ratio NAME VALUE` line per figure (nan where its part failed);
everything else goes to stderr. WORK (default .gpu-check/) keeps the installed wheels, the shards and
TORCHINDUCTOR_CACHE_DIR between runs, so a rerun compiles from the cache.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
GUARD = ROOT / "bench" / "gpu_image"  # its sitecustomize.py refuses what the image lacks (smoke)
# Seconds per part, in this order, from the smoke run's measured times on a 2-core CPU (install 2.2, syncs
# 16.7, tests_gpu 7.1 (collection only: every test skips), pretrain 26.4, gpu_step 12.6; 65 s in all) and
# what a GPU adds: a vitp process's start to its first step took ~13 s there, and tests/gpu starts 11 of
# them (three pretrain runs and an eval, a submit and its job with the one cold compile, ZeRO-3, the
# binding, the preflight); the syncs part profiles 5 ViT-B/16 steps and writes the trace; pretrain's
# 200 steps at batch 256 compile first. The first GPU run's times go into the README.
BUDGETS = {"install": 15, "syncs": 45, "tests_gpu": 210, "pretrain": 130, "gpu_step": 60}
FIGURES = {"tests_gpu": ["gpu_tests_passed", "gpu_tests_failed", "gpu_tests_skipped"],
           "syncs": ["plain_step_syncs_gpu", "plain_step_event_syncs_gpu", "plain_step_dtoh_copies_gpu",
                     "plain_step_scalar_reads_gpu", "plain_step_pageable_htod_gpu"],
           "pretrain": ["mfu_pretrain_vit_b16_gpu", "data_wait_pretrain_vit_b16_gpu"],
           "gpu_step": ["mfu_vit_b16"]}
PLATFORMS = ["manylinux2014_x86_64", "manylinux_2_17_x86_64", "manylinux_2_28_x86_64"]
LOG_TAIL = 2 * 2**20  # of each part's output in check.log
MAX_FILES, MAX_BYTES = 8, 16 * 2**20
RATIO = re.compile(r"^ratio (\S+) (\S+)$", re.M)
LAUNCH = "import sys; from launch.local import run_local; sys.exit(run_local(sys.argv[2:], int(sys.argv[1])))"
TINY_VIT = ["model.width=32", "model.depth=2", "model.heads=2", "model.mlp_dim=64", "model.patch=8",
            "model.img_size=32", "model.representation_size=32"]


@dataclass
class Part:
    name: str
    status: str = "not run"  # ok | failed | timed out | skipped: ...
    seconds: float = 0.0
    figures: dict = field(default_factory=dict)
    note: str = ""
    timed_out: bool = False


class Check:
    def __init__(self, a):
        self.a, self.smoke = a, a.smoke
        self.work, self.out, self.wheels = a.work.resolve(), a.out.resolve(), a.wheels.resolve()
        t0 = time.monotonic()
        self.deadline = t0 + a.total_s
        ends = [t0 + sum(BUDGETS[p] for p in a.parts[:i + 1]) for i in range(len(a.parts))]
        self.slot_end = dict(zip(a.parts, ends))  # a part's budget, plus what the ones before it left
        self.logs: list[tuple[str, Path]] = []
        paths = [str(ROOT)] if self.smoke else [str(self.work / "site"), str(ROOT)]
        self.env = dict(os.environ, PYTHONUNBUFFERED="1", TORCHINDUCTOR_CACHE_DIR=str(self.work / "inductor"),
                        PYTHONPATH=os.pathsep.join(filter(None, [*paths, os.environ.get("PYTHONPATH")])))
        self.env.pop("VITP_REQUIRE_GPU", None)

    # ---- running one command of a part -------------------------------------------------------------
    def sh(self, part: Part, cmd: list[str], budget: float, env: dict | None = None) -> tuple[int, str]:
        """Run ``cmd`` in its own process group for at most ``budget`` s (killed, group and all, past it);
        its stderr and stdout go to the part's log; -> (exit code, 124 on timeout; stdout)."""
        log = self.work / "logs" / f"{part.name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        if (part.name, log) not in self.logs:
            self.logs.append((part.name, log))
        with open(log, "a") as err:
            err.write(f"$ {' '.join(cmd)}\n")
            err.flush()
            p = subprocess.Popen(cmd, cwd=ROOT, env=env or self.env, stdout=subprocess.PIPE, stderr=err, text=True,
                                 start_new_session=True)
            try:
                out, _ = p.communicate(timeout=max(1.0, budget))
                code = p.returncode
            except subprocess.TimeoutExpired:
                _kill(p)
                out, code = p.communicate()[0] or "", 124
                part.timed_out = True
            err.write(out)
        return code, out

    def left(self, part: Part) -> float:
        """Seconds ``part`` may still use: to the end of its slot (none in the smoke) and the check's deadline."""
        end = self.deadline if self.smoke else min(self.slot_end[part.name], self.deadline)
        return end - time.monotonic()

    # ---- the parts ---------------------------------------------------------------------------------
    def install(self, part: Part) -> None:
        whls = sorted(self.wheels.glob("*.whl"))
        manifest = self.wheels / "MANIFEST.json"
        if not whls or not manifest.is_file():
            raise PartError(f"no wheels in {self.wheels}: run `make gpu-wheels` where a package registry is at hand")
        sys.path.insert(0, str(ROOT / "bench"))
        from gpu_wheels import carried_problem

        too_big = carried_problem(whls)  # what a GPU machine without a registry receives
        if too_big:
            raise PartError(too_big)
        pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
               "--no-cache-dir", "--disable-pip-version-check"]
        if self.smoke:  # the set installs for the image's Python, alone (nothing else is fetched)
            plats = [a for p in PLATFORMS for a in ("--platform", p)]
            code, _ = self.sh(part, [*pip, "--dry-run", "--target", str(self.work / "dry-run"), "--python-version",
                                     "3.12", "--implementation", "cp", "--only-binary=:all:", *plats,
                                     *map(str, whls)], self.left(part))
            what = "pip install --dry-run --python-version 3.12 of the wheels"
        else:
            shutil.rmtree(self.work / "site", ignore_errors=True)
            code, _ = self.sh(part, [*pip, "--upgrade", "--target", str(self.work / "site"), *map(str, whls)],
                              self.left(part))
            what = "pip install --target of the wheels"
        if code:
            raise PartError(f"{what}: exit {code} (check.log)")
        verify_cmd = [sys.executable, str(Path(__file__)), "--verify", str(self.wheels)]
        code, out = self.sh(part, verify_cmd, self.left(part))
        if code:
            raise PartError(f"requirements not met: {'; '.join(out.split(chr(10))[:3])}")
        part.note = f"{len(whls)} wheels; every requirement met"
        if self.smoke:
            deny = denied_modules(self.wheels)
            self.env["PYTHONPATH"] = os.pathsep.join([str(GUARD), self.env["PYTHONPATH"]])
            self.env["VITP_IMAGE_DENY"] = ",".join(sorted(deny))
            part.note += f"; {len(deny)} modules outside the image and the wheels refused from here on"

    def tests_gpu(self, part: Part) -> None:
        xml = self.out / "tests_gpu.xml"
        env = dict(self.env) if self.smoke else dict(self.env, VITP_REQUIRE_GPU="1")
        code, out = self.sh(part, [sys.executable, "-m", "pytest", "tests/gpu", "-v", "-rA", "-p", "no:cacheprovider",
                                   f"--junitxml={xml}"], self.left(part), env)
        if not xml.is_file():  # killed: what its verbose lines said so far
            done = re.findall(r"^tests/gpu/\S+::\S+ (PASSED|FAILED|ERROR|SKIPPED)", out, re.M)
            part.figures = {"gpu_tests_passed": done.count("PASSED"),
                            "gpu_tests_failed": done.count("FAILED") + done.count("ERROR"),
                            "gpu_tests_skipped": done.count("SKIPPED")}
            raise PartError(f"pytest exit {code}, no report; before it ended: {part.figures}")
        suite = ET.parse(xml).getroot()
        suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
        n = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
        failed, skipped = n["failures"] + n["errors"], n["skipped"]
        part.figures = {"gpu_tests_passed": n["tests"] - failed - skipped, "gpu_tests_failed": failed,
                        "gpu_tests_skipped": skipped}
        reasons = {s.get("message", "") for s in suite.iter("skipped")}
        part.note = f"{n['tests']} tests: {part.figures}"
        if self.smoke:  # no CUDA here: each must skip, with its reason in one line
            bad = [r for r in reasons if "needs a CUDA GPU" not in r or "\n" in r]
            if code or n["tests"] == 0 or skipped != n["tests"] or bad:
                raise PartError(f"without CUDA every test must skip in one line: exit {code}, {n}, reasons {bad}")
        elif code or failed or skipped or n["tests"] == 0:
            raise PartError(f"pytest exit {code}: {n['tests']} tests, {failed} failed, {skipped} skipped")

    def syncs(self, part: Part) -> None:
        cmd = [sys.executable, "bench/gpu_syncs.py", "--out", str(self.out), "--run-dir", str(self.work / "syncs_run"),
               "--compile", "off"]
        code, out = self.sh(part, cmd + (["--smoke"] if self.smoke else []), self.left(part))
        part.figures = ratios(out)
        if code:
            raise PartError(f"bench/gpu_syncs.py exit {code}")

    def pretrain(self, part: Part) -> None:
        shards, run = self.work / "shards", self.work / "pretrain_run"
        n, lo, hi = (32, 40, 80) if self.smoke else (512, 256, 320)
        if _samples(shards) != n:  # kept between runs, as the compile cache
            images = self.work / "images"
            shutil.rmtree(images, ignore_errors=True)
            code, _ = self.sh(part, [sys.executable, "-c", "import sys; from pathlib import Path; from bench.gpu_step "
                                     "import write_images; write_images(Path(sys.argv[1]), *map(int, sys.argv[2:]))",
                                     str(images), str(n), str(lo), str(hi)], self.left(part))
            if code:
                raise PartError(f"writing {n} images: exit {code}")
            code, _ = self.sh(part, [sys.executable, "-m", "launch.cli", "prep", str(images), str(shards),
                                     "--max-samples-per-shard", str(max(4, n // 16)), "--workers",
                                     str(min(16, os.cpu_count() or 1)), "--no-progress"], self.left(part))
            if code:
                shutil.rmtree(shards, ignore_errors=True)
                raise PartError(f"vitp prep: exit {code}")
        shutil.rmtree(run, ignore_errors=True)  # else it resumes from the last run's final checkpoint
        workers = max(1, min(12, (os.cpu_count() or 2) - 2))
        common = [f"run.dir={run}", f"data.path={shards}", "data.val_split=", "tracking.enabled=false",
                  "train.eval_every=0", "checkpoint.every=0", "cluster.nodes=1", "cluster.tasks_per_node=1",
                  "data.shuffle_buffer=256"]
        if self.smoke:
            ov = [*common, *TINY_VIT, "engine.precision=fp32", "engine.backend=gloo", "cluster.gpus_per_node=0",
                  "train.compile=false", "train.steps=6", "train.log_every=2", "train.micro_batch=4",
                  "train.global_batch=4", "schedule.warmup_steps=2", "data.workers=1"]
        else:
            ov = [*common, "engine.backend=nccl", "cluster.gpus_per_node=1", "train.steps=200", "train.log_every=25",
                  "train.micro_batch=256", "train.global_batch=256", "schedule.warmup_steps=25",
                  f"data.workers={workers}"]
        code, _ = self.sh(part, [sys.executable, "-c", LAUNCH, "1", "pretrain", "--config",
                                 str(ROOT / "configs/pretrain/vit_b16.yaml"), *ov], self.left(part))
        metrics = run / "metrics.jsonl"
        records = [json.loads(x) for x in metrics.read_text().splitlines()] if metrics.is_file() else []
        if metrics.is_file():
            shutil.copyfile(metrics, self.out / "pretrain_metrics.jsonl")
        train = [r for r in records if "mfu" in r][1:]  # the first window compiles
        waits = [r["data_wait"] for r in train if "data_wait" in r]
        part.figures = {"mfu_pretrain_vit_b16_gpu": statistics.median(r["mfu"] for r in train) if train else math.nan,
                        "data_wait_pretrain_vit_b16_gpu": statistics.median(waits) if waits else math.nan}
        part.note = (f"{len(train)} training records after the first"
                     + ("" if waits or not train else "; they carry no data_wait"))
        if code:
            raise PartError(f"pretrain exit {code}")
        if not train:
            raise PartError("no training record after the first")

    def gpu_step(self, part: Part) -> None:
        cmd = [sys.executable, "bench/gpu_step.py", "--models", "vit_b16", "--sections", "search"]
        if self.smoke:
            cmd.append("--smoke")
        else:
            cmd += ["--batches", "128,256", "--warmup", "2", "--steps", "3", "--windows", "3", "--budget-s",
                    str(max(10, int(self.left(part) - 15)))]
        code, out = self.sh(part, cmd, self.left(part))
        part.figures = ratios(out)
        if code:
            raise PartError(f"bench/gpu_step.py exit {code}")

    # ---- the whole ---------------------------------------------------------------------------------
    def run(self) -> list[Part]:
        clear(self.out)
        shutil.rmtree(self.work / "logs", ignore_errors=True)
        parts = []
        for name in self.a.parts:
            part, t0 = Part(name), time.monotonic()
            if self.left(part) < 5:
                part.status = "skipped: the check's time is up"
            else:
                try:
                    getattr(self, name)(part)
                    part.status = "ok"
                except PartError as e:
                    part.status, part.note = "failed", str(e)
                except Exception as e:  # a bug in this script: report it, run the other parts
                    part.status, part.note = "failed", f"{type(e).__name__}: {e}"
                part.seconds = time.monotonic() - t0
                if part.timed_out:
                    part.status = "timed out"
            for k in FIGURES.get(name, []):
                part.figures.setdefault(k, math.nan)
            for k, v in part.figures.items():
                print(f"ratio {k} {float(v):.4f}", flush=True)
            print(f"[gpu-check] {name:<9s} {part.status:<8s} {part.seconds:6.1f}s  {part.note}", file=sys.stderr,
                  flush=True)
            parts.append(part)
        self.write(parts)
        return parts

    def write(self, parts: list[Part]) -> None:
        with open(self.out / "check.log", "w") as f:
            for name, log in self.logs:
                data = log.read_bytes()
                f.write(f"===== {name} ({len(data)} bytes{', tail' if len(data) > LOG_TAIL else ''})\n")
                f.write(data[-LOG_TAIL:].decode(errors="replace"))
        summary = {"smoke": self.smoke, "total_s": sum(p.seconds for p in parts),
                   "parts": {p.name: {"status": p.status, "seconds": round(p.seconds, 1), "figures": p.figures,
                                      "note": p.note} for p in parts}}
        (self.out / "summary.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")
        files = sorted(p for p in self.out.rglob("*") if p.is_file())
        big = [p for p in files if p.stat().st_size >= MAX_BYTES]
        if len(files) > MAX_FILES or big or any(p.parent != self.out for p in files):
            raise SystemExit(f"error: {self.out} holds {len(files)} files (at most {MAX_FILES}, none in folders), "
                             f"{len(big)} of 16 MiB or more: {[p.name for p in files]}")


def clear(folder: Path) -> None:
    """``folder`` made empty, the folder itself kept: it may be a mount point (a GPU machine's result
    folder), which cannot be removed."""
    folder.mkdir(parents=True, exist_ok=True)
    for p in folder.iterdir():
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink()


def _samples(shards: Path) -> int | None:
    try:
        return json.loads((shards / "_info.json").read_text())["splits"]["train"]["num_samples"]
    except (OSError, ValueError, KeyError):
        return None


class PartError(RuntimeError):
    """A part's failure, in one line."""


def _kill(p: subprocess.Popen) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            return
        try:
            p.wait(timeout=5)
            return
        except subprocess.TimeoutExpired:
            continue


def ratios(out: str) -> dict[str, float]:
    return {k: float(v) for k, v in RATIO.findall(out)}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def verify(wheels: Path) -> list[str]:
    """Requirements of vitp (pyproject.toml, but those the wheels' manifest leaves out) and of every wheel
    that this interpreter's path does not meet at their versions."""
    from importlib.metadata import PackageNotFoundError, version

    from packaging.requirements import Requirement

    manifest = json.loads((wheels / "MANIFEST.json").read_text())
    left_out = {_norm(n) for n in manifest["left_out"]}
    reqs = [Requirement(d) for d in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]]
    reqs += [Requirement(r) for rs in manifest["wheels"].values() for r in rs]
    problems = []
    for r in reqs:
        if _norm(r.name) in left_out:
            continue
        try:
            have = version(r.name)
        except PackageNotFoundError:
            problems.append(f"{r}: not installed")
            continue
        if r.specifier and not r.specifier.contains(have, prereleases=True):
            problems.append(f"{r}: {have} installed")
    return sorted(set(problems))


def denied_modules(wheels: Path) -> set[str]:
    """Top-level modules of this interpreter whose distributions are neither in the GPU image nor among the
    wheels (nor vitp itself): what a smoke process must not import."""
    from importlib.metadata import packages_distributions

    sys.path.insert(0, str(ROOT / "bench"))
    from gpu_wheels import image_packages, wheel_name

    allowed = image_packages() | {wheel_name(w)[0] for w in wheels.glob("*.whl")} | {"vitp"}
    return {mod for mod, dists in packages_distributions().items()
            if mod not in sys.stdlib_module_names and not any(_norm(d) in allowed for d in dists)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / ".gpu-check" / "out", help="the result files (GPU_CHECK_OUT)")
    ap.add_argument("--work", type=Path, default=ROOT / ".gpu-check",
                    help="installed wheels, shards, runs, compile cache, logs; kept between runs (GPU_CHECK_WORK)")
    ap.add_argument("--wheels", type=Path, default=ROOT / ".gpu-wheels", help="`make gpu-wheels`' folder (GPU_WHEELS)")
    ap.add_argument("--total-s", type=float, default=None,
                    help="the whole check's limit (default: the budgets' sum; smoke 1800)")
    ap.add_argument("--parts", type=lambda s: s.split(","), default=list(BUDGETS),
                    help=f"comma-separated, in this order (GPU_CHECK_PARTS; default {','.join(BUDGETS)}): a rerun of "
                         "what failed (the wheels an earlier run installed stay in WORK/site)")
    ap.add_argument("--smoke", action="store_true", help="every part on the CPU, tiny sizes")
    ap.add_argument("--verify", type=Path, default=None, help=argparse.SUPPRESS)  # the install part's second step
    a = ap.parse_args(argv)
    if a.verify:
        problems = verify(a.verify)
        print("\n".join(problems))
        return 1 if problems else 0
    unknown = [p for p in a.parts if p not in BUDGETS]
    if unknown:
        ap.error(f"--parts: {', '.join(unknown)} unknown (parts: {', '.join(BUDGETS)})")
    a.parts = [p for p in BUDGETS if p in a.parts]
    a.total_s = a.total_s or (1800.0 if a.smoke else float(sum(BUDGETS.values())))
    parts = Check(a).run()
    return 0 if all(p.status == "ok" for p in parts) else 1


if __name__ == "__main__":
    sys.exit(main())
