#!/usr/bin/env bash
# Make sure Debian's chromium is installed (the book's site check drives it with Playwright;
# Playwright's own browser download is never used). Idempotent: does nothing when it is there.
#   tools/ensure_chromium.sh            # exit 0 when /usr/bin/chromium exists afterwards
# Override the path with CHROMIUM=/path/to/chromium.
set -euo pipefail

CHROMIUM="${CHROMIUM:-/usr/bin/chromium}"

if [[ -x "${CHROMIUM}" ]]; then
    exit 0
fi

if [[ "$(id -u)" -ne 0 ]]; then
    echo "ensure_chromium: ${CHROMIUM} is missing and installing it needs root:" >&2
    echo "  sudo apt-get install -y chromium" >&2
    exit 1
fi

if ! command -v apt-get >/dev/null 2>&1; then
    echo "ensure_chromium: ${CHROMIUM} is missing and there is no apt-get to install it" >&2
    exit 1
fi

echo "ensure_chromium: installing chromium with apt-get (once)" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq chromium >/dev/null

if [[ ! -x "${CHROMIUM}" ]]; then
    echo "ensure_chromium: apt-get finished but ${CHROMIUM} is still missing" >&2
    exit 1
fi
echo "ensure_chromium: $("${CHROMIUM}" --version 2>/dev/null || echo "${CHROMIUM}")" >&2
