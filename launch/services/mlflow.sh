#!/usr/bin/env bash
# An MLflow tracking server on 127.0.0.1 for the tests: SQLite backend store, artifacts proxied by the
# server into a local directory, all under $VITP_SERVICES_DIR/mlflow.
#
# Usage: launch/services/mlflow.sh up|down|restart|status
#
#   up       start the server unless it is already up, wait for /health, print MLFLOW_TRACKING_URI=...
#   down     stop the server `up` started (its whole process group, found by pid file)
#   restart  down, then up: same port, same store (runs logged before are still there)
#   status   print whether it runs and answers; exit 0 only when healthy
#
# Env read:
#   VITP_SERVICES_DIR      state dir (default /tmp/vitp-services)
#   VITP_MLFLOW_PORT       port (default 5055)
#   VITP_PYTHON            python whose mlflow runs the server (default python3)
#   VITP_MLFLOW_TIMEOUT    seconds to wait for /health (default 180; imports alone take ~30 s on a busy 2-core box)
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
source "$here/common.sh"

MDIR="$VITP_SERVICES_DIR/mlflow"
PORT="${VITP_MLFLOW_PORT:-5055}"
PY="${VITP_PYTHON:-python3}"
TIMEOUT="${VITP_MLFLOW_TIMEOUT:-180}"
URI="http://127.0.0.1:$PORT"
PIDFILE="$MDIR/server.pid"
LOG="$MDIR/server.log"

healthy() {
    curl -fsS --max-time 2 "$URI/health" >/dev/null 2>&1
}

# Ours = the recorded pid is alive and is an `mlflow server` (comm is the python binary's name).
ours_alive() {
    pid_alive "$PIDFILE" || return 1
    tr '\0' ' ' <"/proc/$(tr -dc '0-9' <"$PIDFILE")/cmdline" 2>/dev/null | grep -q 'mlflow server'
}

cmd_up() {
    command -v curl >/dev/null || die "curl is needed to poll $URI/health"
    "$PY" -c 'import mlflow' 2>/dev/null || die "no mlflow in $PY (set VITP_PYTHON to the project's venv python)"
    if ours_alive; then
        wait_for "$TIMEOUT" "$URI/health" healthy || { tail_logs "$LOG"; die "server (pid $(cat "$PIDFILE")) is not healthy"; }
        log "already up"
        echo "MLFLOW_TRACKING_URI=$URI"
        return 0
    fi
    healthy && die "port $PORT already serves something not started by this script; set VITP_MLFLOW_PORT"
    mkdir -p "$MDIR/artifacts"
    # setsid: the server and its uvicorn worker form one process group that `down` stops together.
    # One worker: a test server on a small shared machine; the SQLite store serialises writes anyway.
    # Telemetry off: test machines may have no internet and nothing should phone home.
    # Job execution off: it forks seven huey consumers (GenAI evaluation jobs) that tracking never uses.
    MLFLOW_DISABLE_TELEMETRY=true DO_NOT_TRACK=true MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false \
        setsid "$PY" -m mlflow server \
        --host 127.0.0.1 --port "$PORT" --workers 1 \
        --backend-store-uri "sqlite:///$MDIR/mlflow.db" \
        --serve-artifacts --artifacts-destination "$MDIR/artifacts" \
        >>"$LOG" 2>&1 </dev/null &
    echo $! >"$PIDFILE"
    if ! wait_for "$TIMEOUT" "$URI/health" healthy_or_dead; then
        tail_logs "$LOG"
        die "server did not become healthy"
    fi
    if ! ours_alive; then
        tail_logs "$LOG"
        die "server exited during start-up"
    fi
    log "up: $URI (store $MDIR)"
    echo "MLFLOW_TRACKING_URI=$URI"
}

# Stop polling early when the server died (bad flag, port taken) instead of waiting out the timeout.
healthy_or_dead() {
    healthy || ! ours_alive
}

cmd_down() {
    if ours_alive; then
        local pid
        pid=$(tr -dc '0-9' <"$PIDFILE")
        # Negative pid: the whole group setsid created (server + workers), nothing else.
        kill -TERM -- "-$pid" 2>/dev/null || true
        if ! wait_for 20 "mlflow server (pid $pid) to exit" group_gone "$pid"; then
            kill -KILL -- "-$pid" 2>/dev/null || true
            wait_for 5 "mlflow server (pid $pid) to die" group_gone "$pid" || die "could not stop pid $pid"
        fi
    fi
    rm -f "$PIDFILE"
    log "down"
}

group_gone() {
    ! kill -0 -- "-$1" 2>/dev/null
}

cmd_status() {
    if ours_alive; then
        echo "mlflow server: running (pid $(cat "$PIDFILE")) at $URI"
    else
        echo "mlflow server: stopped"
        return 1
    fi
    if healthy; then echo "health: ok"; else echo "health: not answering"; return 1; fi
}

case "${1:-}" in
up) cmd_up ;;
down) cmd_down ;;
restart) cmd_down && cmd_up ;;
status) cmd_status ;;
*) die "usage: $0 up|down|restart|status" ;;
esac
