"""The wheels the GPU machine's image lacks, for `make gpu-check` there (it reaches no package registry).

    python bench/gpu_wheels.py --out .gpu-wheels          # what `make gpu-wheels` runs

From vitp's runtime requirements (pyproject.toml), every distribution the image does not list
(bench/gpu_image/packages.txt), and theirs, transitively, at the version requirements.lock pins:
binaries for CPython 3.12 on manylinux x86_64 from the package registry, DeepSpeed built here as a
pure-Python wheel (DS_BUILD_OPS=0: no compiled ops; vitp's optimizer is torch's). mlflow is left out:
the check runs with tracking off, and its closure (a web server, a database layer) would be most of
the 64 MiB the machine takes with the source. Then every requirement of every wheel must be met by
the image or another wheel, one version per distribution, and wheels + tracked source under 64 MiB;
MANIFEST.json lists the wheels and their requirements, so the check verifies versions on the machine.
Wheels already in --out at the pinned version are kept (a rerun downloads nothing).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import tomllib
from packaging.markers import default_environment
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
IMAGE = ROOT / "bench" / "gpu_image" / "packages.txt"
LEFT_OUT = {"mlflow"}  # tracking is off on the check (see the docstring)
# carried although the image has it: pydantic 2.14 requires typing-extensions>=4.16, and the image's list
# gives no version (a newer typing-extensions only adds names)
OVER_IMAGE = {"typing-extensions"}
BUILT_HERE = {"deepspeed"}  # no cp312 manylinux binary; pure Python without its ops
PLATFORMS = ["manylinux2014_x86_64", "manylinux_2_17_x86_64", "manylinux_2_28_x86_64", "manylinux1_x86_64"]
LIMIT = 64 * 2**20  # what travels to the machine: wheels and the working tree together
# the image's interpreter, for evaluating requirement markers
TARGET = {**default_environment(), "python_version": "3.12", "python_full_version": "3.12.3",
          "implementation_name": "cpython", "platform_python_implementation": "CPython", "sys_platform": "linux",
          "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix", "extra": ""}


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def image_packages(path: Path = IMAGE) -> set[str]:
    lines = (line.strip() for line in path.read_text().splitlines())
    return {norm(line) for line in lines if line and not line.startswith("#")}


def pins(lock: Path = ROOT / "requirements.lock") -> dict[str, str]:
    out = {}
    for line in lock.read_text().splitlines():
        if "==" in line and not line.startswith("#"):
            name, version = line.split("==", 1)
            out[norm(name)] = version.strip()
    return out


def runtime_requirements() -> list[Requirement]:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    return [Requirement(d) for d in deps]


def requires(wheel: Path) -> list[Requirement]:
    """The wheel's Requires-Dist that apply on the image's Python (no extras)."""
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(meta).decode()
    reqs = [Requirement(line.split(":", 1)[1].strip())
            for line in text.splitlines() if line.startswith("Requires-Dist:")]
    return [r for r in reqs if r.marker is None or r.marker.evaluate(TARGET)]


def wheel_name(wheel: Path) -> tuple[str, str]:
    name, version = wheel.name.split("-")[:2]
    return norm(name), version


def _pip(py: str, *args: str, env: dict | None = None) -> None:
    r = subprocess.run([py, "-m", "pip", *args], capture_output=True, text=True, env=env)
    if r.returncode:
        lines = [line for line in (r.stderr or r.stdout).splitlines() if line.strip() and "WARNING" not in line]
        raise SystemExit(f"error: pip {' '.join(args[:2])} ... {args[-1]}: {lines[-1] if lines else r.returncode}")


def fetch(name: str, version: str, out: Path, build_python: str) -> Path:
    """The wheel of ``name==version`` in ``out``: downloaded (a cp312 manylinux binary or pure Python), or
    built here for DeepSpeed."""
    have = [w for w in out.glob("*.whl") if wheel_name(w) == (name, version)]
    if have:
        return have[0]
    spec = f"{name}=={version}"
    if name in BUILT_HERE:
        # setup.py imports torch to decide which ops to build: the build python's torch, not a
        # CUDA build that an isolated build environment would download
        env = dict(os.environ, DS_BUILD_OPS="0")
        _pip(build_python, "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-binary", name, "-w", str(out),
             spec, env=env)
    else:
        plats = [a for p in PLATFORMS for a in ("--platform", p)]
        _pip(build_python, "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
             "--implementation", "cp", *plats, "-d", str(out), spec)
    got = [w for w in out.glob("*.whl") if wheel_name(w) == (name, version)]
    if not got:
        raise SystemExit(f"error: {spec}: pip left no wheel in {out}")
    return got[0]


def closure(out: Path, build_python: str) -> dict[str, Path]:
    """name -> wheel for every distribution vitp needs that the image lacks, transitively."""
    image, pinned = image_packages(), pins()
    todo = [r for r in runtime_requirements() if norm(r.name) not in LEFT_OUT]
    wheels: dict[str, Path] = {}
    while todo:
        name = norm(todo.pop().name)
        if (name in image and name not in OVER_IMAGE) or name in wheels:
            continue
        if name not in pinned:
            raise SystemExit(f"error: {name}: the image lacks it and requirements.lock pins no version")
        wheels[name] = fetch(name, pinned[name], out, build_python)
        print(f"  {wheels[name].name}", file=sys.stderr)
        todo += requires(wheels[name])
    return wheels


def check(wheels: list[Path], image: set[str]) -> list[str]:
    """Problems of the set: a requirement neither the image nor a wheel provides, or a wheel's version outside
    another wheel's range, or two versions of one distribution."""
    have = {}
    problems = []
    for w in wheels:
        name, version = wheel_name(w)
        if name in have:
            problems.append(f"{name}: two versions ({have[name]}, {version}); pip stops on both")
        have[name] = version
    for w in wheels:
        for r in requires(w):
            n = norm(r.name)
            if n in have and r.specifier and not r.specifier.contains(have[n], prereleases=True):
                problems.append(f"{w.name} requires {r}, the wheel is {n} {have[n]}")
            elif n not in have and n not in image:
                problems.append(f"{w.name} requires {r}: neither in the image nor among the wheels")
    return problems


UNCARRIED = {".git", ".gpu-check", ".gpu-wheels", "__pycache__", ".pytest_cache", ".ruff_cache", "runs", "mlruns"}


def tracked_bytes() -> int:
    """Bytes of the source tree a GPU machine receives: git's tracked files where git is at hand, else
    every file but the git-ignored kinds (what the GPU machine's copy holds)."""
    try:
        r = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True)
        files = [ROOT / f for f in r.stdout.decode().split("\0") if f]
    except (OSError, subprocess.CalledProcessError):  # no git, or no repository: the copy as it lies
        files = [Path(d) / n for d, dirs, names in os.walk(ROOT)
                 if not dirs.__setitem__(slice(None), [x for x in dirs if x not in UNCARRIED
                                                       and not x.startswith(".venv")])
                 for n in names]
    return sum(f.stat().st_size for f in files if f.is_file())


def carried_problem(wheels: list[Path]) -> str | None:
    """Why the wheels and the source tree cannot travel together (over LIMIT bytes), or None."""
    wheel_bytes = sum(w.stat().st_size for w in wheels)
    total = wheel_bytes + tracked_bytes()
    if total > LIMIT:
        return (f"wheels ({wheel_bytes / 2**20:.1f} MiB) and the source tree together {total / 2**20:.1f} MiB "
                f"> {LIMIT / 2**20:.0f} MiB")
    return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / ".gpu-wheels", help="the folder (default .gpu-wheels)")
    ap.add_argument("--build-python", default=sys.executable,
                    help="the python that downloads and builds (its torch builds DeepSpeed; default this one)")
    a = ap.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    wheels = closure(a.out, a.build_python)
    stale = [w for w in a.out.glob("*.whl") if w not in wheels.values()]
    for w in stale:  # another pin's wheel: two versions would stop the install
        w.unlink()
    problems = check(list(wheels.values()), image_packages())
    wheel_bytes = sum(w.stat().st_size for w in wheels.values())
    total = wheel_bytes + tracked_bytes()
    too_big = carried_problem(list(wheels.values()))
    if too_big:
        problems.append(too_big)
    manifest = {"python": "3.12", "left_out": sorted(LEFT_OUT), "image": str(IMAGE.relative_to(ROOT)),
                "wheels": {w.name: [str(r) for r in requires(w)] for w in sorted(wheels.values())}}
    (a.out / "MANIFEST.json").write_text(json.dumps(manifest, indent=1) + "\n")
    for p in problems:
        print(f"error: {p}", file=sys.stderr)
    print(f"{len(wheels)} wheels, {wheel_bytes / 2**20:.1f} MiB; with the tracked source {total / 2**20:.1f} MiB "
          f"of {LIMIT / 2**20:.0f}: {a.out}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
