#!/usr/bin/env bash
# The GPU-ready step's tests (tests/unit/test_gpu_ready_step.py: no host read inside a step, each block compiled
# whole, no recompile over document layouts) under another PyTorch release, e.g. the GPU image's 2.11: Dynamo and
# the varlen attention signature change between releases, so a step that compiles cleanly on the lock's torch may
# not on the one a GPU machine has.
#
#   bash tools/check_other_torch.sh 2.11.0
#
# A throwaway venv, build/torch-<version>, holds only that torch; the project's .venv (every other package) and
# lib/ follow it on sys.path, so the tests run the same code with the other torch. Needs `make env` first. pip
# takes the wheel from the package index: on Linux x86_64 PyPI's is the CUDA build (about 2.6 GB with its
# nvidia-* packages); it runs on the CPU all the same. Set PIP_FIND_LINKS to a folder of wheels to install offline.
set -euo pipefail
version="${1:?usage: bash tools/check_other_torch.sh <torch version, e.g. 2.11.0>}"
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || { echo "check_other_torch: no .venv here: run make env first" >&2; exit 2; }
venv="build/torch-${version}"
if [ ! -x "${venv}/bin/python" ]; then
  # the .venv's own interpreter, so both venvs share one Python minor version (the .venv's packages must load)
  base="$(.venv/bin/python -c 'import sys; print(sys._base_executable)')"
  "${base}" -m venv "${venv}"
  "${venv}/bin/python" -m pip install -q "torch==${version}"
fi
purelib="$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
venv_purelib="$("${venv}/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
# after the venv's own site-packages, so its torch wins over the .venv's
printf '%s\n' "${PWD}/lib" "${purelib}" > "${venv_purelib}/zz_distlab_main.pth"
"${venv}/bin/python" -c 'import torch; print(f"check_other_torch: torch {torch.__version__} from {torch.__file__}")'
"${venv}/bin/python" -m pytest -q -p no:cacheprovider -rA tests/unit/test_gpu_ready_step.py
