"""Where a run's records go: sinks behind one interface (pipeline/tracking/sink.py).

    sink.py         Sink (the interface; the base does nothing) and Sinks (fans out to several)
    jsonl.py        JsonlSink: RUN_DIR/metrics.jsonl on rank 0
    mlflow_sink.py  MlflowSink: an MLflow run, sent by a background thread, spooled when the server
                    is away (`vitp sync`)
    mlflow_store.py the requests to the store, the spool, the access check; with mlflow_sink.py the
                    only modules that import mlflow
    setup.py        what a stage calls: Tracking (from the tracking section: the server's address,
                    check_access, the MLflow sink, tracking.sinks)

The training loop and the evaluation stage both use this package; it imports nothing from
pipeline/train or pipeline/eval.
"""

from pipeline.tracking.jsonl import METRICS, JsonlSink
from pipeline.tracking.sink import Sink, Sinks

__all__ = ["METRICS", "JsonlSink", "Sink", "Sinks"]
