#!/usr/bin/env bash
# A three-node SLURM cluster on this host, for the end-to-end tests: munged + slurmctld + `slurmd -N node1`
# + `slurmd -N node2` + `slurmd -N node3`, all as root, all state under $VITP_SERVICES_DIR/slurm.
#
# Usage: launch/services/slurm.sh up|down|status
#
#   up      start whatever is not running yet, wait until every node is idle (no-op when already up; a
#           running cluster of an older config of this script, e.g. two nodes, is taken down and restarted)
#   down    cancel jobs still on the cluster, stop the daemons `up` started (by pid file only)
#   status  print each daemon and `sinfo`; exit 0 only when the cluster answers
#
# Env read:
#   VITP_SERVICES_DIR      state dir (default /tmp/vitp-services)
#   SLURM_CONF             where the config is written (default /etc/slurm/slurm.conf). The client tools
#                          (sbatch, squeue, scancel, scontrol) read that same variable, so the default
#                          needs nothing exported; a custom path must be exported to them too.
#   VITP_SLURM_TIMEOUT     seconds to wait for the nodes to become idle (default 60)
#   VITP_SLURMCTLD_PORT    slurmctld port (default 17000)
#   VITP_SLURMD_PORT       first slurmd port (default 17001; node2 and node3 use the next ones)
#   VITP_SLURM_NODE_CPUS   CPUs each node advertises (default 4; the nodes share this host's cores)
#   VITP_SLURM_GRACE_S     preemption grace time of partition debug (default 60)
#
# Partitions:
#   debug   node1, node2; the default; its jobs can be preempted (requeued) by jobs of `urgent`
#   urgent  node1, node2; PriorityTier 2: a job here preempts debug jobs it needs the nodes of, as a
#           production cluster's high-priority queue does (SIGCONT + SIGTERM, GraceTime seconds, requeue)
#   faults  node1, node2, node3: a 2-node job that leaves a bad node out still has two nodes to run on
#
# A second, isolated cluster (e.g. to test `down` while another one serves) needs its own
# VITP_SERVICES_DIR, SLURM_CONF and ports; node names and everything else stay the same.
#
# The config is marked as ours; `up` refuses to overwrite a slurm.conf it did not write, so a real
# cluster's config is never clobbered.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
source "$here/common.sh"

SDIR="$VITP_SERVICES_DIR/slurm"
CONF="${SLURM_CONF:-/etc/slurm/slurm.conf}"
TIMEOUT="${VITP_SLURM_TIMEOUT:-60}"
CTLD_PORT="${VITP_SLURMCTLD_PORT:-17000}"
SLURMD_PORT="${VITP_SLURMD_PORT:-17001}"
NODE_CPUS="${VITP_SLURM_NODE_CPUS:-4}"
GRACE_S="${VITP_SLURM_GRACE_S:-60}"
NODES=(node1 node2 node3)
MARKER="# vitp local test cluster (written by launch/services/slurm.sh)"
MUNGE_SOCKET="$SDIR/munge/munge.socket"
MUNGE_PID="$SDIR/munge/munged.pid"
CTLD_PID="$SDIR/run/slurmctld.pid"
CTLD_LOG="$SDIR/log/slurmctld.log"

slurmd_pid() { echo "$SDIR/run/slurmd-$1.pid"; }
slurmd_log() { echo "$SDIR/log/slurmd-$1.log"; }

preflight() {
    [[ $(id -u) == 0 ]] || die "must run as root (the local cluster runs its daemons as SlurmUser=root)"
    local exe missing=()
    for exe in munged slurmctld slurmd sbatch squeue sinfo scontrol scancel; do
        command -v "$exe" >/dev/null || missing+=("$exe")
    done
    ((${#missing[@]} == 0)) ||
        die "missing ${missing[*]}; install with launch/services/install-debian.sh"
}

write_conf() {
    local host
    host=$(hostname -s)
    if [[ -f $CONF ]] && ! grep -qxF "$MARKER" "$CONF"; then
        die "$CONF exists and was not written by this script; move it away or set SLURM_CONF"
    fi
    mkdir -p "$(dirname "$CONF")"
    # Why these settings:
    #  - SlurmUser=root, proctrack/linuxproc, task/none: no cgroups or a slurm user needed in a container.
    #  - config_overrides: both slurmds share this host, so each advertises NODE_CPUS regardless of the
    #    real core count (2-node jobs with a few CPUs per task must schedule on a 2-core box).
    #  - CR_Core without memory: memory requests are checked against RealMemory but not consumed, so
    #    jobs run side by side.
    #  - JobRequeue=1: batch jobs may be requeued (`scontrol requeue`, submitit's preemption path).
    #  - KillWait=10: after SIGTERM a task gets 10 s before SIGKILL — enough to write a checkpoint,
    #    short enough for tests.
    #  - cred_expire=10: a requeued job waits cred_expire seconds before it may start again; slurm's
    #    120 s default would dominate every requeue test.
    #  - sched_interval/bf_interval=2: a requeued job becomes eligible later and is only started by a
    #    periodic scheduler pass (60 s / 30 s by default).
    #  - MinJobAge=300: finished jobs stay visible in squeue/scontrol for 5 min (no accounting DB).
    #  - ReturnToService=2: a node that restarts comes back idle instead of staying DOWN.
    #  - PreemptType=preempt/partition_prio + PreemptMode=REQUEUE: a job of the higher-PriorityTier
    #    partition `urgent` preempts debug jobs the way production clusters do: SIGCONT + SIGTERM to the
    #    tasks (no USR2: no PreemptParameters=send_user_signal), GraceTime seconds to save, then SIGKILL
    #    and the job goes back to the queue.
    #  - node3 only in partition `faults` (a job that leaves a node out runs on the other two): debug and
    #    urgent keep the same two nodes, so an urgent job still has to preempt a debug one to run.
    cat >"$CONF.tmp" <<EOF
$MARKER
ClusterName=vitp
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$MUNGE_SOCKET,cred_expire=10
CredType=cred/munge
StateSaveLocation=$SDIR/ctld
SlurmctldPidFile=$CTLD_PID
SlurmctldLogFile=$CTLD_LOG
SlurmdPidFile=$SDIR/run/slurmd-%n.pid
SlurmdSpoolDir=$SDIR/spool/%n
SlurmdLogFile=$SDIR/log/slurmd-%n.log
SlurmdParameters=config_overrides
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SwitchType=switch/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=2
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
JobRequeue=1
KillWait=10
MinJobAge=300
ReturnToService=2
SlurmdTimeout=300
SlurmctldTimeout=120
InactiveLimit=0
Waittime=0
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
NodeName=node[1-3] NodeHostname=$host NodeAddr=127.0.0.1 Port=$SLURMD_PORT-$((SLURMD_PORT + 2)) CPUs=$NODE_CPUS RealMemory=8000 State=UNKNOWN
PartitionName=debug Nodes=node[1-2] Default=YES MaxTime=INFINITE State=UP PriorityTier=1 GraceTime=$GRACE_S
PartitionName=urgent Nodes=node[1-2] MaxTime=INFINITE State=UP PriorityTier=2 PreemptMode=OFF
PartitionName=faults Nodes=node[1-3] MaxTime=INFINITE State=UP PriorityTier=1
EOF
    # slurmctld reads its node table at start only: a running cluster of another config restarts
    if [[ -f $CONF ]] && ! cmp -s "$CONF.tmp" "$CONF" && pid_alive "$CTLD_PID" slurmctld; then
        log "config changed ($CONF): restarting the cluster"
        cmd_down
    fi
    mv "$CONF.tmp" "$CONF"
}

ensure_hosts() {
    # slurmctld and srun resolve node names; both are this host.
    local n missing=()
    for n in "${NODES[@]}"; do
        getent hosts "$n" >/dev/null || missing+=("$n")
    done
    if ((${#missing[@]} > 0)); then
        echo "127.0.0.1 ${missing[*]}" >>/etc/hosts
        log "added '127.0.0.1 ${missing[*]}' to /etc/hosts"
    fi
}

start_munge() {
    pid_alive "$MUNGE_PID" munged && return 0
    local key="$SDIR/munge/munge.key"
    if [[ ! -s $key ]]; then
        head -c 1024 /dev/urandom >"$key.tmp" && chmod 0400 "$key.tmp" && mv "$key.tmp" "$key"
    fi
    rm -f "$MUNGE_SOCKET"
    # --force: munged refuses to run as root or with a socket dir under /tmp without it.
    munged --force --key-file="$key" --socket="$MUNGE_SOCKET" --pid-file="$MUNGE_PID" \
        --log-file="$SDIR/log/munged.log" --seed-file="$SDIR/munge/munged.seed" ||
        { tail_logs "$SDIR/log/munged.log"; die "munged failed to start"; }
    wait_for 10 "munged socket" test -S "$MUNGE_SOCKET" ||
        { tail_logs "$SDIR/log/munged.log"; die "munged did not come up"; }
}

start_slurmctld() {
    pid_alive "$CTLD_PID" slurmctld && return 0
    # -c: start from a clean slate; jobs of a previous session would otherwise be recovered.
    slurmctld -c -f "$CONF" || { tail_logs "$CTLD_LOG"; die "slurmctld failed to start"; }
}

start_slurmd() {
    local n=$1
    pid_alive "$(slurmd_pid "$n")" slurmd && return 0
    mkdir -p "$SDIR/spool/$n"
    slurmd -c -N "$n" -f "$CONF" || { tail_logs "$(slurmd_log "$n")"; die "slurmd -N $n failed to start"; }
}

nodes_idle() {
    # Every node in a usable state (idle, or already running jobs when `up` finds the cluster up).
    local states
    states=$(sinfo -h -N -o '%N %t' 2>/dev/null) || return 1
    local n
    for n in "${NODES[@]}"; do
        grep -Eq "^$n (idle|mix|alloc)\$" <<<"$states" || return 1
    done
}

all_running() {
    pid_alive "$MUNGE_PID" munged && pid_alive "$CTLD_PID" slurmctld || return 1
    local n
    for n in "${NODES[@]}"; do pid_alive "$(slurmd_pid "$n")" slurmd || return 1; done
}

cmd_up() {
    preflight
    if all_running && nodes_idle; then
        log "already up"
        return 0
    fi
    mkdir -p "$SDIR"/{munge,ctld,run,log,spool}
    chmod 0700 "$SDIR/munge"
    ensure_hosts
    write_conf
    start_munge
    start_slurmctld
    wait_for "$TIMEOUT" "slurmctld to answer" scontrol ping ||
        { tail_logs "$CTLD_LOG"; die "slurmctld is not answering"; }
    local n
    for n in "${NODES[@]}"; do start_slurmd "$n"; done
    if ! wait_for "$TIMEOUT" "nodes ${NODES[*]} to be idle" nodes_idle; then
        sinfo -N >&2 || true
        tail_logs "$CTLD_LOG" "$(slurmd_log node1)" "$(slurmd_log node2)" "$(slurmd_log node3)"
        die "cluster did not become ready"
    fi
    log "up: partitions debug, urgent (preempts debug), faults (3 nodes), nodes ${NODES[*]} (config $CONF)"
}

cmd_down() {
    [[ $(id -u) == 0 ]] || die "must run as root"
    if pid_alive "$CTLD_PID" slurmctld; then
        # Jobs still running would leave slurmstepd and their tasks behind once slurmd is gone.
        local jobs
        jobs=$(squeue -h -o %i 2>/dev/null || true)
        if [[ -n $jobs ]]; then
            # shellcheck disable=SC2086
            scancel $jobs 2>/dev/null || true
            wait_for 30 "jobs to finish" jobs_gone || log "some jobs still running; stopping anyway"
        fi
    fi
    local n specs=()
    for n in "${NODES[@]}"; do specs+=("$(slurmd_pid "$n"):slurmd"); done
    # slurmds first: a slurmd that outlives slurmctld keeps retrying to register.
    stop_pidfiles 15 "${specs[@]}"
    stop_pidfiles 15 "$CTLD_PID:slurmctld" "$MUNGE_PID:munged"
    rm -f "$MUNGE_SOCKET"
    log "down"
}

jobs_gone() {
    [[ -z $(squeue -h -t R,CG,S -o %i 2>/dev/null) ]]
}

cmd_status() {
    local rc=0 n
    report() { if pid_alive "$1" "$2"; then echo "$3: running (pid $(cat "$1"))"; else echo "$3: stopped"; rc=1; fi; }
    report "$MUNGE_PID" munged munged
    report "$CTLD_PID" slurmctld slurmctld
    for n in "${NODES[@]}"; do report "$(slurmd_pid "$n")" slurmd "slurmd $n"; done
    if ((rc == 0)); then
        sinfo -N -o '%N %P %t %c' || rc=1
    fi
    return $rc
}

case "${1:-}" in
up) cmd_up ;;
down) cmd_down ;;
status) cmd_status ;;
*) die "usage: $0 up|down|status" ;;
esac
