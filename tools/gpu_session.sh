#!/usr/bin/env bash
# The GPU checklist, as one script for a lent GPU machine that is ours for a few minutes:
#   1. bring-up: the environment, then tests/unit/test_gpu.py (flash varlen attention against the CPU
#      reference; the tiny config trains on CUDA in bf16 autocast);
#   2. MFU: python -m distlab.bench.mfu_ladder on the qwen2.5-0.5b-random preset;
#   3. chapters' gpu profiles, in order, while time is left;
#   4. distlab vs HF Trainer vs TRL on the same preset (python -m distlab.bench.trainer_vs_hf --device cuda).
# Each step has a time box (its cap, or what is left of the budget) and its own log; a failed step is
# reported and the next one runs. Everything lands in $OUT/gpu_results.tgz.
#
#   OUT=build/gpu bash tools/gpu_session.sh [budget seconds, default 570]
#   ONLY="gpu_tests mfu_ladder" LADDER_ARGS="--from-rung 4" bash tools/gpu_session.sh 240   # some steps only
#
# Wheels for packages the machine lacks (or has at other versions than requirements.lock) may sit in
# .whl/ (an ignored folder); they are installed to /tmp/site and put first on PYTHONPATH.
set -u
out=${OUT:-build/gpu}
budget=${1:-570}
start=$SECONDS
work=$(mktemp -d)
mkdir -p "$out"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export PYTHONPATH="$PWD/lib"
if compgen -G ".whl/*.whl" > /dev/null; then
  if python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl; then
    export PYTHONPATH="/tmp/site:$PYTHONPATH"
  else
    echo "== wheels: install failed; going on with the machine's packages"
  fi
fi

step() {  # step NAME CAP COMMAND...: run COMMAND for at most min(CAP, time left), logged to $work/NAME.log
  local name=$1 cap=$2 left t0 rc
  shift 2
  if [[ -n "${ONLY:-}" && " $ONLY " != *" $name "* ]]; then
    return
  fi
  left=$(( budget - (SECONDS - start) - 10 ))
  (( left < cap )) && cap=$left
  if (( cap < 20 )); then
    echo "== $name: skipped, ${left}s left"
    return
  fi
  echo "== $name (up to ${cap}s): $*"
  t0=$SECONDS
  timeout -k 5 "$cap" "$@" > "$work/$name.log" 2>&1
  rc=$?
  echo "== $name: exit $rc after $(( SECONDS - t0 ))s"
  tail -n "${TAIL_LINES:-14}" "$work/$name.log"
}

step environment 40 bash -c 'nvidia-smi; python3 -c "import torch, transformers, peft
print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, torch.cuda.get_device_name())
print(\"transformers\", transformers.__version__, \"peft\", peft.__version__)"'
step gpu_tests 120 python3 -m pytest -q -p no:cacheprovider tests/unit/test_gpu.py
TAIL_LINES=40 step profile 90 python3 tools/gpu_profile_steps.py
# shellcheck disable=SC2086  # LADDER_ARGS is a list of words
TAIL_LINES=30 step mfu_ladder 330 python3 -m distlab.bench.mfu_ladder --steps 25 --warmup 8 --timeout 120 \
  --out "$work" ${LADDER_ARGS:-}
for chapter in ${CHAPTERS:-00 01}; do
  step "chapter_$chapter" 240 python3 -m distlab.publish.regenerate --profile gpu --only "$chapter" --force \
    --out-dir "$work/notebooks" --figures-dir "$work/figures" --work-dir "$work/regenerate"
done
step trainer_vs_hf 150 python3 -m distlab.bench.trainer_vs_hf --device cuda --model qwen2.5-0.5b-random \
  --steps 25 --warmup 8 --rounds 1 --csv "$work/trainer_vs_hf.csv"
tar czf "$out/gpu_results.tgz" -C "$work" . && echo "== saved $out/gpu_results.tgz ($(( SECONDS - start ))s in all)"
