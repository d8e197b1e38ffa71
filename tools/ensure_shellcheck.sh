#!/usr/bin/env bash
# Make sure shellcheck is installed (the tests lint every generated launch script with it).
# Idempotent: does nothing when it is already on PATH; otherwise installs Debian's `shellcheck`
# package with apt-get, which needs root.
#   tools/ensure_shellcheck.sh     # exit 0 when `shellcheck` runs afterwards, 1 (with a reason) if not
set -euo pipefail

if command -v shellcheck >/dev/null 2>&1; then
    exit 0
fi

if [[ "$(id -u)" -ne 0 ]]; then
    echo "ensure_shellcheck: shellcheck is missing and installing it needs root:" >&2
    echo "  sudo apt-get install -y shellcheck" >&2
    exit 1
fi

if ! command -v apt-get >/dev/null 2>&1; then
    echo "ensure_shellcheck: shellcheck is missing and there is no apt-get to install it" >&2
    exit 1
fi

echo "ensure_shellcheck: installing shellcheck with apt-get (once)" >&2
export DEBIAN_FRONTEND=noninteractive
if ! apt-get install -y -qq shellcheck >/dev/null 2>&1; then
    # The package lists may be missing or stale (a fresh container): refresh them and try again.
    apt-get update -qq
    apt-get install -y -qq shellcheck >/dev/null
fi

if ! command -v shellcheck >/dev/null 2>&1; then
    echo "ensure_shellcheck: apt-get finished but shellcheck is still missing" >&2
    exit 1
fi
echo "ensure_shellcheck: $(shellcheck --version | sed -n 2p)" >&2
