#!/usr/bin/env bash
# Start what the tests need, run pytest with the given arguments, stop what was started.
# As root (CI): the local SLURM cluster and the MLflow server, and their tests must not skip.
# Not root: the MLflow server only; SLURM tests skip with a reason.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${VITP_PYTHON:-.venv/bin/python}
export VITP_PYTHON=$PY
started=()
cleanup() {
  for s in "${started[@]}"; do bash "launch/services/$s.sh" down >/dev/null 2>&1 || true; done
}
trap cleanup EXIT

if [ -f launch/services/mlflow.sh ]; then
  out=$(bash launch/services/mlflow.sh up) || { echo "$out"; echo "error: MLflow server did not start" >&2; exit 1; }
  started+=(mlflow)
  uri=$(printf '%s\n' "$out" | sed -n 's/^MLFLOW_TRACKING_URI=//p' | tail -1)
  [ -n "$uri" ] && export VITP_TEST_MLFLOW_URI=$uri
fi
if [ "$(id -u)" = 0 ] && [ -f launch/services/slurm.sh ]; then
  bash launch/services/slurm.sh up || { echo "error: SLURM cluster did not start" >&2; exit 1; }
  started+=(slurm)
  export VITP_SLURM=1
fi

"$PY" -m pytest "$@"
rc=$?
if [ $rc -eq 5 ]; then echo "error: pytest ran no test" >&2; exit 1; fi
exit $rc
