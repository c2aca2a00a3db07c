"""launch/services/install-debian.sh on a machine without the packages. A fresh machine cannot be
made here (CI proves that path: .ci/run installs nothing itself, `make test` does), so PATH holds only
stand-ins: `id` says who runs it, `apt-get` records what it was asked."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = "launch/services/install-debian.sh"


def run(tmp_path: Path, uid: int, apt: bool = True, *groups: str) -> subprocess.CompletedProcess:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "id").write_text(f"#!/bin/sh\necho {uid}\n")
    if apt:
        (bin_dir / "apt-get").write_text(f"#!/bin/sh\necho \"$*\" >> {tmp_path / 'apt.log'}\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    return subprocess.run([shutil.which("bash"), SCRIPT, *groups], cwd=ROOT, env={"PATH": str(bin_dir)},
                          capture_output=True, text=True, timeout=60)


def test_root_with_apt_updates_then_installs_what_is_missing(tmp_path):
    r = run(tmp_path, 0)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "apt.log").read_text().splitlines() == [
        "update -qq", "install -y -qq --no-install-recommends munge slurmctld slurmd slurm-client curl nginx-light"]


@pytest.mark.parametrize("uid,apt,expect", [
    (1000, True, f"{SCRIPT}: missing munge slurmctld slurmd slurm-client curl nginx-light; run as root: "
                 f"sudo bash {SCRIPT} services"),
    (0, False, f"{SCRIPT}: missing munge slurmctld slurmd slurm-client curl nginx-light and no apt-get here; "
               "install them with this system's package manager"),
])
def test_says_in_one_line_what_to_run_when_it_cannot(tmp_path, uid, apt, expect):
    r = run(tmp_path, uid, apt)
    assert r.returncode == 1
    assert r.stderr.splitlines() == [expect]
    assert not (tmp_path / "apt.log").exists()


def test_nothing_to_do_when_the_commands_are_there():
    if not all(shutil.which(c) for c in ("munged", "slurmctld", "slurmd", "sbatch", "curl")):
        pytest.skip("this machine lacks the packages (the stand-in tests above cover it)")
    r = subprocess.run(["bash", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert (r.returncode, r.stdout, r.stderr) == (0, "", "")
