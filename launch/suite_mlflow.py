"""A transfer suite's MLflow parent run: one per checkpoint, its numbers, and superseded finals tagged.

The parent run belongs to one identity: the checkpoint (``init.from`` and its weights' digest). OUT's
``suite_state.json`` keeps the parent of each identity it has seen, so running the suite again on the
same checkpoint continues that run, and another checkpoint into the same OUT opens another one.

    suite_state.json   {"checkpoint_name": ..., "parents": {<identity digest>: {"mlflow_run_id", "mlflow_run_key",
                        "init.from", "source_digest"}}}
"""

from __future__ import annotations

import json

from .suite_decontam import marks
from .suite_identity import digest
from .suite_table import STATE_FILE, draw, finals, group_means, groups, mean, read_results, score, std


def _state(suite) -> dict:
    try:
        state = json.loads((suite.out / STATE_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return state if isinstance(state, dict) else {}


def parent_key(suite) -> str:
    return digest({"source": suite.source, "source_digest": suite.source_digest()})


def open_parent(suite):
    """The suite's MLflow run for this checkpoint (continued when OUT/suite_state.json names one), or a
    no-op sink. Records the checkpoint's name (suite.md's column) either way."""
    from pipeline.tracking import Sink
    from pipeline.tracking.setup import Tracking
    from pipeline.weights import source_lineage

    state = _state(suite)
    state["checkpoint_name"] = suite.name
    parents, key = state.setdefault("parents", {}), parent_key(suite)
    mine = parents.get(key, {})
    sink = Sink()
    if suite.uri:
        section = suite.base.tracking.model_copy(update={"system_metrics": False, "parent_run": None})
        sink = Tracking(section, suite.out, rank=0, run_name=f"suite-{suite.out.name}-{suite.name}").mlflow(
            world_size=1, stage="suite", run_id=mine.get("mlflow_run_id"), run_key=mine.get("mlflow_run_key"),
            params={"suite.file": suite.path, "suite.lrs": suite.spec.lrs, "suite.vtab1k": suite.spec.vtab1k,
                    "suite.minival_fraction": suite.spec.minival_fraction, "suite.repeats": suite.spec.repeats,
                    "init.from": suite.source, "suite.datasets": ",".join(d.name for d in suite.spec.datasets)})
        if sink.run_id:
            parents[key] = {"mlflow_run_id": sink.run_id, "mlflow_run_key": sink.run_key, "init.from": suite.source,
                            "source_digest": suite.source_digest()}
        lineage = source_lineage(suite.source)
        checked = marks(suite.source, suite.spec.datasets)
        sink.set_tags({"vitp.checkpoint": suite.source, "vitp.checkpoint_digest": suite.source_digest(),
                       **({"vitp.decontaminated": ",".join(f"{k}={v}" for k, v in checked.items())}
                          if any(checked.values()) else {}),
                       **({"vitp.pretrain_run": lineage["parent_run_id"]} if "parent_run_id" in lineage else {})})
    suite.out.mkdir(parents=True, exist_ok=True)
    (suite.out / STATE_FILE).write_text(json.dumps(state, indent=1))
    return sink


def metrics(table: list[dict]) -> dict[str, float]:
    """The parent's numbers: per dataset its mean test score (and std over repeats), the chosen lr and
    its minival score; each group's mean and the mean over all datasets."""
    fin, group_of = finals(table), groups(table)
    out: dict[str, float] = {}
    for d, v in fin.items():
        if score(v) is not None:
            out[f"suite/{d}/test_top1"] = score(v)
        if std(v) is not None:
            out[f"suite/{d}/test_top1_std"] = std(v)
    for r in table:
        if r["phase"] == "final" and r.get("selected") and r.get("lr") is not None:
            out[f"suite/{r['dataset']}/lr"] = float(r["lr"])
            if r.get("minival_top1") is not None:
                out[f"suite/{r['dataset']}/minival_top1"] = float(r["minival_top1"])
    for g, v in group_means(fin, group_of).items():
        if v is not None:
            out[f"suite/{g}/mean_test_top1"] = v
    if mean(fin) is not None:
        out["suite/mean_test_top1"] = mean(fin)
    return out


def tag_superseded(suite, table: list[dict]) -> None:
    """Each superseded final's own MLflow run gets ``vitp.suite_status=superseded``."""
    from pipeline.tracking.setup import Tracking

    if not suite.uri:
        return
    section = suite.base.tracking.model_copy(update={"system_metrics": False, "parent_run": None})
    for r in table:
        rid = read_results(r["run_dir"]).get("mlflow_run_id") if r["status"] == "superseded" else None
        if rid:
            sink = Tracking(section, suite.out / "superseded", rank=0).mlflow(world_size=1, stage="transfer",
                                                                             run_id=rid)
            sink.set_tags({"vitp.suite_status": "superseded"})
            sink.close(status="FINISHED", timeout=suite.base.tracking.close_timeout_s)


def publish(suite, sink, table: list[dict]) -> None:
    """The table's numbers, the tables and the figure on the suite's run; superseded finals tagged."""
    fin = finals(table)
    png = draw([(suite.name, fin)], suite.out / "suite.png")
    sink.log(metrics(table), 0)
    old = [r["run_dir"] for r in table if r["status"] == "superseded"]
    sink.set_tags({"vitp.superseded_finals": (",".join(old) or "none")[:4000]})
    for p in (suite.out / "suite.csv", suite.out / "suite.md", png):
        sink.log_artifact(p)
    tag_superseded(suite, table)
