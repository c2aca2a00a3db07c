#!/usr/bin/env bash
# Start what the tests need, run pytest with the given arguments, stop what this script started.
# As root (CI): install the Debian packages when missing (launch/services/install-debian.sh), start the
# local SLURM cluster and the MLflow server; their tests must not skip.
# Not root: the MLflow server only; SLURM tests skip with a reason.
# A service that was already up (`make services-up`, another session) is used and left up.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${VITP_PYTHON:-.venv/bin/python}
export VITP_PYTHON=$PY
started=()
cleanup() {
  local s
  for s in "${started[@]}"; do bash "launch/services/$s.sh" down >/dev/null 2>&1 || true; done
}
trap cleanup EXIT

if [ "$(id -u)" = 0 ]; then
  bash launch/services/install-debian.sh services || exit 2
else
  # Not fatal: the SLURM tests skip without root anyway; mlflow.sh says so if curl is what is missing.
  bash launch/services/install-debian.sh services || true
fi

if bash launch/services/mlflow.sh status >/dev/null 2>&1; then
  echo "run_with_services.sh: MLflow server already up; leaving it up"
else
  started+=(mlflow)  # before `up`: a half-started server is stopped too
  out=$(bash launch/services/mlflow.sh up) || { echo "$out"; echo "error: MLflow server did not start" >&2; exit 1; }
fi

if [ "$(id -u)" = 0 ]; then
  if bash launch/services/slurm.sh status >/dev/null 2>&1; then
    echo "run_with_services.sh: SLURM cluster already up; leaving it up"
  else
    started+=(slurm)
    bash launch/services/slurm.sh up || { echo "error: SLURM cluster did not start" >&2; exit 1; }
  fi
  export VITP_SLURM=1
fi

t0=$(date +%s)
"$PY" -m pytest "$@"
rc=$?
# The suite's own clock (the slowest tests are listed above by --durations): .ci/run warns from this
# line when the suite outgrows its budget.
s=$(( $(date +%s) - t0 ))
printf 'pytest wall time: %d s (%d min %02d s); %d s with the set-up of services\n' "$s" $((s / 60)) \
  $((s % 60)) "$SECONDS"
if [ $rc -eq 5 ]; then echo "error: pytest ran no test" >&2; exit 1; fi
exit $rc
