# Shared helpers for the service scripts (sourced, not executed).
#
# Every daemon a script starts is recorded by a pid file under the state dir, and only those pids are
# ever signalled: `down` must never touch a slurmd/munged/mlflow that somebody else runs on the host.

VITP_SERVICES_DIR="${VITP_SERVICES_DIR:-/tmp/vitp-services}"

die() {
    echo "$(basename "$0"): $*" >&2
    exit 1
}

log() {
    echo "$(basename "$0"): $*"
}

# pid_alive PIDFILE [COMM] -> 0 when the file names a live process (whose command name starts with
# COMM, so a pid recycled by an unrelated process after a crash is not mistaken for our daemon).
pid_alive() {
    local pidfile=$1 comm=${2:-} pid
    [[ -s $pidfile ]] || return 1
    pid=$(tr -dc '0-9' <"$pidfile")
    [[ -n $pid ]] && kill -0 "$pid" 2>/dev/null || return 1
    if [[ -n $comm ]]; then
        [[ $(cat "/proc/$pid/comm" 2>/dev/null) == "$comm"* ]] || return 1
    fi
    return 0
}

# wait_for TIMEOUT_S DESCRIPTION CMD... -> polls CMD every 0.2 s until it succeeds; 1 on timeout.
wait_for() {
    local timeout=$1 what=$2
    shift 2
    local deadline=$((SECONDS + timeout))
    until "$@" >/dev/null 2>&1; do
        if ((SECONDS >= deadline)); then
            echo "$(basename "$0"): timed out after ${timeout}s waiting for ${what}" >&2
            return 1
        fi
        sleep 0.2
    done
}

# stop_pidfiles TIMEOUT_S PIDFILE:COMM... -> SIGTERM every recorded process at once (daemons take ~2 s
# each to shut down), SIGKILL those that outlive the timeout, then remove the pid files. A stale or
# foreign pid file is just removed.
stop_pidfiles() {
    local timeout=$1 spec pidfile comm pid pids=()
    shift
    for spec in "$@"; do
        pidfile=${spec%%:*} comm=${spec#*:}
        if pid_alive "$pidfile" "$comm"; then
            pid=$(tr -dc '0-9' <"$pidfile")
            kill -TERM "$pid" 2>/dev/null || true
            pids+=("$pid")
        fi
    done
    if ((${#pids[@]} > 0)) && ! wait_for "$timeout" "pids ${pids[*]} to exit" pids_gone "${pids[@]}"; then
        kill -KILL "${pids[@]}" 2>/dev/null || true
        wait_for 5 "pids ${pids[*]} to die" pids_gone "${pids[@]}" || return 1
    fi
    for spec in "$@"; do rm -f "${spec%%:*}"; done
}

pids_gone() {
    local pid
    for pid in "$@"; do
        ! kill -0 "$pid" 2>/dev/null || return 1
    done
}

# tail_logs FILE... -> last lines of each log, for a failure message that says why.
tail_logs() {
    local f
    for f in "$@"; do
        [[ -f $f ]] || continue
        echo "---- last lines of $f" >&2
        tail -n 15 "$f" >&2
    done
}
