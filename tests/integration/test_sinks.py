"""A third place for a run's records is one Sink subclass in one file (this one), named in
``tracking.sinks``: in a real 2-rank run it receives exactly the records metrics.jsonl gets, the
run's artifacts and its end; the loop is not touched."""

import json
from pathlib import Path

import pytest

from launch.local import run_local
from pipeline.tracking import Sink

pytestmark = pytest.mark.distributed
ROOT = Path(__file__).resolve().parents[2]
NAME = "tests.integration.test_sinks:RecordingSink"


class RecordingSink(Sink):
    """Appends what it is told to RUN_DIR/recorded.jsonl (rank 0 builds it, as Class(run_dir))."""

    def __init__(self, run_dir: Path):
        self.path = run_dir / "recorded.jsonl"

    def _write(self, record: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")

    def log(self, metrics, step):
        self._write({"step": step, **metrics})

    def log_artifact(self, path, artifact_path=None):
        self._write({"artifact": Path(path).name, "folder": artifact_path})

    def close(self, status=None, timeout=30.0):
        self._write({"closed": status})


def test_a_sink_named_in_the_config_gets_what_metrics_jsonl_gets(tmp_path):
    run = tmp_path / "run"
    args = ["pretrain", "--config", str(ROOT / "configs/pretrain/tiny_cpu.yaml"), f"run.dir={run}",
            "data.path=synthetic:train=256,val=32", "model.depth=1", "model.img_size=16", "train.steps=6",
            "train.log_every=2", "train.eval_every=3", "checkpoint.every=0", "tracking.enabled=false",
            f"tracking.sinks=[{NAME}]"]
    assert run_local(args, 2, timeout=900) == 0
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    got = [json.loads(x) for x in (run / "recorded.jsonl").read_text().splitlines()]
    records = [r for r in got if "step" in r]
    assert [r["step"] for r in metrics] == [2, 3, 4, 6] and "val_top1" in metrics[1]
    assert records == metrics  # the same records, in the same order, once (rank 0 only)
    assert {r["artifact"] for r in got if "artifact" in r} >= {"config.yaml", "model.safetensors", "loss_curve.png"}
    assert got[-1] == {"closed": "FINISHED"} and sum("closed" in r for r in got) == 1


def test_a_sink_name_that_is_not_a_sink_is_a_config_error(tmp_path):
    from pipeline.config import ConfigError, load_config
    from pipeline.tracking.setup import Tracking

    def configured_sinks(cfg, run_dir, rank):
        return Tracking.from_config(cfg, run_dir, rank=rank).extra_sinks()

    for name, says in [("tests.integration.test_sinks:Nope", "AttributeError"),
                       ("no_such_module_x:Sink", "ModuleNotFoundError"),
                       ("pathlib:Path", "not a pipeline.tracking.Sink subclass")]:
        cfg = load_config("configs/pretrain/tiny_cpu.yaml", ["data.path=synthetic", f"tracking.sinks=[{name}]"])
        with pytest.raises(ConfigError, match=f"tracking.sinks: '{name}'.*{says}"):
            configured_sinks(cfg, tmp_path, rank=1)  # every rank checks: none goes on alone
    cfg = load_config("configs/pretrain/tiny_cpu.yaml", ["data.path=synthetic", f"tracking.sinks=[{NAME}]"])
    assert configured_sinks(cfg, tmp_path, rank=1) == []
    assert [type(s) for s in configured_sinks(cfg, tmp_path, rank=0)] == [RecordingSink]
