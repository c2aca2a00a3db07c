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

# VITP_TEST_STREAMS=2 (`make test`): two pytest processes at once, split by tests/conftest.py
# (VITP_TEST_STREAM): the tests of the SLURM cluster and the MLflow server, serially (one may stop the
# server), with every test that starts no ranks of its own; and the multi-rank tests. Each has its
# own temp folder; the cluster stream's report is printed after the other's. Else one pytest.
streams=${VITP_TEST_STREAMS:-1}
unset VITP_TEST_STREAMS  # a run_with_services.sh a test starts runs one pytest
t0=$(date +%s)
if [ "$streams" = 2 ]; then
  tmp=$(mktemp -d)
  trap 'kill "${cluster_pid:-}" 2>/dev/null; cleanup; rm -rf "$tmp"' EXIT
  VITP_TEST_STREAM=cluster "$PY" -m pytest --basetemp "$tmp/cluster" "$@" >"$tmp/cluster.log" 2>&1 &
  cluster_pid=$!
  VITP_TEST_STREAM=rest "$PY" -m pytest --basetemp "$tmp/rest" "$@" 2>&1 | tee "$tmp/rest.log"
  rc_rest=${PIPESTATUS[0]}
  wait "$cluster_pid"
  rc_cluster=$?
  echo
  echo "=== the cluster stream (SLURM tests, one after another, and the tests that start no ranks), run beside the above ==="
  cat "$tmp/cluster.log"
  # a log shows its tail only: what failed in either stream, and each stream's count, last
  echo
  echo "=== both streams' outcomes ==="
  for st in rest cluster; do
    grep -E "^(FAILED|ERROR) " "$tmp/$st.log" | sed "s/^/$st: /"
    grep -E "^=+ .*(passed|failed|error|no tests ran).* in [0-9.]+s" "$tmp/$st.log" | tail -1 | sed "s/^/$st: /"
  done
  # one stream may select nothing (a path given that is all in the other): 5 only when both ran nothing
  if [ $rc_rest = 5 ] && [ $rc_cluster = 5 ]; then rc=5
  elif [ $rc_rest != 0 ] && [ $rc_rest != 5 ]; then rc=$rc_rest
  elif [ $rc_cluster != 0 ] && [ $rc_cluster != 5 ]; then rc=$rc_cluster
  else rc=0; fi
else
  "$PY" -m pytest "$@"
  rc=$?
fi
# The suite's own clock (the slowest tests are listed above by --durations): .ci/run warns from this
# line when the suite outgrows its budget.
s=$(( $(date +%s) - t0 ))
printf 'pytest wall time: %d s (%d min %02d s); %d s with the set-up of services\n' "$s" $((s / 60)) \
  $((s % 60)) "$SECONDS"
if [ $rc -eq 5 ]; then echo "error: pytest ran no test" >&2; exit 1; fi
exit $rc
