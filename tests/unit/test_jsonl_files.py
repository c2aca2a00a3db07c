"""Append-only JSON-lines files after a full disk or a crash: every reader (metrics.jsonl, the MLflow spool,
the job index, the attempt events, the demo's summary) drops each line that is not JSON, warns once naming
the file and the line numbers, and uses the rest; every writer starts its append on a fresh line."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest

from launch import demo
from launch.attempts import EVENTS, append_event, read_events
from launch.jobs import INDEX, append_index, read_index
from pipeline.files import CutLines, append_jsonl, read_jsonl
from pipeline.tracking import METRICS, JsonlSink
from pipeline.tracking.mlflow_sink import MlflowSink
from pipeline.tracking.mlflow_store import SPOOL, Delivery

RECORDS = [{"step": s, "loss": 1.0 / s, "op": "metric", "key": "loss", "value": 1.0 / s, "ts": s,
            "job_id": str(s), "event": "failed"} for s in (1, 2, 3, 4)]
LINES = [json.dumps(r) for r in RECORDS]

# name -> (the file's bytes, the 1-based lines a reader must skip, the records it keeps)
DAMAGE = {
    "cut": ("\n".join(LINES[:3]) + "\n" + LINES[3][:30], [4], RECORDS[:3]),  # the last append cut by a full disk
    "nul": ("\n".join(LINES) + "\n" + "\0" * 300, [5], RECORDS),  # what ext4/NFS leave where a crash lost data
    "mid": (f"{LINES[0]}\n{LINES[1][:25]}\n{LINES[2]}\n{LINES[3]}\n", [2], [RECORDS[0], *RECORDS[2:]]),
}


def damaged(path: Path, kind: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(DAMAGE[kind][0].encode())
    return path


def steps(records) -> list[int]:
    return [r["step"] for r in records]


def read_warned(read, path: Path, kind: str, *, twice: bool = True):
    """``read()`` under recorded warnings: its result, after checking the one warning it gave (naming
    ``path`` and the damaged line); ``twice``: a second read of the same damage says nothing new."""
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        out = read()
        if twice:
            assert read() == out
    cut = [x for x in w if issubclass(x.category, CutLines)]
    assert len(cut) == 1, [str(x.message) for x in w]
    msg = str(cut[0].message)
    assert msg.startswith(f"{path}: ") and f"line {DAMAGE[kind][1][0]};" in msg and "\n" not in msg, msg
    return out


@pytest.mark.parametrize("kind", sorted(DAMAGE))
def test_read_jsonl_skips_what_is_not_json_and_warns_once(kind, tmp_path):
    p = damaged(tmp_path / "log.jsonl", kind)
    assert read_warned(lambda: read_jsonl(p), p, kind) == DAMAGE[kind][2]


@pytest.mark.parametrize("kind", sorted(DAMAGE))
def test_metrics_jsonl_is_read_and_rewritten_without_the_damage(kind, tmp_path):
    p = damaged(tmp_path / METRICS, kind)
    want = [r for r in DAMAGE[kind][2] if r["step"] <= 3]
    assert read_warned(lambda: JsonlSink(p, keep_up_to=3).records, p, kind, twice=False) == want
    assert p.read_text() == "".join(json.dumps(r) + "\n" for r in want)  # rewritten: the next start finds it whole
    sink = JsonlSink(p, keep_up_to=3)
    sink.log({"loss": 0.5}, 4)  # the resumed run's next step
    assert p.read_text() == "".join(json.dumps(r) + "\n" for r in [*want, {"step": 4, "loss": 0.5}])
    assert [demo._metric_curve(tmp_path, "loss")[s] for s in (1, 4)] == [1.0, 0.5]


@pytest.mark.parametrize("kind", sorted(DAMAGE))
def test_the_demos_metric_readers_use_the_rest(kind, tmp_path):
    p = damaged(tmp_path / METRICS, kind)
    curve = read_warned(lambda: demo._metric_curve(tmp_path, "loss"), p, kind)
    assert sorted(curve) == steps(DAMAGE[kind][2])
    assert demo._last_metric(tmp_path, "loss") == round(DAMAGE[kind][2][-1]["loss"], 4)


@pytest.mark.parametrize("kind", sorted(DAMAGE))
def test_the_spool_is_counted_and_claimed_without_the_damage(kind, tmp_path):
    """`vitp jobs`/`--wait` count it; a resumed run and `vitp sync` claim it (read under a temporary
    name, the warning names the spool), and what stays undelivered is spooled again, whole."""
    p = damaged(tmp_path / "a" / SPOOL, kind)
    assert read_warned(lambda: MlflowSink.spooled(p.parent), p, kind) == len(DAMAGE[kind][2])
    p = damaged(tmp_path / "b" / SPOOL, kind)
    d = Delivery("http://127.0.0.1:9", p.parent)
    assert read_warned(d._claim_spool, p, kind, twice=False) == DAMAGE[kind][2]
    assert not p.exists()
    d._pending = DAMAGE[kind][2]
    assert d._write_spool(None) == len(DAMAGE[kind][2])
    assert [r["step"] for r in read_jsonl(p)] == steps(DAMAGE[kind][2])


@pytest.mark.parametrize("kind", sorted(DAMAGE))
def test_the_job_index_and_events_skip_the_damage(kind, tmp_path):
    index = damaged(tmp_path / "jobs" / INDEX, kind)
    assert [e["job_id"] for e in read_warned(lambda: read_index(tmp_path / "jobs"), index, kind)] == \
        [r["job_id"] for r in DAMAGE[kind][2]]
    events = damaged(tmp_path / "job" / EVENTS, kind)
    assert read_warned(lambda: read_events(tmp_path / "job"), events, kind) == DAMAGE[kind][2]


@pytest.mark.parametrize("kind", ["cut", "nul"])
def test_every_writer_starts_on_a_fresh_line(kind, tmp_path):
    """After a cut or NUL-tailed last line, a new record must not be glued onto it (and lost with it)."""
    new = {"step": 5, "loss": 0.2}
    keep = DAMAGE[kind][2]
    writers = {
        "append_jsonl": (tmp_path / "a.jsonl", lambda p: append_jsonl(p, [new])),
        "metrics": (tmp_path / "m" / METRICS, lambda p: JsonlSink.log(_bare_sink(p), {"loss": 0.2}, 5)),
        "index": (tmp_path / "jobs" / INDEX, lambda p: append_index(p.parent, new)),
        "events": (tmp_path / "job" / EVENTS, lambda p: append_event(p.parent, new)),
        "spool": (tmp_path / "s" / SPOOL, lambda p: _spool_one(p, new)),
    }
    for name, (path, write) in writers.items():
        damaged(path, kind)
        write(path)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", CutLines)
            got = read_jsonl(path)
        assert got[:-1] == keep and got[-1]["step"] == 5, name
    append_jsonl(tmp_path / "fresh.jsonl", [new, new])  # a new or whole file gets no blank line
    append_jsonl(tmp_path / "fresh.jsonl", [new])
    assert (tmp_path / "fresh.jsonl").read_text() == (json.dumps(new) + "\n") * 3


def _bare_sink(path: Path) -> JsonlSink:
    """A sink appending to ``path`` as it is (a run between its start and the damage)."""
    sink = JsonlSink.__new__(JsonlSink)
    sink.path, sink.records = path, []
    return sink


def _spool_one(path: Path, op: dict) -> None:
    d = Delivery("http://127.0.0.1:9", path.parent)
    d._pending = [op]
    d._write_spool(None)
