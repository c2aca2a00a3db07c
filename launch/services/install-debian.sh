#!/usr/bin/env bash
# Install what the README's two commands need from Debian/Ubuntu; a no-op when it is all there.
# `make test` (through tests/run_with_services.sh) and `make demo` (when it creates .venv) call it.
#
# Usage: launch/services/install-debian.sh [services] [venv]
#
#   services  (default) munge slurmd slurmctld slurm-client: the local SLURM cluster (slurm.sh);
#             curl: mlflow.sh polls the tracking server's /health; nginx-light: the tests' TLS proxy
#             in front of a login-protected MLflow server (tests/auth_services.py)
#   venv      python3-venv: Debian's python3 cannot create a virtual environment without it
#
# What counts as present is the commands (munged, slurmctld, ..., curl; python3's ensurepip), so a
# machine that has them from elsewhere is left alone. As root with apt-get: `apt-get update`, then
# install the missing packages. Otherwise: exit 1 with one line saying what to run.
set -euo pipefail
me=launch/services/install-debian.sh

groups=("$@")
((${#groups[@]})) || groups=(services)
missing=()
need() {  # need PACKAGE COMMAND...: the package is missing when one of its commands is
    local pkg=$1 exe
    shift
    for exe in "$@"; do
        if ! command -v "$exe" >/dev/null; then
            [[ " ${missing[*]} " == *" $pkg "* ]] || missing+=("$pkg")
            return
        fi
    done
}
for g in "${groups[@]}"; do
    case $g in
    services)
        need munge munged
        need slurmctld slurmctld
        need slurmd slurmd
        need slurm-client sbatch squeue sinfo scontrol scancel
        need curl curl
        need nginx-light nginx
        ;;
    venv)
        python3 -c 'import ensurepip, venv' 2>/dev/null || missing+=(python3-venv)
        ;;
    *)
        echo "$me: unknown group '$g' (services, venv)" >&2
        exit 2
        ;;
    esac
done
if ((${#missing[@]} == 0)); then
    exit 0
fi
if [[ $(id -u) != 0 ]]; then
    echo "$me: missing ${missing[*]}; run as root: sudo bash $me ${groups[*]}" >&2
    exit 1
fi
if ! command -v apt-get >/dev/null; then
    echo "$me: missing ${missing[*]} and no apt-get here; install them with this system's package manager" >&2
    exit 1
fi
echo "$me: installing ${missing[*]} (apt-get)"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
# The packages' own init scripts are not used: slurm.sh starts every daemon itself with its own config.
apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
echo "$me: installed ${missing[*]}"
