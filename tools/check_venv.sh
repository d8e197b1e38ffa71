#!/usr/bin/env bash
# make env's first step, before any pip: VENV must be a virtual environment whose python runs and has pip.
# A missing VENV is created here with PYTHON. Anything else wrong ends with ONE line on stderr saying how to
# fix it, and exit status 2, instead of pip's or python's traceback (or make's bare "No such file or
# directory") further on. Nothing the user made is deleted: only a venv this script itself began and could
# not finish is removed again.
#
#   bash tools/check_venv.sh VENV PYTHON        (the Makefile passes $(VENV) and $(PYTHON))
#
# The cases, each with its fix: no PYTHON, or one older than 3.10 (pyproject's requires-python); a venv whose
# bin/python is a dangling link (the Python it was made from was removed or upgraded) or does not run; a
# half-made venv (no bin/python, or no pip: on Debian/Ubuntu `python3 -m venv` stops there when python3-venv
# is missing, "ensurepip is not available").
set -uo pipefail

if [[ $# -ne 2 ]]; then
  echo "usage: bash tools/check_venv.sh VENV PYTHON" >&2
  exit 2
fi
venv=$1
python=$2
py=$venv/bin/python
remake="rm -rf $venv && make env"

fail() {
  echo "make env: $*" >&2
  exit 2
}

# The last non-empty line of a command's output: the error itself, without the traceback above it.
last_line() {
  grep -v '^[[:space:]]*$' <<<"$1" | tail -n 1
}

# Debian and Ubuntu split venv's pip bootstrap (ensurepip) into python3.X-venv.
venv_package() {
  echo "python$1-venv"
}

check_python() {
  command -v "$python" >/dev/null 2>&1 ||
    fail "no $python on PATH: install Python 3.10 or newer (Debian/Ubuntu: sudo apt-get install python3 python3-venv; macOS: python.org or Homebrew), or name one: make env PYTHON=/path/to/python3"
  local out
  out=$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>&1) ||
    fail "$python does not run ($(last_line "$out")): install Python 3.10 or newer, or name another: make env PYTHON=/path/to/python3"
  version=$out
  "$python" -c 'import sys; sys.exit(sys.version_info < (3, 10))' ||
    fail "$python is Python $version; distlab needs 3.10 or newer: make env PYTHON=python3.12 (or another 3.10+)"
}

create_venv() {
  check_python
  local out existed=0
  [[ -d $venv ]] && existed=1
  out=$("$python" -m venv "$venv" 2>&1)
  local rc=$?
  if [[ $rc -eq 0 ]] && "$py" -c 'import pip' >/dev/null 2>&1; then
    return 0
  fi
  # Half-made (venv stops after bin/python when it cannot bootstrap pip): this script began it, so it goes
  # again, and the next `make env` starts clean rather than tripping over it.
  if [[ $existed -eq 1 ]]; then
    find "$venv" -mindepth 1 -delete 2>/dev/null
  else
    rm -rf "$venv"
  fi
  if grep -q ensurepip <<<"$out"; then
    fail "$python -m venv cannot install pip (ensurepip is not available): on Debian/Ubuntu install $(venv_package "$version") (sudo apt-get install $(venv_package "$version")) and run make env again; without root: uv venv --seed $venv, then make env"
  fi
  fail "$python -m venv $venv failed: $(last_line "$out")"
}

if [[ ! -e $venv && ! -L $venv ]]; then
  create_venv
  exit 0
fi
[[ -d $venv ]] || fail "$venv exists and is not a folder: move it away, or use another: make env VENV=<folder>"
if [[ -z $(ls -A "$venv") ]]; then
  create_venv
  exit 0
fi
if [[ -L $py && ! -e $py ]]; then
  fail "$venv is broken: $py points to $(readlink "$py"), which no longer exists (the Python it was made from was removed or upgraded); make it again: $remake"
fi
[[ -e $py ]] || fail "$venv is not a finished virtual environment (no bin/python); make it again: $remake"
out=$("$py" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>&1) ||
  fail "$py does not run ($(last_line "$out")); make it again: $remake"
version=$out
if ! "$py" -c 'import pip' >/dev/null 2>&1; then
  fail "$venv has no pip (a half-made venv: on Debian/Ubuntu python -m venv stops there without $(venv_package "$version")); install it (sudo apt-get install $(venv_package "$version")) and make it again: $remake"
fi
exit 0
