#!/usr/bin/env bash
# The GPU checklist, as one script for a lent GPU machine that is ours for a few minutes:
#   1. bring-up: the environment, then tests/unit/test_gpu.py (flash varlen attention against the CPU
#      reference; the tiny config trains on CUDA in bf16 autocast);
#   2. MFU: python -m distlab.bench.mfu_ladder on the qwen2.5-0.5b-random preset, from its reference rung (4:
#      the best of the ladder's first rungs) through whole-block compile, chunked cross entropy, micro-batch 16
#      and bf16 weights with an fp32 master copy; each rung logs into rungN/ as it runs;
#   3. chapters' gpu profiles, in order, while time is left;
#   4. distlab vs HF Trainer vs TRL on the same preset (python -m distlab.bench.trainer_vs_hf --device cuda).
# Each step has a time box (its cap, or what is left of the budget) and its own log; a failed step is
# reported and the next one runs. Everything lands in $OUT/gpu_results.tgz.
#
#   OUT=build/gpu bash tools/gpu_session.sh [budget seconds, default 570]
#   ONLY="gpu_tests mfu_ladder" LADDER_ARGS="--from-rung 6" bash tools/gpu_session.sh 240   # some steps only
#   ONLY=mfu_ladder LADDER_ARGS="--preset-row d20" bash tools/gpu_session.sh 360    # nanochat d20's shape
#
# LADDER_ARGS come after the ladder's own arguments, so they override them. PYTHON (default python3) runs
# every step. Wheels for packages the machine lacks (or has at other versions than requirements.lock) may sit
# in $WHEELS (default .whl/, an ignored folder); they are installed to /tmp/site and put first on PYTHONPATH.
# The ladder's dry run on a CPU, at the tiny shape: tests/launches/test_gpu_session_dry_run.py.
set -u
out=${OUT:-build/gpu}
budget=${1:-570}
start=$SECONDS
work=$(mktemp -d)
mkdir -p "$out"
export PYTHON=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export PYTHONPATH="$PWD/lib"
wheels=${WHEELS:-.whl}
if compgen -G "$wheels/*.whl" > /dev/null; then
  if "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      "$wheels"/*.whl; then
    export PYTHONPATH="/tmp/site:$PYTHONPATH"
  else
    echo "== wheels: install failed; going on with the machine's packages"
  fi
fi

box() {  # box CAP: the seconds a step capped at CAP may run now, min(CAP, what is left of the budget less 10)
  local left=$(( budget - (SECONDS - start) - 10 ))
  echo $(( left < $1 ? left : $1 ))
}

step() {  # step NAME CAP COMMAND...: run COMMAND for at most box(CAP) seconds, logged to $work/NAME.log
  local name=$1 cap t0 rc
  cap=$(box "$2")
  shift 2
  if [[ -n "${ONLY:-}" && " $ONLY " != *" $name "* ]]; then
    return
  fi
  if (( cap < 20 )); then
    echo "== $name: skipped, ${cap}s left"
    return
  fi
  echo "== $name (up to ${cap}s): $*"
  t0=$SECONDS
  timeout -k 5 "$cap" "$@" > "$work/$name.log" 2>&1
  rc=$?
  echo "== $name: exit $rc after $(( SECONDS - t0 ))s"
  tail -n "${TAIL_LINES:-14}" "$work/$name.log"
}

# shellcheck disable=SC2016  # $PYTHON is the inner bash's to expand (exported above)
step environment 40 bash -c 'nvidia-smi; "$PYTHON" -c "import torch, transformers, peft
print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, torch.cuda.get_device_name())
print(\"transformers\", transformers.__version__, \"peft\", peft.__version__)"'
step gpu_tests 120 "$PYTHON" -m pytest -q -p no:cacheprovider tests/unit/test_gpu.py
TAIL_LINES=40 step profile 90 "$PYTHON" tools/gpu_profile_steps.py
# The ladder: 90-s boxes per rung (a 0.5B rung is ~30 s of start-up, then its compile and 20 steps), in a budget of
# its step's box less 25 s (the table's printing and saving, the kill's grace), so that it skips a rung it has no
# time left to finish instead of being cut off inside one. Every rung's log is in the tarball, under rungN/.
ladder_box=$(box 330)
# shellcheck disable=SC2086  # LADDER_ARGS is a list of words
TAIL_LINES=40 step mfu_ladder "$ladder_box" "$PYTHON" -m distlab.bench.mfu_ladder --from-rung 4 --steps 20 \
  --warmup 6 --timeout 90 --budget $(( ladder_box - 25 )) --out "$work" ${LADDER_ARGS:-}
for chapter in ${CHAPTERS:-00 01}; do
  step "chapter_$chapter" 240 "$PYTHON" -m distlab.publish.regenerate --profile gpu --only "$chapter" --force \
    --out-dir "$work/notebooks" --figures-dir "$work/figures" --work-dir "$work/regenerate"
done
step trainer_vs_hf 150 "$PYTHON" -m distlab.bench.trainer_vs_hf --device cuda --model qwen2.5-0.5b-random \
  --steps 25 --warmup 8 --rounds 1 --csv "$work/trainer_vs_hf.csv"
if tar czf "$out/gpu_results.tgz" -C "$work" .; then
  rm -rf "$work"  # the temporary folder goes once its tarball is made; a failed tar leaves it, and says where
  echo "== saved $out/gpu_results.tgz ($(( SECONDS - start ))s in all)"
else
  echo "== tar failed; the results are in $work"
fi
