"""A run's ``cfg`` is read where the run is built, not by the loop (tests/cfg_walk.py measures it).

A real 1-rank pre-training (DeepSpeed ZeRO-1 on CPU, synthetic data, validation, two checkpoints,
MLflow to SQLite) runs under the tracer: the training loop is never handed the config or a section,
every part given a section is visited once from the builder, and the walk stays within the issue's bounds
(at most 6 climbs back up and 15 returns).
"""

import json
import subprocess
import sys

import pytest

from tests import cfg_walk


@pytest.fixture
def walk(tmp_path):
    """The walk of a run in its own process (DeepSpeed keeps its process groups in module globals, which
    an in-process run would leave to the tests after it)."""
    out = tmp_path / "walk.json"
    r = subprocess.run([sys.executable, "-m", "tests.cfg_walk", "--json", str(out)], cwd=cfg_walk.ROOT,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(out.read_text())
    return got["rooms"], got["moves"]


def test_the_loop_never_sees_cfg_and_each_part_is_built_once(walk):
    rooms, moves = walk
    assert rooms[:4] == ["pipeline.pretrain", "pipeline.distributed", "pipeline.pretrain", "pipeline.train.build"]
    assert rooms[-1] == "pipeline.pretrain"
    assert not {"pipeline.train.loop", "pipeline.train.periodic", "pipeline.train.checkpoint"} & set(rooms)
    # each part given a section is entered once from the builder; the parts it builds from values (mixer,
    # schedule, patch dropping, EMA, the periodic tasks, the evaluators' tasks) are no room of the walk
    parts = ["pipeline.config.loading", "pipeline.tracking.setup", "pipeline.weights", "pipeline.train.engine"]
    assert all(rooms.count(p) == 1 for p in parts), {p: rooms.count(p) for p in parts}
    assert not {"pipeline.data.mixing", "pipeline.train.schedule", "pipeline.train.evaluations"} & set(rooms)
    # the train loader (source -> synthetic -> source), then the val loader its classify evaluator builds
    assert rooms.count("pipeline.data.source") == 4 and rooms.count("pipeline.data.synthetic") == 2
    # the declared evaluators are read once, from the builder (the old keys as entries: run_entries)
    assert rooms.count("pipeline.eval.declared") == 1
    s = cfg_walk.score(rooms, moves)
    # 6 climbs before evaluators were declared: + the entries the builder reads, + the val loader, which
    # the classify evaluator asks for on its own (no longer in one call with the train loader), + the
    # minival hold-out the builder asks of the data section once (pipeline/data/minival.py)
    assert s["returns"] <= 15 and s["climbs"] <= 9, s


def test_a_climb_is_a_return_into_an_importer():
    rooms = ["pipeline.train.build", "pipeline.data.source", "pipeline.data.synthetic", "pipeline.data.source",
             "pipeline.train.build"]
    # build -> source (a call down), source -> synthetic (a call into an importer: dispatch, not a climb),
    # synthetic -> source (a return down), source -> build (a return into an importer: the one climb)
    moves = [None, None, None, ("TrainLoader.__init__", "TrainLoader"), ("ClassLoaders.train_loader", "TrainLoader")]
    assert cfg_walk.score(rooms, moves) == {"rooms": 3, "stays": 5, "climbs": 1, "returns": 2}
    assert cfg_walk.score(rooms)["climbs"] == 2  # without moves, every move into an importer counts
