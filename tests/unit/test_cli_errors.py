"""One error path for every command (launch/cli.run_command): a mistake is one `error: ...` line on
stderr and exit 2; a run that failed is exit 1; each command's --help says its exit codes."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

from launch.cli import COMMANDS, main, run_command
from pipeline.errors import exit_code

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs/pretrain/tiny_cpu.yaml")
TINY_FT = str(ROOT / "configs/transfer/tiny_cpu.yaml")

# command -> (a bad input, the start of its one error line); the paths are relative to tmp_path
BAD = {
    "prep": (["missing-images", "out"], "error: missing-images: no such directory or manifest"),
    "verify": (["out", "--workers", "0"], "error: --workers: must be >= 1; got 0"),
    "decontam": (["out", "--exclude-near", "missing"], "error: out: no _info.json (not a finished `vitp prep` output)"),
    "pretrain": (["--config", TINY, "optim.lrr=1"], "error: optim.lrr: unknown key (did you mean 'optim.lr'?)"),
    "transfer": (["--config", TINY_FT, "train.steps=0"], "error: train.steps: must be >= 1; got 0"),
    "eval": (["--checkpoint", "run", "--data", "missing"], "error: --data missing: no such dataset folder"),
    "export": (["missing-run", "w.safetensors"], "error: missing-run: no model.safetensors"),
    "inspect": (["--checkpoint", "missing-run", "--out", "figs"], "error: init.from: missing-run: no such checkpoint"),
    "plan": (["--config", TINY, "cluster.nodes=0"], "error: cluster.nodes: must be >= 1; got 0"),
    "submit": (["pretrain", "--config", TINY, "--dry-run", "train.micro_batch=3"],
               "error: train.global_batch: 32 is not divisible by world size"),
    "preflight": (["--config", TINY, "--io-mb", "0"], "error: --io-mb >= 1"),
    "jobs": (["--last", "0", "--log-dir", "jobs"], "error: --last: must be >= 1; got 0"),
    "logs": (["123", "--log-dir", "jobs"], "error: job 123: not in jobs/index.jsonl (use --log-dir)"),
    "cancel": (["123", "--log-dir", "jobs"], "error: job 123: not in jobs/index.jsonl (use --log-dir)"),
    "sync": (["missing-run"], "error: missing-run: no such run directory"),
    "demo": (["--data", "missing"], "error: --data missing: not a directory"),
    "suite": (["--config", "missing.yaml", "init.from=run", "run.dir=out"], "error: missing.yaml: cannot read"),
    "config": (["show", "--config", TINY, "engine.zero_stage=4"],
               "error: engine.zero_stage: expected 0, 1, 2, 3 or auto, got 4"),
}


def test_every_command_has_a_bad_input_case():
    assert set(BAD) == set(COMMANDS)


@pytest.mark.parametrize("command", sorted(BAD))
def test_bad_input_is_one_line_and_exit_2(command, tmp_path, monkeypatch, capfd):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "out").mkdir()
    argv, line = BAD[command]
    assert main([command, *argv]) == 2
    out, err = capfd.readouterr()
    assert err.startswith(line) and err.count("\n") == 1, err
    assert not (tmp_path / "figs").exists() and not (tmp_path / "w.safetensors").exists()  # nothing written


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_help_names_the_exit_codes(command, capsys):
    argv = [command, "show", "--help"] if command == "config" else [command, "--help"]
    try:
        code = main(argv)  # `vitp submit --help` prints and returns
    except SystemExit as e:  # argparse's --help
        code = e.code
    text = " ".join(capsys.readouterr().out.split())
    assert code == 0 and ("exit codes: 0 done" in text or "Exit status 0" in text), text
    assert "2 a usage" in text, text


def test_a_failed_run_exits_1_in_one_line(capfd):
    from pipeline.train.loop import NonFiniteLoss

    def fails(argv):
        raise NonFiniteLoss("loss is nan at step 3")

    assert run_command(fails, []) == 1
    assert capfd.readouterr().err == "error: loss is nan at step 3\n"


def test_a_bug_keeps_its_traceback():
    def bug(argv):
        raise KeyError("x")

    with pytest.raises(KeyError):
        run_command(bug, [])


# The project's errors and their exit codes: each class says its own (pipeline.errors.Classified)
EXIT_CODES = (
    ("pipeline.train.loop", "NonFiniteLoss", 1),  # the run started and failed
    ("data_prep.shards", "WorkerDied", 1),
    ("data_prep.upload", "UploadFailed", 1),
    ("launch.cli", "CommandFailed", 1),
    ("pipeline.train.build", "RunDirError", 2),
    ("pipeline.rundir", "RunDirBusy", 2),
    ("pipeline.distributed", "AcceleratorError", 2),
    ("pipeline.distributed", "RendezvousError", 2),
    ("pipeline.tracking.mlflow_store", "TrackingAccessError", 2),
    ("pipeline.config", "ConfigError", 2),  # the project's bad values are ValueErrors
    ("launch.submit_args", "SubmitError", 2),
    ("builtins", "ValueError", 2),
    ("builtins", "FileNotFoundError", 2),
)


@pytest.mark.parametrize("module,name,code", EXIT_CODES)
def test_exit_table_names_real_exception_classes(module, name, code):
    cls = getattr(importlib.import_module(module), name)
    assert issubclass(cls, Exception) and code in (1, 2)
    assert exit_code(cls("x")) == code


def test_other_errors_are_bugs():
    assert exit_code(KeyError("x")) is None and exit_code(RuntimeError("x")) is None
    assert exit_code(ModuleNotFoundError("x")) is None


# A mistake that needs the checkpoint's weights to be seen (they are read with torch)
NEEDS_TORCH = {"export", "inspect"}
HEAVY = ("torch", "deepspeed", "mlflow", "matplotlib", "submitit")

_ANSWERS = """
import json, os, sys
from launch.cli import main
from tests.unit.test_cli_errors import BAD, HEAVY, NEEDS_TORCH
os.chdir(sys.argv[1])
loaded = {}
for command, (argv, _) in BAD.items():
    for case in ([command, "show", "--help"] if command == "config" else [command, "--help"],
                 *([] if command in NEEDS_TORCH else [[command, *argv]])):
        try:
            code = main(case)
        except SystemExit as e:
            code = e.code
        heavy = [m for m in HEAVY if m in sys.modules]
        if heavy:
            loaded[" ".join(case)] = heavy
            break
print("RESULT " + json.dumps(loaded))
"""


def test_help_and_mistakes_answer_without_loading_the_stage(tmp_path):
    """`vitp COMMAND --help` and each command's mistake (BAD) are answered before torch, DeepSpeed,
    MLflow, matplotlib or submitit load (seconds each on a busy node): a stage module is imported
    once its command line and config are checked. In a fresh interpreter, one case after another."""
    import json
    import subprocess
    import sys

    (tmp_path / "out").mkdir()
    proc = subprocess.run([sys.executable, "-c", _ANSWERS, str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and line, proc.stderr[-3000:]
    assert json.loads(line[-1][len("RESULT "):]) == {}


@pytest.mark.parametrize("uri", ["file:///some/dir", "./mlruns", "none"])
@pytest.mark.parametrize("command", [["pretrain"], ["submit", "pretrain", "--cluster", "local"]])
def test_a_file_store_tracking_uri_is_refused_before_anything_starts(command, uri, tmp_path, monkeypatch, capfd):
    """MLflow's file store (a file: URI, a bare path; `none` is one too) would die after start-up in
    MLflow's multi-line maintenance-mode exception: refused at the config, under both commands."""
    monkeypatch.chdir(tmp_path)
    where = ["run.dir=run", "cluster.log_dir=jobs", "data.path=synthetic", "cluster.tasks_per_node=1"]
    assert main([*command, "--config", TINY, *where, f"tracking.uri={uri}"]) == 2
    err = capfd.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith(f"error: tracking.uri: {uri!r} ") and "file store" in err and "maintenance mode" in err, err
    assert "sqlite:///" in err and "tracking.enabled=false" in err, err
    assert list(tmp_path.iterdir()) == []  # no run dir, no job folder, no index, no mlruns
    # the same URI with tracking off is no mistake: nothing would open it
    from pipeline.config import load_config

    assert load_config(TINY, [f"tracking.uri={uri}", "tracking.enabled=false"]).tracking.uri == uri
