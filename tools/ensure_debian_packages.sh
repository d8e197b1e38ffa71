#!/usr/bin/env bash
# Make sure the Debian packages the test suite drives for real are installed: chromium (the book's
# site check, through Playwright, never Playwright's own browser download), shellcheck (lints
# every generated launch script), iproute2 (ip and tc: chapter 05's emulated LAN hosts) and
# slurm-wlm with munge (chapter 06's real Slurm cluster).
# Idempotent: a program already present is left alone.
#   tools/ensure_debian_packages.sh                      # the defaults below
#   tools/ensure_debian_packages.sh shellcheck:shellcheck  # PROGRAM:PACKAGE pairs
# PROGRAM is a command name or an absolute path. Exit 1, with the reason, when one cannot be had.
set -euo pipefail

if [[ $# -eq 0 ]]; then
    set -- "${CHROMIUM:-/usr/bin/chromium}:chromium" "shellcheck:shellcheck" \
        "ip:iproute2" "tc:iproute2" "nsenter:util-linux" \
        "slurmctld:slurm-wlm" "slurmd:slurm-wlm" "sbatch:slurm-client" "munged:munge"
fi

present() {
    if [[ "$1" == /* ]]; then [[ -x "$1" ]]; else command -v "$1" >/dev/null 2>&1; fi
}

missing=()
for pair in "$@"; do
    program="${pair%%:*}"
    package="${pair#*:}"
    present "${program}" || missing+=("${package}")
done
[[ ${#missing[@]} -eq 0 ]] && exit 0

if [[ "$(id -u)" -ne 0 ]]; then
    echo "ensure_debian_packages: missing ${missing[*]}; installing needs root:" >&2
    echo "  sudo apt-get install -y ${missing[*]}" >&2
    exit 1
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "ensure_debian_packages: missing ${missing[*]} and there is no apt-get to install them" >&2
    exit 1
fi

echo "ensure_debian_packages: installing ${missing[*]} with apt-get (once)" >&2
export DEBIAN_FRONTEND=noninteractive
if ! apt-get install -y -qq "${missing[@]}" >/dev/null 2>&1; then
    # The package lists may be missing or stale (a fresh machine): refresh them and try again.
    apt-get update -qq
    apt-get install -y -qq "${missing[@]}" >/dev/null
fi

for pair in "$@"; do
    program="${pair%%:*}"
    if ! present "${program}"; then
        echo "ensure_debian_packages: apt-get finished but ${program} is still missing" >&2
        exit 1
    fi
done
