#!/usr/bin/env bash
# Install what launch/services/slurm.sh needs on Debian/Ubuntu (as root); a no-op when it is all there.
#
# Usage: launch/services/install-debian.sh
set -euo pipefail

pkgs=(munge slurmd slurmctld slurm-client curl)  # curl: mlflow.sh waits on /health
missing=()
for p in "${pkgs[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q '^install ok installed$' || missing+=("$p")
done
if ((${#missing[@]} == 0)); then
    echo "install-debian.sh: ${pkgs[*]} already installed"
    exit 0
fi
[[ $(id -u) == 0 ]] || { echo "install-debian.sh: must run as root to install ${missing[*]}" >&2; exit 1; }
command -v apt-get >/dev/null || { echo "install-debian.sh: no apt-get; install ${missing[*]} by hand" >&2; exit 1; }
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
# Packages' own init scripts are not used: slurm.sh starts every daemon itself with its own config.
apt-get install -y -qq --no-install-recommends "${missing[@]}"
echo "install-debian.sh: installed ${missing[*]}"
