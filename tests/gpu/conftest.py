"""tests/gpu/: where GPUs were asked for, a skip is a failure.

GPUs are asked for by VITP_REQUIRE_GPU=1 (a GPU CI job sets it), or by CI=true on a machine whose
nvidia-smi lists a GPU (a GPU runner): there a test that skips because torch cannot use CUDA (a
driver older than torch's CUDA build, say) hides exactly the fault these tests exist to catch.
Elsewhere (CI's CPU runners, a laptop) the tests skip with their one-line reason.
"""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest


def _gpu_listed() -> bool:
    if shutil.which("nvidia-smi") is None:
        return False
    try:
        r = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return False
    return r.returncode == 0 and "GPU" in r.stdout


def gpus_required(environ=None, gpu_listed=_gpu_listed) -> str | None:
    """Why GPUs are required here (a skip would then fail), or None."""
    env = os.environ if environ is None else environ
    if env.get("VITP_REQUIRE_GPU", "").lower() in ("1", "true", "yes"):
        return "VITP_REQUIRE_GPU is set"
    if env.get("CI", "").lower() in ("1", "true", "yes") and gpu_listed():
        return "CI on a machine whose nvidia-smi lists a GPU"
    return None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    if rep.skipped and not hasattr(rep, "wasxfail"):
        why = gpus_required()
        if why:
            reason = rep.longrepr[2] if isinstance(rep.longrepr, tuple) else str(rep.longrepr)
            rep.outcome = "failed"
            rep.longrepr = f"{why}: {item.nodeid} must run on the GPU but skipped: {reason}"
